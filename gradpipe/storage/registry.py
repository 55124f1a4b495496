"""Which backend serves a store URL: one explicit table of schemes, imported lazily."""

from __future__ import annotations

import importlib
import os
from typing import Any, Final

from gradpipe.core.display import PATH_LIMIT, printable
from gradpipe.errors import InvalidInputError
from gradpipe.storage.backend import Backend

__all__ = ["BACKENDS", "backend_for_url", "url_scheme"]

#: URL scheme → ``"module:factory"``; a factory takes ``(url, path, storage_options)``.
BACKENDS: Final[dict[str, str]] = {
    "file": "gradpipe.storage._local:from_url",
    "local": "gradpipe.storage._local:from_url",
    "memory": "gradpipe.storage._memory:from_url",
    "s3": "gradpipe.storage._s3:from_url",
    "s3a": "gradpipe.storage._s3:from_url",
}


def url_scheme(url: str) -> str:
    """The scheme of a store URL (``file`` for a plain path)."""
    return url.split("://", 1)[0].lower() if "://" in url else "file"


def backend_for_url(url: str, storage_options: dict[str, Any] | None = None) -> Backend:
    """The backend for a local path, ``file://``, ``memory://`` or ``s3://`` URL.

    Raises :class:`InvalidInputError` for an empty URL or a scheme gradpipe
    has no backend for; nothing is created or written.
    """
    if not isinstance(url, str | os.PathLike) or not str(url):
        raise InvalidInputError(
            f"store URL must be a non-empty string, got {printable(url, limit=PATH_LIMIT)}"
        )
    url = os.fspath(url)
    scheme = url_scheme(url)
    try:
        module_name, _, attr = BACKENDS[scheme].partition(":")
    except KeyError:
        raise InvalidInputError(
            f"unsupported store URL scheme {printable(scheme)} in "
            f"{printable(url, limit=PATH_LIMIT)}; "
            "use a local path, file://, memory:// or s3://bucket/prefix"
        ) from None
    factory = getattr(importlib.import_module(module_name), attr)
    path = url.split("://", 1)[1] if "://" in url else url
    backend: Backend = factory(url, path, dict(storage_options or {}))
    return backend
