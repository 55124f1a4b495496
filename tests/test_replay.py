"""Optimizer replay (gradpipe.core.replay): deterministic, pure, and close to torch.optim."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradpipe.core.dtypes import parse_dtype
from gradpipe.core.replay import KINDS, VARIANTS, OptimizerStep, replay, roles
from gradpipe.errors import GradpipeError, InvalidInputError

DTYPES = ["float32", "bfloat16", "float16", "float64"]

_special = st.sampled_from([0.0, -0.0, np.nan, np.inf, -np.inf, 1e-45, 3e38, -1e-30])
_value = st.one_of(st.floats(-10, 10, width=32), _special)


@st.composite
def steps(draw: st.DrawFn) -> OptimizerStep:
    kind = draw(st.sampled_from(KINDS))
    momentum = draw(st.sampled_from([0.0, 0.5, 0.9])) if kind == "sgd" else 0.0
    return OptimizerStep(
        kind,
        lr=draw(st.floats(1e-6, 1.0)),
        step=draw(st.integers(1, 10_000)),
        beta1=draw(st.floats(0.0, 0.999)),
        beta2=draw(st.floats(0.0, 0.9999)),
        eps=draw(st.sampled_from([1e-8, 1e-6, 0.0])),
        weight_decay=draw(st.sampled_from([0.0, 0.01, 0.1])),
        amsgrad=kind != "sgd" and draw(st.booleans()),
        momentum=momentum,
        nesterov=momentum > 0 and draw(st.booleans()),
        maximize=draw(st.booleans()),
        variant=draw(st.sampled_from(VARIANTS)),
    )


@st.composite
def states(draw: st.DrawFn) -> tuple[OptimizerStep, dict[str, np.ndarray], np.ndarray]:
    step = draw(steps())
    dtype = parse_dtype(draw(st.sampled_from(DTYPES)))
    n = draw(st.integers(1, 40))

    def array() -> np.ndarray:
        values = np.array(draw(st.lists(_value, min_size=n, max_size=n)), dtype=np.float64)
        with np.errstate(over="ignore"):  # 3e38 is infinite in float16: that is a case too
            return values.astype(dtype)

    previous = {role: array() for role in roles(step)}
    if step.kind == "sgd" and step.momentum and draw(st.booleans()):
        del previous["momentum_buffer"]  # torch's first step has none
    return step, previous, array()


def _bits(arrays: dict[str, np.ndarray]) -> dict[str, bytes]:
    return {role: a.tobytes() for role, a in arrays.items()}


@settings(max_examples=300, deadline=None)
@given(states())
def test_the_same_bits_whatever_numpys_error_mode(
    case: tuple[OptimizerStep, dict[str, np.ndarray], np.ndarray],
) -> None:
    step, previous, grad = case
    kept = {role: a.copy() for role, a in previous.items()}
    with np.errstate(all="raise"):
        strict = replay(step, previous, grad)
    with np.errstate(all="ignore"):
        lenient = replay(step, previous, grad)
    default = replay(step, previous, grad)
    assert _bits(strict) == _bits(lenient) == _bits(default)
    assert set(strict) == set(roles(step))
    for role, values in strict.items():
        assert values.dtype == previous["param"].dtype, role
        assert values.shape == previous["param"].shape
    assert _bits(previous) == _bits(kept)  # pure: nothing changed in place
    for values in strict.values():  # one NaN whatever the platform made
        nans = np.isnan(values.astype(np.float64))
        assert (
            len(
                {
                    bytes(v)
                    for v in values[nans].reshape(-1).view(np.uint8).reshape(-1, values.itemsize)
                }
            )
            <= 1
        )


def test_zero_gradients_leave_sgd_parameters_and_decay_adam_moments() -> None:
    p = np.linspace(-1, 1, 11, dtype=np.float32)
    zero = np.zeros_like(p)
    out = replay(OptimizerStep("sgd", lr=0.1), {"param": p}, zero)
    assert out["param"].tobytes() == p.tobytes()
    m, v = np.full_like(p, 0.5), np.full_like(p, 0.25)
    out = replay(
        OptimizerStep("adam", lr=0.1, step=3, beta1=0.5, beta2=0.5),
        {"param": p, "exp_avg": m, "exp_avg_sq": v},
        zero,
    )
    np.testing.assert_array_equal(out["exp_avg"], np.float32(0.25))  # 0.5 * 0.5, exact
    np.testing.assert_array_equal(out["exp_avg_sq"], np.float32(0.125))


def test_nan_and_inf_gradients_propagate_as_ieee_says() -> None:
    p = np.ones(3, dtype=np.float32)
    g = np.array([np.nan, np.inf, 1.0], dtype=np.float32)
    state = {"param": p, "exp_avg": np.zeros_like(p), "exp_avg_sq": np.zeros_like(p)}
    out = replay(OptimizerStep("adam", lr=0.1), state, g)
    assert np.isnan(out["exp_avg"][0])
    assert np.isinf(out["exp_avg"][1])
    assert np.isnan(out["param"][:2]).all()  # inf / inf
    assert np.isfinite(out["param"][2])


@pytest.mark.parametrize("kind", ["adam", "adamw"])
def test_adam_is_close_to_its_float64_formula(kind: str) -> None:
    rng = np.random.default_rng(1)
    p, g = rng.normal(size=(2, 4096)).astype(np.float32)
    m = (rng.normal(size=4096) * 1e-3).astype(np.float32)
    v = (rng.random(4096) * 1e-5).astype(np.float32)
    step = OptimizerStep(kind, lr=1e-3, step=7, weight_decay=0.01)
    out = replay(step, {"param": p, "exp_avg": m, "exp_avg_sq": v}, g)
    p64, g64, m64, v64 = (a.astype(np.float64) for a in (p, g, m, v))
    if kind == "adamw":
        p64 = p64 * (1 - 1e-3 * 0.01)
    else:
        g64 = g64 + 0.01 * p64
    m64 = 0.9 * m64 + 0.1 * g64
    v64 = 0.999 * v64 + 0.001 * g64 * g64
    denom = np.sqrt(v64) / np.sqrt(1 - 0.999**7) + 1e-8
    p64 = p64 - 1e-3 / (1 - 0.9**7) * m64 / denom
    np.testing.assert_allclose(out["exp_avg"], m64, rtol=1e-5, atol=1e-12)
    np.testing.assert_allclose(out["exp_avg_sq"], v64, rtol=1e-5, atol=1e-15)
    np.testing.assert_allclose(out["param"], p64, rtol=1e-5, atol=1e-7)


def test_the_step_round_trips_and_its_scalars_are_rounded_once() -> None:
    step = OptimizerStep("adamw", lr=3e-4, step=12, weight_decay=0.1, variant="fma")
    assert OptimizerStep.from_dict(step.to_dict()) == step
    scalars = step.scalars(np.dtype(np.float32))
    assert scalars["minus_step_size"] == np.float32(-(3e-4 / (1 - 0.9**12)))
    assert all(isinstance(s, np.float32) for s in scalars.values())
    assert step.scalars(parse_dtype("bfloat16"))["eps"].dtype == np.float32  # torch's opmath


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"kind": "lamb", "lr": 0.1}, "not replayed"),
        ({"kind": "adam", "lr": float("nan")}, "lr"),
        ({"kind": "adam", "lr": 0.1, "step": 0}, "step"),
        ({"kind": "sgd", "lr": 0.1, "nesterov": True}, "nesterov"),
        ({"kind": "adam", "lr": 0.1, "variant": "x87"}, "variant"),
        ({"kind": "adam", "lr": 0.1, "betas": (0.9, 0.99)}, "bad optimizer step"),
        ({"kind": "adam", "lr": 0.1, "beta1": 1.0}, "beta1"),
        ({"kind": "adam", "lr": -0.1}, "lr"),
        ({"kind": "adam", "lr": 0.1, "beta2": 1.5}, "beta2"),
        ({"kind": "adam", "lr": 0.1, "eps": -1e-8}, "eps"),
        ({"kind": "adam", "lr": 0.1, "amsgrad": "no"}, "amsgrad"),
        ({"kind": "adam", "lr": 0.1, "step": 1.5}, "step"),
    ],
)
def test_bad_steps_are_refused(fields: dict[str, object], words: str) -> None:
    with pytest.raises(InvalidInputError, match=words):
        OptimizerStep.from_dict(fields)


def test_numpy_scalars_from_torch_state_are_taken() -> None:
    step = OptimizerStep("adam", lr=np.float32(0.5), step=np.int64(3), amsgrad=np.bool_(False))
    assert (step.lr, step.step, step.amsgrad) == (0.5, 3, False)
    assert OptimizerStep.from_dict(step.to_dict()) == step


def test_bad_inputs_are_refused() -> None:
    p = np.ones(4, dtype=np.float32)
    adam = OptimizerStep("adam", lr=0.1)
    state = {"param": p, "exp_avg": p, "exp_avg_sq": p}
    with pytest.raises(InvalidInputError, match="shape"):
        replay(OptimizerStep("sgd", lr=0.1), {"param": p}, np.ones(3, dtype=np.float32))
    with pytest.raises(InvalidInputError, match="float16, bfloat16, float32, float64"):
        replay(OptimizerStep("sgd", lr=0.1), {"param": p.astype(np.int32)}, p)
    with pytest.raises(InvalidInputError, match="lacks exp_avg_sq"):
        replay(adam, {"param": p, "exp_avg": p}, p)
    with pytest.raises(InvalidInputError, match=r"exp_avg \(before\) is float32\[4, 1\]"):
        replay(adam, {**state, "exp_avg": p.reshape(4, 1)}, p)
    with pytest.raises(InvalidInputError, match=r"known\) is float64"):
        replay(adam, state, p, known={"exp_avg": p.astype(np.float64)})
    with pytest.raises(InvalidInputError, match="known holds exp_avgs, param"):
        replay(adam, state, p, known={"exp_avgs": p, "param": p})


def test_a_process_that_flushes_subnormals_is_refused() -> None:
    torch = pytest.importorskip("torch")
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush subnormals")
    try:
        with pytest.raises(GradpipeError, match="flushes subnormal"):
            replay(
                OptimizerStep("sgd", lr=0.1),
                {"param": np.ones(2, np.float32)},
                np.ones(2, np.float32),
            )
    finally:
        torch.set_flush_denormal(False)


# --- against torch.optim on this machine's CPU ------------------------------------------
#: (kind, torch optimizer, options, state dtype, floor): the better variant must match torch
#: in at least ``floor`` of the elements. Which variant matches depends on the CPU: torch's
#: vectorised kernels (AVX2, AVX-512) fuse multiply-adds, its default ones do not; and a torch
#: built with MKL takes square roots that are not always correctly rounded (Adam's parameters).
OPTIMIZERS = [
    ("adam", "Adam", {"lr": 1e-3}, "float32", 0.95),
    ("adam", "Adam", {"lr": 1e-3, "weight_decay": 0.01, "maximize": True}, "float32", 0.95),
    ("adam", "Adam", {"lr": 1e-3, "amsgrad": True, "betas": (0.3, 0.99)}, "float32", 0.95),
    ("adamw", "AdamW", {"lr": 1e-3, "weight_decay": 0.01}, "float32", 0.95),
    ("adamw", "AdamW", {"lr": 1e-3, "weight_decay": 0.01}, "bfloat16", 0.95),
    ("adamw", "AdamW", {"lr": 1e-3, "weight_decay": 0.01}, "float16", 0.95),
    ("adam", "Adam", {"lr": 1e-3, "weight_decay": 0.1}, "float64", 0.7),
    ("sgd", "SGD", {"lr": 0.01, "momentum": 0.9}, "float32", 0.99),
    ("sgd", "SGD", {"lr": 0.01, "momentum": 0.9, "dampening": 0.1}, "bfloat16", 0.95),
    (
        "sgd",
        "SGD",
        {"lr": 0.01, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-4},
        "float32",
        0.99,
    ),
    ("sgd", "SGD", {"lr": 0.01, "maximize": True}, "float16", 0.95),
    # torch's foreach and fused CPU implementations (the fused one takes exact square roots)
    ("adam", "Adam", {"lr": 1e-3, "foreach": True}, "float32", 0.95),
    ("adamw", "AdamW", {"lr": 1e-3, "weight_decay": 0.01, "fused": True}, "float32", 0.99),
    ("sgd", "SGD", {"lr": 0.01, "momentum": 0.9, "fused": True}, "float32", 0.99),
]


@pytest.mark.parametrize(("kind", "name", "options", "dtype", "floor"), OPTIMIZERS)
def test_a_variant_matches_torch_on_this_cpu(
    kind: str, name: str, options: dict[str, object], dtype: str, floor: float
) -> None:
    torch = pytest.importorskip("torch")
    import ml_dtypes

    to_numpy = {"bfloat16": ml_dtypes.bfloat16}.get(dtype, np.dtype(dtype))
    tdtype = getattr(torch, dtype)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape).to(tdtype)) for shape in ((3000,), (40, 70))]
    implementation = {} if {"foreach", "fused"} & set(options) else {"foreach": False}
    optimizer = getattr(torch.optim, name)(params, **implementation, **options)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)

    def numpy(x: torch.Tensor) -> np.ndarray:
        return x.detach().to(torch.float64).numpy().astype(to_numpy)

    matched = dict.fromkeys(VARIANTS, 0)
    total = 0
    for count in range(1, 6):
        for p in params:
            p.grad = (torch.randn(p.shape) * 0.1).to(tdtype)
            held = optimizer.state.get(p, {})
            if "max_exp_avg_sq" in held:  # some maxima above the moment, so the max matters
                held["max_exp_avg_sq"][..., ::2] *= 4
        group = dict(optimizer.param_groups[0])
        before = {
            p: {k: numpy(v) for k, v in optimizer.state.get(p, {}).items() if k != "step"}
            for p in params
        }
        for p in params:
            before[p]["param"] = numpy(p)
        grads = {p: numpy(p.grad) for p in params}
        optimizer.step()
        schedule.step()
        for p in params:
            after = {k: numpy(v) for k, v in optimizer.state[p].items() if k != "step"}
            after["param"] = numpy(p)
            for variant in VARIANTS:
                step = OptimizerStep(
                    kind,  # type: ignore[arg-type]
                    lr=group["lr"],
                    step=count,
                    beta1=group.get("betas", (0.9, 0.999))[0],
                    beta2=group.get("betas", (0.9, 0.999))[1],
                    eps=group.get("eps", 1e-8),
                    weight_decay=group["weight_decay"],
                    amsgrad=group.get("amsgrad", False),
                    momentum=group.get("momentum", 0.0),
                    dampening=group.get("dampening", 0.0),
                    nesterov=group.get("nesterov", False),
                    maximize=group.get("maximize", False),
                    variant=variant,  # type: ignore[arg-type]
                )
                previous = dict(before[p])
                for role in roles(step):
                    if role != "momentum_buffer":
                        previous.setdefault(role, np.zeros_like(previous["param"]))
                predicted = replay(step, previous, grads[p])
                for role, values in predicted.items():
                    same = values.view(np.uint8) == after[role].view(np.uint8)
                    matched[variant] += int(same.reshape(values.size, -1).all(axis=1).sum())
            total += sum(a.size for role, a in after.items() if role in predicted)
    best = max(matched.values()) / total
    assert best >= floor, {v: round(m / total, 4) for v, m in matched.items()}


def test_recorded_scalars_give_the_same_bits_without_the_readers_pow(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gradpipe.core.replay import scalars_from_json, scalars_to_json

    rng = np.random.default_rng(5)
    p, g = rng.normal(size=(2, 256)).astype(np.float32)
    state = {"param": p, "exp_avg": g * np.float32(0.1), "exp_avg_sq": g * g}
    for step in (
        OptimizerStep("adamw", lr=3e-4, step=1234, weight_decay=0.01, variant="fma"),
        OptimizerStep("sgd", lr=1e-2, momentum=0.9, dampening=0.1),
    ):
        written = replay(step, state, g)
        recorded = scalars_to_json(step.scalars(p.dtype))
        assert all(v.startswith("0x") for v in recorded.values())
        scalars = scalars_from_json(recorded, p.dtype)

        def no_pow(self: OptimizerStep, dtype: np.dtype) -> dict[str, np.generic]:
            raise AssertionError("the reader computed the scalars again")

        with monkeypatch.context() as patch:
            patch.setattr(OptimizerStep, "scalars", no_pow)
            assert _bits(replay(step, state, g, scalars=scalars)) == _bits(written)
            bent = {k: v * np.float32(1.5) for k, v in scalars.items()}
            assert _bits(replay(step, state, g, scalars=bent)) != _bits(written)  # used
            with pytest.raises(InvalidInputError, match="recorded scalars"):
                replay(step, state, g, scalars={"lr": np.float32(1)})
    with pytest.raises(InvalidInputError, match="bit pattern"):
        scalars_from_json({"lr": "0xzz"}, p.dtype)
    with pytest.raises(InvalidInputError, match="not float32"):
        replay(step, state, g, scalars={k: np.float64(v) for k, v in scalars.items()})


def test_only_the_moments_are_the_same_moments() -> None:
    rng = np.random.default_rng(6)
    p, g = rng.normal(size=(2, 128)).astype(np.float32)
    for step, state in (
        (
            OptimizerStep("adam", lr=1e-3, step=3, amsgrad=True),
            {"param": p, "exp_avg": p, "exp_avg_sq": p * p, "max_exp_avg_sq": p * p},
        ),
        (
            OptimizerStep("sgd", lr=1e-2, momentum=0.9, nesterov=True),
            {"param": p, "momentum_buffer": g},
        ),
    ):
        every = replay(step, state, g)
        moments = [r for r in roles(step) if r != "param"]
        some = replay(step, state, g, only=moments)
        assert set(some) == set(moments)
        assert _bits(some) == {r: every[r].tobytes() for r in moments}
    with pytest.raises(InvalidInputError, match="only"):
        replay(step, state, g, only=["exp_avg"])
