"""The fast CPU path against torch fp32, in one run: per-stage cost per second of audio and end to end.

    python benchmarks/benchmark_cpu.py                      # released sizes, random weights (the issue-15 run)
    python benchmarks/benchmark_cpu.py --tiny               # a smoke run in a minute
    python benchmarks/benchmark_cpu.py --golden ../shared/golden   # also the int8 quality bounds

Paths (``CosyVoice3(backend=...)`` of the same bundle, the batched engine, one request, streamed, exactly
``--fixed-tokens`` speech tokens, the same seed):
- ``torch``: every stage in torch fp32 (today's CPU path);
- ``fast``: ``backend="onnxruntime-int8"`` (what ``auto`` picks on a machine without a GPU): the DiT in
  onnxruntime with int8 per-frame matmuls, the vocoder's decoder in onnxruntime fp32, the LLM in torch fp32.

Stages, in seconds of compute per second of audio: the LLM (prefill of a 64-position prompt plus the fixed
tokens, the scheduler alone), the flow (every ``FlowStream.inference`` of the end-to-end run) and the
vocoder (every ``HiFTStream.inference``), timed inside the run; LLM and token-to-wave overlap in the engine,
so end to end is less than their sum. ``llm int8`` is torch's dynamic int8 quantisation of the LLM's linears,
measured for the record. Quality (``--golden``): int8 against fp32 on the golden inputs: the DiT's mel
(whole and streamed), the LLM's teacher-forced log-probs.
The machine's load average (``/proc/loadavg``) is recorded before and after: other work shares the cores.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmark_performance import TEXT, _git_commit, _prompt, bench_bundle, llm_only

from cosyvoice.backends import attach_flow
from cosyvoice.backends.quant import quantize_llm
from cosyvoice.bundle import validate_model_dir
from cosyvoice.cli.cosyvoice import CosyVoice3
from cosyvoice.flow import FlowStream
from cosyvoice.frontend.prompts import zero_shot_prompt_text
from cosyvoice.hifigan import HiFTStream
from cosyvoice.settings import Limits

PATHS = {"torch": "torch", "fast": "onnxruntime-int8"}


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


class StageTimer:
    """Sums the wall time of FlowStream / HiFTStream calls (class methods wrapped for this benchmark only)."""

    def __init__(self) -> None:
        self.seconds = {"flow": 0.0, "vocoder": 0.0}
        self._saved: list[tuple[type, str, Callable]] = []

    def __enter__(self) -> StageTimer:
        for cls, stage in ((FlowStream, "flow"), (HiFTStream, "vocoder")):
            original = cls.inference
            self._saved.append((cls, "inference", original))

            def timed(obj, *args, _original=original, _stage=stage, **kwargs):
                start = time.perf_counter()
                try:
                    return _original(obj, *args, **kwargs)
                finally:
                    self.seconds[_stage] += time.perf_counter() - start

            cls.inference = timed
        return self

    def __exit__(self, *exc: object) -> None:
        for cls, name, original in self._saved:
            setattr(cls, name, original)


def end_to_end(tts: CosyVoice3, prompt_wav: Path, fixed: int) -> dict[str, float]:
    voice = tts.frontend.voice(zero_shot_prompt_text("A prompt recording of three seconds."), prompt_wav)
    inp = tts.frontend.model_input(TEXT, voice)
    engine = tts.engine

    def run() -> dict[str, float]:
        start = time.perf_counter()
        first, samples = None, 0
        for chunk in engine.synthesize(inp, stream=True, seed=0):
            first = first if first is not None else time.perf_counter() - start
            samples += chunk.pcm.numel()
        total = time.perf_counter() - start
        audio = samples / engine.sample_rate
        return {"first_audio_s": first or total, "total_s": total, "audio_s": audio, "rtf": total / audio}

    engine.fixed_tokens = min(fixed, 30)
    run()  # a short warm-up: onnxruntime's first-run allocations, torch's kernels, noise buffers
    engine.fixed_tokens = fixed
    with StageTimer() as timer:
        result = run()
    audio = result["audio_s"]
    result.update({f"{stage}_s_per_audio_s": s / audio for stage, s in timer.seconds.items()})
    result["prompt_tokens"] = int(inp.flow_prompt_speech_token.shape[1])
    return result


def llm_cost(llm: torch.nn.Module, fixed: int) -> float:
    """Seconds of LLM compute per second of audio (25 tokens per second), 64-position prefill included."""
    row = llm_only(llm, [1], fixed, torch.device("cpu"))[0]
    return 25.0 / row["tokens_per_s"]


@torch.inference_mode()
def quality(golden_dir: Path, bundle_dir: Path, work: Path) -> dict[str, dict[str, float]]:
    """int8 against fp32 on the golden inputs: the golden tiny bundle's weights, and ``bundle_dir``'s."""
    from safetensors.numpy import load_file

    flow_in = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in load_file(golden_dir / "flow.safetensors")
               .items() if k in ("token", "prompt_token", "prompt_feat", "embedding")}
    llm_in = {k: torch.from_numpy(np.ascontiguousarray(v)).reshape(-1).long()
              for k, v in load_file(golden_dir / "llm.safetensors").items()
              if k in ("text_tokens", "prompt_text_tokens", "prompt_speech_tokens", "forced_tokens")}
    local = work / "golden_bundle"
    if not local.exists():  # the ONNX export writes beside the checkpoints: never into the shared fixtures
        shutil.copytree(golden_dir / "tiny_bundle", local)
    out: dict[str, dict[str, float]] = {}
    for label, root in (("golden tiny bundle", local), ("benchmark bundle", bundle_dir)):
        bundle = validate_model_dir(root)
        fp32, int8 = bundle.load_flow(), attach_flow(bundle.load_flow(), bundle.root, "onnxruntime-int8", "cpu")
        tok, ptok, pfeat, emb = (flow_in[k] for k in ("token", "prompt_token", "prompt_feat", "embedding"))
        row: dict[str, float] = {}
        for streaming in (False, True):
            args = (tok, tok.shape[1], ptok, ptok.shape[1], pfeat, pfeat.shape[1], emb, streaming, True)
            ref, got = fp32.inference(*args), int8.inference(*args)
            name = "chunk_mask" if streaming else "full"
            row[f"mel_{name}_max_abs"] = float((ref - got).abs().max())
            row[f"mel_{name}_rel_rms"] = float((ref - got).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())
        mels = [FlowStream(m, ptok, pfeat, emb) for m in (fp32, int8)]
        half = tok.shape[1] // 2
        a = torch.cat([mels[0].inference(tok[:, :half], False), mels[0].inference(tok[:, half:], True)], dim=2)
        b = torch.cat([mels[1].inference(tok[:, :half], False), mels[1].inference(tok[:, half:], True)], dim=2)
        row["mel_flowstream_max_abs"] = float((a - b).abs().max())
        row["mel_amplitude_max"] = float(a.abs().max())
        del fp32, int8
        llm = bundle.load_llm()
        q = quantize_llm(copy.deepcopy(llm))
        lm_input = llm.build_lm_input(llm_in["text_tokens"], llm_in["prompt_text_tokens"],
                                      llm_in["prompt_speech_tokens"])
        fed = llm.speech_embedding(llm_in["forced_tokens"][:-1])[None]
        logps = [m.log_probs(m.llm(torch.cat([lm_input, fed], dim=1))[0][lm_input.shape[1] - 1:]) for m in (llm, q)]
        ref_lp, got_lp = logps
        top = ref_lp.topk(25, dim=-1).indices  # the sampler's candidates (top_k 25)
        row["llm_logp_top25_max_abs"] = float((ref_lp.gather(1, top) - got_lp.gather(1, top)).abs().max())
        row["llm_top1_agreement"] = float((ref_lp.argmax(-1) == got_lp.argmax(-1)).float().mean())
        p = ref_lp.exp()
        finite = torch.isfinite(ref_lp) & torch.isfinite(got_lp)
        row["llm_kl_mean"] = float(torch.where(finite, p * (ref_lp - got_lp), 0).sum(-1).mean())
        out[label] = row
        del llm, q
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="the tiny test bundle (a smoke run)")
    parser.add_argument("--model-dir", type=Path, help="a bundle to measure (default: released sizes, random)")
    parser.add_argument("--fixed-tokens", type=int, default=75, help="speech tokens per request (75 = 3 s)")
    parser.add_argument("--golden", type=Path, help="golden fixtures: also measure the int8 quality bounds")
    parser.add_argument("--skip-llm-int8", action="store_true", help="skip the LLM int8 stage row")
    parser.add_argument("--fast-backend", default=PATHS["fast"], choices=["onnxruntime", "onnxruntime-int8"],
                        help="the fast path's flow estimator + vocoder backend (default: what auto picks on a CPU)")
    parser.add_argument("--json", type=Path, help="write settings and results here")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="cosyvoice-cpu-bench-"))
    model_dir, model = bench_bundle(args.model_dir, args.tiny, work)
    import onnxruntime as ort

    settings = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "cpu": cpu_model(), "cores": torch.get_num_threads(), "torch": torch.__version__,
                "onnxruntime": ort.__version__, "python": platform.python_version(), "commit": _git_commit(),
                "model": model, "fixed_tokens": args.fixed_tokens, "mode": "stream, 1 request, batched engine",
                "load_before": load_average()}
    print(" | ".join(f"{k} {v}" for k, v in settings.items()), flush=True)
    prompt_wav = _prompt(work / "prompt.wav")
    limits = Limits(max_sessions=1, queue_timeout_seconds=600)
    results: dict[str, dict[str, float]] = {}
    paths = {"torch": "torch", "fast": args.fast_backend}
    for path, backend in paths.items():
        start = time.perf_counter()
        tts = CosyVoice3(model_dir, device="cpu", limits=limits, voice_dir=work / "voices", backend=backend)
        load_s = time.perf_counter() - start
        row = end_to_end(tts, prompt_wav, args.fixed_tokens)
        row["load_s (export on first use)"] = load_s
        if path == "torch":
            row["llm_s_per_audio_s"] = llm_cost(tts.engine.llm, args.fixed_tokens)
            if not args.skip_llm_int8:
                row["llm_int8_s_per_audio_s"] = llm_cost(quantize_llm(copy.deepcopy(tts.engine.llm)), args.fixed_tokens)
        results[path] = row
        print(path, json.dumps({k: round(v, 3) for k, v in row.items()}), flush=True)
        tts.engine.close()
        del tts
    results["fast"]["llm_s_per_audio_s"] = results["torch"]["llm_s_per_audio_s"]  # the same torch fp32 LLM
    settings["load_after"] = load_average()
    print(f"\nload average before {settings['load_before']}, after {settings['load_after']}")
    print("| path | LLM s/s | flow s/s | vocoder s/s | first audio s | total s | audio s | RTF |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for path, r in results.items():
        print(f"| {path} ({paths[path]}) | {r['llm_s_per_audio_s']:.2f} | {r['flow_s_per_audio_s']:.2f} | "
              f"{r['vocoder_s_per_audio_s']:.2f} | {r['first_audio_s']:.2f} | {r['total_s']:.2f} | "
              f"{r['audio_s']:.2f} | {r['rtf']:.2f} |")
    if "llm_int8_s_per_audio_s" in results["torch"]:
        print(f"LLM with torch dynamic int8 linears: {results['torch']['llm_int8_s_per_audio_s']:.2f} s/s")
    report: dict[str, object] = {"settings": settings, "results": results}
    if args.golden:
        report["quality"] = quality(args.golden, Path(model_dir), work)
        for label, row in report["quality"].items():  # type: ignore[union-attr]
            print(label, json.dumps({k: float(f"{v:.3g}") for k, v in row.items()}))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
