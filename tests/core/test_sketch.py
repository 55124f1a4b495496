"""The sign sketch is the matrix it documents, adds up over any grid and has the stated variance."""

from __future__ import annotations

import hashlib
import itertools

import numpy as np
import pytest

from gradpipe.core.sketch import (
    MAX_K,
    MAX_S,
    SKETCH_BLOCK,
    dense_matrix,
    parse_sketch_size,
    sign_sketch,
    sign_sketch_many,
)
from gradpipe.errors import InvalidInputError


def _reference_entry(seed: int, tensor: str, i: int, j: int, *, k: int, s: int) -> tuple[int, int]:
    """``(row, sign)`` of element ``i`` in block ``j``, read off the module docstring's layout.

    Draws the whole counter block, so it also checks that a chunk's jump into
    the middle of a block lands on the same words.
    """
    message = f"{seed}\x00{tensor}".encode()
    key = hashlib.blake2b(message, digest_size=16, person=b"gradpipe.sketch").digest()
    words = (s + 1) // 2
    block, place = divmod(i, SKETCH_BLOCK)
    bitgen = np.random.Philox(key=int.from_bytes(key, "little"), counter=block << 128)
    word = int(bitgen.random_raw(SKETCH_BLOCK * words)[place * words + j // 2])
    half = (word >> (32 * (j % 2))) & 0xFFFFFFFF
    m = k // s
    return j * m + ((half & 0x7FFFFFFF) * m >> 31), -1 if half >> 31 else 1


@pytest.mark.parametrize(("k", "s"), [(8, 1), (24, 3), (20, 4), (35, 5)])
def test_draws_follow_the_documented_layout(k: int, s: int) -> None:
    for i in [0, 7, 8, SKETCH_BLOCK - 1, SKETCH_BLOCK, 3 * SKETCH_BLOCK + 11]:
        # A one-element chunk is column i of P.
        column = sign_sketch(np.ones(1), seed=11, tensor="layer.w", offset=i, k=k, s=s)
        expected = np.zeros(k)
        for j in range(s):
            row, sign = _reference_entry(11, "layer.w", i, j, k=k, s=s)
            expected[row] = sign / np.sqrt(s)
        assert np.array_equal(column, expected)


def test_golden_matrix() -> None:
    # Stored projections depend on these draws: a change here needs a new memo version.
    p = dense_matrix(6, seed=0, tensor="w", k=6, s=3) * np.sqrt(3)
    rows = [[1, 3, 4], [0, 3, 5], [0, 2, 4], [0, 3, 4], [1, 2, 4], [1, 2, 4]]
    signs = [[1, -1, -1], [-1, -1, -1], [1, -1, 1], [1, 1, 1], [-1, -1, 1], [-1, -1, -1]]
    expected = np.zeros((6, 6))
    for column, (r, sign) in enumerate(zip(rows, signs, strict=True)):
        expected[r, column] = sign
    assert np.array_equal(np.round(p), expected)


@pytest.mark.parametrize(("d", "k", "s"), [(4096, 256, 4), (70_001, 16, 2), (70_001, 15, 3)])
def test_sketch_equals_the_dense_matrix(d: int, k: int, s: int) -> None:
    x = np.random.default_rng(d + k).standard_normal(d)
    p = dense_matrix(d, seed=5, tensor="emb", k=k, s=s)
    got = sign_sketch(x, seed=5, tensor="emb", offset=0, k=k, s=s)
    # Each row is a sum of at most d terms: rounding is relative to their magnitudes.
    bound = 1e-12 * (np.abs(p) @ np.abs(x))
    assert np.all(np.abs(got - p @ x) <= bound)
    for column in (0, d // 2, d - 1):
        for block in range(s):
            entries = p[block * (k // s) : (block + 1) * (k // s), column]
            assert np.count_nonzero(entries) == 1
            assert np.abs(entries).max() == 1 / np.sqrt(s)


@pytest.mark.parametrize(("k", "s"), [(64, 4), (63, 3)])
def test_chunks_add_up_to_the_whole(k: int, s: int) -> None:
    rng = np.random.default_rng(k)
    d = 3 * SKETCH_BLOCK + 1234
    x = rng.standard_normal(d).astype(np.float32)
    whole = sign_sketch(x, seed=2, tensor="w", offset=0, k=k, s=s)
    cuts = {1, 2, 3, SKETCH_BLOCK - 1, SKETCH_BLOCK, 2 * SKETCH_BLOCK + 1}
    cuts |= set(rng.integers(1, d, 12).tolist())
    bounds = [0, *sorted(cuts), d]
    total = np.zeros(k)
    for lo, hi in itertools.pairwise(bounds):
        sign_sketch(x[lo:hi], seed=2, tensor="w", offset=lo, k=k, s=s, out=total)
    assert np.all(np.abs(total - whole) <= 1e-12 * np.abs(x.astype(np.float64)).sum())
    assert not np.array_equal(whole, np.zeros(k))


def test_shapes_and_dtypes_of_a_chunk() -> None:
    x = np.arange(24, dtype=np.int32).reshape(2, 3, 4)
    flat = sign_sketch(x.astype(np.float64).ravel(), seed=1, tensor="w", offset=9, k=8, s=2)
    assert np.array_equal(sign_sketch(x, seed=1, tensor="w", offset=9, k=8, s=2), flat)
    assert np.array_equal(
        sign_sketch(x[..., ::-1].copy()[..., ::-1], seed=1, tensor="w", offset=9, k=8, s=2), flat
    )


def test_identical_inputs_give_identical_bits() -> None:
    x = np.random.default_rng(0).standard_normal(100_000)
    a = sign_sketch(x, seed=3, tensor="w", offset=12_345, k=128, s=4)
    b = sign_sketch(x.copy(), seed=3, tensor="w", offset=12_345, k=128, s=4)
    assert a.tobytes() == b.tobytes()


def test_seed_and_tensor_choose_the_matrix() -> None:
    base = dense_matrix(100, seed=1, tensor="w", k=16, s=4)
    assert not np.array_equal(base, dense_matrix(100, seed=2, tensor="w", k=16, s=4))
    assert not np.array_equal(base, dense_matrix(100, seed=1, tensor="b", k=16, s=4))


def test_many_equals_one_at_a_time() -> None:
    xs = np.random.default_rng(1).standard_normal((5, 2, 40_000)).astype(np.float32)
    offset = SKETCH_BLOCK - 17
    many = sign_sketch_many(xs, seed=4, tensor="w", offset=offset, k=32, s=4)
    assert many.shape == (5, 32)
    for q in range(5):
        one = sign_sketch(xs[q], seed=4, tensor="w", offset=offset, k=32, s=4)
        assert many[q].tobytes() == one.tobytes()


def test_out_accumulates() -> None:
    x = np.random.default_rng(2).standard_normal(1000)
    fresh = sign_sketch(x, seed=1, tensor="w", offset=0, k=16)
    out = np.full(16, 1.5)
    assert sign_sketch(x, seed=1, tensor="w", offset=0, k=16, out=out) is out
    assert np.array_equal(out, 1.5 + fresh)
    outs = np.ones((2, 16))
    assert sign_sketch_many(np.stack([x, x]), seed=1, tensor="w", offset=0, k=16, out=outs) is outs
    assert np.array_equal(outs, 1.0 + np.stack([fresh, fresh]))


def test_empty_chunks_project_to_zero() -> None:
    assert np.array_equal(sign_sketch(np.zeros(0), seed=1, tensor="w", offset=5, k=8), np.zeros(8))
    many = sign_sketch_many(np.zeros((0, 10)), seed=1, tensor="w", offset=0, k=8)
    assert many.shape == (0, 8)
    assert dense_matrix(0, seed=1, tensor="w", k=8).shape == (8, 0)


@pytest.mark.parametrize(("k", "s"), [(16, 1), (24, 4), (64, 64)])
def test_unbiased_with_the_stated_variance(k: int, s: int) -> None:
    rng = np.random.default_rng(3)
    d = 32
    # A few large entries, so the Σ x_i² y_i² term of the variance weighs (~27% of it).
    spikes = np.where(np.arange(d) < 4, 4.0, 1.0)
    x = rng.standard_normal(d) * spikes
    y = 0.6 * x + rng.standard_normal(d) * spikes
    exact = float(x @ y)
    variance = ((x @ x) * (y @ y) + exact**2 - 2 * np.sum(x**2 * y**2)) / k
    errors = []
    for seed in range(200):
        for tensor in "abcdefghij":
            px, py = sign_sketch_many(
                np.stack([x, y]), seed=seed, tensor=tensor, offset=0, k=k, s=s
            )
            errors.append(px @ py - exact)
    sample = np.array(errors)
    assert abs(sample.mean()) <= 4 * np.sqrt(variance / sample.size)
    assert abs(sample.var(ddof=1) / variance - 1) <= 0.15


def test_parse_sketch_size() -> None:
    assert parse_sketch_size(MAX_K, MAX_S) == (MAX_K, MAX_S)
    # numpy integers are integers: a size read from an array is fine.
    size: int = np.int64(12)  # type: ignore[assignment]
    assert parse_sketch_size(size, 3) == (12, 3)


@pytest.mark.parametrize(
    ("k", "s", "match"),
    [
        (0, 1, "k=0"),
        (MAX_K + 1, 1, "k="),
        (8, 0, "s=0"),
        (130, 65, "s=65"),
        (10, 4, "divide"),
        (True, 1, "integer"),
        (8.0, 2, "integer"),
    ],
)
def test_bad_sizes_are_refused(k: object, s: object, match: str) -> None:
    with pytest.raises(InvalidInputError, match=match):
        sign_sketch(np.ones(3), seed=1, tensor="w", offset=0, k=k, s=s)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("values", "kwargs", "match"),
    [
        (np.ones(3, dtype=complex), {}, "integer or float"),
        (np.ones(3, dtype=bool), {}, "integer or float"),
        (np.ones(3), {"offset": -1}, "out of range"),
        (np.ones(3), {"offset": 2**63 - 2}, "out of range"),
        (np.ones(3), {"seed": "1"}, "seed"),
        (np.ones(3), {"tensor": 1}, "tensor name"),
        (np.ones(3), {"out": np.zeros(7)}, "shape"),
        (np.ones(3), {"out": np.zeros(8, dtype=np.float32)}, "float64"),
        (np.ones(3), {"out": np.broadcast_to(np.zeros(1), (8,))}, "writable"),
    ],
)
def test_bad_arguments_are_refused(
    values: np.ndarray, kwargs: dict[str, object], match: str
) -> None:
    arguments: dict[str, object] = {"seed": 1, "tensor": "w", "offset": 0, "k": 8, **kwargs}
    with pytest.raises(InvalidInputError, match=match):
        sign_sketch(values, **arguments)  # type: ignore[arg-type]


def test_many_needs_an_example_axis() -> None:
    scalar: np.ndarray = np.asarray(1.0)
    with pytest.raises(InvalidInputError, match="example axis"):
        sign_sketch_many(scalar, seed=1, tensor="w", offset=0, k=8)
    with pytest.raises(InvalidInputError, match="shape"):
        sign_sketch_many(np.ones((2, 3)), seed=1, tensor="w", offset=0, k=8, out=np.zeros((3, 8)))


@pytest.mark.parametrize("d", [-1, 2**26 // 8 + 1])
def test_dense_matrix_refuses_bad_sizes(d: int) -> None:
    with pytest.raises(InvalidInputError, match="dense"):
        dense_matrix(d, seed=1, tensor="w", k=8)
