"""Checks of the inputs of an aggregation: peers, weights, chunks, Byzantine counts.

Every aggregation function calls these before it computes anything, so a bad
input fails with one :class:`~gradpipe.errors.InvalidInputError` that says
what was wrong and where (step, peer, tensor, when the caller names them),
and never as a NaN in a stored aggregate.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from decimal import Decimal, InvalidOperation

import numpy as np

from gradpipe.core.display import printable
from gradpipe.errors import InvalidInputError

__all__ = [
    "check_byzantine",
    "check_peer_chunks",
    "parse_weight_text",
    "parse_weights",
    "where",
]


def where(*, step: int | None = None, peer: str | None = None, tensor: str | None = None) -> str:
    """``"step 7, peer 'a', tensor 'w'"`` from the parts that are known ('' if none)."""
    parts = []
    if step is not None:
        parts.append(f"step {step}")
    if peer is not None:
        parts.append(f"peer {printable(peer)}")
    if tensor is not None:
        parts.append(f"tensor {printable(tensor)}")
    return ", ".join(parts)


def _prefix(context: str) -> str:
    return f"{context}: " if context else ""


def _peer_name(peers: Sequence[str] | None, index: int) -> str:
    return peers[index] if peers is not None and index < len(peers) else f"#{index}"


def parse_weights(
    weights: Sequence[float],
    *,
    step: int | None = None,
    peers: Sequence[str] | None = None,
) -> tuple[float, ...]:
    """Peer weights as floats: at least one, each finite and > 0.

    >>> parse_weights([3, 1])
    (3.0, 1.0)
    """
    context = where(step=step)
    values = []
    for i, w in enumerate(weights):
        try:
            values.append(float(w))
        except (TypeError, ValueError, OverflowError):
            peer = _peer_name(peers, i)
            raise InvalidInputError(
                f"{_prefix(where(step=step, peer=peer))}weight {_shown(repr(w))} is not a "
                "float64 number "
                "> 0 (at most 1.8e308); fix the peer's num_examples or the weights given"
            ) from None
    if not values:
        raise InvalidInputError(f"{_prefix(context)}no peers to aggregate (empty peer set)")
    if peers is not None and len(peers) != len(values):
        raise InvalidInputError(
            f"{_prefix(context)}{len(values)} weights for {len(peers)} peers; give one per peer"
        )
    for i, w in enumerate(values):
        if not math.isfinite(w) or w <= 0:
            peer = _peer_name(peers, i)
            raise InvalidInputError(
                f"{_prefix(where(step=step, peer=peer))}weight {w!r} is not a finite number "
                "> 0; fix the peer's num_examples or the weights given"
            )
    return tuple(values)


def _shown(text: str) -> str:
    """``text``, shortened in the middle when long (a 400-digit number)."""
    return text if len(text) <= 40 else f"{text[:20]}...{text[-10:]}"


def parse_weight_text(text: str, *, what: str = "weight") -> float:
    """A weight written as text (``num_examples`` metadata, ``--weights`` JSON) as a float64.

    Numbers outside float64's range are refused by what was written, not by
    the 0 or infinity they would read as. The value is checked further by
    :func:`parse_weights`. ``what`` names the number in errors.

    >>> parse_weight_text("1e-320")
    1e-320
    """
    shown = repr(_shown(text))
    try:
        exact = Decimal(text.strip())
    except InvalidOperation:
        raise InvalidInputError(f"{what} {shown} is not a number") from None
    if exact.is_nan():  # NaN and sNaN (float() of a signalling NaN raises ValueError)
        raise InvalidInputError(f"{what} {shown} is not a number")
    value = float(exact)
    if exact.is_finite() and exact > 0 and (value == 0.0 or math.isinf(value)):
        raise InvalidInputError(
            f"{what} {shown} is outside float64's range of positive numbers (5e-324 to "
            "1.8e308); scale the weights of the step alike"
        )
    return value


def check_peer_chunks(
    chunks: Sequence[np.ndarray],
    *,
    step: int | None = None,
    peers: Sequence[str] | None = None,
    tensor: str | None = None,
    allow_nan: bool = False,
) -> None:
    """One chunk per peer, all of one shape and float dtype, without NaN or infinity."""
    if not chunks:
        raise InvalidInputError(
            f"{_prefix(where(step=step, tensor=tensor))}no peers to aggregate (empty peer set)"
        )
    if peers is not None and len(peers) != len(chunks):
        raise InvalidInputError(
            f"{_prefix(where(step=step, tensor=tensor))}{len(chunks)} chunks for {len(peers)} peers"
        )
    first = chunks[0]
    for i, chunk in enumerate(chunks):
        context = where(step=step, peer=_peer_name(peers, i), tensor=tensor)
        if chunk.dtype.kind != "f" and chunk.dtype.name != "bfloat16":
            raise InvalidInputError(
                f"{context}: dtype {chunk.dtype} cannot be averaged; aggregation needs floats"
            )
        if chunk.shape != first.shape or chunk.dtype != first.dtype:
            raise InvalidInputError(
                f"{context}: {chunk.dtype}{list(chunk.shape)} differs from peer "
                f"{printable(_peer_name(peers, 0))}'s {first.dtype}{list(first.shape)}; every peer "
                "must send the tensor with one shape and dtype"
            )
        if not allow_nan and not np.isfinite(chunk).all():
            raise InvalidInputError(
                f"{context}: the update holds NaN or infinity; drop the peer or fix its dump"
            )


def check_byzantine(
    n: int, f: int, *, method: str, keep: int | None = None, step: int | None = None
) -> None:
    """Enough peers for ``method`` to tolerate ``f`` Byzantine peers.

    Krum and Multi-Krum need ``n >= 2f + 3`` (Blanchard et al. 2017: every
    score sums ``n - f - 2 >= 1`` distances); Bulyan needs ``n >= 4f + 3``
    (El Mhamdi et al. 2018). Multi-Krum keeps ``1 <= m <= n`` peers.
    """
    context = _prefix(where(step=step))
    factor = {"krum": 2, "multi-krum": 2, "bulyan": 4}.get(method)
    if factor is None:  # first: the messages below name the method as it is
        raise InvalidInputError(f"{context}unknown Byzantine-robust method {printable(method)}")
    if isinstance(f, bool) or not isinstance(f, int) or f < 0:
        raise InvalidInputError(
            f"{context}{method}: the Byzantine count f={printable(f)} must be >= 0"
        )
    need = factor * f + 3
    if n < need:
        raise InvalidInputError(
            f"{context}{method} with f={f} needs at least {need} peers, got {n}; "
            "assume fewer Byzantine peers (a lower f) or wait for more peers"
        )
    if keep is not None and not 1 <= keep <= n:
        raise InvalidInputError(f"{context}{method}: keep={keep} must be between 1 and {n}")
