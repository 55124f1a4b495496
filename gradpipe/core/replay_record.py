"""What a snapshot version written with optimizer replay records to be read back.

A replay version (format 5, docs/design/016) stores some chunks as residuals against a
prediction: the optimizer step replayed (:func:`gradpipe.core.replay.replay`) from the
previous version's chunks and the gradient the step applied. Its manifest keeps everything
that prediction needs in a :class:`ReplayRecord`:

- the gradient (:class:`GradientRef`): an aggregate of a run or the dumps of one of its
  steps, kept alive as children of the snapshot (gc keeps them, verify checks them), or
  tensors recorded with the snapshot and embedded in it;
- per parameter group (:class:`ReplayGroup`): the optimizer step (kind, hyperparameters as
  applied, step count, arithmetic variant), the step's scalars as bit patterns, and which
  array of the state is each parameter's value and moments.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from gradpipe.core.display import printable
from gradpipe.core.ids import parse_id
from gradpipe.core.replay import OptimizerStep, roles
from gradpipe.errors import InvalidInputError

__all__ = ["COMBINE_RULES", "GradientRef", "ReplayGroup", "ReplayRecord", "ReplayTarget"]

#: How the dumps of a step make the gradient the step applied: the peers' float32 sum then
#: divided by their number (an all-reduce sum, then the mean), or each divided first (as
#: DDP does before its all-reduce). Peers in the run's order.
COMBINE_RULES = ("sum-then-scale", "scale-then-sum")


@dataclass(frozen=True)
class GradientRef:
    """Where the gradient of a replayed step is kept.

    Exactly one of ``aggregate`` (the id of an aggregate manifest, whose tensors are named
    as the gradients), ``dumps`` (the ``(peer, dump manifest id)`` of a step, combined by
    ``combine``, one of :data:`COMBINE_RULES`) and ``recorded`` (gradient name → id of a
    tensor manifest embedded in the snapshot). ``label`` says where it came from, for people
    (``run:name@step``, ``run@step``).
    """

    aggregate: str | None = None
    recorded: Mapping[str, str] = field(default_factory=dict)
    label: str = ""
    dumps: tuple[tuple[str, str], ...] = ()
    combine: str = ""

    def __post_init__(self) -> None:
        if (self.aggregate is not None) + bool(self.recorded) + bool(self.dumps) != 1:
            raise InvalidInputError(
                "a replay's gradient is an aggregate, the dumps of a step or recorded tensors"
            )
        if self.aggregate is not None:
            parse_id(self.aggregate)
        for tensor_id in self.recorded.values():
            parse_id(tensor_id)
        for _, dump_id in self.dumps:
            parse_id(dump_id)
        if bool(self.dumps) != (self.combine in COMBINE_RULES):
            raise InvalidInputError(
                f"the dumps of a step are combined by one of {', '.join(COMBINE_RULES)}"
            )

    def children(self) -> Iterator[str]:
        """The manifests it keeps alive (an aggregate, dumps)."""
        if self.aggregate is not None:
            yield self.aggregate
        yield from (dump_id for _, dump_id in self.dumps)

    def describe(self) -> str:
        """One line for ``gradpipe log``."""
        if self.aggregate is not None:
            return f"aggregate {self.label or self.aggregate}"
        if self.dumps:
            return f"dumps {self.label} ({len(self.dumps)} peers, {self.combine})"
        return f"recorded ({len(self.recorded)} tensors)"

    def to_dict(self) -> dict[str, Any]:
        if self.aggregate is not None:
            return {"aggregate": self.aggregate, "label": self.label}
        if self.dumps:
            return {
                "dumps": [list(pair) for pair in self.dumps],
                "combine": self.combine,
                "label": self.label,
            }
        return {"recorded": dict(self.recorded)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GradientRef:
        aggregate = data.get("aggregate")
        return cls(
            aggregate=None if aggregate is None else str(aggregate),
            recorded={str(k): str(v) for k, v in (data.get("recorded") or {}).items()},
            label=str(data.get("label", "")),
            dumps=tuple((str(p), str(d)) for p, d in (data.get("dumps") or ())),
            combine=str(data.get("combine", "")),
        )


@dataclass(frozen=True)
class ReplayGroup:
    """Parameters replayed with one optimizer step.

    ``params`` maps each parameter's gradient name to its state arrays, by role
    (:func:`~gradpipe.core.replay.roles`: ``param``, ``exp_avg``, ...); ``scalars`` holds
    the step's scalars per computation dtype, as bit patterns
    (:func:`~gradpipe.core.replay.scalars_to_json`), so a reader never computes them;
    ``decay`` the moments' decay factors the same way (a version kept without a gradient
    predicts its moments from them: :func:`~gradpipe.core.replay.decay_factors`).
    """

    step: OptimizerStep
    scalars: Mapping[str, Mapping[str, str]]
    params: Mapping[str, Mapping[str, str]]
    decay: Mapping[str, Mapping[str, str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        needed = set(roles(self.step))
        for grad_name, by_role in self.params.items():
            if set(by_role) != needed:
                raise InvalidInputError(
                    f"replay of {printable(grad_name)} lists roles {printable(sorted(by_role))}, "
                    f"{self.step.kind} needs {printable(sorted(needed))}"
                )

    def to_dict(self) -> dict[str, Any]:
        out = {
            "step": self.step.to_dict(),
            "scalars": {d: dict(s) for d, s in self.scalars.items()},
            "params": {g: dict(r) for g, r in self.params.items()},
        }
        if self.decay:
            out["decay"] = {d: dict(s) for d, s in self.decay.items()}
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ReplayGroup:
        return cls(
            OptimizerStep.from_dict(data["step"]),
            {str(d): {str(k): str(v) for k, v in s.items()} for d, s in data["scalars"].items()},
            {str(g): {str(k): str(v) for k, v in r.items()} for g, r in data["params"].items()},
            {
                str(d): {str(k): str(v) for k, v in s.items()}
                for d, s in (data.get("decay") or {}).items()
            },
        )


@dataclass(frozen=True)
class ReplayTarget:
    """One array of a replay version as its reader needs it: group, parameter, role."""

    group: ReplayGroup
    grad_name: str
    role: str

    @property
    def arrays(self) -> Mapping[str, str]:
        """The array key of each role of the same parameter."""
        return self.group.params[self.grad_name]


@dataclass(frozen=True)
class ReplayRecord:
    """The gradient and the optimizer steps a replay version was predicted with.

    ``gradient`` is None for a version kept without its gradient: only its moments are
    predicted, from their decay.
    """

    gradient: GradientRef | None
    groups: tuple[ReplayGroup, ...]

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for key in self.array_keys():
            if key in seen:
                raise InvalidInputError(f"replay lists state array {printable(key)} twice")
            seen.add(key)
        if self.gradient is not None and self.gradient.recorded:
            missing = sorted(self.grad_names() - set(self.gradient.recorded))
            if missing:
                raise InvalidInputError(f"replay's recorded gradient lacks {printable(missing)}")

    def array_keys(self) -> Iterator[str]:
        """Every state array a replay may predict."""
        for group in self.groups:
            for by_role in group.params.values():
                yield from by_role.values()

    def grad_names(self) -> set[str]:
        return {name for group in self.groups for name in group.params}

    def targets(self) -> dict[str, ReplayTarget]:
        """Every array key's group, parameter and role."""
        return {
            key: ReplayTarget(group, grad_name, role)
            for group in self.groups
            for grad_name, by_role in group.params.items()
            for role, key in by_role.items()
        }

    def describe(self) -> str:
        """Where its predictions came from, for ``gradpipe log``."""
        if self.gradient is None:
            return "moments' decay (no gradient)"
        return self.gradient.describe()

    def to_dict(self) -> dict[str, Any]:
        return {
            "gradient": None if self.gradient is None else self.gradient.to_dict(),
            "groups": [g.to_dict() for g in self.groups],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ReplayRecord:
        gradient = data.get("gradient")
        return cls(
            None if gradient is None else GradientRef.from_dict(gradient),
            tuple(ReplayGroup.from_dict(g) for g in data["groups"]),
        )
