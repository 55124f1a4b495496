"""Tensors stored with a lossy codec: marked, measured, never confused with exact ones."""

from __future__ import annotations

import math
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import gradpipe as gp
from gradpipe.codecs import BF16Codec, TopKCodec
from gradpipe.codecs.registry import make_codec
from gradpipe.core.lossy import measure_error
from gradpipe.core.manifest import encode_manifest
from gradpipe.errors import InvalidInputError
from gradpipe.runs import open_run
from gradpipe.testing.training import TrainingConfig, write_sample_run

NAMES = ["bf16", "fp16", "bitround-5", "topk-0.05", "qsgd-8", "powersgd-2", "projection-0.1"]


def gradient(shape: tuple[int, ...] = (96, 300), seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) * 1e-3).astype(np.float32)


@pytest.mark.parametrize("name", NAMES)
def test_put_tensor_lossily_marks_measures_and_verifies(store: gp.Store, name: str) -> None:
    x = gradient()
    codec = make_codec(name)
    tensor_id = store.put_tensor(x, name="g", codecs=[codec], chunk_bytes=32 * 1024)
    info = store.tensor_info(tensor_id)
    got = store.get_tensor(tensor_id)
    assert got.dtype == x.dtype
    assert got.shape == x.shape
    assert not info.exact
    assert info.lossy is not None
    assert info.lossy.name == name
    assert info.lossy.codec["id"] == codec.codec_id
    # the recorded error is the error of what reads give back
    measured = measure_error(x, got)
    assert info.lossy.max_abs_error == measured.max_abs
    assert math.isclose(info.lossy.rel_l2_error, measured.rel_l2, rel_tol=1e-9)
    assert info.lossy.bound == codec.error_bound()
    assert info.lossy.bound.holds(x, got)
    # chunk stats describe the stored values
    assert math.isclose(info.summary().sumsq, float(np.sum(got.astype(np.float64) ** 2)))
    # a format-4 manifest: older gradpipes refuse it rather than take it for exact
    assert b'"format":4' in encode_manifest(info)
    assert gp.verify(store).ok


def test_lossy_ids_never_stand_for_the_original(store: gp.Store) -> None:
    x = gradient(seed=1)
    lossy = store.tensor_info(store.put_tensor(x, codecs=[TopKCodec(0.1)]))
    exact_id = store.put_tensor(x)
    exact = store.tensor_info(exact_id)
    assert exact.exact
    assert exact.lossy is None
    assert not set(lossy.blocks) & set(exact.blocks)
    # the exact put after the lossy one gets the original back, bit for bit
    assert store.get_tensor(exact_id).tobytes() == x.tobytes()
    assert gp.verify(store, all_blocks=True).ok


def test_values_a_lossy_codec_keeps_share_blocks_with_exact_data(store: gp.Store) -> None:
    """bf16 of values that are already bfloat16 is exact: same bytes, same id, still marked."""
    x = gradient(seed=2).astype(ml_dtypes.bfloat16).astype(np.float32)
    lossy_id = store.put_tensor(x, codecs=[BF16Codec()])
    exact_id = store.put_tensor(x)
    lossy, exact = store.tensor_info(lossy_id), store.tensor_info(exact_id)
    assert lossy.blocks == exact.blocks
    assert lossy.lossy is not None
    assert lossy.lossy.max_abs_error == 0
    assert exact.exact
    assert store.get_tensor(exact_id).tobytes() == x.tobytes()
    assert store.get_tensor(lossy_id).tobytes() == x.tobytes()


def test_integer_tensors_stay_exact(store: gp.Store) -> None:
    steps = np.arange(1000, dtype=np.int64)
    info = store.tensor_info(store.put_tensor(steps, codecs=[make_codec("qsgd-4")]))
    assert info.exact
    assert store.get_tensor(store.put_tensor(steps, codecs=[make_codec("qsgd-4")])).tobytes() == (
        steps.tobytes()
    )


def test_lossy_codec_must_lead_the_chain(store: gp.Store) -> None:
    from numcodecs import Zstd

    with pytest.raises(InvalidInputError, match="must come first"):
        store.put_tensor(gradient(), codecs=[Zstd(), BF16Codec()])
    with pytest.raises(InvalidInputError, match="round-trip"):
        store.put_raw(gradient().tobytes(), codecs=[BF16Codec()])


def test_chained_lossless_codec_after_a_lossy_one(store: gp.Store) -> None:
    from numcodecs import Zstd

    x = gradient(seed=3)
    info = store.tensor_info(store.put_tensor(x, codecs=[BF16Codec(), Zstd(level=3)]))
    assert info.lossy is not None
    assert info.lossy.codec == {"id": "gradpipe_bf16", "dtype": "float32"}
    assert info.lossy.bound.holds(x, store.read_tensor(info))


def test_ingest_with_a_lossy_codec(store: gp.Store, tmp_path: Path) -> None:
    sample = write_sample_run(
        tmp_path / "dumps", TrainingConfig(vocab_size=500, embed_dim=8, hidden=16, steps=2)
    )
    report = gp.ingest(store, sample.dump_pattern, run="r", codecs=[make_codec("fp16")])
    assert report.ok
    assert gp.ingest(store, sample.dump_pattern, run="exact").ok
    run, exact_run = open_run(store, "r"), open_run(store, "exact")
    assert all(entry.lossy for entry in run)
    assert not any(entry.lossy for entry in exact_run)
    dump, exact_dump = run.dump(1, sample.peers[0]), exact_run.dump(1, sample.peers[0])
    for name in dump.names:
        info = dump.info(name)
        assert info.lossy is not None
        assert info.lossy.name == "fp16"
        original = exact_dump.read(name)
        stored = dump.read(name)
        assert info.lossy.max_abs_error == measure_error(original, stored).max_abs
        assert info.lossy.bound.holds(original, stored)
    assert gp.verify(store).ok
