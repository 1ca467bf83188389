"""Export the flow estimator (DiT) and the vocoder of a model bundle to ONNX, check them, compare with PyTorch.

    python -m cosyvoice.bin.export_onnx [MODEL_DIR] [--out DIR] [--fp16] [--int8]

Writes the graphs and ``manifest.json`` into ``--out`` (default ``MODEL_DIR/onnx``) and prints the parity of
onnxruntime against PyTorch as a table; the work is :func:`cosyvoice.backends.export.export_onnx`'s.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from cosyvoice.backends.export import (
    ATOL,
    LOW_PRECISION_ATOL,
    LOW_PRECISION_RTOL,
    MANIFEST,
    RTOL,
    VOCODER_RTOL,
    export_onnx,
    parity_table,
)
from cosyvoice.bundle import MODEL_IN_REPO
from cosyvoice.errors import command_line_errors
from cosyvoice.tools.make_tiny_bundle import model_dir_or_demo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cosyvoice.bin.export_onnx", description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", nargs="?", help=f"a model directory (default: {MODEL_IN_REPO} of this "
                                                     "repository, else the demo model, as the web UI)")
    parser.add_argument("--out", help="output folder (default MODEL_DIR/onnx)")
    parser.add_argument("--fp16", action="store_true", help="also write autocast-fp16 DiT graphs (for TensorRT)")
    parser.add_argument("--int8", action="store_true", help="also write int8 dynamic-quantised DiT graphs (CPU)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with command_line_errors():
        model_dir = model_dir_or_demo(args.model_dir)[0]
        manifest = export_onnx(model_dir, args.out, args.fp16, args.int8)
    print(parity_table(manifest))
    print(f"tolerance: max |onnxruntime - pytorch| <= {ATOL:g} + rtol x max |pytorch|, rtol {RTOL:g} for the DiT, "
          f"{VOCODER_RTOL:g} for the vocoder (fp16, int8: {LOW_PRECISION_ATOL:g} + {LOW_PRECISION_RTOL:g} x max); "
          f"manifest: {Path(args.out or Path(model_dir) / 'onnx') / MANIFEST}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
