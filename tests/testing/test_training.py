"""Tests of the synthetic federated training run used for realistic dumps."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file

from gradpipe.errors import InvalidInputError
from gradpipe.formats.safetensors import read_safetensors
from gradpipe.testing import (
    TrainingConfig,
    TrainingState,
    loss_and_gradients,
    sample_gradients,
    train,
    write_sample_run,
)

SMALL = TrainingConfig(vocab_size=3000, embed_dim=8, hidden=16, steps=3)


def files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def test_same_seed_gives_bit_identical_files_and_other_seed_does_not(tmp_path: Path) -> None:
    a = files(Path(write_sample_run(tmp_path / "a", SMALL).directory))
    b = files(Path(write_sample_run(tmp_path / "b", SMALL).directory))
    c = files(Path(write_sample_run(tmp_path / "c", replace(SMALL, seed=1)).directory))
    assert len(a) == SMALL.steps * (SMALL.peers + 1)
    assert a == b
    assert a.keys() == c.keys()
    assert all(a[k] != c[k] for k in a)


def test_loss_goes_down_and_parameters_drift_slowly() -> None:
    results = list(train(TrainingConfig(steps=24)))
    losses = [r.loss for r in results]
    assert np.mean(losses[-4:]) < np.mean(losses[:4]) - 0.1
    assert abs(losses[0] - np.log(10)) < 0.5  # starts near chance level for 10 classes
    for name in ("dense1.weight", "classifier.weight"):
        before, after = results[10].state.params[name], results[11].state.params[name]
        change = np.linalg.norm(after - before) / np.linalg.norm(before)
        assert 0 < change < 0.05, name


def test_embedding_gradients_are_row_sparse_and_dense_layers_dense() -> None:
    result = next(train(TrainingConfig()))
    for peer, grads in result.gradients.items():
        rows_used = np.any(grads["embedding.weight"] != 0, axis=1)
        assert rows_used.mean() < 0.10, peer
        assert rows_used.sum() > 50, peer  # Zipf tail: many distinct rare tokens
        for name in ("dense1.weight", "dense2.weight", "classifier.weight", "classifier.bias"):
            assert (grads[name] != 0).mean() > 0.5, (peer, name)
            assert np.isfinite(grads[name]).all()


def test_num_examples_unequal_and_recorded(tmp_path: Path) -> None:
    run = write_sample_run(tmp_path, SMALL)
    assert run.peers == ["peer0", "peer1", "peer2"]
    assert run.steps == [0, 1, 2]
    seen = {}
    for step in run.steps:
        for peer in run.peers:
            path = Path(run.dump_pattern.format(step=f"{step:04d}", peer=peer))
            assert path == Path(run.dump_path(step, peer))
            assert path.parent.name == f"step={step:04d}"
            _, meta = read_safetensors(path)
            assert meta["step"] == str(step)
            assert meta["peer"] == peer
            assert 0 < float(meta["loss"]) < 10
            seen[peer] = int(meta["num_examples"])
    assert seen == {"peer0": 32, "peer1": 64, "peer2": 128}


def test_files_match_results_with_both_readers(tmp_path: Path) -> None:
    run = write_sample_run(tmp_path, SMALL)
    results = list(train(SMALL))
    shapes = SMALL.param_shapes()
    for r in results:
        for peer in run.peers:
            ref = load_file(run.dump_path(r.step, peer))
            ours, _ = read_safetensors(run.dump_path(r.step, peer))
            assert ref.keys() == ours.keys() == shapes.keys()
            for name, g in r.gradients[peer].items():
                assert g.shape == shapes[name]
                assert ref[name].tobytes() == ours[name].tobytes() == g.tobytes()
        state, meta = read_safetensors(run.state_path(r.step))
        assert meta["step"] == str(r.step)
        assert float(meta["loss"]) == r.loss
        assert json.loads(meta["rng_state"]) == r.state.rng_state
        assert json.loads(meta["config"])["vocab_size"] == SMALL.vocab_size
        for kind, group in (("params", r.state.params), ("adam_m", r.state.adam_m)):
            for name, arr in group.items():
                np.testing.assert_array_equal(state[f"{kind}/{name}"], arr)


def test_resume_from_written_state_continues_bit_identically(tmp_path: Path) -> None:
    config = replace(SMALL, steps=4)
    full = list(train(config))
    run = write_sample_run(tmp_path, replace(SMALL, steps=2))
    tensors, meta = read_safetensors(run.state_path(1))
    state = TrainingState(
        step=int(meta["step"]),
        params={k[7:]: v for k, v in tensors.items() if k.startswith("params/")},
        adam_m={k[7:]: v for k, v in tensors.items() if k.startswith("adam_m/")},
        adam_v={k[7:]: v for k, v in tensors.items() if k.startswith("adam_v/")},
        rng_state=json.loads(meta["rng_state"]),
        loss=float(meta["loss"]),
    )
    resumed = list(train(config, resume=state))
    assert [r.step for r in resumed] == [2, 3]
    for a, b in zip(full[2:], resumed, strict=True):
        assert a.loss == b.loss
        for peer in a.gradients:
            for name in a.gradients[peer]:
                assert a.gradients[peer][name].tobytes() == b.gradients[peer][name].tobytes()


def test_optimizer_uses_the_example_weighted_fedavg() -> None:
    r0, r1 = list(train(SMALL))[:2]
    total = sum(r1.num_examples.values())
    for name in ("classifier.weight", "embedding.weight"):
        avg = sum(r1.gradients[p][name] * (n / total) for p, n in r1.num_examples.items())
        unweighted = sum(r1.gradients[p][name] for p in r1.num_examples) / SMALL.peers
        expected_m = 0.9 * r0.state.adam_m[name] + 0.1 * avg
        np.testing.assert_allclose(r1.state.adam_m[name], expected_m, rtol=1e-5, atol=1e-9)
        wrong_m = 0.9 * r0.state.adam_m[name] + 0.1 * unweighted
        assert not np.allclose(r1.state.adam_m[name], wrong_m, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_gradients(tmp_path: Path, dtype: str) -> None:
    config = replace(SMALL, dtype=dtype)
    run = write_sample_run(tmp_path, config)
    grads, _ = read_safetensors(run.dump_path(0, "peer1"))
    expected = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(np.float16)
    assert {g.dtype for g in grads.values()} == {expected}
    f32 = sample_gradients(SMALL)["dense1.weight"]
    low = next(train(config)).gradients["peer0"]["dense1.weight"]
    np.testing.assert_array_equal(low, f32.astype(expected))  # emitted = rounded float32
    state, _ = read_safetensors(run.state_path(2))
    assert state["params/dense1.weight"].dtype == np.float32  # master weights stay float32


def test_backprop_matches_finite_differences() -> None:
    config = TrainingConfig(vocab_size=40, embed_dim=4, hidden=5, num_classes=3, dtype="float64")
    rng = np.random.default_rng(7)
    params = {k: rng.standard_normal(s) for k, s in config.param_shapes().items()}
    tokens = rng.integers(0, 20, (6, 3))  # rows 20..39 are never used
    labels = rng.integers(0, 3, 6)
    _, grads = loss_and_gradients(params, tokens, labels)
    h = 1e-6
    for name, p in params.items():
        numeric = np.zeros_like(p)
        for idx in np.ndindex(p.shape):
            old = p[idx]
            p[idx] = old + h
            up, _ = loss_and_gradients(params, tokens, labels)
            p[idx] = old - h
            down, _ = loss_and_gradients(params, tokens, labels)
            p[idx] = old
            numeric[idx] = (up - down) / (2 * h)
        np.testing.assert_allclose(grads[name], numeric, rtol=1e-5, atol=1e-8, err_msg=name)
    assert not grads["embedding.weight"][20:].any()
    assert grads["embedding.weight"][np.unique(tokens)].any(axis=1).all()


def test_for_dump_size_hits_the_target(tmp_path: Path) -> None:
    config = TrainingConfig.for_dump_size(3, steps=2, peers=2)
    assert (config.steps, config.peers) == (2, 2)
    assert abs(config.dump_bytes() / 2**20 - 3) < 0.05 * 3
    run = write_sample_run(tmp_path, config)
    written = sum(p.stat().st_size for p in (tmp_path / "dumps").rglob("*.safetensors"))
    assert abs(written / 2**20 - 3) < 0.05 * 3
    assert len(run.peers) * len(run.steps) == 4
    big = TrainingConfig.for_dump_size(500)
    assert big.embed_dim > TrainingConfig().embed_dim
    assert abs(big.dump_bytes() / 2**20 - 500) < 25


def test_sample_gradients_shapes() -> None:
    grads = sample_gradients(SMALL)
    assert {k: v.shape for k, v in grads.items()} == SMALL.param_shapes()
    assert all(v.dtype == np.float32 for v in grads.values())


@pytest.mark.parametrize(
    "kwargs", [{"dtype": "int8"}, {"dtype": "nope"}, {"peers": 0}, {"examples_per_peer": ()}]
)
def test_bad_config_rejected(kwargs: dict) -> None:
    with pytest.raises(InvalidInputError):
        TrainingConfig(**kwargs)
