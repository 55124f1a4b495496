"""Read numpy's ``.npz`` format: a zip archive of ``.npy`` members.

``np.savez`` stores members uncompressed (``ZIP_STORED``), so each array's bytes
sit contiguously in the archive and can be read by byte range; the offset is
computed from the member's *local* file header, whose extra field may differ in
length from the central directory's copy (``np.savez`` writes zip64 extras in
the local header only). ``np.savez_compressed`` deflates members; those are read
whole through :mod:`zipfile`, which also checks their CRC.

Like ``np.load(allow_pickle=False)``, pickled (object) members are refused from
their header, before anything is unpickled. Every member must be an ``.npy``
array: a zip holding anything else is not a gradient dump.
"""

from __future__ import annotations

import struct
import zipfile
import zlib
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, Final

import numpy as np

from gradpipe.errors import InvalidInputError
from gradpipe.formats.npy import NpyArrayHeader, read_npy_data, read_npy_header

__all__ = ["NpzMember", "read_npz_arrays", "read_npz_members"]

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
    """

    name: str
    header: NpyArrayHeader
    data_offset: int | None


def _invalid(path: str, what: str) -> InvalidInputError:
    return InvalidInputError(
        f"{path}: not a valid .npz file: {what}; write it with np.savez / np.savez_compressed "
        "and check that it was copied completely"
    )


@contextmanager
def _open_zip(f: IO[bytes], path: str) -> Iterator[zipfile.ZipFile]:
    try:
        zf = zipfile.ZipFile(f)
    except _ZIP_ERRORS as exc:
        raise _invalid(path, f"not a readable zip archive ({exc})") from None
    with zf:
        yield zf


def _members(zf: zipfile.ZipFile, path: str) -> list[tuple[str, zipfile.ZipInfo]]:
    """``(array name, info)`` of every member, in archive order, validated."""
    out: list[tuple[str, zipfile.ZipInfo]] = []
    seen: set[str] = set()
    for info in zf.infolist():
        if info.is_dir() or not info.filename.endswith(".npy"):
            raise _invalid(path, f"member {info.filename!r} is not an .npy array")
        if info.flag_bits & 0x1:
            raise _invalid(path, f"member {info.filename!r} is encrypted")
        name = info.filename.removesuffix(".npy")
        if name in seen:
            raise _invalid(path, f"member {info.filename!r} appears twice")
        seen.add(name)
        out.append((name, info))
    return out


def _stored_data_start(f: IO[bytes], info: zipfile.ZipInfo, size: int, path: str) -> int:
    """Absolute offset of a stored member's first byte, from its local header."""
    if not 0 <= info.header_offset < size:
        raise _invalid(path, f"member {info.filename!r} starts outside the file")
    f.seek(info.header_offset)
    raw = f.read(_LOCAL_HEADER.size)
    if len(raw) < _LOCAL_HEADER.size:
        raise _invalid(path, f"truncated: local header of {info.filename!r} is cut short")
    signature, name_len, extra_len = _LOCAL_HEADER.unpack(raw)
    if signature != _LOCAL_SIGNATURE:
        raise _invalid(path, f"bad local header signature for member {info.filename!r}")
    start: int = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
    if info.compress_size != info.file_size or start + info.file_size > size:
        raise _invalid(path, f"truncated: member {info.filename!r} does not fit in the file")
    return start


def _check_length(header: NpyArrayHeader, info: zipfile.ZipInfo, path: str) -> None:
    if header.header_size + header.nbytes != info.file_size:
        raise _invalid(
            path,
            f"member {info.filename!r} is {info.file_size} bytes but its .npy header "
            f"describes {header.header_size + header.nbytes}",
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
        for name, info in _members(zf, path):
            where = f"{path}: member {info.filename!r}"
            if info.compress_type == zipfile.ZIP_STORED:
                start = _stored_data_start(f, info, size, path)
                f.seek(start)
                header = read_npy_header(f, where=where)
                offset: int | None = start + header.header_size
            else:
                try:
                    with zf.open(info) as member:
                        header = read_npy_header(member, where=where)
                except InvalidInputError:
                    raise
                except _ZIP_ERRORS as exc:
                    raise _invalid(path, f"member {info.filename!r} is damaged ({exc})") from None
                offset = None
            _check_length(header, info, path)
            out.append(NpzMember(name, header, offset))
    return out


def read_npz_arrays(
    f: IO[bytes], *, path: str, names: Collection[str] | None = None
) -> dict[str, np.ndarray]:
    """Read whole arrays from an open ``.npz`` file, checking each member's CRC.

    Parameters
    ----------
    f : binary file object
        Seekable.
    path : str
        Name of the file, for error messages.
    names : collection of str, optional
        Arrays to read (all when ``None``).

    Returns
    -------
    dict of str to numpy.ndarray
        Canonical (C-ordered, little-endian) arrays, in archive order.
    """
    out = {}
    with _open_zip(f, path) as zf:
        for name, info in _members(zf, path):
            if names is not None and name not in names:
                continue
            where = f"{path}: member {info.filename!r}"
            try:
                with zf.open(info) as member:
                    header = read_npy_header(member, where=where)
                    _check_length(header, info, path)
                    out[name] = read_npy_data(member, header, where=where)
                    # Reading to the end makes zipfile compare the CRC-32.
                    member.read()
            except InvalidInputError:
                raise
            except _ZIP_ERRORS as exc:
                raise _invalid(path, f"member {info.filename!r} is damaged ({exc})") from None
    return out
