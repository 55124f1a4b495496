"""The entries of a run: its tensor schema, its recorded dumps, aggregates and analyses.

A run lists each dump under its key ``(step, peer)`` and each aggregate under
``(step, name)``; both kinds are kept in step order, in the run's manifest
itself while they are few and in shards once they are many
(:mod:`gradpipe.core.run_shards`). Its analyses are listed the same way, under
``(step, name)``, in an index of their own (:mod:`gradpipe.core.analytics_index`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gradpipe.core.dtypes import parse_dtype
from gradpipe.core.ids import parse_id

__all__ = ["AggregateEntry", "AnalysisEntry", "DumpEntry", "EntryKey", "TensorSchema"]

#: Where an entry sorts in its run: ``(step, peer)`` for a dump, ``(step, name)``
#: for an aggregate.
EntryKey = tuple[int, str]


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

    @property
    def sort_key(self) -> EntryKey:
        """``(step, peer)``: where the entry sorts in its run."""
        return (self.step, self.peer)

    @property
    def target(self) -> str:
        """The id of the dump's manifest."""
        return self.dump

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

    @property
    def sort_key(self) -> EntryKey:
        """``(step, name)``: where the entry sorts in its run."""
        return (self.step, self.name)

    @property
    def target(self) -> str:
        """The id of the aggregate's manifest."""
        return self.aggregate

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "name": self.name, "aggregate": self.aggregate, "key": self.key}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AggregateEntry:
        return cls(
            int(data["step"]), str(data["name"]), parse_id(data["aggregate"]), parse_id(data["key"])
        )


@dataclass(frozen=True, slots=True)
class AnalysisEntry:
    """One memoised analysis of a run: (step, name) → its result's manifest, under its key.

    ``name`` says which analysis of what: ``norms`` (the step's dumps) or
    ``norms:fedavg`` (the step's aggregate ``fedavg``).
    """

    step: int
    name: str
    analysis: str
    key: str

    @property
    def sort_key(self) -> EntryKey:
        """``(step, name)``: where the entry sorts in its index."""
        return (self.step, self.name)

    @property
    def target(self) -> str:
        """The id of the analysis' manifest."""
        return self.analysis

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "name": self.name, "analysis": self.analysis, "key": self.key}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AnalysisEntry:
        return cls(
            int(data["step"]), str(data["name"]), parse_id(data["analysis"]), parse_id(data["key"])
        )
