"""Tensor statistics from a manifest agree with the values, and shared blocks count once."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gradpipe.core.chain import ChainInfo, DeltaLink
from gradpipe.core.chunk_stats import chunk_stats
from gradpipe.core.ids import hash_bytes
from gradpipe.core.tensor_manifest import TensorManifest
from gradpipe.statistics.tensor_stats import (
    ADDITIVE,
    MAXIMA,
    RECORD_FIELDS,
    BlockLedger,
    TensorStats,
    bits_per_value,
    fraction,
    l2_norm,
    ratio,
    tensor_stats,
)


def _manifest(
    array: np.ndarray,
    *,
    chunk: int,
    inline: dict[int, bytes] | None = None,
    deltas: dict[int, tuple[DeltaLink, ...]] | None = None,
    chain: ChainInfo | None = None,
) -> TensorManifest:
    """A manifest of ``array`` in chunks of ``chunk`` elements (no store involved)."""
    pieces = [array[i : i + chunk] for i in range(0, array.size, chunk)]
    blocks = tuple(hash_bytes(p.view(np.uint8)) if p.any() else None for p in pieces)
    return TensorManifest(
        "float32",
        array.shape,
        (chunk,),
        blocks,
        tuple(chunk_stats(p) for p in pieces),
        inline or {},
        deltas or {},
        chain,
    )


def _values() -> np.ndarray:
    rng = np.random.default_rng(3)
    values = rng.standard_normal(40).astype(np.float32)
    values[10:20] = 0  # the second chunk is all zero: no block
    values[25] = np.nan
    values[26] = -np.inf
    values[27] = -0.0
    return values


def test_figures_match_the_values() -> None:
    values = _values()
    manifest = _manifest(values, chunk=10, inline={3: b"x" * 7})
    blocks = {b: 100 + i for i, b in enumerate(manifest.blocks) if b is not None}
    record = tensor_stats(manifest, BlockLedger(blocks), ["a", None, "b", "a"])
    finite = values[np.isfinite(values)].astype(np.float64)
    assert record.numel == 40
    assert record.raw_bytes == 160
    # Chunks 0 and 2 are blocks of their own (100 and 102 bytes); chunk 3 is inline (7 bytes).
    assert record.stored_bytes == record.referenced_bytes == 100 + 102 + 7
    assert (record.chunk_count, record.zero_chunk_count, record.inline_chunk_count) == (4, 1, 1)
    assert record.nonzero_count == np.count_nonzero(values)  # NaN counts, -0.0 does not
    assert record.density == np.count_nonzero(values) / 40
    assert record.zero_chunk_fraction == 0.25
    assert (record.nan_count, record.inf_count) == (1, 1)
    assert math.isclose(record.l2_norm, float(np.sqrt(np.sum(finite**2))), rel_tol=1e-12)
    assert record.max_abs == math.inf
    assert record.ratio == 160 / 209
    assert record.bits_per_value == 8 * 209 / 40
    assert (record.encoding, record.chain_depth, record.codec) == ("full", 0, "a,b")
    assert (record.lossy, record.max_abs_error, record.missing_blocks) == (False, 0.0, 0)


def test_record_has_every_field_in_order() -> None:
    manifest = _manifest(np.ones(4, np.float32), chunk=4)
    [block] = manifest.blocks
    assert block is not None
    doc = tensor_stats(manifest, BlockLedger({block: 3}), ["c"]).to_dict()
    assert tuple(doc) == RECORD_FIELDS
    assert (doc["ratio"], doc["max_abs"], doc["density"]) == (16 / 3, 1.0, 1.0)
    assert set(ADDITIVE) | set(MAXIMA) <= set(RECORD_FIELDS)


def test_shared_blocks_count_once_for_the_first_claimant() -> None:
    values = np.arange(1, 21, dtype=np.float32)
    first = _manifest(values, chunk=10)
    again = _manifest(values, chunk=10)  # equal content: the same two blocks
    sizes = {b: 50 for b in first.blocks if b is not None}
    ledger = BlockLedger(sizes)
    a = tensor_stats(first, ledger, ["x", "x"])
    b = tensor_stats(again, ledger, ["x", "x"])
    assert (a.stored_bytes, a.referenced_bytes) == (100, 100)
    assert (b.stored_bytes, b.referenced_bytes) == (0, 100)
    assert b.ratio == math.inf  # it took no bytes of its own
    assert ledger.counted_bytes == a.stored_bytes + b.stored_bytes


def test_a_block_twice_in_one_tensor_counts_once() -> None:
    values = np.tile(np.arange(1, 11, dtype=np.float32), 2)  # two equal chunks
    manifest = _manifest(values, chunk=10)
    assert manifest.blocks[0] == manifest.blocks[1]
    record = tensor_stats(manifest, BlockLedger({manifest.blocks[0]: 30}), ["x", "x"])
    assert (record.stored_bytes, record.referenced_bytes) == (30, 30)


def test_a_missing_block_is_counted_and_leaves_the_ratio_unknown() -> None:
    manifest = _manifest(np.ones(8, np.float32), chunk=4)
    record = tensor_stats(manifest, BlockLedger({}), ["x", "x"])
    # Both chunks are equal: one block, missing.
    assert (record.missing_blocks, record.stored_bytes) == (1, 0)
    assert math.isnan(record.ratio)


def test_delta_chunks_claim_their_delta_and_keyframe() -> None:
    values = np.arange(1, 21, dtype=np.float32)
    keyframe = _manifest(values, chunk=10)
    changed = values.copy()
    changed[:10] += 1
    version = _manifest(changed, chunk=10)
    delta_block = hash_bytes(b"delta")
    link = DeltaLink(delta_block, keyframe.blocks[0] or "", "int")
    lossy = ChainInfo(None, 8, (12, 0), (40, 40), (1, 1), lossy=True, max_abs_error=0.5)
    version = _manifest(changed, chunk=10, deltas={0: (link,)}, chain=lossy)
    sizes = {b: 40 for b in keyframe.blocks if b is not None} | {delta_block: 12}
    ledger = BlockLedger(sizes)
    tensor_stats(keyframe, ledger, ["x", "x"])
    record = tensor_stats(version, ledger, ["gradpipe_delta:int", "x"])
    # The keyframe and the unchanged second chunk were counted by the first version.
    assert (record.stored_bytes, record.referenced_bytes) == (12, 12 + 40 + 40)
    assert (record.encoding, record.chain_depth, record.delta_chunk_count) == ("delta", 1, 1)
    assert (record.lossy, record.max_abs_error) == (True, 0.5)
    assert record.codec == "gradpipe_delta:int,x"


def test_empty_and_all_zero_tensors() -> None:
    empty = TensorManifest("float32", (0,), (0,), (), ())
    record = tensor_stats(empty, BlockLedger({}), [])
    assert math.isnan(record.ratio)
    assert math.isnan(record.density)
    assert math.isnan(record.max_abs)
    assert record.codec == "none"
    zeros = _manifest(np.zeros(8, np.float32), chunk=4)
    record = tensor_stats(zeros, BlockLedger({}), [None, None])
    assert (record.stored_bytes, record.ratio, record.density) == (0, math.inf, 0.0)
    assert record.zero_chunk_fraction == 1.0


def test_codec_names_must_match_the_chunks() -> None:
    manifest = _manifest(np.ones(8, np.float32), chunk=4)
    with pytest.raises(ValueError, match="2 chunks"):
        tensor_stats(manifest, BlockLedger({}), ["x"])


def test_derived_figures_of_sums_are_ratios_of_sums() -> None:
    raw = np.array([100.0, 300.0, 0.0])
    stored = np.array([50.0, 50.0, 0.0])
    np.testing.assert_array_equal(ratio(raw, stored)[:2], [2.0, 6.0])
    assert math.isnan(ratio(raw, stored)[2])
    assert ratio(raw.sum(), stored.sum()) == 4.0  # not 2 + 6
    assert bits_per_value(4.0, 8.0) == 4.0
    assert math.isnan(fraction(0.0, 0.0))
    assert l2_norm(9.0) == 3.0


def test_records_are_frozen() -> None:
    manifest = _manifest(np.ones(4, np.float32), chunk=4)
    record: TensorStats = tensor_stats(manifest, BlockLedger({}), ["x"])
    with pytest.raises(AttributeError):
        record.numel = 3  # type: ignore[misc]
