"""``gradpipe export``: one dump written back as safetensors, bit-exact."""

from __future__ import annotations

import argparse

from gradpipe.cli._common import CommandResult, Commands, open_store_arg

__all__ = ["register"]


def register(commands: Commands) -> None:
    """Add ``export``."""
    p = commands.add("export", run_export, "write one dump back as safetensors, bit-exact")
    p.add_argument("--run", required=True)
    p.add_argument("--step", type=int, required=True)
    p.add_argument("--peer", required=True)
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
    from gradpipe.runs import export_dump

    parse_output_path(args.output, what="-o")  # before opening anything
    store = open_store_arg(args, "r")
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
        f"wrote {len(dump.names)} tensors of step {args.step}, peer {args.peer!r} to {args.output}",
    )
