"""benchmark_cpu's row runner, the first-audio breakdown and the cancel benchmark on the tiny bundle (smoke runs:
no timing is asserted)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _bench(name: str = "benchmark_cpu"):
    sys.path.insert(0, str(BENCHMARKS))  # its sibling modules (reference_engine, cpu_floor, ...)
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # dataclasses look their module up there
    spec.loader.exec_module(bench)
    return bench


def test_a_row_with_a_first_hop_and_the_llm_held_runs_and_says_so(
        tiny_bundle_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The issue's levers as rows: a request's first hop and the engine's first-chunk priority; first audio's CPU
    is counted to the first chunk, the cancelled request's tail apart."""
    bench = _bench()
    monkeypatch.setenv("COSYVOICE_PROMPT_CACHE", "off")  # run_row sets it: restored after the test
    monkeypatch.setitem(bench.ROWS, "smoke", bench.Row(staged=True, first_hop=4, held=True))
    r = bench.run_row(tiny_bundle_dir, "smoke", requests=2, lengths=[1], work=tmp_path)
    assert (r["first_hop"], r["held"], r["steps"]) == (4, True, 10)
    assert 0 < r["first_audio_cpu_s_p50"] <= r["first_audio_cpu_to_release_s_p50"]
    assert r["rtf_1s"] > 0
    table = bench.rows_table({"smoke": r}, [1])
    assert table.splitlines()[-1].startswith("| smoke | fp32 ") and "| full | 4 | yes |" in table


def test_the_first_audio_breakdown_names_each_thread_and_stage(tiny_bundle_dir: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Per request: the engine's two threads and its stages, in the threads they run in, with and without the
    first-chunk priority (--alternate)."""
    monkeypatch.setenv("COSYVOICE_PROMPT_CACHE", "on")  # main sets it: restored after the test
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    records = _bench("first_audio_breakdown").main(["--model-dir", str(tiny_bundle_dir), "--precision", "fp32",
                                                    "--requests", "2", "--warm-ups", "1", "--alternate"])
    assert [r["held"] for r in records] == [True, False]
    for r in records:
        assert r["cpu_s"] > 0 and {"cosyvoice-scheduler", "cosyvoice-t2w"} <= set(r["threads_cpu_s"])
        assert {"llm step @ cosyvoice-scheduler", "flow (Euler loop) @ cosyvoice-t2w",
                "vocoder @ cosyvoice-t2w"} <= set(r["stages"])


def test_the_floor_section_times_every_dit_path_on_the_bundles_graphs(tiny_bundle_dir: Path) -> None:
    """The floor's DiT paths run the exported graphs as the engine does (their interface drifted once: the int8
    graph's float16 cache was fed float32 and the benchmark stopped before its rows)."""
    results = _bench("cpu_floor").dit_paths(tiny_bundle_dir, None)
    assert set(results) == {*_bench("cpu_floor").dit_paths_here(), "_work"}
    for name, row in results.items():
        if name != "_work":
            assert len(row) == 2 and all(seconds > 0 for seconds in row.values()), name


def test_the_cancel_benchmark_stops_a_take_after_each_chunk_and_times_the_next(tiny_bundle_dir: Path, tmp_path: Path,
                                                                                monkeypatch: pytest.MonkeyPatch,
                                                                                capsys) -> None:
    """A Stop after every chunk but the last, each followed by a freed engine and by a next take that is heard."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    result = _bench("benchmark_cancel").main(["--model-dir", str(tiny_bundle_dir), "--precision", "fp32",
                                              "--seconds", "6", "--repeats", "1", "--delay", "0"])
    assert result["chunks"] >= 2 and [row["k"] for row in result["rows"]] == list(range(1, result["chunks"]))
    for row in result["rows"]:
        assert min(row["freed_s"]) >= 0 and min(row["next_first_audio_s"]) > 0
    table = capsys.readouterr().out.splitlines()
    assert table[-1].startswith("| (no Stop: an idle engine) |") and "the last call" in table[-2]
