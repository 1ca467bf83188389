"""Streaming latency and throughput of the engine, against the reference's recompute strategy.

    python benchmarks/bench_engine.py [--model-dir DIR] [--device cuda] [--dtype bf16] [--concurrency 1 4]

Without ``--model-dir`` it writes a randomly initialised bundle with the released model's dimensions
(Qwen2-0.5B LLM, 22-block DiT, 512-channel HiFT) so the timings are those of the real architecture;
random weights never emit a stop token, so every request runs to its max length (20 x text tokens).
The prompt voice is featurised once (as a saved voice), so the timings are the engine's alone.

Rows: ``ours`` = incremental flow and vocoder per session (FlowStream, HiFTStream); ``baseline`` = the
reference's strategy of re-running flow and vocoder over the whole utterance for every chunk (same engine,
``incremental_flow=False, incremental_vocoder=False``).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import soundfile as sf
import torch

from cosyvoice.bundle import validate_model_dir
from cosyvoice.engine import Engine
from cosyvoice.frontend.frontend import CosyVoiceFrontend
from cosyvoice.frontend.prompts import zero_shot_prompt_text
from cosyvoice.settings import PRECISIONS, Limits, parse_precision
from cosyvoice.tools.make_tiny_bundle import TinyDims, make_tiny_bundle

RELEASED_DIMS = TinyDims(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, pre_lookahead_channels=1024,
                         dit_dim=1024, dit_depth=22, dit_heads=16, dit_dim_head=64, dit_ff_mult=2, hift_channels=512,
                         f0_channels=512)
TEXT = "Every benchmark request speaks this sentence."


def _prompt(path: Path, seconds: float = 3.0, sr: int = 24000) -> Path:
    t = np.arange(int(seconds * sr)) / sr
    phase = 2 * np.pi * np.cumsum(120 + 30 * np.sin(2 * np.pi * 0.8 * t)) / sr
    wav = sum(np.sin(k * phase) / k for k in range(1, 12)) * 0.5 * (1 - np.cos(2 * np.pi * 3 * t))
    sf.write(path, (0.3 * wav).astype(np.float32), sr)
    return path


def run_once(engine: Engine, inp, seed: int) -> dict[str, float]:
    start = time.perf_counter()
    first = None
    samples = 0
    for chunk in engine.synthesize(inp, stream=True, seed=seed):
        if first is None:
            if engine.device.type == "cuda":
                torch.cuda.synchronize()
            first = time.perf_counter() - start
        samples += chunk.pcm.numel()
    total = time.perf_counter() - start
    audio = samples / engine.sample_rate
    return {"ttfa": first or total, "total": total, "audio": audio}


def bench(engine: Engine, inp, concurrency: int, requests: int) -> dict[str, float]:
    results: list[dict[str, float]] = []
    lock = threading.Lock()

    def worker(k: int) -> None:
        for r in range(requests):
            out = run_once(engine, inp, seed=1000 * k + r)
            with lock:
                results.append(out)

    start = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    ttfa = sorted(r["ttfa"] for r in results)
    return {"ttfa_p50": statistics.median(ttfa), "ttfa_max": ttfa[-1],
            "rtf": sum(r["total"] for r in results) / sum(r["audio"] for r in results),
            "x_realtime": sum(r["audio"] for r in results) / wall,
            "audio_s": statistics.mean(r["audio"] for r in results)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(PRECISIONS), nargs="+", default=["fp32"],
                        help="LLM and flow precision (the vocoder always runs in float32)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--requests", type=int, default=2, help="requests per concurrent client")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="cosyvoice-bench-"))
    model_dir = args.model_dir or make_tiny_bundle(work / "released-dims", seed=0, dims=RELEASED_DIMS)
    bundle = validate_model_dir(model_dir)
    device = torch.device(args.device)
    limits = Limits(max_sessions=max(args.concurrency))
    frontend = CosyVoiceFrontend(bundle, limits)
    voice = frontend.voice(zero_shot_prompt_text("A prompt recording of three seconds."), _prompt(work / "p.wav"),
                           text_frontend=False)
    inp = frontend.model_input(TEXT, voice)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    model = model_dir if args.model_dir else "random, released dims"
    print(f"device {gpu} | torch {torch.__version__} | model {model} | text {inp.text.shape[1]} tokens "
          f"(<= {20 * inp.text.shape[1]} speech tokens) | prompt {inp.flow_prompt_speech_token.shape[1]} tokens | "
          f"{args.requests} requests per client | streaming")
    print(f"{'engine':<10} {'dtype':<6} {'clients':>7} {'TTFA p50 ms':>12} {'TTFA max ms':>12} {'RTF':>7} "
          f"{'x realtime':>11} {'audio s':>8}")
    hift = bundle.load_hift(device)
    for dtype_name in args.dtype:
        dtype = parse_precision(dtype_name)
        llm, flow = bundle.load_llm(device, dtype), bundle.load_flow(device, dtype)
        for name, incremental in (("ours", True), ("baseline", False)):
            engine = Engine(bundle.config, llm, flow, hift, device, limits,
                            endofprompt_id=frontend.tokenizer.end_of_prompt_id, incremental_flow=incremental,
                            incremental_vocoder=incremental)
            run_once(engine, inp, seed=0)  # warm-up: allocator, kernels, noise buffers
            for c in args.concurrency:
                r = bench(engine, inp, c, args.requests)
                print(f"{name:<10} {dtype_name:<6} {c:>7} {1e3 * r['ttfa_p50']:>12.0f} {1e3 * r['ttfa_max']:>12.0f} "
                      f"{r['rtf']:>7.3f} {r['x_realtime']:>11.2f} {r['audio_s']:>8.1f}", flush=True)
        del llm, flow


if __name__ == "__main__":
    main()
