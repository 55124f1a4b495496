"""``gradpipe evaluate``: candidate codecs measured on a sample of a run's stored chunks."""

from __future__ import annotations

import argparse

from gradpipe.cli._common import (
    CommandResult,
    Commands,
    add_where_arguments,
    open_store_arg,
    positive_int,
    report_result,
)
from gradpipe.core.codec_names import CODEC_NAMES, DEFAULT_CANDIDATES

__all__ = ["register"]


def register(commands: Commands) -> None:
    """Add ``evaluate``."""
    p = commands.add(
        "evaluate",
        run_evaluate,
        "measure candidate codecs (lossless and lossy) on a seeded sample of a run's chunks: "
        "ratio, speed, fidelity in float64, each codec's stated bound beside its measured error",
    )
    p.add_argument("--run", required=True, help="the run whose gradient dumps to sample")
    p.add_argument(
        "--codecs",
        metavar="NAME,...",
        help=f"comma-separated candidates: {', '.join(CODEC_NAMES)}, or a lossy one then "
        f"lossless ones joined by '+', e.g. bitround-7+zstd (default: "
        f"{', '.join(DEFAULT_CANDIDATES)})",
    )
    p.add_argument(
        "--sample",
        type=positive_int,
        default=64,
        metavar="N",
        help="chunks to sample, every tensor the same share, spread over steps and peers "
        "(default: 64)",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the sample (default 0); same seed, same sample"
    )
    p.add_argument(
        "--feedback-steps",
        type=positive_int,
        default=8,
        metavar="K",
        help="consecutive steps over which top-k and PowerSGD run with error feedback "
        "(default: 8; 1: none)",
    )
    add_where_arguments(p)


def run_evaluate(args: argparse.Namespace) -> CommandResult:
    from gradpipe.codecs.candidate import parse_candidates
    from gradpipe.evaluation.api import evaluate_codecs
    from gradpipe.graph.runner import runner

    candidates = parse_candidates(args.codecs)  # a bad name is refused before any I/O
    store = open_store_arg(args, "r")
    with runner(scheduler=args.scheduler, processes=args.processes) as active:
        report = evaluate_codecs(
            store,
            run=args.run,
            codecs=[c.name for c in candidates],
            sample=args.sample,
            seed=args.seed,
            feedback_steps=args.feedback_steps,
            runner=active,
        )
    return report_result(store.url, report)
