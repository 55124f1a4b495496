"""The ``gradpipe`` command.

Every command has ``--help``; ``--json`` prints one JSON object on stdout.
Exit status: 0 success, 1 when some input or stored object failed, 2 for
usage errors (bad arguments, URLs or names).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from dask.utils import format_bytes, parse_timedelta

from gradpipe.errors import InvalidInputError, UnsupportedFormatError

__all__ = ["main"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class CommandResult:
    """What a command hands back: a JSON document, a text rendering, an exit status."""

    def __init__(self, doc: dict[str, Any], text: str, status: int = EXIT_OK) -> None:
        self.doc, self.text, self.status = doc, text, status


def _storage_options(pairs: Sequence[str]) -> dict[str, Any] | None:
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise InvalidInputError(f"--storage-option takes KEY=VALUE, got {pair!r}")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options or None


def _open(args: argparse.Namespace, mode: str) -> Any:
    from gradpipe.storage import open_store

    return open_store(args.store, mode=mode, storage_options=_storage_options(args.storage_option))  # type: ignore[arg-type]


def _parse_duration(text: str) -> float:
    try:
        return float(parse_timedelta(text, default="s"))
    except (KeyError, ValueError):
        raise InvalidInputError(f"{text!r} is not a duration; write e.g. 24h, 30m or 0s") from None


# --- commands ------------------------------------------------------------------
def cmd_init(args: argparse.Namespace) -> CommandResult:
    store = _open(args, "a")
    return CommandResult({"store": store.url}, f"gradpipe store ready at {store.url}")


def cmd_ls(args: argparse.Namespace) -> CommandResult:
    store = _open(args, "r")
    if args.run is not None:
        return _ls_run(store, args.run)
    refs = store.refs.list()
    rows: list[dict[str, Any]] = [
        {"ref": name, "target": e.target, "time": e.time, "message": e.message}
        for name, e in refs.items()
    ]
    if not rows:
        return CommandResult({"store": store.url, "refs": []}, f"{store.url}: no refs yet")
    _describe_runs(store, rows)
    width = max(len(r["ref"]) for r in rows)
    lines = [
        f"{r['ref']:<{width}}  {r['target'][:19]}…  {r['time'][:19]}  "
        + (f"{r['summary']}  " if "summary" in r else "")
        + r["message"]
        for r in rows
    ]
    return CommandResult({"store": store.url, "refs": rows}, "\n".join(lines))


def _describe_runs(store: Any, rows: list[dict[str, Any]]) -> None:
    """Add steps x peers to the rows of run refs (their manifests read in one batch)."""
    from gradpipe.core.run_manifest import RunManifest

    runs = [r for r in rows if r["ref"].startswith("runs/")]
    for row, manifest in zip(runs, store.get_manifests([r["target"] for r in runs]), strict=True):
        if isinstance(manifest, RunManifest):
            row.update(
                steps=len(manifest.steps), peers=len(manifest.peers), dumps=len(manifest.dumps)
            )
            row["summary"] = f"{row['steps']} steps x {row['peers']} peers"


def _ls_run(store: Any, name: str) -> CommandResult:
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


def cmd_ingest(args: argparse.Namespace) -> CommandResult:
    from gradpipe.ingest import ingest

    store = _open(args, "a")
    report = ingest(
        store,
        args.pattern,
        run=args.run,
        scheduler=args.scheduler,
        workers=args.workers,
        codecs=_parse_codecs(args.codec),
        replace=args.replace,
        progress=not args.json and sys.stderr.isatty(),
        dashboard=args.dashboard,
    )
    doc = {"store": store.url, **report.to_dict()}
    return CommandResult(doc, report.summary(), EXIT_OK if report.ok else EXIT_FAILED)


def _parse_codecs(spec: str | None) -> list[Any] | None:
    """``--codec`` SPEC: a numcodecs id with optional JSON-ish params, e.g. ``zstd:level=5``."""
    if spec is None or spec == "auto":
        return None
    import numcodecs

    import gradpipe.codecs  # noqa: F401 - registers gradpipe_* codecs

    chain = []
    for item in spec.split("+"):
        codec_id, _, params = item.partition(":")
        config: dict[str, Any] = {"id": codec_id}
        for pair in filter(None, params.split(",")):
            key, sep, value = pair.partition("=")
            if not sep:
                raise InvalidInputError(f"--codec {spec!r}: expected key=value, got {pair!r}")
            try:
                config[key] = json.loads(value)
            except json.JSONDecodeError:
                config[key] = value
        try:
            chain.append(numcodecs.get_codec(config))
        except (ValueError, TypeError) as exc:
            raise InvalidInputError(f"--codec {spec!r}: {exc}") from None
    return chain


def cmd_export(args: argparse.Namespace) -> CommandResult:
    from gradpipe.runs import export_dump

    store = _open(args, "r")
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


def cmd_demo(args: argparse.Namespace) -> CommandResult:
    from gradpipe.demo import run_demo

    report = run_demo(args.store, workers=args.workers)
    hints = (
        f"\nnext: gradpipe ls {args.store} demo   |   gradpipe verify {args.store}   |   "
        f"gradpipe export {args.store} --run demo --step 0 --peer peer0 -o peer0.safetensors"
    )
    return CommandResult(
        {"store": args.store, **report.to_dict()},
        report.summary() + hints,
        EXIT_OK if report.ok else EXIT_FAILED,
    )


def cmd_verify(args: argparse.Namespace) -> CommandResult:
    from gradpipe.storage.verify import verify

    store = _open(args, "r")
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


def cmd_gc(args: argparse.Namespace) -> CommandResult:
    from gradpipe.storage.gc import gc

    grace = _parse_duration(args.grace) if args.grace is not None else None
    store = _open(args, "a")
    report = gc(store, grace=grace, dry_run=args.dry_run)
    verb = "would delete" if args.dry_run else "deleted"
    text = (
        f"{verb} {report.deleted} unreferenced block(s), {format_bytes(report.deleted_bytes)}; "
        f"kept {report.reachable} reachable and {report.kept_young} younger than the grace "
        f"period; {verb} {report.stray_deleted} stale temporary file(s)"
    )
    return CommandResult({"store": store.url, **report.to_dict()}, text)


# --- parser --------------------------------------------------------------------
def _add_store(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("store", metavar="STORE", help="store URL: a path, file:// or s3://")
    parser.add_argument(
        "-S",
        "--storage-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="fsspec storage option (repeatable), e.g. endpoint_url=http://127.0.0.1:9000",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``gradpipe`` command."""
    from gradpipe import __version__

    parser = argparse.ArgumentParser(
        prog="gradpipe",
        description="Keep, inspect and reuse the gradients and training state of training runs.",
    )
    parser.add_argument("--version", action="version", version=f"gradpipe {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def add(
        name: str, func: Callable[[argparse.Namespace], CommandResult], help_: str
    ) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_, description=help_)
        _add_store(p)
        p.set_defaults(func=func)
        return p

    add("init", cmd_init, "create a store (nothing happens if one exists)")
    p = add("ls", cmd_ls, "list the refs of a store, or the steps x peers of a run")
    p.add_argument("run", metavar="RUN", nargs="?", help="show this run's steps x peers")
    p = add("ingest", cmd_ingest, "ingest gradient dumps into a run (a Dask graph)")
    p.add_argument(
        "pattern",
        metavar="PATTERN",
        help="path or URL with {step} and {peer}, e.g. 'd/step={step}/peer={peer}.safetensors'",
    )
    p.add_argument("--run", required=True, help="run name to ingest into")
    p.add_argument("--scheduler", metavar="ADDR", help="Dask scheduler address (default: local)")
    p.add_argument("--workers", type=int, help="local threads (default: one per core)")
    p.add_argument(
        "--codec",
        metavar="SPEC",
        help="fixed codec chain, e.g. 'zstd:level=5' or 'gradpipe_bytegroup:dtype=float32' "
        "(default: auto, lossless per chunk)",
    )
    p.add_argument(
        "--dashboard",
        action="store_true",
        help="without --scheduler: run on an in-process Dask cluster and print its dashboard link",
    )
    p.add_argument(
        "--replace",
        action="store_true",
        help="replace dumps recorded from a different version of the same file",
    )
    p = add("export", cmd_export, "write one dump back as safetensors, bit-exact")
    p.add_argument("--run", required=True)
    p.add_argument("--step", type=int, required=True)
    p.add_argument("--peer", required=True)
    p.add_argument("-o", "--output", required=True, metavar="OUT.safetensors")
    p = add(
        "demo",
        cmd_demo,
        "generate a sample training run and ingest it (the README's first command)",
    )
    p.add_argument("--workers", type=int, help="local threads (default: one per core)")
    p = add("verify", cmd_verify, "check every reachable object against its id")
    p.add_argument("--all", action="store_true", help="also check unreferenced blocks")
    p = add("gc", cmd_gc, "delete unreferenced blocks older than the grace period")
    p.add_argument("--dry-run", action="store_true", help="report, delete nothing")
    p.add_argument(
        "--grace", metavar="DURATION", help="e.g. 24h, 30m, 0s (default gradpipe.gc.grace)"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``gradpipe`` command; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        result = args.func(args)
    except UnsupportedFormatError as exc:  # stored or input data too new: not a usage error
        return _fail(args, exc, EXIT_FAILED)
    except InvalidInputError as exc:
        return _fail(args, exc, EXIT_USAGE)
    except Exception as exc:  # the contract: a message (and JSON) and exit 1, never a traceback
        return _fail(args, exc, EXIT_FAILED)
    if args.json:
        print(json.dumps(result.doc, indent=2, default=str))
    else:
        print(result.text)
    return int(result.status)


def _fail(args: argparse.Namespace, exc: Exception, status: int) -> int:
    if args.json:
        print(json.dumps({"ok": False, "error": str(exc), "type": type(exc).__name__}))
    print(f"gradpipe {args.command}: error: {exc}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
