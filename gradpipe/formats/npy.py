"""Read numpy's ``.npy`` format: one array per file, or per ``.npz`` member.

An ``.npy`` file is a magic string and version, a little-endian header length,
a Python-literal header ``{'descr', 'fortran_order', 'shape'}``, then the raw
array bytes. The header is parsed with :mod:`numpy.lib.format`, so every
version numpy writes is understood, and nothing is ever unpickled: object
arrays (``descr 'O'``, which ``np.save`` writes as a pickle) are refused from
the header alone, before any data is read.

gradpipe stores only the dtypes of :data:`gradpipe.core.dtypes.DTYPE_NAMES`;
structured, complex, datetime, string and void arrays are refused. In
particular ``np.save`` of an ``ml_dtypes.bfloat16`` array writes the descr
``'<V2'``: the file no longer says it was bfloat16 (``np.load`` returns raw
``V2`` records), so gradpipe refuses it rather than guess, and tells the user to
dump bfloat16 as safetensors or torch instead.

Arrays stored C-ordered and little-endian (or 1 byte wide) can be read by byte
range straight from the file; Fortran-ordered or big-endian ones are read whole
and converted to the canonical C-ordered little-endian form.
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping
from dataclasses import dataclass
from math import prod
from typing import IO, TYPE_CHECKING, Final

import numpy as np
from numpy.lib import format as npformat

from gradpipe.core.display import PATH_LIMIT, printable
from gradpipe.core.dtypes import canonical_dtype, dtype_name
from gradpipe.errors import InvalidInputError
from gradpipe.formats.checksum import reason
from gradpipe.formats.spec import TensorSpec, check_tensor_values, parse_tensor_spec

if TYPE_CHECKING:
    from gradpipe.formats.registry import DumpSource

__all__ = ["READER", "NpyArrayHeader", "NpyReader", "read_npy_data", "read_npy_header"]

# Bytes read at a time: large enough to cost nothing per piece, small beside a tensor.
_PIECE: Final = 1 << 24
_BF16_HINT: Final = (
    "np.save writes ml_dtypes.bfloat16 arrays as raw 2-byte records ('<V2') and loses the "
    "dtype; dump bfloat16 tensors as safetensors or torch files instead"
)


@dataclass(frozen=True)
class NpyArrayHeader:
    """The parsed header of one ``.npy`` array.

    Attributes
    ----------
    dtype : numpy.dtype
        The dtype as stored, in the file's byte order.
    shape : tuple of int
        Array shape.
    fortran_order : bool
        Whether the data is laid out in Fortran (column-major) order.
    header_size : int
        Bytes from the start of the ``.npy`` data to its first array byte.
    """

    dtype: np.dtype
    shape: tuple[int, ...]
    fortran_order: bool
    header_size: int

    @property
    def nbytes(self) -> int:
        """Length of the array data in bytes."""
        return prod(self.shape) * self.dtype.itemsize

    @property
    def dtype_name(self) -> str:
        """The gradpipe dtype name (byte order aside)."""
        return dtype_name(self.dtype)

    @property
    def ranged(self) -> bool:
        """True when the stored bytes already are the canonical C-ordered little-endian ones."""
        # With at most one axis longer than 1, C and Fortran order give the same bytes.
        c_bytes = not self.fortran_order or sum(d > 1 for d in self.shape) <= 1
        return c_bytes and self.dtype.byteorder != ">"


def _describe(dtype: np.dtype) -> str:
    try:
        return repr(npformat.dtype_to_descr(dtype))
    except (TypeError, ValueError):  # pragma: no cover - descr of a dtype numpy built itself
        return repr(str(dtype))


def _check_dtype(dtype: np.dtype, *, where: str) -> None:
    if dtype.hasobject:
        raise InvalidInputError(
            f"{where}: holds Python objects (dtype {_describe(dtype)}), which np.save stores "
            "as a pickle; gradpipe never unpickles input files. Save numeric arrays instead"
        )
    if dtype.fields is not None:
        raise InvalidInputError(
            f"{where}: has the structured dtype {_describe(dtype)}; gradpipe stores plain "
            "numeric arrays. Save each field as its own array"
        )
    if dtype.kind == "V":
        hint = _BF16_HINT if dtype.itemsize == 2 else "save a numeric dtype instead"
        raise InvalidInputError(
            f"{where}: has the raw void dtype {_describe(dtype)}, whose element type is "
            f"unknown; {hint}"
        )
    try:
        dtype_name(dtype)
    except InvalidInputError as exc:
        raise InvalidInputError(
            f"{where}: has dtype {_describe(dtype)}, which gradpipe does not store ({exc}). "
            "Convert the array (e.g. .astype('float32')) before dumping it"
        ) from None


def read_npy_header(f: IO[bytes], *, where: str) -> NpyArrayHeader:
    """Read and validate an ``.npy`` header at the current position of ``f``.

    Parameters
    ----------
    f : binary file object
        Positioned at the magic string; needs ``read`` and ``tell`` only (a zip
        member works).
    where : str
        Names the file (and member) in error messages.

    Returns
    -------
    NpyArrayHeader

    Raises
    ------
    InvalidInputError
        If the magic, version or header is malformed or cut short, or the dtype is
        one gradpipe does not store (objects, structured, void, complex, ...).
    """
    start = f.tell()
    try:
        version = npformat.read_magic(f)
        # Version 3.0 only changed the header's encoding to UTF-8, which matters
        # for structured field names only; those are refused below anyway.
        if version == (1, 0):
            shape, fortran_order, dtype = npformat.read_array_header_1_0(f)
        elif version in ((2, 0), (3, 0)):
            shape, fortran_order, dtype = npformat.read_array_header_2_0(f)
        else:
            raise ValueError(f"unknown format version {version}")
    except (ValueError, EOFError, OverflowError) as exc:
        raise InvalidInputError(
            f"{where}: not a valid .npy array ({reason(exc)}); check that the file was written by "
            "np.save and copied completely"
        ) from None
    if any(d < 0 for d in shape):
        raise InvalidInputError(f"{where}: .npy header has a negative shape {shape}")
    _check_dtype(dtype, where=where)
    # numpy's readers do not report the header length; writers pad it so data is
    # 64-aligned, but a hand-made file need not be, so measure where reading stopped.
    header_size = f.tell() - start
    return NpyArrayHeader(dtype, tuple(shape), bool(fortran_order), header_size)


def read_npy_data(f: IO[bytes], header: NpyArrayHeader, *, where: str) -> np.ndarray:
    """Read the array bytes following a header into a canonical array.

    Returns a C-contiguous, writable array in gradpipe's little-endian dtype,
    with ``header.shape``; bytes are moved, never converted through values, so
    NaN payloads stay exact. The caller bounds ``header.nbytes`` first
    (:func:`~gradpipe.formats.spec.parse_tensor_spec`), but a bound is not a
    promise: a deflated ``.npz`` member may claim up to 1032 times its
    compressed size and hold far less. So the buffer grows with the bytes
    actually read, piece by piece, never to what the header claims before they
    arrive, and a file that ends short fails saying how much it held.
    """
    nbytes = header.nbytes
    buf = bytearray()
    while len(buf) < nbytes:
        # bytearray grows by an eighth over what it holds; large blocks are moved by
        # the OS (mremap), not copied, so growing costs about what preallocating does.
        chunk = f.read(min(nbytes - len(buf), _PIECE))
        if not chunk:
            raise InvalidInputError(
                f"{where}: claims {nbytes} bytes of array data but holds only {len(buf)}: "
                "it is truncated, damaged or forged; copy the file again or re-create it"
            )
        buf += chunk
    dtype = header.dtype
    flat = np.frombuffer(buf, dtype=dtype)
    if header.fortran_order:
        arr = flat.reshape(header.shape[::-1]).T.copy(order="C")
    else:
        arr = flat.reshape(header.shape)
    if dtype.byteorder == ">":
        arr = arr.byteswap().view(canonical_dtype(dtype))
    return arr


def _stem(path: str) -> str:
    return posixpath.splitext(posixpath.basename(path))[0]


def _parse(source: DumpSource) -> tuple[TensorSpec, NpyArrayHeader]:
    """The one validation of an ``.npy`` file, for its header read and its whole read."""
    f, path, size = source.file, source.path, source.size
    f.seek(0)
    header = read_npy_header(f, where=printable(path, limit=PATH_LIMIT))
    if header.header_size + header.nbytes != size:
        raise InvalidInputError(
            f"{printable(path, limit=PATH_LIMIT)}: truncated or padded .npy file: the header "
            f"describes {header.header_size + header.nbytes} bytes but the file has {size}; copy "
            "the file again"
        )
    offset = header.header_size if header.ranged else None
    spec = parse_tensor_spec(
        _stem(path),
        header.dtype_name,
        header.shape,
        offset,
        path=path,
        room=size - header.header_size,
        source="the file after its header",
    )
    return spec, header


class NpyReader:
    """The dump reader of ``.npy`` files: one tensor, named after the file stem."""

    format = "npy"
    partial_header = True

    def parse_header(self, source: DumpSource) -> tuple[tuple[TensorSpec, ...], dict[str, str]]:
        """The file's one tensor spec; ``.npy`` files carry no metadata."""
        spec, _ = _parse(source)
        return (spec,), {}

    def read_tensors(
        self, source: DumpSource, specs: Mapping[str, TensorSpec]
    ) -> dict[str, np.ndarray]:
        """The array, when ``specs`` asks for it, validated as its header was."""
        spec, header = _parse(source)
        if spec.name not in specs:
            return {}
        array = read_npy_data(source.file, header, where=printable(source.path, limit=PATH_LIMIT))
        check_tensor_values(spec, array, path=source.path)
        return {spec.name: array}


#: The reader :data:`gradpipe.formats.registry.READERS` names.
READER = NpyReader()
