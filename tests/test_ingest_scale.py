"""Many small dumps: the work of an ingest grows linearly in the number of dumps.

2,000 tiny safetensors dumps (two float32 tensors of a few elements each) go
through the threaded scheduler, and so do 500 of them. Instead of timing the
two (speed lives in ``benchmarks/bench_ingest_small.py``), the test counts what
each ingest did, and asserts the counts are exactly linear:

- tasks run, by key prefix: one read, one encode and one dump task per small dump
  (a dump under ``ingest.task-bytes`` is one read unit), one inspect task per 16
  dumps, one commit;
- opens of the dump files: two per dump (its header, then its one read unit);
- store round trips (outermost backend calls, lock files aside: lease heartbeats
  run on a timer): ``k`` per dump plus a few per ingest, the same ``k`` and the
  same few at both sizes. Any step whose work grows with the run (a scan of all
  recorded dumps per dump, say) breaks the equality.

Where the time per small dump goes (pyinstrument, one thread, 2,000 dumps, ext4
in a VM): about 70 % in creating files, five objects per dump (two data blocks,
two tensor manifests, one dump manifest), each a create-if-absent write
(``O_EXCL`` temporary file, ``link``, ``unlink``); encoding, hashing and the
Dask scheduler share the rest.
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from dask.callbacks import Callback
from dask.utils import key_split

import gradpipe as gp
from gradpipe.formats import dump as dump_module
from gradpipe.formats.safetensors import write_safetensors
from gradpipe.runs import open_run
from gradpipe.storage.backend import Backend
from gradpipe.storage.locks import LOCK_PREFIX

N = 2_000
SMALL = 500
PEERS = 4
HEADERS_PER_TASK = 16
#: Round trips to the store per small dump, by backend call: its two tiny tensors
#: are inline in their manifests, which are embedded in the dump manifest, so one
#: batch writes one object, checking first whether it exists (``mtimes``, which
#: also refreshes it when reused).
PER_DUMP = {"mtimes": 1, "write_parts_if_absent": 1}
#: Round trips per ingest, whatever its size: the run read before planning and
#: at the commit, and the commit's compare-and-swap (plus a few batches' worth).
PER_INGEST_AT_MOST = 8


def _tensors(i: int) -> dict[str, np.ndarray]:
    """Two tiny tensors, different in every dump (so nothing dedups)."""
    rng = np.random.default_rng(i)
    return {
        "layer.weight": rng.standard_normal((2, 3)).astype(np.float32),
        "layer.bias": np.arange(3, dtype=np.float32) + np.float32(i + 1),
    }


def _pattern(root: Path) -> str:
    return str(root / "step={step}" / "peer={peer}.safetensors")


def _path(root: Path, i: int) -> Path:
    step, peer = divmod(i, PEERS)
    return root / f"step={step:05d}" / f"peer=p{peer}.safetensors"


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """``N`` tiny dumps, and a directory with hard links to the first ``SMALL`` of them."""
    big = tmp_path_factory.mktemp("big")
    small = tmp_path_factory.mktemp("small")
    for i in range(N):
        path = _path(big, i)
        if i % PEERS == 0:
            path.parent.mkdir()
        # An open file rather than a path: no temporary file and rename per dump.
        with path.open("wb") as f:
            write_safetensors(f, _tensors(i), {"num_examples": str(i % 7 + 1)})
        if i < SMALL:
            link = _path(small, i)
            link.parent.mkdir(exist_ok=True)
            os.link(path, link)
    return big, small


class Counts:
    """What one ingest did: tasks by prefix, dump-file opens, store round trips by call."""

    def __init__(self) -> None:
        self.tasks: Counter[str] = Counter()
        self.dump_opens = 0
        self.round_trips: Counter[str] = Counter()


def _only_locks(args: tuple[Any, ...]) -> bool:
    if not args:
        return False
    first = args[0]
    keys = [first] if isinstance(first, str) else [k if isinstance(k, str) else k[0] for k in first]
    return bool(keys) and all(k.startswith(LOCK_PREFIX) for k in keys)


Counting = Callable[[gp.Store], contextlib.AbstractContextManager[Counts]]

BACKEND_CALLS = [
    name
    for name, member in vars(Backend).items()
    if callable(member) and not name.startswith("_") and name != "delete_all"
]


@pytest.fixture
def counting(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counting]:
    """``with counting(store) as counts:`` counts what happens in the block."""
    current = [Counts()]
    lock = threading.Lock()
    depth = threading.local()  # a batched call may make single calls inside: count the outer
    patched: set[type] = set()

    def wrap(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(func)
        def counted(backend: Backend, *args: Any, **kwargs: Any) -> Any:
            level = getattr(depth, "value", 0)
            if level == 0 and not _only_locks(args):
                with lock:
                    current[-1].round_trips[name] += 1
            depth.value = level + 1
            try:
                return func(backend, *args, **kwargs)
            finally:
                depth.value = level

        return counted

    # Every read of a dump goes through one checked open (formats.dump.open_regular).
    opened = dump_module._open_local

    def counted_open(path: str, *args: Any, **kwargs: Any) -> Any:
        if str(path).endswith(".safetensors"):
            with lock:
                current[-1].dump_opens += 1
        return opened(path, *args, **kwargs)

    monkeypatch.setattr(dump_module, "_open_local", counted_open)

    @contextlib.contextmanager
    def start(store: gp.Store) -> Iterator[Counts]:
        cls = type(store.backend)
        if cls not in patched:
            patched.add(cls)
            for name in BACKEND_CALLS:
                monkeypatch.setattr(cls, name, wrap(name, getattr(cls, name)))
        current.append(Counts())
        try:
            yield current[-1]
        finally:
            current.append(Counts())  # what happens after the block counts nowhere

    class Tasks(Callback):
        def _pretask(self, key: Any, dsk: Any, state: Any) -> None:
            with lock:
                current[-1].tasks[key_split(key)] += 1

    with Tasks():
        yield start


@pytest.mark.slow
def test_two_thousand_small_dumps(
    dumps: tuple[Path, Path], tmp_path: Path, counting: Counting
) -> None:
    big, small = dumps
    counts = {}
    for n, root in ((SMALL, small), (N, big)):
        store = gp.open_store(str(tmp_path / f"store{n}"), mode="w")
        with counting(store) as counts[n]:
            report = gp.ingest(store, _pattern(root), run="r", workers=4)
        assert report.ok, report.summary()
        assert report.ingested == n
        assert report.tensors == 2 * n
        assert report.raw_bytes == n * (6 + 3) * 4
        # Per dump one object: the dump manifest, with both tiny tensors' manifests
        # embedded and their chunks inline.
        assert report.writes.blocks_written == n
        assert report.writes.inline_chunks == 2 * n
        assert report.writes.blocks_reused == 0

        assert counts[n].tasks == {
            "gradpipe-inspect": -(-n // HEADERS_PER_TASK),
            "gradpipe-read": n,
            "gradpipe-encode": n,
            "gradpipe-dump": n,
            "gradpipe-commit": 1,
        }
        assert counts[n].dump_opens == 2 * n

    # Store round trips: the same cost per dump and per ingest at both sizes.
    small_trips, big_trips = counts[SMALL].round_trips, counts[N].round_trips
    assert set(small_trips) == set(big_trips)
    for call in big_trips:
        per_dump, rest = divmod(big_trips[call] - small_trips[call], N - SMALL)
        assert (call, rest) == (call, 0), (small_trips, big_trips)
        assert per_dump == PER_DUMP.get(call, 0), (call, small_trips, big_trips)
        fixed = small_trips[call] - per_dump * SMALL
        assert 0 <= fixed <= PER_INGEST_AT_MOST, (call, small_trips, big_trips)

    store = gp.open_store(str(tmp_path / f"store{N}"), mode="r")
    run = open_run(store, "r")
    assert len(run) == N
    assert run.peers == [f"p{p}" for p in range(PEERS)]
    assert run.steps == list(range(N // PEERS))
    for i in random.Random(0).sample(range(N), 40):
        step, peer = divmod(i, PEERS)
        dump = run.dump(step, f"p{peer}")
        assert dump.metadata == {"num_examples": str(i % 7 + 1)}
        for name, want in _tensors(i).items():
            assert dump.read(name).tobytes() == want.tobytes()


def test_ingesting_again_builds_no_write_graph(
    dumps: tuple[Path, Path], tmp_path: Path, counting: Counting
) -> None:
    _, small = dumps
    store = gp.open_store(str(tmp_path / "store"), mode="w")
    first = gp.ingest(store, _pattern(small), run="r")
    assert first.ingested == SMALL
    with counting(store) as counts:
        again = gp.ingest(store, _pattern(small), run="r")
    assert (again.ingested, again.skipped, again.ok) == (0, SMALL, True)
    assert again.run_id == first.run_id
    # Everything is recorded: no task runs, no dump is opened, nothing is written.
    assert counts.tasks == {}
    assert counts.dump_opens == 0
    assert not {call for call in counts.round_trips if "write" in call or call == "swap"}
