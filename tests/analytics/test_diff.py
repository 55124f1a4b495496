"""gp.diff and gradpipe diff: ids first, then only the differing chunks."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

import gradpipe as gp
from gradpipe.cli import main
from gradpipe.core.ids import block_key
from gradpipe.core.replay import OptimizerStep, replay
from gradpipe.formats.safetensors import write_safetensors
from gradpipe.runs import open_run
from gradpipe.testing.faults import faulty_store

CHUNK_BYTES = 16384  # 4,096 float32 per chunk: blocks of their own


def _tensors(step: int, peer: str) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(10 * step + ord(peer))
    return {
        "layer.0.w": rng.standard_normal((64, 256)).astype(np.float32),  # 4 chunks
        "layer.0.b": rng.standard_normal(32).astype(np.float32),  # inline
        "head.w": rng.standard_normal(5000).astype(np.float64),
    }


def _write_run(
    root: Path, change: dict[tuple[int, str], dict[str, np.ndarray]] | None = None
) -> str:
    for step in range(2):
        for peer in ("a", "b"):
            tensors = _tensors(step, peer) | (change or {}).get((step, peer), {})
            path = root / f"step={step}" / f"peer={peer}.safetensors"
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("wb") as f:
                write_safetensors(f, tensors, {})
    return str(root / "step={step}" / "peer={peer}.safetensors")


def _chunk_keys(store: gp.Store, run: str) -> set[str]:
    view = open_run(store, run)
    return {
        block_key(b)
        for e in view
        for n in view.dump(e.step, e.peer).names
        for i, b in enumerate(view.dump(e.step, e.peer).info(n).blocks)
        if b and i not in view.dump(e.step, e.peer).info(n).inline
    }


def _cli(store: gp.Store, *args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict]:
    status = main(["diff", store.url, *args, "--json"])
    out = capsys.readouterr().out
    return status, json.loads(out) if out.strip() else {}


def test_equal_runs_read_no_chunk(store: gp.Store, tmp_path: Path, capsys) -> None:
    pattern = _write_run(tmp_path / "one")
    assert gp.ingest(store, pattern, run="x", chunk_bytes=CHUNK_BYTES).ok
    assert gp.ingest(store, pattern, run="y", chunk_bytes=CHUNK_BYTES).ok
    counted, backend = faulty_store(store)
    report = gp.diff(counted, "x", "y")
    assert report.equal
    assert report.dims == ("step", "peer")
    assert report.counts()["identical"] == 12
    assert report.chunks_read == 0
    chunks = _chunk_keys(store, "x")
    assert chunks
    assert not {k for op, k in backend.calls if op == "read"} & chunks
    status, doc = _cli(store, "x", "y", capsys=capsys)
    assert (status, doc["equal"]) == (0, True)
    assert gp.diff(store, "x@1", "y@1").equal
    assert gp.diff(store, "x@1/a", "y@1/a").equal


def test_one_ulp_is_found_reading_one_pair_of_chunks(
    store: gp.Store, tmp_path: Path, capsys
) -> None:
    changed = _tensors(1, "b")["layer.0.w"].copy()
    changed[40, 3] = np.nextafter(changed[40, 3], np.float32(np.inf))
    assert gp.ingest(store, _write_run(tmp_path / "x"), run="x", chunk_bytes=CHUNK_BYTES).ok
    pattern = _write_run(tmp_path / "y", {(1, "b"): {"layer.0.w": changed}})
    assert gp.ingest(store, pattern, run="y", chunk_bytes=CHUNK_BYTES).ok
    report = gp.diff(store, "x", "y")
    assert not report.equal
    [different] = [t for t in report.tensors if t.status == "different"]
    assert different.position == (1, "b")
    assert different.tensor == "layer.0.w"
    assert different.max_ulp == 1
    assert different.first_element == 40 * 256 + 3
    assert different.first_chunk == (40 * 256 + 3) // 4096
    assert different.chunks_read == 2
    gap = abs(float(changed[40, 3]) - float(_tensors(1, "b")["layer.0.w"][40, 3]))
    assert different.max_abs_diff == gap
    norm = math.sqrt(math.fsum((_tensors(1, "b")["layer.0.w"].astype(float) ** 2).ravel()))
    assert different.rel_l2 == pytest.approx(gap / norm, rel=1e-12)
    status, doc = _cli(store, "x", "y", capsys=capsys)
    assert (status, doc["equal"]) == (1, False)
    assert doc["tensors"][0]["max_ulp"] == 1
    quick = gp.diff(store, "x", "y", quick=True)
    assert quick.chunks_read == 0
    assert [t.status for t in quick.tensors if t.status != "identical"] == ["different"]


def test_signed_zeros_and_nans_differ_in_bits_only(local_store: gp.Store, tmp_path: Path) -> None:
    a = np.array([0.0, 1.0, np.nan, 2.0], np.float32)
    b = np.array([-0.0, 1.0, np.nan, np.nan], np.float32)
    for name, values in (("a", a), ("b", b)):
        local_store.put_tensor(values, name=name)
    report = gp.diff(
        local_store, local_store.refs.get("tensors/a"), local_store.refs.get("tensors/b")
    )
    [record] = report.tensors
    assert record.status == "different"
    assert record.max_ulp == 0  # -0 and +0 are one value; the NaN pair is left out
    assert record.nan_mismatch == 1
    assert record.first_element == 0
    assert record.max_abs_diff == np.inf


def test_different_dumps_and_kinds_mixed(local_store: gp.Store, tmp_path: Path) -> None:
    assert gp.ingest(local_store, _write_run(tmp_path / "x"), run="x", chunk_bytes=CHUNK_BYTES).ok
    report = gp.diff(local_store, "x@0/a", "x@0/b")
    for record in report.tensors:
        a, b = _tensors(0, "a")[record.tensor], _tensors(0, "b")[record.tensor]
        d = a.astype(np.float64) - b.astype(np.float64)
        assert record.max_abs_diff == float(np.abs(d).max())
        want = math.sqrt(math.fsum((d * d).ravel()) / math.fsum((a.astype(float) ** 2).ravel()))
        assert record.rel_l2 == pytest.approx(want, rel=1e-12)
    assert gp.aggregate(local_store, run="x", method="mean", name="avg", steps=[0]).ok
    mixed = gp.diff(local_store, "x@0/a", "x:avg@0")
    assert {t.status for t in mixed.tensors} == {"different"}
    with pytest.raises(gp.InvalidInputError, match="like with like"):
        gp.diff(local_store, "x", "x@0/a")


def test_another_grid_is_compared_by_value(local_store: gp.Store, tmp_path: Path) -> None:
    pattern = _write_run(tmp_path / "x")
    assert gp.ingest(local_store, pattern, run="fine", chunk_bytes=CHUNK_BYTES).ok
    assert gp.ingest(local_store, pattern, run="coarse", chunk_bytes=1 << 20).ok
    report = gp.diff(local_store, "fine@0", "coarse@0")
    assert report.equal
    assert report.chunks_read > 0


def test_snapshots_across_a_prune_and_through_replays(local_store: gp.Store) -> None:
    w = np.ones((300, 200), np.float32)
    m, v = np.zeros_like(w), np.zeros_like(w)
    rng = np.random.default_rng(0)
    for step in range(1, 6):
        grad = rng.standard_normal(w.shape, dtype=np.float32)
        adam = OptimizerStep("adam", lr=1e-3, step=step)
        new = replay(adam, {"param": w, "exp_avg": m, "exp_avg_sq": v}, grad)
        w, m, v = new["param"], new["exp_avg"], new["exp_avg_sq"]
        slots = {"param": "w", "exp_avg": "m", "exp_avg_sq": "v"}
        groups = [{"step": adam, "params": {"w": slots}}]
        gp.snapshot(local_store, "s", {"w": w, "m": m, "v": v}, step=step, gradient={"w": grad},
                    optimizer=groups)  # fmt: skip
    before = {info.step: info.id for info in gp.snapshot_log(local_store, "s")}
    counted, _ = faulty_store(local_store)
    report = gp.diff(counted, "snapshots/s@4", "snapshots/s@5")
    assert not report.equal
    old = gp.restore(local_store, "s", step=4)
    for record in report.tensors:
        want = np.abs(old[record.tensor].astype(float) - {"w": w, "m": m, "v": v}[record.tensor])
        assert record.max_abs_diff == float(want.max())
    gp.prune(local_store, "s", keep_last=2)
    assert gp.diff(local_store, before[5], "snapshots/s@latest").equal
    assert gp.diff(local_store, before[5], "snapshots/s@5").chunks_read == 0


def test_errors_exit_2_not_1(store: gp.Store, tmp_path: Path, capsys) -> None:
    assert gp.ingest(store, _write_run(tmp_path / "x"), run="x", chunk_bytes=CHUNK_BYTES).ok
    changed = {(0, "a"): {"layer.0.w": _tensors(0, "a")["layer.0.w"] + 1}}
    assert gp.ingest(
        store, _write_run(tmp_path / "y", changed), run="y", chunk_bytes=CHUNK_BYTES
    ).ok
    view = open_run(store, "y")
    victim = view.dump(0, "a").info("layer.0.w").blocks[0]
    store.backend.delete(block_key(victim))
    assert main(["diff", store.url, "x", "y"]) == 2
    assert victim in capsys.readouterr().err
    assert main(["diff", store.url, "x", "nope"]) == 2
    err = capsys.readouterr().err
    assert "no run 'nope'" in err


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_ulps_count_across_zero_and_to_infinity(dtype: str) -> None:
    from gradpipe.analytics.diff import _ulp_distance
    from gradpipe.core.dtypes import parse_dtype

    kind = parse_dtype(dtype)
    width = kind.itemsize
    unsigned = np.dtype(f"u{width}")
    tiny = np.array([1], unsigned).view(kind)[0]  # the smallest subnormal
    a = np.array([-tiny, 0.0, 1.0], dtype=kind)
    b = np.array([tiny, -0.0, 1.0], dtype=kind)
    distances = [
        _ulp_distance(a[i : i + 1].view(unsigned), b[i : i + 1].view(unsigned), width)
        for i in range(3)
    ]
    assert distances == [2, 0, 0]
    top = np.array([np.inf], dtype=kind).view(unsigned)
    below = (top - 1).view(kind).view(unsigned)  # the largest finite value
    assert _ulp_distance(top, below, width) == 1


def test_figures_at_the_edges_of_float64_and_of_integers(local_store: gp.Store) -> None:
    pairs = {
        "big": (np.array([1e160, 1.0]), np.array([2e160, 1.0])),  # squares overflow
        "nan": (np.array([1.0, 2.0]), np.array([1.0, np.nan])),
        "zero": (np.array([0.0, 0.0]), np.array([-0.0, 0.0])),
        "ints": (np.array([2**62, 1], np.int64), np.array([2**62 + 1, 1], np.int64)),
    }
    for name, (a, b) in pairs.items():
        local_store.put_tensor(a, name=f"{name}-a")
        local_store.put_tensor(b, name=f"{name}-b")
    found = {
        name: gp.diff(local_store, f"tensors/{name}-a", f"tensors/{name}-b").tensors[0]
        for name in pairs
    }
    assert found["big"].rel_l2 == pytest.approx(1.0, rel=1e-12)
    assert found["big"].max_abs_diff == 1e160
    assert found["nan"].rel_l2 == math.inf
    assert found["nan"].nan_mismatch == 1
    assert found["zero"].rel_l2 == 0.0
    assert found["zero"].max_abs_diff == 0.0
    assert found["ints"].max_abs_diff == 1.0
    assert found["ints"].max_ulp is None


def test_a_tensor_pattern_must_match_something(store: gp.Store, tmp_path: Path, capsys) -> None:
    assert gp.ingest(store, _write_run(tmp_path / "x"), run="x", chunk_bytes=CHUNK_BYTES).ok
    with pytest.raises(gp.InvalidInputError, match="a list of patterns"):
        gp.diff(store, "x", "x", tensors="layer.0.w")  # type: ignore[arg-type]
    assert gp.diff(store, "x", "x", tensors=["layer.*"]).equal
    assert main(["diff", store.url, "x", "x", "--tensors", "layr.*"]) == 2  # a typo: not "equal"
    assert "match no tensor" in capsys.readouterr().err


def test_peers_named_with_at_signs(local_store: gp.Store, tmp_path: Path) -> None:
    path = tmp_path / "step=3" / "peer=rank@0.safetensors"
    path.parent.mkdir()
    with path.open("wb") as f:
        write_safetensors(f, {"w": np.ones(4, np.float32)}, {})
    pattern = str(tmp_path / "step={step}" / "peer={peer}.safetensors")
    assert gp.ingest(local_store, pattern, run="r@1").ok
    assert gp.diff(local_store, "runs/r@1", "runs/r@1").equal
    assert gp.diff(local_store, "r@1@3/rank@0", "r@1@3/rank@0").equal
