"""Where analyses live: results, the index under ``analytics/<run>``, format 6, gc, races."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import gradpipe as gp
import gradpipe.core.manifest as manifest_module
from gradpipe.analytics.memo import ResultSpec, commit_analyses, read_results, store_results
from gradpipe.core.analysis_manifest import AnalysisInput, AnalysisManifest, analysis_key
from gradpipe.core.analytics_index import AnalyticsIndex, record_analyses
from gradpipe.core.manifest import decode_manifest, encode_manifest
from gradpipe.core.run_entries import AnalysisEntry
from gradpipe.core.run_shards import TreeShape
from gradpipe.errors import UnsupportedFormatError
from gradpipe.storage.catalog import read_analytics
from gradpipe.testing.faults import Fault, faulty_store

DUMP = "b3:" + "1" * 64


def _spec(step: int, *, run: str = "r", name: str = "norms", dump: str = DUMP) -> ResultSpec:
    inputs = (AnalysisInput("a", dump),)
    key = analysis_key("norms", 1, {}, inputs)
    return ResultSpec(run, step, name, "norms", 1, {}, inputs, key)


def _result(store: gp.Store, step: int) -> AnalysisEntry:
    figures = ("sum_squares", "l2_norm", "max_abs", "nonzero", "nan", "inf", "numel", "present")
    arrays = {f: np.arange(3, dtype=np.float64).reshape(1, 3) * step for f in figures}
    arrays["numel"] = np.ones((1, 3), np.int64)
    with store.writing("test"):
        coords = {"labels": ["a"], "tensors": ["x", "y", "z"]}
        [entry] = store_results(store, [(_spec(step), arrays, coords)])
        return entry


def test_a_result_round_trips_with_its_arrays(store: gp.Store) -> None:
    entry = _result(store, 3)
    [(analysis_id, manifest, arrays)] = read_results(store, "r", [entry])
    assert analysis_id == entry.analysis
    assert manifest.step == 3
    assert manifest.provenance["gradpipe"] == gp.__version__
    assert manifest.coords == {"labels": ["a"], "tensors": ["x", "y", "z"]}
    np.testing.assert_array_equal(arrays["l2_norm"], np.arange(3).reshape(1, 3) * 3)
    assert arrays["numel"].dtype == np.int64
    again = decode_manifest(encode_manifest(manifest))
    assert isinstance(again, AnalysisManifest)
    assert encode_manifest(again) == encode_manifest(manifest)


def test_the_key_covers_what_changes_the_figures() -> None:
    base = analysis_key("norms", 1, {}, (AnalysisInput("a", DUMP),))
    assert base != analysis_key("norms", 2, {}, (AnalysisInput("a", DUMP),))
    assert base != analysis_key("norms", 1, {"k": 1}, (AnalysisInput("a", DUMP),))
    assert base != analysis_key("norms", 1, {}, (AnalysisInput("a", "b3:" + "2" * 64),))
    assert base != analysis_key("norms", 1, {}, (AnalysisInput("a", DUMP, 2.0),))
    with pytest.raises(gp.InvalidInputError, match="weight"):
        AnalysisInput("a", DUMP, 0.0)


def test_an_older_gradpipe_refuses_format_6(
    store: gp.Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    entry = _result(store, 1)
    commit_analyses(store, "r", [entry])
    raw = bytes(store.get_raw(entry.analysis))
    monkeypatch.setattr(manifest_module, "FORMAT_VERSION", 5)
    with pytest.raises(UnsupportedFormatError, match="upgrade"):
        decode_manifest(raw)


def test_gc_keeps_indexed_results_and_verify_walks_them(store: gp.Store) -> None:
    entries = [_result(store, s) for s in range(3)]
    commit_analyses(store, "r", entries)
    orphan = _result(store, 9)  # stored, never indexed
    gc = gp.gc(store, grace=0)
    assert gc.ok
    assert store.has_blocks([e.analysis for e in entries]) == [True] * 3
    assert store.has_blocks([orphan.analysis]) == [False]
    report = gp.verify(store)
    assert report.ok, report.summary()
    assert report.manifests >= 4  # the index and the three results at least


def test_recording_the_same_entries_again_writes_nothing(store: gp.Store) -> None:
    entry = _result(store, 1)
    first = commit_analyses(store, "r", [entry])
    assert first is not None
    history = len(store.refs.history("analytics/r"))
    assert commit_analyses(store, "r", [entry]) is None
    assert len(store.refs.history("analytics/r")) == history


def test_two_writers_of_different_steps_both_land(store: gp.Store) -> None:
    entries = [_result(store, s) for s in range(8)]
    barrier = threading.Barrier(2)

    def commit(part: list[AnalysisEntry]) -> None:
        barrier.wait()
        for entry in part:
            commit_analyses(store, "r", [entry])

    threads = [threading.Thread(target=commit, args=(entries[i::2],)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    _, index = read_analytics(store, "r")
    assert list(index.entries) == sorted(entries, key=lambda e: e.sort_key)


def test_a_lost_reply_on_the_swap_is_neither_a_conflict_nor_a_duplicate(store: gp.Store) -> None:
    entry = _result(store, 1)
    faulty, backend = faulty_store(
        store, Fault("swap", "refs/analytics/*", calls={1}, lose="reply")
    )
    commit_analyses(faulty, "r", [entry])
    assert backend.fired("swap")
    _, index = read_analytics(store, "r")
    assert list(index.entries) == [entry]
    assert len(store.refs.history("analytics/r")) == 1


def test_a_long_index_moves_into_shards(store: gp.Store) -> None:
    index = AnalyticsIndex("r")
    entries = [AnalysisEntry(s, "norms", "b3:" + f"{s:064x}", "b3:" + "f" * 64) for s in range(40)]
    shape = TreeShape(leaf=4, branch=3)
    for lo in range(0, 40, 7):
        index = record_analyses(index, entries[lo : lo + 7], shape=shape)
    assert index.shards is not None
    assert not index.inline
    assert len(index) == 40
    assert index.format_needed() == 6
    shards = list(index.unstored_manifests())
    assert all(s.format_needed() == 6 for s in shards)
    store.put_manifest(index)
    stored = store.get_typed(store.put_manifest(index), AnalyticsIndex)
    assert stored.lookup([(7, "norms"), (99, "norms")]) == {(7, "norms"): entries[7]}
    assert list(stored.entries) == entries


def test_the_ref_may_only_point_at_an_index(store: gp.Store) -> None:
    entry = _result(store, 1)
    store.refs.set("analytics/r", entry.analysis)
    with pytest.raises(gp.IntegrityError, match="analytics"):
        read_analytics(store, "r")


def test_an_index_entry_moved_to_another_result_is_caught(store: gp.Store) -> None:
    one, two = _result(store, 1), _result(store, 2)
    moved = AnalysisEntry(1, "norms", two.analysis, one.key)
    with pytest.raises(gp.IntegrityError, match=r"step 1: the index names .* step 2"):
        read_results(store, "r", [moved])


def test_an_index_of_another_run_is_refused(store: gp.Store) -> None:
    commit_analyses(store, "y", [_result(store, 1)])
    store.refs.set("analytics/x", store.refs.get("analytics/y"))
    with pytest.raises(gp.IntegrityError, match="points at the analyses of run 'y'"):
        read_analytics(store, "x")
