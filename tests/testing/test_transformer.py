"""Tests of the transformer fine-tuning run that makes realistic benchmark dumps."""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import replace
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from gradpipe import open_store
from gradpipe.errors import InvalidInputError
from gradpipe.formats.safetensors import read_safetensors
from gradpipe.ingestion.api import ingest
from gradpipe.runs import open_run
from gradpipe.testing import TransformerConfig, train_transformer, write_transformer_run
from gradpipe.testing._transformer_numpy import loss_and_gradients
from gradpipe.testing.transformer import _Data, init_params

HAS_TORCH = importlib.util.find_spec("torch") is not None
needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
TINY = TransformerConfig.tiny()
EMB = "embeddings.word_embeddings.weight"


def files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def test_default_names_and_shapes_are_minilm_l6() -> None:
    shapes = TransformerConfig().param_shapes()
    assert shapes[EMB] == (30522, 384)
    assert shapes["embeddings.position_embeddings.weight"] == (512, 384)
    assert shapes["embeddings.token_type_embeddings.weight"] == (2, 384)
    assert shapes["embeddings.LayerNorm.bias"] == (384,)
    layer = {k[len("encoder.layer.5.") :]: s for k, s in shapes.items() if "layer.5." in k}
    assert layer == {
        **{f"attention.self.{m}.weight": (384, 384) for m in ("query", "key", "value")},
        **{f"attention.self.{m}.bias": (384,) for m in ("query", "key", "value")},
        "attention.output.dense.weight": (384, 384),
        "attention.output.dense.bias": (384,),
        "attention.output.LayerNorm.weight": (384,),
        "attention.output.LayerNorm.bias": (384,),
        "intermediate.dense.weight": (1536, 384),
        "intermediate.dense.bias": (1536,),
        "output.dense.weight": (384, 1536),
        "output.dense.bias": (384,),
        "output.LayerNorm.weight": (384,),
        "output.LayerNorm.bias": (384,),
    }
    assert not any("layer.6." in k for k in shapes)
    assert shapes["pooler.dense.weight"] == (384, 384)
    assert shapes["classifier.weight"] == (2, 384)
    assert len(shapes) == 5 + 16 * 6 + 2 + 2
    small = sum(np.prod(s) * 4 <= 6 * 1024 for s in shapes.values())
    assert small >= len(shapes) / 2  # half the tensors are small vectors, as users see
    # 24 float32 dumps of 91 MB (22.7 M parameters): the users' run was 2.07 GB.
    assert TransformerConfig().peers * TransformerConfig().steps == 24
    assert abs(TransformerConfig().dump_bytes() - 2.07e9) < 0.1 * 2.07e9


def test_gradients_have_the_model_names_and_shapes_in_both_dtypes() -> None:
    for dtype, want in (("float32", np.float32), ("bfloat16", ml_dtypes.bfloat16)):
        config = replace(TINY, dtype=dtype, steps=1)
        (result,) = train_transformer(config)
        for peer in config.peer_names:
            grads = result.gradients[peer]
            assert {k: v.shape for k, v in grads.items()} == config.param_shapes()
            assert {v.dtype for v in grads.values()} == {np.dtype(want)}
        assert {v.dtype for v in result.params.values()} == {np.dtype(np.float32)}


def test_embedding_gradient_is_row_sparse_and_dense_layers_dense() -> None:
    config = replace(TINY, vocab_size=5000, seq_len=128, max_positions=128, steps=1)
    (result,) = train_transformer(config)
    batch = _Data(config).batch(np.random.default_rng([config.seed, 2]))
    grads = result.gradients["peer0"]
    rows = np.flatnonzero(np.any(grads[EMB] != 0, axis=1))
    used = np.unique(batch.input_ids)
    np.testing.assert_array_equal(rows, used[used != 0])  # the batch's tokens, not [PAD]
    assert 0.001 < rows.size / config.vocab_size < 0.03
    positions = np.any(grads["embeddings.position_embeddings.weight"] != 0, axis=1)
    assert positions[: batch.attention_mask.sum(axis=1).max()].all()
    assert not positions[config.seq_len :].any()
    assert not grads["embeddings.token_type_embeddings.weight"][1].any()  # one sentence type
    for name in (
        "encoder.layer.0.attention.self.query.weight",
        "encoder.layer.1.output.dense.weight",
    ):
        assert (grads[name] != 0).mean() > 0.99, name


def test_loss_falls_and_labels_are_balanced() -> None:
    # numpy: fast on a tiny model; torch follows the same path (test_torch_and_numpy_agree).
    losses = [r.loss for r in train_transformer(replace(TINY, steps=40), backend="numpy")]
    assert abs(losses[0] - np.log(2)) < 0.05  # starts at chance level for 2 labels
    assert np.mean(losses[-8:]) < np.mean(losses[:8]) - 0.1
    labels = _Data(replace(TINY, batch_size=2000)).batch(np.random.default_rng(1)).labels
    assert 0.4 < labels.mean() < 0.6


def test_same_seed_gives_identical_files_and_another_seed_does_not(tmp_path: Path) -> None:
    a = files(Path(write_transformer_run(tmp_path / "a", TINY).directory))
    b = files(Path(write_transformer_run(tmp_path / "b", TINY).directory))
    c = files(Path(write_transformer_run(tmp_path / "c", replace(TINY, seed=1)).directory))
    assert len(a) == TINY.steps * (TINY.peers + 1)
    assert a == b
    assert a.keys() == c.keys()
    assert all(a[k] != c[k] for k in a)


def test_backprop_matches_finite_differences() -> None:
    config = replace(TINY, vocab_size=12, hidden=4, heads=2, intermediate=6, seq_len=5)
    config = replace(config, max_positions=6, batch_size=3, num_labels=3, dtype="float64")
    rng = np.random.default_rng(3)
    params = {k: v + rng.normal(0, 0.3, v.shape) for k, v in init_params(config).items()}
    params[EMB][0] = 0
    batch = _Data(config).batch(np.random.default_rng(4))
    shape = {"layers": config.layers, "heads": config.heads}
    _, grads = loss_and_gradients(params, batch, **shape)
    h = 1e-6
    for name, p in params.items():
        numeric = np.zeros_like(p)
        for idx in np.ndindex(p.shape):
            old = p[idx]
            p[idx] = old + h
            up, _ = loss_and_gradients(params, batch, **shape)
            p[idx] = old - h
            down, _ = loss_and_gradients(params, batch, **shape)
            p[idx] = old
            numeric[idx] = (up - down) / (2 * h)
        if name == EMB:
            numeric[0] = 0  # padding_idx: torch.nn.Embedding never updates the [PAD] row
        np.testing.assert_allclose(grads[name], numeric, rtol=1e-5, atol=1e-8, err_msg=name)
    assert np.abs(grads["encoder.layer.0.attention.self.query.weight"]).max() > 1e-4


@needs_torch
def test_torch_and_numpy_agree() -> None:
    from gradpipe.testing._transformer_torch import TorchTrainer

    config = replace(TINY, dtype="float64")
    params = init_params(config)
    batch = _Data(config).batch(np.random.default_rng(5))
    shape = {"layers": config.layers, "heads": config.heads}
    loss, grads = loss_and_gradients(params, batch, **shape)
    trainer = TorchTrainer(params, **shape, lr=1e-3, weight_decay=0.01, seed=0)
    torch_loss, torch_grads = trainer.gradients(batch)
    assert torch_loss == pytest.approx(loss, rel=1e-12)
    assert torch_grads.keys() == grads.keys()
    scale = max(np.abs(g).max() for g in grads.values())
    for name, g in grads.items():
        # Key biases cannot change the loss (softmax is shift-invariant): both are ~1e-23.
        np.testing.assert_allclose(torch_grads[name], g, rtol=1e-7, atol=1e-12 * scale)
    # Whole runs agree too: the same AdamW, step after step, to float32 rounding.
    runs = [list(train_transformer(TINY, backend=b)) for b in ("numpy", "torch")]
    for a, b in zip(*runs, strict=True):
        assert a.loss == pytest.approx(b.loss, rel=1e-4)
        for name in ("encoder.layer.1.output.dense.weight", EMB):
            np.testing.assert_allclose(a.params[name], b.params[name], rtol=1e-4, atol=1e-6)
            np.testing.assert_allclose(
                a.exp_avg_sq[name], b.exp_avg_sq[name], rtol=1e-3, atol=1e-12
            )


def test_files_hold_dumps_metadata_and_optimizer_state(tmp_path: Path) -> None:
    run = write_transformer_run(tmp_path, TINY)
    results = list(train_transformer(TINY))
    assert run.peers == ["peer0", "peer1"]
    for r in results:
        for peer in run.peers:
            assert Path(run.dump_path(r.step, peer)).parent.name == f"step={r.step:04d}"
            grads, meta = read_safetensors(run.dump_path(r.step, peer))
            assert meta == {
                "num_examples": str(TINY.batch_size),
                "step": str(r.step),
                "peer": peer,
                "loss": repr(r.peer_losses[peer]),
            }
            assert all(grads[k].tobytes() == g.tobytes() for k, g in r.gradients[peer].items())
        state, meta = read_safetensors(run.state_path(r.step))
        assert json.loads(meta["config"])["hidden"] == TINY.hidden
        assert float(meta["loss"]) == r.loss
        for kind, group in (("params", r.params), ("exp_avg", r.exp_avg)):
            for name, arr in group.items():
                np.testing.assert_array_equal(state[f"{kind}/{name}"], arr)
        assert state[f"step/{EMB}"] == r.step + 1
        assert (state[f"exp_avg_sq/{EMB}"] >= 0).all()


def test_dumps_ingest_and_read_back_bit_exact(tmp_path: Path) -> None:
    config = replace(TINY, dtype="bfloat16", steps=2)
    run = write_transformer_run(tmp_path / "run", config, states=False)
    assert not (tmp_path / "run" / "state").exists()
    store = open_store(str(tmp_path / "store"), mode="w")
    report = ingest(store, run.dump_pattern, run="bert")
    assert report.ok
    assert report.ingested == config.steps * config.peers
    stored = open_run(store, "bert")
    assert stored.steps == run.steps
    for step in run.steps:
        for peer in run.peers:
            tensors, meta = read_safetensors(run.dump_path(step, peer))
            dump = stored.dump(step, peer)
            assert dump.metadata["num_examples"] == meta["num_examples"]
            back = dump.read_all()
            assert back.keys() == tensors.keys()
            for name, tensor in tensors.items():
                assert back[name].dtype == tensor.dtype
                assert back[name].tobytes() == tensor.tobytes(), name


@pytest.mark.parametrize("mib", [2, 30, 200, 2000])
def test_for_dump_size_is_near_the_target(mib: float) -> None:
    config = TransformerConfig.for_dump_size(mib)
    assert abs(config.dump_bytes() / 2**20 - mib) < 0.15 * mib
    if mib >= 200:
        assert config.param_shapes() == TransformerConfig().param_shapes()  # the real model
    if mib < 80:  # smaller than one dump of the real model: the model shrinks
        one = TransformerConfig.for_dump_size(mib, steps=1, peers=1)
        assert (one.steps, one.peers) == (1, 1)
        assert abs(one.dump_bytes() / 2**20 - mib) < 0.15 * mib
        assert one.hidden % one.heads == 0


@pytest.mark.parametrize(
    "kwargs",
    [{"dtype": "int8"}, {"heads": 5}, {"seq_len": 600}, {"peers": 0}, {"vocab_size": 3}],
)
def test_bad_config_rejected(kwargs: dict) -> None:
    with pytest.raises(InvalidInputError):
        TransformerConfig(**kwargs)


def test_without_torch_auto_falls_back_to_numpy(monkeypatch: pytest.MonkeyPatch) -> None:
    numpy_run = [r.loss for r in train_transformer(TINY, backend="numpy")]
    monkeypatch.setitem(sys.modules, "gradpipe.testing._transformer_torch", None)  # unimportable
    assert [r.loss for r in train_transformer(TINY)] == numpy_run
    with pytest.raises(ImportError):
        next(train_transformer(TINY, backend="torch"))
    with pytest.raises(InvalidInputError, match="backend"):
        next(train_transformer(TINY, backend="jax"))  # type: ignore[arg-type]
