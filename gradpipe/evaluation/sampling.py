"""A seeded sample of a run's stored chunks, stratified so that no tensor is drowned.

A run of 105 tensors whose largest holds 40% of the bytes would, sampled by
bytes or by chunk, give the embedding most of the sample and the bias vectors
none. The sample here is drawn in two stages, both deterministic given the
seed:

1. :func:`order_dumps` puts the run's dumps in an order whose every prefix
   spreads over the steps evenly (steps in a seeded order, one dump of each
   before a second of any) and over the peers in turn (each step's peers
   rotated by the step's position); the evaluation reads the manifests of
   the first ``n`` dumps of that order only.
2. :func:`sample_units` then gives the tensors the sample in turn (every
   tensor the same number of chunks, in a seeded order of tensors, until a
   tensor runs out of chunks), each tensor's picks going round the dumps from
   an offset of its own (so together they cover the dumps evenly) and taking,
   in each dump, its chunks in a seeded order.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from gradpipe.core.display import printable
from gradpipe.core.ids import hash_bytes
from gradpipe.errors import InvalidInputError

__all__ = ["Unit", "order_dumps", "parse_sample_size", "sample_units"]

#: Streams of the seeded generators, one per use, so one never shifts another.
_STEPS, _TENSORS, _CHUNKS = 0, 1, 2


@dataclass(frozen=True, slots=True, order=True)
class Unit:
    """One sampled chunk: chunk ``chunk`` of tensor ``tensor`` of the dump of (step, peer)."""

    step: int
    peer: str
    tensor: str
    chunk: int

    def describe(self) -> str:
        """``tensor 'w' of step 3, peer 'a', chunk 0`` (for messages)."""
        return (
            f"tensor {printable(self.tensor)} of step {self.step}, peer "
            f"{printable(self.peer)}, chunk {self.chunk}"
        )


def parse_sample_size(value: object) -> int:
    """A sample size: a whole number of chunks, at least 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidInputError(
            f"sample must be a whole number of chunks >= 1, not {printable(value)}"
        )
    return value


def order_dumps(dumps: Sequence[tuple[int, str]], seed: int) -> list[tuple[int, str]]:
    """Every (step, peer) once, in an order whose prefixes cover steps and peers evenly.

    >>> order_dumps([(0, "a"), (0, "b"), (1, "a"), (1, "b")], seed=0)[:2] in (
    ...     [(0, "a"), (1, "b")], [(1, "a"), (0, "b")])
    True
    """
    by_step: dict[int, list[str]] = {}
    for step, peer in dumps:
        by_step.setdefault(step, []).append(peer)
    peers = sorted({peer for _, peer in dumps})
    rank = {peer: i for i, peer in enumerate(peers)}
    steps = sorted(by_step)
    rng = np.random.default_rng([seed, _STEPS])
    shuffled = [steps[i] for i in rng.permutation(len(steps))]
    columns = []
    for position, step in enumerate(shuffled):
        # Rotate so the k-th step in the order starts at the k-th peer.
        turn = sorted(by_step[step], key=lambda p: (rank[p] - position) % len(peers))
        columns.append([(step, peer) for peer in turn])
    out: list[tuple[int, str]] = []
    for r in range(max((len(c) for c in columns), default=0)):
        out.extend(column[r] for column in columns if r < len(column))
    return out


def sample_units(
    dumps: Sequence[tuple[int, str]],
    chunks: Mapping[tuple[int, str], Mapping[str, int]],
    n: int,
    seed: int,
) -> list[Unit]:
    """Up to ``n`` chunks, tensors in turn (see the module), sorted by (step, peer, tensor, chunk).

    Parameters
    ----------
    dumps : sequence of (step, peer)
        The dumps to draw from, in the order to go round them (:func:`order_dumps`).
    chunks : mapping
        ``chunks[(step, peer)][tensor]``: how many chunks each tensor of each dump has.
    n : int
        How many chunks to draw; fewer when the dumps hold fewer.
    seed : int
        Seed of the order of tensors and of chunks.

    Examples
    --------
    >>> units = sample_units([(0, "a")], {(0, "a"): {"big": 100, "bias": 1}}, 4, seed=0)
    >>> sorted({u.tensor for u in units}), len(units)
    (['bias', 'big'], 4)
    """
    parse_sample_size(n)
    names = sorted({t for d in dumps for t, count in chunks.get(d, {}).items() if count > 0})
    rng = np.random.default_rng([seed, _TENSORS])
    order = [names[i] for i in rng.permutation(len(names))]
    streams = {
        name: _tensor_stream(dumps, chunks, name, offset, seed) for offset, name in enumerate(order)
    }
    picked: list[Unit] = []
    live = list(order)
    while live and len(picked) < n:
        for name in list(live):
            if len(picked) == n:
                break
            unit = next(streams[name], None)
            if unit is None:
                live.remove(name)
            else:
                picked.append(unit)
    return sorted(picked)


def _tensor_stream(
    dumps: Sequence[tuple[int, str]],
    chunks: Mapping[tuple[int, str], Mapping[str, int]],
    name: str,
    offset: int,
    seed: int,
) -> Iterator[Unit]:
    """One tensor's chunks: round ``r`` takes the ``r``-th chunk (seeded order) of each dump."""
    holding = [(i, d) for i, d in enumerate(dumps) if chunks.get(d, {}).get(name, 0) > 0]
    if not holding:
        return
    start = offset % len(holding)
    turn = holding[start:] + holding[:start]
    tensor_key = int(hash_bytes(name.encode())[-15:], 16)  # the same for a name in any run
    perms = {
        i: np.random.default_rng([seed, _CHUNKS, i, tensor_key]).permutation(chunks[d][name])
        for i, d in turn
    }
    for r in range(max(len(p) for p in perms.values())):
        for i, (step, peer) in turn:
            if r < len(perms[i]):
                yield Unit(step, peer, name, int(perms[i][r]))
