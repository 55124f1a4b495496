"""Read and write the safetensors format, tensor by tensor.

A safetensors file is an 8-byte little-endian header length ``n``, ``n`` bytes
of JSON mapping each tensor name to ``{"dtype", "shape", "data_offsets"}``
(plus an optional ``"__metadata__"`` object of strings), then the raw
little-endian tensor bytes, back to back.

gradpipe reads this itself rather than through the ``safetensors`` package
because ingest works on multi-GB dumps over fsspec (local or S3): it reads the
header once, then fetches one tensor, or one byte range of a tensor, at a time,
never the whole file. Every read takes an open binary file object and reads
exact ranges, so it works on anything with ``seek``/``read``.

The writer lays files out exactly like the reference implementation (tensors
ordered by dtype alignment, largest first, then by name; header padded with
spaces to a multiple of 8), so for files without metadata both produce the same
bytes. Metadata keys are written sorted; the reference writes them in hash
order, which differs from run to run.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from math import prod
from typing import IO, TYPE_CHECKING, Final

import numpy as np

from gradpipe.core.display import PATH_LIMIT, printable
from gradpipe.core.dtypes import SAFETENSORS_NAMES, canonical_dtype, dtype_name, parse_dtype
from gradpipe.core.encoding import reject_duplicate_keys
from gradpipe.errors import InvalidInputError, UnsupportedFormatError
from gradpipe.formats._output import write_output
from gradpipe.formats.checksum import reason
from gradpipe.formats.spec import (
    TensorSpec,
    check_tensor_values,
    parse_tensor_name,
    parse_tensor_spec,
)

if TYPE_CHECKING:
    from gradpipe.formats.registry import DumpSource

__all__ = [
    "READER",
    "SafetensorsHeader",
    "SafetensorsReader",
    "TensorEntry",
    "read_header",
    "read_safetensors",
    "read_tensor",
    "read_tensor_range",
    "write_safetensors",
    "write_safetensors_stream",
]

#: The reference implementation refuses headers above 100 MB; so do we, so a
#: corrupt length field cannot make us allocate gigabytes.
MAX_HEADER_SIZE: Final = 100_000_000
_METADATA_KEY: Final = "__metadata__"
_CODES: Final[dict[str, str]] = {name: code for code, name in SAFETENSORS_NAMES.items()}
# Rank of each dtype in the reference writer's sort (its `Dtype` enum order);
# tensors are written highest rank first so every tensor stays aligned.
_RANK: Final[dict[str, int]] = {
    code: i
    for i, code in enumerate(
        ["BOOL", "U8", "I8", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "F64", "I64", "U64"]
    )
}


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives in a safetensors file.

    Attributes
    ----------
    name : str
        Tensor name from the header.
    dtype : str
        gradpipe dtype name (``"float32"``, ``"bfloat16"``, ...).
    shape : tuple of int
        Tensor shape; ``()`` for a scalar.
    start, stop : int
        Absolute file offsets of the tensor's bytes, ``[start, stop)``.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    stop: int

    @property
    def nbytes(self) -> int:
        """Length of the tensor's data in bytes."""
        return self.stop - self.start

    @property
    def spec(self) -> TensorSpec:
        """The entry as a dump's :class:`~gradpipe.formats.spec.TensorSpec`."""
        return TensorSpec(self.name, self.dtype, self.shape, self.start)


@dataclass(frozen=True)
class SafetensorsHeader:
    """The parsed, validated header of a safetensors file.

    Attributes
    ----------
    tensors : dict of str to TensorEntry
        Entries in header order.
    metadata : dict of str to str
        The ``__metadata__`` object (empty when absent).
    data_start : int
        File offset where the data section begins (``8 + header length``).
    """

    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]
    data_start: int


def _invalid(path: str, what: str) -> InvalidInputError:
    return InvalidInputError(
        f"{printable(path, limit=PATH_LIMIT)}: not a valid safetensors file: {what}; re-export the "
        "file or check that "
        "it was copied completely"
    )


def _read_exact(f: IO[bytes], start: int, length: int, *, path: str, what: str) -> bytearray:
    """Read exactly ``length`` bytes at ``start`` into a fresh (writable) buffer."""
    f.seek(start)
    buf = bytearray(length)
    view = memoryview(buf)
    readinto = getattr(f, "readinto", None)
    got = 0
    while got < length:
        # readinto avoids a second copy of multi-GB tensors; short reads are legal.
        n = readinto(view[got:]) if readinto is not None else None
        if n is None:
            chunk = f.read(length - got)
            n = len(chunk)
            view[got : got + n] = chunk
        if n == 0:
            raise _invalid(path, f"file ends inside {what} (wanted {length} bytes at {start})")
        got += n
    return buf


def _parse_entry(name: str, raw: object, data_start: int, *, path: str) -> TensorEntry:
    where = f"tensor {printable(name)}"
    if not isinstance(raw, dict) or set(raw) != {"dtype", "shape", "data_offsets"}:
        raise _invalid(path, f"{where} must be an object with dtype, shape and data_offsets")
    code, shape, offsets = raw["dtype"], raw["shape"], raw["data_offsets"]
    if not isinstance(code, str) or code not in SAFETENSORS_NAMES:
        raise UnsupportedFormatError(
            f"{printable(path, limit=PATH_LIMIT)}: {where} has dtype {printable(code)}, which "
            "gradpipe does not store; supported: "
            f"{', '.join(SAFETENSORS_NAMES)}. Convert the tensor before dumping it"
        )

    def is_uint(v: object) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    if not isinstance(shape, list) or not all(is_uint(d) for d in shape):
        raise _invalid(
            path, f"{where} has shape {printable(shape)}; expected a list of integers >= 0"
        )
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(is_uint, offsets))):
        raise _invalid(
            path, f"{where} has data_offsets {printable(offsets)}; expected [begin, end]"
        )
    begin, end = offsets
    dtype = SAFETENSORS_NAMES[code]
    expected = prod(shape) * parse_dtype(dtype).itemsize
    if end < begin or end - begin != expected:
        raise _invalid(
            path,
            f"{where} has data_offsets [{begin}, {end}] but shape {shape} of {code} needs "
            f"{expected} bytes",
        )
    # The one validation of every reader: name, a shape numpy can build, the size limit.
    spec = parse_tensor_spec(
        name, dtype, shape, data_start + begin, path=path, room=end - begin, source="its byte range"
    )
    return TensorEntry(spec.name, dtype, spec.shape, data_start + begin, data_start + end)


def read_header(f: IO[bytes], *, path: str) -> SafetensorsHeader:
    """Read and strictly validate the header of an open safetensors file.

    Parameters
    ----------
    f : binary file object
        Seekable; only the first ``8 + n`` bytes are read.
    path : str
        Name of the file, used in error messages.

    Returns
    -------
    SafetensorsHeader

    Raises
    ------
    InvalidInputError
        If the length field, the JSON, a shape, the offsets or the metadata are
        malformed, or if the data section does not exactly fill the file.
    UnsupportedFormatError
        If a tensor has a dtype gradpipe does not store (e.g. ``F8_E4M3``).
    """
    size = f.seek(0, os.SEEK_END)
    if size < 8:
        raise _invalid(path, f"file is {size} bytes, shorter than the 8-byte length field")
    n = int.from_bytes(_read_exact(f, 0, 8, path=path, what="the length field"), "little")
    if n > MAX_HEADER_SIZE or 8 + n > size:
        raise _invalid(path, f"header length {n} does not fit in a file of {size} bytes")
    raw = _read_exact(f, 8, n, path=path, what="the header")
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=reject_duplicate_keys)
    except (UnicodeDecodeError, ValueError) as exc:
        raise _invalid(path, f"header is not valid JSON ({reason(exc)})") from None
    if not isinstance(header, dict):
        raise _invalid(path, "header is not a JSON object")

    metadata = header.pop(_METADATA_KEY, {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _invalid(path, "__metadata__ must map strings to strings")

    data_start = 8 + n
    tensors = {name: _parse_entry(name, v, data_start, path=path) for name, v in header.items()}
    # Like the reference reader: the data section must be tiled exactly, with no
    # gaps, overlaps or trailing bytes, so every byte of the file is accounted for.
    pos = data_start
    for entry in sorted(tensors.values(), key=lambda e: (e.start, e.stop)):
        if entry.start != pos:
            problem = "overlaps the previous tensor" if entry.start < pos else "leaves a gap"
            raise _invalid(
                path, f"tensor {printable(entry.name)} at offset {entry.start} {problem}"
            )
        pos = entry.stop
    if pos != size:
        raise _invalid(path, f"tensor data ends at byte {pos} but the file has {size} bytes")
    return SafetensorsHeader(tensors=tensors, metadata=dict(metadata), data_start=data_start)


def read_tensor_range(
    f: IO[bytes], entry: TensorEntry, start: int, stop: int, *, path: str = "<file>"
) -> bytearray:
    """Read bytes ``[start, stop)`` of one tensor's flat little-endian data.

    Offsets are relative to the tensor's first byte. Used to fetch one chunk of a
    large tensor without reading the rest.
    """
    if not 0 <= start <= stop <= entry.nbytes:
        raise InvalidInputError(
            f"{printable(path, limit=PATH_LIMIT)}: byte range [{start}, {stop}) is outside tensor "
            f"{printable(entry.name)} "
            f"of {entry.nbytes} bytes"
        )
    return _read_exact(f, entry.start + start, stop - start, path=path, what=repr(entry.name))


def read_tensor(f: IO[bytes], entry: TensorEntry, *, path: str = "<file>") -> np.ndarray:
    """Read one tensor (and only its bytes) as a writable numpy array."""
    buf = read_tensor_range(f, entry, 0, entry.nbytes, path=path)
    array = np.frombuffer(buf, dtype=parse_dtype(entry.dtype))
    # numpy would happily view 0x02 as "True" and break bit-exact round trips.
    check_tensor_values(entry, array, path=path)
    return array.reshape(entry.shape)


def read_safetensors(
    path_or_file: str | os.PathLike[str] | IO[bytes],
    *,
    storage_options: Mapping[str, object] | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Read a whole safetensors file: ``(tensors, metadata)``.

    ``path_or_file`` is a local path, an fsspec URL (``s3://...``) or an open
    binary file object.
    """
    if isinstance(path_or_file, str | os.PathLike):
        import fsspec

        path = os.fspath(path_or_file)
        with fsspec.open(path, "rb", **(storage_options or {})) as f:
            return read_safetensors(f)
    path = str(getattr(path_or_file, "name", None) or getattr(path_or_file, "path", "<file>"))
    header = read_header(path_or_file, path=path)
    tensors = {k: read_tensor(path_or_file, e, path=path) for k, e in header.tensors.items()}
    return tensors, header.metadata


class SafetensorsReader:
    """The dump reader of safetensors files (see :mod:`gradpipe.formats.registry`)."""

    format = "safetensors"
    partial_header = True

    def parse_header(self, source: DumpSource) -> tuple[tuple[TensorSpec, ...], dict[str, str]]:
        """Every tensor's spec, in file order, and ``__metadata__``."""
        header = read_header(source.file, path=source.path)
        entries = sorted(header.tensors.values(), key=lambda e: e.start)
        return tuple(e.spec for e in entries), dict(header.metadata)

    def read_tensors(
        self, source: DumpSource, specs: Mapping[str, TensorSpec]
    ) -> dict[str, np.ndarray]:
        """The tensors named in ``specs``; the header is parsed again, as it is now."""
        header = read_header(source.file, path=source.path)
        return {
            name: read_tensor(source.file, header.tensors[name], path=source.path)
            for name in specs
            if name in header.tensors
        }


#: The reader :data:`gradpipe.formats.registry.READERS` names.
READER = SafetensorsReader()


def _code(name: str, dtype: np.dtype | str) -> str:
    try:
        return _CODES[dtype if isinstance(dtype, str) else dtype_name(dtype)]
    except (InvalidInputError, KeyError):
        shown = dtype if isinstance(dtype, str) else dtype_name(dtype)
        raise InvalidInputError(
            f"tensor {printable(name)}: dtype {printable(shown)} cannot be written to safetensors"
        ) from None


def _check_name(name: object) -> None:
    if not isinstance(name, str) or name == _METADATA_KEY:
        raise InvalidInputError(f"tensor name {printable(name)} is not allowed in safetensors")
    # Write only names the reader accepts back.
    parse_tensor_name(name, where="safetensors")


def _prepare(tensors: Mapping[str, np.ndarray]) -> list[tuple[str, str, np.ndarray]]:
    """Validate inputs and return ``(name, code, little-endian C array)`` in file order."""
    out = []
    for name, value in tensors.items():
        _check_name(name)
        arr = np.asarray(value)
        try:
            code = _CODES[dtype_name(arr.dtype)]
        except InvalidInputError as exc:
            raise InvalidInputError(f"tensor {printable(name)}: {exc}") from None
        if arr.dtype.byteorder == ">":
            # byteswap + view moves bits, never values: NaN payloads stay exact.
            arr = arr.byteswap().view(canonical_dtype(arr.dtype))
        # Not np.ascontiguousarray: it turns 0-d arrays into 1-d ones.
        out.append((name, code, arr if arr.flags.c_contiguous else arr.copy(order="C")))
    out.sort(key=lambda t: (-_RANK[t[1]], t[0]))
    return out


_Entry = tuple[str, str, tuple[int, ...], int]  # name, safetensors dtype code, shape, bytes


def _header(entries: list[_Entry], metadata: dict[str, str]) -> bytes:
    """The length field and JSON header of ``(name, code, shape, nbytes)`` entries in file order."""
    header: dict[str, object] = {_METADATA_KEY: metadata} if metadata else {}
    pos = 0
    for name, code, shape, nbytes in entries:
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    raw = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # the reference pads so the data starts 8-aligned
    return len(raw).to_bytes(8, "little") + raw


def _write(
    f: IO[bytes], prepared: list[tuple[str, str, np.ndarray]], metadata: dict[str, str]
) -> None:
    f.write(_header([(n, c, a.shape, a.nbytes) for n, c, a in prepared], metadata))
    for _, _, arr in prepared:
        _write_array(f, arr)


def _write_array(f: IO[bytes], arr: np.ndarray) -> None:
    # The array's own buffer, no copy: buffered writers pass large writes through.
    if arr.nbytes:
        f.write(arr.reshape(-1).view(np.uint8).data)


def _write_stream(
    f: IO[bytes],
    entries: list[_Entry],
    arrays: Iterator[np.ndarray],
    metadata: dict[str, str],
) -> None:
    f.write(_header(entries, metadata))
    for name, code, shape, nbytes in entries:
        arr = next(arrays, None)
        if arr is None:
            raise InvalidInputError(f"no data was given for tensor {printable(name)}")
        if arr.shape != shape or arr.nbytes != nbytes or _code(name, arr.dtype) != code:
            raise InvalidInputError(
                f"tensor {printable(name)} was announced as {code} {list(shape)} but its data is "
                f"{arr.dtype} {list(arr.shape)}"
            )
        if arr.dtype.byteorder == ">":
            arr = arr.byteswap().view(canonical_dtype(arr.dtype))  # bits, never values
        _write_array(f, arr if arr.flags.c_contiguous else arr.copy(order="C"))


def write_safetensors(
    path_or_file: str | os.PathLike[str] | IO[bytes],
    tensors: Mapping[str, np.ndarray],
    metadata: Mapping[str, str] | None = None,
    *,
    storage_options: Mapping[str, object] | None = None,
    keep_metadata_order: bool = False,
) -> None:
    """Write ``tensors`` (and string ``metadata``) as a safetensors file.

    Parameters
    ----------
    path_or_file : str, path or binary file object
        A local path is written atomically (temporary file in the same
        directory, fsync, then ``os.replace``), so readers never see half a
        file. A remote fsspec URL is written with one upload, which object
        stores make visible only once complete.
    tensors : mapping of str to numpy.ndarray
        Any dtype in :data:`gradpipe.core.dtypes.DTYPE_NAMES`, either byte order,
        any layout; bytes are written bit-exact, straight from each array's
        buffer (no copy of the whole file is built).
    metadata : mapping of str to str, optional
        Stored as ``__metadata__``, keys sorted.
    keep_metadata_order : bool
        Keep ``metadata`` in its given order instead: writing back the metadata
        of a file read (in its order) then reproduces the reference writer's bytes.
    """
    meta = _parse_metadata(metadata, sort=not keep_metadata_order)
    prepared = _prepare(tensors)
    write_output(path_or_file, lambda f: _write(f, prepared, meta), storage_options)


def write_safetensors_stream(
    path_or_file: str | os.PathLike[str] | IO[bytes],
    specs: Mapping[str, tuple[str, tuple[int, ...]]],
    produce: Callable[[list[str]], Iterable[np.ndarray]],
    metadata: Mapping[str, str] | None = None,
    *,
    storage_options: Mapping[str, object] | None = None,
    keep_metadata_order: bool = False,
) -> None:
    """Write a safetensors file whose tensors are made while it is written.

    The header needs only names, dtypes and shapes (``specs``: name → gradpipe
    dtype name and shape); ``produce`` is then called once with the names in
    file order and must yield the arrays in that order. Each is written as
    soon as it comes, so a producer that decodes ahead overlaps its work with
    the writes, and an array may be dropped once written. The file is the one
    :func:`write_safetensors` would write from the same arrays, with the same
    atomicity; an array that does not match its spec is an error.
    ``keep_metadata_order`` is as for :func:`write_safetensors`.
    """
    meta = _parse_metadata(metadata, sort=not keep_metadata_order)
    entries = []
    for name, (dtype, shape) in specs.items():
        _check_name(name)
        size = prod(shape) * parse_dtype(dtype).itemsize
        entries.append((name, _code(name, dtype), tuple(shape), size))
    entries.sort(key=lambda t: (-_RANK[t[1]], t[0]))

    def write(f: IO[bytes]) -> None:
        arrays = iter(produce([e[0] for e in entries]))
        try:
            _write_stream(f, entries, arrays, meta)
        finally:
            close = getattr(arrays, "close", None)
            if close is not None:
                close()  # a generator that decodes ahead stops and waits for its workers

    write_output(path_or_file, write, storage_options)


def _parse_metadata(metadata: Mapping[str, str] | None, *, sort: bool = True) -> dict[str, str]:
    meta = dict(metadata or {})
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise InvalidInputError(
            "safetensors metadata must map str to str; convert values with str()"
        )
    return dict(sorted(meta.items())) if sort else meta
