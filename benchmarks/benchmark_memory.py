"""Resident memory of a CPU model load, phase by phase, per precision (issue 21: peak RSS <= 4 GB in the fast path).

    python benchmarks/benchmark_memory.py                          # released sizes, random weights
    python benchmarks/benchmark_memory.py --against main           # also the rows of another revision, same run
    python benchmarks/benchmark_memory.py --tiny                   # a smoke run in seconds

One bundle (released sizes with random weights unless ``--model-dir``: random weights take the memory real ones
do), one ``CosyVoice3(model_dir, device="cpu", precision=..., backend="torch")`` per precision, each in its own
process (VmHWM, the peak resident set, is per process and never goes down). The loader's steps are wrapped for
this benchmark only and each records the process's VmRSS (now) and VmHWM (the peak so far) when it returns:
reading a checkpoint (``read llm.pt``), building a module with its weights (``built LLM``), the precision
applied to it (``precision ...``), the whole load (``loaded``: frontend, vocoder and engine too) and then one
streamed request (``1 streamed request``; with the voice's flow prefix, on by default, whose size is
reported: part of that RSS). ``--against REV`` runs the same rows on the ``cosyvoice`` package of
git revision REV (``git archive``, nothing in the repository changes): the baseline in the same run.

The bundle's ONNX frontend models (speech tokenizer, speaker encoder) are small stand-ins, not the released
graphs: their share of a real model's memory is not measured here.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmark_cpu import cpu_model, load_average
from benchmark_performance import TEXT, _git_commit, _prompt, bench_bundle, scratch_dir

PRECISIONS = ("fp32", "int8", "auto")
PROMPT_TEXT = "A prompt recording of three seconds."
REPO = Path(__file__).resolve().parents[1]


def memory_mb() -> tuple[float, float]:
    """(VmRSS, VmHWM) of this process in MB."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


class Probe:
    """Records (what, VmRSS, VmHWM) after each wrapped loader step returns (see the module docstring)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, float, float]] = []

    def mark(self, what: str) -> None:
        self.events.append((what, *memory_mb()))

    def wrap(self, owner: object, name: str, label: Callable[..., str]) -> None:
        """Wrap ``owner.name`` (a module function or a class's method) when this revision has it."""
        original = getattr(owner, name, None)
        if original is None:
            return

        @functools.wraps(original)
        def recorded(*args, **kwargs):
            out = original(*args, **kwargs)
            self.mark(label(*args, **kwargs))
            return out

        setattr(owner, name, recorded)


def run_row(model_dir: Path, precision: str, work: Path) -> dict[str, object]:
    """Load ``precision`` in this process, then one streamed request; the probe's events."""
    from cosyvoice import weights
    from cosyvoice.backends import precision as fast
    from cosyvoice.bundle import ModelBundle
    from cosyvoice.cli.cosyvoice import CosyVoice3
    from cosyvoice.frontend.prompts import zero_shot_prompt_text

    probe = Probe()
    probe.mark("start (torch imported)")
    probe.wrap(weights, "read_checkpoint", lambda path, *a, **k: f"read {Path(path).name}")
    for method, module in (("load_llm", "LLM"), ("load_flow", "flow"), ("load_hift", "vocoder")):
        probe.wrap(ModelBundle, method, lambda *a, _m=module, **k: f"built {_m}")
    for name in ("plan_and_apply", "apply_llm", "apply_flow"):
        probe.wrap(fast, name, lambda *a, _n=name, **k: f"precision: {_n}")
    start = time.perf_counter()
    tts = CosyVoice3(model_dir, device="cpu", voice_dir=work / f"voices-{precision}", backend="torch",
                     precision=precision)
    load_s = time.perf_counter() - start
    probe.mark("loaded")
    voice = tts.frontend.voice(zero_shot_prompt_text(PROMPT_TEXT), _prompt(work / "prompt.wav"))
    for _ in tts.engine.synthesize(tts.frontend.model_input(TEXT, voice), stream=True, seed=0, fixed_tokens=75):
        pass
    probe.mark("1 streamed request")
    cache = tts.engine.prompt_cache
    result = {"plan": tts.model.plan.label, "load_s": load_s, "events": probe.events, "load_after": load_average(),
              "prompt_cache_mb": cache.memory_bytes / 2**20 if cache is not None else 0.0}
    tts.engine.close()
    return result


def revision_tree(rev: str, work: Path) -> Path:
    """The ``cosyvoice`` package of git revision ``rev``, extracted under ``work`` (the repository is untouched)."""
    out = work / f"rev-{rev.replace('/', '_')}"
    out.mkdir()
    archive = subprocess.run(["git", "archive", rev, "cosyvoice"], cwd=REPO, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive.stdout, check=True)
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="the tiny test bundle (a smoke run)")
    parser.add_argument("--model-dir", type=Path, help="a bundle to measure (default: released sizes, random)")
    parser.add_argument("--precisions", nargs="*", choices=PRECISIONS, default=list(PRECISIONS))
    parser.add_argument("--against", help="also run the rows on this git revision's cosyvoice package")
    parser.add_argument("--json", type=Path, help="write settings and results here")
    parser.add_argument("--row", help=argparse.SUPPRESS)  # internal: run one precision in this process
    args = parser.parse_args(argv)
    work = scratch_dir("cosyvoice-mem-bench-")
    if args.row:
        print(json.dumps(run_row(args.model_dir, args.row, work)))
        return {}
    return measure(args, work)


def measure(args: argparse.Namespace, work: Path) -> dict:
    model_dir, model = bench_bundle(args.model_dir, args.tiny, work)
    settings = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "cpu": cpu_model(), "cores": os.cpu_count(), "torch": torch.__version__,
                "python": platform.python_version(), "glibc": "-".join(platform.libc_ver()), "commit": _git_commit(),
                "model": model, "backend": "torch", "request": "1 streamed, 75 fixed tokens, seed 0",
                "load_before": load_average()}
    print(" | ".join(f"{k} {v}" for k, v in settings.items()), flush=True)
    sources: dict[str, Path | None] = {"this tree": None}
    if args.against:
        sources[args.against] = revision_tree(args.against, work)
    results: dict[str, dict[str, object]] = {}
    for source, tree in sources.items():
        env = dict(os.environ)
        if tree is not None:  # ahead of the editable install on sys.path
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tree), env.get("PYTHONPATH")) if p)
        for precision in args.precisions:
            done = subprocess.run([sys.executable, __file__, "--row", precision, "--model-dir", str(model_dir)],
                                  capture_output=True, text=True, env=env)
            lines = done.stdout.strip().splitlines()
            key = f"{source}: {precision}"
            results[key] = json.loads(lines[-1]) if done.returncode == 0 and lines else {
                "failed": done.stderr.strip().splitlines()[-3:]}
            print_row(key, results[key])
    settings["load_after"] = load_average()
    print(f"\nload average before {settings['load_before']}, after {settings['load_after']}")
    print("| revision: precision | runs | load s | peak RSS after load MB | peak RSS MB | RSS after request MB "
          "| of which voice prefix MB | load average after |\n| --- | --- | --- | --- | --- | --- | --- | --- |")
    for key, r in results.items():
        if "events" not in r:
            print(f"| {key} | {r} |")
            continue
        events = {what: (rss, hwm) for what, rss, hwm in r["events"]}  # type: ignore[union-attr]
        print(f"| {key} | {r['plan']} | {r['load_s']:.1f} | {events['loaded'][1]:.0f} | "
              f"{events['1 streamed request'][1]:.0f} | {events['1 streamed request'][0]:.0f} | "
              f"{r['prompt_cache_mb']:.0f} | {r['load_after']} |")
    report = {"settings": settings, "rows": results}
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return report


def print_row(key: str, result: dict[str, object]) -> None:
    if "events" not in result:
        print(key, json.dumps(result), flush=True)
        return
    print(f"\n{key} ({result['plan']}, load {result['load_s']:.1f} s)\n| step | RSS MB | peak RSS MB |\n"
          "| --- | --- | --- |")
    for what, rss, hwm in result["events"]:  # type: ignore[union-attr]
        print(f"| {what} | {rss:.0f} | {hwm:.0f} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
