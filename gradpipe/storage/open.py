"""Opening a store from a URL: the choice of backend and the mode rules."""

from __future__ import annotations

import os
import threading
from typing import Any, get_args

import fsspec
from dask.base import tokenize

from gradpipe.errors import InvalidInputError, NotFoundError
from gradpipe.storage._backend import TEMP_PREFIX, Backend
from gradpipe.storage._local import LocalBackend
from gradpipe.storage.store import MARKER_KEY, Mode, Store, marker_bytes, read_marker

__all__ = ["backend_for_url", "open_store", "reopen_store"]

_LOCAL = {"file", "local"}
_S3 = {"s3", "s3a"}


def backend_for_url(url: str, storage_options: dict[str, Any] | None = None) -> Backend:
    """The backend for a local path, ``file://`` or ``s3://`` URL."""
    if not isinstance(url, str | os.PathLike) or not str(url):
        raise InvalidInputError(f"store URL must be a non-empty string, got {url!r}")
    url = os.fspath(url)
    scheme = url.split("://", 1)[0].lower() if "://" in url else "file"
    if scheme in _LOCAL:
        from gradpipe.storage._local import LocalBackend

        path = url.split("://", 1)[1] if "://" in url else url
        return LocalBackend(os.path.abspath(os.path.expanduser(path)))
    if scheme in _S3:
        try:
            fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
        except ImportError:
            raise InvalidInputError(
                f"{url}: S3 stores need s3fs; install it with `pip install 'gradpipe[s3]'`"
            ) from None
        from gradpipe.storage._s3 import S3Backend

        if not path.strip("/"):
            raise InvalidInputError(f"{url}: name a bucket, as in s3://bucket/prefix")
        return S3Backend(fs, path)
    raise InvalidInputError(
        f"unsupported store URL scheme {scheme!r} in {url!r}; "
        "use a local path, file:// or s3://bucket/prefix"
    )


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
        A local path, ``file://`` URL or ``s3://bucket/prefix``. S3 endpoint
        and credentials come from ``storage_options`` or the usual AWS
        environment (``AWS_ENDPOINT_URL_S3``, ``AWS_ACCESS_KEY_ID``, ...).
    mode : {"r", "a", "w", "w-"}
        ``"r"`` read an existing store; ``"a"`` read and write, creating the
        store if absent; ``"w"`` create, deleting an existing store's content;
        ``"w-"`` create, failing if a store exists. A non-empty location that
        is not a gradpipe store is never written to.
    storage_options : dict, optional
        Passed to the fsspec filesystem (e.g. ``{"endpoint_url": ...}``).
    """
    if mode not in get_args(Mode):
        raise InvalidInputError(f"mode must be one of {get_args(Mode)}, got {mode!r}")
    url = os.fspath(url)
    backend = backend_for_url(url, storage_options)
    marker = read_marker(backend)
    if marker is None:
        if mode == "r":
            raise NotFoundError(
                f"no gradpipe store at {url}; create one with `gradpipe init {url}` "
                "or open_store(..., mode='a')"
            )
        _check_empty(backend, url)
        backend.write_if_absent(MARKER_KEY, marker_bytes())
    elif mode == "w-":
        raise InvalidInputError(f"a gradpipe store already exists at {url} (mode='w-')")
    elif mode == "w":
        backend.delete_all()
        backend.write_if_absent(MARKER_KEY, marker_bytes())
    # Local stores travel as absolute paths: a worker with another working
    # directory must reach the same store.
    where = backend.url if isinstance(backend, LocalBackend) else url
    return Store(backend, mode=mode, url=where, storage_options=storage_options)


_REOPENED: dict[str, Store] = {}
_REOPENED_MAX = 64
_REOPENED_LOCK = threading.Lock()


def reopen_store(url: str, mode: Mode, storage_options: dict[str, Any] | None) -> Store:
    """Open a store received from another process: it must exist (never created or wiped).

    A Dask worker unpickles the store once per task; opening is cached per
    process so that costs one marker read, not one per task.
    """
    key = tokenize(url, mode == "r", storage_options)
    with _REOPENED_LOCK:
        store = _REOPENED.get(key)
        if store is None:
            if len(_REOPENED) >= _REOPENED_MAX:
                _REOPENED.pop(next(iter(_REOPENED)))
            store = open_store(url, mode="r", storage_options=storage_options)
            store.mode = "r" if mode == "r" else "a"
            _REOPENED[key] = store
        return store


def _check_empty(backend: Backend, url: str) -> None:
    try:
        # Temporary files of a writer killed while creating the marker do not count.
        stray = next((k for k in backend.list("") if TEMP_PREFIX not in k.key), None)
    except (NotFoundError, FileNotFoundError):
        return
    if stray is not None:
        raise InvalidInputError(
            f"{url} is not a gradpipe store and is not empty (it holds {stray.key!r}); "
            "choose an empty or new location"
        )
