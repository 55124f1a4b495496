"""Compare two stored objects tensor by tensor, reading only the chunks whose ids differ.

A chunk's id is the hash of its logical bytes, so two chunks of the same dtype
and the same place in the same grid with one id hold the same bits: nothing
of them is read. Ids are compared, never tensor or snapshot ids (a prune gives
kept versions new ids, docs/design/016). Chunks whose ids differ are read in
pairs (one task per tensor): a snapshot version written with optimizer replay
is read whole through its replays, tensors on different grids are read whole.

Per tensor: ``identical`` (every bit), ``max_abs_diff`` (float64; 0 for
``-0.0`` against ``+0.0`` and for NaN against NaN), ``max_ulp`` (the largest
distance in units in the last place, over elements neither of which is NaN;
``±0`` are 0 apart), ``nan_mismatch`` (elements NaN on one side only),
``rel_l2 = ‖a − b‖ / ‖a‖`` (``‖a − b‖`` over the finite gaps of the differing
chunks, scaled so that it never overflows; ``‖a‖`` from ``a``'s statistics; inf
where a gap is infinite or one side NaN), and the first differing chunk and
element (flat index).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import numpy as np
from dask.base import tokenize

from gradpipe.analytics.norm_figures import exact_sum, scaled_l2
from gradpipe.analytics.resolve import Position, Side, TensorSet, parse_object
from gradpipe.core.display import printable
from gradpipe.core.dtypes import is_float, parse_dtype
from gradpipe.core.html import ReportHtml
from gradpipe.core.tensor_manifest import TensorManifest
from gradpipe.errors import InvalidInputError
from gradpipe.graph.arrays import load_chunk
from gradpipe.graph.runner import Runner, use_runner
from gradpipe.storage.tensors import read_tensor

if TYPE_CHECKING:
    from gradpipe.storage.store import Store

__all__ = ["DiffReport", "TensorDiff", "diff"]

#: A tensor's outcome: the same bits, different values, or not comparable.
STATUSES: Final = ("identical", "different", "only_a", "only_b", "mismatch")


@dataclass
class TensorDiff:
    """How one tensor of one position differs."""

    position: Position
    tensor: str
    status: str
    a: str = ""
    b: str = ""
    dtype: str = ""
    shape: tuple[int, ...] = ()
    max_abs_diff: float = 0.0
    max_ulp: int | None = 0
    nan_mismatch: int = 0
    rel_l2: float = 0.0
    first_chunk: int | None = None
    first_element: int | None = None
    chunks_read: int = 0
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "position": list(self.position),
            "tensor": self.tensor,
            "status": self.status,
            "a": self.a,
            "b": self.b,
            "dtype": self.dtype,
            "shape": list(self.shape),
        }
        if self.status == "different":
            out |= {
                "max_abs_diff": _json_float(self.max_abs_diff),
                "max_ulp": self.max_ulp,
                "nan_mismatch": self.nan_mismatch,
                "rel_l2": _json_float(self.rel_l2),
                "first_chunk": self.first_chunk,
                "first_element": self.first_element,
            }
        if self.detail:
            out["detail"] = self.detail
        return out


def _json_float(value: float) -> float | str:
    return value if math.isfinite(value) else str(value)


@dataclass
class DiffReport(ReportHtml):
    """What :func:`diff` found: per tensor, and in all."""

    a: str
    b: str
    dims: tuple[str, ...]
    tensors: list[TensorDiff] = field(default_factory=list)
    #: Positions present on one side only.
    unpaired: list[tuple[str, Position]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Always true once built: a failure to compare raises instead."""
        return True

    @property
    def equal(self) -> bool:
        """Every position paired, every tensor on both sides and bit-identical."""
        return not self.unpaired and all(t.status == "identical" for t in self.tensors)

    @property
    def chunks_read(self) -> int:
        return sum(t.chunks_read for t in self.tensors)

    def counts(self) -> dict[str, int]:
        return {s: sum(t.status == s for t in self.tensors) for s in STATUSES}

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "equal": self.equal,
            "a": self.a,
            "b": self.b,
            "dims": list(self.dims),
            "counts": self.counts(),
            "chunks_read": self.chunks_read,
            "unpaired": [{"side": s, "position": list(p)} for s, p in self.unpaired],
            "tensors": [t.to_dict() for t in self.tensors if t.status != "identical"],
        }

    def summary(self) -> str:
        counts = self.counts()
        head = "equal" if self.equal else "different"
        lines = [
            f"{printable(self.a)} vs {printable(self.b)}: {head} "
            f"({counts['identical']} identical, {counts['different']} different, "
            f"{counts['only_a'] + counts['only_b']} on one side, {counts['mismatch']} mismatched; "
            f"{self.chunks_read} chunks read)"
        ]
        for side, position in self.unpaired[:10]:
            lines.append(f"  only in {side}: {_where(self.dims, position)}")
        shown = [t for t in self.tensors if t.status != "identical"]
        for t in shown[:20]:
            where = _where(self.dims, t.position)
            lead = f"  {where}{', ' if where else ''}{printable(t.tensor)}: {t.status}"
            if t.status == "different":
                lead += (
                    f", max |a-b| {t.max_abs_diff:.3g}, max ulp {t.max_ulp}, rel l2 "
                    f"{t.rel_l2:.3g}, first at chunk {t.first_chunk}, element {t.first_element}"
                )
            elif t.detail:
                lead += f" ({t.detail})"
            lines.append(lead)
        if len(shown) > 20:
            lines.append(f"  ... {len(shown) - 20} more")
        return "\n".join(lines)


def _where(dims: tuple[str, ...], position: Position) -> str:
    return ", ".join(f"{d} {printable(v)}" for d, v in zip(dims, position, strict=True))


def diff(
    store: Store,
    a: str,
    b: str,
    *,
    tensors: Sequence[str] | None = None,
    quick: bool = False,
    runner: Runner | None = None,
) -> DiffReport:
    """Compare two dumps, aggregates, snapshots or runs (see :mod:`gradpipe.analytics.resolve`).

    Parameters
    ----------
    store : Store
        The store both live in (read-only is enough).
    a, b : str
        What to compare: ``RUN``, ``RUN@STEP``, ``RUN@STEP/PEER``, ``RUN:NAME``,
        ``RUN:NAME@STEP``, ``snapshots/NAME``, ``snapshots/NAME@STEP`` or an id.
    tensors : sequence of str, optional
        Only these tensors (shell-style patterns: ``"encoder.*"``).
    quick : bool
        Decide from the chunk ids alone: read nothing, give no figures.

    Returns
    -------
    DiffReport
        ``equal``, and per tensor that differs, its figures.
    """
    if isinstance(tensors, str):
        raise InvalidInputError(f"tensors= takes a list of patterns, e.g. [{tensors!r}]")
    side_a, side_b = parse_object(store, a), parse_object(store, b)
    if side_a.dims != side_b.dims:
        raise _mismatched(side_a, side_b)
    report = DiffReport(a, b, side_a.dims)
    tasks: list[tuple[int, Any]] = []
    for position in sorted(set(side_a.sets) | set(side_b.sets), key=_sort_key):
        set_a, set_b = side_a.sets.get(position), side_b.sets.get(position)
        if set_a is None or set_b is None:
            report.unpaired.append(("b" if set_a is None else "a", position))
            continue
        for name in _names(set_a, set_b, tensors):
            record, work = _compare_ids(position, name, set_a, set_b, quick=quick)
            report.tensors.append(record)
            if work is not None:
                tasks.append((len(report.tensors) - 1, work))
    if tensors is not None and not report.tensors and not report.unpaired:
        raise InvalidInputError(
            f"tensors {', '.join(map(printable, tensors))} match no tensor of {printable(a)} "
            f"or {printable(b)}: nothing was compared"
        )
    if tasks:
        _read_differences(store, report, tasks, runner)
    return report


def _mismatched(a: Side, b: Side) -> Exception:
    def what(side: Side) -> str:
        return "one object" if not side.dims else f"a set paired by {', '.join(side.dims)}"

    return InvalidInputError(
        f"{printable(a.text)} is {what(a)} and {printable(b.text)} is {what(b)}; compare "
        "like with like (a run with a run, a step with a step, one object with one object)"
    )


def _sort_key(position: Position) -> tuple[Any, ...]:
    return tuple((0, v) if isinstance(v, int) else (1, v) for v in position)


def _names(a: TensorSet, b: TensorSet, patterns: Sequence[str] | None) -> list[str]:
    from fnmatch import fnmatchcase

    from gradpipe.analytics.layers import model_order

    names = model_order(set(a.tensors) | set(b.tensors))
    if patterns is None:
        return names
    return [n for n in names if any(fnmatchcase(n, p) for p in patterns)]


def _compare_ids(
    position: Position, name: str, a: TensorSet, b: TensorSet, *, quick: bool
) -> tuple[TensorDiff, Any]:
    """The record of one tensor as far as ids tell, and the reading still needed (or None)."""
    ta, tb = a.tensors.get(name), b.tensors.get(name)
    record = TensorDiff(position, name, "identical", a.label, b.label)
    if ta is None or tb is None:
        record.status = "only_b" if ta is None else "only_a"
        return record, None
    record.dtype, record.shape = ta.dtype, ta.shape
    if (ta.dtype, ta.shape) != (tb.dtype, tb.shape):
        record.status = "mismatch"
        record.detail = f"{ta.dtype} {list(ta.shape)} against {tb.dtype} {list(tb.shape)}"
        return record, None
    replayed = bool(ta.replays or tb.replays)
    same_grid = ta.chunk_shape == tb.chunk_shape
    if same_grid and ta.blocks == tb.blocks:
        return record, None
    differing = (
        [i for i, (x, y) in enumerate(zip(ta.blocks, tb.blocks, strict=True)) if x != y]
        if same_grid
        else list(range(len(ta.blocks)))
    )
    record.status = "different"  # until the data says otherwise (another grid)
    if same_grid:
        record.first_chunk = differing[0]
    if quick:
        record.max_ulp = None
        record.max_abs_diff = record.rel_l2 = math.nan
        if not same_grid:
            record.status, record.detail = "mismatch", "another chunk grid: --quick cannot tell"
        return record, None
    if not same_grid or replayed:
        return record, _Pair(name, ta, tb, None, a.whole, b.whole)
    return record, _Pair(name, ta, tb, differing)


@dataclass
class _Pair:
    """Two tensors to read and compare: chunk by chunk (``chunks``) or whole (None)."""

    name: str
    a: TensorManifest
    b: TensorManifest
    chunks: list[int] | None
    whole_a: Any = None
    whole_b: Any = None


@dataclass
class _Found:
    """What comparing the data of one tensor pair found."""

    max_abs: float = 0.0
    max_ulp: int | None = 0
    nan_mismatch: int = 0
    #: Each compared piece's ``‖a − b‖`` over its finite gaps (scaled: never overflows).
    norms: list[float] = field(default_factory=list)
    #: ``‖a‖`` of the chunks read whose sum of squares overflowed (by chunk; -1: whole).
    a_norms: dict[int, float] = field(default_factory=dict)
    first_chunk: int | None = None
    first_element: int | None = None
    reads: int = 0


def _read_differences(
    store: Store, report: DiffReport, tasks: list[tuple[int, _Pair]], runner: Runner | None
) -> None:
    graph: dict[Hashable, Any] = {}
    keys: list[Hashable] = []
    for index, pair in tasks:
        record = report.tensors[index]
        context = f"{record.a} / {record.b}, tensor {printable(record.tensor)}"
        key = ("gradpipe-diff", tokenize(store.url, record.a, record.b, record.tensor))
        graph[key] = (_compare_data, store, pair, context)
        keys.append(key)
    with use_runner(runner) as active:
        found = active.get(graph, keys, name="gradpipe-diff")
    for (index, pair), result in zip(tasks, found, strict=True):
        record = report.tensors[index]
        record.chunks_read = result.reads
        if result.first_element is None:  # another grid, the same bits
            record.status, record.first_chunk = "identical", None
            continue
        record.max_abs_diff = result.max_abs
        record.max_ulp = result.max_ulp
        record.nan_mismatch = result.nan_mismatch
        record.first_chunk = result.first_chunk
        record.first_element = result.first_element
        record.rel_l2 = _relative(math.hypot(*result.norms), pair.a, result)


def _compare_data(store: Store, pair: _Pair, context: str) -> _Found:
    found = _Found()
    if pair.chunks is None:
        a = _whole(store, pair.a, pair.whole_a, pair.name, context)
        b = _whole(store, pair.b, pair.whole_b, pair.name, context)
        found.reads = sum(x is not None for x in pair.a.blocks) + sum(
            x is not None for x in pair.b.blocks
        )
        _compare_values(found, a.reshape(-1), b.reshape(-1), 0, chunk_of=pair.a)
        if math.isinf(exact_sum(s.sumsq for s in pair.a.stats)):
            found.a_norms[-1] = scaled_l2(a)
        return found
    ranges = pair.a.chunk_ranges()
    for i in pair.chunks:
        start, stop = ranges[i]
        values = []
        for manifest in (pair.a, pair.b):
            values.append(
                load_chunk(
                    store,
                    manifest.blocks[i],
                    manifest.dtype,
                    (stop - start,),
                    f"{context}, chunk {i}",
                    manifest.inline.get(i),
                    manifest.deltas.get(i, ()),
                )
            )
            found.reads += manifest.blocks[i] is not None
        _compare_values(found, values[0], values[1], start, chunk_of=pair.a)
        if math.isinf(pair.a.stats[i].sumsq):
            found.a_norms[i] = scaled_l2(values[0])
    return found


def _whole(
    store: Store, manifest: TensorManifest, reader: Any, name: str, context: str
) -> np.ndarray:
    """A tensor read whole: through its snapshot's replays where it has some."""
    if reader is not None and manifest.replays:
        out: np.ndarray = reader(name)
        return out
    return read_tensor(store, manifest, context=context)


def _compare_values(
    found: _Found, a: np.ndarray, b: np.ndarray, start: int, *, chunk_of: TensorManifest
) -> None:
    """Fold the differences of ``a`` and ``b`` (flat, from element ``start``) into ``found``."""
    width = a.dtype.itemsize
    unsigned = np.dtype(f"u{width}")
    bits_a, bits_b = a.view(unsigned), b.view(unsigned)
    differ = np.flatnonzero(bits_a != bits_b)
    if not differ.size:
        return
    if found.first_element is None or start + int(differ[0]) < found.first_element:
        found.first_element = start + int(differ[0])
        found.first_chunk = _chunk_index(chunk_of, found.first_element)
    if differ.size < a.size // 2:  # a few elements differ: look at those alone
        a, b = a[differ], b[differ]
        bits_a, bits_b = bits_a[differ], bits_b[differ]
    if not is_float(parse_dtype(chunk_of.dtype)):
        delta = np.abs(a.astype(object) - b.astype(object))  # exact for every integer width
        found.max_abs = max(found.max_abs, float(delta.max()))
        found.max_ulp = None
        found.norms.append(scaled_l2(delta.astype(np.float64)))
        return
    x, y = a.astype(np.float64), b.astype(np.float64)
    nan_x, nan_y = np.isnan(x), np.isnan(y)
    one_nan = nan_x != nan_y
    found.nan_mismatch += int(np.count_nonzero(one_nan))
    with np.errstate(invalid="ignore", over="ignore"):
        gap = np.abs(x - y)  # inf - inf and NaN - NaN give NaN: equal values, no gap
    gap[(x == y) | (nan_x & nan_y)] = 0.0
    if one_nan.any():
        found.max_abs = math.inf
    finite = np.isfinite(gap)
    if finite.any():
        found.max_abs = max(found.max_abs, float(gap[finite].max()))
    if not finite.all():
        found.max_abs = math.inf
    found.norms.append(scaled_l2(gap[finite]))
    neither = ~nan_x & ~nan_y
    ulp = _ulp_distance(bits_a[neither], bits_b[neither], width)
    if ulp is not None and found.max_ulp is not None:
        found.max_ulp = max(found.max_ulp, ulp)


def _relative(gap_norm: float, a: TensorManifest, found: _Found) -> float:
    """``‖a − b‖ / ‖a‖``: 0 for equal values, inf where a gap is infinite or a NaN on one
    side. ``‖a‖`` comes from ``a``'s statistics, or from its data where a chunk's sum of
    squares overflowed (NaN if that chunk was not read)."""
    if math.isinf(found.max_abs):
        return math.inf
    if gap_norm == 0:
        return 0.0
    norm_sq = exact_sum(s.sumsq for s in a.stats)
    if math.isinf(norm_sq):
        if -1 in found.a_norms:
            norm = found.a_norms[-1]
        else:
            parts = [
                found.a_norms.get(i, math.nan) if math.isinf(s.sumsq) else math.sqrt(s.sumsq)
                for i, s in enumerate(a.stats)
            ]
            norm = math.hypot(*parts)
    else:
        norm = math.sqrt(norm_sq)
    return gap_norm / norm if norm > 0 else math.inf


def _chunk_index(manifest: TensorManifest, element: int) -> int:
    for i, (start, stop) in enumerate(manifest.chunk_ranges()):
        if start <= element < stop:
            return i
    return len(manifest.blocks) - 1


def _ulp_distance(a: np.ndarray, b: np.ndarray, width: int) -> int | None:
    """The largest distance in ulps between float bit patterns (``±0`` are one value).

    A pattern's magnitude bits count ulps from zero; across zero the distances add.
    """
    if not a.size:
        return 0
    bits = 8 * width
    unsigned = np.dtype(f"u{width}")
    mask = np.array((1 << (bits - 1)) - 1, dtype=unsigned)
    mag_a = (a & mask).astype(np.uint64)
    mag_b = (b & mask).astype(np.uint64)
    same_side = (a >> (bits - 1)) == (b >> (bits - 1))
    apart = np.where(
        same_side,
        np.where(mag_a > mag_b, mag_a - mag_b, mag_b - mag_a),
        mag_a + mag_b,  # each below 2**63: the sum fits
    )
    return int(apart.max())
