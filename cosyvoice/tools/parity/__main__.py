"""``python -m cosyvoice.tools.parity --golden DIR``: per-component parity table, exit 1 on any FAIL."""

from __future__ import annotations

import os

# Before torch loads: MKL's FFT rounding is CPU-dependent unless this selects its reproducible path,
# and the golden feature fixtures match that path (see tests/conftest.py).
os.environ.setdefault("MKL_CBWR", "COMPATIBLE")

import argparse
import importlib
import inspect
import sys
import time
import traceback

import torch

from cosyvoice.tools.parity import COMPONENTS
from cosyvoice.tools.parity.common import Golden, Result


def run_component(name: str, golden: Golden, device: str = "cpu") -> list[Result]:
    """Run one component's checks; an exception is reported as a FAIL row, never swallowed silently.

    Model components run on ``device``; the frontend's features are always computed on the CPU (as the
    engine does: CUDA FFTs round differently enough to move near-silent log-mel values by ~1e-3).
    """
    try:
        module = importlib.import_module(f"cosyvoice.tools.parity.{name}")
        if "device" in inspect.signature(module.check).parameters:
            return module.check(golden, device=device)
        return module.check(golden)
    except Exception as exc:  # the tool reports every component, even one that crashes
        detail = traceback.format_exception_only(type(exc), exc)[-1].strip()
        return [Result(name, "(error)", float("inf"), float("inf"), 0.0, False, detail[:300])]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--golden", required=True, help="golden fixture folder (layout of ../shared/golden)")
    parser.add_argument("--only", nargs="*", choices=COMPONENTS, help="run only these components")
    parser.add_argument("--device", default="cpu", help="device for the networks (cpu, cuda, cuda:1, ...)")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                        help="bf16 (CUDA only): also report how far the bf16 LLM and flow move outputs from fp32")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (the fixtures were made with 1)")
    args = parser.parse_args(argv)
    if args.dtype == "bf16" and not args.device.startswith("cuda"):
        parser.error("--dtype bf16 runs the LLM and flow in bfloat16, which needs --device cuda")
    torch.set_num_threads(args.threads)
    if args.device.startswith("cuda"):
        torch.backends.cudnn.allow_tf32 = False  # as the engine does; see docs/differences.md
    golden = Golden(args.golden)
    print(f"golden: {golden.root}   torch {torch.__version__}   device {args.device}   float32"
          f"{' (+ bf16 report)' if args.dtype == 'bf16' else ''}   threads {args.threads}")
    print(f"{'component':<10} {'check':<40} {'max_abs':>11} {'mean_abs':>11} {'tol':>9}  result")
    failed = 0
    total = 0
    for name in [*(args.only or COMPONENTS), *(["bf16"] if args.dtype == "bf16" else [])]:
        start = time.perf_counter()
        results = run_component(name, golden, args.device)
        for r in results:
            print(r.row())
        failed += sum(not r.passed for r in results)
        total += len(results)
        print(f"{'':<10} ({name}: {len(results)} checks, {time.perf_counter() - start:.1f} s)")
    print(f"{total - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
