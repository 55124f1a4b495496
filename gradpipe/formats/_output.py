"""Write one output file: a local path atomically, a remote URL in one upload.

Shared by every writer of :mod:`gradpipe.formats`, so all of them leave either
the old file or the whole new one behind, never half of one.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO

__all__ = ["write_output"]


def write_output(
    path_or_file: str | os.PathLike[str] | IO[bytes],
    write: Callable[[IO[bytes]], None],
    storage_options: Mapping[str, object] | None,
) -> None:
    """Call ``write`` on the open output: a local file atomically, a URL in one upload."""
    if not isinstance(path_or_file, str | os.PathLike):
        write(path_or_file)
        return
    path = os.fspath(path_or_file)
    if "://" in path and not path.startswith("file://"):
        import fsspec

        with fsspec.open(path, "wb", **(storage_options or {})) as f:
            write(f)
        return
    target = Path(path.removeprefix("file://"))
    tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp")
    # Not mkstemp: its 0600 would outlive the rename; a new file gets the umask's mode.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            # The rename must not reach the disk before the data: after a crash
            # the name holds the old file or the whole new one, never an empty one.
            os.fsync(f.fileno())
        Path(tmp).replace(target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
