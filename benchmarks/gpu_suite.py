"""Every GPU check the project needs, in one call (< 9 min on one H100 at the released sizes, random weights).

    python benchmarks/gpu_suite.py --out gpu-results            # on the GPU machine: writes JSON + markdown there
    python benchmarks/gpu_suite.py --tiny --device cpu --out x  # here: the same steps at toy sizes, GPU-only ones
                                                                # marked skipped (a smoke run; tests run it)

Steps, each recorded with its numbers and a PASS / FAIL / SKIPPED verdict:

1. ``graphed-decode``: the scheduler's CUDA-graph decode step gives the eager scheduler's tokens (fp32, 8 sessions,
   sizes 1..8 rows), and the memory its graph pools hold.
2. ``packed-dit``: packed token-to-wave batching (several sessions' chunks in one DiT call per Euler step) gives
   each session the mel it gets alone, fp32 (tolerance STREAM_MEL_ATOL = 1e-5), and how long one packed call of
   8 sessions takes against 8 calls one at a time.
3. ``compiled-dit``: the packed DiT step compiled per shape bucket (``Engine(compile_dit=True)``; on CUDA
   ``mode="reduce-overhead"``, i.e. captured in CUDA graphs) against the eager step on the same buckets, fp32
   (STREAM_MEL_ATOL), with the compile time and the time of one packed call each way.
4. ``bf16``: bf16 against fp32 on the same tokens: flow mel relative error (bound 5e-2: bf16 operands land at
   1e-3..1e-2) and LLM log-prob max difference (reported).
5. ``ablation``: ``benchmarks/benchmark_performance.py --ablation`` (every optimisation switched off in turn, the
   reference strategy beside them), streaming, 250 fixed tokens, closed loop 1 and 16 clients and open-loop
   Poisson arrivals, bf16; its table is copied into the markdown.
6. ``memory-64``: 64 concurrent streams on the fast engine (bf16): peak memory, memory per stream, the flow-cache
   bytes at the end of the run and the fallbacks to recompute; and the flow-cache budget arithmetic for 64 x 30 s.
7. ``export`` (optional): ``--export-step module:function`` is imported and called as ``function(bundle_dir,
   device)``; it returns a dict of numbers and ``"ok": bool`` (the export backends' GPU check, once one exists).

Any FAIL makes the exit status 1 and prints ``MISMATCH`` lines last. Results: ``<out>/gpu_suite.json`` and
``<out>/gpu_suite.md``.

Carrying what the GPU image lacks (see /work/.library/device/README.md, "Notes", and KINDS.md's package list):
the image has torch, numpy, pyyaml, safetensors, tokenizers, onnx and onnxruntime; the suite also imports soundfile
and soxr (audio), and text normalisation may import wetext, kaldifst and inflect (with typeguard and
more-itertools); av (encoding) is not imported. Here, in the repository root:

    echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \\
        -d .whl soundfile soxr wetext==0.1.8 kaldifst inflect==7.3.1 typeguard more-itertools

(pure-Python wheels such as wetext and inflect come as ``py3-none-any``; add ``--platform any`` if pip asks), then
run with ``carry: [".whl"]`` and the command

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \\
        .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD && PYTHONUNBUFFERED=1 python3 benchmarks/gpu_suite.py --out $OUT
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benchmark modules
import benchmark_performance as bench

from cosyvoice.bundle import ModelBundle, validate_model_dir
from cosyvoice.engine import Engine, LLMScheduler, Ticket
from cosyvoice.flow import FlowStream, extend_packed
from cosyvoice.frontend.frontend import CosyVoiceFrontend
from cosyvoice.frontend.prompts import zero_shot_prompt_text
from cosyvoice.settings import Limits
from cosyvoice.tools.make_tiny_bundle import make_tiny_bundle
from cosyvoice.tools.parity.tolerances import STREAM_MEL_ATOL

BF16_MEL_REL = 5e-2


class Suite:
    def __init__(self, out: Path, device: torch.device, bundle: ModelBundle, tiny: bool) -> None:
        self.out, self.device, self.bundle, self.tiny = out, device, bundle, tiny
        self.results: dict[str, dict] = {}
        self.markdown: list[str] = []

    def step(self, name: str, fn: Callable[[], dict], needs_cuda: bool = False) -> None:
        start = time.perf_counter()
        if needs_cuda and self.device.type != "cuda":
            result = {"verdict": "SKIPPED", "why": "needs CUDA"}
        else:
            try:
                result = fn()
                result["verdict"] = "PASS" if result.pop("ok") else "FAIL"
            except Exception as exc:
                result = {"verdict": "FAIL", "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
        result["seconds"] = round(time.perf_counter() - start, 1)
        self.results[name] = result
        print(f"[{result['verdict']}] {name} ({result['seconds']} s): "
              f"{ {k: v for k, v in result.items() if k not in ('trace', 'table')} }", flush=True)
        self.write()

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "gpu_suite.json").write_text(json.dumps(self.results, indent=2, default=str))
        lines = ["| step | verdict | seconds | numbers |", "| --- | --- | --- | --- |"]
        for name, r in self.results.items():
            numbers = ", ".join(f"{k} {v}" for k, v in r.items() if k not in ("verdict", "seconds", "trace", "table"))
            lines.append(f"| {name} | {r['verdict']} | {r['seconds']} | {numbers} |")
        tables = [f"\n### {name}\n\n{r['table']}" for name, r in self.results.items() if "table" in r]
        (self.out / "gpu_suite.md").write_text("\n".join(lines) + "\n" + "\n".join(tables) + "\n")

    # ------------------------------------------------------------------ steps

    def graphed_decode(self) -> dict:
        lm = self.bundle.load_llm(self.device, torch.float32)
        prompt = lm.speech_embedding.weight[:40].detach()
        runs = {}
        for graphs in (False, True):
            scheduler = LLMScheduler(lm, rows=8, max_positions=40 + 64, cuda_graphs=graphs)
            tokens: dict[int, list[int]] = {i: [] for i in range(8)}
            done = threading.Semaphore(0)
            before = torch.cuda.memory_allocated(self.device)
            for i in range(8):
                scheduler.submit(Ticket(lm.generate_job(prompt, 16 + 6 * i, 16 + 6 * i, ban_stop=True), 100 + i,
                                        tokens[i].extend, lambda _e, d=done: d.release()))
            for _ in range(8):
                done.acquire()
            runs[graphs] = (tokens, torch.cuda.memory_allocated(self.device) - before,
                            scheduler.runner.graphed is not None)
            scheduler.close()
        equal = runs[False][0] == runs[True][0]
        return {"ok": equal and runs[True][2], "tokens_equal": equal, "graphs_captured": runs[True][2],
                "graph_pool_mib": round((runs[True][1] - runs[False][1]) / 2**20, 1)}

    def packed_dit(self) -> dict:
        flow = self.bundle.load_flow(self.device, torch.float32)
        vocab, n = flow.cfg.vocab_size, 8

        def streams() -> list[tuple[FlowStream, torch.Tensor]]:
            out = []
            for seed in range(n):
                g = torch.Generator().manual_seed(seed)
                prompt = 25 + 5 * seed
                out.append((FlowStream(flow, torch.randint(0, vocab, (1, prompt), generator=g).to(self.device),
                                       torch.randn(1, 2 * prompt, flow.cfg.output_size, generator=g).to(self.device),
                                       torch.randn(1, flow.cfg.spk_embed_dim, generator=g).to(self.device)),
                            torch.randint(0, vocab, (1, 128), generator=g).to(self.device)))
            return out

        def chunk(stream: FlowStream, tokens: torch.Tensor, rnd: int) -> torch.Tensor:
            """Round 0: the first chunk (hop padded to the chunk grid, + look-ahead); round 1: the next 50 tokens."""
            first = 25 + (-stream.prompt_token.shape[1] % 25)
            return tokens[:, :first + 3] if rnd == 0 else tokens[:, first + 3:first + 53]

        def sync() -> None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

        alone_streams, packed_streams = streams(), streams()
        alone, packed, times = [], [], {}
        for rnd in range(2):  # the first chunk, then the second on top of the cache
            sync()
            start = time.perf_counter()
            alone += [stream.inference(chunk(stream, tokens, rnd), finalize=False) for stream, tokens in alone_streams]
            sync()
            times["alone"] = time.perf_counter() - start
            steps = [stream.begin(chunk(stream, tokens, rnd), finalize=False) for stream, tokens in packed_streams]
            start = time.perf_counter()
            packed += extend_packed(steps)
            sync()
            times["packed"] = time.perf_counter() - start
        worst = max(float((a - p).abs().max()) for a, p in zip(alone, packed, strict=True))
        return {"ok": worst <= STREAM_MEL_ATOL, "sessions": n, "mel_max_abs": worst, "atol": STREAM_MEL_ATOL,
                "second_chunk_ms_one_at_a_time": round(1e3 * times["alone"], 1),
                "second_chunk_ms_packed": round(1e3 * times["packed"], 1)}

    def compiled_dit(self) -> dict:
        from cosyvoice.engine.graphs import CompiledDiT, dit_buckets

        flow = self.bundle.load_flow(self.device, torch.float32)
        vocab = flow.cfg.vocab_size

        def run(trunk=None) -> tuple[list[torch.Tensor], float]:
            streams = []
            for seed in range(4):
                g = torch.Generator().manual_seed(seed)
                prompt = 25 + 7 * seed
                streams.append((FlowStream(flow, torch.randint(0, vocab, (1, prompt), generator=g).to(self.device),
                                           torch.randn(1, 2 * prompt, flow.cfg.output_size, generator=g)
                                           .to(self.device),
                                           torch.randn(1, flow.cfg.spk_embed_dim, generator=g).to(self.device)),
                                torch.randint(0, vocab, (1, 200), generator=g).to(self.device)))
            out, seconds = [], 0.0
            for rnd in range(3):
                steps = []
                for stream, tokens in streams:
                    first = 25 + (-stream.prompt_token.shape[1] % 25) + 3
                    lo, hi = (0, first) if rnd == 0 else (first + 50 * (rnd - 1), first + 50 * rnd)
                    steps.append(stream.begin(tokens[:, lo:hi], finalize=False))
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                start = time.perf_counter()
                out += extend_packed(steps, trunk, dit_buckets)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                seconds = time.perf_counter() - start  # the last round: compiled by then
            return out, seconds

        eager, t_eager = run()
        compiled = CompiledDiT(self.device, backend="aot_eager" if self.tiny else "inductor")
        start = time.perf_counter()
        run(compiled.trunk)  # compiles (captures) every bucket
        t_compile = time.perf_counter() - start
        got, t_compiled = run(compiled.trunk)
        worst = max(float((a - b).abs().max()) for a, b in zip(eager, got, strict=True))
        return {"ok": worst <= STREAM_MEL_ATOL, "mel_max_abs": worst, "atol": STREAM_MEL_ATOL,
                "compile_s": round(t_compile, 1), "packed_call_ms_eager": round(1e3 * t_eager, 1),
                "packed_call_ms_compiled": round(1e3 * t_compiled, 1)}

    def bf16(self) -> dict:
        full, half = (self.bundle.load_flow(self.device, d) for d in (torch.float32, torch.bfloat16))
        g = torch.Generator().manual_seed(0)
        vocab = full.cfg.vocab_size
        args = dict(token=torch.randint(0, vocab, (1, 150), generator=g), token_len=150,
                    prompt_token=torch.randint(0, vocab, (1, 50), generator=g), prompt_token_len=50,
                    prompt_feat=torch.randn(1, 100, full.cfg.output_size, generator=g), prompt_feat_len=100,
                    embedding=torch.randn(1, full.cfg.spk_embed_dim, generator=g), streaming=True, finalize=True)
        a, b = full.inference(**args), half.inference(**args)
        rel = float((a - b).norm() / a.norm())
        lms = [self.bundle.load_llm(self.device, d) for d in (torch.float32, torch.bfloat16)]
        emb = lms[0].speech_embedding.weight[:40].detach()[None]
        logps = []
        for lm in lms:
            cache = lm.llm.new_cache(1, 64)
            with torch.inference_mode():
                logps.append(lm.decode_step(emb.to(lm.speech_embedding.weight.dtype), 0, cache)[1].float())
        return {"ok": rel <= BF16_MEL_REL, "flow_mel_rel_err": rel, "bound": BF16_MEL_REL,
                "llm_logp_max_abs": float((logps[0] - logps[1]).abs().max())}

    def ablation(self) -> dict:
        argv = ["--model-dir", str(self.bundle.root), "--device", str(self.device), "--ablation", "--modes", "stream",
                "--fixed-tokens", "30" if self.tiny else "250", "--concurrency", "1", "2" if self.tiny else "16",
                "--poisson", "4" if self.tiny else "8", "--arrivals", "3" if self.tiny else "24",
                "--dtype", "fp32" if self.device.type != "cuda" else "bf16"]
        report = bench.main(argv)
        rows = [bench.Row(**r) for r in report["rows"]]
        return {"ok": bool(rows), "rows": len(rows), "table": bench.markdown_table(rows),
                "settings": report["settings"]}

    def memory_64(self) -> dict:
        streams = 4 if self.tiny else 64
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        limits = Limits(max_sessions=streams)
        frontend = CosyVoiceFrontend(self.bundle, limits)
        llm = self.bundle.load_llm(self.device, dtype, frontend.tokenizer.end_of_prompt_id)
        flow, hift = self.bundle.load_flow(self.device, dtype), self.bundle.load_hift(self.device)
        with tempfile.TemporaryDirectory() as tmp:
            voice = frontend.voice(zero_shot_prompt_text("A prompt recording of three seconds."),
                                   bench._prompt(Path(tmp) / "p.wav"))
        inp = frontend.model_input(bench.TEXT, voice)
        engine = Engine(self.bundle.config, llm, flow, hift, self.device, limits, t2w_batch=8,
                        fixed_tokens=30 if self.tiny else 250)
        held = [0]

        def watch(stop: threading.Event) -> None:
            while not stop.wait(0.05):
                held[0] = max(held[0], engine.flow_cache_bytes)

        stop = threading.Event()
        watcher = threading.Thread(target=watch, args=(stop,))
        watcher.start()
        with bench._PeakMemory(self.device) as mem:
            results, wall, _ = bench.measure(engine, inp, True, streams, 1)
        stop.set()
        watcher.join()
        per_frame = FlowStream.bytes_per_frame(flow)
        frames_30s = 30 * self.bundle.config.sample_rate // 480  # 50 mel frames per second
        engine.close()
        return {"ok": len(results) == streams and engine.active_sessions == 0, "streams": streams,
                "peak_mib": round(mem.used_mib), "mib_per_stream": round(mem.used_mib / streams, 1),
                "flow_cache_peak_mib": round(held[0] / 2**20, 1), "flow_cache_fallbacks": engine.flow_cache_fallbacks,
                "audio_s_per_wall_s": round(sum(r["audio"] for r in results) / wall, 2),
                "flow_cache_30s_x64_gib (arithmetic)": round(64 * frames_30s * per_frame / 2**30, 1),
                "flow_cache_budget_gib": round(engine.flow_cache_mb / 1024, 1)}

    def export(self, spec: str) -> dict:
        module, _, function = spec.partition(":")
        return dict(getattr(importlib.import_module(module), function)(self.bundle.root, self.device))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for gpu_suite.json and gpu_suite.md")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="toy sizes (a smoke run of the script itself)")
    parser.add_argument("--steps", nargs="*", help="only these steps")
    parser.add_argument("--export-step", help="module:function of the export backends' GPU check")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here: run on the GPU machine, or --tiny --device cpu for a smoke run", file=sys.stderr)
        return 2
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 checks are float32, not TF32
    elif args.tiny:
        torch.set_num_threads(1)  # the CPU smoke run: toy sizes run fastest on one thread
    work = bench.scratch_dir("gpu-suite-")
    dims = {} if args.tiny else {"dims": bench.RELEASED_DIMS}
    bundle_dir = make_tiny_bundle(work / "bundle", seed=0, **dims)
    suite = Suite(args.out, device, validate_model_dir(bundle_dir), args.tiny)
    steps: list[tuple[str, Callable[[], dict], bool]] = [
        ("graphed-decode", suite.graphed_decode, True), ("packed-dit", suite.packed_dit, False),
        ("compiled-dit", suite.compiled_dit, False), ("bf16", suite.bf16, True),
        ("ablation", suite.ablation, False), ("memory-64", suite.memory_64, False)]
    if args.export_step:
        steps.append(("export", lambda: suite.export(args.export_step), False))
    started = time.perf_counter()
    for name, fn, needs_cuda in steps:
        if not args.steps or name in args.steps:
            suite.step(name, fn, needs_cuda)
    failed = [name for name, r in suite.results.items() if r["verdict"] == "FAIL"]
    print(f"\n{(args.out / 'gpu_suite.md').read_text()}\ntotal {time.perf_counter() - started:.0f} s")
    for name in failed:
        print(f"MISMATCH: {name}: {suite.results[name]}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
