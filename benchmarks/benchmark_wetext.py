"""Text normaliser start-up time and per-sentence latency, English and Chinese, through our text frontend.

    python benchmarks/benchmark_wetext.py [--model-dir DIR] [--repeats 20] [--starts 5] [--json PATH]

Start-up is measured in fresh interpreters (median of ``--starts``): import of our text frontend, then the
first English and the first Chinese normalisation (each loads that language's wetext tagger + verbalizer
FSTs); torch is imported first and shown apart (our frontend package imports it). Per-sentence latency is
every call of ``--repeats`` passes over the sentences below, warm, as p50 / p90 per call: ``normalize``
(wetext + cleanup + English number spelling, what prompt texts get) and ``split`` (the same plus cutting
into pieces, what every text to synthesise gets; English pieces are measured in tokens, with the tokenizer
of ``--model-dir`` or else of a generated tiny bundle).

Baseline from the same run: the wetext package's own ``Normalizer`` (``wetext`` 0.1.8, ``operator="tn"``),
which is not what we run (its import loads every FST, and it normalises text without digits too).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

from cosyvoice.backends.cpu import cpu_model

ROOT = Path(__file__).resolve().parent.parent

SENTENCES = {
    "en": [
        "Hello! This is my cloned voice, and it sounds just like me.",
        "The meeting moved to 3:30 pm on March 5th, 2024, in room 101.",
        "It costs $12.99, about 15% less than the 1,250 dollars we paid in 1999.",
        "Call 555-0199 before 8 am; the package weighs 2.5 kg and measures 30 cm.",
        "Dr. Smith read chapter 7 aloud, twice, to the 24 students.",
        "She said she would be back soon, so we waited by the door for a while.",
        "Version 2.13 ran 4x faster on 16 cores with 64 GB of memory.",
        "On 2025-11-23 the temperature dropped to -5 degrees at 6:45.",
    ],
    "zh": [
        "收到好友从远方寄来的生日礼物，那份意外的惊喜与深深的祝福让我心中充满了甜蜜的快乐。",
        "会议定于2024年3月5日下午3点30分在101会议室举行。",
        "这件衣服原价1299元，现在打8.5折，只要1104.15元。",
        "请拨打电话13800138000，或者在早上8点之前发邮件给我们。",
        "今天的气温是零下5摄氏度，湿度为65%，风速每秒3.2米。",
        "我们一起去公园散步吧，天气这么好，不出去走走太可惜了。",
        "第3季度的营收增长了12.5%，达到了2.3亿元。",
        "他在1998年的第15届比赛中获得了第2名，成绩是9.87秒。",
    ],
}

# Each start-up probe runs in a fresh interpreter and prints the seconds of each phase. Ours imports torch
# first, on its own line: the cosyvoice.frontend package imports it (audio), and a server has it loaded anyway.
_PROBE_OURS = """
import json, time
t = time.perf_counter()
import torch
t0 = time.perf_counter()
from cosyvoice.frontend.text import WeTextNormalizer
t1 = time.perf_counter()
n = WeTextNormalizer()
n.normalize({en!r})
t2 = time.perf_counter()
n.normalize({zh!r})
t3 = time.perf_counter()
print(json.dumps({{"torch": t0 - t, "import": t1 - t0, "en": t2 - t1, "zh": t3 - t2}}))
"""
_PROBE_WETEXT = """
import json, time
t0 = time.perf_counter()
from wetext import Normalizer
t1 = time.perf_counter()
Normalizer(lang="en", operator="tn").normalize({en!r})
t2 = time.perf_counter()
Normalizer(lang="zh", operator="tn").normalize({zh!r})
t3 = time.perf_counter()
print(json.dumps({{"torch": 0.0, "import": t1 - t0, "en": t2 - t1, "zh": t3 - t2}}))
"""


def startup(probe: str, starts: int) -> dict[str, float]:
    """Median over fresh interpreters of each start-up phase, in seconds."""
    code = probe.format(en=SENTENCES["en"][1], zh=SENTENCES["zh"][1])
    runs = []
    for _ in range(starts):
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True, text=True)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


def per_call(fn: Callable[[str], object], sentences: list[str], repeats: int) -> dict[str, float]:
    """p50 / p90 / mean of single calls (seconds), after one warm-up pass."""
    for s in sentences:
        fn(s)
    times = []
    for _ in range(repeats):
        for s in sentences:
            start = time.perf_counter()
            fn(s)
            times.append(time.perf_counter() - start)
    times.sort()
    return {"p50": times[len(times) // 2], "p90": times[int(0.9 * (len(times) - 1))], "min": times[0],
            "mean": statistics.fmean(times), "calls": len(times)}


def _tokenizer_dir(model_dir: Path | None) -> tuple[Path, str]:
    if model_dir is not None:
        return model_dir, str(model_dir)
    from benchmark_performance import scratch_dir

    from cosyvoice.tools.make_tiny_bundle import make_tiny_bundle

    return make_tiny_bundle(scratch_dir("cosyvoice-wetext-") / "tiny", seed=0), "tiny bundle's BPE"


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "absent"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, help="take the tokenizer from this model folder")
    parser.add_argument("--repeats", type=int, default=20, help="passes over the sentences per row")
    parser.add_argument("--starts", type=int, default=5, help="fresh interpreters per start-up row")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)

    from wetext import Normalizer

    from cosyvoice.frontend.text import TextFrontend, WeTextNormalizer
    from cosyvoice.frontend.tokenizer import CosyVoice3Tokenizer

    tok_dir, tok_name = _tokenizer_dir(args.model_dir)
    frontend = TextFrontend(CosyVoice3Tokenizer.from_model_dir(tok_dir), WeTextNormalizer())
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": f"cpu: {cpu_model()}, {os.cpu_count()} cores ({platform.machine()})",
        # other processes inflate every number on a shared machine: the load says how much to trust them
        "load_average_1min": {"before": os.getloadavg()[0]},
        "python": platform.python_version(),
        "versions": {d: _version(d) for d in ("wetext", "kaldifst", "inflect", "tokenizers")},
        "tokenizer": tok_name, "repeats": args.repeats, "starts": args.starts,
        "sentences": {lang: len(s) for lang, s in SENTENCES.items()},
    }
    results: dict[str, dict] = {"startup": {"ours": startup(_PROBE_OURS, args.starts),
                                            "wetext": startup(_PROBE_WETEXT, args.starts)},
                                "latency": {}}
    baseline = {lang: Normalizer(lang=lang, operator="tn") for lang in SENTENCES}
    for lang, sentences in SENTENCES.items():
        results["latency"][lang] = {
            "normalize": per_call(frontend.normalize, sentences, args.repeats),
            "split": per_call(frontend.split, sentences, args.repeats),
            "wetext Normalizer": per_call(baseline[lang].normalize, sentences, args.repeats),
        }

    env["load_average_1min"]["after"] = os.getloadavg()[0]
    load = env["load_average_1min"]
    print(f"{env['date']} | {env['device']} | load {load['before']:.1f} -> {load['after']:.1f} | "
          f"python {env['python']} | "
          + " ".join(f"{k} {v}" for k, v in env["versions"].items()) + f" | tokenizer: {tok_name}")
    print(f"\nstart-up (median of {args.starts} fresh interpreters), ms")
    print(f"{'':<10} {'torch':>7} {'import':>8} {'first en':>9} {'first zh':>9} {'total':>8} {'w/o torch':>10}")
    for name, r in results["startup"].items():
        total = sum(r.values())
        print(f"{name:<10} {1e3 * r['torch']:>7.0f} {1e3 * r['import']:>8.0f} {1e3 * r['en']:>9.0f} "
              f"{1e3 * r['zh']:>9.0f} {1e3 * total:>8.0f} {1e3 * (total - r['torch']):>10.0f}")
    print(f"\nper sentence (warm, {args.repeats} passes over {len(SENTENCES['en'])} sentences each), ms")
    print(f"{'lang':<5} {'path':<18} {'p50':>7} {'p90':>7} {'min':>7} {'mean':>7}")
    for lang, rows in results["latency"].items():
        for name, r in rows.items():
            print(f"{lang:<5} {name:<18} {1e3 * r['p50']:>7.3f} {1e3 * r['p90']:>7.3f} {1e3 * r['min']:>7.3f} "
                  f"{1e3 * r['mean']:>7.3f}")
    if args.json:
        args.json.write_text(json.dumps({"env": env, **results}, indent=2, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
