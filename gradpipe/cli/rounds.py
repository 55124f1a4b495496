"""``gradpipe rounds``: show, and set, the roster, quorum and peer statuses of a run's steps."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from gradpipe.cli._common import (
    CommandResult,
    Commands,
    open_store_arg,
    parse_duration,
    report_result,
)
from gradpipe.core.display import printable
from gradpipe.errors import InvalidInputError

__all__ = ["parse_peers", "register"]


def register(commands: Commands) -> None:
    """Add ``rounds``."""
    p = commands.add(
        "rounds",
        run_rounds,
        "show each step's round (expected peers, who delivered, quorum, readiness); "
        "set the roster, quorum, deadline or failed peers",
    )
    p.add_argument("--run", required=True, help="the run")
    p.add_argument(
        "--expect",
        metavar="PEERS",
        help="the roster: peers expected at every step, comma-separated or @FILE (one a line); "
        "default: the peers seen in any step",
    )
    p.add_argument(
        "--quorum",
        metavar="Q",
        help="all (default), N (at least N peers) or a share of the roster (0.75 or 75%%)",
    )
    p.add_argument(
        "--deadline",
        metavar="DURATION",
        help="after START + DURATION (e.g. 30m), missing peers count as failed and a step "
        "with at least one peer is ready; 0 clears it",
    )
    p.add_argument(
        "--start",
        metavar="TIME",
        help="ISO 8601 time the deadline counts from (default: when the deadline is first set)",
    )
    p.add_argument(
        "--fail",
        action="append",
        default=[],
        metavar="PEER@STEP",
        help="mark a peer failed at a step (repeatable; needs --reason); it is left out of "
        "that step's aggregate",
    )
    p.add_argument("--reason", default="", help="why the peers of --fail failed")
    p.add_argument(
        "--unfail", action="append", default=[], metavar="PEER@STEP", help="clear a --fail mark"
    )


def parse_peers(text: str) -> list[str]:
    """``--expect``: ``a,b,c`` or ``@file`` (one peer a line, ``#`` comments)."""
    if text.startswith("@"):
        try:
            lines = Path(text[1:]).read_text().splitlines()
        except OSError as exc:
            raise InvalidInputError(f"--expect {text}: cannot read the file: {exc}") from None
        peers = [line.split("#", 1)[0].strip() for line in lines]
    else:
        peers = [p.strip() for p in text.split(",")]
    peers = [p for p in peers if p]
    if not peers:
        raise InvalidInputError(f"--expect {printable(text)} names no peers")
    return peers


def run_rounds(args: argparse.Namespace) -> CommandResult:
    from gradpipe.aggregation.rounds import rounds

    options: dict[str, Any] = {
        "expect": None if args.expect is None else parse_peers(args.expect),
        "quorum": args.quorum,
        "deadline": None if args.deadline is None else parse_duration(args.deadline),
        "start": args.start,
        "fail": args.fail,
        "reason": args.reason,
        "unfail": args.unfail,
    }
    changes = any(options[k] for k in ("fail", "unfail")) or any(
        options[k] is not None for k in ("expect", "quorum", "deadline", "start")
    )
    store = open_store_arg(args, "r+" if changes else "r")
    report = rounds(store, run=args.run, **options)
    return report_result(store.url, report)
