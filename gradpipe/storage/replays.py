"""One chunk of a snapshot version stored against an optimizer replay: predicted, rebuilt.

The writer and every reader predict a chunk with the same function,
:func:`predict_chunk`: the optimizer step (:func:`gradpipe.core.replay.replay`) on the
previous version's chunks of the parameter's state, the gradient's elements of the chunk
and the step's recorded scalars, with this version's moments known exactly when the
parameter itself is predicted (they are rebuilt first). :func:`rebuild_replay_chunk` then
checks the prediction against the id the writer recorded (a reader whose arithmetic drifted
says so: the stored blocks are intact) and applies the residual (docs/design/016).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from gradpipe.codecs.delta import DeltaCodec
from gradpipe.core.chain import ReplayLink
from gradpipe.core.dtypes import dtype_name, parse_dtype
from gradpipe.core.ids import hash_bytes
from gradpipe.core.replay import OptimizerStep, replay, scalars_from_json
from gradpipe.errors import IntegrityError

if TYPE_CHECKING:
    from gradpipe.storage.store import Store

__all__ = ["gradient_range", "predict_chunk", "rebuild_replay_chunk"]


def predict_chunk(
    step: OptimizerStep,
    scalars: Mapping[str, str],
    role: str,
    *,
    previous: Mapping[str, np.ndarray | None],
    grad: np.ndarray,
    known: Mapping[str, np.ndarray | None],
    dtype: np.dtype,
) -> np.ndarray:
    """The predicted values of one chunk of ``role`` (an array of ``dtype``).

    ``previous`` and ``known`` map roles to the chunk's values, None for an all-zero chunk
    (which takes no block); ``scalars`` are the step's, as recorded (hex bit patterns).
    """
    count = grad.size

    def values(chunk: np.ndarray | None) -> np.ndarray:
        return np.zeros(count, dtype=dtype) if chunk is None else chunk.view(dtype)

    before = {r: values(v) for r, v in previous.items()}
    exact = {r: values(v) for r, v in known.items()}
    out = replay(
        step,
        before,
        grad,
        known=exact or None,
        scalars=scalars_from_json(scalars, dtype),
        only=(role,),
    )
    return np.ascontiguousarray(out[role])


def rebuild_replay_chunk(
    store: Store,
    link: ReplayLink,
    predicted: np.ndarray,
    *,
    block: str,
    where: str,
) -> np.ndarray:
    """Chunk ``block``'s logical bytes: its residual applied to ``predicted``, checked.

    Raises :class:`IntegrityError` when the prediction is not the writer's (the reader's
    arithmetic drifted: the stored blocks are intact), or the result is not ``block``.
    """
    predicted_bytes = np.ascontiguousarray(predicted).view(np.uint8)
    if hash_bytes(predicted_bytes) != link.predicted:
        raise IntegrityError(
            f"{where}: the optimizer replay predicts other values than the writer's "
            f"(numpy {np.__version__}; the arithmetic rule is design note 016's). The stored "
            "blocks are intact; read it with the gradpipe and numpy that wrote it"
        )
    if link.block is None:
        out = predicted_bytes.copy()
    else:
        residual = store.get_raw(link.block, context=f"{where}, replay residual")
        out = np.empty(predicted_bytes.nbytes, dtype=np.uint8)
        codec = DeltaCodec(link.kind, dtype_name(predicted.dtype)).bind(predicted)
        codec.decode(residual, out=out)
    if hash_bytes(out) != block:
        raise IntegrityError(
            f"{where}: its replay residual rebuilds other bytes than chunk {block}; "
            "run `gradpipe verify`"
        )
    return out


def gradient_range(
    dtype: str,
    chunks: list[np.ndarray | None],
    ranges: list[tuple[int, int]],
    start: int,
    stop: int,
) -> np.ndarray:
    """Elements ``start:stop`` of a gradient tensor from its chunks that cover them.

    ``chunks`` are those chunks' logical bytes (None: all zero) and ``ranges`` their element
    ranges; a gradient need not be chunked as the state is.
    """
    typed = parse_dtype(dtype)
    out = np.zeros(stop - start, dtype=typed)
    for chunk, (lo, hi) in zip(chunks, ranges, strict=True):
        a, b = max(lo, start), min(hi, stop)
        if chunk is not None and a < b:
            out[a - start : b - start] = chunk.view(typed)[a - lo : b - lo]
    return out
