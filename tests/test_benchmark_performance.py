"""The performance benchmark runs end to end on the tiny bundle (a smoke run: no timing is asserted)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import torch

from cosyvoice.engine import Engine

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "benchmark_performance.py"


def _bench():
    spec = importlib.util.spec_from_file_location("benchmark_performance", BENCHMARK)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # dataclasses look their module up there
    spec.loader.exec_module(bench)
    return bench


def test_benchmark_runs_every_mode_and_ablation_with_tiny(tiny_bundle_dir: Path, tmp_path: Path, capsys) -> None:
    bench = _bench()
    out = tmp_path / "perf.json"
    bench.main(["--tiny", "--model-dir", str(tiny_bundle_dir), "--concurrency", "1", "2", "--poisson", "4",
                "--arrivals", "3", "--modes", "stream", "--ablation", "--llm-only", "--json", str(out)])
    report = json.loads(out.read_text())
    rows = report["rows"]
    engines = ["fast", "no-packing", "no-trim", "no-graphs", "no-incremental", "baseline"]
    assert [(r["engine"], r["load"], r["rate"]) for r in rows] == [
        (e, load, rate) for e in engines for load, rate in (("closed", 0), ("closed", 0), ("poisson", 4))]
    for r in rows:
        assert r["requests"] == (3 if r["load"] == "poisson" else r["clients"]) and r["clients"] >= 1
        assert 0 < r["first_packet_p50_ms"] <= r["first_packet_p95_ms"] <= r["first_packet_p99_ms"]
        assert r["first_packet_p50_ms"] <= r["first_audible_p50_ms"] <= r["first_audible_p99_ms"]
        assert r["audio_s_per_request"] > 0 and r["llm_tokens_per_s"] > 0 and r["rtf"] > 0
        assert r["underruns_per_stream"] >= 0 and r["peak_mem_mib"] >= 0
    # fixed_tokens: every request decoded the same 30 tokens, so every untrimmed row produced the same audio length;
    # trimming only ever removes leading silence
    untrimmed = {round(r["audio_s_per_request"], 3) for r in rows if r["engine"] in ("no-trim", "baseline")}
    assert len(untrimmed) == 1
    assert all(r["audio_s_per_request"] <= min(untrimmed) + 1e-3 for r in rows)
    assert {(r["runner"], r["batch"]) for r in report["llm_only"]} == {
        (n, b) for n in ("scheduler", "eager threads") for b in (1, 2)}
    settings = report["settings"]
    assert settings["fixed_tokens"] == 30 and settings["device"].startswith("cpu") and settings["torch"]
    assert settings["engine_options"]["no-packing"]["t2w_batch"] == 1
    table = capsys.readouterr().out
    assert "| fast | fp32 | stream | closed | 2 | 0 | 2 |" in table
    assert "| baseline | fp32 | stream | poisson |" in table


def test_benchmark_nonstream_rows(tiny_bundle_dir: Path) -> None:
    report = _bench().main(["--tiny", "--model-dir", str(tiny_bundle_dir), "--concurrency", "1",
                            "--modes", "nonstream"])
    assert [(r["engine"], r["mode"]) for r in report["rows"]] == [("fast", "nonstream"), ("baseline", "nonstream")]
    assert all(r["underruns_per_stream"] == 0 for r in report["rows"])  # one chunk: nothing to stall on


def test_playback_underruns_count_late_chunks_and_wait_for_them() -> None:
    underruns = _bench().playback_underruns
    sr = 1000
    # chunks of 1 s each: on time, on time, 0.5 s late (the clock waits), then on the shifted clock
    assert underruns([(0.2, 0, 1000), (1.1, 1000, 1000), (2.7, 2000, 1000), (3.6, 3000, 1000)], sr) == 1
    assert underruns([(0.2, 0, 1000), (1.3, 1000, 1000), (2.4, 2000, 1000)], sr) == 2
    assert underruns([(0.5, 0, 500)], sr) == 0


def test_reference_strategy_gives_the_engines_audio(tts, short_prompt_wav: Path) -> None:
    """The benchmark's baseline (an LLM thread per request, flow and vocoder recomputed per chunk in the caller's
    thread) and the engine give the same chunks for a seed: the benchmark compares strategies, not outputs."""
    spec = importlib.util.spec_from_file_location("reference_engine", BENCHMARK.parent / "reference_engine.py")
    reference = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reference)
    # the engine without the voice's flow prefix (cosyvoice/flow/prompt_cache.py, on in Model.load): the prefix
    # gives the same mel up to float rounding, and this compares bit for bit
    e = Engine(tts.engine.config, tts.engine.llm, tts.engine.flow, tts.engine.hift, tts.engine.device)
    baseline = reference.ReferenceEngine(e.config, e.llm, e.flow, e.hift, e.device, incremental_flow=True,
                                         incremental_vocoder=True)
    voice = tts.frontend.voice("You are a helpful assistant.<|endofprompt|>Hello, this is a short prompt.",
                               short_prompt_wav)
    inp = tts.frontend.model_input("Hi there, friend.", voice)
    for stream in (True, False):
        a = [c.pcm for c in e.synthesize(inp, stream=stream, seed=3)]
        b = [c.pcm for c in baseline.synthesize(inp, stream=stream, seed=3)]
        assert len(a) == len(b) >= (2 if stream else 1)
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    # the reference's recompute path: the same boundaries, the same audio up to rounding
    recompute = reference.ReferenceEngine(e.config, e.llm, e.flow, e.hift, e.device)
    c = [x.pcm for x in recompute.synthesize(inp, stream=True, seed=3)]
    a = [x.pcm for x in e.synthesize(inp, stream=True, seed=3)]
    assert [x.numel() for x in a] == [x.numel() for x in c]
    assert baseline.active_sessions == recompute.active_sessions == 0 and e.active_sessions == 0
    e.close()


def export_check_that_fails(bundle_dir, device) -> dict:
    """A stand-in export backend whose GPU check finds a mismatch (what gpu_suite must report loudly)."""
    return {"ok": False, "max_abs": 0.5}


def test_gpu_suite_smoke_on_cpu_and_loud_failure(tmp_path: Path, capsys) -> None:
    spec = importlib.util.spec_from_file_location("gpu_suite", BENCHMARK.parent / "gpu_suite.py")
    suite = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(suite)
    threads = torch.get_num_threads()
    try:
        status = suite.main(["--tiny", "--device", "cpu", "--out", str(tmp_path), "--steps", "graphed-decode",
                             "packed-dit", "compiled-dit", "memory-64", "export",
                             "--export-step", f"{__name__}:export_check_that_fails"])
    finally:
        torch.set_num_threads(threads)
    results = json.loads((tmp_path / "gpu_suite.json").read_text())
    assert {k: v["verdict"] for k, v in results.items()} == {
        "graphed-decode": "SKIPPED", "packed-dit": "PASS", "compiled-dit": "PASS", "memory-64": "PASS",
        "export": "FAIL"}
    assert results["packed-dit"]["mel_max_abs"] <= 1e-5 and results["memory-64"]["streams"] == 4
    assert status == 1 and "MISMATCH: export" in capsys.readouterr().err
    assert "| packed-dit | PASS |" in (tmp_path / "gpu_suite.md").read_text()


def test_a_benchmarks_scratch_folder_is_gone_when_its_process_ends(tmp_path: Path) -> None:
    """A benchmark's scratch folder (a released-size bundle is ~3.5 GB) goes with its process, even one that
    ends with an error part-way: left behind, runs filled the disk that CI installs into."""
    script = (f"import sys; sys.path.insert(0, {str(BENCHMARK.parent)!r}); import tempfile; "
              f"tempfile.tempdir = {str(tmp_path)!r}; from benchmark_performance import scratch_dir; "
              "work = scratch_dir('bench-'); (work / 'bundle.pt').write_bytes(b'x' * 1024); print(work, flush=True); "
              "raise SystemExit('stopped part-way')")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "stopped part-way" in done.stderr
    work = Path(done.stdout.strip())
    assert work.parent == tmp_path and work.name.startswith("bench-")
    assert not work.exists() and list(tmp_path.iterdir()) == []
