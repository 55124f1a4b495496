"""``gradpipe aggregate``: the aggregates of a run's steps, computed on a Dask graph."""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

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

#: The methods ``--method`` takes: ``gradpipe.aggregation.api.METHODS`` (a test checks),
#: not imported from there so that ``--help`` loads no numpy.
METHODS = (
    "sum",
    "mean",
    "weighted-mean",
    "fedavg",
    "median",
    "trimmed-mean",
    "krum",
    "multi-krum",
    "bulyan",
    "dp-fedavg",
    "sgd",
    "fedavgm",
    "fedadagrad",
    "fedadam",
    "fedyogi",
)

__all__ = ["METHODS", "parse_steps", "parse_weights_arg", "register"]


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
        help="fedavg weights peers by their dumps' num_examples (or --weights); weighted-mean "
        "needs --weights; mean is unweighted; sum adds; median and trimmed-mean (--trim) are "
        "coordinate-wise; krum, multi-krum (--keep) and bulyan select peers (--byzantine); "
        "dp-fedavg clips (--clip-norm) and adds seeded Gaussian noise (--noise-multiplier); "
        "the server optimizers sgd, fedavgm, fedadagrad, fedadam and fedyogi record the FedAvg "
        "of each step and apply it to the newest snapshot of --snapshot with --server-lr, "
        "writing the next snapshot",
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
        "--clip-norm",
        type=float,
        metavar="C",
        help="clip each peer's update (all its tensors) to L2 norm C first (dp-fedavg: "
        "required; with --adaptive-clip, the first step's clip norm)",
    )
    p.add_argument(
        "--clip-aggregate",
        type=float,
        metavar="C",
        help="clip each step's result (all its tensors) to L2 norm C, for every method",
    )
    p.add_argument(
        "--trim",
        type=float,
        metavar="BETA",
        help="trimmed-mean: drop int(BETA*n) values at each end per coordinate, "
        "0 <= BETA < 0.5 (default 0.1)",
    )
    p.add_argument(
        "--byzantine",
        type=int,
        metavar="F",
        help="krum, multi-krum, bulyan: faulty peers tolerated (default 0); krum needs "
        "n >= 2F+3 peers, bulyan n >= 4F+3",
    )
    p.add_argument(
        "--keep",
        type=int,
        metavar="M",
        help="multi-krum: FedAvg of the M peers of best score (default n - F)",
    )
    p.add_argument(
        "--noise-multiplier",
        type=float,
        metavar="Z",
        help="dp-fedavg: Gaussian noise of standard deviation Z*C/n on the mean (default 1.0)",
    )
    p.add_argument(
        "--seed",
        type=int,
        metavar="S",
        help="dp-fedavg: the noise's seed (default: one is picked and recorded)",
    )
    p.add_argument(
        "--adaptive-clip",
        action="store_true",
        help="dp-fedavg: move the clip norm every step toward --target-quantile of the update "
        "norms (Andrew et al.), resuming from the previous step's recorded value",
    )
    p.add_argument(
        "--target-quantile",
        type=float,
        metavar="GAMMA",
        help="adaptive clipping's target quantile of update norms (default 0.5)",
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
    server = p.add_argument_group(
        "server optimizers",
        "sgd, fedavgm, fedadagrad, fedadam, fedyogi (Reddi et al., 'Adaptive Federated "
        "Optimization'): steps apply in order, each once per snapshot chain",
    )
    server.add_argument(
        "--snapshot",
        metavar="NAME",
        help='the chain whose newest snapshot holds {"params": ...} (and the optimizer state '
        "after the first step); each step writes its next snapshot",
    )
    server.add_argument(
        "--server-lr",
        type=float,
        metavar="ETA",
        help="the server learning rate (required with a server optimizer)",
    )
    server.add_argument(
        "--momentum", type=float, metavar="MU", help="fedavgm: momentum (default 0.9)"
    )
    server.add_argument(
        "--beta1", type=float, metavar="B1", help="fedadagrad, fedadam, fedyogi (default 0.9)"
    )
    server.add_argument("--beta2", type=float, metavar="B2", help="fedadam, fedyogi (default 0.99)")
    server.add_argument(
        "--tau",
        type=float,
        metavar="TAU",
        help="adaptivity: x -= eta*m/(sqrt(v)+tau) (default 0.001)",
    )
    server.add_argument(
        "--initial-accumulator",
        type=float,
        metavar="V0",
        help="where v starts (default tau**2, as in Reddi et al.; Flower starts at 0)",
    )
    server.add_argument(
        "--bias-correction",
        action="store_true",
        help="fedadam, fedyogi: Adam's bias correction (off by default, as in the paper; "
        "Flower's FedAdam has it)",
    )
    add_where_arguments(p)
    add_report_argument(p)


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
        "clip_norm": args.clip_norm,
        "clip_aggregate": args.clip_aggregate,
        "trim": args.trim,
        "byzantine": args.byzantine,
        "keep": args.keep,
        "noise_multiplier": args.noise_multiplier,
        "seed": args.seed,
        "adaptive_clip": args.adaptive_clip,
        "target_quantile": args.target_quantile,
        "split_every": args.split_every,
        "force": args.force,
        "snapshot": args.snapshot,
        "server_lr": args.server_lr,
        "momentum": args.momentum,
        "beta1": args.beta1,
        "beta2": args.beta2,
        "tau": args.tau,
        "initial_accumulator": args.initial_accumulator,
        "bias_correction": args.bias_correction,
    }
    store = open_store_arg(args, "r+")  # never creates: the run must exist
    where = {"scheduler": args.scheduler, "processes": args.processes}
    with job_runner(report=args.report, **where) as active:
        report = aggregate(store, run=args.run, runner=active, **options)
    result = report_result(store.url, report)
    return result if args.report is None else with_performance_report(result, args.report)
