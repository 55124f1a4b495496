"""``gradpipe init / ls / verify / gc``: creating, listing, checking and cleaning a store."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from gradpipe.cli._common import (
    EXIT_FAILED,
    EXIT_OK,
    CommandResult,
    Commands,
    aligned_lines,
    open_store_arg,
    parse_duration,
    report_result,
)
from gradpipe.core.display import PATH_LIMIT, printable, printable_text

if TYPE_CHECKING:
    from gradpipe.runs import Run
    from gradpipe.storage.store import Store

__all__ = ["register"]


def register(commands: Commands) -> None:
    """Add ``init``, ``ls``, ``verify`` and ``gc``."""
    commands.add("init", run_init, "create a store (nothing happens if one exists)")
    p = commands.add("ls", run_ls, "list the refs of a store, or the steps x peers of a run")
    p.add_argument("run", metavar="RUN", nargs="?", help="show this run's steps x peers")
    p.add_argument(
        "--depth",
        action="store_true",
        help="with RUN: read every dump's manifest and show its delta-chain depth (the "
        "longest chain of deltas a read of it decodes; 0: stored in full, see ingest --delta) "
        "instead of x",
    )
    p = commands.add("verify", run_verify, "check every reachable object against its id")
    p.add_argument("--all", action="store_true", help="also check unreferenced blocks")
    p.add_argument(
        "--delete-corrupt",
        action="store_true",
        help="delete blocks whose bytes do not match their id, so that "
        "`gradpipe ingest ... --repair` can write them back",
    )
    p = commands.add("gc", run_gc, "delete unreferenced blocks older than the grace period")
    p.add_argument("--dry-run", action="store_true", help="report, delete nothing")
    p.add_argument(
        "--grace", metavar="DURATION", help="e.g. 24h, 30m, 0s (default gradpipe.gc.grace)"
    )
    p.add_argument(
        "--wait",
        metavar="DURATION",
        help="how long to wait for running writers before giving up, e.g. 30m, 10s "
        "(default gradpipe.lock.wait)",
    )


def run_init(args: argparse.Namespace) -> CommandResult:
    store = open_store_arg(args, "a")
    return CommandResult({"store": store.url}, f"gradpipe store ready at {store.url}")


# --- ls ----------------------------------------------------------------------------
def run_ls(args: argparse.Namespace) -> CommandResult:
    store = open_store_arg(args, "r")
    if args.run is not None:
        return _ls_run(store, args.run, depth=args.depth)
    if args.depth:
        from gradpipe.errors import InvalidInputError

        raise InvalidInputError("ls --depth shows the dumps of a run: name the RUN")
    refs = store.refs.list()
    rows: list[dict[str, Any]] = [
        {"ref": name, "target": e.target, "time": e.time, "message": e.message}
        for name, e in refs.items()
    ]
    if not rows:
        return CommandResult({"store": store.url, "refs": []}, f"{store.url}: no refs yet")
    bad = _describe_runs(store, rows) + _describe_analyses(store, rows)
    width = max(len(r["ref"]) for r in rows)
    lines = [
        f"{r['ref']:<{width}}  {r['target'][:19]}…  {r['time'][:19]}  "
        + (f"{r['summary']}  " if "summary" in r else "")
        + (f"PROBLEM: {r['problem']}  " if "problem" in r else "")
        + printable_text(r["message"], limit=PATH_LIMIT)
        for r in rows
    ]
    return CommandResult(
        {"store": store.url, "refs": rows}, "\n".join(lines), EXIT_FAILED if bad else EXIT_OK
    )


def _describe_runs(store: Store, rows: list[dict[str, Any]]) -> int:
    """Add steps x peers to the rows of run refs (manifests read in one batch).

    A run ref whose target is missing, damaged or another kind of object gets
    a ``problem`` instead (the run loader's own message); returns how many did.
    """
    from gradpipe.core.run_manifest import RunManifest
    from gradpipe.errors import GradpipeError
    from gradpipe.storage.catalog import read_run_at

    runs = [r for r in rows if r["ref"].startswith("runs/")]
    manifests: list[RunManifest | GradpipeError]
    try:
        manifests = list(
            store.get_typed_many([r["target"] for r in runs], RunManifest, context="run")
        )
    except GradpipeError:  # one is bad: read them one by one to say which, and how
        manifests = []
        for row in runs:
            try:
                manifests.append(read_run_at(store, row["target"], row["ref"].split("/", 1)[1]))
            except GradpipeError as exc:
                manifests.append(exc)
    bad = 0
    for row, manifest in zip(runs, manifests, strict=True):
        if isinstance(manifest, GradpipeError):
            row["problem"] = " ".join(str(manifest).split())
            bad += 1
            continue
        row.update(steps=len(manifest.steps), peers=len(manifest.peers), dumps=manifest.dump_count)
        row["summary"] = f"{row['steps']} steps x {row['peers']} peers"
    return bad


def _describe_analyses(store: Store, rows: list[dict[str, Any]]) -> int:
    """Add what each run's analytics index records (``norms: 6 steps, peers: 6 steps``)."""
    from collections import Counter

    from gradpipe.errors import GradpipeError
    from gradpipe.storage.catalog import read_analytics_at

    bad = 0
    for row in rows:
        if not row["ref"].startswith("analytics/"):
            continue
        try:
            index = read_analytics_at(store, row["target"], row["ref"].split("/", 1)[1])
            counts = Counter(e.name for e in index.entries)
        except GradpipeError as exc:
            row["problem"] = " ".join(str(exc).split())
            bad += 1
            continue
        row["analyses"] = dict(counts)
        row["summary"] = "analyses: " + ", ".join(f"{n} ({c} steps)" for n, c in counts.items())
    return bad


def _dump_depths(store: Store, run: Run) -> dict[tuple[int, str], int]:
    """(step, peer) → the deepest delta chain of any chunk of the dump (manifests in batches)."""
    from gradpipe.core.run_manifest import DumpManifest
    from gradpipe.core.tensor_manifest import TensorManifest

    entries = list(run)
    dumps = store.get_typed_many([e.dump for e in entries], DumpManifest, context="dump")
    out = {}
    for entry, dump in zip(entries, dumps, strict=True):
        # Dumps written before manifests were embedded keep their tensors apart.
        apart = [tid for _, tid in dump.tensors if tid not in dump.embedded]
        tensors = [*dump.embedded.values(), *store.get_typed_many(apart, TensorManifest)]
        out[entry.step, entry.peer] = max((t.depth for t in tensors), default=0)
    return out


def _ls_run(store: Store, name: str, *, depth: bool = False) -> CommandResult:
    from gradpipe.runs import open_run

    run = open_run(store, name)
    grid = run.grid()
    depths = _dump_depths(store, run) if depth else {}
    aggregates = _aggregates(store, run)
    doc = {
        "store": store.url,
        "run": run.name,
        "run_id": run.id,
        "steps": run.steps,
        "peers": run.peers,
        "dumps": [
            {
                "step": e.step,
                "peer": e.peer,
                "dump": e.dump,
                "fingerprint": e.fingerprint,
                "lossy": e.lossy,
            }
            | ({"depth": depths[e.step, e.peer]} if depth else {})
            for e in run
        ],
        "schema": {k: v.to_dict() for k, v in sorted(run.schema.items())},
        "aggregates": aggregates,
    }
    peers = run.peers
    lossy = {(e.step, e.peer) for e in run if e.lossy}
    width = max(len(str(s)) for s in [*run.steps, "step"])
    lines = [
        f"run {printable(run.name)}: {len(run.steps)} steps x {len(peers)} peers, "
        f"{len(run)} dumps, "
        f"{len(run.schema)} tensors"
    ]
    lines.append(f"{'step':>{width}}  " + "  ".join(peers))
    for step, present in grid.items():
        marks = [
            (
                str(depths[step, p]) + ("~" if (step, p) in lossy else "")
                if depth
                else ("~" if (step, p) in lossy else "x")
            ).center(len(p))
            if p in present
            else ".".center(len(p))
            for p in peers
        ]
        lines.append(f"{step:>{width}}  " + "  ".join(marks))
    if lossy:
        lines.append(
            f"~: stored lossily ({len(lossy)} dump(s)); their tensors record the codec and "
            "the error: gp.open_run(store, run).dump(step, peer).info(name).lossy"
        )
    if aggregates:
        lines.append("aggregates:")
        lines += _aggregate_table(aggregates)
    return CommandResult(doc, "\n".join(lines))


def _aggregate_table(aggregates: list[dict[str, Any]]) -> list[str]:
    """The run's aggregates under a header: step, name, method, id (and STALE, why)."""
    rows = [
        [str(a["step"]), printable_text(a["name"]), a["method"], f"{a['aggregate'][:19]}…"]
        + ([f"STALE ({a['stale']})"] if a["stale"] else [])
        for a in aggregates
    ]
    return [
        "  " + line for line in aligned_lines([["step", "name", "method", "id"], *rows], right={0})
    ]


def _aggregates(store: Store, run: Run) -> list[dict[str, Any]]:
    """The run's aggregates, each marked stale when a dump it used was replaced (one batch read)."""
    from gradpipe.core.aggregate_manifest import AggregateManifest, stale_reason

    entries = run.aggregates
    manifests = store.get_typed_many(
        [a.aggregate for a in entries],
        AggregateManifest,
        context=f"run {printable(run.name)} aggregate",
    )
    return [
        {
            "step": entry.step,
            "name": entry.name,
            "aggregate": entry.aggregate,
            "method": manifest.method,
            "params": manifest.params,
            "peers": manifest.peers,
            "stale": stale_reason(run.manifest, manifest),
        }
        for entry, manifest in zip(entries, manifests, strict=True)
    ]


# --- verify, gc ------------------------------------------------------------------------
def run_verify(args: argparse.Namespace) -> CommandResult:
    from gradpipe.storage.verify import verify

    store = open_store_arg(args, "r+" if args.delete_corrupt else "r")
    report = verify(store, all_blocks=args.all, delete_corrupt=args.delete_corrupt)
    return report_result(store.url, report)


def run_gc(args: argparse.Namespace) -> CommandResult:
    from gradpipe.storage.gc import gc

    grace = parse_duration(args.grace) if args.grace is not None else None
    wait = parse_duration(args.wait) if args.wait is not None else None
    store = open_store_arg(args, "r+")  # never creates: `gc typo` must not make a store
    return report_result(store.url, gc(store, grace=grace, dry_run=args.dry_run, wait=wait))
