"""``gradpipe snapshot``, ``restore``, ``log`` and ``prune``: training-state snapshot chains."""

from __future__ import annotations

import argparse
import json
from typing import Any

from gradpipe.cli._common import (
    CommandResult,
    Commands,
    open_store_arg,
    positive_int,
    report_result,
)
from gradpipe.core.display import printable
from gradpipe.core.replay_options import DEFAULT_REPLAY_INTERVAL, REPLAY_KINDS
from gradpipe.errors import InvalidInputError

__all__ = ["register"]


def register(commands: Commands) -> None:
    """Add ``snapshot``, ``restore``, ``log`` and ``prune``."""
    p = commands.add(
        "snapshot",
        run_snapshot,
        "save a training-state file as the next snapshot of NAME (a delta against the last); "
        "run again with the same file and step, it writes nothing",
    )
    p.add_argument("name", metavar="NAME")
    p.add_argument(
        "state_file",
        metavar="STATE_FILE",
        help="safetensors, npz, npy, or a PyTorch checkpoint (.pt/.pth, loaded safely: "
        "tensors and plain containers only)",
    )
    p.add_argument("--step", type=_step, required=True)
    p.add_argument("--loss", type=float)
    p.add_argument(
        "--meta", action="append", default=[], metavar="KEY=VALUE", help="metadata (repeatable)"
    )
    p.add_argument(
        "--delta",
        choices=("int", "xor"),
        default="int",
        help="how a changed chunk is stored against its previous version (both bit-exact)",
    )
    p.add_argument(
        "--keyframe-interval",
        type=positive_int,
        metavar="K",
        help="a full copy of each chunk every K snapshots (default 8)",
    )
    p.add_argument(
        "--gradient",
        metavar="RUN:AGGREGATE@STEP",
        help="the gradient the optimizer step before this snapshot applied: a run's "
        "aggregate, or RUN@STEP for that step's dumps averaged (sum, then divided by the "
        "peers); parameters and moments are stored against that step replayed from the "
        "previous snapshot, mostly nothing (needs --optimizer; design note 016)",
    )
    p.add_argument(
        "--optimizer",
        choices=REPLAY_KINDS,
        help="the optimizer of a PyTorch checkpoint {'model': ..., 'optimizer': ...} "
        "(a state file does not say Adam from AdamW); without --gradient, the moments are "
        "coded against their decay where that is smaller",
    )
    p.add_argument(
        "--replay-interval",
        type=positive_int,
        metavar="K",
        help=f"with --gradient or --optimizer, a version is stored self-contained every K "
        f"snapshots (default {DEFAULT_REPLAY_INTERVAL}: a restore replays at most K-1 steps)",
    )

    p = commands.add("restore", run_restore, "write a snapshot back as a file, bit-exact")
    p.add_argument("name", metavar="NAME")
    p.add_argument("--step", type=_step, help="the snapshot at this step (default: the newest)")
    p.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="OUT",
        help="the same kind of file the snapshot was made from (.safetensors, .npz, .npy, "
        ".pt); a snapshot made in Python may be written as any kind that holds its state",
    )

    p = commands.add("log", run_log, "list the snapshots of NAME, oldest first")
    p.add_argument("name", metavar="NAME")

    p = commands.add(
        "prune", run_prune, "drop old snapshots of NAME, keeping the rest reconstructible"
    )
    p.add_argument("name", metavar="NAME")
    p.add_argument("--keep-last", type=positive_int, required=True, metavar="N")
    p.add_argument(
        "--keep-every",
        type=positive_int,
        metavar="M",
        help="also keep every snapshot whose step is a multiple of M",
    )
    p.add_argument("--dry-run", action="store_true", help="say what would go; change nothing")


def _step(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a step number: {printable(text)}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"a step is >= 0, not {value}")
    return value


def _metadata(pairs: list[str]) -> dict[str, str]:
    from gradpipe.formats.state_file import STATE_FILE_KEY

    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise InvalidInputError(f"--meta takes KEY=VALUE, got {printable(pair)}")
        if key == STATE_FILE_KEY:
            raise InvalidInputError(f"--meta {key} is reserved by gradpipe")
        out[key] = value
    return out


def run_snapshot(args: argparse.Namespace) -> CommandResult:
    from gradpipe.core.chain import DEFAULT_KEYFRAME_INTERVAL
    from gradpipe.formats.state_file import STATE_FILE_KEY, read_state_file
    from gradpipe.snapshots.api import write_snapshot

    metadata = _metadata(args.meta)
    state, info = read_state_file(args.state_file)  # before opening the store
    metadata[STATE_FILE_KEY] = json.dumps(info.to_dict(), separators=(",", ":"))
    store = open_store_arg(args, "r+")  # never creates: `gradpipe init` does
    interval = args.keyframe_interval or DEFAULT_KEYFRAME_INTERVAL
    done = write_snapshot(
        store,
        args.name,
        state,
        step=args.step,
        loss=args.loss,
        metadata=metadata,
        delta=args.delta,
        keyframe_interval=interval,
        gradient=args.gradient,
        optimizer=args.optimizer,
        replay_interval=args.replay_interval or DEFAULT_REPLAY_INTERVAL,
    )
    from gradpipe.core.snapshot_manifest import SnapshotManifest
    from gradpipe.snapshots.api import SnapshotInfo

    # This snapshot's own manifest (another writer may have landed on top since).
    snapshot_id = done.id
    manifest = store.get_typed(
        snapshot_id, SnapshotManifest, context=f"snapshot {printable(args.name)}"
    )
    info_doc = SnapshotInfo.of(snapshot_id, manifest)
    doc = {"store": store.url, "file": args.state_file, **info_doc.to_dict()}
    doc["written"] = done.written
    doc["replayed"] = done.replayed
    doc["skipped"] = dict(done.skipped)
    if not done.written:  # the same file and step, run again: exit 0, as ingest does
        text = (
            f"snapshot {printable(args.name)} step {args.step} already recorded as {snapshot_id}: "
        )
        return CommandResult(doc, text + "nothing written")
    text = (
        f"snapshot {printable(args.name)} step {args.step}: "
        f"{info_doc.logical_bytes / 2**20:.1f} MiB "
        f"of state, stored {info_doc.stored_bytes / 2**20:.1f} MiB "
        f"({info_doc.ratio:.2f} of a full copy), chain depth {info_doc.depth}, id {snapshot_id}"
    )
    if args.optimizer is not None:
        text += (
            f"\nreplayed {done.replayed} parameter(s) with {info_doc.gradient or 'no gradient'}"
            f" (replay depth {info_doc.replay_depth})"
        )
        for name, why in list(done.skipped.items())[:10]:
            text += f"\n  not replayed: {printable(name)}: {why}"
    return CommandResult(doc, text)


def run_restore(args: argparse.Namespace) -> CommandResult:
    from gradpipe.formats.dump import dump_format
    from gradpipe.formats.state_file import STATE_FILE_KEY, StateFileInfo, check_state_path
    from gradpipe.output import parse_output_path
    from gradpipe.snapshots.api import find_snapshot
    from gradpipe.snapshots.restore import restore_file

    parse_output_path(args.output, what="-o")  # before opening anything
    store = open_store_arg(args, "r")
    snapshot_id, manifest = find_snapshot(store, args.name, args.step)
    recorded = manifest.metadata.get(STATE_FILE_KEY)
    if recorded is not None:
        info = StateFileInfo.from_dict(json.loads(recorded))
    else:  # made in Python: the output's extension says which kind
        info = StateFileInfo(dump_format(args.output))
    check_state_path(args.output, info)  # before reading anything
    restore_file(store, manifest, args.output, info)
    doc: dict[str, Any] = {
        "store": store.url,
        "name": args.name,
        "step": manifest.step,
        "id": snapshot_id,
        "output": args.output,
        "kind": info.kind,
    }
    return CommandResult(
        doc,
        f"wrote snapshot {printable(args.name)} step {manifest.step} to {args.output} "
        f"({info.kind})",
    )


def run_log(args: argparse.Namespace) -> CommandResult:
    from gradpipe.snapshots.api import snapshot_log

    store = open_store_arg(args, "r")
    versions = snapshot_log(store, args.name)
    rows = [v.to_dict() for v in versions]
    header = (
        f"{'step':>8}  {'time':<26}  {'loss':>10}  {'stored':>10}  {'ratio':>5}  depth  age  "
        f"{'encoding':<24}  id"
    )
    lines = [header]
    for v in versions:
        loss = "-" if v.loss is None else f"{v.loss:.6g}"
        lossy = f"  lossy, max error {v.max_abs_error:.3g}" if v.lossy else ""
        replay = ""
        if v.gradient:
            replay = f"  replays {v.gradient}, depth {v.replay_depth}"
            if v.gradient_bytes:
                replay += f", gradient {v.gradient_bytes / 2**20:.1f} MiB"
        lines.append(
            f"{v.step:>8}  {v.time:<26.26}  {loss:>10}  {v.stored_bytes / 2**20:>7.1f} MiB  "
            f"{v.ratio:>5.2f}  {v.depth:>5}  {v.age:>3}  {_encoding(v.encoding):<24}  "
            f"{v.id[:16]}{lossy}{replay}"
        )
    total = sum(v.stored_bytes for v in versions)
    full = sum(v.full_bytes for v in versions)
    lines.append(
        f"{len(versions)} snapshot(s), {total / 2**20:.1f} MiB stored, "
        f"{(total / full if full else 1.0):.2f} of full copies"
    )
    doc = {"store": store.url, "name": args.name, "snapshots": rows}
    return CommandResult(doc, "\n".join(lines))


def _encoding(counts: dict[str, int]) -> str:
    """``"12 full, 30 replay (28 exact)"``: the kinds a version stored chunks as."""
    parts = [f"{counts[k]} {k}" for k in ("full", "delta", "replay") if counts.get(k)]
    if counts.get("exact"):
        parts[-1] += f" ({counts['exact']} exact)"
    return ", ".join(parts) or "unchanged"


def run_prune(args: argparse.Namespace) -> CommandResult:
    from gradpipe.snapshots.prune import prune

    store = open_store_arg(args, "r" if args.dry_run else "r+")
    report = prune(
        store, args.name, keep_last=args.keep_last, keep_every=args.keep_every, dry_run=args.dry_run
    )
    return report_result(store.url, report)
