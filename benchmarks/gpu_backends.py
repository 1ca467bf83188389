"""The GPU step of the backends issue: torch vs onnxruntime-CUDA vs TensorRT fp32 / fp16, per call and end to end.

    python benchmarks/gpu_backends.py OUT_DIR [--model-dir DIR]       # or: from gpu_backends import run

:func:`run` is what the one GPU script calls. On a machine without CUDA it returns ``{"skipped": reason}``.
At the released sizes (random weights unless ``--model-dir``): exports the graphs (fp32 + autocast fp16),
builds the TensorRT plans (build seconds and plan bytes recorded; a second run reuses the cache), then per
backend: the DiT per call (full graph, CFG batch 2, 200 frames; cached graph, 50 new frames after 300),
the vocoder per call (100 mel frames), each output's NaN/Inf count and its max difference from torch fp32,
and one streamed request end to end (75 fixed tokens: first audio and RTF). Written as
``OUT_DIR/gpu_backends.json``. Not yet run on a GPU (none was lent to this work).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmark_performance import RELEASED_DIMS, TEXT, _prompt

from cosyvoice.backends import attach_flow, attach_hift, unavailable
from cosyvoice.backends.export import export_onnx
from cosyvoice.bundle import validate_model_dir
from cosyvoice.frontend.prompts import zero_shot_prompt_text
from cosyvoice.settings import Limits
from cosyvoice.tools.make_tiny_bundle import make_tiny_bundle

# (label, backend, flow dtype): TensorRT fp16 = the autocast-fp16 ONNX as a strongly typed network
VARIANTS = (("torch fp32", "torch", torch.float32), ("onnxruntime-cuda fp32", "onnxruntime", torch.float32),
            ("tensorrt fp32", "tensorrt", torch.float32), ("tensorrt fp16", "tensorrt", torch.float16))


def _timed(fn, reps: int = 20) -> tuple[float, torch.Tensor]:
    out = fn()  # warm-up (and the output checked)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times), out


def _check(out: torch.Tensor, ref: torch.Tensor | None) -> dict[str, float]:
    out = out.float().cpu()
    bad = int((~torch.isfinite(out)).sum())
    diff = float((out - ref.float().cpu()).abs().max()) if ref is not None and not bad else float("nan")
    return {"nonfinite": bad, "max_abs_diff_vs_torch_fp32": diff}


@torch.inference_mode()
def _per_call(bundle, backend: str, dtype: torch.dtype, refs: dict[str, torch.Tensor]) -> dict[str, object]:
    dev = torch.device("cuda")
    flow = attach_flow(bundle.load_flow(dev, dtype), bundle.root, backend, dev)
    hift = attach_hift(bundle.load_hift(dev), bundle.root, backend, dev)
    dit = flow.decoder.estimator
    g = torch.Generator(device="cpu").manual_seed(0)
    cfg = bundle.config.flow.dit

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dev, dtype)

    x, mu, cond, spks = rand(2, cfg.mel_dim, 200), rand(2, cfg.mu_dim, 200), rand(2, cfg.mel_dim, 200), rand(2, 80)
    t = torch.full((2,), 0.5, device=dev, dtype=dtype)
    row: dict[str, object] = {}
    ms, out = _timed(lambda: dit(x, mu, t, spks, cond, streaming=True))
    row["dit_full_200_ms"], row["dit_full_check"] = ms, _check(out, refs.get("dit_full"))
    refs.setdefault("dit_full", out)
    _, past = dit.forward_cached(x[..., :150], mu[..., :150], t, spks, cond[..., :150], None, 150)
    n = 50
    ms, out = _timed(lambda: dit.forward_cached(x[..., 150:150 + n], mu[..., 150:150 + n], t, spks,
                                                cond[..., 150:150 + n], past, 0)[0])
    row["dit_cached_50_after_150_ms"], row["dit_cached_check"] = ms, _check(out, refs.get("dit_cached"))
    refs.setdefault("dit_cached", out)
    mel = torch.randn(1, 80, 100, generator=g).to(dev)
    ms, out = _timed(lambda: hift.inference(mel, finalize=True)[0])
    row["vocoder_100_frames_ms"], row["vocoder_check"] = ms, _check(out, refs.get("vocoder"))
    refs.setdefault("vocoder", out)
    if backend == "tensorrt":
        graphs = {"flow_estimator": dit.runner.plain, "flow_estimator_cached": dit.runner.cached,
                  "vocoder": hift.runner.graph}
        row["plans"] = {name: {"build_s (0 = cached)": gr.build_seconds, "bytes": gr.plan_bytes}
                        for name, gr in graphs.items()}
    return row


def _end_to_end(model_dir: Path, backend: str, dtype: torch.dtype, work: Path) -> dict[str, float]:
    from cosyvoice.cli.cosyvoice import CosyVoice3

    tts = CosyVoice3(model_dir, device="cuda", dtype="fp16" if dtype == torch.float16 else "fp32",
                     limits=Limits(max_sessions=1), voice_dir=work / "voices", backend=backend)
    voice = tts.frontend.voice(zero_shot_prompt_text("A prompt recording of three seconds."),
                               _prompt(work / "p.wav"))
    inp = tts.frontend.model_input(TEXT, voice)
    tts.engine.fixed_tokens = 75
    result = {}
    for _ in range(2):  # the first is the warm-up
        start = time.perf_counter()
        first, samples = None, 0
        for chunk in tts.engine.synthesize(inp, stream=True, seed=0):
            first = first if first is not None else time.perf_counter() - start
            samples += chunk.pcm.numel()
        total = time.perf_counter() - start
        result = {"first_audio_s": first or total, "rtf": total / (samples / tts.sample_rate)}
    tts.engine.close()
    return result


def run(out_dir: str | Path, model_dir: str | Path | None = None) -> dict[str, object]:
    """Measure every variant that can run here; ``{"skipped": reason}`` without a CUDA GPU."""
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA GPU"}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu-backends-", dir=out))
    model_dir = Path(model_dir) if model_dir else make_tiny_bundle(work / "full", seed=0, dims=RELEASED_DIMS)
    start = time.perf_counter()
    manifest = export_onnx(model_dir, Path(model_dir) / "onnx", fp16=True)
    report: dict[str, object] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                 "export_s": time.perf_counter() - start,
                                 "onnx_bytes": {k: v["bytes"] for k, v in manifest["graphs"].items()},
                                 "variants": {}}
    bundle = validate_model_dir(model_dir)
    refs: dict[str, torch.Tensor] = {}
    for label, backend, dtype in VARIANTS:
        problem = unavailable(backend, torch.device("cuda"))
        if problem:
            report["variants"][label] = {"skipped": problem}  # type: ignore[index]
            continue
        try:
            row = _per_call(bundle, backend, dtype, refs)
            torch.cuda.empty_cache()  # the variant's modules are gone with _per_call's frame
            row["end_to_end_stream_75_tokens"] = _end_to_end(Path(model_dir), backend, dtype, work)
        except Exception as exc:  # one variant failing (a plan build, a provider) must not hide the others
            row = {"error": f"{type(exc).__name__}: {exc}"}
        report["variants"][label] = row  # type: ignore[index]
        print(label, json.dumps(row), flush=True)
    (out / "gpu_backends.json").write_text(json.dumps(report, indent=2))
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--model-dir", type=Path, help="a bundle (default: released sizes, random weights)")
    args = parser.parse_args(argv)
    print(json.dumps(run(args.out_dir, args.model_dir), indent=2))


if __name__ == "__main__":
    main()
