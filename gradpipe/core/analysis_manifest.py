"""The manifest of an analysis: figures computed from one step of a run, and what defines them.

An analysis of a step (its norms, its peers' agreement, ...) names everything
its figures depend on, as an aggregate does: the run and step, the analysis and
its version (bumped when its math changes), the parameters that change stored
figures, and its inputs (each dump or aggregate id, with the peer's weight where
one applies), plus ``extra`` ids it also read (a query's projection, say). Its
``key`` is the hash of the canonical JSON of those, the memo key under which the
run's analytics index records it (:mod:`gradpipe.core.analytics_index`): asking
again for the same analysis of the same dumps reads nothing but the index. A
replaced dump changes the key, so a result is never reused for other inputs.

The result arrays are ordinary tensors embedded as a dump's are; ``coords``
labels their axes (peers, tensor names, bin edges) and ``figures`` holds the
scalars a report shows.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, ClassVar

from gradpipe.core.display import printable, printable_names
from gradpipe.core.encoding import to_json_bytes
from gradpipe.core.ids import hash_bytes, parse_id
from gradpipe.core.manifest import Manifest
from gradpipe.core.names import parse_name
from gradpipe.core.tensor_manifest import EmbeddedTensors, LazyTensors, TensorManifest
from gradpipe.errors import InvalidInputError

__all__ = ["AnalysisInput", "AnalysisManifest", "analysis_key"]


@dataclass(frozen=True, slots=True)
class AnalysisInput:
    """One source an analysis read: a peer's dump (or an aggregate, by its name), and a weight.

    ``weight`` is the peer's weight where the figures use one (the peers'
    mean), else None.
    """

    label: str
    source: str
    weight: float | None = None

    def __post_init__(self) -> None:
        parse_name(self.label, what="analysis input")
        parse_id(self.source)
        if self.weight is not None and (not math.isfinite(self.weight) or self.weight <= 0):
            raise InvalidInputError(
                f"input {printable(self.label)}: weight {self.weight!r} is not a finite number > 0"
            )

    def to_list(self) -> list[Any]:
        return [self.label, self.source, self.weight]

    @classmethod
    def from_list(cls, data: Sequence[Any]) -> AnalysisInput:
        label, source, weight = data
        return cls(str(label), str(source), None if weight is None else float(weight))


def analysis_key(
    analysis: str,
    version: int,
    params: Mapping[str, Any],
    inputs: Sequence[AnalysisInput],
    extra: Sequence[str] = (),
) -> str:
    """The memo key of an analysis: the hash of what defines its figures, as canonical JSON.

    Only parameters that change stored figures belong in ``params``; those that
    act when the figures are read (a spike threshold, a layer rule) stay out,
    so changing them reuses what is stored.
    """
    doc = {
        "analysis": analysis,
        "version": version,
        "params": dict(params),
        "inputs": [i.to_list() for i in inputs],
        "extra": list(extra),
    }
    return hash_bytes(to_json_bytes(doc))


@dataclass(frozen=True)
class AnalysisManifest(EmbeddedTensors, Manifest):
    """One analysis of one step of a run: what defines it, its figures and its result arrays."""

    type: ClassVar[str] = "analysis"

    run: str
    step: int
    #: The entry's name in the run's index: ``norms``, ``norms:fedavg``...
    name: str
    analysis: str
    version: int
    params: dict[str, Any]
    inputs: tuple[AnalysisInput, ...]
    key: str
    tensors: tuple[tuple[str, str], ...]
    extra: tuple[str, ...] = ()
    provenance: dict[str, str] = field(default_factory=dict)
    coords: dict[str, Any] = field(default_factory=dict)
    figures: dict[str, Any] = field(default_factory=dict)
    embedded: Mapping[str, TensorManifest] = field(default_factory=dict)

    def __post_init__(self) -> None:
        parse_name(self.run, what="run name")
        if isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 0:
            raise InvalidInputError(
                f"analysis step must be an integer >= 0, not {printable(self.step)}"
            )
        if isinstance(self.version, bool) or not isinstance(self.version, int):
            raise InvalidInputError(f"analysis version {printable(self.version)} is not an integer")
        if not self.inputs:
            raise InvalidInputError(
                f"analysis {printable(self.name)} of step {self.step} has no inputs"
            )
        labels = [i.label for i in self.inputs]
        if len(set(labels)) != len(labels):
            raise InvalidInputError(
                f"analysis {printable(self.name)} lists an input twice: {printable_names(labels)}"
            )
        parse_id(self.key)
        for extra_id in self.extra:
            parse_id(extra_id)
        for _, tensor_id in self.tensors:
            parse_id(tensor_id)
        listed = {tensor_id for _, tensor_id in self.tensors}
        for tensor_id in self.embedded:
            if tensor_id not in listed:
                raise InvalidInputError(f"embedded tensor {tensor_id} is not one of the analysis'")

    @cached_property
    def tensor_ids(self) -> dict[str, str]:
        """Result array name → tensor id."""
        return dict(self.tensors)

    def manifest_children(self) -> Iterator[str]:
        # Inputs and extra ids are provenance, not children: a result outlives a
        # replaced dump (its key no longer matches, so it is recomputed, not reused).
        return (t for t in dict.fromkeys(self.tensor_ids.values()) if t not in self.embedded)

    def format_needed(self) -> int:
        return 6

    def to_dict(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "step": self.step,
            "name": self.name,
            "analysis": self.analysis,
            "version": self.version,
            "params": dict(self.params),
            "inputs": [i.to_list() for i in self.inputs],
            "extra": list(self.extra),
            "key": self.key,
            "provenance": dict(self.provenance),
            "coords": dict(self.coords),
            "figures": dict(self.figures),
            "tensors": [list(pair) for pair in self.tensors],
            "embedded": {t: m.to_dict() for t, m in self.embedded.items()},
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AnalysisManifest:
        for part in ("params", "coords", "figures", "provenance"):
            if not isinstance(data[part], dict):
                raise TypeError(f"analysis {part} are not an object")
        return cls(
            run=str(data["run"]),
            step=int(data["step"]),
            name=str(data["name"]),
            analysis=str(data["analysis"]),
            version=int(data["version"]),
            params=data["params"],
            inputs=tuple(AnalysisInput.from_list(i) for i in data["inputs"]),
            key=str(data["key"]),
            tensors=tuple((str(n), str(t)) for n, t in data["tensors"]),
            extra=tuple(str(e) for e in data["extra"]),
            provenance={str(k): str(v) for k, v in data["provenance"].items()},
            coords=data["coords"],
            figures=data["figures"],
            embedded=LazyTensors(data["embedded"]),
        )
