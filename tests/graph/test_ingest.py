"""The ingest graph builders: shape, size, key names and determinism, without computing."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest
from dask.core import get_dependencies
from dask.utils import key_split

import gradpipe as gp
from gradpipe.formats.dump import DumpHeader, TensorSpec
from gradpipe.ingestion.discover import DumpFile
from gradpipe.ingestion.graph import HEADERS_PER_TASK, build_ingest_graph, build_inspect_graph
from gradpipe.ingestion.tasks import commit_run, inspect_dumps

FS = fsspec.filesystem("file")
CHUNK = 4096
UNIT = 16384


def _dump(i: int, *, fingerprint: str = "f") -> DumpFile:
    return DumpFile(i, "p0", f"/nowhere/step={i}.safetensors", 100, f"{fingerprint}{i}")


def _header(dump: DumpFile, floats: int = 3) -> DumpHeader:
    specs = (
        TensorSpec("w", "float32", (floats,), 8),
        TensorSpec("b", "float32", (2,), 8 + 4 * floats),
    )
    return DumpHeader(dump.path, "safetensors", specs, {}, 8 + 4 * floats + 8)


def _pairs(n: int, **kwargs: Any) -> list[tuple[DumpFile, DumpHeader]]:
    return [(d, _header(d)) for d in (_dump(i, **kwargs) for i in range(n))]


def _build(store: gp.Store, pairs: list[tuple[DumpFile, DumpHeader]], **kwargs: Any) -> Any:
    return build_ingest_graph(
        store,
        "r",
        FS,
        pairs,
        chunk_bytes=CHUNK,
        unit_bytes=UNIT,
        codecs=None,
        message="test",
        **kwargs,
    )


@pytest.fixture
def store(tmp_path: Path) -> gp.Store:
    return gp.open_store(tmp_path / "store", mode="w")


def test_graph_size_is_linear_in_dumps(store: gp.Store) -> None:
    sizes = {}
    for n in (50, 100, 200):
        graph, key = _build(store, _pairs(n))
        names = Counter(key_split(k) for k in graph)
        # A small dump is one read unit: one read, one encode and one dump task.
        assert names == {
            "gradpipe-read": n,
            "gradpipe-encode": n,
            "gradpipe-dump": n,
            "gradpipe-commit": 1,
        }
        assert key_split(key) == "gradpipe-commit"
        sizes[n] = len(graph)
    # Linear, with the exact slope and intercept of the structure above (three points).
    assert sizes == {n: 3 * n + 1 for n in sizes}


def test_a_big_dump_is_several_units_and_its_dump_task_waits_for_all(store: gp.Store) -> None:
    dump = _dump(0)
    big = _header(dump, floats=10 * UNIT // 4)  # ten units' worth of float32
    graph, key = _build(store, [(dump, big)])
    names = Counter(key_split(k) for k in graph)
    assert names["gradpipe-read"] == names["gradpipe-encode"] >= 10
    [dump_key] = [k for k in graph if key_split(k) == "gradpipe-dump"]
    encodes = [k for k in graph if key_split(k) == "gradpipe-encode"]
    assert get_dependencies(graph, dump_key) == set(encodes)
    assert get_dependencies(graph, key) == {dump_key}
    # Each encode task reads the output of its own read task, and nothing else.
    for encode in encodes:
        [read] = get_dependencies(graph, encode)
        assert key_split(read) == "gradpipe-read"
        assert read[1:] == encode[1:]


def test_tasks_carry_no_arrays(store: gp.Store) -> None:
    graph, _ = _build(store, _pairs(5))
    for task in graph.values():
        assert not any(isinstance(arg, np.ndarray) for arg in task[1:])


def test_keys_are_deterministic_and_follow_the_inputs(store: gp.Store) -> None:
    graph, key = _build(store, _pairs(4))
    again, again_key = _build(store, _pairs(4))
    assert (set(graph), key) == (set(again), again_key)
    changed, changed_key = _build(store, _pairs(4, fingerprint="g"))  # new file versions
    assert changed_key != key
    assert not set(changed) & set(graph)


def test_the_commit_task_carries_the_lease(store: gp.Store) -> None:
    pairs = _pairs(2)
    graph, key = _build(store, pairs, replace=True, lease="locks/shared-abc")
    func, *args = graph[key]
    assert func is commit_run
    assert args[0] is store
    assert args[1] == "r"
    assert args[2] == [d for d, _ in pairs]
    assert args[-2:] == [True, "locks/shared-abc"]


@pytest.mark.parametrize("n", [0, 1, HEADERS_PER_TASK, HEADERS_PER_TASK + 1, 40])
def test_inspect_graph_batches_headers_in_order(n: int) -> None:
    dumps = [_dump(i) for i in range(n)]
    graph, keys = build_inspect_graph(FS, dumps)
    assert len(keys) == -(-n // HEADERS_PER_TASK)
    assert all(key_split(k) == "gradpipe-inspect" for k in keys)
    batches = [graph[k] for k in keys]
    assert all(task[0] is inspect_dumps for task in batches)
    assert [d for task in batches for d in task[2]] == dumps
    assert all(len(task[2]) <= HEADERS_PER_TASK for task in batches)


def test_inspect_graph_results_pair_with_their_dumps(tmp_path: Path) -> None:
    """Computed, the batches concatenate into one header or failure per dump, in order."""
    good = tmp_path / "step=1.npz"
    np.savez(good, w=np.zeros(3, np.float32))
    dumps = [
        DumpFile(i, "p0", str(good) if i % 3 == 0 else str(tmp_path / f"gone{i}.npz"), 1, f"f{i}")
        for i in range(20)
    ]
    graph, keys = build_inspect_graph(FS, dumps, per_task=7)
    with gp.runner(workers=2) as runner:
        batches = runner.get(graph, keys, name="gradpipe-inspect")
    results = [r for batch in batches for r in batch]
    assert len(results) == len(dumps)
    for dump, result in zip(dumps, results, strict=True):
        if dump.path == str(good):
            assert isinstance(result, DumpHeader)
            assert [t.name for t in result.tensors] == ["w"]
        else:
            assert isinstance(result, gp.Failure)
            assert (result.step, result.path) == (dump.step, dump.path)
