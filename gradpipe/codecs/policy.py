"""Which lossless codec to use for one chunk.

The storage layer records the codec config of every chunk in its block
header, so the choice is free per chunk. It is made from one number the
ingest already has in its per-chunk statistics: how many elements are not
zero bit patterns.

Measured with ``python benchmarks/bench_codecs.py --density-sweep``: one
4 MiB chunk of N(0, 1e-3) values, zeros placed element by element (as ReLU
masks them) or in whole 64-element rows (as in an embedding gradient), best
of 3, one core of a 2-core machine shared with other work. Sparse / dense::

                          ratio                  decode MiB/s
    density               0.1    0.5    0.6     0.1        0.5        0.6
    float32,  elements    9.96/4.75  2.22/1.76  1.87/1.58  4347/750   2218/1057  1781/1187
    float32,  rows       11.49/10.76 2.36/2.27  1.96/1.91  4474/2126  1953/1735  1716/1818
    bfloat16, elements    9.90/5.15  2.48/2.03  2.13/1.84   971/703   1255/1015  1039/1109
    bfloat16, rows       14.44/13.32 2.93/2.80  2.44/2.35  3360/2103  1163/1568  1005/1531

The sparse codec is smaller at every density below 1: a zero costs it one
bitmap bit, while each dense plane pays again for every zero byte. Its decode
is a scatter, though, whose cost grows with the density: above one half it
falls under 1 GiB/s for bfloat16 and under the dense codec's speed, to save
a few percent. Encoding is never slower than dense below that point. So:
sparse up to :data:`SPARSE_MAX_DENSITY` = 0.5 nonzero, dense above.

(The table above is of frame version 1 of the dense codec. Version 2 chooses,
per chunk, where the sign goes and how each plane is coded. On the dense state
of a MiniLM-like encoder, measured with ``python benchmarks/bench_codecs.py
--repeat 7`` (one core of a 2-core machine shared with other work; figures
move by ±20% between runs), ratio / encode MiB/s / decode MiB/s::

                      float32             bfloat16            ZipNN ratio f32/bf16
    gradients         1.237 / 725 / 1264  1.621 / 504 / 1174  1.175 / 1.424
    params            1.203 / 841 / 1189  1.508 / 599 / 1110  1.203 / 1.510
    exp_avg           1.188 / 844 / 1204  1.462 / 605 / 1116  1.188 / 1.462
    exp_avg_sq        1.208 / 693 /  964  1.525 / 456 /  731  1.207 / 1.522

Dense chunks are 100% nonzero, so the threshold is unaffected.)
"""

from __future__ import annotations

from typing import Any, Final

import numpy as np
from numcodecs.abc import Codec

from gradpipe.codecs.bytegroup import DEFAULT_LEVEL, ByteGroupCodec
from gradpipe.codecs.sparse import SparseCodec, nonzero_mask
from gradpipe.core.dtypes import dtype_name
from gradpipe.errors import InvalidInputError

__all__ = [
    "SPARSE_MAX_DENSITY",
    "choose_codec",
    "default_codec_config",
    "estimate_size",
    "policy_codec_id",
]

#: Largest fraction of nonzero elements for which :func:`choose_codec` picks
#: :class:`~gradpipe.codecs.sparse.SparseCodec` (see the module docstring).
SPARSE_MAX_DENSITY: Final = 0.5


def choose_codec(
    chunk: np.ndarray, nonzero: int | None = None, *, level: int = DEFAULT_LEVEL
) -> Codec:
    """The lossless codec for one chunk.

    Parameters
    ----------
    chunk : numpy.ndarray
        The chunk, normally 1-D; only its dtype and size are used when
        ``nonzero`` is given.
    nonzero : int, optional
        Number of elements whose bits are not all zero (``-0.0`` counts),
        if the caller already knows it; counted here otherwise.
    level : int
        Zstandard level passed to the codec.

    Returns
    -------
    numcodecs.abc.Codec
        A :class:`~gradpipe.codecs.sparse.SparseCodec` when at most
        :data:`SPARSE_MAX_DENSITY` of the elements are nonzero, else a
        :class:`~gradpipe.codecs.bytegroup.ByteGroupCodec`.

    Examples
    --------
    >>> import numpy as np
    >>> choose_codec(np.zeros(1000, dtype="float32"))
    SparseCodec(dtype='float32', level=1)
    >>> choose_codec(np.ones(1000, dtype="float32"), nonzero=1000)
    ByteGroupCodec(dtype='float32', level=1)
    """
    name = dtype_name(chunk.dtype)
    count = chunk.size
    if nonzero is None:
        nonzero = int(np.count_nonzero(nonzero_mask(chunk)))
    elif isinstance(nonzero, bool) or not 0 <= nonzero <= count:
        raise InvalidInputError(
            f"nonzero must be a count between 0 and the chunk size {count}, not {nonzero!r}"
        )
    if _sparse(count, nonzero):
        return SparseCodec(name, level)
    return ByteGroupCodec(name, level)


def estimate_size(
    chunk: np.ndarray, nonzero: int | None = None, *, level: int = DEFAULT_LEVEL
) -> float | None:
    """About how large :func:`choose_codec`'s encoding of ``chunk`` would be, from a sample.

    ``nonzero`` as for :func:`choose_codec`. None where the policy picks a codec that has
    no estimate (the sparse one).
    """
    if nonzero is None:
        nonzero = int(np.count_nonzero(nonzero_mask(chunk)))
    if _sparse(chunk.size, nonzero):
        return None
    return ByteGroupCodec(dtype_name(chunk.dtype), level).estimate(chunk)


def policy_codec_id(count: int, nonzero: int) -> str:
    """The id of the codec :func:`choose_codec` picks for a chunk, from its counts alone.

    ``count`` elements, ``nonzero`` of them not zero bit patterns. What a
    chunk written by the policy is stored with, known without reading it
    (chunk statistics record the count of non-zero values, in which ``-0.0``
    is zero; the policy counts it as non-zero, which only matters for a chunk
    of many ``-0.0`` right at the threshold).

    Examples
    --------
    >>> policy_codec_id(1000, 10), policy_codec_id(1000, 900)
    ('gradpipe_sparse', 'gradpipe_bytegroup')
    """
    return SparseCodec.codec_id if _sparse(count, nonzero) else ByteGroupCodec.codec_id


def _sparse(count: int, nonzero: int) -> bool:
    # An empty chunk has no zeros to skip; the dense frame is the shorter one.
    return bool(count) and nonzero <= SPARSE_MAX_DENSITY * count


def default_codec_config(
    dtype: np.dtype | type | str, *, level: int = DEFAULT_LEVEL
) -> dict[str, Any]:
    """Config of the codec to use when nothing is known about the data.

    Parameters
    ----------
    dtype : numpy.dtype, type or str
        The element dtype (a gradpipe name such as ``"bfloat16"`` or anything
        numpy accepts).
    level : int
        Zstandard level.

    Returns
    -------
    dict
        A numcodecs config, for :func:`numcodecs.get_codec`.

    Examples
    --------
    >>> default_codec_config("bfloat16")
    {'id': 'gradpipe_bytegroup', 'dtype': 'bfloat16', 'level': 1}
    """
    name = dtype if isinstance(dtype, str) else dtype_name(dtype)
    config: dict[str, Any] = ByteGroupCodec(name, level).get_config()
    return config
