"""``batchscope snapshot export``: handed to ``batchscope.presentation.snapshot``,
which needs the dashboard packages."""

from __future__ import annotations

from runtime.tools.cli.common import UsageError, _fail


def _snapshot(argv: list[str]) -> int:
    try:
        from batchscope.presentation import snapshot
    except ImportError as exc:
        raise UsageError(f"snapshot export needs the dashboard packages ({exc.name} is not "
                         "installed); install them with: pip install 'batchscope[dashboard]'"
                         ) from None
    export = snapshot.cli_export
    if argv[:1] in (["-h"], ["--help"]):
        print("usage: batchscope snapshot export [options]; its options: "
              "batchscope snapshot export --help")
        return 0
    if argv[:1] != ["export"]:
        raise UsageError("usage: batchscope snapshot export [options]; see "
                         "batchscope snapshot export --help")
    from sqlalchemy.exc import ArgumentError, SQLAlchemyError

    from batchscope.storage.db import DatabaseNotFound

    try:
        return int(export(argv[1:]) or 0)
    except DatabaseNotFound as exc:
        return _fail(f"batchscope snapshot export: {exc}")
    except ArgumentError as exc:
        return _fail(f"batchscope snapshot export: --db is not a database URL ({exc}); give "
                     "one such as sqlite:///data/batchscope.db")
    except SQLAlchemyError as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return _fail(f"batchscope snapshot export: cannot read the database: {first[:300]}")
    except OSError as exc:
        return _fail(f"batchscope snapshot export: cannot write the snapshot "
                     f"({exc.strerror or exc}: {exc.filename or ''}); give --out a .zip path "
                     "in a folder that exists")
