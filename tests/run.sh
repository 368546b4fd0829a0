#!/usr/bin/env bash
# Installs everything the test suite needs into .venv and runs it.
#   bash tests/run.sh            # the whole suite
#   bash tests/run.sh -k engine  # extra arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."

# Browser tests drive Debian's chromium through Playwright (no browser download).
if [ ! -x /usr/bin/chromium ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  else
    echo "note: /usr/bin/chromium is missing; install it (apt-get install chromium) to run the browser tests" >&2
  fi
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q "torch==2.13.0" -e ".[dashboard,test,minilm]"

export PYTHONUNBUFFERED=1
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
