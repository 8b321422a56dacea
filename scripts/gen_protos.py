"""Regenerate the Python stubs under specwire/v1/ from protos/specwire/v1/*.proto.

Usage: python scripts/gen_protos.py [--out DIR]   (DIR defaults to the repository root)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"


def generate(out_dir: Path) -> list[Path]:
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / "specwire" / "v1").glob("*.proto"))
    include = str(Path(protoc.__file__).parent / "_proto")
    args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}", *protos]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    return sorted((out_dir / "specwire" / "v1").glob("*_pb2*.py*"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT)
    args = parser.parse_args()
    for path in generate(args.out):
        print(path.relative_to(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
