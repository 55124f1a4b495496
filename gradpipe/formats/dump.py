"""Gradient dumps: one file per (training step, peer), in any supported format.

Ingest reads a dump in two steps. :func:`read_dump_header` reads only what
describes the tensors (names, dtypes, shapes and, where the bytes lie in the
file as they are, their offsets) plus the optional JSON sidecar. Then ranged
tensors are fetched chunk by chunk with :func:`read_byte_range`, one ranged
request each, and the rest whole with :func:`read_dump_tensors`.

======================  ===========  ==========================================
extension               format       ranged
======================  ===========  ==========================================
``.safetensors``        safetensors  always
``.npy``                npy          when C-ordered and little-endian
``.npz``                npz          stored (``np.savez``) members, as for npy
``.pt``, ``.pth``       torch        never (the whole file is loaded)
======================  ===========  ==========================================

Metadata is the format's own (a safetensors ``__metadata__``, a torch
checkpoint's plain-value leaves) updated with the sidecar ``<path>.json``: a
JSON object whose string values are kept and whose numbers and booleans are
kept as their JSON text (``10``, ``0.5``, ``true``). **Sidecar keys override
the file's own**, so a dump can be corrected (``num_examples`` for a weighted
average, say) without rewriting it.

Everything works through any fsspec filesystem. Damaged, truncated or
mislabelled files raise :class:`~gradpipe.errors.InvalidInputError` naming the
file; errors of the storage backend itself (``OSError``, e.g. a missing file)
pass through untouched.
"""

from __future__ import annotations

import json
import os
import posixpath
from collections.abc import Iterable
from dataclasses import dataclass, field
from math import prod
from typing import IO, TYPE_CHECKING, Final

import numpy as np

from gradpipe.core.dtypes import DTYPE_NAMES, dtype_name, parse_dtype
from gradpipe.core.encoding import reject_duplicate_keys
from gradpipe.errors import InvalidInputError
from gradpipe.formats import safetensors as st

if TYPE_CHECKING:
    import fsspec

__all__ = [
    "DUMP_FORMATS",
    "DumpHeader",
    "TensorSpec",
    "dump_format",
    "read_byte_range",
    "read_dump_header",
    "read_dump_tensors",
]

#: File extension → dump format name.
DUMP_FORMATS: Final[dict[str, str]] = {
    ".safetensors": "safetensors",
    ".npy": "npy",
    ".npz": "npz",
    ".pt": "torch",
    ".pth": "torch",
}
SIDECAR_SUFFIX: Final = ".json"
# Header reads fetch small blocks: object stores would otherwise read ahead by
# their default block size (tens of MB) to parse a few hundred bytes.
_HEADER_BLOCK_SIZE: Final = 1 << 16


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a dump: what it is and where its bytes are.

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
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int | None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_NAMES:
            raise InvalidInputError(f"tensor {self.name!r}: unknown dtype {self.dtype!r}")
        if not all(isinstance(d, int) and d >= 0 for d in self.shape):
            raise InvalidInputError(f"tensor {self.name!r}: bad shape {self.shape!r}")
        if self.offset is not None and self.offset < 0:
            raise InvalidInputError(f"tensor {self.name!r}: negative offset {self.offset}")

    @property
    def nbytes(self) -> int:
        """Length of the tensor's data in bytes."""
        return prod(self.shape) * parse_dtype(self.dtype).itemsize


@dataclass(frozen=True)
class DumpHeader:
    """Everything known about a dump file before its tensor data is read.

    Attributes
    ----------
    path : str
        The file's path on its filesystem.
    format : str
        ``"safetensors"``, ``"npy"``, ``"npz"`` or ``"torch"``.
    tensors : tuple of TensorSpec
        In file order.
    metadata : dict of str to str
        The format's own metadata updated with the sidecar's (sidecar wins).
    size : int
        File size in bytes.
    """

    path: str
    format: str
    tensors: tuple[TensorSpec, ...]
    metadata: dict[str, str] = field(hash=False)
    size: int

    @property
    def ranged(self) -> bool:
        """Every tensor has an offset: all can be read by byte range, chunk by chunk."""
        return all(t.offset is not None for t in self.tensors)


def _basename(path: str) -> str:
    return posixpath.basename(path)


def dump_format(path: str) -> str:
    """The format of a dump, from its file extension.

    >>> dump_format("s3://runs/step=3/peer=0.safetensors")
    'safetensors'
    """
    ext = posixpath.splitext(_basename(path))[1].lower()
    try:
        return DUMP_FORMATS[ext]
    except KeyError:
        raise InvalidInputError(
            f"{path}: not a known dump format; gradpipe reads files ending in "
            f"{', '.join(DUMP_FORMATS)}. Rename or convert the file"
        ) from None


def _stem(path: str) -> str:
    return posixpath.splitext(_basename(path))[0]


def _sidecar_value(value: object, *, where: str, key: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool | int | float):
        return json.dumps(value)
    raise InvalidInputError(
        f"{where}: value of {key!r} is {json.dumps(value)}; sidecar values must be strings, "
        "numbers or booleans"
    )


def read_sidecar(fs: fsspec.AbstractFileSystem, path: str) -> dict[str, str]:
    """The metadata of ``<path>.json``, or ``{}`` when there is no sidecar."""
    where = path + SIDECAR_SUFFIX
    try:
        raw = fs.cat_file(where)
    except FileNotFoundError:
        return {}
    try:
        data = json.loads(bytes(raw).decode("utf-8"), object_pairs_hook=reject_duplicate_keys)
    except (UnicodeDecodeError, ValueError) as exc:
        raise InvalidInputError(f"{where}: sidecar is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise InvalidInputError(
            f'{where}: sidecar must be a JSON object of metadata, e.g. {{"num_examples": 512}}'
        )
    return {k: _sidecar_value(v, where=where, key=k) for k, v in data.items()}


def _npy_specs(f: IO[bytes], path: str, size: int) -> tuple[TensorSpec, ...]:
    from gradpipe.formats.npy import read_npy_header

    header = read_npy_header(f, where=path)
    if header.header_size + header.nbytes != size:
        raise InvalidInputError(
            f"{path}: truncated or padded .npy file: the header describes "
            f"{header.header_size + header.nbytes} bytes but the file has {size}; "
            "copy the file again"
        )
    offset = header.header_size if header.ranged else None
    return (TensorSpec(_stem(path), header.dtype_name, header.shape, offset),)


def _npz_specs(f: IO[bytes], path: str, size: int) -> tuple[TensorSpec, ...]:
    from gradpipe.formats.npz import read_npz_members

    return tuple(
        TensorSpec(
            m.name,
            m.header.dtype_name,
            m.header.shape,
            m.data_offset if m.header.ranged else None,
        )
        for m in read_npz_members(f, path=path, size=size)
    )


def read_dump_header(fs: fsspec.AbstractFileSystem, path: str) -> DumpHeader:
    """Describe a dump's tensors and metadata, reading as little as the format allows.

    safetensors, npy and npz files are read up to their headers only (plus each
    npz member's local header); torch files are loaded whole.

    Parameters
    ----------
    fs : fsspec.AbstractFileSystem
        The filesystem holding the dump (local, S3, ...).
    path : str
        The dump's path on ``fs``.

    Returns
    -------
    DumpHeader

    Raises
    ------
    InvalidInputError
        If the extension is unknown, the file is damaged, truncated or not what
        its extension says, a tensor has a dtype gradpipe does not store, or the
        sidecar is not a JSON object of plain values.
    """
    fmt = dump_format(path)
    metadata: dict[str, str] = {}
    options = {} if fmt == "torch" else {"block_size": _HEADER_BLOCK_SIZE}
    with fs.open(path, "rb", **options) as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(0)
        if fmt == "safetensors":
            header = st.read_header(f, path=path)
            entries = sorted(header.tensors.values(), key=lambda e: e.start)
            specs = tuple(TensorSpec(e.name, e.dtype, e.shape, e.start) for e in entries)
            metadata = dict(header.metadata)
        elif fmt == "npy":
            specs = _npy_specs(f, path, size)
        elif fmt == "npz":
            specs = _npz_specs(f, path, size)
        else:
            from gradpipe.formats.torch import load_torch

            # A local file is memory-mapped: its header costs no data read.
            source: IO[bytes] | str = path if _is_local(fs) else f
            tensors, metadata = load_torch(source, path=path, stem=_stem(path))
            specs = tuple(
                TensorSpec(k, dtype_name(a.dtype), a.shape, None) for k, a in tensors.items()
            )
    metadata.update(read_sidecar(fs, path))
    return DumpHeader(path, fmt, specs, metadata, size)


def _is_local(fs: fsspec.AbstractFileSystem) -> bool:
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return "file" in protocols or "local" in protocols


def read_byte_range(fs: fsspec.AbstractFileSystem, path: str, start: int, stop: int) -> np.ndarray:
    """Read bytes ``[start, stop)`` of a file with one ranged request.

    Returns
    -------
    numpy.ndarray
        A read-only ``uint8`` array of ``stop - start`` bytes; view it as the
        tensor's dtype.

    Raises
    ------
    InvalidInputError
        If the range is invalid or fewer bytes came back (truncated file).
    """
    if not 0 <= start <= stop:
        raise InvalidInputError(f"{path}: invalid byte range [{start}, {stop})")
    if start == stop:
        return np.empty(0, dtype=np.uint8)
    data = fs.cat_file(path, start=start, end=stop)
    if len(data) != stop - start:
        raise InvalidInputError(
            f"{path}: truncated: asked for bytes [{start}, {stop}) but got {len(data)}; "
            "the file is shorter than its header says, copy it again"
        )
    return np.frombuffer(data, dtype=np.uint8)


def _select(header: DumpHeader, names: Iterable[str] | None) -> dict[str, TensorSpec]:
    specs = {t.name: t for t in header.tensors}
    if names is None:
        return specs
    wanted = list(dict.fromkeys(names))
    missing = [n for n in wanted if n not in specs]
    if missing:
        raise InvalidInputError(
            f"{header.path}: no tensor named {', '.join(map(repr, missing))}; "
            f"it has {', '.join(map(repr, specs)) or 'none'}"
        )
    return {n: specs[n] for n in wanted}


def _read_safetensors_tensor(f: IO[bytes], spec: TensorSpec, path: str) -> np.ndarray:
    if spec.offset is None:
        raise InvalidInputError(f"{path}: tensor {spec.name!r} has no offset in its header")
    entry = st.TensorEntry(
        spec.name, spec.dtype, spec.shape, spec.offset, spec.offset + spec.nbytes
    )
    return st.read_tensor(f, entry, path=path)


def read_dump_tensors(
    fs: fsspec.AbstractFileSystem,
    path: str,
    header: DumpHeader,
    names: Iterable[str] | None = None,
) -> dict[str, np.ndarray]:
    """Read whole tensors of a dump, in any format.

    Parameters
    ----------
    fs : fsspec.AbstractFileSystem
        The filesystem holding the dump.
    path : str
        The dump's path on ``fs``.
    header : DumpHeader
        From :func:`read_dump_header`.
    names : iterable of str, optional
        Tensors to read (all when ``None``).

    Returns
    -------
    dict of str to numpy.ndarray
        C-contiguous arrays in gradpipe's little-endian dtypes with the shapes
        of ``header``, in the order of ``names`` (file order when ``None``).

    Raises
    ------
    InvalidInputError
        If a name is unknown, the file is damaged, or it no longer matches
        ``header`` (it changed since the header was read).
    """
    specs = _select(header, names)
    with fs.open(path, "rb") as f:
        if header.format == "safetensors":
            arrays = {n: _read_safetensors_tensor(f, s, path) for n, s in specs.items()}
        elif header.format == "npy":
            from gradpipe.formats.npy import read_npy_data, read_npy_header

            npy = read_npy_header(f, where=path)
            arrays = {n: read_npy_data(f, npy, where=path) for n in specs}
        elif header.format == "npz":
            from gradpipe.formats.npz import read_npz_arrays

            arrays = read_npz_arrays(f, path=path, names=set(specs))
        else:
            from gradpipe.formats.torch import load_torch

            arrays, _ = load_torch(f, path=path, stem=_stem(path))
    out = {}
    for n, spec in specs.items():
        arr = arrays.get(n)
        if arr is None or arr.shape != spec.shape or dtype_name(arr.dtype) != spec.dtype:
            raise InvalidInputError(
                f"{path}: tensor {n!r} no longer matches the header read before "
                f"({spec.dtype}{list(spec.shape)}); the file changed, ingest it again"
            )
        out[n] = arr
    return out
