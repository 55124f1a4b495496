"""Where gradpipe may write a file a user asked for (``export -o``, later ``restore -o``).

An output is written through a temporary file and a rename in its directory,
which replaces whatever the name held. So before writing, a local output path
must name a regular file or nothing: never a symlink (the rename would replace
the link, not write where it points), a FIFO, a device (``-o /dev/null`` as
root would replace the system's), a directory or a socket; and never a path
inside a gradpipe store, whose objects it could overwrite.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from gradpipe.core.display import PATH_LIMIT, printable
from gradpipe.errors import InvalidInputError
from gradpipe.storage.marker import MARKER_KEY

__all__ = ["parse_output_path", "store_root_of"]

_KINDS = {
    stat.S_IFLNK: "a symbolic link",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFDIR: "a directory",
    stat.S_IFSOCK: "a socket",
}


def parse_output_path(
    path: str | os.PathLike[str], *, what: str = "output path", store_url: str | None = None
) -> str:
    """Check that ``path`` is a place gradpipe may write a new file; returns it.

    Parameters
    ----------
    path : str or path
        A local path, ``file://`` URL, or a remote fsspec URL.
    what : str
        How the message names the path (the CLI says ``-o``).
    store_url : str, optional
        The URL of the store being read: a remote output under it is refused
        too (local outputs are refused inside *any* local store).

    Raises
    ------
    InvalidInputError
        For an empty name, a missing directory, an existing non-regular file,
        or a path inside a store.
    """
    text = os.fspath(path)
    if "://" in text and not text.lower().startswith("file://"):
        if store_url is not None and text.rstrip("/").startswith(store_url.rstrip("/") + "/"):
            raise InvalidInputError(
                f"{what} {printable(text, limit=PATH_LIMIT)} is inside the store "
                f"{store_url}; writing there could "
                "overwrite stored objects. Write it outside the store"
            )
        return text
    local = text[len("file://") :] if text.lower().startswith("file://") else text
    if not local or local.endswith(("/", os.sep)) or Path(local).name in ("", ".", ".."):
        raise InvalidInputError(
            f"{what} needs a file name, got {printable(text, limit=PATH_LIMIT)}"
        )
    try:
        info = os.lstat(local)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise InvalidInputError(
            f"cannot check {what} {printable(text, limit=PATH_LIMIT)}: {exc.strerror}"
        ) from None
    else:
        if not stat.S_ISREG(info.st_mode):
            kind = _KINDS.get(stat.S_IFMT(info.st_mode), "not a regular file")
            raise InvalidInputError(
                f"{what} {printable(text, limit=PATH_LIMIT)} exists and is {kind}; "
                "gradpipe replaces only "
                "regular files. "
                "Give another path, or remove it first"
            )
    root = store_root_of(local)
    if root is not None:
        raise InvalidInputError(
            f"{what} {printable(text, limit=PATH_LIMIT)} is inside the gradpipe store at "
            f"{root}; writing there could "
            "overwrite stored objects. Write it outside the store"
        )
    parent = Path(os.path.abspath(local)).parent
    if not parent.is_dir():
        raise InvalidInputError(
            f"{what} {printable(text, limit=PATH_LIMIT)}: the directory {parent} does not "
            "exist; create it first"
        )
    return text


def store_root_of(path: str | os.PathLike[str]) -> str | None:
    """The root of the local gradpipe store ``path`` would be inside, if any.

    The directory that will hold ``path`` and every one above it are checked
    for a store marker, after resolving symlinks (``link-to-store/x`` is inside).
    """
    directory = Path(os.path.realpath(Path(os.path.abspath(path)).parent))
    for candidate in (directory, *directory.parents):
        if (candidate / MARKER_KEY).is_file():
            return str(candidate)
    return None
