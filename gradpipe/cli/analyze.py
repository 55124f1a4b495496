"""``gradpipe diff``: compare dumps, aggregates, snapshots or runs, chunk ids first.

Exit status: 0 when equal, 1 when different, 2 on any error (as ``cmp(1)``), so
a CI job can check that two training runs are bit-identical.
"""

from __future__ import annotations

import argparse

from gradpipe.cli._common import EXIT_FAILED, EXIT_OK, CommandResult, Commands, open_store_arg

__all__ = ["register"]

_OBJECTS = (
    "RUN, RUN@STEP, RUN@STEP/PEER, RUN:AGGREGATE, RUN:AGGREGATE@STEP, snapshots/NAME, "
    "snapshots/NAME@STEP (or @latest), or an id b3:..."
)


def register(commands: Commands) -> None:
    """Add ``diff``."""
    p = commands.add(
        "diff",
        run_diff,
        "compare two dumps, aggregates, snapshots or runs tensor by tensor: bit-identical or "
        "not from chunk ids (identical chunks are never read), else max |a-b|, ulps, relative L2",
    )
    p.add_argument("a", metavar="A", help=f"what to compare: {_OBJECTS}")
    p.add_argument("b", metavar="B", help="what to compare it with (the same form)")
    p.add_argument(
        "--tensors",
        metavar="GLOB",
        action="append",
        help="only tensors whose names match (repeatable): 'encoder.*'",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="decide from chunk ids alone: read no chunk, give no figures",
    )
    p.epilog = "Exit status: 0 equal, 1 different, 2 error (as cmp(1))."
    p.set_defaults(error_status=2)


def run_diff(args: argparse.Namespace) -> CommandResult:
    from gradpipe.analytics.diff import diff

    store = open_store_arg(args, "r")
    report = diff(store, args.a, args.b, tensors=args.tensors, quick=args.quick)
    status = EXIT_OK if report.equal else EXIT_FAILED
    return CommandResult(report.to_dict(), report.summary(), status)
