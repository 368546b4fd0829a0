"""Rebuild the descriptor sets next to this file from the ``.proto`` sources beside it.

    python runtime/server/grpc/protos/regenerate.py

needs ``grpcio-tools`` (a development tool, not a runtime dependency: the server reads
the committed ``.binpb`` files with ``protobuf`` alone). Two sets are written:

* ``inference.binpb``: Triton's ``grpc_service.proto`` with the ``model_config.proto``
  it imports, the service the server registers;
* ``kserve_predict_v2.binpb``: KServe's ``grpc_predict_v2.proto``, kept only to check
  (``tests/test_grpc_protocol.py``) that the KServe messages are wire-identical to
  Triton's (both declare package ``inference``, so they never share a pool).

``--check`` rebuilds into memory and exits 1 when a committed set differs.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
#: descriptor set -> the .proto it is built from (imports are included)
SETS = {"inference.binpb": "grpc_service.proto",
        "kserve_predict_v2.binpb": "grpc_predict_v2.proto"}


def build(proto: str) -> bytes:
    """The serialized ``FileDescriptorSet`` of ``proto`` and its imports."""
    from grpc_tools import protoc  # development tool: imported only here

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "set.binpb"
        code = protoc.main(["protoc", f"-I{HERE}", f"--descriptor_set_out={out}",
                            "--include_imports", str(HERE / proto)])
        if code != 0:
            raise SystemExit(f"protoc failed on {proto} (exit {code})")
        return out.read_bytes()


def main(argv: list[str]) -> int:
    check = "--check" in argv
    stale = []
    for target, proto in SETS.items():
        data = build(proto)
        path = HERE / target
        if check:
            if not path.exists() or path.read_bytes() != data:
                stale.append(target)
        else:
            path.write_bytes(data)
            print(f"wrote {path} ({len(data)} bytes)")
    if stale:
        print(f"out of date: {', '.join(stale)}; run python {Path(__file__)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
