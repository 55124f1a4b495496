"""Content ids: the name of every immutable object in a store.

An id is the BLAKE3 hash of an object's *logical* bytes (uncompressed,
canonical), written as ``b3:<64 hex digits>``; the prefix names the algorithm
so another one can be added without ambiguity. BLAKE3 is used because it is a
cryptographic hash at several GB/s on one core (SHA-256 manages ~1.5 GB/s).
"""

from __future__ import annotations

import re
from typing import Final, TypeGuard

import blake3
import numpy as np

from gradpipe.core.display import printable
from gradpipe.errors import InvalidInputError

__all__ = ["ID_PREFIX", "block_key", "hash_bytes", "id_from_block_key", "is_id", "parse_id"]

ID_PREFIX: Final = "b3:"
_ID_RE: Final = re.compile(r"b3:[0-9a-f]{64}")

# Below this size a thread pool costs more than it saves.
_PARALLEL_HASH_BYTES: Final = 64 * 2**20


def hash_bytes(data: bytes | bytearray | memoryview | np.ndarray) -> str:
    """Return the id of ``data``.

    >>> hash_bytes(b"")
    'b3:af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262'
    """
    view = memoryview(data)  # type: ignore[arg-type]  # numpy arrays are buffers
    threads = blake3.blake3.AUTO if view.nbytes >= _PARALLEL_HASH_BYTES else 1
    return ID_PREFIX + blake3.blake3(view, max_threads=threads).hexdigest()


def is_id(value: object) -> TypeGuard[str]:
    """True when ``value`` is a well-formed id string."""
    return isinstance(value, str) and _ID_RE.fullmatch(value) is not None


def parse_id(value: object) -> str:
    """Validate an id given by a user or read from a manifest."""
    if not is_id(value):
        raise InvalidInputError(
            f"{printable(value)} is not a gradpipe id; ids look like 'b3:' followed by 64 "
            "hex digits"
        )
    return value


def block_key(block_id: str) -> str:
    """The store key of a block: ``blocks/ab/cdef…``.

    Two hex digits of fan-out keep directories small on local disk and spread
    keys over S3 prefixes.
    """
    digest = parse_id(block_id)[len(ID_PREFIX) :]
    return f"blocks/{digest[:2]}/{digest[2:]}"


def id_from_block_key(key: str) -> str | None:
    """The id a ``blocks/…`` key names, None for any other file (e.g. a temporary one)."""
    block_id = ID_PREFIX + key.removeprefix("blocks/").replace("/", "")
    return block_id if key.startswith("blocks/") and is_id(block_id) else None
