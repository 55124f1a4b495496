"""gradpipe's settings, in the ``gradpipe`` namespace of Dask's configuration.

Set them like any Dask setting: ``dask.config.set({"gradpipe.chunk-bytes": 8 << 20})``,
a YAML file in ``~/.config/dask/``, or ``DASK_GRADPIPE__CHUNK_BYTES=8388608``.
"""

from __future__ import annotations

import copy
import threading
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from types import ModuleType

__all__ = ["DEFAULTS", "all_settings", "get_bytes", "get_seconds", "get_setting"]

DEFAULTS: Final[dict[str, Any]] = {
    "gradpipe": {
        # Bytes of raw tensor data per chunk: big enough that per-chunk costs
        # (a block, a request) vanish, small enough to decode in a few ms.
        "chunk-bytes": "4 MiB",
        # Chunks whose encoded block is at most this big live inside their tensor
        # manifest instead of an object of their own: a bias or LayerNorm vector
        # then costs no file (~1 ms to create on a local disk, a request on S3).
        # 0 turns inlining off.
        "inline-bytes": "8 KiB",
        # zstd level of the default lossless codecs (1 measured best for float planes).
        "codec-level": 1,
        # A process keeps a copy of the last snapshot it wrote of each name, up
        # to this size, so that the next one needs no read to delta against it.
        "snapshot-cache-bytes": "4 GiB",
        "storage": {
            # Requests in flight per store for batched S3 reads and writes.
            "concurrency": 32,
            # fsync local blocks and refs: survives power loss, costs write speed.
            "fsync": False,
            # A dedup hit on a block older than this refreshes its time, so a
            # concurrent gc cannot take a block a writer is about to reference.
            "touch-after": "1h",
            # How S3 requests are retried (botocore's retry configuration; see
            # gradpipe/storage/retries.py): "standard" backs off exponentially
            # with jitter, "adaptive" also slows down when throttled. Attempts
            # count the first one: 5 gives up on a dead endpoint after 7.5 s per
            # request on average, as botocore's old default did; raise it for a flaky one.
            # Explicit storage_options and AWS_RETRY_MODE / AWS_MAX_ATTEMPTS win.
            "retries": {"mode": "standard", "max-attempts": 5},
        },
        "ingest": {
            # Raw bytes one read/encode task handles: tens of MiB amortise
            # task overhead and still spread a run over every core.
            "task-bytes": "32 MiB",
        },
        "gc": {
            # Unreferenced blocks younger than this are kept, whatever the lock
            # says: a margin for writes that took no lease (see docs/design/003).
            "grace": "24h",
        },
        "rounds": {
            # An aggregation's claim of a step older than this is taken for that
            # of a dead process and may be replaced: longer than your longest
            # aggregation of one call, short enough that a crash frees the steps.
            "claim-ttl": "1h",
        },
        "lock": {
            # A lock object not refreshed for this long belongs to a dead
            # holder and is ignored (holders refresh every quarter of it).
            "ttl": "5m",
            # How long a writer waits for gc (and gc for writers) before giving up.
            "wait": "10m",
            # Pause between looks at the lock while waiting (jittered).
            "poll": "1s",
        },
        # Largest tensor one dump file may hold, in bytes, whatever its format:
        # an absolute cap on what one file can make a worker allocate. Below it,
        # a tensor may never claim more than its file can supply (its byte range;
        # 1032x a deflated npz member; a torch tensor's storage), see formats/spec.py.
        # 64 GiB is above any single tensor of today's largest models' shards.
        "max-tensor-bytes": "64 GiB",
    }
}

_LOADED: list[ModuleType] = []
_LOADING = threading.Lock()


def _dask_config() -> ModuleType:
    """``dask.config``, with gradpipe's defaults merged in, imported on the first setting read.

    Importing dask costs about 0.1 s (most of ``gradpipe ls``); commands that
    read no setting (``ls``, ``export``) never pay it.
    """
    if not _LOADED:
        with _LOADING:
            if not _LOADED:
                import dask.config

                dask.config.update_defaults(DEFAULTS)
                _LOADED.append(dask.config)
    return _LOADED[0]


def get_setting(key: str) -> Any:
    """One ``gradpipe.*`` setting (its default when the configuration has none).

    The defaults are also looked up here, not only merged at import: a module
    first imported inside ``with dask.config.set(...)`` has its merged defaults
    undone when the block ends (dask restores the configuration it saved), and
    gradpipe's modules are imported lazily, so that happens.
    """
    value = _dask_config().get(f"gradpipe.{key}", default=_UNSET)
    return _default(key) if value is _UNSET else value


def all_settings() -> dict[str, Any]:
    """Every ``gradpipe.*`` setting in effect (defaults merged), as a nested dict copy."""
    return copy.deepcopy(_dask_config().get("gradpipe", default={}))


_UNSET: Final = object()


def _default(key: str) -> Any:
    node: Any = DEFAULTS["gradpipe"]
    for part in key.split("."):
        if not isinstance(node, dict):
            raise KeyError(f"gradpipe.{key}")
        node = node.get(part, node.get(part.replace("_", "-"), _UNSET))
        if node is _UNSET:
            raise KeyError(f"gradpipe.{key}")
    return node


def get_bytes(key: str) -> int:
    """A size setting, in bytes (accepts ``"4 MiB"`` or an int)."""
    from dask.utils import parse_bytes

    return int(parse_bytes(get_setting(key)))


def get_seconds(key: str) -> float:
    """A duration setting, in seconds (accepts ``"24h"`` or a number)."""
    from dask.utils import parse_timedelta

    return float(parse_timedelta(get_setting(key), default="s"))
