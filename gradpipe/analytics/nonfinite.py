"""Where the first NaN or infinity is: the one chunk per flagged tensor the manifests point at.

The norms (:mod:`gradpipe.analytics.norms`) say which (step, peer, tensor) cells
hold a non-finite value, from the chunk statistics. For each such cell a task
reads its manifest, takes the first chunk whose statistics count a NaN or an
infinity, reads that chunk alone and finds the element. "Earliest" orders by
step, then the run's peer order, then tensors in model order
(:func:`~gradpipe.analytics.layers.model_order`), then element.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from gradpipe.core.aggregate_manifest import AggregateManifest
from gradpipe.core.display import printable
from gradpipe.core.run_manifest import DumpManifest
from gradpipe.core.tensor_manifest import resolve_tensor
from gradpipe.errors import IntegrityError
from gradpipe.graph.arrays import load_chunk
from gradpipe.storage.catalog import named_tensors

if TYPE_CHECKING:
    from gradpipe.storage.store import Store

__all__ = ["FlaggedCell", "NonFinite", "locate_nonfinite"]


@dataclass(frozen=True)
class FlaggedCell:
    """A (step, peer or aggregate, tensor) the statistics say holds a NaN or an infinity."""

    step: int
    label: str
    source: str  # the dump's (or aggregate's) id
    kind: str  # "dump" or "aggregate"
    tensor: str


@dataclass(frozen=True)
class NonFinite:
    """The first non-finite element of one flagged tensor."""

    cell: FlaggedCell
    chunk: int
    flat_index: int
    index: tuple[int, ...]
    #: ``"nan"``, ``"+inf"`` or ``"-inf"``.
    value: str
    #: Non-finite elements in that chunk (statistics), and in the whole tensor.
    chunk_count: int
    tensor_count: int


def locate_nonfinite(store: Store, cell: FlaggedCell) -> NonFinite:
    """Read the first flagged chunk of ``cell``'s tensor and find its first non-finite element."""
    where = f"step {cell.step}, {'peer' if cell.kind == 'dump' else 'aggregate'} "
    where += f"{printable(cell.label)}, tensor {printable(cell.tensor)}"
    container: DumpManifest | AggregateManifest
    if cell.kind == "dump":
        container = store.get_typed(cell.source, DumpManifest, context=where)
    else:
        container = store.get_typed(cell.source, AggregateManifest, context=where)
    tensors = named_tensors(store, container.tensors, container.embedded, where=where)
    if cell.tensor not in tensors:
        raise IntegrityError(f"{where}: the tensor is not in its manifest any more")
    manifest = resolve_tensor(tensors[cell.tensor])
    stats = manifest.stats
    flagged = [i for i, s in enumerate(stats) if s.nan + s.inf > 0]
    if not flagged:
        raise IntegrityError(f"{where}: its statistics count no NaN or infinity")
    first = flagged[0]
    start, stop = manifest.chunk_ranges()[first]
    values = load_chunk(
        store,
        manifest.blocks[first],
        manifest.dtype,
        (stop - start,),
        f"{where}, chunk {first}",
        manifest.inline.get(first),
        manifest.deltas.get(first, ()),
    ).astype(np.float64)
    bad = np.flatnonzero(~np.isfinite(values))
    if not bad.size:
        raise IntegrityError(
            f"{where}, chunk {first}: its statistics count a NaN or an infinity the data does "
            "not hold; run gradpipe verify"
        )
    local = int(bad[0])
    value = float(values[local])
    flat = start + local
    return NonFinite(
        cell,
        first,
        flat,
        tuple(int(i) for i in np.unravel_index(flat, manifest.shape)),
        "nan" if np.isnan(value) else ("+inf" if value > 0 else "-inf"),
        stats[first].nan + stats[first].inf,
        sum(s.nan + s.inf for s in stats),
    )
