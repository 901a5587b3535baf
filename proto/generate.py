"""Regenerates the Python code for every .proto in this folder:

    python -m vllm_cluster.proto.generate          # writes proto/*_pb2.py, *_pb2_grpc.py, *_pb2.pyi
    python -m vllm_cluster.proto.generate --check  # exits 1 when the committed code is stale

Imports in the generated code, and the .proto files' own imports, are rooted at the import
namespace (`from vllm_cluster.proto import ...`, `import "vllm_cluster/proto/x.proto"`):
protoc runs over a temporary include tree in which vllm_cluster/proto is this folder.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
PACKAGE = Path("vllm_cluster", "proto")  # where the generated modules are imported from


def generate(out_dir: Path) -> list[Path]:
    from grpc_tools import protoc  # dev dependency; only this script needs it

    include = out_dir / "include"
    (include / PACKAGE).parent.mkdir(parents=True)
    (include / PACKAGE).symlink_to(PROTO_DIR, target_is_directory=True)
    sources = sorted(PROTO_DIR.glob("*.proto"))
    args = [
        "grpc_tools.protoc",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(PACKAGE / s.name) for s in sources),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {[s.name for s in sources]}")
    return sorted((out_dir / PACKAGE).glob("*_pb2*.py*"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail when the generated code is stale")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        stale = [f.name for f in fresh if not (PROTO_DIR / f.name).exists()
                 or not filecmp.cmp(f, PROTO_DIR / f.name, shallow=False)]
        if args.check:
            if stale:
                print(f"stale generated code: {stale}; run `python -m vllm_cluster.proto.generate`", file=sys.stderr)
                return 1
            return 0
        for f in fresh:
            (PROTO_DIR / f.name).write_bytes(f.read_bytes())
        print(f"wrote {len(fresh)} files to {PROTO_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
