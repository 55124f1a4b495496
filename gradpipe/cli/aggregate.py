"""``gradpipe aggregate``: the aggregates of a run's steps, computed on a Dask graph."""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from gradpipe.aggregation.options import (
    METHOD_TABLE,
    METHODS,
    PARAMS,
    SERVER_METHODS,
    SERVER_PARAMS,
)
from gradpipe.cli._common import (
    CommandResult,
    Commands,
    add_report_argument,
    add_where_arguments,
    open_store_arg,
    report_result,
    with_performance_report,
)
from gradpipe.core.display import printable
from gradpipe.errors import InvalidInputError

__all__ = ["parse_steps", "parse_weights_arg", "register"]


def register(commands: Commands) -> None:
    """Add ``aggregate``."""
    p = commands.add(
        "aggregate",
        run_aggregate,
        "aggregate each step's dumps over the peers (FedAvg, mean, ...) and record the result",
    )
    p.add_argument("--run", required=True, help="the run whose dumps to aggregate")
    p.add_argument(
        "--method",
        required=True,
        choices=METHODS,
        help=_methods_help(),
    )
    p.add_argument("--name", help="what the run records the aggregates as (default: the method)")
    p.add_argument(
        "--steps",
        metavar="A:B",
        help="half-open step range, e.g. 0:10 (default: every step); steps not ready in "
        "`gradpipe rounds` are skipped, with the reason",
    )
    p.add_argument(
        "--weights",
        metavar="JSON",
        help='explicit peer weights, a JSON object, e.g. \'{"peer0": 32, "peer1": 64}\'',
    )
    p.add_argument(
        "--split-every",
        type=int,
        metavar="N",
        help="partials per combine task, a power of two (default 8); the result does not "
        "depend on it",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="recompute steps already recorded (memoised), and aggregate steps that are not "
        "ready in `gradpipe rounds` (a step another live aggregation claimed is still skipped)",
    )
    _add_method_arguments(p)
    add_where_arguments(p)
    add_report_argument(p)


def _methods_help() -> str:
    families: dict[str, list[str]] = {}
    for m in METHOD_TABLE:
        families.setdefault(m.family, []).append(m.name)
    listed = "; ".join(f"{family}: {', '.join(names)}" for family, names in families.items())
    return (
        f"{listed}. fedavg weights peers by their dumps' num_examples (or --weights); the "
        "server optimizers record the FedAvg of each step and apply it to the newest snapshot "
        "of --snapshot. The documentation's aggregation page says what each computes"
    )


def _add_method_arguments(parser: argparse.ArgumentParser) -> None:
    """The methods' parameters, from the options table (gradpipe.aggregation.options)."""
    server = parser.add_argument_group(
        "server optimizers",
        f"{', '.join(SERVER_METHODS)} (Reddi et al., 'Adaptive Federated Optimization'): "
        "steps apply in order, each once per snapshot chain",
    )
    for param in PARAMS:
        group = server if param.name in SERVER_PARAMS else parser
        text = f"{param.help} ({'; '.join([param.methods_text, *param.notes()])})"
        if param.type is bool:
            group.add_argument(param.flag, action="store_true", help=text)
        else:
            group.add_argument(param.flag, type=param.type, metavar=param.metavar, help=text)


def parse_steps(text: str | None) -> range | None:
    """``--steps A:B`` as ``range(A, B)`` (half-open)."""
    if text is None:
        return None
    start, sep, stop = text.partition(":")
    try:
        if not sep:
            raise ValueError(text)
        first, last = int(start), int(stop)
    except ValueError:
        raise InvalidInputError(
            f"--steps {printable(text)}: expected A:B, a half-open range of steps, e.g. 0:10"
        ) from None
    if first < 0 or last <= first:
        raise InvalidInputError(f"--steps {printable(text)}: needs 0 <= A < B")
    return range(first, last)


class _Number(str):
    """A JSON number's text, as written."""


def parse_weights_arg(text: str | None) -> dict[str, float] | None:
    """``--weights`` JSON: an object of peer name to a finite number > 0."""
    from gradpipe.aggregation.inputs import parse_weight_text  # numpy: not for --help

    if text is None:
        return None
    try:
        # Numbers are read from their text, so one beyond float64's range is named as written.
        doc = json.loads(text, parse_float=_Number, parse_int=_Number)
    except json.JSONDecodeError as exc:
        raise InvalidInputError(f"--weights is not valid JSON: {exc}") from None
    if not isinstance(doc, dict) or not doc:
        raise InvalidInputError("--weights must be a JSON object, e.g. '{\"peer0\": 32}'")
    out = {}
    for peer, given in doc.items():
        if not isinstance(given, _Number):  # not a string, true, null, NaN or a list
            raise InvalidInputError(
                f"--weights: peer {printable(peer)} has weight {printable(given)}, not a number"
            )
        try:
            value = parse_weight_text(given)
        except InvalidInputError as exc:
            raise InvalidInputError(f"--weights: peer {printable(peer)}: {exc}") from None
        if not math.isfinite(value) or value <= 0:
            raise InvalidInputError(
                f"--weights: peer {printable(peer)} has weight {printable(value)}; "
                "weights must be finite and > 0"
            )
        out[str(peer)] = float(value)
    return out


def run_aggregate(args: argparse.Namespace) -> CommandResult:
    from gradpipe.aggregation.api import aggregate
    from gradpipe.graph.runner import job_runner

    options: dict[str, Any] = {
        "method": args.method,
        "name": args.name,
        "steps": parse_steps(args.steps),
        "weights": parse_weights_arg(args.weights),
        "split_every": args.split_every,
        "force": args.force,
        **{param.name: getattr(args, param.name) for param in PARAMS},
    }
    store = open_store_arg(args, "r+")  # never creates: the run must exist
    where = {"scheduler": args.scheduler, "processes": args.processes}
    with job_runner(report=args.report, **where) as active:
        report = aggregate(store, run=args.run, runner=active, **options)
    result = report_result(store.url, report)
    return result if args.report is None else with_performance_report(result, args.report)
