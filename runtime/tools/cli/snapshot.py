"""``batchscope snapshot export``: handed to ``batchscope.presentation.snapshot``,
which needs the dashboard packages."""

from __future__ import annotations

from runtime.tools.cli.common import UsageError


def _snapshot(argv: list[str]) -> int:
    try:
        from batchscope.presentation import snapshot
    except ImportError as exc:
        raise UsageError(f"snapshot export needs the dashboard packages ({exc.name} is not "
                         "installed); install them with: pip install 'batchscope[dashboard]'"
                         ) from None
    export = snapshot.cli_export
    if argv[:1] != ["export"]:
        raise UsageError("usage: batchscope snapshot export [options]; see "
                         "batchscope snapshot export --help")
    return int(export(argv[1:]) or 0)
