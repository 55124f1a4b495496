"""Browsing runs: steps × peers, dumps and aggregates, their tensors and metadata; exporting."""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

from gradpipe.core.aggregate_manifest import AggregateManifest, stale_reason
from gradpipe.core.display import PATH_LIMIT, printable
from gradpipe.core.html import human_bytes, key_values, table
from gradpipe.core.names import parse_name
from gradpipe.core.run_manifest import (
    AggregateEntry,
    DumpEntry,
    DumpManifest,
    RunManifest,
    TensorSchema,
)
from gradpipe.core.tensor_manifest import TensorManifest
from gradpipe.errors import NotFoundError
from gradpipe.storage.catalog import list_runs, read_run
from gradpipe.storage.store import Store

if TYPE_CHECKING:
    from dask.array import Array as DaskArray

__all__ = [
    "Aggregate",
    "Dump",
    "Run",
    "export_aggregate",
    "export_dump",
    "list_runs",
    "open_run",
]


def open_run(store: Store, run: str) -> Run:
    """A run of the store, as recorded now."""
    run_id, manifest = read_run(store, run)
    if run_id is None:  # read_run raises for a missing run unless asked not to
        raise NotFoundError(
            f"no run {printable(run)} in store {printable(store.url, limit=PATH_LIMIT)}"
        )
    return Run(store, run_id, manifest)


@dataclass(frozen=True)
class Run:
    """A read-only view of one run."""

    store: Store
    id: str
    manifest: RunManifest

    @property
    def name(self) -> str:
        return self.manifest.run

    @property
    def steps(self) -> list[int]:
        """Recorded steps, ascending."""
        return self.manifest.steps

    @property
    def peers(self) -> list[str]:
        """Peers seen in any step."""
        return self.manifest.peers

    @property
    def schema(self) -> dict[str, TensorSchema]:
        """Tensor name → dtype and shape, shared by every dump of the run."""
        return dict(self.manifest.schema)

    def __iter__(self) -> Iterator[DumpEntry]:
        return iter(self.manifest.dumps)

    def __repr__(self) -> str:
        return (
            f"<gradpipe.Run {self.name!r}: {len(self)} dumps, steps {_span(self.steps)}, "
            f"{len(self.peers)} peers, {len(self.manifest.schema)} tensors>"
        )

    def _repr_html_(self) -> str:
        names = sorted({a.name for a in self.manifest.aggregates})
        tensors = table(
            ["tensor", "dtype", "shape"],
            [(n, t.dtype, list(t.shape)) for n, t in self.manifest.schema.items()],
        )
        return key_values(
            f"run {printable(self.name)}",
            {
                "store": self.store.url,
                "dumps": len(self),
                "steps": _span(self.steps),
                "peers": ", ".join(self.peers[:12]) + (" …" if len(self.peers) > 12 else ""),
                "aggregates": ", ".join(names) or "none",
                "id": self.id,
            },
            tensors,
        )

    def __len__(self) -> int:
        return self.manifest.dump_count

    def grid(self) -> dict[int, list[str]]:
        """Step → peers recorded at that step."""
        out: dict[int, list[str]] = {}
        for entry in self.manifest.dumps:
            out.setdefault(entry.step, []).append(entry.peer)
        return out

    def dump(self, step: int, peer: str) -> Dump:
        """The dump of (step, peer)."""
        parse_name(peer, what="peer name")  # a malformed name is a usage error, not "missing"
        entry = self.manifest.entry(step, peer)
        if entry is None:
            raise NotFoundError(
                f"run {printable(self.name)} has no dump for step {step}, peer {printable(peer)} "
                f"(steps {_span(self.steps)}, peers {', '.join(self.peers) or 'none'})"
            )
        manifest = self.store.get_typed(
            entry.dump,
            DumpManifest,
            context=f"run {printable(self.name)} step {step}, peer {printable(peer)}",
        )
        return Dump(self.store, entry.dump, manifest)

    def read(
        self, name: str, *, step: int, peer: str, lazy: bool = False
    ) -> np.ndarray | DaskArray:
        """One tensor of one dump (numpy, or a dask.array with ``lazy=True``)."""
        return self.dump(step, peer).read(name, lazy=lazy)

    @property
    def aggregates(self) -> list[AggregateEntry]:
        """The recorded aggregates, by (step, name)."""
        return list(self.manifest.aggregates)

    def aggregate(self, name: str, *, step: int) -> Aggregate:
        """The aggregate recorded as ``name`` for ``step``."""
        parse_name(name, what="aggregate name")
        entry = self.manifest.aggregate_entry(step, name)
        if entry is None:
            known = sorted({(a.name) for a in self.manifest.aggregates})
            raise NotFoundError(
                f"run {printable(self.name)} has no aggregate {printable(name)} of step {step} "
                f"(aggregates: {', '.join(known) or 'none'}); compute it with gradpipe aggregate"
            )
        manifest = self.store.get_typed(
            entry.aggregate,
            AggregateManifest,
            context=f"run {printable(self.name)} aggregate {printable(name)} of step {step}",
        )
        return Aggregate(
            self.store, entry.aggregate, manifest, stale_reason(self.manifest, manifest)
        )


@dataclass(frozen=True)
class _TensorSet(ABC):
    """What a dump and an aggregate share: named tensors, with their manifests embedded."""

    store: Store
    id: str
    manifest: DumpManifest | AggregateManifest

    @property
    def step(self) -> int:
        return self.manifest.step

    @property
    def names(self) -> list[str]:
        """Tensor names, in the file's order."""
        return [name for name, _ in self.manifest.tensors]

    def info(self, name: str) -> TensorManifest:
        """Dtype, shape, chunks and statistics of a tensor; reads no data."""
        tensor_id = self._tensor_id(name)
        embedded = self.manifest.embedded.get(tensor_id)
        if embedded is not None:
            return embedded
        return self.store.get_typed(tensor_id, TensorManifest, context=self._where(name))

    def read(self, name: str, *, lazy: bool = False) -> np.ndarray | DaskArray:
        """A tensor as numpy (bit-exact) or, with ``lazy=True``, as a dask.array."""
        manifest = self.info(name)
        context = self._where(name)
        if lazy:
            from gradpipe.graph.arrays import lazy_tensor

            return lazy_tensor(self.store, manifest, name=context)
        return self.store.read_tensor(manifest, context=context)

    def infos(self) -> dict[str, TensorManifest]:
        """Every tensor's manifest (dtype, shape, chunks, stats), in the file's order.

        Manifests not embedded in the dump's own are fetched in one batch,
        once per :class:`Dump`.
        """
        return dict(self._infos)

    @cached_property
    def _infos(self) -> dict[str, TensorManifest]:
        embedded = self.manifest.embedded
        elsewhere = [tid for _, tid in self.manifest.tensors if tid not in embedded]
        fetched = self.store.get_typed_many(elsewhere, TensorManifest, context=self._label())
        manifests = {**dict(zip(elsewhere, fetched, strict=True)), **embedded}
        return {name: manifests[tid] for name, tid in self.manifest.tensors}

    def read_all(self) -> dict[str, np.ndarray]:
        """Every tensor of the dump, in the file's order.

        Every chunk of every tensor is decoded in one parallel pass
        (:func:`gradpipe.storage.tensors.read_tensors`).
        """
        return dict(zip(self.names, self.iter_read(), strict=True))

    def iter_read(self, names: Sequence[str] | None = None) -> Iterator[np.ndarray]:
        """The tensors ``names`` (default: all, in the file's order), in that order.

        One parallel pass over all their chunks, like :meth:`read_all`, but each
        tensor is yielded as soon as it is whole, while later ones decode.
        """
        infos = self._infos
        wanted = self.names if names is None else list(names)
        for name in wanted:
            if name not in infos:
                self._tensor_id(name)  # the error that names what the dump has
        return self.store.iter_tensors(
            [infos[n] for n in wanted], contexts=[self._where(n) for n in wanted]
        )

    def __repr__(self) -> str:
        return f"<gradpipe.{type(self).__name__} {self._label()}: {len(self.names)} tensors>"

    def _tensor_rows(self) -> list[tuple[object, ...]]:
        """Per tensor: dtype, shape, raw size, stored encoding; from manifests only."""
        rows: list[tuple[object, ...]] = []
        for name, info in self.infos().items():
            encoding = "lossy" if not info.exact else "delta" if info.deltas else "full"
            rows.append(
                (
                    name,
                    info.dtype,
                    list(info.shape),
                    human_bytes(info.nbytes),
                    len(info.blocks),
                    encoding,
                )
            )
        return rows

    def _tensors_html(self) -> str:
        return table(["tensor", "dtype", "shape", "raw", "chunks", "encoding"], self._tensor_rows())

    @abstractmethod
    def _label(self) -> str:
        """How messages name this set of tensors ("dump of step 3, peer 'a'")."""

    def _where(self, name: str) -> str:
        return f"tensor {printable(name)} of {self._label()}"

    def _tensor_id(self, name: str) -> str:
        try:
            return self.manifest.tensor_ids[name]
        except KeyError:
            raise NotFoundError(
                f"{self._label()} has no tensor {printable(name)} "
                f"(it has {', '.join(self.names[:8])}{'...' if len(self.names) > 8 else ''})"
            ) from None


@dataclass(frozen=True, repr=False)  # _TensorSet's one-line repr
class Dump(_TensorSet):
    """A read-only view of one dump: tensors, metadata, provenance."""

    manifest: DumpManifest

    @property
    def peer(self) -> str:
        return self.manifest.peer

    @property
    def metadata(self) -> dict[str, str]:
        """The dump's own metadata (``num_examples``...)."""
        return dict(self.manifest.metadata)

    @property
    def source(self) -> dict[str, str]:
        """Where the dump came from: path, format, size, fingerprint."""
        return dict(self.manifest.source)

    def _label(self) -> str:
        return f"step {self.step}, peer {printable(self.peer)}"

    def _repr_html_(self) -> str:
        return key_values(
            f"dump of {self._label()}",
            {"id": self.id, **self.metadata, **{f"source {k}": v for k, v in self.source.items()}},
            self._tensors_html(),
        )


@dataclass(frozen=True, repr=False)  # _TensorSet's one-line repr
class Aggregate(_TensorSet):
    """A read-only view of one aggregate: tensors, method, parameters, inputs.

    ``stale`` says why its inputs differ from the dumps the run records now
    (a dump replaced, a peer added or gone), or is None.
    """

    manifest: AggregateManifest
    stale: str | None = None

    @property
    def name(self) -> str:
        return self.manifest.name

    @property
    def method(self) -> str:
        return self.manifest.method

    @property
    def params(self) -> dict[str, object]:
        return dict(self.manifest.params)

    @property
    def peers(self) -> list[str]:
        """The peers aggregated, in order."""
        return self.manifest.peers

    @property
    def weights(self) -> dict[str, float]:
        """Peer → the weight it had."""
        return {i.peer: i.weight for i in self.manifest.inputs}

    @property
    def metadata(self) -> dict[str, str]:
        """String metadata for an exported file: what the aggregate is and how it was made."""
        import json

        return {
            "aggregate": self.name,
            "method": self.method,
            "step": str(self.step),
            "run": self.manifest.run,
            "params": json.dumps(self.manifest.params, sort_keys=True),
            "inputs": json.dumps([i.to_list() for i in self.manifest.inputs]),
            "aggregate_id": self.id,
        }

    def _label(self) -> str:
        return f"aggregate {printable(self.name)} of step {self.step}"

    def _repr_html_(self) -> str:
        peers = ", ".join(f"{p} ({w:g})" for p, w in self.weights.items())
        return key_values(
            self._label(),
            {
                "method": self.method,
                "peers (weight)": peers,
                "params": self.params,
                "stale": self.stale or "no",
                "id": self.id,
            },
            self._tensors_html(),
        )


def export_dump(store: Store, run: str, step: int, peer: str, path: str | os.PathLike[str]) -> Dump:
    """Write a dump back as safetensors: bit-exact tensors and its metadata.

    ``path`` must name a regular file or nothing (not a symlink, FIFO, device
    or directory) outside any store; see :func:`gradpipe.output.parse_output_path`.
    """
    from gradpipe.formats.safetensors import write_safetensors_stream
    from gradpipe.output import parse_output_path

    parse_output_path(path, store_url=store.url)
    dump = open_run(store, run).dump(step, peer)
    specs = {name: (m.dtype, m.shape) for name, m in dump.infos().items()}
    # Tensors are written as they are decoded, while later ones decode.
    write_safetensors_stream(path, specs, dump.iter_read, dump.metadata)
    return dump


def export_aggregate(
    store: Store, run: str, step: int, name: str, path: str | os.PathLike[str]
) -> Aggregate:
    """Write an aggregate as safetensors: its tensors, bit-exact, and its provenance as metadata."""
    from gradpipe.formats.safetensors import write_safetensors_stream
    from gradpipe.output import parse_output_path

    parse_output_path(path, store_url=store.url)
    found = open_run(store, run).aggregate(name, step=step)
    specs = {tensor: (m.dtype, m.shape) for tensor, m in found.infos().items()}
    write_safetensors_stream(path, specs, found.iter_read, found.metadata)
    return found


def _span(steps: list[int]) -> str:
    if not steps:
        return "none"
    return f"{steps[0]}..{steps[-1]}" if len(steps) > 1 else str(steps[0])
