"""Many small dumps: the ingest graph grows linearly and the ingest keeps up.

2,000 tiny safetensors dumps (two float32 tensors of a few elements each) go
through the threaded scheduler. The graph of ``build_ingest_graph`` has, by
construction, one read, one encode and one dump task per small dump (a dump
under ``ingest.task-bytes`` is one read unit) plus one commit, so its size is
asserted exactly: ``tasks == 3 * n + 1``. Wall time is only bounded loosely
(2,000 dumps must not take more than 8 times as long as 500, plus 5 s): speed
figures live in ``benchmarks/bench_ingest.py``.

Where the time per small dump goes (pyinstrument, one thread, 2,000 dumps, ext4
in a VM): about 70 % in creating files, five objects per dump (two data blocks,
two tensor manifests, one dump manifest), each a create-if-absent write
(``O_EXCL`` temporary file, ``link``, ``unlink``); encoding, hashing and the
Dask scheduler share the rest.
"""

from __future__ import annotations

import os
import random
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from dask.utils import key_split

import gradpipe as gp
from gradpipe.formats.safetensors import write_safetensors
from gradpipe.graph.discover import discover_dumps
from gradpipe.graph.ingest import inspect_dumps
from gradpipe.ingest import build_ingest_graph, ingest
from gradpipe.runs import open_run

N = 2_000
SMALL = 500
PEERS = 4


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


def test_graph_size_is_linear_in_dumps(dumps: tuple[Path, Path], tmp_path: Path) -> None:
    big, _ = dumps
    fs, found, _ = discover_dumps(_pattern(big))
    assert len(found) == N
    headers = inspect_dumps(fs, found)
    pairs = list(zip(found, headers, strict=True))
    store = gp.open_store(str(tmp_path / "store"), mode="w")
    sizes = {}
    for n in (SMALL, 1_000, N):
        graph, key = build_ingest_graph(
            store,
            "r",
            fs,
            pairs[:n],
            chunk_bytes=4 << 20,
            unit_bytes=32 << 20,
            codecs=None,
            message="scale",
        )
        names = Counter(key_split(k) for k in graph)
        assert names == {
            "gradpipe-read": n,
            "gradpipe-encode": n,
            "gradpipe-dump": n,
            "gradpipe-commit": 1,
        }
        assert key in graph
        sizes[n] = len(graph)
    # Linear, with the exact slope and intercept of the structure above.
    a = (sizes[N] - sizes[SMALL]) // (N - SMALL)
    b = sizes[SMALL] - a * SMALL
    assert (a, b) == (3, 1)
    assert all(size == a * n + b for n, size in sizes.items())


@pytest.mark.slow
def test_two_thousand_small_dumps(dumps: tuple[Path, Path], tmp_path: Path) -> None:
    big, small = dumps
    seconds = {}
    reports = {}
    for n, root in ((SMALL, small), (N, big)):
        store = gp.open_store(str(tmp_path / f"store{n}"), mode="w")
        start = time.perf_counter()
        reports[n] = ingest(store, _pattern(root), run="r")
        seconds[n] = time.perf_counter() - start
        report = reports[n]
        assert report.ok, report.summary()
        assert report.ingested == n
        assert report.tensors == 2 * n
        assert report.raw_bytes == n * (6 + 3) * 4
        # Per dump: 2 data blocks, 2 tensor manifests and 1 dump manifest, all new.
        assert report.writes.blocks_written == 5 * n
        assert report.writes.blocks_reused == 0

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

    # Ingesting again finds everything recorded and builds no graph.
    again = ingest(gp.open_store(str(tmp_path / f"store{N}"), mode="a"), _pattern(big), run="r")
    assert (again.ingested, again.skipped, again.ok) == (0, N, True)
    assert again.run_id == run.id

    # Loose: per-dump cost must not grow with the number of dumps (a quadratic
    # step somewhere would take 16x). No tight timing here; see the benchmark.
    assert seconds[N] < 8 * seconds[SMALL] + 5, seconds
