"""``gradpipe init / ls / verify / gc``: creating, listing, checking and cleaning a store."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from gradpipe.cli._common import (
    EXIT_FAILED,
    EXIT_OK,
    CommandResult,
    Commands,
    open_store_arg,
    parse_duration,
)

if TYPE_CHECKING:
    from gradpipe.storage.store import Store

__all__ = ["register"]


def register(commands: Commands) -> None:
    """Add ``init``, ``ls``, ``verify`` and ``gc``."""
    commands.add("init", run_init, "create a store (nothing happens if one exists)")
    p = commands.add("ls", run_ls, "list the refs of a store, or the steps x peers of a run")
    p.add_argument("run", metavar="RUN", nargs="?", help="show this run's steps x peers")
    p = commands.add("verify", run_verify, "check every reachable object against its id")
    p.add_argument("--all", action="store_true", help="also check unreferenced blocks")
    p = commands.add("gc", run_gc, "delete unreferenced blocks older than the grace period")
    p.add_argument("--dry-run", action="store_true", help="report, delete nothing")
    p.add_argument(
        "--grace", metavar="DURATION", help="e.g. 24h, 30m, 0s (default gradpipe.gc.grace)"
    )


def run_init(args: argparse.Namespace) -> CommandResult:
    store = open_store_arg(args, "a")
    return CommandResult({"store": store.url}, f"gradpipe store ready at {store.url}")


# --- ls ----------------------------------------------------------------------------
def run_ls(args: argparse.Namespace) -> CommandResult:
    store = open_store_arg(args, "r")
    if args.run is not None:
        return _ls_run(store, args.run)
    refs = store.refs.list()
    rows: list[dict[str, Any]] = [
        {"ref": name, "target": e.target, "time": e.time, "message": e.message}
        for name, e in refs.items()
    ]
    if not rows:
        return CommandResult({"store": store.url, "refs": []}, f"{store.url}: no refs yet")
    bad = _describe_runs(store, rows)
    width = max(len(r["ref"]) for r in rows)
    lines = [
        f"{r['ref']:<{width}}  {r['target'][:19]}…  {r['time'][:19]}  "
        + (f"{r['summary']}  " if "summary" in r else "")
        + (f"PROBLEM: {r['problem']}  " if "problem" in r else "")
        + r["message"]
        for r in rows
    ]
    return CommandResult(
        {"store": store.url, "refs": rows}, "\n".join(lines), EXIT_FAILED if bad else EXIT_OK
    )


def _describe_runs(store: Store, rows: list[dict[str, Any]]) -> int:
    """Add steps x peers to the rows of run refs (manifests read in one batch).

    A run ref whose target is missing, damaged or another kind of object gets
    a ``problem`` instead; returns how many did.
    """
    from gradpipe.core.run_manifest import RunManifest
    from gradpipe.errors import GradpipeError

    runs = [r for r in rows if r["ref"].startswith("runs/")]
    try:
        manifests: list[Any] = store.get_manifests([r["target"] for r in runs])
    except GradpipeError:  # one is bad: read them one by one to say which
        manifests = []
        for row in runs:
            try:
                manifests.append(store.get_manifest(row["target"], context=f"ref {row['ref']}"))
            except GradpipeError as exc:
                manifests.append(exc)
    bad = 0
    for row, manifest in zip(runs, manifests, strict=True):
        if isinstance(manifest, RunManifest):
            row.update(
                steps=len(manifest.steps), peers=len(manifest.peers), dumps=len(manifest.dumps)
            )
            row["summary"] = f"{row['steps']} steps x {row['peers']} peers"
            continue
        bad += 1
        if isinstance(manifest, Exception):
            row["problem"] = str(manifest)
        else:
            row["problem"] = (
                f"points at a {manifest.type} manifest, not a run; run `gradpipe verify` and "
                "move the ref back to the run's last state"
            )
    return bad


def _ls_run(store: Store, name: str) -> CommandResult:
    from gradpipe.runs import open_run

    run = open_run(store, name)
    grid = run.grid()
    doc = {
        "store": store.url,
        "run": run.name,
        "run_id": run.id,
        "steps": run.steps,
        "peers": run.peers,
        "dumps": [
            {"step": e.step, "peer": e.peer, "dump": e.dump, "fingerprint": e.fingerprint}
            for e in run
        ],
        "schema": {k: v.to_dict() for k, v in sorted(run.schema.items())},
    }
    peers = run.peers
    width = max(len(str(s)) for s in [*run.steps, "step"])
    lines = [
        f"run {run.name!r}: {len(run.steps)} steps x {len(peers)} peers, {len(run)} dumps, "
        f"{len(run.schema)} tensors"
    ]
    lines.append(f"{'step':>{width}}  " + "  ".join(peers))
    for step, present in grid.items():
        marks = ["x".center(len(p)) if p in present else ".".center(len(p)) for p in peers]
        lines.append(f"{step:>{width}}  " + "  ".join(marks))
    return CommandResult(doc, "\n".join(lines))


# --- verify, gc ------------------------------------------------------------------------
def run_verify(args: argparse.Namespace) -> CommandResult:
    from dask.utils import format_bytes

    from gradpipe.storage.verify import verify

    store = open_store_arg(args, "r")
    report = verify(store, all_blocks=args.all)
    doc = {"store": store.url, **report.to_dict()}
    head = (
        f"checked {report.manifests} manifests and {report.blocks} blocks "
        f"({format_bytes(report.bytes)} of data)"
    )
    if report.ok:
        return CommandResult(doc, f"{head}: all good")
    lines = [f"{head}: {len(report.problems)} problem(s)"]
    lines += [f"  {p.kind:<10} {p.id}  needed by {p.context}" for p in report.problems]
    return CommandResult(doc, "\n".join(lines), EXIT_FAILED)


def run_gc(args: argparse.Namespace) -> CommandResult:
    from dask.utils import format_bytes

    from gradpipe.storage.gc import gc

    grace = parse_duration(args.grace) if args.grace is not None else None
    store = open_store_arg(args, "r+")  # never creates: `gc typo` must not make a store
    report = gc(store, grace=grace, dry_run=args.dry_run)
    verb = "would delete" if args.dry_run else "deleted"
    text = (
        f"{verb} {report.deleted} unreferenced block(s), {format_bytes(report.deleted_bytes)}; "
        f"kept {report.reachable} reachable and {report.kept_young} younger than the grace "
        f"period; {verb} {report.stray_deleted} stale temporary file(s)"
    )
    return CommandResult({"store": store.url, **report.to_dict()}, text)
