"""A state machine checks gc against an in-memory model of the store.

The model knows, without asking the store, which blocks each tensor and each
ref update writes (it chunks the arrays itself and hashes the chunks), which
of them are reachable, and which are young. After every gc the set of blocks
on the backend must be exactly what the model predicts: nothing unreferenced
survives its grace period, nothing reachable or young is lost.
"""

from __future__ import annotations

import os
import tempfile
import time
import uuid
from pathlib import Path

import dask.config
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import gradpipe as gp
from gradpipe.core.ids import hash_bytes, id_from_block_key
from gradpipe.core.manifest import encode_manifest
from gradpipe.errors import NotFoundError

# Chunks of 16 float32 values: arrays are built from a small pool of chunk
# contents so that tensors share blocks, repeat whole, and have zero chunks.
CHUNK = 16
CHUNK_BYTES = CHUNK * 4
POOL = [
    np.zeros(CHUNK, np.float32),
    np.arange(CHUNK, dtype=np.float32),
    -np.arange(CHUNK, dtype=np.float32),
    np.full(CHUNK, -0.0, np.float32),  # not zero bits: needs a block
]
REFS = ["tags/a", "tags/b", "tags/c"]
# These tests damage and count data blocks: every chunk is a block of its own.
pytestmark = pytest.mark.usefixtures("no_inline")
HOUR = 3600.0

chunks = st.one_of(
    st.sampled_from(range(len(POOL))),
    st.integers(0, 2**32 - 1),  # a random chunk, seeded
)
arrays = st.tuples(st.lists(chunks, min_size=0, max_size=5), st.integers(0, CHUNK - 1))


def build(spec: tuple[list[int], int]) -> np.ndarray:
    parts, tail = spec
    out = []
    for p in parts:
        if p < len(POOL):
            out.append(POOL[p])
        else:
            out.append(np.random.default_rng(p).standard_normal(CHUNK, dtype=np.float32))
    data = np.concatenate([*out, np.ones(tail, np.float32)]) if out or tail else np.zeros(0)
    return data.astype(np.float32)


def data_blocks(array: np.ndarray) -> set[str]:
    """Ids of the data blocks of a 1-d float32 array in CHUNK-element chunks."""
    raw = array.view(np.uint8)
    found = set()
    for start in range(0, raw.size, CHUNK_BYTES):
        piece = raw[start : start + CHUNK_BYTES]
        if piece.any():
            found.add(hash_bytes(piece.tobytes()))
    return found


class GcMachine(RuleBasedStateMachine):
    """Puts, ref moves and deletions, gc with several grace periods, ageing."""

    url_factory: staticmethod
    can_age = True

    tensors = Bundle("tensors")

    @initialize()
    def open(self) -> None:
        self.store = gp.open_store(self.url_factory(), mode="w")
        self.arrays: dict[str, np.ndarray] = {}  # tensor id -> content
        self.blocks_of: dict[str, set[str]] = {}  # tensor id -> its data blocks
        self.live: dict[str, str | None] = {}  # ref -> target (None: deleted)
        self.entries: set[str] = set()  # every ref entry ever written
        self.young: set[str] = set()  # blocks written or touched since the last ageing
        self.present: set[str] = set()  # what the model says is on the backend

    # --- the model --------------------------------------------------------------
    def reachable(self) -> set[str]:
        out = set(self.entries)  # history is kept, deletions included
        for target in self.live.values():
            if target is not None:
                out.add(target)
                out |= self.blocks_of[target]
        return out

    def available(self, tensor_id: str) -> bool:
        """The tensor's manifest and data are all still in the store."""
        return tensor_id in self.present and self.blocks_of[tensor_id] <= self.present

    def blocks_on_backend(self) -> set[str]:
        ids = [id_from_block_key(i.key) for i in self.store.backend.list("blocks")]
        assert None not in ids, "stray file among the blocks"
        return set(ids)  # type: ignore[arg-type]

    # --- rules ------------------------------------------------------------------
    @rule(target=tensors, spec=arrays)
    def put_tensor(self, spec: tuple[list[int], int]) -> str:
        array = build(spec)
        tensor_id = self.store.put_tensor(array, chunk_bytes=CHUNK_BYTES)
        blocks = data_blocks(array)
        if tensor_id in self.arrays:
            assert self.arrays[tensor_id].tobytes() == array.tobytes()
        self.arrays[tensor_id] = array
        self.blocks_of[tensor_id] = blocks
        self.young |= blocks | {tensor_id}
        self.present |= blocks | {tensor_id}
        return tensor_id

    @rule(name=st.sampled_from(REFS), tensor_id=tensors)
    def set_ref(self, name: str, tensor_id: str) -> None:
        if not self.available(tensor_id):
            return  # gc took it; a writer must put it again before committing
        entry = self.store.refs.set(name, tensor_id)
        assert entry.target == tensor_id
        self._entry_written(name, encode_manifest(entry), tensor_id)

    @rule(name=st.sampled_from(REFS))
    def delete_ref(self, name: str) -> None:
        entry = self.store.refs.set(name, None)
        self._entry_written(name, encode_manifest(entry), None)

    def _entry_written(self, name: str, data: bytes, target: str | None) -> None:
        entry_id = hash_bytes(data)
        self.entries.add(entry_id)
        self.young.add(entry_id)
        self.present.add(entry_id)
        self.live[name] = target

    @rule()
    def gc_now(self) -> None:
        report = gp.gc(self.store, grace=0)
        expected = self.reachable()
        assert report.deleted == len(self.present - expected)
        self.present = expected
        assert self.blocks_on_backend() == expected

    @rule()
    def gc_with_long_grace(self) -> None:
        before = self.blocks_on_backend()
        with dask.config.set({"gradpipe.gc.grace": "30 days"}):
            report = gp.gc(self.store)
        assert report.deleted == 0
        assert self.blocks_on_backend() == before == self.present

    @precondition(lambda self: self.can_age)
    @rule()
    def age_everything(self) -> None:
        # Everything now on disk was written two hours ago.
        old = time.time() - 2 * HOUR
        root = Path(self.store.backend.root) / "blocks"
        for path in root.rglob("*"):
            if path.is_file():
                os.utime(path, (old, old))
        self.young.clear()

    @precondition(lambda self: self.can_age)
    @rule()
    def gc_after_an_hour(self) -> None:
        # Keeps what is reachable and what was written or reused since ageing
        # (a dedup hit on a two-hour-old block refreshes it: touch-after is 1h).
        report = gp.gc(self.store, grace=HOUR)
        expected = self.present & (self.reachable() | self.young)
        assert report.deleted == len(self.present - expected)
        self.present = expected
        assert self.blocks_on_backend() == expected

    # --- invariants -------------------------------------------------------------
    @invariant()
    def live_refs_read_back(self) -> None:
        if not hasattr(self, "store"):
            return
        for name, target in self.live.items():
            if target is None:
                with pytest.raises(NotFoundError):
                    self.store.refs.get(name)
                continue
            assert self.store.refs.get(name) == target
            got = self.store.get_tensor(target)
            want = self.arrays[target]
            assert got.dtype == want.dtype
            assert got.shape == want.shape
            assert got.tobytes() == want.tobytes()

    @invariant()
    def store_verifies(self) -> None:
        if not hasattr(self, "store"):
            return
        report = gp.verify(self.store)
        assert report.ok, report.problems
        assert self.blocks_on_backend() == self.present


def test_gc_state_machine_local() -> None:
    with tempfile.TemporaryDirectory() as top:

        class Local(GcMachine):
            url_factory = staticmethod(lambda: str(Path(top) / uuid.uuid4().hex))

        run_state_machine_as_test(
            Local,
            settings=settings(
                max_examples=50,
                stateful_step_count=40,
                deadline=None,
                database=None,
                suppress_health_check=[HealthCheck.too_slow],
            ),
        )


@pytest.mark.s3
def test_gc_state_machine_s3(s3: object) -> None:
    class OnS3(GcMachine):
        url_factory = staticmethod(lambda: f"s3://gradpipe-test/{uuid.uuid4().hex[:12]}")
        can_age = False  # S3 sets LastModified itself

    run_state_machine_as_test(
        OnS3,
        settings=settings(
            max_examples=4,
            stateful_step_count=10,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
