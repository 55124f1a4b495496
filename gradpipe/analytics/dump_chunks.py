"""Every float chunk of one dump, decoded in windows: what per-dump analyses consume.

A task that bins or projects a dump holds one window of decoded chunks
(:data:`WINDOW_BYTES`) at a time, never the whole dump; the window's chunks are
fetched together (concurrent requests on S3) and checked against their ids.
All-zero chunks take no block and are handed over without a read.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

import numpy as np

from gradpipe.aggregation.inputs import where
from gradpipe.analytics.layers import model_order
from gradpipe.core.dtypes import is_float, parse_dtype
from gradpipe.core.run_manifest import DumpManifest
from gradpipe.core.tensor_manifest import TensorManifest, resolve_tensor
from gradpipe.storage.catalog import named_tensors
from gradpipe.storage.reads import ChunkRead, decode_chunks

if TYPE_CHECKING:
    from gradpipe.storage.store import Store

__all__ = ["WINDOW_BYTES", "DumpChunk", "DumpChunks", "float_tensors"]

#: Decoded bytes a task holds at once.
WINDOW_BYTES: Final = 64 << 20


@dataclass(frozen=True)
class DumpChunk:
    """One chunk of a dump's float tensor: where it starts, and its values (None: all zero)."""

    tensor: str
    start: int
    stop: int
    values: np.ndarray | None


class DumpChunks:
    """The float tensors of one dump and their chunks, read window by window.

    ``names`` lists the float tensors in model order; iterating yields their
    chunks in that order; ``reads`` counts the chunks decoded so far.
    """

    def __init__(self, store: Store, step: int, peer: str, dump_id: str) -> None:
        self.store, self.step, self.peer = store, step, peer
        self.where = where(step=step, peer=peer)
        self.dump = store.get_typed(dump_id, DumpManifest, context=self.where)
        self.tensors = {
            name: resolve_tensor(tensor)
            for name, tensor in named_tensors(
                store, self.dump.tensors, self.dump.embedded, where=self.where
            ).items()
        }
        self.names = float_tensors(self.tensors)
        self.reads = 0

    def __iter__(self) -> Iterator[DumpChunk]:
        window: list[tuple[DumpChunk, ChunkRead]] = []
        held = 0
        for name in self.names:
            manifest = self.tensors[name]
            dtype = parse_dtype(manifest.dtype)
            for i, (block, (start, stop)) in enumerate(
                zip(manifest.blocks, manifest.chunk_ranges(), strict=True)
            ):
                if block is None:
                    yield DumpChunk(name, start, stop, None)
                    continue
                out = np.empty(stop - start, dtype)
                context = f"{where(step=self.step, peer=self.peer, tensor=name)}, chunk {i}"
                read = ChunkRead(
                    block, out, context, manifest.inline.get(i), manifest.deltas.get(i, ())
                )
                window.append((DumpChunk(name, start, stop, out), read))
                held += out.nbytes
                if held >= WINDOW_BYTES:
                    yield from self._decoded(window)
                    window, held = [], 0
        yield from self._decoded(window)

    def _decoded(self, window: list[tuple[DumpChunk, ChunkRead]]) -> Iterator[DumpChunk]:
        decode_chunks(self.store, [read for _, read in window])
        self.reads += len(window)
        for chunk, _ in window:
            yield chunk


def float_tensors(tensors: Mapping[str, TensorManifest]) -> list[str]:
    """The names of the float tensors, in model order."""
    return [n for n in model_order(tensors) if is_float(parse_dtype(tensors[n].dtype))]
