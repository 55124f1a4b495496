"""The writer's side of optimizer replay: which arrays are predicted, from what, how deep.

:class:`ReplayPlan` maps each array of the state to its parameter and role, checks that
the previous version, the gradient and the new state agree on every parameter (one that
does not is written without replay, and the reason is reported), probes the arithmetic
variant and the learning rate that reproduce the step best, and gives
:func:`~gradpipe.storage.chains.write_version` each array's chunk predictor. The writer
predicts with the very function the reader replays with
(:func:`~gradpipe.storage.replays.predict_chunk`), from private copies of the values it
writes, so what it predicts is what a reader will (docs/design/016).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np

from gradpipe.core.display import printable
from gradpipe.core.dtypes import dtype_name
from gradpipe.core.replay import (
    KINDS,
    OptimizerStep,
    Variant,
    decay_factors,
    roles,
    scalars_to_json,
    work_dtype,
)
from gradpipe.core.replay_options import DEFAULT_REPLAY_INTERVAL
from gradpipe.core.replay_record import GradientRef, ReplayGroup, ReplayRecord
from gradpipe.core.tensor_manifest import TensorManifest
from gradpipe.errors import InvalidInputError
from gradpipe.snapshots.gradient import GivenGradient
from gradpipe.storage.chains import Predictor
from gradpipe.storage.replays import predict_chunk, predict_decay
from gradpipe.storage.versioner import Prediction

__all__ = [
    "DEFAULT_REPLAY_INTERVAL",
    "MAX_REPLAY_INTERVAL",
    "OptimizerGroup",
    "ReplayPlan",
    "parse_optimizer",
    "parse_replay_interval",
    "torch_groups",
    "torch_step",
]


#: Elements of each sampled parameter the probe predicts (the variant and lr chosen by it).
_PROBE_ELEMENTS: Final = 1 << 16
_PROBE_PARAMS: Final = 3
_STATE_DTYPES: Final = frozenset({"float16", "bfloat16", "float32", "float64"})


#: The deepest chain of replays a read may make, plus one: each level is a step of the
#: read's graph and of its building (a deeper chain would also restore slower than it saves).
MAX_REPLAY_INTERVAL: Final = 64


def parse_replay_interval(value: object) -> int:
    """A replay interval (1 to :data:`MAX_REPLAY_INTERVAL`; 1 writes no replay)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or not 1 <= value <= MAX_REPLAY_INTERVAL
    ):
        raise InvalidInputError(
            f"replay interval must be an integer in [1, {MAX_REPLAY_INTERVAL}], not "
            f"{printable(value)}"
        )
    return value


@dataclass(frozen=True)
class OptimizerGroup:
    """Parameters stepped with one optimizer step: the step, and each one's arrays by role."""

    step: OptimizerStep
    params: Mapping[str, Mapping[str, str]]  # gradient name -> {role: array key}


def parse_optimizer(optimizer: Any, state: Mapping[Any, Any]) -> list[OptimizerGroup]:
    """What ``optimizer=`` names: a kind (for a torch-shaped state) or groups.

    A kind (``"adam"``, ``"adamw"``, ``"sgd"``) reads a state shaped as
    ``{"model": model.state_dict(), "optimizer": optimizer.state_dict()}`` (as numpy):
    the hyperparameters come from ``param_groups``, and parameter *i* of the optimizer is
    the *i*-th model entry of its shape and dtype (buffers are skipped by that rule). Groups
    are a sequence of ``{"step": OptimizerStep or its fields, "params": {gradient name:
    {role: array key}}}``. A wrong match costs compression, never exactness.
    """
    if isinstance(optimizer, str):
        return groups_from_torch_state(state, optimizer)
    if not isinstance(optimizer, Sequence):
        raise InvalidInputError(
            f"optimizer= takes a kind ({', '.join(KINDS)}) or a list of groups, not "
            f"{printable(type(optimizer).__name__)}"
        )
    out = []
    for group in optimizer:
        if isinstance(group, OptimizerGroup):
            out.append(group)
            continue
        step = group["step"]
        step = step if isinstance(step, OptimizerStep) else OptimizerStep.from_dict(step)
        params = {
            str(g): {str(r): str(k) for r, k in p.items()} for g, p in group["params"].items()
        }
        out.append(OptimizerGroup(step, params))
    return out


def groups_from_torch_state(state: Mapping[Any, Any], kind: str) -> list[OptimizerGroup]:
    """:func:`parse_optimizer` of a kind: the groups of a torch-shaped state."""
    model, optimizer = state.get("model"), state.get("optimizer")
    if not isinstance(model, Mapping) or not isinstance(optimizer, Mapping):
        raise InvalidInputError(
            f"optimizer={kind!r} reads a state shaped as {{'model': model.state_dict(), "
            "'optimizer': optimizer.state_dict()}; this one has no such entries. Pass the "
            "groups instead (see gp.snapshot)"
        )
    per_param = optimizer.get("state", {})
    names = [n for n, v in model.items() if isinstance(v, np.ndarray)]
    cursor = 0
    groups = []
    for group in optimizer.get("param_groups", ()):
        params: dict[str, dict[str, str]] = {}
        steps: dict[int, dict[str, dict[str, str]]] = {}
        stateless = kind == "sgd" and not group.get("momentum")  # plain SGD keeps no state
        for index in group.get("params", ()):
            entry = per_param.get(index)
            if not isinstance(entry, Mapping):
                if not stateless:
                    continue  # no state yet (a parameter that never had a gradient)
                entry = {}
            elif "step" not in entry and kind != "sgd":
                continue
            sample = next(
                (v for k, v in entry.items() if k != "step" and isinstance(v, np.ndarray)), None
            )
            while cursor < len(names) and not _same_kind(model[names[cursor]], sample):
                cursor += 1
            if cursor == len(names):
                break
            name = names[cursor]
            cursor += 1
            arrays = {"param": f"model.{name}"}
            arrays.update(
                {
                    role: f"optimizer.state.{index}.{role}"
                    for role, value in entry.items()
                    if role != "step" and value is not None
                }
            )
            count = int(np.asarray(entry.get("step", 1)).item())  # SGD keeps no count
            params = steps.setdefault(count, {})
            params[name] = arrays
        groups += torch_groups(kind, group, steps)
    return groups


def torch_groups(
    kind: str, group: Mapping[str, Any], by_count: Mapping[int, Mapping[str, Mapping[str, str]]]
) -> list[OptimizerGroup]:
    """The replay groups of one torch parameter group: one per step count (torch creates
    state lazily, so counts can differ), each parameter with every role its step needs."""
    out = []
    for count, params in by_count.items():
        step = torch_step(kind, group, count)
        wanted = set(roles(step))
        kept = {n: a for n, a in params.items() if set(a) == wanted}
        if kept:
            out.append(OptimizerGroup(step, kept))
    return out


def _same_kind(a: Any, b: Any) -> bool:
    """Whether model entry ``a`` may be the parameter whose state holds ``b`` (None: any
    floating-point array, for a parameter without state)."""
    if b is None:
        return isinstance(a, np.ndarray) and dtype_name(a.dtype) in _STATE_DTYPES
    return (
        isinstance(a, np.ndarray)
        and isinstance(b, np.ndarray)
        and a.shape == b.shape
        and a.dtype == b.dtype
    )


def torch_step(kind: str, group: Mapping[str, Any], count: int) -> OptimizerStep:
    """The step of a torch parameter group (its hyperparameters) at step ``count``."""
    fields: dict[str, Any] = {"kind": kind, "lr": float(group["lr"]), "step": max(count, 1)}
    if kind == "sgd":
        for name in ("momentum", "dampening", "nesterov", "maximize", "weight_decay"):
            if name in group:
                fields[name] = group[name]
    else:
        betas = group.get("betas", (0.9, 0.999))
        fields.update(beta1=float(betas[0]), beta2=float(betas[1]))
        for name in ("eps", "weight_decay", "amsgrad", "maximize"):
            if name in group:
                fields[name] = group[name]
    return OptimizerStep(**fields)


@dataclass
class ReplayPlan:
    """What one snapshot write predicts: per array, its group, parameter and role.

    ``values`` are the private copies the version is written from (every role of every
    replayed parameter), ``previous`` the previous version's (from the process cache or
    read back), ``head`` the previous version's tensor manifests (their replay depths),
    ``skipped`` the parameters written without replay and why. Without a gradient
    (``gradient`` None) only the moments are predicted, from their decay
    (:func:`~gradpipe.core.replay.decay_factors`).
    """

    groups: list[OptimizerGroup]
    values: dict[str, np.ndarray]
    previous: Mapping[str, np.ndarray]
    head: Mapping[str, TensorManifest]
    gradient: Mapping[str, Callable[[], np.ndarray]] | None
    interval: int
    skipped: dict[str, str] = field(default_factory=dict)
    #: The replays a read of this version's replayed chunks makes: one more than the
    #: previous version's deepest, for every chunk alike; 0 at the interval (none replayed).
    depth: int = 0
    _grads: dict[str, np.ndarray] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        groups: list[OptimizerGroup],
        arrays: Mapping[str, np.ndarray],
        head: Mapping[str, TensorManifest],
        *,
        previous: Callable[[list[str]], Mapping[str, np.ndarray]],
        gradient: GivenGradient | None,
        interval: int,
        head_depth: int,
    ) -> ReplayPlan:
        """Check every parameter; copy the arrays of those kept; find their previous values.

        ``previous`` reads the previous version's values of the given array keys;
        ``head_depth`` is the previous version's replay depth.
        """
        skipped: dict[str, str] = {}
        kept_groups = []
        taken: set[str] = set()  # an array is one parameter's role, once
        for group in groups:
            params = {}
            for name, by_role in group.params.items():
                reason = _refusal(by_role, arrays, head)
                if not reason and gradient is not None:
                    reason = _gradient_refusal(name, arrays[by_role["param"]], gradient.shapes)
                if not reason and gradient is None and not _decaying(group.step):
                    reason = "without its gradient, nothing of it is predictable"
                shared = sorted(set(by_role.values()) & taken)
                if not reason and (shared or len(set(by_role.values())) < len(by_role)):
                    reason = f"its arrays {printable(shared or sorted(by_role.values()))} are "
                    reason += "another parameter's or another role's too"
                if reason:
                    skipped[name] = reason
                else:
                    params[name] = by_role
                    taken |= set(by_role.values())
            if params:
                kept_groups.append(OptimizerGroup(group.step, params))
        keys = [
            key
            for g in kept_groups
            for by_role in g.params.values()
            for role, key in by_role.items()
            if gradient is not None or role in _decaying(g.step)
        ]
        values = {k: np.array(arrays[k], copy=True, order="C") for k in keys}
        before = previous(keys) if keys else {}
        given = None if gradient is None else gradient.arrays
        depth = 1 + head_depth
        plan = cls(kept_groups, values, before, dict(head), given, interval, skipped)
        plan.depth = depth if depth < interval else 0
        return plan

    @property
    def keys(self) -> set[str]:
        """Every array the plan predicts."""
        return set(self.values)

    def grad_array(self, name: str) -> np.ndarray:
        """Parameter ``name``'s gradient as given (for a recorded gradient: to write it)."""
        assert self.gradient is not None
        return np.asarray(self.gradient[name]())

    def grad(self, name: str) -> np.ndarray:
        """Parameter ``name``'s gradient, flat (read once, on first use)."""
        found = self._grads.get(name)
        if found is None:
            assert self.gradient is not None
            found = np.ascontiguousarray(self.gradient[name]()).reshape(-1)
            self._grads[name] = found
        return found

    def probe(self, variant_hint: str | None, lr_hints: Mapping[str, float]) -> None:
        """Choose the variant (and each group's lr among the hints) by exact matches on a sample.

        ``lr_hints`` are, by parameter name, other learning rates its step may have applied
        (the one the previous save was given: a state taken after the scheduler's step holds
        the next one). Ties keep the given lr and ``variant_hint``. Without a gradient
        there is no step to replay: nothing to choose.
        """
        if self.gradient is None:
            return
        params = [(g, name) for g, group in enumerate(self.groups) for name in group.params]
        params.sort(key=lambda p: -self.values[self.groups[p[0]].params[p[1]]["param"]].size)
        sample = params[:_PROBE_PARAMS]
        if not sample:
            return
        variants: list[Variant] = ["plain", "fma"]
        if variant_hint in variants:
            variants.remove(variant_hint)
            variants.insert(0, variant_hint)
        best: list[OptimizerStep] = []
        best_score = -1
        for variant in variants:
            for use_hint in (False, True) if lr_hints else (False,):
                steps = [
                    _with(group.step, variant, _hint(group, lr_hints) if use_hint else None)
                    for group in self.groups
                ]
                score = sum(
                    self._exact(_Param(steps[g], self.groups[g].params[n], n)) for g, n in sample
                )
                if score > best_score:
                    best, best_score = steps, score
        self.groups = [
            OptimizerGroup(step, group.params)
            for step, group in zip(best, self.groups, strict=True)
        ]

    def _exact(self, param: _Param) -> int:
        """How many elements of a sample of the parameter's arrays its step predicts exactly."""
        n = min(self.values[param.arrays["param"]].size, _PROBE_ELEMENTS)
        count = 0
        for role in roles(param.step):
            predicted = self.predict(param, role, 0, n)
            actual = self.values[param.arrays[role]].reshape(-1)[:n]
            count += int(np.count_nonzero(_bits(predicted) == _bits(actual)))
        return count

    def predict(self, param: _Param, role: str, start: int, stop: int) -> np.ndarray:
        """Elements ``start:stop`` of ``role`` of ``param`` predicted as a reader will."""
        arrays = param.arrays
        dtype = self.values[arrays["param"]].dtype
        needed = roles(param.step)
        moments = [r for r in needed if r != "param"] if role == "param" else []
        return predict_chunk(
            param.step,
            _scalars(param.step, dtype),
            role,
            previous={r: self.previous[arrays[r]].reshape(-1)[start:stop] for r in needed},
            grad=self.grad(param.name)[start:stop],
            known={r: self.values[arrays[r]].reshape(-1)[start:stop] for r in moments},
            dtype=dtype,
        )

    def predictors(self) -> dict[str, Predictor]:
        """Each predicted array's chunk predictor, for ``write_version(predict=)``; none when
        this version reaches the interval (it is then self-contained, whole)."""
        out: dict[str, Predictor] = {}
        if self.depth == 0:
            return out
        for group in self.groups:
            for name, by_role in group.params.items():
                if self.gradient is None:  # each moment from its own previous values
                    for role in _decaying(group.step):
                        out[by_role[role]] = self._decay_predictor(group.step, role, by_role)
                    continue
                param = _Param(group.step, by_role, name)
                for role, key in by_role.items():
                    out[key] = self._predictor(param, role)
        return out

    def _decay_predictor(
        self, step: OptimizerStep, role: str, by_role: Mapping[str, str]
    ) -> Predictor:
        key = by_role[role]
        dtype = self.values[key].dtype
        factor = scalars_to_json(decay_factors(step, dtype))[role]

        def predict(i: int, start: int, stop: int) -> Prediction | None:
            before = self.previous[key].reshape(-1)[start:stop]
            return Prediction(predict_decay(before, factor, dtype, stop - start), "decay")

        return predict

    def _predictor(self, param: _Param, role: str) -> Predictor:
        def predict(i: int, start: int, stop: int) -> Prediction | None:
            return Prediction(self.predict(param, role, start, stop))

        return predict

    def record(self, gradient: GradientRef | None) -> ReplayRecord:
        """The manifest's record of the plan (the steps as probed, their scalars; without a
        gradient, the moments' decay factors)."""
        groups = []
        for group in self.groups:
            dtypes = {
                np.dtype(self.values[k].dtype) for r in group.params.values() for k in r.values()
                if k in self.values
            }  # fmt: skip
            scalars = {
                dtype_name(work_dtype(d)): scalars_to_json(group.step.scalars(d)) for d in dtypes
            }
            decays = {}
            if gradient is None:
                decays = {
                    dtype_name(work_dtype(d)): scalars_to_json(decay_factors(group.step, d))
                    for d in dtypes
                }
            groups.append(ReplayGroup(group.step, scalars, group.params, decays))
        return ReplayRecord(gradient, tuple(groups))


@dataclass(frozen=True)
class _Param:
    """One replayed parameter: its step, its arrays by role, its gradient's name."""

    step: OptimizerStep
    arrays: Mapping[str, str]
    name: str


def _hint(group: OptimizerGroup, hints: Mapping[str, float]) -> float | None:
    """The learning rate the previous save gave one of the group's parameters, if any."""
    return next((hints[name] for name in group.params if name in hints), None)


def _decaying(step: OptimizerStep) -> tuple[str, ...]:
    """The roles a version without a gradient predicts from their decay."""
    return tuple(decay_factors(step, np.dtype(np.float32)))


def _with(step: OptimizerStep, variant: Variant, lr: float | None) -> OptimizerStep:
    if lr is None:
        return dataclasses.replace(step, variant=variant)
    return dataclasses.replace(step, variant=variant, lr=lr)


def _scalars(step: OptimizerStep, dtype: np.dtype) -> dict[str, str]:
    return scalars_to_json(step.scalars(dtype))


def _bits(values: np.ndarray) -> np.ndarray:
    return values.reshape(-1).view(f"u{values.dtype.itemsize}")


def _refusal(
    by_role: Mapping[str, str],
    arrays: Mapping[str, np.ndarray],
    head: Mapping[str, TensorManifest],
) -> str:
    """Why a parameter's arrays cannot be replayed ("" when they can)."""
    for role, key in by_role.items():
        if key not in arrays:
            return f"the state has no array {key} ({role})"
        if key not in head:
            return f"the previous version has no array {key} ({role})"
    param = arrays[by_role["param"]]
    kind = dtype_name(param.dtype)
    if kind not in _STATE_DTYPES:
        return f"its dtype {kind} is not replayed"
    grid = head[by_role["param"]]
    for role, key in by_role.items():
        new, old = arrays[key], head[key]
        if new.shape != param.shape or new.dtype != param.dtype:
            return f"{role} is {dtype_name(new.dtype)}{list(new.shape)}, not the parameter's"
        if (old.dtype, old.shape, old.chunk_shape) != (kind, param.shape, grid.chunk_shape):
            return f"{role} was stored as another dtype, shape or chunk grid before"
    return ""


def _gradient_refusal(
    name: str, param: np.ndarray, shapes: Mapping[str, tuple[str, tuple[int, ...]]]
) -> str:
    """Why parameter ``name``'s gradient cannot be replayed ("" when it can)."""
    if name not in shapes:
        return "the gradient has no tensor of its name"
    grad_dtype, grad_shape = shapes[name]
    if tuple(grad_shape) != param.shape:
        return f"its gradient's shape {list(grad_shape)} is not the parameter's {list(param.shape)}"
    if grad_dtype not in _STATE_DTYPES:
        return f"its gradient's dtype {grad_dtype} is not a float"
    return ""
