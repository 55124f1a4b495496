"""Read numpy's ``.npz`` format: a zip archive of ``.npy`` members.

``np.savez`` stores members uncompressed (``ZIP_STORED``), so each array's bytes
sit contiguously in the archive and can be read by byte range; the offset is
computed from the member's *local* file header, whose extra field may differ in
length from the central directory's copy (``np.savez`` writes zip64 extras in
the local header only). ``np.savez_compressed`` deflates members; those are read
whole through :mod:`zipfile`, which also checks their CRC.

The sizes a zip directory declares are checked before anything is read or
allocated: a stored member must fit in the file, a deflated one cannot hold more
than :data:`~gradpipe.formats.spec.DEFLATE_MAX_RATIO` (1032) bytes per
compressed byte, and other compression methods (which ``np.savez*`` never
writes, and whose ratios are unbounded) are refused. A deflated member is then
inflated piece by piece, never past its declared size, so a 233-byte archive
claiming gigabytes costs nothing. Members may not share bytes: a forged zip
directory can list one stored member under 64 names (every entry pointing at
the same local header), which would make a file claim 64 times its size, so
every member's extent (local header to end of data) is read and overlaps are
refused. The members of one file thus claim at most the file (stored) or 1032
times it (deflated) in total, on the header read and the whole read alike.

Like ``np.load(allow_pickle=False)``, pickled (object) members are refused from
their header, before anything is unpickled. Every member must be an ``.npy``
array: a zip holding anything else is not a gradient dump.
"""

from __future__ import annotations

import itertools
import struct
import zipfile
import zlib
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import IO, TYPE_CHECKING, Final

import numpy as np

from gradpipe.core.display import PATH_LIMIT, printable
from gradpipe.errors import InvalidInputError
from gradpipe.formats.checksum import crc32_remove_prefix, damaged, reason
from gradpipe.formats.npy import NpyArrayHeader, read_npy_data, read_npy_header
from gradpipe.formats.spec import (
    DEFLATE_MAX_RATIO,
    TensorSpec,
    check_tensor_values,
    parse_tensor_spec,
)

if TYPE_CHECKING:
    from gradpipe.formats.registry import DumpSource

__all__ = ["READER", "NpzMember", "NpzReader", "read_npz_arrays", "read_npz_members"]

_LOCAL_HEADER: Final = struct.Struct("<4s22xHH")  # signature, ..., name length, extra length
_LOCAL_SIGNATURE: Final = b"PK\x03\x04"
# What zipfile and zlib raise on a damaged archive or member.
_ZIP_ERRORS: Final = (
    zipfile.BadZipFile,
    zipfile.LargeZipFile,
    zlib.error,
    EOFError,
    NotImplementedError,  # compression method zipfile does not know
    RuntimeError,  # encrypted member
    ValueError,
)


@dataclass(frozen=True)
class NpzMember:
    """One array of an ``.npz`` archive.

    Attributes
    ----------
    name : str
        Member name without the ``.npy`` suffix (the key ``np.load`` gives it).
    header : NpyArrayHeader
        The member's parsed ``.npy`` header.
    data_offset : int or None
        Absolute file offset of the array bytes for stored (uncompressed)
        members, ``None`` for compressed ones.
    spec : TensorSpec
        The validated spec of the array (offset as ``data_offset``).
    """

    name: str
    header: NpyArrayHeader
    data_offset: int | None
    spec: TensorSpec


def _invalid(path: str, what: str) -> InvalidInputError:
    return InvalidInputError(
        f"{printable(path, limit=PATH_LIMIT)}: not a valid .npz file: {what}; write it with "
        "np.savez / np.savez_compressed "
        "and check that it was copied completely"
    )


@contextmanager
def _open_zip(f: IO[bytes], path: str) -> Iterator[zipfile.ZipFile]:
    try:
        zf = zipfile.ZipFile(f)
    except _ZIP_ERRORS as exc:
        raise _invalid(path, f"not a readable zip archive ({reason(exc)})") from None
    with zf:
        yield zf


def _check_sizes(info: zipfile.ZipInfo, size: int, path: str) -> None:
    """Refuse declared sizes the file cannot back, before anything is read or allocated."""
    member = repr(info.filename)
    if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        raise _invalid(
            path,
            f"member {member} uses zip compression method {info.compress_type}; gradpipe reads "
            "stored and deflated members, as np.savez and np.savez_compressed write",
        )
    if info.compress_size > size:
        raise _invalid(
            path,
            f"truncated: member {member} declares {info.compress_size} compressed bytes in a file "
            f"of {size}",
        )
    if info.compress_type == zipfile.ZIP_STORED and info.file_size != info.compress_size:
        raise _invalid(
            path,
            f"stored member {member} declares {info.file_size} bytes but occupies "
            f"{info.compress_size}",
        )
    if info.compress_type == zipfile.ZIP_DEFLATED:
        bound = info.compress_size * DEFLATE_MAX_RATIO
        if info.file_size > bound:
            raise _invalid(
                path,
                f"member {member} declares {info.file_size} bytes from {info.compress_size} "
                f"deflated bytes, but deflate expands at most {DEFLATE_MAX_RATIO} times "
                f"({bound} bytes); the file is damaged or forged",
            )


def _room(info: zipfile.ZipInfo) -> int:
    """The most bytes a member can supply."""
    if info.compress_type == zipfile.ZIP_DEFLATED:
        return info.compress_size * DEFLATE_MAX_RATIO
    return info.compress_size


def _data_start(f: IO[bytes], info: zipfile.ZipInfo, size: int, path: str) -> int:
    """Absolute offset of a member's first data byte, from its local header."""
    if not 0 <= info.header_offset < size:
        raise _invalid(path, f"member {printable(info.filename)} starts outside the file")
    f.seek(info.header_offset)
    raw = f.read(_LOCAL_HEADER.size)
    if len(raw) < _LOCAL_HEADER.size:
        raise _invalid(path, f"truncated: local header of {printable(info.filename)} is cut short")
    signature, name_len, extra_len = _LOCAL_HEADER.unpack(raw)
    if signature != _LOCAL_SIGNATURE:
        raise _invalid(path, f"bad local header signature for member {printable(info.filename)}")
    start: int = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
    if start + info.compress_size > size:
        raise _invalid(
            path, f"truncated: member {printable(info.filename)} does not fit in the file"
        )
    return start


def _members(
    zf: zipfile.ZipFile, f: IO[bytes], path: str, size: int
) -> list[tuple[str, zipfile.ZipInfo, int]]:
    """``(array name, info, data start)`` of every member, in archive order, validated.

    Members must not share bytes (see the module docstring): each one's extent,
    from its local header to the end of its data, is checked against the others.
    """
    out: list[tuple[str, zipfile.ZipInfo, int]] = []
    seen: set[str] = set()
    for info in zf.infolist():
        if info.is_dir() or not info.filename.endswith(".npy"):
            raise _invalid(path, f"member {printable(info.filename)} is not an .npy array")
        if info.flag_bits & 0x1:
            raise _invalid(path, f"member {printable(info.filename)} is encrypted")
        _check_sizes(info, size, path)
        name = info.filename.removesuffix(".npy")
        if name in seen:
            raise _invalid(path, f"member {printable(info.filename)} appears twice")
        seen.add(name)
        out.append((name, info, _data_start(f, info, size, path)))
    extents = sorted(
        ((info.header_offset, start + info.compress_size, info) for _, info, start in out),
        key=lambda extent: extent[:2],
    )
    for (_, end, first), (begin, _, second) in itertools.pairwise(extents):
        if begin < end:
            raise _invalid(
                path,
                f"members {printable(first.filename)} and {printable(second.filename)} overlap in "
                "the file (the zip directory points both at the same bytes); the file is damaged "
                "or forged",
            )
    return out


def _member_spec(
    name: str, info: zipfile.ZipInfo, header: NpyArrayHeader, offset: int | None, path: str
) -> TensorSpec:
    """The one validation of a member, for the header read and the whole read alike."""
    if header.header_size + header.nbytes != info.file_size:
        raise _invalid(
            path,
            f"member {printable(info.filename)} is {info.file_size} bytes but its .npy header "
            f"describes {header.header_size + header.nbytes}",
        )
    return parse_tensor_spec(
        name,
        header.dtype_name,
        header.shape,
        offset,
        path=path,
        room=_room(info) - header.header_size,
        source=f"member {printable(info.filename)}",
    )


def read_npz_members(f: IO[bytes], *, path: str, size: int) -> list[NpzMember]:
    """Read the headers of every member of an open ``.npz`` file.

    Only the zip directory, each stored member's local header and each member's
    ``.npy`` header are read (compressed members are inflated just far enough to
    reach their header).

    Parameters
    ----------
    f : binary file object
        Seekable.
    path : str
        Name of the file, for error messages.
    size : int
        File size in bytes.

    Returns
    -------
    list of NpzMember
        In archive order.

    Raises
    ------
    InvalidInputError
        If the archive is damaged or truncated, holds anything but ``.npy``
        arrays, or an array has a dtype gradpipe does not store.
    """
    out = []
    with _open_zip(f, path) as zf:
        for name, info, start in _members(zf, f, path, size):
            where = f"{printable(path, limit=PATH_LIMIT)}: member {printable(info.filename)}"
            crc: int | None = None
            if info.compress_type == zipfile.ZIP_STORED:
                f.seek(start)
                header = read_npy_header(f, where=where)
                offset: int | None = start + header.header_size
                f.seek(start)
                head = f.read(header.header_size)
                # The member's CRC-32 covers its header and its data; ingest reads the
                # data by range, so it is given the CRC-32 the data alone must have.
                crc = crc32_remove_prefix(info.CRC, zlib.crc32(head), header.nbytes)
            else:
                try:
                    with zf.open(info) as member:
                        header = read_npy_header(member, where=where)
                except InvalidInputError:
                    raise
                except _ZIP_ERRORS as exc:
                    raise _invalid(
                        path,
                        f"member {printable(info.filename)} is damaged ({reason(exc)})",
                    ) from None
                offset = None
            spec = _member_spec(name, info, header, offset if header.ranged else None, path)
            if header.ranged and crc is not None:
                spec = replace(spec, crc32=crc)
            out.append(NpzMember(name, header, offset, spec))
    return out


def read_npz_arrays(
    f: IO[bytes], *, path: str, size: int, names: Collection[str] | None = None
) -> dict[str, np.ndarray]:
    """Read whole arrays from an open ``.npz`` file, checking each member's CRC.

    Members are validated exactly as :func:`read_npz_members` validates them,
    before any of their data is allocated.

    Parameters
    ----------
    f : binary file object
        Seekable.
    path : str
        Name of the file, for error messages.
    size : int
        File size in bytes.
    names : collection of str, optional
        Arrays to read (all when ``None``).

    Returns
    -------
    dict of str to numpy.ndarray
        Canonical (C-ordered, little-endian) arrays, in archive order.
    """
    out = {}
    with _open_zip(f, path) as zf:
        for name, info, _ in _members(zf, f, path, size):
            if names is not None and name not in names:
                continue
            where = f"{printable(path, limit=PATH_LIMIT)}: member {printable(info.filename)}"
            try:
                with zf.open(info) as member:
                    header = read_npy_header(member, where=where)
                    spec = _member_spec(name, info, header, None, path)
                    # zipfile inflates piece by piece and never past file_size.
                    out[name] = read_npy_data(member, header, where=where)
                    check_tensor_values(spec, out[name], path=path)
                    # Reading to the end makes zipfile compare the CRC-32.
                    member.read()
            except InvalidInputError:
                raise
            except zipfile.BadZipFile as exc:
                if "CRC" not in str(exc):
                    raise _invalid(
                        path,
                        f"member {printable(info.filename)} is damaged ({reason(exc)})",
                    ) from None
                raise damaged(
                    path,
                    f"member {printable(info.filename)}",
                    ": its bytes do not have the CRC-32 the zip directory records",
                ) from None
            except _ZIP_ERRORS as exc:
                raise _invalid(
                    path,
                    f"member {printable(info.filename)} is damaged ({reason(exc)})",
                ) from None
    return out


class NpzReader:
    """The dump reader of ``.npz`` archives: one tensor per ``.npy`` member."""

    format = "npz"
    partial_header = True

    def parse_header(self, source: DumpSource) -> tuple[tuple[TensorSpec, ...], dict[str, str]]:
        """Every member's spec, in archive order; ``.npz`` files carry no metadata."""
        members = read_npz_members(source.file, path=source.path, size=source.size)
        return tuple(m.spec for m in members), {}

    def read_tensors(
        self, source: DumpSource, specs: Mapping[str, TensorSpec]
    ) -> dict[str, np.ndarray]:
        """The members named in ``specs``, validated as the header was."""
        source.file.seek(0)
        return read_npz_arrays(source.file, path=source.path, size=source.size, names=set(specs))


#: The reader :data:`gradpipe.formats.registry.READERS` names.
READER = NpzReader()
