"""A/B of the DiT's cached onnxruntime graph: per-chunk CPU seconds against the past length, and peak RSS.

Each ``--run LABEL TREE GRAPH`` streams one utterance through :class:`~cosyvoice.flow.FlowStream` in a process of
its own (so its peak RSS is its own), with the code of ``TREE`` (a checkout or ``git archive`` of the commit to
measure; its runner must match the graph's format) and the ``flow_estimator_cached`` file ``GRAPH`` of the same
``--model-dir``: random speech tokens, one chunk of tokens per call (``finalize=False``, as the engine streams),
``--steps`` Euler steps, the DiT on one onnxruntime thread and torch on one. Per-call cost is per Euler step, so
fewer steps than the model's 10 reach long utterances within a smaller cache (bytes per frame scale with the
steps) and keep each step's cost as it is: 60 s at 2 steps holds 2.1 GB of cache (10 steps: 10.5 GB), and
format 1 peaked at 8.4 GB RSS there (its per-call copies).

The table: CPU seconds per chunk in bands of the frames finished before the call (the prompt's included), then the
flow's CPU seconds per second of audio returned (CPU RTF) of requests of ``--marks`` seconds of tokens: the first
calls of the same stream (the final call is not made).

    python benchmarks/ort_cache_ab.py --model-dir DIR --seconds 60 --steps 2 \\
        --run "old (format 1)" /tmp/old_tree DIR_OLD/onnx/flow_estimator_cached.int8.onnx \\
        --run "new (format 2)" . DIR/onnx/flow_estimator_cached.int8.onnx
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def stream(model_dir: str, graph: str, seconds: float, steps: int, prompt_s: float) -> dict[str, object]:
    """One utterance streamed chunk by chunk on ``graph``: each call's past frames and CPU seconds, peak RSS."""
    from pathlib import Path

    import torch

    from cosyvoice.backends import release_blocks
    from cosyvoice.backends.ort import OrtGraph
    from cosyvoice.backends.runners import GraphEstimator
    from cosyvoice.bundle import validate_model_dir
    from cosyvoice.flow import FlowStream

    torch.set_num_threads(1)
    flow = validate_model_dir(model_dir).load_flow()
    dit = flow.decoder.estimator
    session = OrtGraph(Path(graph), torch.device("cpu"), 1)
    # an int8 graph of export format 3 or later keeps its cache in float16 (older trees' runners take no dtype)
    half = {i.name: i.type for i in session.session.get_inputs()}.get("cache_k_0") == "tensor(float16)"
    dit.runner = GraphEstimator(None, session, dit, *([torch.float16] if half else []))
    release_blocks(flow)
    g = torch.Generator().manual_seed(0)
    vocab, ratio = flow.input_embedding.num_embeddings, flow.token_mel_ratio
    tokens_per_s = 50 // ratio  # 50 mel frames a second
    prompt = torch.randint(0, vocab, (1, int(prompt_s * tokens_per_s)), generator=g)
    feat = torch.randn(1, prompt.shape[1] * ratio, flow.cfg.output_size, generator=g)
    s = FlowStream(flow, prompt, feat, torch.randn(1, flow.spk_embed_affine_layer.in_features, generator=g), steps)
    chunk = dit.chunk_size // ratio
    calls = []
    for _ in range(int(seconds * tokens_per_s) // chunk):
        past, cpu, wall = s.finished_frames, _cpu_s(), time.perf_counter()
        mel = s.inference(torch.randint(0, vocab, (1, chunk), generator=g), finalize=False)
        calls.append({"past": past, "frames": mel.shape[2], "cpu_s": _cpu_s() - cpu,
                      "wall_s": time.perf_counter() - wall})
        if len(calls) % 10 == 0:
            print(f"  {len(calls)} chunks, past {past / 50:.0f} s: {calls[-1]['cpu_s']:.2f} CPU s, "
                  f"RSS peak {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:,.0f} MiB", flush=True)
    return {"calls": calls, "chunk_s": chunk / tokens_per_s, "cache_mb": s.cache_bytes / 2**20,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def table(results: dict[str, dict], marks: list[float], band_s: float) -> str:
    """Markdown: per-chunk CPU seconds by past-length band, CPU RTF at each mark, peak RSS, per run."""
    labels = list(results)
    rows = ["| | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
    top = max(c["past"] for r in results.values() for c in r["calls"])
    band = int(band_s * 50)
    for lo in range(0, top + 1, band):
        cells = []
        for r in results.values():
            got = [c["cpu_s"] for c in r["calls"] if lo <= c["past"] < lo + band]
            cells.append(f"{sum(got) / len(got):.2f}" if got else "")
        rows.append(f"| CPU s per chunk, past {lo / 50:.0f}-{(lo + band) / 50:.0f} s | " + " | ".join(cells) + " |")
    for mark in marks:
        cells = []
        for r in results.values():  # a request of ``mark`` seconds of tokens: its first calls
            done = r["calls"][:round(mark / r["chunk_s"])]
            audio = sum(c["frames"] for c in done) / 50
            cells.append(f"{sum(c['cpu_s'] for c in done) / audio:.3f}" if len(done) == round(mark / r["chunk_s"])
                         else "")
        rows.append(f"| flow CPU RTF, {mark:g} s request | " + " | ".join(cells) + " |")
    rows.append("| peak RSS MiB | " + " | ".join(f"{r['peak_rss_mb']:,.0f}" for r in results.values()) + " |")
    rows.append("| cache at the end MiB | " + " | ".join(f"{r['cache_mb']:,.0f}" for r in results.values()) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--run", nargs=3, action="append", metavar=("LABEL", "TREE", "GRAPH"), default=[])
    parser.add_argument("--seconds", type=float, default=60.0, help="speech streamed after the prompt")
    parser.add_argument("--steps", type=int, default=4, help="Euler steps per call (the model's: 10)")
    parser.add_argument("--prompt-seconds", type=float, default=2.0)
    parser.add_argument("--marks", type=float, nargs="+", default=[10, 30, 60], help="request lengths (s)")
    parser.add_argument("--band", type=float, default=10.0, help="past-length band of the per-chunk rows (s)")
    parser.add_argument("--json", help="write every call's numbers here")
    parser.add_argument("--child", nargs=2, metavar=("GRAPH", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        got = stream(args.model_dir, args.child[0], args.seconds, args.steps, args.prompt_seconds)
        with open(args.child[1], "w", encoding="utf-8") as f:
            json.dump(got, f)
        return 0
    results = {}
    for label, tree, graph in args.run:
        out = f"{args.json or 'ort_cache_ab'}.{len(results)}.tmp"
        env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
        subprocess.run([sys.executable, __file__, "--model-dir", args.model_dir, "--seconds", str(args.seconds),
                        "--steps", str(args.steps), "--prompt-seconds", str(args.prompt_seconds),
                        "--child", graph, out], env=env, check=True)
        with open(out, encoding="utf-8") as f:
            results[label] = json.load(f)
        os.remove(out)
        print(f"{label}: {sum(c['cpu_s'] for c in results[label]['calls']):.1f} CPU s, load average "
              f"{os.getloadavg()[0]:.2f}", flush=True)
    print(table(results, args.marks, args.band))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
