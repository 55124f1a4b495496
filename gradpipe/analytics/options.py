"""The analyses and their parameters: one table, read by everything that lists them.

The Python functions check their keywords against :data:`PARAMS`, and the
documentation prints its table from here (:func:`markdown_tables`).

Each stored result has a version (:data:`STORED_VERSIONS`) that enters its memo
key: bump it when its math changes, and stored results are recomputed rather
than reused.

This module imports no numpy, so ``gradpipe --help`` stays fast.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from gradpipe.aggregation.options import Param, check_param
from gradpipe.core.display import printable
from gradpipe.errors import InvalidInputError

__all__ = [
    "ANALYSES",
    "ANALYSIS_CHOICES",
    "ANALYSIS_TABLE",
    "DEFAULT_ANALYSES",
    "PARAMS",
    "Analysis",
    "markdown_tables",
    "parse_params",
]


@dataclass(frozen=True)
class Analysis:
    """One analysis: what it computes, what it reads, what it is stored as."""

    name: str
    help: str
    #: What it reads: ``manifests`` (chunk statistics only) or ``chunks``.
    reads: str
    #: The stored result it is computed from (its memo unit), or "" if derived on read.
    stored_as: str
    #: Runs when no analysis is named.
    default: bool = True


#: Every analysis, in the order reports list them.
ANALYSIS_TABLE: Final = (
    Analysis(
        "norms",
        "per (step, peer, tensor): L2 norm, max abs(g), non-zero, NaN and infinity counts; per "
        "layer and in total by exact sums",
        "manifests",
        "norms",
    ),
    Analysis(
        "spikes",
        "steps whose norm is far above its trailing window: a robust z-score of log(norm) "
        "against the window's median and MAD",
        "manifests",
        "",
    ),
    Analysis(
        "nonfinite",
        "the earliest (step, peer, tensor, element) holding a NaN or an infinity; only the "
        "chunks the manifests flag are read",
        "flagged chunks",
        "",
    ),
    Analysis(
        "agreement",
        "per step, per layer and in total: the peers' cosine matrix, sign agreement, distance "
        "to the weighted mean, Krum scores, the norm of the mean against the mean of the norms, "
        "and outlier peers",
        "chunks",
        "peers",
    ),
    Analysis(
        "gns",
        "the gradient noise scale B_simple = tr(Σ)/‖G‖² per step and layer from the peers' "
        "batch sizes (McCandlish et al. 2018, A.1), raw and smoothed",
        "chunks",
        "peers",
    ),
    Analysis(
        "histograms",
        "per (step, tensor): counts in log-spaced magnitude bins (both signs, zero, under- and "
        "overflow, infinities, NaN), summed over peers; TensorBoard's histograms",
        "chunks",
        "histograms",
        default=False,
    ),
    Analysis(
        "projection",
        "per (step, peer, layer): a seeded k-dimensional sparse sign projection of the "
        "gradient, reproducible from (seed, tensor, element); what influence reads",
        "chunks",
        "projection",
        default=False,
    ),
    Analysis(
        "influence",
        "TracIn-style scores lr * <P g_query, P g_(step, peer)> of query gradients against "
        "every stored dump, per layer and in total (needs a query)",
        "projections",
        "",
        default=False,
    ),
)

#: The version of each stored result, in its memo key: bumped when its math changes.
STORED_VERSIONS: Final = {"norms": 1, "peers": 1, "histograms": 1, "projection": 1}

ANALYSES: Final = tuple(a.name for a in ANALYSIS_TABLE)
DEFAULT_ANALYSES: Final = tuple(a.name for a in ANALYSIS_TABLE if a.default)
_BY_ANALYSIS: Final = {a.name: a for a in ANALYSIS_TABLE}

#: Every analysis parameter (``methods``: the analyses that take it).
PARAMS: Final = (
    Param(
        "window",
        int,
        ("spikes",),
        "steps in the trailing window a step's norm is compared with",
        default=50,
        low=3,
        metavar="W",
    ),
    Param(
        "threshold",
        float,
        ("spikes",),
        "the robust z-score above which a step is a spike",
        default=6.0,
        low=0.0,
        low_open=True,
        metavar="Z",
    ),
    Param(
        "two_sided",
        bool,
        ("spikes",),
        "also flag steps whose norm falls below -threshold",
        default=False,
    ),
    Param(
        "by",
        str,
        ("spikes", "agreement", "gns"),
        "the level figures are given at: total, layer or tensor",
        default="total",
        metavar="LEVEL",
    ),
    Param(
        "outlier_z",
        float,
        ("agreement",),
        "a peer is an outlier at a step when its distance to the mean, or its cosine with the "
        "others' mean, lies this many robust standard deviations out (scale pooled over steps)",
        default=6.0,
        low=0.0,
        low_open=True,
        metavar="Z",
    ),
    Param(
        "byzantine",
        int,
        ("agreement",),
        "faulty peers Krum's scores tolerate (each score sums the n-F-2 nearest; NaN below "
        "n = 2F+3 peers)",
        default=0,
        low=0,
        metavar="F",
    ),
    Param(
        "ema",
        float,
        ("gns",),
        "the smoothing over steps of tr(Σ) and ‖G‖², each bias-corrected, before their ratio",
        default=0.9,
        low=0.0,
        high=1.0,
        high_open=True,
        metavar="BETA",
    ),
    Param(
        "batch_size",
        int,
        ("gns",),
        "every peer's batch size, where dumps record no num_examples (needs equal weights)",
        low=1,
        metavar="B",
    ),
    Param(
        "bins_per_octave",
        int,
        ("histograms",),
        "histogram bins per factor of two of magnitude",
        default=2,
        low=1,
        high=16,
        metavar="M",
    ),
    Param(
        "low_exp",
        int,
        ("histograms",),
        "the smallest magnitude binned is 2**low_exp (smaller ones: underflow)",
        default=-32,
        low=-1022,
        high=1022,
        metavar="E",
    ),
    Param(
        "high_exp",
        int,
        ("histograms",),
        "magnitudes from 2**high_exp up count as overflow",
        default=16,
        low=-1021,
        high=1023,
        metavar="E",
    ),
    Param(
        "per_peer",
        bool,
        ("histograms",),
        "keep each peer's counts instead of their sum",
        default=False,
    ),
    Param(
        "k",
        int,
        ("projection", "influence"),
        "dimensions of the random projection (error std <= ‖x‖‖y‖ sqrt(2/k))",
        default=8192,
        low=1,
        high=2**20,
        metavar="K",
    ),
    Param(
        "seed",
        int,
        ("projection", "influence"),
        "the projection's seed: projections of one seed share a space",
        default=0,
        low=0,
        metavar="S",
    ),
    Param(
        "s",
        int,
        ("projection", "influence"),
        "non-zeros per column of the projection (a divisor of k, at most 64)",
        default=4,
        low=1,
        high=64,
        metavar="N",
    ),
    Param(
        "first_only",
        bool,
        ("nonfinite",),
        "examine only the earliest step that holds a non-finite value (else every such step)",
        default=True,
    ),
)
_BY_NAME: Final = {p.name: p for p in PARAMS}
#: The values of the text parameters.
ANALYSIS_CHOICES: Final = {"by": ("total", "layer", "tensor")}
_CHOICES: Final = ANALYSIS_CHOICES


def analysis(name: str) -> Analysis:
    """The analysis named ``name`` (an error listing them all otherwise)."""
    found = _BY_ANALYSIS.get(name)
    if found is None:
        raise InvalidInputError(
            f"no analysis {printable(name)}; the analyses are {', '.join(ANALYSES)}"
        )
    return found


def parse_params(name: str, given: dict[str, object]) -> dict[str, object]:
    """``given`` checked for analysis ``name``, with the defaults of what it leaves out."""
    analysis(name)
    out: dict[str, object] = {}
    for param in PARAMS:
        if name not in param.methods:
            continue
        value = given.get(param.name, param.default)
        if value is not None:
            value = check_param(param, value)
            choices = _CHOICES.get(param.name)
            if choices is not None and value not in choices:
                raise InvalidInputError(
                    f"{param.name} {printable(value)} must be one of {', '.join(choices)}"
                )
        out[param.name] = value
    unknown = sorted(set(given) - set(out))
    if unknown:
        raise InvalidInputError(
            f"{name} takes no {', '.join(unknown)} (it takes: {', '.join(out) or 'nothing'})"
        )
    return out


def check_request(
    what: Sequence[str] | str | None, aggregate: str | None, params: Mapping[str, Any]
) -> list[str]:
    """The analyses a request runs, in table order; raises for what none of them takes."""
    chosen = _chosen(what, aggregate)
    unknown = sorted(set(params) - {p.name for p in PARAMS})
    if unknown:
        raise InvalidInputError(
            f"analyze takes no {', '.join(unknown)} (see gradpipe analyze --help)"
        )
    for name in params:
        taken_by = takers(name)
        if not set(taken_by) & set(chosen):
            raise InvalidInputError(
                f"{name} is a parameter of {', '.join(taken_by)}, which this call does not run"
            )
    return chosen


#: The analyses that apply to an aggregate (the others compare or read peers' dumps).
_OF_AGGREGATES: Final = ("norms", "spikes", "nonfinite")


def _chosen(what: Sequence[str] | str | None, aggregate: str | None) -> list[str]:
    names = list(DEFAULT_ANALYSES if what is None else [what] if isinstance(what, str) else what)
    for name in names:
        analysis(name)  # an error listing the analyses for an unknown one
    if "influence" in names:
        raise InvalidInputError(
            "influence needs a query: call gp.influence(store, run, query) (or gradpipe "
            "analyze --what projection to project the run ahead of queries)"
        )
    if aggregate is not None:
        needs_peers = [n for n in names if n not in _OF_AGGREGATES]
        if what is None:
            names = [n for n in names if n not in needs_peers]
        elif needs_peers:
            raise InvalidInputError(
                f"{', '.join(needs_peers)} compare or read the peers' dumps; with aggregate= "
                "only norms, spikes and nonfinite apply"
            )
    return [n for n in ANALYSES if n in names]


def default(param: str) -> Any:
    """Parameter ``param``'s default value."""
    return _BY_NAME[param].default


def takers(param: str) -> tuple[str, ...]:
    """The analyses that take parameter ``param``."""
    return _BY_NAME[param].methods


def markdown_tables() -> str:
    """The analyses and their parameters as two Markdown tables (the documentation's)."""
    lines = ["| analysis | reads | default | computes |", "|---|---|---|---|"]
    lines += [
        f"| `{a.name}` | {a.reads} | {'yes' if a.default else 'no'} | {_cell(a.help)} |"
        for a in ANALYSIS_TABLE
    ]
    lines += ["", "| parameter | type | range | default | analyses | what it does |"]
    lines.append("|---|---|---|---|---|---|")
    for p in PARAMS:
        default = "" if p.default is None else f"`{p.default!r}`".replace("'", "")
        choices = _CHOICES.get(p.name)
        range_text = " / ".join(choices) if choices else p.range_text
        lines.append(
            f"| `{p.name}` | {p.type.__name__} | {range_text} | {default} "
            f"| {', '.join(p.methods)} | {_cell(p.help)} |"
        )
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    """``text`` in a Markdown table cell (a ``|`` would end the cell)."""
    return text.replace("|", "\\|")


if __name__ == "__main__":  # python -m gradpipe.analytics.options: the docs' tables
    print(markdown_tables(), end="")
