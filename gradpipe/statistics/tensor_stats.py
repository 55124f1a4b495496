"""Compression and value statistics of stored tensors, from their manifests alone.

A tensor manifest already holds everything but the stored size of its blocks:
per chunk its block id (none for an all-zero chunk), its inline frame (a small
chunk kept inside the manifest), its delta links and its value statistics
(:mod:`gradpipe.core.chunk_stats`). Given the size of every block object (one
listing of the store), :func:`tensor_stats` gives one :class:`TensorStats`
record per tensor without a chunk being read.

Shared blocks are counted once. Content addressing shares a block between
every tensor with an equal chunk (the same gradient twice, a keyframe under
many deltas), so a :class:`BlockLedger` gives each block's bytes to the first
tensor that claims it, and later claimants count it as *referenced* only.
Claimed in a fixed order, the per-tensor ``stored_bytes`` then add up to the
bytes the tensors take in the store, with no block twice. Inline frames are
never shared (each manifest keeps its own copy) and always count for their
tensor.

The derived figures (:func:`ratio`, :func:`bits_per_value`, :func:`fraction`,
:func:`l2_norm`) are plain numpy expressions, so the same definitions serve a
single record and a whole summed array: a ratio of sums, never a sum of
ratios.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeVar

import numpy as np
import numpy.typing as npt

from gradpipe.core.tensor_manifest import TensorManifest

__all__ = [
    "ADDITIVE",
    "DERIVED",
    "ENCODINGS",
    "MAXIMA",
    "RECORD_FIELDS",
    "STORED_FIELDS",
    "BlockLedger",
    "TensorStats",
    "bits_per_value",
    "derived_fields",
    "fraction",
    "l2_norm",
    "ratio",
    "tensor_lossy",
    "tensor_stats",
]

#: How a tensor's chunks are stored: every stored chunk in full, or some as deltas.
ENCODINGS: Final = ("full", "delta")

#: Fields whose sum over tensors, peers or steps is the figure of the whole.
ADDITIVE: Final = (
    "numel",
    "raw_bytes",
    "stored_bytes",
    "chunk_count",
    "zero_chunk_count",
    "inline_chunk_count",
    "delta_chunk_count",
    "nonzero_count",
    "nan_count",
    "inf_count",
    "sum_squares",
    "missing_blocks",
)
#: Fields whose maximum is the figure of the whole.
MAXIMA: Final = ("max_abs", "chain_depth", "max_abs_error")

#: Every field of a record, in the order tables and files show them.
RECORD_FIELDS: Final = (
    "raw_bytes",
    "stored_bytes",
    "referenced_bytes",
    "ratio",
    "bits_per_value",
    "encoding",
    "chain_depth",
    "codec",
    "numel",
    "density",
    "zero_chunk_fraction",
    "nan_count",
    "inf_count",
    "l2_norm",
    "max_abs",
    "lossy",
    "max_abs_error",
    "chunk_count",
    "zero_chunk_count",
    "inline_chunk_count",
    "delta_chunk_count",
    "nonzero_count",
    "sum_squares",
    "missing_blocks",
)

N = TypeVar("N", float, npt.NDArray[np.float64])


def ratio(raw_bytes: N, stored_bytes: N) -> N:
    """Raw over stored bytes: ``inf`` for data that takes no bytes, NaN for no data."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.divide(raw_bytes, stored_bytes)  # type: ignore[no-any-return]


def bits_per_value(stored_bytes: N, numel: N) -> N:
    """Stored bits per element (NaN for an empty tensor)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.divide(np.multiply(stored_bytes, 8.0), numel)  # type: ignore[no-any-return]


def fraction(part: N, whole: N) -> N:
    """``part / whole``, NaN when ``whole`` is 0 (a density, a share of chunks)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.divide(part, whole)  # type: ignore[no-any-return]


def l2_norm(sum_squares: N) -> N:
    """The Euclidean norm from a sum of squares (of the finite values)."""
    return np.sqrt(sum_squares)  # type: ignore[no-any-return]


#: Fields computed from others: never summed, always recomputed (:func:`derived_fields`).
DERIVED: Final = ("ratio", "bits_per_value", "density", "zero_chunk_fraction", "l2_norm")


_DERIVED_FROM: Final = (
    "raw_bytes",
    "stored_bytes",
    "numel",
    "nonzero_count",
    "zero_chunk_count",
    "chunk_count",
    "sum_squares",
    "missing_blocks",
)


def derived_fields(columns: Mapping[str, npt.ArrayLike]) -> dict[str, npt.NDArray[np.float64]]:
    """The :data:`DERIVED` fields from the additive ones, element by element.

    ``columns`` holds arrays (or scalars) of ``raw_bytes``, ``stored_bytes``,
    ``numel``, ``nonzero_count``, ``zero_chunk_count``, ``chunk_count``,
    ``sum_squares`` and ``missing_blocks``: one tensor's, or sums over many
    (a ratio of sums). ``ratio`` is NaN where a block is missing.
    """
    c = {k: np.asarray(columns[k], dtype=np.float64) for k in _DERIVED_FROM}
    known = c["missing_blocks"] == 0
    return {
        "ratio": np.where(known, ratio(c["raw_bytes"], c["stored_bytes"]), np.nan),
        "bits_per_value": bits_per_value(c["stored_bytes"], c["numel"]),
        "density": fraction(c["nonzero_count"], c["numel"]),
        "zero_chunk_fraction": fraction(c["zero_chunk_count"], c["chunk_count"]),
        "l2_norm": l2_norm(c["sum_squares"]),
    }


class BlockLedger:
    """The stored size of every block, and which blocks some tensor has counted already.

    Parameters
    ----------
    sizes : mapping of str to int
        Block id → size in bytes of its stored object (from a listing).

    Examples
    --------
    >>> ledger = BlockLedger({"a": 10, "b": 5})
    >>> ledger.claim(["a", "b"]), ledger.claim(["b", "c"])
    ((15, 15, 0), (0, 5, 1))
    """

    def __init__(self, sizes: Mapping[str, int]) -> None:
        self._sizes = sizes
        self._counted: set[str] = set()

    def claim(self, blocks: Iterable[str]) -> tuple[int, int, int]:
        """Count a tensor's blocks: ``(bytes new to the ledger, bytes of all, missing)``.

        A block listed twice counts once; a block with no known size (missing
        from the store) counts as ``missing`` and no bytes.
        """
        owned = referenced = missing = 0
        for block in dict.fromkeys(blocks):
            size = self._sizes.get(block)
            if size is None:
                missing += 1
                continue
            referenced += size
            if block not in self._counted:
                self._counted.add(block)
                owned += size
        return owned, referenced, missing

    @property
    def counted_blocks(self) -> int:
        """How many distinct blocks were claimed so far."""
        return len(self._counted)

    @property
    def counted_bytes(self) -> int:
        """Bytes of every block claimed so far, each once."""
        return sum(self._sizes[b] for b in self._counted)


@dataclass(frozen=True, slots=True)
class TensorStats:
    """What one stored tensor takes and holds; every figure from its manifest.

    ``stored_bytes`` are the bytes of the blocks this tensor was first to
    claim (see :class:`BlockLedger`) plus its inline frames;
    ``referenced_bytes`` those of every block a read of it fetches, shared or
    not. ``sum_squares`` and ``max_abs`` cover the finite values (``max_abs``
    is ``inf`` when the tensor holds an infinity, NaN when it holds no value
    that is not NaN).
    """

    numel: int
    raw_bytes: int
    stored_bytes: int
    referenced_bytes: int
    chunk_count: int
    zero_chunk_count: int
    inline_chunk_count: int
    delta_chunk_count: int
    nonzero_count: int
    nan_count: int
    inf_count: int
    sum_squares: float
    max_abs: float
    chain_depth: int
    encoding: str
    codec: str
    lossy: bool
    max_abs_error: float
    missing_blocks: int

    @property
    def ratio(self) -> float:
        """Raw over stored bytes (NaN when a block is missing: its size is unknown)."""
        if self.missing_blocks:
            return math.nan
        return float(ratio(float(self.raw_bytes), float(self.stored_bytes)))

    @property
    def bits_per_value(self) -> float:
        """Stored bits per element."""
        return float(bits_per_value(float(self.stored_bytes), float(self.numel)))

    @property
    def density(self) -> float:
        """Fraction of elements that are not zero (NaN counts as not zero)."""
        return float(fraction(float(self.nonzero_count), float(self.numel)))

    @property
    def zero_chunk_fraction(self) -> float:
        """Fraction of chunks that are all zero (and take no block)."""
        return float(fraction(float(self.zero_chunk_count), float(self.chunk_count)))

    @property
    def l2_norm(self) -> float:
        """Euclidean norm of the finite values."""
        return float(l2_norm(self.sum_squares))

    def to_dict(self) -> dict[str, Any]:
        """Every field of :data:`RECORD_FIELDS`, derived ones included."""
        return {name: getattr(self, name) for name in RECORD_FIELDS}


#: The fields a :class:`TensorStats` keeps (the others are :data:`DERIVED`).
STORED_FIELDS: Final = tuple(f for f in RECORD_FIELDS if f not in DERIVED)


def tensor_lossy(manifest: TensorManifest) -> tuple[bool, float]:
    """Whether a tensor's stored values differ from those it was given, and by how much at most.

    The one place that reads the marks: today a lossy delta chain
    (:class:`~gradpipe.core.chain.ChainInfo`) records them; a tensor stored
    with a lossy codec will record its own, read here too.
    """
    if manifest.chain is not None and manifest.chain.lossy:
        return True, manifest.chain.max_abs_error
    return False, 0.0


def tensor_stats(
    manifest: TensorManifest, ledger: BlockLedger, chunk_codecs: Sequence[str | None]
) -> TensorStats:
    """The statistics of one tensor, its shared blocks counted through ``ledger``.

    ``chunk_codecs`` names each chunk's codec (None for an all-zero chunk);
    the tensor's ``codec`` is the distinct names, sorted and joined by ``,``
    (``none`` when no chunk takes a block).
    """
    if len(chunk_codecs) != len(manifest.blocks):
        raise ValueError(
            f"{len(chunk_codecs)} codec names for a tensor of {len(manifest.blocks)} chunks"
        )
    owned, referenced, missing = ledger.claim(manifest.data_children())
    inline = sum(len(frame) for frame in manifest.inline.values())
    # One chunk (most tensors of a dump): its record is the summary, nothing to merge.
    summary = manifest.stats[0] if len(manifest.stats) == 1 else manifest.summary()
    extremes = [abs(v) for v in (summary.min, summary.max) if v is not None]
    lossy, max_error = tensor_lossy(manifest)
    codecs = sorted({c for c in chunk_codecs if c is not None})
    return TensorStats(
        numel=manifest.size,
        raw_bytes=manifest.nbytes,
        stored_bytes=owned + inline,
        referenced_bytes=referenced + inline,
        chunk_count=len(manifest.blocks),
        zero_chunk_count=sum(b is None for b in manifest.blocks),
        inline_chunk_count=len(manifest.inline),
        delta_chunk_count=len(manifest.deltas),
        nonzero_count=summary.nonzero,
        nan_count=summary.nan,
        inf_count=summary.inf,
        sum_squares=summary.sumsq,
        max_abs=max(extremes) if extremes else math.nan,
        chain_depth=manifest.depth,
        encoding="replay" if manifest.replays else "delta" if manifest.deltas else "full",
        codec=",".join(codecs) or "none",
        lossy=lossy,
        max_abs_error=max_error,
        missing_blocks=missing,
    )
