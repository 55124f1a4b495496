"""Names given by users or read from dumps: run, peer, snapshot and ref names.

Names become parts of store keys, so they are checked before anything is
written: no path separators, no ``..``, no control characters, nothing that
could escape the store root or mean different things on different backends.
"""

from __future__ import annotations

import re
from typing import Final

from gradpipe.errors import InvalidInputError

__all__ = ["parse_name", "parse_ref_name"]

_NAME_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+=@-]{0,199}")
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
        raise InvalidInputError(f"invalid {what} {name!r}: {_RULE}")
    return name


def parse_ref_name(name: object) -> str:
    """Validate a ref name: ``<kind>/<name>``, e.g. ``runs/run-7``.

    >>> parse_ref_name("tags/best")
    'tags/best'
    """
    if not isinstance(name, str) or name.count("/") != 1:
        raise InvalidInputError(f"invalid ref name {name!r}: expected '<kind>/<name>'")
    kind, rest = name.split("/")
    parse_name(kind, what="ref kind")
    parse_name(rest, what="ref name")
    return name
