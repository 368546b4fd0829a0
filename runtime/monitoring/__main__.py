"""``python -m runtime.monitoring DIR``: write the Grafana dashboard and alert rules to DIR."""

from __future__ import annotations

import sys
from pathlib import Path

from runtime.monitoring import ASSETS, asset_text


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m runtime.monitoring DIR", file=sys.stderr)
        return 2
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    for name in ASSETS:
        (out / name).write_text(asset_text(name), encoding="utf-8")
        print(out / name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
