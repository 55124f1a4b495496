"""The dtypes gradpipe stores, and their canonical names.

Stored data is always little-endian; names are numpy's (``float32``) plus
``bfloat16`` from ml_dtypes, which numpy lacks. The safetensors spelling
(``F32``, ``BF16``) maps to the same names. ml_dtypes takes ~0.4 s to import,
so it is loaded only when a bfloat16 is actually met.
"""

from __future__ import annotations

from functools import cache
from typing import Final

import numpy as np

from gradpipe.core.display import printable
from gradpipe.errors import InvalidInputError

__all__ = [
    "DTYPE_NAMES",
    "SAFETENSORS_NAMES",
    "bfloat16",
    "canonical_dtype",
    "check_values",
    "dtype_name",
    "is_float",
    "parse_dtype",
]

_DTYPES: Final[dict[str, np.dtype]] = {
    "bool": np.dtype(np.bool_),
    "int8": np.dtype("<i1"),
    "int16": np.dtype("<i2"),
    "int32": np.dtype("<i4"),
    "int64": np.dtype("<i8"),
    "uint8": np.dtype("<u1"),
    "uint16": np.dtype("<u2"),
    "uint32": np.dtype("<u4"),
    "uint64": np.dtype("<u8"),
    "float16": np.dtype("<f2"),
    "float32": np.dtype("<f4"),
    "float64": np.dtype("<f8"),
}

#: Every dtype name gradpipe accepts, in a stable order.
DTYPE_NAMES: Final[tuple[str, ...]] = (*tuple(_DTYPES)[:10], "bfloat16", "float32", "float64")


@cache
def bfloat16() -> np.dtype:
    """numpy's dtype for bfloat16 (imports ml_dtypes on first use)."""
    import ml_dtypes

    dtype: np.dtype = np.dtype(ml_dtypes.bfloat16)
    return dtype


#: safetensors dtype codes → gradpipe dtype names.
SAFETENSORS_NAMES: Final[dict[str, str]] = {
    "BOOL": "bool",
    "I8": "int8",
    "I16": "int16",
    "I32": "int32",
    "I64": "int64",
    "U8": "uint8",
    "U16": "uint16",
    "U32": "uint32",
    "U64": "uint64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
}


def parse_dtype(name: str) -> np.dtype:
    """Return the little-endian numpy dtype for a gradpipe dtype name.

    >>> parse_dtype("float32")
    dtype('float32')
    """
    if name == "bfloat16":
        return bfloat16()
    try:
        return _DTYPES[name]
    except KeyError:
        raise InvalidInputError(
            f"unsupported dtype {printable(name)}; gradpipe stores {', '.join(DTYPE_NAMES)}"
        ) from None


def dtype_name(dtype: np.dtype | type) -> str:
    """Return the gradpipe name of a numpy dtype (either byte order).

    >>> dtype_name(np.dtype(">f4"))
    'float32'
    """
    dt = np.dtype(dtype)
    known = _NAMES.get(dt)
    if known is not None:
        return known
    if _is_bfloat16(dt):
        _NAMES[dt] = "bfloat16"
        return "bfloat16"
    if dt.kind in "biuf" and dt.fields is None and dt.subdtype is None:
        name = dt.newbyteorder("<").name if dt.kind != "b" else "bool"
        if name in _DTYPES:
            _NAMES[dt] = name
            return name
    raise InvalidInputError(
        f"unsupported dtype {printable(dt.name)}; gradpipe stores {', '.join(DTYPE_NAMES)}"
    )


def canonical_dtype(dtype: np.dtype | type) -> np.dtype:
    """The stored (little-endian) form of ``dtype``."""
    return parse_dtype(dtype_name(dtype))


def is_float(dtype: np.dtype) -> bool:
    """True for float16, bfloat16, float32 and float64."""
    return dtype.kind == "f" or _is_bfloat16(dtype)


#: Names found by :func:`dtype_name`: a numpy dtype's ``name`` is computed in Python (about
#: 1.5 us, with the GIL), and the chunk pipeline asks for it several times per chunk.
_NAMES: dict[np.dtype, str] = {}


def _is_bfloat16(dtype: np.dtype) -> bool:
    # ml_dtypes' bfloat16 is of kind "V": anything else is rejected without its name (computed
    # in Python) or importing ml_dtypes.
    return dtype.kind == "V" and dtype.name == "bfloat16" and dtype == bfloat16()


def check_values(array: np.ndarray, *, where: str) -> None:
    """Refuse bit patterns a dtype cannot hold: a bool byte other than 0 and 1.

    numpy shows byte 0x02 as ``True`` but writes it back as 0x02, and every
    reader of the bool format refuses it; the store must not accept what it
    cannot give back. Every path that writes tensor bytes calls this.
    """
    if array.dtype.kind == "b" and array.size:
        raw = array.reshape(-1).view(np.uint8)
        if int(raw.max()) > 1:
            raise InvalidInputError(
                f"{where}: bool tensor holds bytes other than 0 and 1 (e.g. {int(raw.max())}); "
                "fix the writer, or store it as uint8"
            )
