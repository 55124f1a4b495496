"""What the command groups share: exit statuses, results, the store arguments, argument types.

A command is a function ``handler(args) -> CommandResult``; it raises a
:class:`~gradpipe.errors.GradpipeError` for what went wrong, and
:mod:`gradpipe.cli._app` turns that into a one-line message and an exit status.
This module is imported for ``--help``: it must not import numpy or dask.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, NoReturn

from gradpipe.core.display import PATH_LIMIT, printable
from gradpipe.errors import InvalidInputError, NotFoundError

if TYPE_CHECKING:
    from gradpipe.core.report import Report
    from gradpipe.storage.store import Mode, Store

__all__ = [
    "EXIT_FAILED",
    "EXIT_OK",
    "EXIT_USAGE",
    "ArgumentParser",
    "CommandResult",
    "Commands",
    "Handler",
    "MissingStoreError",
    "UsageError",
    "add_report_argument",
    "json_text",
    "open_store_arg",
    "parse_duration",
    "parse_report_path",
    "positive_int",
    "report_result",
    "storage_options",
    "with_performance_report",
]

EXIT_OK: Final = 0
EXIT_FAILED: Final = 1
EXIT_USAGE: Final = 2


@dataclass(frozen=True)
class CommandResult:
    """What a command hands back: a JSON document, a text rendering, an exit status.

    ``text`` is for people: ``main`` escapes what is not printable in it (line
    breaks kept), unless ``verbatim`` says it is a machine format (CSV) printed
    as it is.
    """

    doc: dict[str, Any]
    text: str
    status: int = EXIT_OK
    verbatim: bool = False


Handler = Callable[[argparse.Namespace], CommandResult]


def report_result(store_url: str, report: Report, *, hints: str = "") -> CommandResult:
    """What a command that ran an operation prints: the report's own words.

    ``summary()`` (then ``hints``) as text, ``to_dict()`` with the store URL
    under ``--json``, and exit 1 when the report is not ``ok``: one rendering
    per report, shared by the command line, workflows and Python callers.
    """
    text = report.summary() + (f"\n{hints}" if hints else "")
    status = EXIT_OK if report.ok else EXIT_FAILED
    return CommandResult({"store": store_url, **report.to_dict()}, text, status)


def with_performance_report(result: CommandResult, path: str) -> CommandResult:
    """``result`` of a job run with ``--report``: it says where the report went."""
    return CommandResult(
        {**result.doc, "performance_report": path},
        f"{result.text}\nperformance report: {path}",
        result.status,
    )


class UsageError(Exception):
    """argparse rejected the command line (raised by :meth:`ArgumentParser.error`)."""

    def __init__(self, prog: str, message: str) -> None:
        super().__init__(message)
        self.prog = prog


class ArgumentParser(argparse.ArgumentParser):
    """An argparse parser whose errors reach ``main`` as :class:`UsageError`.

    ``main`` then prints one line (and, with ``--json``, one JSON object) and
    exits 2, as for every other usage error.
    """

    def error(self, message: str) -> NoReturn:
        raise UsageError(self.prog, message)


class MissingStoreError(NotFoundError):
    """The STORE argument names no store: a usage error (exit 2), not a failed object."""


class Commands:
    """The table of subcommands that each command group's ``register`` adds to."""

    def __init__(self, subparsers: argparse._SubParsersAction[ArgumentParser]) -> None:
        self._subparsers = subparsers

    def add(self, name: str, handler: Handler, help: str, *, store: bool = True) -> ArgumentParser:
        """A new subcommand ``name`` with ``--json`` (and STORE, -S unless ``store=False``)."""
        parser = self._subparsers.add_parser(name, help=help, description=help)
        if store:
            parser.add_argument(
                "store", metavar="STORE", help="store URL: a path, file:// or s3://bucket/prefix"
            )
            parser.add_argument(
                "-S",
                "--storage-option",
                action="append",
                default=[],
                metavar="KEY=VALUE",
                help="fsspec storage option (repeatable), e.g. endpoint_url=http://127.0.0.1:9000",
            )
        parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
        parser.set_defaults(handler=handler)
        return parser


# --- the store argument --------------------------------------------------------
#: A top-level list longer than this is written one compact item per line.
_LONG_LIST: Final = 64


def json_text(doc: dict[str, Any]) -> str:
    """``doc`` as indented JSON, each long top-level list one compact item per line.

    ``json.dumps`` with ``indent`` runs in pure Python: the records of a long
    run (``gradpipe stats``: a quarter of a million) take seconds that the C
    encoder, called once per item, does not. Short documents read as before.
    """
    long = {k for k, v in doc.items() if isinstance(v, list) and len(v) > _LONG_LIST}
    text = json.dumps({k: [] if k in long else v for k, v in doc.items()}, indent=2, default=str)
    for key in long:
        marker = f"{json.dumps(key)}: []"
        lines = ",\n".join("    " + json.dumps(item, default=str) for item in doc[key])
        head, tail = text.split("\n  " + marker, 1)
        text = f"{head}\n  {json.dumps(key)}: [\n{lines}\n  ]{tail}"
    return text


def storage_options(pairs: Sequence[str]) -> dict[str, Any] | None:
    """``-S KEY=VALUE`` pairs as fsspec storage options (values parsed as JSON when they are)."""
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise InvalidInputError(f"-S/--storage-option takes KEY=VALUE, got {printable(pair)}")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options or None


def open_store_arg(args: argparse.Namespace, mode: Mode) -> Store:
    """The store named by STORE.

    Only ``init``, ``ingest`` and ``demo`` create a store (``mode="a"``); every
    other command opens with ``"r"`` or ``"r+"``, so a mistyped path is an
    error (exit 2) that names it and suggests ``gradpipe init``, never a new
    empty store.
    """
    from gradpipe.storage.open import open_store

    options = storage_options(args.storage_option)
    try:
        return open_store(args.store, mode=mode, storage_options=options)
    except NotFoundError as exc:
        raise MissingStoreError(str(exc)) from None


def aligned_lines(rows: Sequence[Sequence[str]], *, right: Collection[int] = ()) -> list[str]:
    """``rows`` of cells as text lines, each column as wide as its widest cell.

    Columns whose index is in ``right`` are right-aligned, the others left-aligned; a row
    may have more cells than others (a trailing note), trailing spaces are dropped.
    """
    widths: list[int] = []
    for row in rows:
        for i, cell in enumerate(row):
            if i == len(widths):
                widths.append(0)
            widths[i] = max(widths[i], len(cell))
    return [
        "  ".join(
            cell.rjust(widths[i]) if i in right else cell.ljust(widths[i])
            for i, cell in enumerate(row)
        ).rstrip()
        for row in rows
    ]


def add_where_arguments(p: argparse.ArgumentParser) -> None:
    """``--scheduler ADDR`` and ``--processes``: where a command's graphs run."""
    p.add_argument("--scheduler", metavar="ADDR", help="Dask scheduler address (default: local)")
    p.add_argument(
        "--processes",
        action="store_true",
        help="without --scheduler: run on single-threaded local processes, one per core, "
        "instead of threads; they share no GIL, so they keep scaling on many cores (about "
        "0.5 s to start them)",
    )


def add_report_argument(p: argparse.ArgumentParser) -> None:
    """``--report OUT.html``, Dask's performance report of a batch job (ingest, aggregate, ...)."""
    p.add_argument(
        "--report",
        metavar="OUT.html",
        type=parse_report_path,
        help="write Dask's performance report of the job to OUT.html (task stream, worker "
        "profile, bandwidth; readable after the job, unlike an in-process cluster's "
        "dashboard); without --scheduler the job runs on an in-process Dask cluster",
    )


def parse_report_path(text: str) -> str:
    """``--report``: a file to write in an existing directory (checked before the job runs)."""
    from pathlib import Path

    path = Path(text).expanduser().absolute()
    if path.is_dir():
        raise argparse.ArgumentTypeError(
            f"{printable(text, limit=PATH_LIMIT)} is a directory; name an HTML file in it"
        )
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(
            f"{printable(text, limit=PATH_LIMIT)}: directory "
            f"{printable(str(path.parent), limit=PATH_LIMIT)} does not exist; create it "
            "or name a file in an existing one"
        )
    return str(path)


# --- argument types --------------------------------------------------------------
def positive_int(text: str) -> int:
    """argparse type of counts such as ``--workers``: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {printable(text)}")
    return value


def parse_duration(text: str) -> float:
    """``24h``, ``30m``, ``0s``, or a number of seconds."""
    from dask.utils import parse_timedelta

    try:
        return float(parse_timedelta(text, default="s"))
    except (KeyError, ValueError, TypeError):
        raise InvalidInputError(
            f"{printable(text)} is not a duration; write e.g. 24h, 30m or 0s"
        ) from None
