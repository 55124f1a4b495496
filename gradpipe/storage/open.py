"""Opening a store from a URL: the mode rules."""

from __future__ import annotations

import os
from typing import Any, get_args

from gradpipe.core.display import PATH_LIMIT, printable
from gradpipe.errors import InvalidInputError, NotFoundError
from gradpipe.storage.backend import TEMP_PREFIX, Backend
from gradpipe.storage.marker import MARKER_KEY, marker_bytes, read_marker
from gradpipe.storage.registry import backend_for_url
from gradpipe.storage.store import Mode, Store

__all__ = ["open_store"]


def open_store(
    url: str | os.PathLike[str],
    *,
    mode: Mode = "r",
    storage_options: dict[str, Any] | None = None,
) -> Store:
    """Open (or create) a gradpipe store.

    Parameters
    ----------
    url : str
        A local path, ``file://`` URL, ``s3://bucket/prefix`` or
        ``memory://name`` (a store held in this process). S3 endpoint and
        credentials come from ``storage_options`` or the usual AWS environment
        (``AWS_ENDPOINT_URL_S3``, ``AWS_ACCESS_KEY_ID``, ...).
    mode : {"r", "r+", "a", "w", "w-"}
        ``"r"`` read an existing store; ``"r+"`` read and write an existing
        store (never creates one: a mistyped path is an error); ``"a"`` read
        and write, creating the store if absent; ``"w"`` create, deleting an
        existing store's content; ``"w-"`` create, failing if a store exists.
        A non-empty location that is not a gradpipe store is never written to.
    storage_options : dict, optional
        Passed to the fsspec filesystem (e.g. ``{"endpoint_url": ...}``).
    """
    if mode not in get_args(Mode):
        raise InvalidInputError(f"mode must be one of {get_args(Mode)}, got {printable(mode)}")
    url = os.fspath(url)
    backend = backend_for_url(url, storage_options)
    marker = read_marker(backend)
    if marker is None:
        if mode in ("r", "r+"):
            raise NotFoundError(
                f"no gradpipe store at {printable(url, limit=PATH_LIMIT)}; check the path, or "
                "create one with "
                f"`gradpipe init {printable(url, limit=PATH_LIMIT)}` (open_store(..., mode='a'))"
            )
        _check_empty(backend, url)
        if not backend.write_if_absent(MARKER_KEY, marker_bytes()):
            read_marker(backend)  # another opener's, made since we looked: checked, then used
    elif mode == "w-":
        raise InvalidInputError(
            f"a gradpipe store already exists at {printable(url, limit=PATH_LIMIT)} (mode='w-')"
        )
    elif mode == "w":
        backend.delete_all()
        backend.write_if_absent(MARKER_KEY, marker_bytes())
    # Local stores travel as absolute paths: a worker with another working
    # directory must reach the same store.
    where = backend.url if url_is_local(url) else url
    return Store(backend, mode=mode, url=where, storage_options=storage_options)


def url_is_local(url: str) -> bool:
    """True for a plain path or a ``file://`` URL."""
    return "://" not in url or url.split("://", 1)[0].lower() in ("file", "local")


def _check_empty(backend: Backend, url: str) -> None:
    try:
        # Temporary files of a writer killed while creating the marker do not count, nor a
        # marker that another process opening this new store made since we looked for it.
        stray = next(
            (k for k in backend.list("") if TEMP_PREFIX not in k.key and k.key != MARKER_KEY),
            None,
        )
    except (NotFoundError, FileNotFoundError):
        return
    if stray is not None:
        raise InvalidInputError(
            f"{printable(url, limit=PATH_LIMIT)} is not a gradpipe store and is not empty (it "
            f"holds {printable(stray.key, limit=PATH_LIMIT)}); choose an empty or new location"
        )
