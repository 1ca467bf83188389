"""The performance benchmark runs end to end on the tiny bundle (a smoke run: no timing is asserted)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

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
