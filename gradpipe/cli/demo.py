"""``gradpipe demo``: the README's first command, a sample run generated and ingested."""

from __future__ import annotations

import argparse

from gradpipe.cli._common import (
    CommandResult,
    Commands,
    positive_int,
    report_result,
    storage_options,
)

__all__ = ["register"]


def register(commands: Commands) -> None:
    """Add ``demo``."""
    p = commands.add(
        "demo",
        run_demo,
        "generate a sample training run and ingest it (the README's first command)",
    )
    p.add_argument(
        "--workers", type=positive_int, metavar="N", help="local threads (default: one per core)"
    )
    p.add_argument(
        "--dumps",
        metavar="DIR",
        help="local directory for the sample dumps (default: STORE-dumps beside a local "
        "store; needed for a remote one)",
    )


def run_demo(args: argparse.Namespace) -> CommandResult:
    from gradpipe.demo import run_demo

    report = run_demo(
        args.store,
        workers=args.workers,
        dumps_dir=args.dumps,
        storage_options=storage_options(args.storage_option),
    )
    hints = (
        f"next: gradpipe ls {args.store} demo   |   gradpipe verify {args.store}   |   "
        f"gradpipe export {args.store} --run demo --step 0 --peer peer0 -o peer0.safetensors\n"
        "the dashboard above closed with this command; to watch jobs on one that stays up, run "
        "`dask scheduler --preload gradpipe.dashboard` and `dask worker tcp://127.0.0.1:8786` "
        "(two terminals), add --scheduler tcp://127.0.0.1:8786 to gradpipe ingest or aggregate, "
        "and open http://127.0.0.1:8787/gradpipe"
    )
    return report_result(args.store, report, hints=hints)
