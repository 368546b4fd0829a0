"""Download the wheels the GPU machine lacks into ``.whl/`` (git-ignored), for its Python.

The lent GPU machine runs Python 3.12 (manylinux x86_64) with a CUDA build of torch and
many packages already installed (numpy, grpcio, protobuf, psutil, prometheus-client,
pyyaml, httpx, uvloop, nvidia-ml-py...), and no package index. What BatchScope needs
beyond them is listed in ``NEEDED``; each is downloaded at the version installed here
(so the GPU run uses what the suite tested), as a binary wheel for cp312, without its
dependencies (``NEEDED`` names those the image lacks too). torch is never downloaded.

    python -m benchmarks.gpu.wheels            # -> .whl/*.whl, prints their total size
    python -m benchmarks.gpu.wheels --check    # only say which are there and their size

``benchmarks/gpu/launch.sh`` installs them on the GPU machine into a temporary prefix
and runs the GPU script; ``docs/gpu.md`` says how to send both with the ``run`` tool.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDER = ROOT / ".whl"
#: what the GPU image lacks: BatchScope's own dependencies and theirs (see module doc);
#: then what the server's OpenTelemetry span export imports (``--otlp-traces-endpoint``,
#: the GPU script's ``tracing`` section), protobuf among them: the image has one, but
#: googleapis-common-protos's generated code refuses a runtime older than its own
NEEDED = ("orjson", "sqlalchemy", "greenlet", "starlette", "httptools", "alembic", "mako",
          "optuna", "colorlog", "perfetto", "nvtx", "typing-extensions",
          "opentelemetry-api", "opentelemetry-sdk", "opentelemetry-semantic-conventions",
          "opentelemetry-proto", "opentelemetry-exporter-otlp-proto-grpc",
          "opentelemetry-exporter-otlp-proto-common", "opentelemetry-exporter-otlp-common",
          "googleapis-common-protos", "protobuf")
#: distributions the GPU image holds already (those BatchScope's serving path and GPU
#: script may import; from the machine's package list)
IMAGE = ("torch", "numpy", "grpcio", "protobuf", "psutil", "prometheus-client", "pyyaml",
         "httpx", "httpcore", "h11", "anyio", "sniffio", "certifi", "idna", "uvloop",
         "nvidia-ml-py", "markupsafe", "jinja2", "packaging", "tqdm", "pandas", "filelock",
         "fsspec", "sympy", "networkx", "mpmath", "triton", "setuptools", "python-dateutil",
         "six", "tzdata", "pytz", "attrs", "requests", "urllib3", "charset-normalizer",
         "pyarrow", "cloudpickle")
#: the wheel folder must fit in one device call's carry with the repository
MAX_TOTAL_MB = 32.0
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")


def pinned() -> list[str]:
    """``NAME==VERSION`` of each needed package as installed here."""
    out = []
    for name in NEEDED:
        try:
            out.append(f"{name}=={md.version(name)}")
        except md.PackageNotFoundError:
            raise SystemExit(f"{name} is not installed here; install the project's test "
                             "extra first (tests/run.sh does)") from None
    return out


def download(spec: str) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.12", "--implementation", "cp", "-q", "-d", str(FOLDER)]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    cmd.append(spec)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:  # a pure-Python wheel has no platform: try without one
        plain = [c for c in cmd if c not in PLATFORMS and c != "--platform"]
        done = subprocess.run(plain[:-1] + ["--python-version", "3.12", spec],
                              capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"could not download {spec}:\n{done.stderr[-2000:]}")


def wheels() -> list[Path]:
    return sorted(FOLDER.glob("*.whl"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only list what is there")
    args = ap.parse_args()
    FOLDER.mkdir(exist_ok=True)
    if not args.check:
        for old in wheels():  # one version of each: two stop the install there
            old.unlink()
        for spec in pinned():
            download(spec)
    found = wheels()
    total = sum(w.stat().st_size for w in found) / 2**20
    for w in found:
        print(f"{w.stat().st_size / 2**20:6.2f} MB  {w.name}")
    print(f"{len(found)} wheels, {total:.1f} MB in {FOLDER} (limit {MAX_TOTAL_MB:g} MB)")
    if any(w.name.startswith("torch-") for w in found):
        raise SystemExit("a torch wheel is in the folder: remove it (the GPU machine has its own)")
    if total > MAX_TOTAL_MB:
        raise SystemExit("the wheels are too large to carry")


if __name__ == "__main__":
    main()
