"""``gradpipe analyze`` and ``gradpipe diff``: gradient analytics from the store.

``analyze`` runs the analyses of a run (by default every one needing no extra
input: norms, spikes, first non-finite, agreement, noise scale), memoised in
the store, and prints per-step headlines (or JSON, or CSV records; ``--plot``
draws them). ``diff`` compares dumps, aggregates, snapshots or runs, chunk ids
first; its exit status is 0 when equal, 1 when different and 2 on any error
(as ``cmp(1)``), so a CI job can check that two training runs are bit-identical.
"""

from __future__ import annotations

import argparse
import math
from typing import TYPE_CHECKING, Any, Final

from gradpipe.analytics.options import (
    ANALYSES,
    ANALYSIS_CHOICES,
    ANALYSIS_TABLE,
    DEFAULT_ANALYSES,
    PARAMS,
)
from gradpipe.cli._common import (
    EXIT_FAILED,
    EXIT_OK,
    CommandResult,
    Commands,
    add_where_arguments,
    aligned_lines,
    json_text,
    open_store_arg,
)
from gradpipe.cli.aggregate import parse_steps
from gradpipe.core.display import printable
from gradpipe.errors import InvalidInputError

if TYPE_CHECKING:
    from gradpipe.analytics.analyze import AnalysisReport

__all__ = ["register"]

FORMATS: Final = ("table", "json", "csv")

_OBJECTS = (
    "RUN, RUN@STEP, RUN@STEP/PEER, RUN:AGGREGATE, RUN:AGGREGATE@STEP, snapshots/NAME, "
    "snapshots/NAME@STEP (or @latest), or an id b3:..."
)


def register(commands: Commands) -> None:
    """Add ``analyze`` and ``diff``."""
    _register_analyze(commands)
    p = commands.add(
        "diff",
        run_diff,
        "compare two dumps, aggregates, snapshots or runs tensor by tensor: bit-identical or "
        "not from chunk ids (identical chunks are never read), else max abs(a-b), ulps, rel. L2",
    )
    p.add_argument("a", metavar="A", help=f"what to compare: {_OBJECTS}")
    p.add_argument("b", metavar="B", help="what to compare it with (the same form)")
    p.add_argument(
        "--tensors",
        metavar="GLOB",
        action="append",
        help="only tensors whose names match (repeatable): 'encoder.*'",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="decide from chunk ids alone: read no chunk, give no figures",
    )
    p.epilog = "Exit status: 0 equal, 1 different, 2 error (as cmp(1))."
    p.set_defaults(error_status=2)


def run_diff(args: argparse.Namespace) -> CommandResult:
    from gradpipe.analytics.diff import diff

    store = open_store_arg(args, "r")
    report = diff(store, args.a, args.b, tensors=args.tensors, quick=args.quick)
    status = EXIT_OK if report.equal else EXIT_FAILED
    return CommandResult(report.to_dict(), report.summary(), status)


def _register_analyze(commands: Commands) -> None:
    p = commands.add(
        "analyze",
        run_analyze,
        "gradient analytics of a run, memoised in the store: norms and spikes, the first NaN "
        "or infinity, peer agreement and outliers, the gradient noise scale, histograms",
    )
    p.add_argument("--run", required=True, help="the run to analyse")
    listed = "; ".join(
        f"{a.name}{' (default)' if a.default else ''}: {a.help}" for a in ANALYSIS_TABLE
    )
    p.add_argument(
        "--what",
        metavar="LIST",
        help=f"comma-separated analyses (default: {','.join(DEFAULT_ANALYSES)}). {listed}",
    )
    p.add_argument("--steps", metavar="A:B", help="half-open step range (default: every step)")
    p.add_argument(
        "--aggregate",
        metavar="NAME",
        help="norms, spikes and non-finite values of this aggregate instead of the dumps",
    )
    p.add_argument(
        "--format",
        choices=FORMATS,
        default="table",
        help="table (default: per-step headlines), json (the report, as --json) or csv "
        "(one record per step and peer)",
    )
    p.add_argument(
        "--plot",
        metavar="OUT.png",
        help="draw norms with spikes, the noise scale and the latest step's agreement to this "
        "PNG; needs matplotlib (pip install 'gradpipe[plot]')",
    )
    group = p.add_argument_group("analysis parameters", "from the analyses' table")
    for param in PARAMS:
        text = f"{param.help} ({'; '.join([', '.join(param.methods), *param.notes()])})"
        if param.type is bool:
            group.add_argument(param.flag, action=argparse.BooleanOptionalAction, help=text)
        elif param.name in ANALYSIS_CHOICES:
            group.add_argument(param.flag, choices=ANALYSIS_CHOICES[param.name], help=text)
        else:
            group.add_argument(param.flag, type=param.type, metavar=param.metavar, help=text)
    add_where_arguments(p)


def run_analyze(args: argparse.Namespace) -> CommandResult:
    from gradpipe.graph.runner import job_runner
    from gradpipe.output import parse_output_path

    what = _what(args.what)
    if args.plot is not None:
        parse_output_path(args.plot, what="--plot")  # before reading anything
    params = {p.name: getattr(args, p.name) for p in PARAMS if getattr(args, p.name) is not None}
    store = open_store_arg(args, "r+")  # results are recorded: the second call reads them
    from gradpipe.analytics.analyze import analyze

    where = {"scheduler": args.scheduler, "processes": args.processes}
    with job_runner(**where) as active:
        report = analyze(
            store,
            args.run,
            what=what,
            steps=parse_steps(args.steps),
            aggregate=args.aggregate,
            runner=active,
            **params,
        )
    doc = {"store": store.url, **report.to_dict()}
    if args.plot is not None:
        from gradpipe.analytics.plot import plot_report

        plot_report(report, args.plot)
        doc["plot"] = args.plot
    if args.format == "json":
        text = json_text(doc)
    elif args.format == "csv":
        from gradpipe.statistics.api import records_csv

        text = records_csv(list(report.records())).rstrip("\n")
    else:
        text = _table(report)
        if args.plot is not None:
            text += f"\nplot written to {args.plot}"
    status = EXIT_OK if report.ok else EXIT_FAILED
    return CommandResult(doc, text, status, verbatim=args.format != "table")


def _what(text: str | None) -> list[str] | None:
    if text is None:
        return None
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in ANALYSES]
    if unknown or not names:
        raise InvalidInputError(f"--what {printable(text)}: the analyses are {', '.join(ANALYSES)}")
    return names


def _table(report: AnalysisReport) -> str:
    rows = list(report.records())
    columns = [
        ("step", "step", str),
        ("peer", "peer", str),
        ("L2 norm", "l2_norm", lambda v: f"{v:.4g}"),
        ("spike z", "z", lambda v: f"{v:.2f}"),
        ("spike", "spike", lambda v: "SPIKE" if v else ""),
        ("distance", "distance", lambda v: f"{v:.4g}"),
        ("loo cos", "loo_cosine", lambda v: f"{v:.3f}"),
        ("outlier", "outlier", lambda v: "OUTLIER" if v else ""),
        ("B_simple", "b_simple", lambda v: f"{v:.4g}"),
        ("smoothed", "b_simple_ema", lambda v: f"{v:.4g}"),
    ]
    shown = [c for c in columns if any(r.get(c[1]) is not None for r in rows)]
    lines = report.summary().splitlines()
    if rows and len(shown) > 2:
        table = [[title for title, _, _ in shown]]
        table += [[_cell(r.get(key), fmt) for _, key, fmt in shown] for r in rows]
        lines += aligned_lines(table, right=set(range(2, len(shown))))
    return "\n".join(lines)


def _cell(value: Any, fmt: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return str(fmt(value))
