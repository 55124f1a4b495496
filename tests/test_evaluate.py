"""``gp.evaluate_codecs``: bounds on transformer-shaped gradients, figures against numpy, error
feedback by hand, the projection judged on what it keeps, the sample, bad input, S3."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any

import dask
import ml_dtypes
import numpy as np
import pytest
from dask.utils import key_split

import gradpipe as gp
from gradpipe.codecs.candidate import Candidate
from gradpipe.codecs.policy import choose_codec
from gradpipe.codecs.registry import make_codec
from gradpipe.core.lossy import ErrorBound
from gradpipe.evaluation.sampling import Unit
from gradpipe.formats.safetensors import write_safetensors
from gradpipe.graph.runner import Runner
from gradpipe.testing import TransformerConfig, TransformerRun, write_transformer_run

#: 2 peers x 4 steps of a tiny BERT-shaped encoder (32 tensors, 2-D weights and 1-D biases).
TINY = TransformerConfig.tiny(steps=4)
#: Small chunks, so tensors have several and matrices are cut into blocks of rows.
CHUNKS = {"gradpipe.chunk-bytes": "4 KiB", "gradpipe.inline-bytes": 0}
LOSSY = [
    "bf16",
    "fp16",
    "bitround-3",
    "bitround-7+zstd",
    "topk-0.01",
    "topk-0.3",
    "qsgd-2",
    "qsgd-16",
    "powersgd-1",
    "powersgd-4",
    "projection-0.1",
    "projection-0.5",
]


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> TransformerRun:
    return write_transformer_run(
        tmp_path_factory.mktemp("tiny"), TINY, states=False, backend="numpy"
    )


def _ingest(url: str | Path, pattern: str, run: str = "t") -> gp.Store:
    store = gp.open_store(url, mode="a")
    with dask.config.set(CHUNKS):
        assert gp.ingest(store, pattern, run=run).ok
    return store


@pytest.fixture(scope="module")
def store(dumps: TransformerRun, tmp_path_factory: pytest.TempPathFactory) -> gp.Store:
    return _ingest(tmp_path_factory.mktemp("store") / "s", dumps.dump_pattern)


def _chunk(store: gp.Store, unit: Unit) -> tuple[np.ndarray, tuple[int, ...]]:
    """A sampled chunk read straight from the store (not by the graph), and its tensor's shape."""
    dump = gp.open_run(store, "t").dump(unit.step, unit.peer)
    info = dump.info(unit.tensor)
    start, stop = info.chunk_ranges()[unit.chunk]
    return np.asarray(dump.read(unit.tensor)).reshape(-1)[start:stop], info.shape


def test_every_lossy_codec_keeps_its_stated_bound_on_transformer_gradients(
    store: gp.Store,
) -> None:
    report = gp.evaluate_codecs(store, run="t", codecs=LOSSY, sample=48, seed=3)
    assert isinstance(report, gp.Report)
    assert report.ok, report.summary()
    assert report.codecs == LOSSY
    for result in report.results:
        assert result.chunks, result.name
        assert result.lossy
        if result.reconstructs:
            assert result.bound_held, result.name
            assert result.bound_held_chunks == len(result.chunks)
            assert result.bound_used is not None
            assert 0 < result.bound_used <= 1 + 1e-9, result.name
            assert result.fidelity is not None
            assert not result.fidelity.bit_exact
        else:
            assert result.name.startswith("projection")
    # PowerSGD is evaluated on matrices only: the 1-D biases and LayerNorms are left out.
    powersgd = report.result("powersgd-4")
    assert sum(powersgd.skipped.values()) == 48 - len(powersgd.chunks) > 0
    assert all(len(_chunk(store, report.units[c.index])[1]) == 2 for c in powersgd.chunks)


def _direct(store: gp.Store, units: list[Unit], name: str) -> dict[str, float]:
    """The figures of ``name`` over ``units``, by numpy on the concatenated chunks."""
    xs, ys, stored = [], [], 0
    for unit in units:
        x, shape = _chunk(store, unit)
        codec = (
            choose_codec(x) if name == "default" else make_codec(name, dtype="float32", shape=shape)
        )
        frame = codec.encode(x)
        stored += len(frame)
        xs.append(x.astype(np.float64))
        ys.append(np.frombuffer(codec.decode(frame), dtype=x.dtype).astype(np.float64))
    x, y = np.concatenate(xs), np.concatenate(ys)
    nonzero = x != 0
    return {
        "ratio": x.size * 4 / stored,
        "bits_per_value": 8 * stored / x.size,
        "max_abs_error": float(np.max(np.abs(y - x))),
        "rel_l2_error": float(np.linalg.norm(y - x) / np.linalg.norm(x)),
        "cosine": float(x @ y / (np.linalg.norm(x) * np.linalg.norm(y))),
        "norm_ratio": float(np.linalg.norm(y) / np.linalg.norm(x)),
        "sign_agreement": float(np.mean(np.sign(y[nonzero]) == np.sign(x[nonzero]))),
    }


@pytest.mark.parametrize("name", ["default", "bf16", "topk-0.1", "qsgd-4", "powersgd-2"])
def test_figures_match_a_direct_numpy_computation(store: gp.Store, name: str) -> None:
    report = gp.evaluate_codecs(store, run="t", codecs=[name], sample=20, seed=1)
    [result] = report.results
    units = [report.units[c.index] for c in result.chunks]
    want = _direct(store, units, name)
    got = result.to_dict()
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-15), key
    assert got["bit_exact"] is (name == "default")
    assert got["encode_mib_s"] > 0
    assert got["decode_mib_s"] > 0


def _write_run(root: Path, steps: dict[int, dict[str, dict[str, np.ndarray]]]) -> str:
    """Dump files ``steps[step][peer] = tensors``; their pattern."""
    for step, peers in steps.items():
        for peer, tensors in peers.items():
            path = root / f"step={step}" / f"peer={peer}.safetensors"
            path.parent.mkdir(parents=True, exist_ok=True)
            write_safetensors(path, tensors)
    return str(root / "step={step}" / "peer={peer}.safetensors")


def test_error_feedback_against_a_two_step_example_by_hand(tmp_path: Path) -> None:
    # Top-k keeping one of two values. Step 0 sends [3, 0] and carries [0, 1]; step 1
    # compresses [0.5, 2.5] + [0, 1] = [0.5, 3.5], sends [0, 3.5] and carries [0.5, 0].
    # Accumulated: sent [3, 3.5] against the true [3.5, 3.5]; without feedback the steps
    # send [3, 0] and [0, 2.5]: [3, 2.5].
    pattern = _write_run(
        tmp_path / "d",
        {0: {"p": {"g": np.array([3.0, 1.0])}}, 1: {"p": {"g": np.array([0.5, 2.5])}}},
    )
    store = _ingest(tmp_path / "store", pattern)
    report = gp.evaluate_codecs(store, run="t", codecs="topk-0.5", sample=2, feedback_steps=2)
    feedback = report.result("topk-0.5").feedback_figures()
    assert feedback is not None
    assert (feedback["chains"], feedback["steps"], feedback["not_simulated"]) == (2, 2, 0)
    true, fed, plain = np.array([3.5, 3.5]), np.array([3.0, 3.5]), np.array([3.0, 2.5])

    def figures(sent: np.ndarray) -> dict[str, float]:
        n = math.hypot(*true)
        return {
            "rel_l2_error": math.hypot(*(sent - true)) / n,
            "cosine": float(sent @ true) / (n * math.hypot(*sent)),
            "norm_ratio": math.hypot(*sent) / n,
            "sign_agreement": 1.0,
        }

    assert feedback["with_feedback"] == pytest.approx(figures(fed), rel=1e-12)
    assert feedback["without_feedback"] == pytest.approx(figures(plain), rel=1e-12)
    assert feedback["with_feedback"]["rel_l2_error"] == pytest.approx(0.5 / math.sqrt(24.5))
    # One step: no simulation.
    single = gp.evaluate_codecs(store, run="t", codecs="topk-0.5", sample=2, feedback_steps=1)
    assert single.result("topk-0.5").feedback_figures() is None


def _without_speeds(doc: dict[str, Any]) -> dict[str, Any]:
    for codec in doc["codecs"]:
        del codec["encode_mib_s"], codec["decode_mib_s"]
    return doc


def test_the_same_seed_gives_the_same_sample_and_figures(store: gp.Store) -> None:
    names = ["default", "qsgd-4", "topk-0.1", "projection-0.2"]
    first = gp.evaluate_codecs(store, run="t", codecs=names, sample=16, seed=7)
    again = gp.evaluate_codecs(store, run="t", codecs=names, sample=16, seed=7)
    assert _without_speeds(first.to_dict()) == _without_speeds(again.to_dict())
    other = gp.evaluate_codecs(store, run="t", codecs=names, sample=16, seed=8)
    assert other.units != first.units


def test_the_sample_gives_every_tensor_its_share_over_steps_and_peers(store: gp.Store) -> None:
    tensors = gp.open_run(store, "t").schema
    report = gp.evaluate_codecs(store, run="t", codecs="zstd", sample=2 * len(tensors), seed=5)
    per_tensor = Counter(u.tensor for u in report.units)
    assert per_tensor == dict.fromkeys(tensors, 2)  # the 5-chunk embedding as the 2-value bias
    assert len(set(report.units)) == len(report.units)
    assert {u.step for u in report.units} == set(range(TINY.steps))
    per_peer = Counter(u.peer for u in report.units)
    assert abs(per_peer["peer0"] - per_peer["peer1"]) <= 2
    per_step = Counter(u.step for u in report.units)
    assert max(per_step.values()) - min(per_step.values()) <= 2
    # More than the run holds: every chunk once.
    everything = gp.evaluate_codecs(store, run="t", codecs="zstd", sample=100_000)
    run = gp.open_run(store, "t")
    total = sum(len(run.dump(e.step, e.peer).info(n).blocks) for e in run for n in run.schema)
    assert len(everything.units) == total


def test_the_projection_is_judged_on_norms_and_inner_products(store: gp.Store) -> None:
    report = gp.evaluate_codecs(store, run="t", codecs="projection-0.1", sample=24, seed=2)
    result = report.result("projection-0.1")
    assert not result.reconstructs
    doc = result.to_dict()
    for key in ("bit_exact", "max_abs_error", "rel_l2_error", "cosine", "sign_agreement"):
        assert doc[key] is None, key
    sketch = doc["sketch"]
    assert sketch["norm_chunks"] == len(result.chunks) == 24
    assert sketch["pairs"] == 24  # every chunk has a partner: the other peer of its step
    codec = make_codec("projection-0.1")
    kept = original = 0.0
    for outcome in result.chunks:
        x = _chunk(store, report.units[outcome.index])[0].astype(np.float64)
        norm = codec.norm(codec.encode(x.astype(np.float32)))
        assert outcome.sketch is not None
        assert outcome.sketch.sketch_sq == pytest.approx(norm**2, rel=1e-12)
        assert outcome.sketch.epsilon == codec.error_bound(x.size).norm_epsilon
        kept, original = kept + norm**2, original + x @ x
    assert doc["norm_ratio"] == pytest.approx(math.sqrt(kept / original), rel=1e-12)
    assert math.isfinite(sketch["norm_epsilon_max"])
    assert sketch["norm_epsilon_max"] > 0
    for pair in result.pairs:
        assert pair.epsilon > 0
        assert math.isfinite(pair.error)
    text = report.summary()
    assert "projection-0.1: does not reconstruct the vector" in text
    assert "JL ε" in text


def test_codecs_that_do_not_apply_are_listed_not_measured(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    pattern = _write_run(
        tmp_path / "d",
        {
            s: {
                "p": {
                    "w": rng.standard_normal((8, 16)).astype(np.float32),
                    "b": rng.standard_normal(16).astype(np.float32),
                    "count": np.arange(5, dtype=np.int64),
                }
            }
            for s in range(2)
        },
    )
    store = _ingest(tmp_path / "store", pattern)
    report = gp.evaluate_codecs(store, run="t", codecs="default,bf16,powersgd-2", sample=6)
    assert len(report.units) == 6
    assert len(report.result("default").chunks) == 6  # integers too, bit-exact
    assert report.result("default").fidelity.bit_exact  # type: ignore[union-attr]
    assert report.result("bf16").skipped == {
        "bf16 does not encode int64 values (they would be stored exactly)": 2
    }
    assert report.result("powersgd-2").skipped == {
        "powersgd-2 does not encode int64 values (they would be stored exactly)": 2,
        "powersgd-2 approximates matrices; 1-D tensors are left out (stored exactly, as "
        "PowerSGD sends biases)": 2,
    }
    assert len(report.result("powersgd-2").chunks) == 2  # "w" of each step
    assert "bf16: 2 chunk(s) left out: bf16 does not encode int64 values" in report.summary()
    # A codec left out of every chunk says nothing about fidelity (not "exact, no error").
    half = _write_run(tmp_path / "h", {0: {"p": {"h": np.ones(8, dtype=ml_dtypes.bfloat16)}}})
    only = gp.evaluate_codecs(_ingest(tmp_path / "hs", half), run="t", codecs="bf16,topk-0.5")
    bf16 = only.result("bf16")
    assert (len(bf16.chunks), bf16.fidelity, bf16.ratio) == (0, None, None)
    assert bf16.to_dict()["bit_exact"] is None
    assert bf16.to_dict()["rel_l2_error"] is None
    assert len(only.result("topk-0.5").chunks) == 1  # top-k takes bfloat16
    row = next(line for line in only.summary().splitlines() if line.startswith("bf16 "))
    assert row.split()[1:8] == ["0", "—", "—", "—", "—", "—", "—"]


def test_bad_input_is_refused_before_any_work(store: gp.Store, tmp_path: Path) -> None:
    for codecs, words in [
        ("nope", "codecs are default, zstd, blosc, bf16, fp16, bitround-K, topk-F"),
        ("topk-2", "top-k fraction must be a number in (0, 1], not 2.0"),
        ("topk", "needs its parameter: topk-F"),
        ("bf16+topk-0.1", "a lossy codec must come first"),
        ("default+zstd", "cannot be chained"),
        (",", "no codecs to evaluate"),
    ]:
        with pytest.raises(
            gp.InvalidInputError, match=words.replace("(", r"\(").replace(")", r"\)")
        ):
            gp.evaluate_codecs(store, run="t", codecs=codecs)
    for kwargs in ({"sample": 0}, {"feedback_steps": 0}, {"seed": -1}, {"sample": True}):
        with pytest.raises(gp.InvalidInputError):
            gp.evaluate_codecs(store, run="t", **kwargs)  # type: ignore[arg-type]
    with pytest.raises(gp.NotFoundError, match="no run 'nope'"):
        gp.evaluate_codecs(store, run="nope")
    empty = _ingest(tmp_path / "empty", _write_run(tmp_path / "e", {0: {"p": {"g": np.zeros(0)}}}))
    with pytest.raises(gp.InvalidInputError, match="stores no values"):
        gp.evaluate_codecs(empty, run="t")


def test_a_codec_that_breaks_its_bound_fails_the_report(
    store: gp.Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    tight = ErrorBound("tighter than bf16 can be", relative=2.0**-20)
    original = Candidate.bound

    def bound(self: Candidate, dtype: str, size: int) -> ErrorBound:
        return tight if self.name == "bf16" else original(self, dtype, size)

    monkeypatch.setattr(Candidate, "bound", bound)
    report = gp.evaluate_codecs(store, run="t", codecs="bf16,fp16", sample=4)
    assert not report.ok
    assert not report.result("bf16").bound_held
    assert report.result("bf16").bound_used > 1  # type: ignore[operator]
    assert report.result("fp16").bound_held
    assert "BOUND NOT HELD: bf16" in report.summary()
    assert report.to_dict()["ok"] is False


class _Recording(Runner):
    def __init__(self) -> None:
        super().__init__(workers=2)
        self.graphs: list[dict[Hashable, Any]] = []

    def get(self, graph: Any, keys: Sequence[Hashable], **kw: Any) -> list[Any]:
        self.graphs.append(dict(graph))
        return super().get(graph, keys, **kw)


def test_the_graph_reads_each_chunk_once_in_named_tasks(store: gp.Store) -> None:
    recording = _Recording()
    names = ["zstd", "topk-0.1", "powersgd-2", "projection-0.1"]
    report = gp.evaluate_codecs(store, run="t", codecs=names, sample=10, runner=recording)
    [graph] = recording.graphs
    kinds = Counter(key_split(k) for k in graph)
    assert kinds["gradpipe-evaluation"] == len(names)
    assert kinds["gradpipe-evaluation-chunk"] == sum(len(r.chunks) for r in report.results)
    # Error-feedback windows (4 steps of the peer) and partners add reads, but every
    # stored chunk is read by one task, whatever reads it.
    from gradpipe.graph.chains import chunk_key

    read = key_split(chunk_key("b3:" + "0" * 64))  # the shared, content-keyed chunk read
    reads = [k for k in graph if key_split(k) == read]
    assert len(reads) == len(set(reads)) > len(report.units)
    assert kinds["gradpipe-evaluation-window"] > 0
    assert kinds["gradpipe-evaluation-pair"] == 10
    assert not recording.closed  # a runner given is left open


def test_evaluate_on_every_store(store_url: str, dumps: TransformerRun) -> None:
    store = _ingest(store_url, dumps.dump_pattern)
    report = gp.evaluate_codecs(store, run="t", codecs="default,bf16,topk-0.05", sample=12)
    assert report.ok
    assert [len(r.chunks) for r in report.results] == [12, 12, 12]
    assert report.result("default").fidelity.bit_exact  # type: ignore[union-attr]
