"""Lost replies on the wire: a real S3 server on loopback whose answers go missing.

The fault layer of :class:`S3Server` lets a request reach moto and then
answers 503, so botocore retries it: the retried conditional PUT meets the
write it retries and gets a 412. gradpipe must take that for what it is.
"""

from __future__ import annotations

import uuid
from collections.abc import Container, Iterator
from pathlib import Path

import dask.config
import numpy as np
import pytest

import gradpipe as gp
from gradpipe.errors import StorageError
from gradpipe.testing.s3server import LostReply, S3Request, S3Server

BUCKET = "gradpipe-test"
REF = "tags/x"

pytestmark = pytest.mark.s3


@pytest.fixture
def prefix(s3_faults: S3Server) -> str:
    return uuid.uuid4().hex[:8]


@pytest.fixture
def few_attempts() -> Iterator[None]:
    """botocore gives up after 3 attempts, not 5: what the tests of giving up wait for."""
    with dask.config.set({"gradpipe.storage.retries.max-attempts": 3}):
        yield


@pytest.fixture
def store(prefix: str) -> gp.Store:
    return gp.open_store(f"s3://{BUCKET}/{prefix}", mode="w")


def about(log: list[S3Request], path: str) -> list[tuple[int | None, int]]:
    """(moto's status, the status sent) of every PUT of ``path``."""
    return [(r.moto_status, r.status) for r in log if r.method == "PUT" and r.path == path]


def test_block_put_whose_reply_was_lost_is_stored_once(
    s3_faults: S3Server, store: gp.Store, prefix: str
) -> None:
    array = np.arange(5000, dtype=np.float32)
    rule = LostReply("PUT", f"{BUCKET}/{prefix}/blocks/*", calls={1})
    with s3_faults.lose_replies(rule) as log:
        tensor_id = store.put_tensor(array, name="w")
    assert rule.fired == 1
    [lost] = [r for r in log if r.status == 503]
    # moto stored it, the client retried, and the retry was refused: written once.
    assert about(log, lost.path) == [(200, 503), (412, 412)]
    assert lost.headers == {"If-None-Match"}
    assert store.refs.get("tensors/w") == tensor_id
    assert store.get_tensor(tensor_id).tobytes() == array.tobytes()
    assert gp.verify(store).ok


@pytest.mark.parametrize("header", ["If-Match", "If-None-Match"])
def test_ref_swap_whose_reply_was_lost_is_our_commit(
    s3_faults: S3Server, store: gp.Store, prefix: str, header: str
) -> None:
    a = store.put_tensor(np.ones(3))
    b = store.put_tensor(np.zeros(3))
    if header == "If-Match":
        store.refs.set(REF, a, expected=None)
    key = f"{BUCKET}/{prefix}/refs/{REF}"
    rule = LostReply("PUT", key, calls={1}, header=header)
    with s3_faults.lose_replies(rule) as log:
        if header == "If-Match":
            entry = store.refs.set(REF, b, expected=a)
        else:
            entry = store.refs.set(REF, b, expected=None)
    assert rule.fired == 1
    assert about(log, key) == [(200, 503), (412, 412)]
    expected_history = [b, a] if header == "If-Match" else [b]
    assert [e.target for e in store.refs.history(REF)] == expected_history
    assert store.refs.list()[REF].write_id == entry.write_id


@pytest.mark.slow
@pytest.mark.usefixtures("few_attempts")
def test_ref_swap_whose_every_reply_was_lost_is_still_our_commit(
    s3_faults: S3Server, store: gp.Store, prefix: str
) -> None:
    # botocore gives up; reading the ref back shows that our first attempt landed.
    a = store.put_tensor(np.ones(3))
    b = store.put_tensor(np.zeros(3))
    store.refs.set(REF, a, expected=None)
    key = f"{BUCKET}/{prefix}/refs/{REF}"
    with s3_faults.lose_replies(LostReply("PUT", key)) as log:
        entry = store.refs.set(REF, b, expected=a)
    puts = about(log, key)
    assert puts[0] == (200, 503)
    assert len(puts) > 1
    assert all(p == (412, 503) for p in puts[1:])
    assert [e.target for e in store.refs.history(REF)] == [b, a]
    assert store.refs.list()[REF].write_id == entry.write_id


@pytest.mark.slow
@pytest.mark.usefixtures("few_attempts")
def test_block_put_whose_every_reply_was_lost_then_rerun(
    s3_faults: S3Server, store: gp.Store, prefix: str
) -> None:
    array = np.arange(5000, dtype=np.float32)
    pattern = f"{BUCKET}/{prefix}/blocks/*"
    with s3_faults.lose_replies(LostReply("PUT", pattern)) as log, pytest.raises(StorageError):
        store.put_tensor(array, name="w")
    landed = {r.path for r in log if r.moto_status == 200 and r.path.startswith(pattern[:-1])}
    assert landed
    assert "tensors/w" not in store.refs.list()
    with s3_faults.lose_replies() as log:
        tensor_id = store.put_tensor(array, name="w")
    # The rerun creates every block first (on S3 one request for a new block,
    # not two); the store refuses those that landed before: none is written twice.
    again = [r for r in log if r.method == "PUT" and r.path in landed]
    assert again
    assert all(r.moto_status == 412 for r in again)
    assert store.get_tensor(tensor_id).tobytes() == array.tobytes()


def test_block_put_whose_request_was_lost_is_written_by_the_retry(
    s3_faults: S3Server, store: gp.Store, prefix: str
) -> None:
    array = np.arange(5000, dtype=np.float32)
    rule = LostReply("PUT", f"{BUCKET}/{prefix}/blocks/*", calls={1}, reach=False)
    with s3_faults.lose_replies(rule) as log:
        tensor_id = store.put_tensor(array, name="w")
    [lost] = [r for r in log if r.status == 503]
    assert about(log, lost.path) == [(None, 503), (200, 200)]
    assert store.get_tensor(tensor_id).tobytes() == array.tobytes()
    assert store.write_stats.blocks_written >= 2  # the retried block counts as written


# --- 409 ConditionalRequestConflict: S3's answer while another conditional write is in flight
def conflict(pattern: str, calls: Container[int] | None = None) -> LostReply:
    """S3 refusing a conditional PUT while another one to the key is in flight (not done)."""
    return LostReply(
        "PUT", pattern, calls=calls, status=409, code="ConditionalRequestConflict", reach=False
    )


def test_block_put_answered_409_is_tried_again(
    s3_faults: S3Server, store: gp.Store, prefix: str
) -> None:
    array = np.arange(5000, dtype=np.float32)
    rule = conflict(f"{BUCKET}/{prefix}/blocks/*", calls={1, 2})
    with s3_faults.lose_replies(rule) as log:
        tensor_id = store.put_tensor(array)
    [path] = {r.path for r in log if r.status == 409}
    assert about(log, path) == [(None, 409), (None, 409), (200, 200)]
    assert store.get_tensor(tensor_id).tobytes() == array.tobytes()


def test_block_put_answered_409_for_ever_is_an_error_unless_it_exists(
    s3_faults: S3Server, store: gp.Store, prefix: str
) -> None:
    key = "blocks/zz/conflicted"
    with (
        s3_faults.lose_replies(conflict(f"{BUCKET}/{prefix}/{key}")),
        pytest.raises(StorageError, match="kept conflicting"),
    ):
        store.backend.write_if_absent(key, b"x")
    assert store.backend.mtimes([key]) == [None]
    # Someone else's write of the same key landed meanwhile: then it exists, not an error.
    store.backend.write_if_absent(key, b"theirs")
    with s3_faults.lose_replies(conflict(f"{BUCKET}/{prefix}/{key}")) as log:
        assert store.backend.write_if_absent(key, b"x") is False
    assert len(about(log, f"{BUCKET}/{prefix}/{key}")) > 1
    assert store.backend.read(key) == b"theirs"


def test_ref_swap_answered_409_is_retried_by_refs(
    s3_faults: S3Server, store: gp.Store, prefix: str
) -> None:
    a = store.put_tensor(np.ones(3))
    b = store.put_tensor(np.zeros(3))
    store.refs.set(REF, a, expected=None)
    key = f"{BUCKET}/{prefix}/refs/{REF}"
    with s3_faults.lose_replies(conflict(key, calls={1})) as log:
        entry = store.refs.set(REF, b, expected=a)
    assert about(log, key) == [(None, 409), (200, 200)]
    assert [e.target for e in store.refs.history(REF)] == [b, a]
    assert store.refs.list()[REF].write_id == entry.write_id


@pytest.mark.slow
@pytest.mark.usefixtures("no_inline")  # many blocks, so that many replies get lost
def test_ingest_with_lost_replies_everywhere_is_complete_and_written_once(
    s3_faults: S3Server, store: gp.Store, prefix: str, tmp_path: Path
) -> None:
    from gradpipe.ingestion.api import ingest
    from gradpipe.runs import open_run
    from gradpipe.testing.training import TrainingConfig, write_sample_run

    sample = write_sample_run(
        tmp_path / "d", TrainingConfig(vocab_size=500, embed_dim=8, hidden=8, peers=2, steps=2)
    )
    rules = [
        LostReply("PUT", f"{BUCKET}/{prefix}/blocks/*", calls=range(1, 40, 3)),
        # The run's ref is created by this ingest: its one swap is an If-None-Match PUT.
        LostReply("PUT", f"{BUCKET}/{prefix}/refs/*", header="If-None-Match", calls={1}),
    ]
    with s3_faults.lose_replies(*rules) as log:
        report = ingest(store, sample.dump_pattern, run="r")
    assert report.ok
    assert report.ingested == 4
    assert rules[0].fired > 1
    assert rules[1].fired == 1
    assert len(list(store.refs.history("runs/r"))) == 1  # one commit, one entry
    # Every block PUT that moto took was taken once: retries met 412.
    blocks = f"{BUCKET}/{prefix}/blocks/"
    taken = [
        r.path
        for r in log
        if r.method == "PUT" and r.moto_status == 200 and r.path.startswith(blocks)
    ]
    assert len(taken) > 10
    assert len(taken) == len(set(taken))
    run = open_run(store, "r")
    assert {(e.step, e.peer) for e in run} == {(s, p) for s in sample.steps for p in sample.peers}
    assert gp.verify(store).ok
    again = ingest(store, sample.dump_pattern, run="r")
    assert again.skipped == 4
