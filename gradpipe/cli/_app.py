"""The ``gradpipe`` command: parser assembly, running a command, errors to exit statuses.

Commands live in command-group modules (``gradpipe/cli/<group>.py``), each with
a ``register(commands)`` function. Adding a command group is one module and
one line in :data:`COMMAND_GROUPS`.
"""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Sequence
from typing import Final

from gradpipe.cli._common import (
    EXIT_FAILED,
    EXIT_USAGE,
    ArgumentParser,
    CommandResult,
    Commands,
    MissingStoreError,
    UsageError,
    json_text,
)
from gradpipe.core.display import printable_text
from gradpipe.errors import GradpipeError, InvalidInputError, UnsupportedFormatError

__all__ = ["COMMAND_GROUPS", "build_parser", "exit_status", "main"]

#: Command-group modules under ``gradpipe.cli``, in the order ``--help`` lists them.
COMMAND_GROUPS: Final[tuple[str, ...]] = (
    "store",  # init, ls, verify, gc
    "ingest",
    "aggregate",
    "rounds",
    "evaluate",
    "export",
    "snapshots",  # snapshot, restore, log, prune
    "workflow",  # run
    "stats",
    "analyze",  # analyze, diff
    "demo",
)

#: Exit status 130 is the shell's for a command stopped by Ctrl-C.
EXIT_INTERRUPTED: Final = 130
#: The longest error message printed; names in it are shortened where they are
#: formatted, so only a message that forgot to is cut here.
MESSAGE_LIMIT: Final = 2000


def build_parser() -> ArgumentParser:
    """The argument parser of the ``gradpipe`` command."""
    from gradpipe._version import __version__

    parser = ArgumentParser(
        prog="gradpipe",
        description="Keep, inspect and reuse the gradients and training state of training runs.",
        epilog="Exit status: 0 success, 1 some input or stored object failed, 2 usage error "
        "(gradpipe run: 3 infrastructure errors outlived the retries).",
    )
    parser.add_argument("--version", action="version", version=f"gradpipe {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    commands = Commands(subparsers)
    for group in COMMAND_GROUPS:
        importlib.import_module(f"gradpipe.cli.{group}").register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``gradpipe`` command; returns the exit status.

    A command line argparse rejects raises ``SystemExit(2)`` after printing
    one line (argparse's own convention; ``--help`` and ``--version`` exit 0).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:  # argparse would blame "gradpipe", not the command they were given to
            raise UsageError(
                f"gradpipe {args.command}", f"unrecognized arguments: {' '.join(extra)}"
            )
    except UsageError as exc:
        _report(exc.prog, f"{exc}; see `{exc.prog} --help`", "UsageError", as_json="--json" in argv)
        raise SystemExit(EXIT_USAGE) from None
    prog = f"gradpipe {args.command}"
    try:
        result: CommandResult = args.handler(args)
    except KeyboardInterrupt:
        _report(prog, "interrupted", "KeyboardInterrupt", as_json=args.json)
        return EXIT_INTERRUPTED
    except Exception as exc:  # the contract: a message (and JSON), never a traceback
        _report(prog, _message(exc), _public_type(exc), as_json=args.json)
        # A command whose exit 1 means something else (gradpipe diff: "different") fails with 2.
        return getattr(args, "error_status", None) or exit_status(exc)
    if args.json:
        print(json_text(result.doc))
    elif result.verbatim:
        print(result.text)
    else:
        print(_printable_lines(result.text))
    return int(result.status)


def _printable_lines(text: str) -> str:
    """``text`` with each line's non-printable characters escaped, its line breaks kept.

    The last line of defence: names are escaped where they are formatted, and
    whatever one forgot (a path, a stored message) must still not act on the
    terminal or forge a line of the report.
    """
    return "\n".join(printable_text(line) for line in text.split("\n"))


def exit_status(exc: BaseException) -> int:
    """2 for what the user typed (arguments, URLs, names, a store that is not there), else 1."""
    if isinstance(exc, UnsupportedFormatError):  # data too new for this gradpipe: not usage
        return EXIT_FAILED
    if isinstance(exc, InvalidInputError | MissingStoreError):
        return EXIT_USAGE
    return EXIT_FAILED


def _message(exc: BaseException) -> str:
    text = str(exc).strip()  # exact: --json shows it so; the text line is made one in _report
    if isinstance(exc, GradpipeError) and text:
        return text
    if isinstance(exc, OSError) and text:  # e.g. writing -o: the OS says what and where
        return text
    # Not one of ours: a bug, whose type is the only clue when it has no words.
    name = type(exc).__name__
    return (
        f"{name}: {text}"
        if text
        else f"{name} (an internal error; please report it with the command line that caused it)"
    )


def _public_type(exc: BaseException) -> str:
    """The name of the nearest public exception class (gradpipe.errors or builtins)."""
    for cls in type(exc).__mro__:
        if cls.__module__ in ("gradpipe.errors", "builtins"):
            return cls.__name__
    return type(exc).__name__


def _report(prog: str, message: str, kind: str, *, as_json: bool) -> None:
    if as_json:  # the exact message: JSON escapes it itself, and programs compare it
        print(json.dumps({"ok": False, "error": message, "type": kind}))
    # One line, bounded, nothing a terminal acts on.
    text = printable_text(" ".join(message.splitlines()), limit=MESSAGE_LIMIT)
    print(f"{prog}: error: {text}", file=sys.stderr)
