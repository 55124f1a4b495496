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
        f"gradpipe export {args.store} --run demo --step 0 --peer peer0 -o peer0.safetensors"
    )
    return report_result(args.store, report, hints=hints)
