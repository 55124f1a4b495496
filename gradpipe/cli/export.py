"""``gradpipe export``: one dump, or one aggregate, written as safetensors, bit-exact."""

from __future__ import annotations

import argparse

from gradpipe.cli._common import CommandResult, Commands, open_store_arg
from gradpipe.core.display import printable

__all__ = ["register"]


def register(commands: Commands) -> None:
    """Add ``export``."""
    p = commands.add(
        "export", run_export, "write one dump (or aggregate) back as safetensors, bit-exact"
    )
    p.add_argument("--run", required=True)
    p.add_argument("--step", type=int, required=True)
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--peer", help="the peer whose dump to export")
    which.add_argument(
        "--aggregate", metavar="NAME", help="the aggregate to export (see gradpipe aggregate)"
    )
    p.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="OUT.safetensors",
        help="a new file or a regular file to replace; never a symlink, device or FIFO, "
        "nor a path inside a store",
    )


def run_export(args: argparse.Namespace) -> CommandResult:
    from gradpipe.output import parse_output_path
    from gradpipe.runs import export_aggregate, export_dump

    parse_output_path(args.output, what="-o")  # before opening anything
    store = open_store_arg(args, "r")
    if args.aggregate is not None:
        found = export_aggregate(store, args.run, args.step, args.aggregate, args.output)
        return CommandResult(
            {
                "store": store.url,
                "run": args.run,
                "step": args.step,
                "aggregate": args.aggregate,
                "aggregate_id": found.id,
                "stale": found.stale,
                "output": args.output,
                "tensors": len(found.names),
            },
            f"wrote {len(found.names)} tensors of aggregate {printable(args.aggregate)} of step "
            f"{args.step} to {args.output}" + (f" (stale: {found.stale})" if found.stale else ""),
        )
    dump = export_dump(store, args.run, args.step, args.peer, args.output)
    doc = {
        "store": store.url,
        "run": args.run,
        "step": args.step,
        "peer": args.peer,
        "dump": dump.id,
        "output": args.output,
        "tensors": len(dump.names),
    }
    return CommandResult(
        doc,
        f"wrote {len(dump.names)} tensors of step {args.step}, peer "
        f"{printable(args.peer)} to {args.output}",
    )
