"""What a dump's tensor is, and the one validation every format's reader applies to it.

Every reader (safetensors, npy, npz, torch) turns what its file says about a
tensor into a :class:`TensorSpec` through :func:`parse_tensor_spec`, for the
header read and for the whole-file read alike, so the two paths can never
disagree about what is acceptable. The checks bound what one file can make
gradpipe allocate:

- the name is a usable string, the dtype one gradpipe stores, the shape one
  numpy can build (each dimension and the extent within a signed 64-bit index);
- the tensor's bytes fit in what the file can supply for it (``room``): its
  byte range for stored data, 1032 times the compressed size for a deflated
  npz member (deflate's largest possible expansion), its storage for a torch
  tensor;
- and they are at most ``gradpipe.max-tensor-bytes`` (64 GiB by default).

:func:`check_tensor_values` then refuses bit patterns the store could not give
back (a bool byte other than 0 and 1); it runs on whole tensors and on every
byte range ingest reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Final, Protocol

import numpy as np

from gradpipe.config import get_bytes
from gradpipe.core.chunking import parse_shape
from gradpipe.core.display import PATH_LIMIT, printable
from gradpipe.core.dtypes import DTYPE_NAMES, check_values, parse_dtype
from gradpipe.core.names import MAX_NAME_LENGTH, parse_tensor_name  # the one rule, in core
from gradpipe.errors import InvalidInputError

__all__ = [
    "DEFLATE_MAX_RATIO",
    "MAX_NAME_LENGTH",
    "TensorSpec",
    "check_tensor_values",
    "max_tensor_bytes",
    "parse_tensor_name",
    "parse_tensor_spec",
]

#: The most deflate can expand its input: a 258-byte match coded in 2 bits
#: (RFC 1951), so no deflated member holds more than 1032 bytes per byte stored.
DEFLATE_MAX_RATIO: Final = 1032
_SETTING: Final = "max-tensor-bytes"


def max_tensor_bytes() -> int:
    """The ``gradpipe.max-tensor-bytes`` setting: the largest tensor a dump may hold.

    >>> import dask.config
    >>> with dask.config.set({"gradpipe.max-tensor-bytes": "1 GiB"}):
    ...     max_tensor_bytes()
    1073741824
    """
    try:
        limit = get_bytes(_SETTING)
    except (TypeError, ValueError) as exc:
        raise InvalidInputError(
            f"gradpipe.{_SETTING} is not a size ({exc}); set it to bytes or e.g. '64 GiB'"
        ) from None
    if limit < 0:
        raise InvalidInputError(f"gradpipe.{_SETTING} is {limit}; set it to a size >= 0")
    return limit


def _check(name: object, dtype: str, shape: object, *, where: str) -> tuple[str, tuple[int, ...]]:
    text = parse_tensor_name(name, where=where)
    if dtype not in DTYPE_NAMES:
        stored = ", ".join(DTYPE_NAMES)
        raise InvalidInputError(
            f"{where}: tensor {printable(text)} has dtype {printable(dtype)}; gradpipe stores "
            f"{stored}"
        )
    itemsize = parse_dtype(dtype).itemsize
    return text, parse_shape(shape, itemsize, where=f"{where}: tensor {printable(text)}")


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a dump: what it is and where its bytes are.

    Build specs from file contents with :func:`parse_tensor_spec`, which
    also bounds their size; the constructor checks the name, dtype and shape.

    Attributes
    ----------
    name : str
        Tensor name (``dense1.weight``).
    dtype : str
        gradpipe dtype name (``"float32"``, ``"bfloat16"``, ...).
    shape : tuple of int
        Tensor shape, ``()`` for a scalar.
    offset : int or None
        Absolute file offset of the tensor's raw C-order little-endian bytes;
        ``None`` when the tensor cannot be read by byte range.
    crc32 : int or None
        The CRC-32 the bytes at ``offset`` must have, where the file records one
        (a stored ``.npz`` member's, less its ``.npy`` header): whoever reads
        them by range checks it (:mod:`gradpipe.formats.checksum`) before they
        count as ingested. ``None`` when the file records none.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int | None
    crc32: int | None = None

    def __post_init__(self) -> None:
        _check(self.name, self.dtype, self.shape, where="dump")
        if self.offset is not None and self.offset < 0:
            raise InvalidInputError(f"tensor {printable(self.name)}: negative offset {self.offset}")
        if self.crc32 is not None and (self.offset is None or not 0 <= self.crc32 < 1 << 32):
            raise InvalidInputError(
                f"tensor {printable(self.name)}: a CRC-32 ({self.crc32}) needs an offset and 32 "
                "bits"
            )

    @property
    def nbytes(self) -> int:
        """Length of the tensor's data in bytes."""
        return prod(self.shape) * parse_dtype(self.dtype).itemsize


def parse_tensor_spec(
    name: object,
    dtype: str,
    shape: object,
    offset: int | None,
    *,
    path: str,
    room: int,
    source: str,
) -> TensorSpec:
    """Validate what a file says about one tensor, bounding its size, and return its spec.

    Parameters
    ----------
    name, dtype, shape, offset
        As read from the file (``dtype`` already a gradpipe dtype name).
    path : str
        The file, for messages.
    room : int
        The most bytes the file can supply for this tensor.
    source : str
        What ``room`` is, for messages (``"its byte range"``, ``"its storage"``).

    Raises
    ------
    InvalidInputError
        If the name, dtype or shape is unusable, or the tensor is larger than
        ``room`` or than ``gradpipe.max-tensor-bytes``.
    """
    shown = printable(path, limit=PATH_LIMIT)
    name, shape = _check(name, dtype, shape, where=shown)
    where = f"{shown}: tensor {printable(name)}"
    nbytes = prod(shape) * parse_dtype(dtype).itemsize
    limit = max_tensor_bytes()
    if nbytes > limit:
        from dask.utils import format_bytes  # dask is loaded already: the limit is a setting

        raise InvalidInputError(
            f"{where} is {dtype} {list(shape)}, {nbytes} bytes ({format_bytes(nbytes)}), more "
            f"than gradpipe.max-tensor-bytes ({limit} bytes); if the dump is genuine, raise the "
            "setting (dask.config.set or DASK_GRADPIPE__MAX_TENSOR_BYTES)"
        )
    if nbytes > room:
        raise InvalidInputError(
            f"{where} is {dtype} {list(shape)}, {nbytes} bytes, but {source} holds at most "
            f"{room}; the file is damaged or forged, write it again"
        )
    return TensorSpec(name, dtype, shape, offset)


class _Described(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def dtype(self) -> str: ...


def check_tensor_values(spec: _Described, values: np.ndarray, *, path: str) -> None:
    """Refuse bit patterns ``spec``'s dtype cannot hold (a bool byte other than 0 and 1).

    ``spec`` is a :class:`TensorSpec` (or anything with its ``name`` and
    ``dtype``); ``values`` the whole tensor or any part of it, in any dtype of
    the same item size (raw bytes of a ranged read are viewed as bool).
    """
    if spec.dtype == "bool" and values.size and int(values.view(np.uint8).max()) > 1:
        # The message is built only when it is needed: this runs once per chunk.
        where = f"{printable(path, limit=PATH_LIMIT)}: tensor {printable(spec.name)}"
        check_values(values.view(np.bool_), where=where)
