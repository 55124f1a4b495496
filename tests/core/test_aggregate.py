"""Sum, mean, weighted mean, FedAvg: against float64 references and Flower, and any grouping."""

from __future__ import annotations

import itertools
import pickle
import random
from functools import cache

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradpipe.aggregation.kernel import BLOCK
from gradpipe.aggregation.reduce import (
    AggregationMethod,
    Partial,
    combine,
    finish,
    partial,
    partial_of,
    reduce_peers,
)
from gradpipe.errors import InvalidInputError
from gradpipe.testing.transformer import TransformerConfig, train_transformer

aggregate_mod = pytest.importorskip("flwr.server.strategy.aggregate")

EPS32 = float(np.finfo(np.float32).eps)


def _peers(n: int, size: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    scales = 10.0 ** rng.uniform(-3, 2, size=n)  # peers of very different magnitudes
    return [(rng.standard_normal(size) * s).astype(np.float32) for s in scales]


def _reference(chunks: list[np.ndarray], weights: list[float], divide: bool) -> np.ndarray:
    """The float64 weighted sum, written independently: exact products, math.fsum per element."""
    import math

    stacked = np.stack([c.astype(np.float64) * w for c, w in zip(chunks, weights, strict=True)])
    out = np.array([math.fsum(col) for col in stacked.reshape(len(chunks), -1).T])
    out = out.reshape(chunks[0].shape)
    return out / math.fsum(weights) if divide else out


def _within_one_ulp32(ours: np.ndarray, ref64: np.ndarray) -> None:
    # Ours is the float32 rounding of a float64 pairwise sum whose error is <= log2(n)·ε64·Σ|t|,
    # some 2**-29 of a float32 ulp for these magnitudes: the result is the correctly rounded
    # float32 of the exact value or its neighbour. One float32 ulp of the exact value bounds it.
    ulp = np.spacing(np.abs(ref64).astype(np.float32)).astype(np.float64)
    assert (np.abs(ours.astype(np.float64) - ref64) <= ulp).all()


@pytest.mark.parametrize("n", [1, 2, 3, 7, 8, 13])
@pytest.mark.parametrize("method", ["sum", "mean", "weighted-mean", "fedavg"])
def test_reducible_methods_match_a_float64_reference(n: int, method: str) -> None:
    chunks = _peers(n, 513, seed=n)
    weighted = method in ("weighted-mean", "fedavg")
    weights = [float(w) for w in range(3, 3 + n)] if weighted else [1.0] * n
    ours = reduce_peers(chunks, method=method, weights=weights if weighted else None)
    assert ours.dtype == np.float32
    _within_one_ulp32(ours, _reference(chunks, weights, divide=method != "sum"))


def test_fedavg_matches_flower_within_the_float32_accumulation_bound() -> None:
    n = 9
    chunks = _peers(n, 2000, seed=3)
    weights = [5, 1, 7, 2, 2, 9, 4, 3, 8]
    ours = reduce_peers(chunks, weights=weights)
    (flower,) = aggregate_mod.aggregate([([c], w) for c, w in zip(chunks, weights, strict=True)])
    # Flower accumulates w·x in float32, one rounding per add: |Δ| <= 2·n·ε32·max|x|
    # bounds both its error and (far more loosely) ours.
    bound = 2 * n * EPS32 * max(float(np.abs(c).max()) for c in chunks)
    assert np.abs(ours.astype(np.float64) - flower.astype(np.float64)).max() <= bound


@cache
def _transformer_grads() -> tuple[dict[str, list[np.ndarray]], list[int]]:
    config = TransformerConfig.tiny(peers=5, steps=1)
    (step,) = train_transformer(config, backend="numpy")
    names = list(step.gradients[config.peer_names[0]])
    grads = {k: [step.gradients[p][k] for p in config.peer_names] for k in names}
    return grads, [3, 1, 4, 1, 5]


def test_fedavg_on_transformer_gradients() -> None:
    grads, weights = _transformer_grads()
    for name, chunks in grads.items():
        ours = reduce_peers(chunks, weights=weights, tensor=name)
        _within_one_ulp32(ours, _reference(chunks, [float(w) for w in weights], divide=True))
        (flower,) = aggregate_mod.aggregate(
            [([c], w) for c, w in zip(chunks, weights, strict=True)]
        )
        bound = 2 * len(chunks) * EPS32 * max(float(np.abs(c).max()) for c in chunks)
        assert np.abs(ours.astype(np.float64) - flower).max() <= bound, name


def test_chunking_does_not_change_a_bit() -> None:
    grads, weights = _transformer_grads()
    chunks = [c.reshape(-1) for c in grads["encoder.layer.0.intermediate.dense.weight"]]
    whole = reduce_peers(chunks, weights=weights)
    size = chunks[0].size
    for step in (1, 7, 100, size):
        pieces = [
            reduce_peers([c[i : i + step] for c in chunks], weights=weights)
            for i in range(0, size, step)
        ]
        assert np.concatenate(pieces).tobytes() == whole.tobytes()


def _random_groups(n: int, rng: random.Random) -> list[list[int]]:
    cuts = sorted(rng.sample(range(1, n), rng.randint(0, n - 1))) if n > 1 else []
    bounds = [0, *cuts, n]
    return [list(range(a, b)) for a, b in itertools.pairwise(bounds)]


def _tree(leaves: list[Partial], rng: random.Random) -> Partial:
    """Combine by a random tree of random fan-in, partials handed over in a shuffled order."""
    level = leaves
    while len(level) > 1:
        groups = _random_groups(len(level), rng)
        nxt = []
        for g in groups:
            members = [level[i] for i in g]
            rng.shuffle(members)
            nxt.append(combine(members))
        level = nxt
    return level[0]


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 40), seed=st.integers(0, 2**32 - 1))
def test_any_tree_gives_bit_identical_results(n: int, seed: int) -> None:
    rng = random.Random(seed)
    chunks = _peers(n, 64, seed=seed % 1000)
    weights = [float(rng.randint(1, 1000)) for _ in range(n)]
    reference = reduce_peers(chunks, weights=weights)
    leaves = [
        partial(c, peer=i, weight=w) for i, (c, w) in enumerate(zip(chunks, weights, strict=True))
    ]
    for _ in range(3):
        state = _tree(leaves, rng)
        assert state.weight == sum(weights)  # integer weights: exact in any order
        assert finish(state, peers=n).tobytes() == reference.tobytes()
        assert (
            finish(state, method="sum", peers=n).tobytes()
            == reduce_peers(chunks, method="sum", weights=weights).tobytes()
        )


def test_a_power_of_two_fan_in_keeps_one_array_per_partial() -> None:
    chunks = _peers(16, 8)
    leaves = [partial(c, peer=i) for i, c in enumerate(chunks)]
    fours = [combine(leaves[i : i + 4]) for i in range(0, 16, 4)]
    assert all(len(p.blocks) == 1 for p in fours)
    odd = combine(leaves[1:12])  # [1,2) [2,4) [4,8) [8,12)
    assert [(b.lo, b.size) for b in odd.blocks] == [(1, 1), (2, 2), (4, 4), (8, 4)]


def test_the_tree_sum_is_the_pairwise_sum_the_docstring_defines() -> None:
    # n = 5: ((x0 + x1) + (x2 + x3)) + x4, in float64, then one rounding.
    x = [np.array([v], dtype=np.float64) for v in (1e16, 1.0, -1e16, 1.0, 3.0)]
    out = reduce_peers(x, method="sum")
    assert out[0] == ((1e16 + 1.0) + (-1e16 + 1.0)) + 3.0


def test_partials_pickle_and_do_not_alias_their_input() -> None:
    chunk = np.arange(4, dtype=np.float64)
    leaf = partial(chunk, peer=0)
    chunk[0] = 99.0
    copy = pickle.loads(pickle.dumps(leaf))
    assert finish(copy, method="sum").tolist() == [0.0, 1.0, 2.0, 3.0]


def test_inputs_of_combine_are_not_written() -> None:
    chunks = _peers(4, 16)
    leaves = [partial(c, peer=i) for i, c in enumerate(chunks)]
    before = [leaf.blocks[0].total.copy() for leaf in leaves]
    combine([combine(leaves[:2]), combine(leaves[2:])])
    assert all((leaf.blocks[0].total == b).all() for leaf, b in zip(leaves, before, strict=True))


def test_dtype_and_noise_in_finish() -> None:
    chunks = [np.array([1.0, 2.0], np.float32), np.array([3.0, 4.0], np.float32)]
    state = combine([partial(c, peer=i) for i, c in enumerate(chunks)])
    assert finish(state, method="mean", dtype="float64").dtype == np.float64
    noised = finish(state, method="mean", noise=np.array([0.5, -0.5]))
    assert noised.tolist() == [2.5, 2.5]


def test_aggregation_method_names() -> None:
    assert AggregationMethod("trimmed-mean") is AggregationMethod.TRIMMED_MEAN
    assert AggregationMethod.FEDAVG.reducible
    assert AggregationMethod.FEDAVG.divides
    assert AggregationMethod.SUM.reducible
    assert not AggregationMethod.SUM.divides
    assert not AggregationMethod.KRUM.reducible


@pytest.mark.parametrize("weight", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_weights_name_the_step_and_peer(weight: float) -> None:
    chunks = _peers(3, 4)
    with pytest.raises(InvalidInputError, match=r"step 7, peer 'b'.*weight"):
        reduce_peers(chunks, weights=[1.0, weight, 1.0], step=7, peers=["a", "b", "c"])


def test_bad_updates_name_step_peer_and_tensor() -> None:
    good = np.zeros(4, np.float32)
    bad = good.copy()
    bad[2] = np.nan
    with pytest.raises(InvalidInputError, match=r"step 1, peer 'q', tensor 'w'.*NaN"):
        reduce_peers([good, bad], step=1, peers=["p", "q"], tensor="w")
    with pytest.raises(InvalidInputError, match=r"peer 'q', tensor 'w'.*differs"):
        reduce_peers([good, np.zeros(5, np.float32)], step=1, peers=["p", "q"], tensor="w")
    with pytest.raises(InvalidInputError, match=r"peer 'q', tensor 'w'.*differs"):
        reduce_peers([good, np.zeros(4, np.float16)], step=1, peers=["p", "q"], tensor="w")
    with pytest.raises(InvalidInputError, match=r"step 1, tensor 'w': no peers"):
        reduce_peers([], step=1, tensor="w")
    with pytest.raises(InvalidInputError, match="cannot be averaged"):
        reduce_peers([np.zeros(2, np.int32)], peers=["p"])


def test_combine_refuses_gaps_overlaps_and_partial_finish() -> None:
    leaves = [partial(np.zeros(2), peer=i) for i in range(4)]
    with pytest.raises(InvalidInputError, match="adjacent"):
        combine([leaves[0], leaves[2]])
    with pytest.raises(InvalidInputError, match="adjacent"):
        combine([leaves[0], leaves[0]])
    with pytest.raises(InvalidInputError, match="finish needs"):
        finish(combine(leaves[:3]), peers=4)
    with pytest.raises(InvalidInputError, match="finish needs"):
        finish(combine(leaves[1:]))
    with pytest.raises(InvalidInputError, match="not a reducible"):
        finish(combine(leaves), method="median")


def _whole_array_tree(
    chunks: list[np.ndarray], coefficients: list[float], lo: int = 0
) -> list[tuple[int, int, np.ndarray]]:
    """The canonical forest of peers [lo, lo + n), written plainly on whole arrays: each
    term fl64(c * x), siblings added left + right as they meet (the module docstring)."""
    stack: list[tuple[int, int, np.ndarray]] = []
    for i, (chunk, c) in enumerate(zip(chunks, coefficients, strict=True)):
        stack.append((lo + i, 1, chunk.astype(np.float64) * c))
        while len(stack) >= 2:
            (a, n, left), (b, m, right) = stack[-2], stack[-1]
            if not (n == m and a % (2 * n) == 0 and a + n == b):
                break
            stack[-2:] = [(a, 2 * n, left + right)]
    return stack


def _whole_array_finish(forest: list[tuple[int, int, np.ndarray]], divisor: float) -> np.ndarray:
    total = forest[0][2]
    for _, _, block in forest[1:]:
        total = total + block
    return (total / divisor).astype(np.float32)


@pytest.mark.parametrize("size", [1, 5, BLOCK - 1, BLOCK, 2 * BLOCK + 17])
@pytest.mark.parametrize("n", [1, 2, 3, 6, 8, 11, 17])
def test_the_blocked_kernel_gives_the_bits_of_the_whole_array_tree(size: int, n: int) -> None:
    """Blocks of the kernel, block edges inside the chunk: every result, the same bits as the
    plain definition on whole arrays (peers of very different magnitudes, odd weights, scales)."""
    rng = np.random.default_rng(n * 1000 + size)
    chunks = _peers(n, size, seed=n + size)
    weights = [float(w) for w in rng.integers(1, 1000, n)]
    scales = [float(s) for s in rng.uniform(0.01, 1.0, n)]
    coefficients = [w * s for w, s in zip(weights, scales, strict=True)]
    forest = _whole_array_tree(chunks, coefficients)
    want = _whole_array_finish(forest, sum(weights))
    got = reduce_peers(chunks, weights=weights, scales=scales)
    assert got.tobytes() == want.tobytes()
    # Contiguous groups of the peers, computed by partial_of, then finished as a list.
    for group in (1, 3, 4, 8):
        parts = [
            partial_of(
                chunks[i : i + group],
                first=i,
                weights=weights[i : i + group],
                scales=scales[i : i + group],
            )
            for i in range(0, n, group)
        ]
        for part in parts:  # each group's forest, block by block, is the plain one
            plain = _whole_array_tree(
                chunks[part.lo : part.hi], coefficients[part.lo : part.hi], lo=part.lo
            )
            assert [(b.lo, b.size) for b in part.blocks] == [(a, m) for a, m, _ in plain]
            for block, (_, _, total) in zip(part.blocks, plain, strict=True):
                assert block.total.tobytes() == total.tobytes()
        assert finish(parts, peers=n).tobytes() == want.tobytes()
        assert finish(combine(parts), peers=n).tobytes() == want.tobytes()


def test_partial_of_an_unaligned_range_holds_its_canonical_forest() -> None:
    chunks = _peers(9, 100)
    state = partial_of(chunks, first=3)  # peers [3, 12): [3,4) [4,8) [8,12)
    assert [(b.lo, b.size) for b in state.blocks] == [(3, 1), (4, 4), (8, 4)]
    assert (state.lo, state.hi, state.weight) == (3, 12, 9.0)
    singles = combine([partial(c, peer=3 + i) for i, c in enumerate(chunks)])
    for ours, theirs in zip(state.blocks, singles.blocks, strict=True):
        assert ours.total.tobytes() == theirs.total.tobytes()


def test_finish_of_a_list_does_not_write_its_inputs() -> None:
    chunks = _peers(6, 2 * BLOCK + 1)
    parts = [partial_of(chunks[:4]), partial(chunks[4], peer=4), partial(chunks[5], peer=5)]
    before = [b.total.copy() for p in parts for b in p.blocks]
    finish(parts, method="sum")
    combine(parts)
    after = [b.total for p in parts for b in p.blocks]
    assert all((a == b).all() for a, b in zip(after, before, strict=True))


def test_a_nan_in_a_group_names_its_peer() -> None:
    chunks = _peers(5, 2 * BLOCK)
    chunks[3] = chunks[3].copy()
    chunks[3][BLOCK + 7] = np.inf
    with pytest.raises(InvalidInputError, match=r"peer 'd': the update holds NaN or infinity"):
        partial_of(chunks, names=["a", "b", "c", "d", "e"])
    with pytest.raises(InvalidInputError, match=r"peer #4: the update holds NaN"):
        partial_of(chunks[1:], first=2)
    with pytest.raises(InvalidInputError, match="overflows float64"):
        partial_of([np.full(3, 1e308), np.full(3, 1e308)])
