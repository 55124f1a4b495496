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

Each format has one reader in :mod:`gradpipe.formats.registry`, imported on
first use; every reader validates its tensors with
:func:`~gradpipe.formats.spec.parse_tensor_spec`, so what one file can make
gradpipe allocate is bounded (by its own size and by
``gradpipe.max-tensor-bytes``) on the header read and the whole read alike.

Everything works through any fsspec filesystem. Damaged, truncated, forged or
mislabelled files, and local paths that are not regular files (a FIFO would
block the reader for ever), raise :class:`~gradpipe.errors.InvalidInputError`
naming the file; errors of the storage backend itself (``OSError``, e.g. a
missing file) pass through untouched.
"""

from __future__ import annotations

import json
import os
import posixpath
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from gradpipe.core.dtypes import dtype_name
from gradpipe.core.encoding import reject_duplicate_keys
from gradpipe.errors import InvalidInputError
from gradpipe.formats.registry import DUMP_FORMATS, DumpSource, get_reader
from gradpipe.formats.spec import TensorSpec

if TYPE_CHECKING:
    import fsspec

__all__ = [
    "DUMP_FORMATS",
    "DumpHeader",
    "TensorSpec",
    "check_regular_file",
    "dump_format",
    "is_local",
    "read_byte_range",
    "read_dump_header",
    "read_dump_tensors",
]

SIDECAR_SUFFIX: Final = ".json"
# Header reads fetch small blocks: object stores would otherwise read ahead by
# their default block size (tens of MB) to parse a few hundred bytes.
_HEADER_BLOCK_SIZE: Final = 1 << 16
_KINDS: Final = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a named pipe (FIFO)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


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


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    """Whether ``fs`` is the local filesystem (its paths are OS paths)."""
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return "file" in protocols or "local" in protocols


def check_regular_file(
    fs: fsspec.AbstractFileSystem, path: str, info: Mapping[str, Any] | None = None
) -> None:
    """Refuse, without opening it, a path that is not a regular file.

    Opening a FIFO blocks until some writer opens it, a device may never end,
    and a directory has no bytes: none is a dump. A local path is checked with
    ``os.stat`` (symbolic links followed); any other filesystem by the ``type``
    of ``info`` (as ``fs.glob(detail=True)`` gives it) or of ``fs.info(path)``.

    Raises
    ------
    InvalidInputError
        If the path is not a regular file, or a local path cannot be examined
        (e.g. a dangling symbolic link).
    """
    advice = "gradpipe reads regular files only; remove it or make the pattern more specific"
    if is_local(fs):
        try:
            mode = Path(path).stat().st_mode
        except OSError as exc:
            raise InvalidInputError(
                f"{path}: cannot examine it ({exc.strerror}); {advice}"
            ) from None
        if stat.S_ISREG(mode):
            return
        kind = next((what for test, what in _KINDS if test(mode)), "a special file")
        raise InvalidInputError(f"{path} is {kind}, not a regular file; {advice}")
    found = (info if info is not None else fs.info(path)).get("type")
    if found != "file":
        raise InvalidInputError(f"{path} is a {found}, not a regular file; {advice}")


def read_dump_header(fs: fsspec.AbstractFileSystem, path: str) -> DumpHeader:
    """Describe a dump's tensors and metadata, reading as little as the format allows.

    safetensors, npy and npz files are read up to their headers only (plus each
    npz member's local header); torch files are loaded whole (a local one is
    memory-mapped, so nothing is copied).

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
        If the extension is unknown, a local path is not a regular file, the
        file is damaged, truncated, forged or not what its extension says, a
        tensor has a dtype gradpipe does not store or is larger than the file
        can hold or than ``gradpipe.max-tensor-bytes``, or the sidecar is not a
        JSON object of plain values.
    """
    reader = get_reader(dump_format(path))
    local = is_local(fs)
    if local:
        # Before opening: open() on a FIFO waits for a writer for ever. (A
        # remote object store has no such files, and a stat would cost a request.)
        check_regular_file(fs, path)
    options = {"block_size": _HEADER_BLOCK_SIZE} if reader.partial_header else {}
    with fs.open(path, "rb", **options) as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(0)
        specs, metadata = reader.parse_header(DumpSource(f, path, size, local))
    metadata = {**metadata, **read_sidecar(fs, path)}
    return DumpHeader(path, reader.format, specs, metadata, size)


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
        If a name is unknown, the file is damaged, a tensor holds values its
        dtype cannot (a bool byte other than 0 and 1), or the file no longer
        matches ``header`` (it changed since the header was read).
    """
    specs = _select(header, names)
    reader = get_reader(header.format)
    local = is_local(fs)
    if local:
        check_regular_file(fs, path)
    with fs.open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(0)
        arrays = reader.read_tensors(DumpSource(f, path, size, local), specs)
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
