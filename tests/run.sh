#!/usr/bin/env bash
# Installs everything the test suite needs into .venv and runs it.
#   bash tests/run.sh            # the whole suite
#   bash tests/run.sh -k engine  # extra arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."

# need PACKAGE NOTE: install Debian's PACKAGE (as root, with apt-get), else print NOTE
need() {
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$1" >/dev/null
  else
    echo "note: $2" >&2
  fi
}

# Browser tests drive Debian's chromium through Playwright (no browser download).
[ -x /usr/bin/chromium ] || need chromium \
  "/usr/bin/chromium is missing; install it (apt-get install chromium) to run the browser tests"

# The storage, query and dashboard tests also run against a throw-away PostgreSQL server
# that the suite starts with Debian's server binaries (tests/conftest.py finds pg_ctl in
# /usr/lib/postgresql/*/bin; as root it runs the server as the postgres user).
if ! ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1 && ! command -v pg_ctl >/dev/null; then
  need postgresql "PostgreSQL server binaries are missing; install them (apt-get install \
postgresql), or the PostgreSQL tests fail (BATCHSCOPE_TEST_BACKENDS=sqlite leaves them out)"
fi

# promtool (Debian's prometheus package) checks and unit-tests the shipped alert rules.
command -v promtool >/dev/null || need prometheus \
  "promtool is missing; install it (apt-get install prometheus) to test the alert rules"

# valgrind: the instruction-count benchmark's test reads callgrind's own dumps.
command -v valgrind >/dev/null || need valgrind \
  "valgrind is missing; install it (apt-get install valgrind) or its test skips"

# A C/C++ compiler: torch.compile's CPU backend builds its kernels with it, and the NVTX
# test builds benchmarks/gpu/nvtx_tool.c.
if ! command -v g++ >/dev/null || ! command -v cc >/dev/null; then
  need g++ "no C/C++ compiler; install one (apt-get install g++) or the compile and NVTX \
tests skip or fail"
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# --no-cache-dir: pip would otherwise keep a second copy of every wheel it downloads
# in its cache; the venv itself takes about 3 GB
free_kib=$(df -Pk . | awk 'NR==2 {print $4}')
if [ "${free_kib:-0}" -lt 4000000 ]; then
  echo "note: $((free_kib / 1024)) MiB free here; the install needs about 3 GB" >&2
fi
.venv/bin/python -m pip install -q --no-cache-dir "torch==2.13.0" -e ".[dashboard,test,minilm]"

export PYTHONUNBUFFERED=1
# a temporary folder of this run's own: pytest prunes old folders under its shared default
# root, which would pull the data folder from under the PostgreSQL server of a run going on
# beside this one
BASETEMP=$(mktemp -d -t batchscope-tests-XXXXXX)
exec .venv/bin/python -m pytest -q -p no:cacheprovider --basetemp="$BASETEMP" "$@"
