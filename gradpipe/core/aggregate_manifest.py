"""The manifest of an aggregate: a tensor set computed from the dumps of one step.

An aggregate names everything that defines it: the run and step, the method
and its parameters, and its inputs (each peer's dump id and weight, in the
fixed peer order), with the tensors it produced embedded as a dump's are. Its
``key`` is the hash of the canonical JSON of ``{method, params, inputs}``: the
memo key under which the run records it, so asking again for the same
aggregate of the same dumps reads no chunk. ``inputs`` also tells whether an
aggregate is *stale*: a dump it used was replaced (``ingest --replace``) or a
peer was added to its step since (:func:`stale_reason`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, ClassVar

from gradpipe.core.display import printable, printable_names
from gradpipe.core.encoding import to_json_bytes
from gradpipe.core.ids import hash_bytes, parse_id
from gradpipe.core.manifest import Manifest
from gradpipe.core.names import parse_name
from gradpipe.core.tensor_manifest import EmbeddedTensors, LazyTensors, TensorManifest
from gradpipe.errors import InvalidInputError

if TYPE_CHECKING:
    from gradpipe.core.run_manifest import RunManifest

__all__ = ["AggregateInput", "AggregateManifest", "aggregate_key", "stale_reason"]


@dataclass(frozen=True, slots=True)
class AggregateInput:
    """One peer's part in an aggregate: its dump and its weight."""

    peer: str
    dump: str
    weight: float

    def __post_init__(self) -> None:
        parse_name(self.peer, what="peer name")
        parse_id(self.dump)
        if not math.isfinite(self.weight) or self.weight <= 0:
            raise InvalidInputError(
                f"peer {printable(self.peer)}: weight {self.weight!r} is not a finite number > 0"
            )

    def to_list(self) -> list[Any]:
        return [self.peer, self.dump, self.weight]

    @classmethod
    def from_list(cls, data: Sequence[Any]) -> AggregateInput:
        peer, dump, weight = data
        return cls(str(peer), str(dump), float(weight))


def aggregate_key(method: str, params: Mapping[str, Any], inputs: Sequence[AggregateInput]) -> str:
    """The memo key of an aggregate: the hash of ``{method, params, inputs}`` as canonical JSON.

    The inputs enter with their dump ids and weights (a dump id already
    names its run, step and peer), in peer order.
    """
    doc = {
        "method": method,
        "params": dict(params),
        "inputs": [[i.dump, i.weight] for i in inputs],
    }
    return hash_bytes(to_json_bytes(doc))


@dataclass(frozen=True)
class AggregateManifest(EmbeddedTensors, Manifest):
    """An aggregate of one step of a run: method, parameters, inputs, provenance, tensors.

    ``tensors`` keeps the tensors' order (pairs of name and tensor id); their
    manifests are embedded, as in a dump (format 3: aggregates are new).
    """

    type: ClassVar[str] = "aggregate"

    run: str
    step: int
    name: str
    method: str
    params: dict[str, Any]
    inputs: tuple[AggregateInput, ...]
    tensors: tuple[tuple[str, str], ...]
    key: str
    provenance: dict[str, str] = field(default_factory=dict)
    embedded: Mapping[str, TensorManifest] = field(default_factory=dict)

    def __post_init__(self) -> None:
        parse_name(self.run, what="run name")
        parse_name(self.name, what="aggregate name")
        if isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 0:
            raise InvalidInputError(
                f"aggregate step must be an integer >= 0, not {printable(self.step)}"
            )
        if not self.inputs:
            raise InvalidInputError(
                f"aggregate {printable(self.name)} of step {self.step} has no inputs"
            )
        peers = [i.peer for i in self.inputs]
        if len(set(peers)) != len(peers):
            raise InvalidInputError(
                f"aggregate {printable(self.name)} lists a peer twice: {printable_names(peers)}"
            )
        parse_id(self.key)
        for _, tensor_id in self.tensors:
            parse_id(tensor_id)
        listed = {tensor_id for _, tensor_id in self.tensors}
        for tensor_id in self.embedded:
            if tensor_id not in listed:
                raise InvalidInputError(
                    f"embedded tensor {tensor_id} is not one of the aggregate's"
                )

    @cached_property
    def tensor_ids(self) -> dict[str, str]:
        """Tensor name → tensor id."""
        return dict(self.tensors)

    @property
    def peers(self) -> list[str]:
        """The peers aggregated, in the fixed peer order."""
        return [i.peer for i in self.inputs]

    @property
    def dumps(self) -> dict[str, str]:
        """Peer → the id of the dump it contributed."""
        return {i.peer: i.dump for i in self.inputs}

    def manifest_children(self) -> Iterator[str]:
        # The input dumps are provenance, not children: an aggregate outlives
        # a replaced dump (it is content-addressed and names what it used), and
        # keeping the old dump alive for it is not gc's business.
        return (t for t in dict.fromkeys(self.tensor_ids.values()) if t not in self.embedded)

    def format_needed(self) -> int:
        return 3

    def to_dict(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "step": self.step,
            "name": self.name,
            "method": self.method,
            "params": dict(self.params),
            "inputs": [i.to_list() for i in self.inputs],
            "tensors": [list(pair) for pair in self.tensors],
            "key": self.key,
            "provenance": dict(self.provenance),
            "embedded": {t: m.to_dict() for t, m in self.embedded.items()},
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AggregateManifest:
        params = data["params"]
        if not isinstance(params, dict):
            raise TypeError("aggregate params are not an object")
        return cls(
            run=str(data["run"]),
            step=int(data["step"]),
            name=str(data["name"]),
            method=str(data["method"]),
            params=params,
            inputs=tuple(AggregateInput.from_list(i) for i in data["inputs"]),
            tensors=tuple((str(n), str(t)) for n, t in data["tensors"]),
            key=str(data["key"]),
            provenance={str(k): str(v) for k, v in data["provenance"].items()},
            embedded=LazyTensors(data["embedded"]),
        )


def stale_reason(run: RunManifest, aggregate: AggregateManifest) -> str | None:
    """Why ``aggregate`` no longer matches the dumps ``run`` records at its step, or None.

    Stale: a peer's dump was replaced (its id differs), a peer it used is no
    longer recorded, or the step has a peer it did not use.
    """
    current = {d.peer: d.dump for d in run.step_dumps(aggregate.step)}
    used = aggregate.dumps
    replaced = sorted(p for p, d in used.items() if p in current and current[p] != d)
    gone = sorted(p for p in used if p not in current)
    added = sorted(p for p in current if p not in used)
    reasons = []
    if replaced:
        reasons.append(f"dumps of {', '.join(replaced)} replaced")
    if gone:
        reasons.append(f"{', '.join(gone)} no longer recorded")
    if added:
        reasons.append(f"{', '.join(added)} added")
    return "; ".join(reasons) or None
