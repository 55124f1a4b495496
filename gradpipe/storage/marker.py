"""The store marker: the ``gradpipe.json`` whose presence makes a location a store.

Every backend goes through these functions, so a damaged or foreign marker
reads the same everywhere, and only a marker with a ``format`` newer than this
gradpipe reads asks the user to upgrade.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, Final

from gradpipe.core.display import printable
from gradpipe.core.encoding import from_json_bytes, to_json_bytes
from gradpipe.errors import IntegrityError, NotFoundError, UnsupportedFormatError
from gradpipe.storage.backend import Backend

__all__ = ["MARKER_KEY", "STORE_FORMAT", "marker_bytes", "read_marker"]

#: The key whose presence makes a directory or prefix a gradpipe store.
MARKER_KEY: Final = "gradpipe.json"
#: Store layout version this gradpipe writes and the newest it reads.
STORE_FORMAT: Final = 1


def read_marker(backend: Backend) -> dict[str, Any] | None:
    """The store marker, None if there is none; checks the layout version.

    Raises :class:`IntegrityError` for a marker that is not gradpipe's or is
    damaged, and :class:`UnsupportedFormatError` for a newer layout.
    """
    where = f"{backend.url}/{MARKER_KEY}"
    try:
        data = backend.read(MARKER_KEY)
    except NotFoundError:
        return None
    try:
        doc = from_json_bytes(data, what=where)
    except Exception as exc:
        raise IntegrityError(
            f"{where} is damaged ({exc}); it should be gradpipe's store marker. If this is a "
            "gradpipe store, restore the file from a backup or another copy of the store"
        ) from None
    if not isinstance(doc, dict) or doc.get("gradpipe") != "store":
        raise IntegrityError(
            f"{where} exists but is not gradpipe's store marker; this location holds "
            "something else, choose another one"
        )
    version = doc.get("format")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise IntegrityError(
            f"{where} is damaged: its 'format' is {printable(version)}, expected a layout "
            "number such "
            f"as {STORE_FORMAT}; restore the file or rewrite it with "
            f'{{"gradpipe": "store", "format": {STORE_FORMAT}}}'
        )
    if version > STORE_FORMAT:
        raise UnsupportedFormatError(
            f"store {backend.url} has format {version}, newer than this gradpipe reads "
            f"({STORE_FORMAT}); upgrade gradpipe"
        )
    return doc


def marker_bytes() -> bytes:
    """The content of a new store's marker."""
    from gradpipe._version import __version__

    return to_json_bytes(
        {
            "gradpipe": "store",
            "format": STORE_FORMAT,
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
            "created_by": f"gradpipe {__version__}",
        }
    )
