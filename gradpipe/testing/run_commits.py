"""Tiny real dumps committed through the ingest's own commit: runs of any size, fast.

A run of 20,000 dumps takes minutes to ingest from files; what its size
costs is in the commit (``gradpipe.ingestion.tasks.commit_run``), which
does not care how a dump was read. These helpers store one tiny dump per
(step, peer) (a 4-value tensor kept inside the dump's manifest) and commit
them as the ingest does: for the scale benchmark and tests of runs in shards.
Hold ``store.writing(...)`` around a write and its commit, as an ingest holds
its lease, when a gc may run meanwhile.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from gradpipe.core.manifest import manifest_id
from gradpipe.core.run_manifest import DumpEntry, DumpManifest, TensorSchema
from gradpipe.ingestion.discover import DumpFile
from gradpipe.ingestion.tasks import CommitResult, DumpResult, commit_run
from gradpipe.storage.blocks import WriteStats
from gradpipe.storage.store import Store

__all__ = ["commit_tiny_dumps", "write_tiny_dumps"]

_SCHEMA = {"w": TensorSchema("float32", (4,))}


def write_tiny_dumps(
    store: Store, run: str, keys: Sequence[tuple[int, str]], *, version: int = 0
) -> list[DumpResult]:
    """Store one tiny dump per ``(step, peer)`` (one batched write); not yet in the run.

    ``version`` changes the values, so the same key can be written again as
    another version of its file.
    """
    manifests, entries = [], []
    for step, peer in keys:
        values = np.array([step, version, len(peer), 1], dtype=np.float32)
        tensor = store.write_tensor(values)
        tensor_id = manifest_id(tensor)
        fingerprint = f"tiny-{step}-{peer}-{version}"
        manifests.append(
            DumpManifest(
                run,
                step,
                peer,
                (("w", tensor_id),),
                source={"path": f"tiny/{step}/{peer}", "fingerprint": fingerprint},
                embedded={tensor_id: tensor},
            )
        )
        entries.append((step, peer, fingerprint))
    ids = store.put_manifests(manifests)
    return [
        DumpResult(DumpEntry(step, peer, dump_id, fingerprint), dict(_SCHEMA), WriteStats(), 16, {})
        for (step, peer, fingerprint), dump_id in zip(entries, ids, strict=True)
    ]


def commit_tiny_dumps(
    store: Store, run: str, results: Sequence[DumpResult], *, replace: bool = False
) -> CommitResult:
    """Commit dumps from :func:`write_tiny_dumps` with the ingest's commit (one ref swap)."""
    files = [
        DumpFile(e.step, e.peer, f"tiny/{e.step}/{e.peer}", 16, e.fingerprint)
        for e in (r.entry for r in results)
    ]
    with store.writing(f"commit tiny dumps into run {run}") as lease:
        return commit_run(
            store,
            run,
            files,
            list(results),
            f"commit {len(results)} tiny dumps",
            replace,
            lease.key if lease is not None else None,
        )
