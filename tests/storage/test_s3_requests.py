"""Requests an S3 store sends, counted by the loopback server: counts, never times.

On S3 a new block costs one request (a conditional PUT), not two (a HEAD,
then the PUT): blocks are created first, and only those the server answers
412 for have their age looked up, so a reused old block is still refreshed
(``docs/design/003-gc-safety.md``). While batches keep finding their blocks
stored, the store checks first again and sends no data it need not.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import gradpipe as gp
from gradpipe.ingestion.api import ingest
from gradpipe.storage.tensors import WRITE_WINDOW
from gradpipe.testing.s3server import S3Request, S3Server
from gradpipe.testing.training import TrainingConfig, write_sample_run

pytestmark = [pytest.mark.s3, pytest.mark.usefixtures("no_inline")]

BUCKET = "gradpipe-test"
CHUNK = 4096  # bytes: float32 chunks of 1024 values, each a block of its own


@pytest.fixture
def prefix() -> str:
    return uuid.uuid4().hex[:8]


@pytest.fixture
def store(s3_faults: S3Server, prefix: str) -> gp.Store:
    return gp.open_store(f"s3://{BUCKET}/{prefix}", mode="w")


def on_blocks(log: list[S3Request], prefix: str) -> Counter[tuple[str, int | None]]:
    """(method, moto's status) of the requests on blocks."""
    blocks = f"{BUCKET}/{prefix}/blocks/"
    return Counter((r.method, r.moto_status) for r in log if r.path.startswith(blocks))


def distinct(n_chunks: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n_chunks * CHUNK // 4).astype(np.float32)


def test_a_new_block_costs_one_put(s3_faults: S3Server, store: gp.Store, prefix: str) -> None:
    with s3_faults.lose_replies() as log:
        store.put_tensor(distinct(10, 0), chunk_bytes=CHUNK)
    assert on_blocks(log, prefix) == {
        ("PUT", 200): 10 + 1,  # ten chunks and the tensor's manifest
    }


def test_a_reused_old_block_is_refreshed_after_its_412(
    s3_faults: S3Server, store: gp.Store, prefix: str
) -> None:
    array = distinct(3, 1)
    tensor_id = store.put_tensor(array, chunk_bytes=CHUNK)
    keys = [i.key for i in store.backend.list("blocks")]
    assert len(keys) == 4
    old = time.time() - 7200  # older than storage.touch-after (1h)
    for key in keys:
        s3_faults.set_mtime(BUCKET, f"{prefix}/{key}", old)
    again = gp.open_store(store.url, mode="r+")  # a new writer expects new blocks
    with s3_faults.lose_replies() as log:
        assert again.put_tensor(array, chunk_bytes=CHUNK) == tensor_id
    # Each chunk's block: its create refused, then its age looked up, then a
    # fresh time; the manifest's batch comes after one that found everything
    # stored, so it is looked up first.
    assert on_blocks(log, prefix) == {("PUT", 412): 3, ("HEAD", 200): 4, ("PUT", 200): 4}
    blocks = f"{BUCKET}/{prefix}/blocks/"
    copies = [r for r in log if r.path.startswith(blocks) and r.moto_status == 200]
    assert all(r.headers == frozenset() for r in copies)  # copies onto themselves, no creates
    assert all(m is not None and m > old + 3600 for m in store.backend.mtimes(keys))
    assert again.write_stats.blocks_reused == 4
    assert again.write_stats.blocks_written == 0


def test_a_reused_recent_block_costs_a_put_and_a_head(
    s3_faults: S3Server, store: gp.Store, prefix: str
) -> None:
    array = distinct(3, 2)
    store.put_tensor(array, chunk_bytes=CHUNK)
    again = gp.open_store(store.url, mode="r+")
    with s3_faults.lose_replies() as log:
        again.put_tensor(array, chunk_bytes=CHUNK)
    assert on_blocks(log, prefix) == {("PUT", 412): 3, ("HEAD", 200): 3 + 1}  # + manifest


def test_batches_that_find_their_blocks_stored_check_first(
    s3_faults: S3Server, store: gp.Store, prefix: str
) -> None:
    windows = 3
    array = distinct(windows * WRITE_WINDOW, 3)
    store.put_tensor(array, chunk_bytes=CHUNK)
    with s3_faults.lose_replies() as log:
        store.put_tensor(array, chunk_bytes=CHUNK)
    # The first window is sent and refused; the rest, and the manifest, are only looked up.
    assert on_blocks(log, prefix) == {
        ("PUT", 412): WRITE_WINDOW,
        ("HEAD", 200): windows * WRITE_WINDOW + 1,
    }
    # New data again: one window checked first and found missing, then creates first.
    with s3_faults.lose_replies() as log:
        store.put_tensor(distinct(windows * WRITE_WINDOW, 4), chunk_bytes=CHUNK)
    assert on_blocks(log, prefix) == {
        ("HEAD", 404): WRITE_WINDOW,
        ("PUT", 200): windows * WRITE_WINDOW + 1,
    }


def _requests_of_ingest(server: S3Server, tmp_path: Path, steps: int) -> tuple[Counter[str], int]:
    sample = write_sample_run(
        tmp_path / f"d{steps}",
        TrainingConfig(vocab_size=300, embed_dim=8, hidden=8, peers=2, steps=steps),
    )
    store = gp.open_store(f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}", mode="w")
    with server.count_requests() as counts:
        report = ingest(store, sample.dump_pattern, run="r")
    assert report.ok
    assert report.ingested == 2 * steps
    return counts.by_operation, report.writes.blocks_written


def test_ingest_requests_per_dump(s3_faults: S3Server, tmp_path: Path) -> None:
    small, small_blocks = _requests_of_ingest(s3_faults, tmp_path, 2)
    large, large_blocks = _requests_of_ingest(s3_faults, tmp_path, 4)
    more_dumps = 4  # 4 steps x 2 peers, against 2 x 2
    # A lease's heartbeat refreshes its lock (a COPY) with time, not with dumps: a loaded
    # machine makes more of them in the longer ingest, or fewer.
    ops = (set(small) | set(large)) - {"COPY"}
    per_dump = {op: (large[op] - small[op]) / more_dumps for op in ops}
    blocks_per_dump = (large_blocks - small_blocks) / more_dumps
    assert blocks_per_dump > 1
    # One PUT per new object, nothing else grows with the run: no HEAD per
    # block, no read of the run per dump.
    assert {op: n for op, n in per_dump.items() if n} == {"PUT": blocks_per_dump}
    assert small["HEAD"] <= 4  # the lease's look at its lock; none for blocks
