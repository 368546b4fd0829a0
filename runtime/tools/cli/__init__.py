"""The ``batchscope`` command: ``serve``, ``load``, ``tune``, ``snapshot``, ``trace`` and ``k8s``.

Input mistakes (unknown model, bad flag values, invalid settings) end with exit
status 2 and one line on stderr saying what was wrong; no traceback.

The parts: ``common`` (the parser class, ``UsageError``, the flags made from the
settings schema, the database URL check), ``serve_args`` (``serve``'s flags and their
checks), ``serve`` (running the service), ``load``, ``tune``, ``trace`` and
``snapshot``; here, the parser of them all (``build_parser``) and ``main``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Sequence

from batchscope.load.loadgen import LoadError
from batchscope.tuning.client import TuningError
from runtime.api.errors import BatchScopeError
from runtime.tools.cli.common import EXIT_USAGE, UsageError, _fail, _Parser, check_database_url
from runtime.tools.cli.load import _add_load, _load
from runtime.tools.cli.serve import _serve, end_now, run_service
from runtime.tools.cli.serve_args import (_add_serve, adapter_args, check_device,
                                          device_process_default, load_models, model_settings,
                                          serve_auth, trace_config)
from runtime.tools.cli.snapshot import _snapshot
from runtime.tools.cli.trace import _add_trace, _glued, _trace
from runtime.tools.cli.tune import _add_tune, _tune, tune_options

__all__ = ["EXIT_USAGE", "UsageError", "adapter_args", "build_parser", "check_database_url",
           "check_device", "device_process_default", "end_now", "load_models", "main",
           "model_settings", "run_service", "serve_auth", "trace_config", "tune_options",
           "version_line"]


_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="batchscope", description="BatchScope: batching inference runtime "
                                                    "with a live observability dashboard")
    parser.add_argument("--log-level", default="WARNING", type=str.upper,
                        choices=_LOG_LEVELS,
                        help="DEBUG, INFO, WARNING (the default) or ERROR")
    parser.add_argument("--version", action="version", version=version_line(),
                        help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_serve(sub)
    _add_load(sub)
    _add_tune(sub)
    _add_trace(sub)
    sub.add_parser("snapshot", help="diagnostic snapshots: batchscope snapshot export ...",
                   add_help=False)
    sub.add_parser("k8s", help="Kubernetes manifests for one model: batchscope k8s --model "
                               "NAME ...", add_help=False)
    return parser


def version_line() -> str:
    """What ``batchscope --version`` prints: ``batchscope 0.1.0``."""
    from batchscope.version import version

    return f"batchscope {version()}"


def _leading_log_level(argv: list[str]) -> tuple[str, list[str]]:
    """The ``--log-level`` given before the command, and the words after it.

    ``snapshot`` and ``k8s`` parse their own words, so the global option in front of them
    is taken off here (``batchscope --log-level DEBUG snapshot export ...``); an unknown
    level is refused as argparse refuses it for the other commands."""
    level, i = "WARNING", 0
    while i < len(argv) and argv[i].startswith("--log-level"):
        word = argv[i]
        if word == "--log-level" and i + 1 < len(argv):
            value, i = argv[i + 1], i + 2
        elif word.startswith("--log-level="):
            value, i = word.split("=", 1)[1], i + 1
        else:
            break
        level = value.upper()
        if level not in _LOG_LEVELS and argv[i:i + 1] in (["snapshot"], ["k8s"]):
            choices = ", ".join(repr(name) for name in _LOG_LEVELS)
            raise UsageError(f"batchscope: argument --log-level: invalid choice: {value!r} "
                             f"(choose from {choices}) (see batchscope --help)")
    if level not in _LOG_LEVELS:
        level = "WARNING"  # the parser below says what is wrong for the other commands
    return level, argv[i:]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv == ["--version"]:
        print(version_line())
        return 0
    try:
        level, rest = _leading_log_level(argv)
        if rest[:1] in (["snapshot"], ["k8s"]):
            logging.basicConfig(level=getattr(logging, level),
                                format="%(asctime)s %(levelname)s %(name)s: %(message)s")
            if rest[0] == "snapshot":
                return _snapshot(rest[1:])
            from batchscope.deploy import k8s

            return k8s.main(rest[1:])
        if "trace" in argv:
            argv = _glued(argv)
        args = build_parser().parse_args(argv)
        logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.WARNING),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        if args.command == "serve":
            return _serve(args)
        if args.command == "tune":
            return _tune(args)
        if args.command == "trace":
            return _trace(args)
        return _load(args)
    except UsageError as exc:
        return _fail(str(exc))
    except BatchScopeError as exc:  # ConfigError from the loader, ...
        return _fail(f"batchscope: {exc.message}")
    except (LoadError, TuningError) as exc:  # bad load options, unreachable server, ...
        return _fail(f"batchscope: {exc.message}")
    except KeyboardInterrupt:
        return 130
