"""Optimizer replay: the next training state predicted from the previous one and a gradient.

A snapshot taken after an optimizer step is, but for rounding, a function of the snapshot
before it, the gradient the step applied and the optimizer's hyperparameters at that step.
:func:`replay` computes that function the way ``torch.optim`` does, element by element, so a
snapshot can be stored as the (mostly zero) difference between its bits and the prediction
(issue 21; ``docs/design/016-optimizer-replay.md``).

The arithmetic rule, which makes a prediction the same bits on every platform:

- every element-wise operation of torch's update is one numpy ufunc on arrays of the
  computation dtype (float32 for float32, bfloat16 and float16 state, float64 for float64),
  in torch's order: IEEE-754 add, multiply, divide and square root are correctly rounded
  wherever numpy runs, and numpy never fuses two of them;
- the scalars (``1 - beta1``, ``lr / (1 - beta1**step)``, ...) are computed in Python floats
  as torch computes them, then rounded once to the computation dtype. They are recorded with
  the step (:meth:`OptimizerStep.scalars`), so a reader never recomputes ``beta**step`` with
  its own ``libm``;
- the ``fma`` variant computes each multiply-add that a fused kernel would fuse
  (``lerp``, ``add(alpha=)``, ``addcmul``) as one float64 expression rounded once to the
  computation dtype: exact but for rare double roundings, and the same bits everywhere
  (float64 state, which has no wider type on every platform, computes as ``plain``);
- reduced-precision state (bfloat16, float16) is rounded to its dtype after each operation,
  as each torch kernel rounds its output;
- NaN and infinity propagate as IEEE says, with numpy's floating-point errors ignored (the
  result does not depend on ``np.seterr``).

The prediction need not match torch: the stored residual makes every version bit-exact.
How often it matches is measured in ``benchmarks/bench_replay.py``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Final, Literal

import numpy as np

from gradpipe.core.display import printable
from gradpipe.core.dtypes import dtype_name
from gradpipe.core.replay_options import REPLAY_KINDS
from gradpipe.errors import GradpipeError, InvalidInputError

__all__ = [
    "KINDS",
    "VARIANTS",
    "OptimizerStep",
    "decay",
    "decay_factors",
    "replay",
    "roles",
    "scalars_from_json",
    "scalars_to_json",
    "work_dtype",
]

#: The scalars of each kind's update (:meth:`OptimizerStep.scalars`).
_SCALAR_NAMES: Final = {
    "sgd": frozenset({"lr", "weight_decay", "minus_lr", "momentum", "one_minus_dampening"}),
    "adam": frozenset(
        {
            "lr",
            "weight_decay",
            "one_minus_beta1",
            "beta2",
            "one_minus_beta2",
            "correction2_sqrt",
            "eps",
            "minus_step_size",
            "decay",
        }
    ),
}

#: The state dtypes a replay computes on.
_STATE_DTYPES: Final = ("float16", "bfloat16", "float32", "float64")

Kind = Literal["adam", "adamw", "sgd"]

#: The hyperparameters' ranges, as torch's optimizers check them: ``[low, high)``.
_RANGES: Final = {
    "lr": (0.0, math.inf),
    "beta1": (0.0, 1.0),
    "beta2": (0.0, 1.0),
    "eps": (0.0, math.inf),
    "weight_decay": (0.0, math.inf),
    "momentum": (0.0, math.inf),
    "dampening": (0.0, math.inf),
}
Variant = Literal["plain", "fma"]
#: The optimizers replayed: ``torch.optim.Adam``, ``AdamW`` and ``SGD`` (momentum, nesterov).
KINDS: Final = REPLAY_KINDS
#: ``plain``: every operation rounded on its own (torch's CPU kernels without AVX2, numpy);
#: ``fma``: multiply-adds rounded once (vectorised and fused kernels; float64 state: as plain).
VARIANTS: Final = ("plain", "fma")


@dataclass(frozen=True)
class OptimizerStep:
    """One optimizer step as a replay needs it: the kind and its hyperparameters at that step.

    ``step`` is the optimizer's step count after the step (torch's ``state["step"]``), ``lr``
    the learning rate after the scheduler. Fields of other kinds are left at their defaults.
    """

    kind: Kind
    lr: float
    step: int = 1
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    amsgrad: bool = False
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    maximize: bool = False
    variant: Variant = "plain"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidInputError(
                f"optimizer {printable(self.kind)} is not replayed; one of {', '.join(KINDS)}"
            )
        if self.variant not in VARIANTS:
            raise InvalidInputError(
                f"replay variant {printable(self.variant)} is not one of plain, fma"
            )
        for name, (low, high) in _RANGES.items():
            value = getattr(self, name)
            if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Real):
                raise InvalidInputError(
                    f"optimizer step: {name} {printable(value)} is not a number"
                )
            number = float(value)  # a numpy scalar from torch's state is welcome
            if not (
                math.isfinite(number) and low <= number and (number < high or high == math.inf)
            ):
                span = f">= {low}" if high == math.inf else f"in [{low}, {high})"
                raise InvalidInputError(
                    f"optimizer step: {name} {printable(value)} must be a finite number {span}"
                )
            object.__setattr__(self, name, number)
        if isinstance(self.step, bool | np.bool_) or not isinstance(self.step, numbers.Integral):
            raise InvalidInputError(
                f"optimizer step: step {printable(self.step)} is not an integer"
            )
        if int(self.step) < 1:
            raise InvalidInputError(f"optimizer step: step {self.step} must be >= 1")
        object.__setattr__(self, "step", int(self.step))
        for name in ("amsgrad", "nesterov", "maximize"):
            if not isinstance(getattr(self, name), bool | np.bool_):
                raise InvalidInputError(f"optimizer step: {name} must be true or false")
            object.__setattr__(self, name, bool(getattr(self, name)))
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise InvalidInputError(
                "nesterov needs a momentum > 0 and no dampening (as torch's SGD)"
            )

    def scalars(self, dtype: np.dtype) -> dict[str, np.generic]:
        """The scalars the update multiplies and adds, computed as torch computes them (in
        Python floats), each rounded once to the computation dtype of ``dtype``.

        For bfloat16 and float16 state, torch rounds the scalar of ``add(alpha=)`` and of
        ``add(scalar)`` to the state's dtype first: :class:`_Ops` does that where it adds.
        """
        work = work_dtype(dtype)
        out: dict[str, float] = {"lr": self.lr, "weight_decay": self.weight_decay}
        if self.kind == "sgd":
            out.update(
                minus_lr=-self.lr,
                momentum=self.momentum,
                one_minus_dampening=1 - self.dampening,
            )
        else:
            correction1 = 1 - self.beta1**self.step
            correction2 = 1 - self.beta2**self.step
            out.update(
                one_minus_beta1=1 - self.beta1,
                beta2=self.beta2,
                one_minus_beta2=1 - self.beta2,
                correction2_sqrt=correction2**0.5,
                eps=self.eps,
                minus_step_size=-(self.lr / correction1),
                decay=1 - self.lr * self.weight_decay,
            )
        return {name: work.type(value) for name, value in out.items()}

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (for a snapshot version's manifest)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> OptimizerStep:
        """The inverse of :meth:`to_dict`."""
        try:
            return cls(**dict(data))
        except TypeError as exc:
            raise InvalidInputError(f"bad optimizer step {printable(dict(data))}: {exc}") from None


def roles(step: OptimizerStep) -> tuple[str, ...]:
    """The arrays of one parameter's state that a step of this kind updates, in order."""
    if step.kind == "sgd":
        return ("param", "momentum_buffer") if step.momentum != 0 else ("param",)
    extra = ("max_exp_avg_sq",) if step.amsgrad else ()
    return ("param", "exp_avg", "exp_avg_sq", *extra)


def decay_factors(step: OptimizerStep, dtype: np.dtype) -> dict[str, np.generic]:
    """Each moment's decay per step, rounded to the computation dtype: what a moment becomes
    with no gradient (``exp_avg`` times ``beta1``, ``exp_avg_sq`` times ``beta2``, SGD's
    ``momentum_buffer`` times ``momentum``), the prediction of a snapshot kept without its
    gradient (design note 016)."""
    work = work_dtype(dtype)
    if step.kind == "sgd":
        return {"momentum_buffer": work.type(step.momentum)} if step.momentum != 0 else {}
    return {"exp_avg": work.type(step.beta1), "exp_avg_sq": work.type(step.beta2)}


def decay(previous: np.ndarray, factor: np.generic) -> np.ndarray:
    """``previous`` times ``factor`` (a :func:`decay_factors` value): one multiply in the
    computation dtype, rounded to ``previous``'s dtype, NaN canonical (the arithmetic rule)."""
    values = np.asarray(previous)
    _check_subnormals()
    ops = _Ops(values.dtype, "plain")
    with np.errstate(all="ignore"):
        return ops.store({"x": ops.round(ops.load(values) * factor)})["x"]


def replay(
    step: OptimizerStep,
    previous: Mapping[str, np.ndarray],
    grad: np.ndarray,
    *,
    known: Mapping[str, np.ndarray] | None = None,
    scalars: Mapping[str, np.generic] | None = None,
    only: Collection[str] | None = None,
) -> dict[str, np.ndarray]:
    """The state after ``step`` predicted from the state before it and the gradient applied.

    ``previous`` maps each of :func:`roles` to its values before the step (same shape and
    dtype as ``previous["param"]``; SGD's ``momentum_buffer`` may be missing at its first step,
    as torch's is); ``grad`` has the parameter's shape. Returns every role's predicted values,
    of the parameter's dtype. Pure: the inputs are not changed.

    ``known`` holds roles of the state after the step that are known exactly already (a
    reader decodes the moments before the parameters): the update goes on from them rather
    than from their predictions, as torch's did, so one mispredicted moment does not spoil the
    parameter's prediction too. Roles are computed in the order moments, then parameters.

    ``scalars`` are the step's scalars as a writer recorded them (:meth:`OptimizerStep.scalars`,
    stored with :func:`scalars_to_json`): a reader passes them so that it never computes
    ``beta**step`` with its own ``pow``. ``only`` names the roles wanted (the moments alone
    skip the parameters' square roots and divisions).
    """
    needed = roles(step)
    wanted = set(needed if only is None else only)
    if not wanted or not wanted <= set(needed):
        raise InvalidInputError(
            f"replay: only {printable(sorted(wanted))} is not among {', '.join(needed)}"
        )
    missing = [r for r in needed if r not in previous and r != "momentum_buffer"]
    if missing:
        raise InvalidInputError(
            f"replay of {step.kind}: the state before lacks {', '.join(missing)}"
        )
    param = np.asarray(previous["param"])
    dtype = param.dtype
    if dtype_name(dtype) not in _STATE_DTYPES:
        raise InvalidInputError(
            f"replay computes on {', '.join(_STATE_DTYPES)} state, not {dtype_name(dtype)}"
        )
    if np.shape(grad) != param.shape:
        raise InvalidInputError(
            f"replay: the gradient's shape {list(np.shape(grad))} is not the parameter's "
            f"{list(param.shape)}"
        )
    unknown = sorted(set(known or {}) - set(needed) | ({"param"} & set(known or {})))
    if unknown:
        raise InvalidInputError(
            f"replay: known holds {', '.join(unknown)}, not a moment of {step.kind}"
        )
    for where, arrays in (("before", previous), ("known", known or {})):
        for role, values in arrays.items():
            if role in needed and (
                np.shape(values) != param.shape or np.asarray(values).dtype != dtype
            ):
                shown = f"{dtype_name(np.asarray(values).dtype)}{list(np.shape(values))}"
                raise InvalidInputError(
                    f"replay: {role} ({where}) is {shown}, not the parameter's "
                    f"{dtype_name(dtype)}{list(param.shape)}"
                )
    _check_subnormals()
    ops = _Ops(dtype, step.variant)
    with np.errstate(all="ignore"):
        g = ops.load(grad)
        if step.maximize:
            g = -g
        c = step.scalars(dtype) if scalars is None else _given_scalars(step, dtype, scalars)
        ops.known = {role: ops.load(values) for role, values in (known or {}).items()}
        ops.param_wanted = "param" in wanted
        ops.wanted = wanted
        update = _sgd if step.kind == "sgd" else _adam
        out = update(ops, step, c, ops.load(param), g, previous=previous)
        return ops.store({role: out[role] for role in needed if role in wanted})


def _given_scalars(
    step: OptimizerStep, dtype: np.dtype, scalars: Mapping[str, np.generic]
) -> dict[str, np.generic]:
    """Recorded scalars, checked: the names and the computation dtype this step uses (without
    computing them: that is what recording them avoids)."""
    expected = _SCALAR_NAMES["sgd" if step.kind == "sgd" else "adam"]
    work = work_dtype(dtype)
    if set(scalars) != set(expected):
        raise InvalidInputError(
            f"replay: the recorded scalars are {printable(sorted(scalars))}, not "
            f"{printable(sorted(expected))}"
        )
    out = {}
    for name, value in scalars.items():
        if np.asarray(value).dtype != work:
            raise InvalidInputError(f"replay: scalar {name} is not {dtype_name(work)}")
        out[name] = work.type(value)
    return out


def scalars_to_json(scalars: Mapping[str, np.generic]) -> dict[str, str]:
    """Scalars as their bit patterns in hex (``"0x3f800000"``): exact, whatever the reader."""
    return {
        name: f"0x{int(np.asarray(value).view(_UINT[np.asarray(value).itemsize])):x}"
        for name, value in scalars.items()
    }


def scalars_from_json(data: Mapping[str, str], dtype: np.dtype) -> dict[str, np.generic]:
    """The inverse of :func:`scalars_to_json`, for state of ``dtype``."""
    work = work_dtype(dtype)
    out: dict[str, np.generic] = {}
    for name, text in data.items():
        try:
            bits = int(str(text), 16)
            word = np.array([bits], dtype=_UINT[work.itemsize])
            out[name] = work.type(word.view(work)[0])
        except (ValueError, OverflowError):
            raise InvalidInputError(
                f"replay: scalar {printable(name)} {printable(text)} is not a "
                f"{dtype_name(work)} bit pattern"
            ) from None
    return out


def _adam(
    ops: _Ops,
    step: OptimizerStep,
    c: Mapping[str, np.generic],
    p: np.ndarray,
    g: np.ndarray,
    *,
    previous: Mapping[str, np.ndarray],
) -> dict[str, np.ndarray]:
    if step.weight_decay != 0:
        if step.kind == "adamw":
            if ops.param_wanted:  # (the moments do not depend on it)
                p = ops.round(p * c["decay"])  # param.mul_(1 - lr * weight_decay)
        else:
            g = ops.add_scaled(g, p, c["weight_decay"])  # grad.add(param, alpha=wd)
    # A moment known exactly (a reader decoded it first) or not needed is not computed.
    m = ops.known.get("exp_avg")
    if m is None and (ops.param_wanted or "exp_avg" in ops.wanted):
        m = ops.lerp(ops.load(previous["exp_avg"]), g, c["one_minus_beta1"])  # exp_avg.lerp_
    v = ops.known.get("exp_avg_sq")
    if v is None and (ops.param_wanted or step.amsgrad or "exp_avg_sq" in ops.wanted):
        v = ops.round(ops.load(previous["exp_avg_sq"]) * c["beta2"])  # exp_avg_sq.mul_(beta2)
        v = ops.addcmul(v, g, g, c["one_minus_beta2"])  # .addcmul_(grad, grad, value=1 - b2)
    out = {r: x for r, x in (("exp_avg", m), ("exp_avg_sq", v)) if x is not None}
    if step.amsgrad:
        assert v is not None
        known_max = ops.known.get("max_exp_avg_sq")
        v = np.maximum(ops.load(previous["max_exp_avg_sq"]), v) if known_max is None else known_max
        out["max_exp_avg_sq"] = v
    if not ops.param_wanted:  # the moments alone: no square roots
        return out
    assert m is not None
    assert v is not None
    denom = ops.round(ops.round(np.sqrt(v)) / c["correction2_sqrt"])  # sqrt() / sqrt(bc2)
    denom = ops.add_scalar(denom, c["eps"])  # .add_(eps)
    # param.addcdiv_(exp_avg, denom, value=-step_size): self + value * t1 / t2, one kernel
    out["param"] = ops.round(p + c["minus_step_size"] * m / denom)
    return out


def _sgd(
    ops: _Ops,
    step: OptimizerStep,
    c: Mapping[str, np.generic],
    p: np.ndarray,
    g: np.ndarray,
    *,
    previous: Mapping[str, np.ndarray],
) -> dict[str, np.ndarray]:
    if step.weight_decay != 0:
        g = ops.add_scaled(g, p, c["weight_decay"])  # grad.add(param, alpha=wd)
    out: dict[str, np.ndarray] = {}
    if step.momentum != 0:
        before = previous.get("momentum_buffer")
        if before is None:  # the first step: buf = grad.clone()
            buf = g
        else:  # buf.mul_(momentum).add_(grad, alpha=1 - dampening)
            buf = ops.round(ops.load(before) * c["momentum"])
            buf = ops.add_scaled(buf, g, c["one_minus_dampening"])
        out["momentum_buffer"] = buf = ops.known.get("momentum_buffer", buf)
        if not ops.param_wanted:
            return out
        g = ops.add_scaled(g, buf, c["momentum"]) if step.nesterov else buf
    out["param"] = ops.add_scaled(p, g, c["minus_lr"])  # param.add_(grad, alpha=-lr)
    return out


def work_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype torch computes a kernel in for state of ``dtype`` (its "opmath" type)."""
    return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)


#: The canonical quiet NaN of each state dtype (sign clear, top fraction bit set).
_CANONICAL_NAN: Final = {
    "float16": 0x7E00,
    "bfloat16": 0x7FC0,
    "float32": 0x7FC00000,
    "float64": 0x7FF8000000000000,
}
_UINT: Final[dict[int, np.dtype]] = {
    2: np.dtype(np.uint16),
    4: np.dtype(np.uint32),
    8: np.dtype(np.uint64),
}


def _check_subnormals() -> None:
    """Refuse to predict in a process that flushes subnormals to zero (FTZ/DAZ: set by a
    library built with -ffast-math, or ``torch.set_flush_denormal(True)``): its bits would
    not be another platform's."""
    tiny = np.array([1e-39], dtype=np.float32)
    if (tiny * np.float32(1.0))[0] == 0:
        raise GradpipeError(
            "this process flushes subnormal floats to zero (a library built with -ffast-math, "
            "or torch.set_flush_denormal(True)): optimizer replay would not give the bits "
            "another process gives; turn it off (torch.set_flush_denormal(False))"
        )


class _Ops:
    """The element-wise operations of an update, rounded as the variant and the dtype say."""

    def __init__(self, dtype: np.dtype, variant: str) -> None:
        self.dtype = dtype
        self.work = work_dtype(dtype)
        # float64 state has no wider type to fuse in everywhere (long double is double on some
        # platforms): its fma variant computes as the plain one.
        self.fused = variant == "fma" and self.work == np.float32
        self.narrow = dtype != self.work  # bfloat16, float16: round after each kernel
        self.known: dict[str, np.ndarray] = {}  # roles of the new state known exactly
        self.param_wanted = True
        self.wanted: set[str] = set()  # the roles asked for (others are computed only if needed)

    def load(self, values: np.ndarray) -> np.ndarray:
        return np.asarray(values).astype(self.work, copy=False)  # never written in place

    def round(self, values: np.ndarray) -> np.ndarray:
        """A kernel's output: rounded to the state's dtype, computed on in the work dtype."""
        values = np.asarray(values, dtype=self.work)
        return values.astype(self.dtype).astype(self.work) if self.narrow else values

    def store(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The predictions in the state's dtype, every NaN the one canonical quiet NaN: IEEE
        leaves the sign and payload of a NaN made by an invalid operation to the platform."""
        out = {}
        for role, values in arrays.items():
            nan = np.isnan(values)  # in the work dtype: casting keeps NaN and makes none
            result = np.asarray(values).astype(self.dtype)
            if nan.any():
                bits = _CANONICAL_NAN[dtype_name(self.dtype)]
                result.view(_UINT[self.dtype.itemsize])[nan] = bits
            out[role] = result
        return out

    def _fma(self, a: Any, b: Any, c: Any) -> np.ndarray:
        """``a * b + c`` rounded once: the product is exact in float64 (float32 operands)."""
        if np.ndim(a) == 0:  # the array first: one float64 copy of it, then in place
            a, b = b, a
        exact = np.asarray(a).astype(np.float64)
        exact *= b if np.ndim(b) else np.float64(b)  # exact: float32 operands
        exact += c if np.ndim(c) else np.float64(c)  # rounded once, in float64
        return self.round(exact.astype(self.work))

    def _narrow_scalar(self, value: np.generic) -> np.generic:
        """A scalar as torch's ``add`` takes it: rounded to the state's dtype first."""
        return self.work.type(self.dtype.type(value)) if self.narrow else value

    def add_scalar(self, x: np.ndarray, value: np.generic) -> np.ndarray:
        """``x.add(value)``, one kernel."""
        return self.round(x + self._narrow_scalar(value))

    def add_scaled(self, x: np.ndarray, y: np.ndarray, alpha: np.generic) -> np.ndarray:
        """``x.add(y, alpha=alpha)``."""
        alpha = self._narrow_scalar(alpha)
        if self.fused:
            return self._fma(y, alpha, x)
        return self.round(x + y * alpha)

    def lerp(self, start: np.ndarray, end: np.ndarray, weight: np.generic) -> np.ndarray:
        """``start.lerp(end, weight)``: ``start + w * (end - start)`` for ``|w| < 0.5``, else
        ``end - (end - start) * (1 - w)`` (torch's two forms), in one kernel: one rounding to
        the state's dtype at the end."""
        diff = end - start
        if abs(float(weight)) < 0.5:
            if self.fused:
                return self._fma(weight, diff, start)
            return self.round(start + diff * weight)
        rest = self.work.type(1) - weight
        if self.fused:
            return self._fma(-diff, rest, end)
        return self.round(end - diff * rest)

    def addcmul(self, x: np.ndarray, a: np.ndarray, b: np.ndarray, value: np.generic) -> np.ndarray:
        """``x.addcmul(a, b, value=value)``: ``x + value * a * b``, in one kernel."""
        if self.fused:
            return self._fma(value * a, b, x)
        return self.round(x + value * a * b)
