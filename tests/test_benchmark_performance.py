"""The performance benchmark runs end to end on the tiny bundle (a smoke run: no timing is asserted)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import torch

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "benchmark_performance.py"


def test_benchmark_runs_with_tiny(tiny_bundle_dir: Path, tmp_path: Path, capsys) -> None:
    spec = importlib.util.spec_from_file_location("benchmark_performance", BENCHMARK)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # dataclasses look their module up there
    spec.loader.exec_module(bench)
    out = tmp_path / "perf.json"
    bench.main(["--tiny", "--model-dir", str(tiny_bundle_dir), "--concurrency", "1", "2", "--llm-only",
                "--json", str(out)])
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert {(r["engine"], r["mode"], r["clients"]) for r in rows} == {
        (e, m, c) for e in ("fast", "baseline") for m in ("stream", "nonstream") for c in (1, 2)}
    for r in rows:
        assert r["requests"] == r["clients"] and r["audio_s_per_request"] > 0 and r["llm_tokens_per_s"] > 0
        assert 0 < r["first_audio_p50_ms"] <= r["first_audio_p90_ms"] and r["rtf"] > 0
    # fixed_tokens: every request decoded the same 30 tokens, so every row produced the same audio length
    assert len({round(r["audio_s_per_request"], 3) for r in rows}) == 1
    assert {(r["runner"], r["batch"]) for r in report["llm_only"]} == {
        (n, b) for n in ("scheduler", "eager threads") for b in (1, 2)}
    settings = report["settings"]
    assert settings["fixed_tokens"] == 30 and settings["device"].startswith("cpu") and settings["torch"]
    table = capsys.readouterr().out
    assert "| fast | fp32 | stream | 2 |" in table and "| baseline | fp32 | nonstream | 1 |" in table


def test_reference_strategy_gives_the_engines_audio(tts, short_prompt_wav: Path) -> None:
    """The benchmark's baseline (an LLM thread per request, flow and vocoder recomputed per chunk in the caller's
    thread) and the engine give the same chunks for a seed: the benchmark compares strategies, not outputs."""
    spec = importlib.util.spec_from_file_location("reference_engine", BENCHMARK.parent / "reference_engine.py")
    reference = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reference)
    e = tts.engine
    baseline = reference.ReferenceEngine(e.config, e.llm, e.flow, e.hift, e.device,
                                         endofprompt_id=e.endofprompt_id, incremental_flow=True,
                                         incremental_vocoder=True)
    voice = tts.frontend.voice("You are a helpful assistant.<|endofprompt|>Hello, this is a short prompt.",
                               short_prompt_wav, text_frontend=False)
    inp = tts.frontend.model_input("Hi there, friend.", voice)
    for stream in (True, False):
        a = [c.pcm for c in e.synthesize(inp, stream=stream, seed=3)]
        b = [c.pcm for c in baseline.synthesize(inp, stream=stream, seed=3)]
        assert len(a) == len(b) >= (2 if stream else 1)
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    # the reference's recompute path: the same boundaries, the same audio up to rounding
    recompute = reference.ReferenceEngine(e.config, e.llm, e.flow, e.hift, e.device, endofprompt_id=e.endofprompt_id)
    c = [x.pcm for x in recompute.synthesize(inp, stream=True, seed=3)]
    a = [x.pcm for x in e.synthesize(inp, stream=True, seed=3)]
    assert [x.numel() for x in a] == [x.numel() for x in c]
    assert baseline.active_sessions == recompute.active_sessions == 0 and tts.engine.active_sessions == 0
