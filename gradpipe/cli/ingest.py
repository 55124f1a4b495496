"""``gradpipe ingest``: dump files into a run, on a Dask graph.

Adding an option is two steps: an argument in :func:`add_arguments`, and the
keyword it becomes in :func:`ingest_options`.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from gradpipe.cli._common import (
    CommandResult,
    Commands,
    add_report_argument,
    add_where_arguments,
    open_store_arg,
    positive_int,
    report_result,
    with_performance_report,
)
from gradpipe.core.codec_names import CODEC_FAMILIES
from gradpipe.core.display import printable
from gradpipe.errors import InvalidInputError

if TYPE_CHECKING:
    from numcodecs.abc import Codec

#: The kinds ``--delta-kind`` takes and the default ``--keyframe-interval``: those
#: of ``gradpipe.ingestion.api.DELTA_KINDS`` and ``gradpipe.core.chain.DEFAULT_KEYFRAME_INTERVAL``
#: (a test checks), not imported from there so that ``--help`` loads no numpy.
DELTA_KINDS = ("int", "xor")
DEFAULT_KEYFRAME_INTERVAL = 8

#: The lossy codec names ``--codec`` takes first, from the codec table.
_LOSSY = tuple(f.shown(name) for name, f in CODEC_FAMILIES.items() if f.lossy)

__all__ = ["DELTA_KINDS", "add_arguments", "ingest_options", "parse_codecs", "register"]


def register(commands: Commands) -> None:
    """Add ``ingest``."""
    add_arguments(
        commands.add("ingest", run_ingest, "ingest gradient dumps into a run (a Dask graph)")
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``gradpipe ingest`` after STORE."""
    p.add_argument(
        "pattern",
        metavar="PATTERN",
        help="path or URL with {step} and {peer}, e.g. 'd/step={step}/peer={peer}.safetensors'",
    )
    p.add_argument("--run", required=True, help="run name to ingest into")
    add_where_arguments(p)
    p.add_argument(
        "--workers",
        type=positive_int,
        metavar="N",
        help="local threads, or processes with --processes (default: one per core)",
    )
    p.add_argument(
        "--codec",
        metavar="SPEC",
        help="fixed codec chain: codec names or numcodecs ids joined by '+', e.g. "
        f"'zstd:level=5', or a lossy codec first: {', '.join(_LOSSY)}, e.g. 'bf16+zstd' "
        "(lossy tensors are marked lossy with their error; integer tensors stay exact; "
        "default: auto, lossless per chunk)",
    )
    p.add_argument(
        "--dashboard",
        action="store_true",
        help="without --scheduler: run on an in-process Dask cluster and print its dashboard link",
    )
    add_report_argument(p)
    p.add_argument(
        "--replace",
        action="store_true",
        help="replace dumps recorded from a different version of the same file",
    )
    p.add_argument(
        "--repair",
        action="store_true",
        help="also check the dumps already recorded (manifests read, blocks checked for "
        "presence) and ingest again those with missing objects",
    )
    p.add_argument(
        "--delta",
        action="store_true",
        help="store each peer's tensors as delta chains across steps: every chunk against the "
        "same peer's previous step, as a delta or in full, whichever is smaller (about half "
        "the size on parameters, nothing on gradients; the report says which)",
    )
    p.add_argument(
        "--delta-kind",
        choices=DELTA_KINDS,
        help="with --delta: integer difference or XOR of the bit patterns, both bit-exact "
        "(default: int)",
    )
    p.add_argument(
        "--keyframe-interval",
        type=positive_int,
        metavar="K",
        help="with --delta: a chunk is stored in full at least every K steps, so a read "
        f"decodes at most K blocks per chunk (default: {DEFAULT_KEYFRAME_INTERVAL})",
    )


def ingest_options(args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of :func:`gradpipe.ingest` given on the command line.

    Everything is validated here, before the store is opened or any file read.
    """
    if not args.delta:
        given = [
            flag
            for flag, value in (
                ("--delta-kind", args.delta_kind),
                ("--keyframe-interval", args.keyframe_interval),
            )
            if value is not None
        ]
        if given:
            raise InvalidInputError(f"{' and '.join(given)} only apply with --delta")
    if args.delta and args.codec is not None:
        raise InvalidInputError(
            "--delta chooses the codec of every chunk and delta itself; drop --codec"
        )
    chains: dict[str, Any] = {}
    if args.delta:
        chains = {
            "delta": True,
            "delta_kind": args.delta_kind or "int",
            "keyframe_interval": args.keyframe_interval or DEFAULT_KEYFRAME_INTERVAL,
        }
    return {
        **chains,
        "scheduler": args.scheduler,
        "workers": args.workers,
        "processes": args.processes,
        "codecs": parse_codecs(args.codec),
        "replace": args.replace,
        "repair": args.repair,
        "progress": not args.json and sys.stderr.isatty(),
        "dashboard": args.dashboard,
    }


def run_ingest(args: argparse.Namespace) -> CommandResult:
    from gradpipe.ingestion.api import ingest

    options = ingest_options(args)
    store = open_store_arg(args, "a")  # ingest creates the store if needed, as documented
    if args.report is None:
        return report_result(store.url, ingest(store, args.pattern, run=args.run, **options))
    from gradpipe.graph.runner import job_runner

    where = {
        k: options.pop(k) for k in ("scheduler", "workers", "processes", "progress", "dashboard")
    }
    with job_runner(report=args.report, **where) as active:
        report = ingest(store, args.pattern, run=args.run, runner=active, **options)
    return with_performance_report(report_result(store.url, report), args.report)


def parse_codecs(spec: str | None) -> list[Codec] | None:
    """``--codec`` SPEC: codecs joined by ``+``, each a name or a numcodecs id with params.

    For example ``zstd:level=5``, ``gradpipe_bytegroup:dtype=float32+zstd`` or,
    lossy, ``bf16+zstd`` and ``topk-0.01`` (names of
    :mod:`gradpipe.codecs.registry`; a lossy codec's dtype is set per tensor
    when it is written). ``auto`` or ``default`` (or nothing) leaves the
    choice to gradpipe, per chunk.
    """
    if spec is None or spec in ("auto", "default"):
        return None
    import numcodecs

    import gradpipe.codecs  # noqa: F401 - registers gradpipe_* codecs
    from gradpipe.codecs.registry import CODEC_FAMILIES, make_codec

    chain = []
    for item in spec.split("+"):
        if ":" not in item and item.partition("-")[0] in CODEC_FAMILIES:
            named = make_codec(item)
            if named is None:
                raise InvalidInputError(
                    f"--codec {printable(spec)}: 'default' is the lossless policy, it "
                    "cannot be chained"
                )
            chain.append(named)
            continue
        codec_id, _, params = item.partition(":")
        config: dict[str, Any] = {"id": codec_id}
        for pair in filter(None, params.split(",")):
            key, sep, value = pair.partition("=")
            if not sep:
                raise InvalidInputError(
                    f"--codec {printable(spec)}: expected key=value, got {printable(pair)}"
                )
            try:
                config[key] = json.loads(value)
            except json.JSONDecodeError:
                config[key] = value
        try:
            chain.append(numcodecs.get_codec(config))
        except (ValueError, TypeError) as exc:
            raise InvalidInputError(f"--codec {printable(spec)}: {exc}") from None
    from gradpipe.codecs._lossy import check_chain

    try:
        check_chain(chain)
    except InvalidInputError as exc:
        raise InvalidInputError(f"--codec {printable(spec)}: {exc}") from None
    return chain
