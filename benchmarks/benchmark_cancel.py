"""A Stop during a take, then the next take: how long the engine goes on computing audio nobody will hear, and
how soon the next take is heard.

    python benchmarks/benchmark_cancel.py --model-dir DIR            # a released-size bundle (export_onnx'd for auto)
    python benchmarks/benchmark_cancel.py --tiny                     # a smoke run

One streamed take of ``--seconds`` of speech (25 speech tokens a second, the same seed and text) is stopped by its
cancel token ``--delay`` seconds after its k-th chunk arrives (by then the worker is inside the next chunk's flow
call), for every k before its last chunk, ``--repeats`` times each. Two trials per stop:

- **freed**: wall and process CPU seconds from the Stop until the engine holds no session (the token-to-wave worker
  let go of the take: it had to finish whatever it was computing, down to one Euler step of a flow call);
- **next take**: a new take started at the Stop, its first audio from that moment (it queues behind the worker).

Beside them, in the same run, the first audio of a take on an idle engine: what the next take would get if the
Stop cost nothing. The code under test is whatever ``cosyvoice`` imports (``PYTHONPATH=<worktree>`` measures
another revision with this script).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmark_cpu import PROMPT_TEXT, load_average
from benchmark_performance import TEXT, _git_commit, _prompt, bench_bundle, scratch_dir
from cpu_floor import process_cpu_s

import cosyvoice
from cosyvoice.cli.cosyvoice import CosyVoice3
from cosyvoice.engine import AudioChunk, CancelToken, Engine
from cosyvoice.frontend.prompts import zero_shot_prompt_text
from cosyvoice.settings import Limits


def freed_after(engine: Engine, poll_s: float = 0.002) -> float:
    """Seconds until the engine holds no session (polled: the engine has no event for it)."""
    start = time.perf_counter()
    while engine.active_sessions:
        time.sleep(poll_s)
    return time.perf_counter() - start


class Takes:
    """Streamed takes of one request on one engine."""

    def __init__(self, tts: CosyVoice3, tokens: int, delay: float, work: Path) -> None:
        self.engine, self.delay = tts.engine, delay
        voice = tts.frontend.voice(zero_shot_prompt_text(PROMPT_TEXT), _prompt(work / "prompt.wav"))
        self.inp, self.tokens = tts.frontend.model_input(TEXT, voice), tokens

    def start(self, cancel: CancelToken | None = None, seed: int = 0) -> Iterator[AudioChunk]:
        return self.engine.synthesize(self.inp, stream=True, seed=seed, fixed_tokens=self.tokens, cancel=cancel)

    def first_audio(self, seed: int = 1) -> float:
        """A new take's first audio, from now; the take is then stopped and freed."""
        start = time.perf_counter()
        chunks = self.start(seed=seed)
        next(chunks)
        first = time.perf_counter() - start
        chunks.close()
        return first

    def stopped_after(self, k: int, next_take: bool) -> dict[str, float]:
        """Stop a take ``delay`` seconds after its k-th chunk: then the seconds until it is freed (and the CPU
        seconds spent meanwhile), or the first audio of a take started at the Stop."""
        token = CancelToken()
        chunks = self.start(token)
        for _ in range(k):
            next(chunks)
        time.sleep(self.delay)  # a person's Stop, some time into what the worker does next
        cpu = process_cpu_s()
        token.cancel()
        if next_take:
            result = {"next_first_audio_s": self.first_audio()}
        else:
            result = {"freed_s": freed_after(self.engine), "freed_cpu_s": process_cpu_s() - cpu}
        chunks.close()
        freed_after(self.engine)
        return result


def run(tts: CosyVoice3, seconds: int, repeats: int, delay: float, work: Path) -> dict[str, object]:
    takes = Takes(tts, 25 * seconds, delay, work)
    takes.first_audio(seed=0)  # warm-up: allocations, the voice's flow prefix
    n_chunks = sum(1 for _ in takes.start())
    idle = [takes.first_audio() for _ in range(repeats + 1)]
    rows = []
    for k in range(1, n_chunks):
        freed = [takes.stopped_after(k, next_take=False) for _ in range(repeats)]
        nexts = [takes.stopped_after(k, next_take=True) for _ in range(repeats)]
        rows.append({"k": k, "freed_s": [r["freed_s"] for r in freed], "freed_cpu_s": [r["freed_cpu_s"] for r in freed],
                     "next_first_audio_s": [r["next_first_audio_s"] for r in nexts]})
    return {"chunks": n_chunks, "idle_first_audio_s": idle, "rows": rows}


def table(result: dict[str, object]) -> str:
    def p50(values: list[float]) -> str:
        return f"{float(np.percentile(values, 50)):.2f}"

    n = result["chunks"]
    lines = ["| Stop after chunk (+ delay) | then due | freed after (wall s, p50 / max) | CPU s until freed "
             "(p50) | next take's first audio from the Stop (p50 / max) |", "| --- | --- | --- | --- | --- |"]
    for row in result["rows"]:
        on = "the last call" if row["k"] == n - 1 else f"chunk {row['k'] + 1}"
        lines.append(f"| {row['k']} of {n} | {on} | {p50(row['freed_s'])} / {max(row['freed_s']):.2f} | "
                     f"{p50(row['freed_cpu_s'])} | {p50(row['next_first_audio_s'])} / "
                     f"{max(row['next_first_audio_s']):.2f} |")
    idle = result["idle_first_audio_s"]
    lines.append(f"| (no Stop: an idle engine) | | | | {p50(idle)} / {max(idle):.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, help="a bundle (default: a random one at the released sizes)")
    parser.add_argument("--tiny", action="store_true", help="the tiny test bundle: a smoke run")
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--seconds", type=int, default=10, help="speech of each take")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--delay", type=float, default=1.0, help="seconds from a chunk to the Stop")
    args = parser.parse_args(argv)
    work = scratch_dir("cosyvoice-cancel-")
    model_dir, label = bench_bundle(args.model_dir, args.tiny, work)
    before = load_average()
    tts = CosyVoice3(model_dir, device="cpu", limits=Limits(queue_timeout_seconds=3600),
                     voice_dir=work / "voices", precision=args.precision)
    result = run(tts, args.seconds, args.repeats, args.delay, work)
    tts.engine.close()
    code = _git_commit(Path(cosyvoice.__file__).parent)  # the revision measured, wherever this script lives
    print(f"bundle: {label}; code {code}; {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads; torch {torch.__version__}; precision {tts.model.plan.label}; "
          f"{args.seconds} s takes in {result['chunks']} chunks, the Stop {args.delay} s after a chunk, "
          f"{args.repeats} repeats; "
          f"load average before {before}, after {load_average()}")
    print(table(result))
    return result


if __name__ == "__main__":
    main()
