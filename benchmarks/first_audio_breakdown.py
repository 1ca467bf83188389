"""Where first audio's time goes: per stage and per thread, wall and CPU, from the request to its first chunk.

    python benchmarks/first_audio_breakdown.py --model-dir <bundle> [--steps 6] [--first-hop 15] [--alternate]

One process, one bundle on ``--precision`` (default ``auto``: its kept choices), the voice's flow prefix on, after
``--warm-ups`` whole requests; then ``--requests`` streamed requests, each cancelled at its first chunk. Per request:
wall and process CPU seconds to the first chunk, each thread's CPU seconds over that window
(``/proc/self/task/*/stat``, named by Python's thread names: anything besides the two engine threads is a pool
that spins or works elsewhere), and each stage's calls, wall and CPU seconds in its own thread (the LLM's steps in
the scheduler thread; the voice-prefix lookup, the flow's Euler loop and the vocoder in the token-to-wave thread).
``--held``: the engine's first-chunk priority on (the LLM held back while the first chunk is computed; the
engine's default on a CPU, which this script turns off without the flag, to measure both);
``--alternate``: on for every other request, an A/B under the same load. Why this script: benchmark_cpu's rows
give totals; this one says which thread and stage spent them (issue 27's first-audio CPU, docs/perf.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmark_cpu import PROMPT_TEXT, load_average
from benchmark_performance import TEXT, _prompt, scratch_dir
from cpu_floor import process_cpu_s

from cosyvoice.cli.cosyvoice import CosyVoice3
from cosyvoice.engine.runner import LLMRunner
from cosyvoice.engine.session import ChunkSchedule
from cosyvoice.flow.model import FlowStream
from cosyvoice.flow.prompt_cache import PromptCache
from cosyvoice.frontend.prompts import zero_shot_prompt_text
from cosyvoice.hifigan import HiFTStream
from cosyvoice.settings import Limits

#: (class, method, stage): wrapped for this script only, each call timed in the thread that makes it
STAGES = ((LLMRunner, "execute", "llm step"), (PromptCache, "stream", "voice prefix lookup"),
          (FlowStream, "solve", "flow (Euler loop)"), (HiFTStream, "inference", "vocoder"))
TICKS = os.sysconf("SC_CLK_TCK")


def thread_cpu_s() -> dict[int, float]:
    """Each thread of this process (native id) -> its CPU seconds, user and system."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
        except FileNotFoundError:  # ended meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / TICKS
    return out


class StageClock:
    """Records (stage, thread name, start, wall s, thread CPU s) of every call of :data:`STAGES` while entered."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, float, float, float]] = []
        self._saved: list[tuple[type, str, Callable]] = []

    def __enter__(self) -> StageClock:
        for cls, name, stage in STAGES:
            original = getattr(cls, name)
            self._saved.append((cls, name, original))

            def timed(*args, _original=original, _stage=stage, **kwargs):
                start, cpu = time.perf_counter(), time.thread_time()
                try:
                    return _original(*args, **kwargs)
                finally:
                    self.calls.append((_stage, threading.current_thread().name, start,
                                       time.perf_counter() - start, time.thread_time() - cpu))

            setattr(cls, name, timed)
        return self

    def __exit__(self, *exc: object) -> None:
        for cls, name, original in self._saved:
            setattr(cls, name, original)

    def between(self, start: float, end: float) -> dict[str, list[float]]:
        """'stage @ thread' -> [calls, wall s, CPU s] of the calls that began in [start, end)."""
        out: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
        for stage, thread, began, wall, cpu in self.calls:
            if start <= began < end:
                row = out[f"{stage} @ {thread}"]
                row[0] += 1
                row[1] += min(wall, end - began)
                row[2] += cpu
        return {k: [v[0], round(v[1], 3), round(v[2], 3)] for k, v in sorted(out.items())}


def first_audio(tts: CosyVoice3, inp, clock: StageClock, options: dict, held: bool) -> dict[str, object]:
    """One streamed request, cancelled at its first chunk: wall, CPU, per thread and per stage to that chunk."""
    tts.engine.first_chunk_priority = held
    threads, cpu, start = thread_cpu_s(), process_cpu_s(), time.perf_counter()
    chunks = tts.engine.synthesize(inp, stream=True, seed=0, fixed_tokens=250, **options)
    next(chunks)
    first, first_cpu, after = time.perf_counter() - start, process_cpu_s() - cpu, thread_cpu_s()
    chunks.close()
    names = {t.native_id: t.name for t in threading.enumerate()}
    per_thread: dict[str, float] = defaultdict(float)
    for tid, seconds in after.items():
        per_thread[names.get(tid, f"native thread {tid}")] += seconds - threads.get(tid, 0.0)
    return {"held": held, "first_audio_s": round(first, 3), "cpu_s": round(first_cpu, 3),
            "threads_cpu_s": {k: round(v, 3) for k, v in per_thread.items() if v > 0},
            "stages": clock.between(start, start + first), "load": load_average()}


def main(argv: list[str] | None = None) -> list[dict[str, object]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--precision", default="auto", help="the engine's precision (fp32 for a quick smoke run)")
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--warm-ups", type=int, default=2, help="whole 30-token requests before measuring")
    parser.add_argument("--steps", type=int, help="the flow's Euler steps (default: the model's)")
    parser.add_argument("--first-hop", type=int, help="speech tokens of the first chunk (default: the reference's)")
    parser.add_argument("--held", action="store_true", help="the engine's first-chunk priority on")
    parser.add_argument("--alternate", action="store_true", help="the priority on for every other request")
    parser.add_argument("--json", type=Path, help="write the requests' records here")
    args = parser.parse_args(argv)
    os.environ["COSYVOICE_PROMPT_CACHE"] = "on"
    work = scratch_dir("first-audio-")
    tts = CosyVoice3(args.model_dir, device="cpu", precision=args.precision, voice_dir=work / "voices",
                     limits=Limits(max_sessions=1, queue_timeout_seconds=3600))
    print("plan", tts.model.plan.label, "| threads (LLM, t2w)", tts.engine.threads, "| load", load_average())
    voice = tts.frontend.voice(zero_shot_prompt_text(PROMPT_TEXT), _prompt(work / "prompt.wav"))
    inp = tts.frontend.model_input(TEXT, voice)
    options = {"steps": args.steps, "schedule": ChunkSchedule(first_hop=args.first_hop)}
    for _ in range(args.warm_ups):
        list(tts.engine.synthesize(inp, stream=True, seed=0, fixed_tokens=30, **options))
    with StageClock() as clock:
        records = [first_audio(tts, inp, clock, options, held=args.held or (args.alternate and i % 2 == 0))
                   for i in range(args.requests)]
    tts.engine.close()
    for r in records:
        print(json.dumps(r))
    for held in sorted({r["held"] for r in records}, reverse=True):
        rs = [r for r in records if r["held"] is held]
        print(f"LLM held {held}: first audio p50 {np.median([r['first_audio_s'] for r in rs]):.2f} s, "
              f"CPU p50 {np.median([r['cpu_s'] for r in rs]):.2f} s over {len(rs)} requests")
    if args.json:
        args.json.write_text(json.dumps(records, indent=1))
    return records


if __name__ == "__main__":
    main()
