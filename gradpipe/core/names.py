"""Names given by users or read from dumps: run, peer, snapshot, ref and tensor names.

Names become parts of store keys, so they are checked before anything is
written: no path separators, no ``..``, no control characters, nothing that
could escape the store root or mean different things on different backends.
Tensor names are looser (any text without control characters): they are kept
in manifests, never used as store keys.
"""

from __future__ import annotations

import re
import unicodedata
from typing import Final

from gradpipe.core.display import printable
from gradpipe.errors import InvalidInputError

__all__ = ["MAX_NAME_LENGTH", "parse_name", "parse_ref_name", "parse_tensor_name"]

_NAME_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+=@-]{0,199}")
#: Longest tensor name accepted, in characters (real names are a few dozen).
MAX_NAME_LENGTH: Final = 1024
_RULE: Final = (
    "use 1-200 characters from letters, digits and . _ + = @ -, starting with a letter "
    "or digit, without '..'"
)


def parse_name(name: object, *, what: str = "name") -> str:
    """Validate one name (a single key segment).

    >>> parse_name("run-7")
    'run-7'
    """
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or ".." in name:
        raise InvalidInputError(f"invalid {what} {printable(name)}: {_RULE}")
    return name


def parse_ref_name(name: object) -> str:
    """Validate a ref name: ``<kind>/<name>``, e.g. ``runs/run-7``.

    >>> parse_ref_name("tags/best")
    'tags/best'
    """
    if not isinstance(name, str) or name.count("/") != 1:
        raise InvalidInputError(f"invalid ref name {printable(name)}: expected '<kind>/<name>'")
    kind, rest = name.split("/")
    parse_name(kind, what="ref kind")
    parse_name(rest, what="ref name")
    return name


def parse_tensor_name(name: object, *, where: str) -> str:
    """Validate a tensor name read from a dump.

    Names are kept in manifests (UTF-8 JSON) and shown in reports and as
    xarray variables, so they must be non-empty text without control
    characters. They are never used as store keys.
    """
    if not isinstance(name, str) or not name:
        raise InvalidInputError(f"{where}: a tensor name is empty or not a string; rename it")
    if len(name) > MAX_NAME_LENGTH:
        raise InvalidInputError(
            f"{where}: tensor name {printable(name)} is longer than {MAX_NAME_LENGTH} "
            "characters; rename it"
        )
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidInputError(
            f"{where}: tensor name {printable(name)} is not valid UTF-8 text (a lone "
            "surrogate); rename it"
        ) from None
    if any(unicodedata.category(c) == "Cc" for c in name):
        raise InvalidInputError(
            f"{where}: tensor name {printable(name)} holds control characters; rename it"
        )
    return name
