"""Regenerate the gRPC stubs from ``cosyvoice.proto``: ``python -m cosyvoice.server.proto.generate``.

The stubs are committed (servers need no build step) and a test checks that they are what this
command writes, so an edit to the .proto without regenerating fails CI. The output depends on the
grpcio-tools version, which the ``dev`` extra pins.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

PROTO = Path(__file__).with_name("cosyvoice.proto")
REPO_ROOT = PROTO.parents[3]  # the stubs import each other as cosyvoice.server.proto.*, so protoc runs from here
GENERATED = ("cosyvoice_pb2.py", "cosyvoice_pb2.pyi", "cosyvoice_pb2_grpc.py")


def generate(out_root: Path = REPO_ROOT) -> list[Path]:
    """Write the stubs under ``out_root``/cosyvoice/server/proto/ and return their paths."""
    from grpc_tools import protoc  # a development tool: servers only need grpcio and protobuf

    out_root = Path(out_root)
    rel = PROTO.relative_to(REPO_ROOT)
    (out_root / rel.parent).mkdir(parents=True, exist_ok=True)
    status = protoc.main(["grpc_tools.protoc", f"-I{REPO_ROOT}", f"--python_out={out_root}",
                          f"--pyi_out={out_root}", f"--grpc_python_out={out_root}", str(rel)])
    if status != 0:
        raise RuntimeError(f"protoc failed on {PROTO} (exit status {status})")
    return [out_root / rel.parent / name for name in GENERATED]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT, help="root to write cosyvoice/server/proto/ under")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
