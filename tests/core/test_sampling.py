"""The stratified sample: deterministic given the seed, every tensor its share, steps and peers
covered evenly, no chunk twice."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradpipe.errors import InvalidInputError
from gradpipe.evaluation.sampling import order_dumps, parse_sample_size, sample_units

DUMPS = [(s, p) for s in range(10) for p in ("a", "b", "c")]
#: One huge tensor, a medium one, and tiny ones, as in a transformer's dump.
CHUNKS = {d: {"embedding": 200, "dense": 8, "bias": 1, "norm": 1} for d in DUMPS}


def test_dump_order_covers_steps_then_peers_in_turn() -> None:
    order = order_dumps(DUMPS, seed=0)
    assert sorted(order) == sorted(DUMPS)
    assert {s for s, _ in order[:10]} == set(range(10))  # one dump of every step first
    assert Counter(p for _, p in order[:9]) == {"a": 3, "b": 3, "c": 3}
    assert order == order_dumps(DUMPS, seed=0)
    assert order != order_dumps(DUMPS, seed=1)
    # Steps where some peers are missing.
    ragged = [(0, "a"), (1, "a"), (1, "b"), (2, "c")]
    assert sorted(order_dumps(ragged, seed=4)) == ragged


def test_every_tensor_gets_its_share_whatever_its_size() -> None:
    units = sample_units(order_dumps(DUMPS, 0), CHUNKS, 40, seed=0)
    assert len(units) == len(set(units)) == 40
    assert Counter(u.tensor for u in units) == {
        "embedding": 10,
        "dense": 10,
        "bias": 10,
        "norm": 10,
    }
    # Tiny tensors have one chunk per dump: their 10 picks are 10 different dumps.
    assert len({(u.step, u.peer) for u in units if u.tensor == "bias"}) == 10
    steps = Counter(u.step for u in units)
    assert set(steps) == set(range(10))
    assert max(steps.values()) - min(steps.values()) <= 2
    peers = Counter(u.peer for u in units)
    assert max(peers.values()) - min(peers.values()) <= 4
    assert units == sorted(units)


def test_a_tensor_that_runs_out_leaves_its_share_to_the_others() -> None:
    chunks = {(0, "a"): {"big": 50, "one": 1}, (1, "a"): {"big": 50, "one": 1}}
    units = sample_units([(0, "a"), (1, "a")], chunks, 10, seed=2)
    assert Counter(u.tensor for u in units) == {"big": 8, "one": 2}
    every = sample_units([(0, "a"), (1, "a")], chunks, 1000, seed=2)
    assert len(every) == 102
    assert sample_units([(0, "a")], {(0, "a"): {"empty": 0}}, 5, seed=0) == []


@given(st.integers(0, 2**32), st.integers(1, 60))
@settings(max_examples=50, deadline=None)
def test_the_sample_is_a_function_of_the_seed(seed: int, n: int) -> None:
    order = order_dumps(DUMPS, seed)
    first = sample_units(order, CHUNKS, n, seed)
    assert first == sample_units(order_dumps(DUMPS, seed), CHUNKS, n, seed)
    assert len(first) == len(set(first)) == n
    for u in first:
        assert 0 <= u.chunk < CHUNKS[(u.step, u.peer)][u.tensor]
    shares = Counter(u.tensor for u in first).values()
    assert max(shares) - min(shares) <= 1


def test_sample_size_is_checked() -> None:
    for bad in (0, -1, 1.5, True, "3"):
        with pytest.raises(InvalidInputError, match="whole number of chunks"):
            parse_sample_size(bad)
    assert parse_sample_size(7) == 7
