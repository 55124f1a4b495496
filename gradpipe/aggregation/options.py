"""Aggregation methods and their parameters: one table, read by everything that lists them.

:func:`gradpipe.aggregate` checks its keywords against :data:`PARAMS`; ``gradpipe aggregate``
builds its options from it (:func:`gradpipe.cli.aggregate.register`), the workflow schema its
``aggregate`` stage's keys (:mod:`gradpipe.workflow.spec`), and the documentation its table
(:func:`markdown_tables`). ``tests/test_aggregate_options.py`` checks that the four agree.

This module imports no numpy, so ``gradpipe --help`` stays fast.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

from gradpipe.core.display import printable
from gradpipe.errors import InvalidInputError

__all__ = [
    "DEFAULT_SPLIT_EVERY",
    "METHODS",
    "METHOD_TABLE",
    "PARAMS",
    "SERVER_METHODS",
    "SERVER_PARAMS",
    "Method",
    "Param",
    "check_param",
    "check_value",
    "markdown_tables",
    "params_of",
    "parse_split_every",
]


@dataclass(frozen=True)
class Method:
    """One aggregation method: its name, its family and what it computes."""

    name: str
    family: str  # "average", "robust", "private" or "server optimizer"
    help: str


#: Every method :func:`gradpipe.aggregate` computes, in the order the documentation lists them.
METHOD_TABLE: Final = (
    Method("sum", "average", "the peers' tensors added"),
    Method("mean", "average", "the unweighted mean"),
    Method("weighted-mean", "average", "the mean weighted by `weights` (required)"),
    Method(
        "fedavg",
        "average",
        "the mean weighted by each dump's `num_examples` metadata (or by `weights`)",
    ),
    Method("median", "robust", "the coordinate-wise median"),
    Method(
        "trimmed-mean",
        "robust",
        "the coordinate-wise mean of what is left once `int(trim*n)` values are dropped at "
        "each end",
    ),
    Method(
        "krum",
        "robust",
        "the one peer whose update is closest to its n-F-2 nearest (Blanchard et al., 2017)",
    ),
    Method("multi-krum", "robust", "the FedAvg of the `keep` peers of best Krum score"),
    Method(
        "bulyan",
        "robust",
        "Multi-Krum's selection, then a coordinate-wise trimmed mean (El Mhamdi et al., 2018)",
    ),
    Method(
        "dp-fedavg",
        "private",
        "each peer's update clipped to `clip_norm`, averaged, plus seeded Gaussian noise "
        "(McMahan et al., 2018); adaptive clipping after Andrew et al., 2021",
    ),
    Method("sgd", "server optimizer", "FedAvg, then x -= server_lr * g on a snapshot chain"),
    Method("fedavgm", "server optimizer", "FedAvg, then a momentum step (Hsu et al., 2019)"),
    Method(
        "fedadagrad",
        "server optimizer",
        "FedAvg, then an Adagrad step (Reddi et al., 2021, 'Adaptive Federated Optimization')",
    ),
    Method("fedadam", "server optimizer", "FedAvg, then an Adam step (Reddi et al., 2021)"),
    Method("fedyogi", "server optimizer", "FedAvg, then a Yogi step (Reddi et al., 2021)"),
)

METHODS: Final = tuple(m.name for m in METHOD_TABLE)
SERVER_METHODS: Final = tuple(m.name for m in METHOD_TABLE if m.family == "server optimizer")
_AVERAGES: Final = tuple(m.name for m in METHOD_TABLE if m.family == "average")
_ADAPTIVE: Final = ("fedadagrad", "fedadam", "fedyogi")


@dataclass(frozen=True)
class Param:
    """One parameter of some methods: its type, range, default and help.

    ``name`` is the keyword of :func:`gradpipe.aggregate` and the workflow stage's key; the
    command line spells it with dashes (``--clip-norm``). ``default`` None means unset, and the
    help says what happens then. Numbers lie in ``[low, high]``, an end excluded when its
    ``*_open`` is true.
    """

    name: str
    type: type
    methods: tuple[str, ...]
    help: str
    default: float | int | bool | str | None = None
    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False
    metavar: str | None = None
    required_by: tuple[str, ...] = ()

    @property
    def flag(self) -> str:
        """The command line's option: ``--clip-norm``."""
        return "--" + self.name.replace("_", "-")

    @property
    def methods_text(self) -> str:
        """The methods that take it, in words: ``every method`` or their names."""
        return "every method" if self.methods == METHODS else ", ".join(self.methods)

    def notes(self) -> list[str]:
        """What help texts say beside the description: range, default, who requires it."""
        out = [self.range_text] if self.range_text else []
        if self.default is not None and self.type is not bool:
            out.append(f"default {self.default}")
        if self.required_by:
            out.append(f"required by {', '.join(self.required_by)}")
        return out

    @property
    def range_text(self) -> str:
        """The allowed values in words: ``> 0``, ``in [0, 0.5)``, ``>= 1``; empty for text."""
        if self.type is bool or self.type is str:
            return ""
        low = _number_text(self.low)
        if self.high == math.inf:
            return f"{'>' if self.low_open else '>='} {low}" if self.low != -math.inf else ""
        high = _number_text(self.high)
        return f"in {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"


def _number_text(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(value)


#: Every method parameter. The run-level keywords (``run``, ``steps``, ``name``, ``weights``,
#: ``split_every``, ``force``, ``runner``) are not per method and are not here.
PARAMS: Final = (
    Param(
        "clip_aggregate",
        float,
        METHODS,
        "clip each step's result (all its tensors together) to this L2 norm",
        low=0.0,
        low_open=True,
        metavar="C",
    ),
    Param(
        "clip_norm",
        float,
        (*_AVERAGES, "dp-fedavg", *SERVER_METHODS),
        "clip each peer's update (all its tensors together) to this L2 norm first; with "
        "adaptive_clip, the first step's clip norm",
        low=0.0,
        low_open=True,
        metavar="C",
        required_by=("dp-fedavg",),
    ),
    Param(
        "trim",
        float,
        ("trimmed-mean",),
        "the share of values dropped at each end of each coordinate",
        default=0.1,
        low=0.0,
        high=0.5,
        high_open=True,
        metavar="BETA",
    ),
    Param(
        "byzantine",
        int,
        ("krum", "multi-krum", "bulyan"),
        "faulty peers tolerated: krum needs n >= 2F+3 peers, bulyan n >= 4F+3",
        default=0,
        low=0,
        metavar="F",
    ),
    Param(
        "keep",
        int,
        ("multi-krum",),
        "the peers of best score averaged (default n - F)",
        low=1,
        metavar="M",
    ),
    Param(
        "noise_multiplier",
        float,
        ("dp-fedavg",),
        "Gaussian noise of standard deviation Z * clip_norm / n on the mean",
        default=1.0,
        low=0.0,
        metavar="Z",
    ),
    Param(
        "seed",
        int,
        ("dp-fedavg",),
        "the noise's seed (default: one is drawn and recorded)",
        low=0,
        metavar="S",
    ),
    Param(
        "adaptive_clip",
        bool,
        ("dp-fedavg",),
        "move the clip norm every step toward target_quantile of the update norms, resuming "
        "from the previous step's recorded value",
        default=False,
    ),
    Param(
        "target_quantile",
        float,
        ("dp-fedavg",),
        "adaptive clipping: the quantile of the update norms the clip norm moves toward",
        default=0.5,
        low=0.0,
        high=1.0,
        high_open=True,
        metavar="GAMMA",
    ),
    Param(
        "clip_lr",
        float,
        ("dp-fedavg",),
        "adaptive clipping: the clip norm's geometric learning rate",
        default=0.2,
        low=0.0,
        low_open=True,
        metavar="ETA_C",
    ),
    Param(
        "snapshot",
        str,
        SERVER_METHODS,
        'the chain whose newest snapshot holds {"params": ...} (and, after the first step, '
        "the optimizer's state); each step writes the next snapshot",
        metavar="NAME",
        required_by=SERVER_METHODS,
    ),
    Param(
        "server_lr",
        float,
        SERVER_METHODS,
        "the server learning rate",
        low=0.0,
        low_open=True,
        metavar="ETA",
        required_by=SERVER_METHODS,
    ),
    Param(
        "momentum", float, ("fedavgm",), "momentum", default=0.9, low=0.0, high=1.0, metavar="MU"
    ),
    Param(
        "beta1",
        float,
        _ADAPTIVE,
        "the first moment's decay",
        default=0.9,
        low=0.0,
        high=1.0,
        metavar="B1",
    ),
    Param(
        "beta2",
        float,
        ("fedadam", "fedyogi"),
        "the second moment's decay",
        default=0.99,
        low=0.0,
        high=1.0,
        metavar="B2",
    ),
    Param(
        "tau",
        float,
        _ADAPTIVE,
        "adaptivity: x -= server_lr * m / (sqrt(v) + tau)",
        default=0.001,
        low=0.0,
        low_open=True,
        metavar="TAU",
    ),
    Param(
        "initial_accumulator",
        float,
        _ADAPTIVE,
        "where v starts (default tau**2, as in Reddi et al.; Flower starts at 0)",
        low=0.0,
        metavar="V0",
    ),
    Param(
        "bias_correction",
        bool,
        ("fedadam", "fedyogi"),
        "Adam's bias correction (off by default, as in the paper; Flower's FedAdam has it)",
        default=False,
    ),
)

_BY_NAME: Final = {p.name: p for p in PARAMS}

#: The parameters of the server optimizer's step (the others shape each step's FedAvg).
SERVER_PARAMS: Final = tuple(p.name for p in PARAMS if set(p.methods) <= set(SERVER_METHODS))


def params_of(method: str) -> tuple[Param, ...]:
    """The parameters ``method`` takes, in table order."""
    return tuple(p for p in PARAMS if method in p.methods)


def check_value(name: str, value: object) -> float | int | bool | str:
    """``value`` of parameter ``name``, checked against its type and range.

    >>> check_value("trim", 0.2)
    0.2
    >>> check_value("trim", 0.5)
    Traceback (most recent call last):
    ...
    gradpipe.errors.InvalidInputError: trim 0.5 must be a finite number in [0, 0.5)
    """
    return check_param(_BY_NAME[name], value)


def check_param(param: Param, value: object) -> float | int | bool | str:
    """``value`` checked against ``param``'s type and range (any table's :class:`Param`)."""
    name = param.name
    if param.type is bool:
        if not isinstance(value, bool):
            raise InvalidInputError(f"{name} {printable(value)} must be true or false")
        return value
    if param.type is str:
        if not isinstance(value, str):
            raise InvalidInputError(f"{name} {printable(value)} must be text")
        return value
    if param.type is int:
        if isinstance(value, bool) or not isinstance(value, int) or not _inside(param, value):
            raise InvalidInputError(
                f"{name} {printable(value)} must be an integer {param.range_text}"
            )
        return value
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidInputError(f"{name} {printable(value)} must be a number")
    try:
        number = float(value)
    except OverflowError:  # an integer beyond float64's range
        number = math.inf
    if not math.isfinite(number) or not _inside(param, number):
        raise InvalidInputError(
            f"{name} {printable(value)} must be a finite number {param.range_text}".rstrip()
        )
    return number


def _inside(param: Param, value: float) -> bool:
    above = value > param.low if param.low_open else value >= param.low
    below = value < param.high if param.high_open else value <= param.high
    return above and below


#: Partials per combine task when not told (``split_every``); the result does not depend on it.
DEFAULT_SPLIT_EVERY: Final = 8


def parse_split_every(value: int | None) -> int:
    """``split_every``: a power of two >= 2 (None: the default, 8)."""
    if value is None:
        return DEFAULT_SPLIT_EVERY
    if isinstance(value, bool) or not isinstance(value, int) or value < 2 or value & (value - 1):
        raise InvalidInputError(
            f"split_every {printable(value)} must be a power of two >= 2 (2, 4, 8, ...): "
            "then every partial holds one array per chunk"
        )
    return value


def markdown_tables() -> str:
    """The methods and their parameters as two Markdown tables (the documentation's)."""
    lines = ["| method | family | computes |", "|---|---|---|"]
    lines += [f"| `{m.name}` | {m.family} | {m.help} |" for m in METHOD_TABLE]
    lines += [
        "",
        "| parameter | command line | type | range | default | methods | what it does |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in PARAMS:
        methods = p.methods_text
        if p.required_by:
            methods += f" (required by {', '.join(p.required_by)})"
            if p.required_by == p.methods:
                methods = f"{', '.join(p.methods)} (required)"
        default = "" if p.default is None else f"`{p.default!r}`".replace("'", "")
        lines.append(
            f"| `{p.name}` | `{p.flag}` | {p.type.__name__} | {p.range_text} | {default} "
            f"| {methods} | {p.help} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # python -m gradpipe.aggregation.options: the docs' tables
    print(markdown_tables(), end="")
