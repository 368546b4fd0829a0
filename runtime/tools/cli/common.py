"""What the subcommands share: the parser class that reports a mistake as a
``UsageError`` (one line on stderr, exit status ``EXIT_USAGE``), the flags made from the
settings schema and the control-token flags, the database URL check and ``_fail``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable, NoReturn

from batchscope import settings as schema

EXIT_USAGE = 2


class UsageError(Exception):
    """A mistake in the command line; reported as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message} (see {self.prog} --help)")


# Every request-model setting of ``batchscope.settings.BATCHING`` is a flag of its own
# (``max_batch_size`` -> ``--max-batch-size``; a true/false one -> ``--bucketing`` /
# ``--no-bucketing``) that applies to every served request model; ``--set`` reaches any
# setting of one model, generation models included. Adding a setting to the schema adds
# its flag and its help text here.
def _flag_type(setting: schema.Setting) -> Callable[[str], Any]:
    """The argparse ``type`` of a setting's flag: ``Setting.parse_text``, with argparse's
    usual wording for a value that is not a number (``invalid int value: 'lots'``)."""

    def parse(text: str) -> Any:
        try:
            return setting.parse_text(text)
        except ValueError as exc:
            if setting.kind in ("int", "float"):
                raise argparse.ArgumentTypeError(
                    f"invalid {setting.kind} value: {text!r}; write {setting.describe()}") from None
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = setting.kind
    return parse


def _flag_help(setting: schema.Setting) -> str:
    text = f"{setting.doc} Valid: {setting.describe()}; default {setting.default_text()}."
    return text.replace("%", "%%")


def _add_setting_flags(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("batching settings (every request model; see also --set)")
    for setting in schema.BATCHING:
        if setting.kind == "bool":
            group.add_argument(setting.flag, dest=setting.name, default=argparse.SUPPRESS,
                               action=argparse.BooleanOptionalAction, help=_flag_help(setting))
        else:
            metavar = {"int_list": "N,N,...", "choice": "{" + ",".join(setting.choices) + "}"
                       }.get(setting.kind, setting.name.upper())
            group.add_argument(setting.flag, dest=setting.name, default=argparse.SUPPRESS,
                               type=_flag_type(setting), metavar=metavar,
                               help=_flag_help(setting))


def _add_token_flags(p: argparse.ArgumentParser, what: str) -> None:
    token = p.add_argument_group(
        f"control token ({what} send 'Authorization: Bearer <token>'; required beyond "
        "loopback, optional on it)")
    token.add_argument("--control-token-file", default=None, metavar="PATH",
                       help="read the token from PATH, a file only its owner may read "
                            "(chmod 600)")
    token.add_argument("--control-token", default=None, metavar="TOKEN",
                       help="the token itself (other local users can see it in the process "
                            "list: prefer --control-token-file or $BATCHSCOPE_CONTROL_TOKEN, "
                            "which is read when neither flag is given)")


def check_database_url(url: str, source: str) -> str:
    """``url`` if SQLAlchemy can open that kind of database here, else a ``UsageError``
    saying what to write (a plain path gets the ``sqlite:///`` URL of that path) or
    which driver is missing."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    example = "sqlite:////abs/path/file.db or postgresql+psycopg://user@host/db"
    if "://" not in url and ":" not in url.split("/", 1)[0]:
        path = Path(url).expanduser().absolute()
        raise UsageError(f"{source} {url!r} is a path, not a database URL; write "
                         f"sqlite:///{path} (sqlite:/// then the absolute path)")
    try:
        dialect = make_url(url).get_dialect()
    except NoSuchModuleError:  # before ArgumentError, its base class
        raise UsageError(f"{source} {url!r}: SQLAlchemy knows no database "
                         f"{url.split(':', 1)[0]!r}; write one like {example}") from None
    except ArgumentError:
        raise UsageError(f"{source} {url!r} is not a database URL; write one like "
                         f"{example}") from None
    try:
        dialect.import_dbapi()
    except ImportError as exc:
        raise UsageError(f"{source} {url!r} needs the database driver {exc.name or exc}, "
                         "which is not installed; install it with pip") from None
    return url


def _fail(message: str) -> int:
    # the whole message: some carry the code to write on the lines after the first
    print(message.rstrip() or "batchscope: error", file=sys.stderr)
    return EXIT_USAGE
