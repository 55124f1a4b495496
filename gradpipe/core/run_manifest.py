"""Manifests of training runs: one per dump, one per run.

A run ref (``runs/<name>``) points at a :class:`RunManifest`, which lists
every recorded dump with its source fingerprint (so a re-run of an ingest
can skip a file without reading it), the run's tensor schema (so every
dump of the run agrees on each tensor's dtype and shape) and the aggregates
computed from its dumps, each under its memo key (format 3).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, ClassVar

from gradpipe.core.dtypes import parse_dtype
from gradpipe.core.ids import parse_id
from gradpipe.core.manifest import Manifest
from gradpipe.core.names import parse_name
from gradpipe.core.tensor_manifest import EmbeddedTensors, TensorManifest
from gradpipe.errors import InvalidInputError

__all__ = [
    "AggregateEntry",
    "DumpEntry",
    "DumpManifest",
    "RunManifest",
    "TensorSchema",
    "merge_run",
    "record_aggregates",
]


@dataclass(frozen=True, slots=True)
class TensorSchema:
    """What a tensor name means throughout a run."""

    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        parse_dtype(self.dtype)

    def describe(self) -> str:
        """``float32 (64, 128)``."""
        return f"{self.dtype} {self.shape}"

    def to_dict(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TensorSchema:
        return cls(str(data["dtype"]), tuple(int(n) for n in data["shape"]))


@dataclass(frozen=True)
class DumpManifest(EmbeddedTensors, Manifest):
    """The tensors of one (run, step, peer), with metadata and provenance.

    ``tensors`` keeps the file's order (pairs of name and tensor id), so the
    dump lists its tensors as the file did. ``embedded`` holds the manifests of
    tensors kept inside this one (format 2: ingest embeds every tensor of a
    dump, so a dump is one object plus its large chunks); a tensor's id is the
    hash of its own encoding wherever it is kept.
    """

    type: ClassVar[str] = "dump"

    run: str
    step: int
    peer: str
    tensors: tuple[tuple[str, str], ...]
    metadata: dict[str, str] = field(default_factory=dict)
    source: dict[str, str] = field(default_factory=dict)
    embedded: Mapping[str, TensorManifest] = field(default_factory=dict)

    def __post_init__(self) -> None:
        parse_name(self.run, what="run name")
        parse_name(self.peer, what="peer name")
        if self.step < 0:
            raise InvalidInputError(f"step must be >= 0, got {self.step}")
        for _, tensor_id in self.tensors:
            parse_id(tensor_id)
        listed = {tensor_id for _, tensor_id in self.tensors}
        for tensor_id in self.embedded:
            if tensor_id not in listed:
                raise InvalidInputError(f"embedded tensor {tensor_id} is not one of the dump's")

    @cached_property
    def tensor_ids(self) -> dict[str, str]:
        """Tensor name → tensor id."""
        return dict(self.tensors)

    def manifest_children(self) -> Iterator[str]:
        return (t for t in dict.fromkeys(self.tensor_ids.values()) if t not in self.embedded)

    def format_needed(self) -> int:
        return 2 if self.embedded else 1

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "run": self.run,
            "step": self.step,
            "peer": self.peer,
            "tensors": [list(pair) for pair in self.tensors],
            "metadata": dict(self.metadata),
            "source": dict(self.source),
        }
        if self.embedded:
            out["embedded"] = {t: m.to_dict() for t, m in self.embedded.items()}
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DumpManifest:
        return cls(
            run=data["run"],
            step=int(data["step"]),
            peer=data["peer"],
            tensors=tuple((str(n), str(t)) for n, t in data["tensors"]),
            metadata={str(k): str(v) for k, v in data["metadata"].items()},
            source={str(k): str(v) for k, v in data["source"].items()},
            embedded={
                parse_id(t): TensorManifest.from_dict(m)
                for t, m in data.get("embedded", {}).items()
            },
        )


@dataclass(frozen=True, slots=True)
class DumpEntry:
    """One recorded dump of a run.

    ``lossy`` marks a dump with a tensor stored by a lossy codec (format 4),
    so ``gradpipe ls`` can say so without reading the dump's manifest.
    """

    step: int
    peer: str
    dump: str
    fingerprint: str
    lossy: bool = False

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "step": self.step,
            "peer": self.peer,
            "dump": self.dump,
            "fingerprint": self.fingerprint,
        }
        if self.lossy:  # absent otherwise: runs without lossy dumps keep their ids
            out["lossy"] = True
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DumpEntry:
        return cls(
            int(data["step"]),
            str(data["peer"]),
            parse_id(data["dump"]),
            str(data["fingerprint"]),
            bool(data.get("lossy", False)),
        )


@dataclass(frozen=True, slots=True)
class AggregateEntry:
    """One recorded aggregate of a run: (step, name) → its manifest, under its memo key."""

    step: int
    name: str
    aggregate: str
    key: str

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "name": self.name, "aggregate": self.aggregate, "key": self.key}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AggregateEntry:
        return cls(
            int(data["step"]), str(data["name"]), parse_id(data["aggregate"]), parse_id(data["key"])
        )


@dataclass(frozen=True)
class RunManifest(Manifest):
    """A run: its dumps in (step, peer) order, the schema they share, its aggregates."""

    type: ClassVar[str] = "run"

    run: str
    dumps: tuple[DumpEntry, ...] = ()
    schema: dict[str, TensorSchema] = field(default_factory=dict)
    aggregates: tuple[AggregateEntry, ...] = ()

    def __post_init__(self) -> None:
        parse_name(self.run, what="run name")
        keys = [(d.step, d.peer) for d in self.dumps]
        if keys != sorted(set(keys)):
            raise InvalidInputError(f"run {self.run!r} lists dumps out of order or twice")
        named = [(a.step, a.name) for a in self.aggregates]
        if named != sorted(set(named)):
            raise InvalidInputError(f"run {self.run!r} lists aggregates out of order or twice")

    @cached_property
    def _index(self) -> dict[tuple[int, str], DumpEntry]:
        return {(d.step, d.peer): d for d in self.dumps}

    def entry(self, step: int, peer: str) -> DumpEntry | None:
        """The dump recorded for (step, peer), if any."""
        return self._index.get((step, peer))

    def aggregate_entry(self, step: int, name: str) -> AggregateEntry | None:
        """The aggregate recorded as ``name`` for ``step``, if any."""
        return next((a for a in self.aggregates if (a.step, a.name) == (step, name)), None)

    def step_dumps(self, step: int) -> list[DumpEntry]:
        """The dumps of one step, in peer order."""
        return [d for d in self.dumps if d.step == step]

    @property
    def steps(self) -> list[int]:
        """Recorded steps, ascending."""
        return sorted({d.step for d in self.dumps})

    @property
    def peers(self) -> list[str]:
        """Peers seen in any step, sorted."""
        return sorted({d.peer for d in self.dumps})

    def manifest_children(self) -> Iterator[str]:
        yield from (d.dump for d in self.dumps)
        yield from (a.aggregate for a in self.aggregates)

    def format_needed(self) -> int:
        # A run without aggregates is written as before, so older readers still read it.
        if any(d.lossy for d in self.dumps):
            return 4
        return 3 if self.aggregates else 1

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "run": self.run,
            "dumps": [d.to_dict() for d in self.dumps],
            "schema": {name: s.to_dict() for name, s in sorted(self.schema.items())},
        }
        if self.aggregates:
            out["aggregates"] = [a.to_dict() for a in self.aggregates]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunManifest:
        return cls(
            run=data["run"],
            dumps=tuple(DumpEntry.from_dict(d) for d in data["dumps"]),
            schema={str(k): TensorSchema.from_dict(v) for k, v in data["schema"].items()},
            aggregates=tuple(AggregateEntry.from_dict(a) for a in data.get("aggregates", ())),
        )


def merge_run(
    run: RunManifest, new: list[DumpEntry], schema: dict[str, TensorSchema]
) -> RunManifest:
    """``run`` with ``new`` dumps added (a dump already there is replaced); aggregates kept."""
    by_key = {(d.step, d.peer): d for d in run.dumps}
    by_key.update({(d.step, d.peer): d for d in new})
    merged_schema = dict(run.schema)
    for name, spec in schema.items():
        merged_schema.setdefault(name, spec)
    return RunManifest(
        run.run, tuple(by_key[k] for k in sorted(by_key)), merged_schema, run.aggregates
    )


def record_aggregates(run: RunManifest, new: list[AggregateEntry]) -> RunManifest:
    """``run`` with ``new`` aggregates recorded (one of the same step and name is replaced)."""
    by_key = {(a.step, a.name): a for a in run.aggregates}
    by_key.update({(a.step, a.name): a for a in new})
    return RunManifest(run.run, run.dumps, run.schema, tuple(by_key[k] for k in sorted(by_key)))
