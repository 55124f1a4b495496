"""The xarray backend: ``xr.open_dataset(STORE, engine="gradpipe", run=...)`` and friends.

Every value the backend gives is checked against what ``dump.read`` (or the
aggregate's and snapshot's own readers) gives for the same tensor, bit for
bit; missing (step, peer) pairs read as the fill value; selections read only
the chunks they touch; dask keys follow the content.
"""

from __future__ import annotations

import importlib.metadata
import io
import json
import pickle
import re
import subprocess
import sys
import textwrap
import tomllib
import types
import uuid
import warnings
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import dask
import dask.config
import numpy as np
import pytest
import xarray as xr
from hypothesis import example, given, settings
from hypothesis import strategies as st

import gradpipe as gp
from gradpipe.core.dtypes import dtype_name
from gradpipe.core.ids import block_key
from gradpipe.errors import InvalidInputError, NotFoundError
from gradpipe.formats.safetensors import write_safetensors
from gradpipe.testing.s3server import S3Server
from gradpipe.xarray.backend import GradpipeBackendEntrypoint
from gradpipe.xarray.datasets import RUN_RESERVED, SNAPSHOT_RESERVED

ROOT = Path(__file__).resolve().parent.parent
STEPS = (0, 1, 2)
PEERS = ("a", "b", "c")
MISSING = {(1, "b"), (2, "c")}
#: The dump of (2, "a") lacks this tensor: it reads as the fill value there only.
PARTIAL = ((2, "a"), "half")

Dumps = dict[tuple[int, str], dict[str, np.ndarray]]


# --- fixtures ---------------------------------------------------------------------
@pytest.fixture(scope="session")
def gradpipe_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """``engine="gradpipe"`` known to xarray, from pyproject's entry point.

    An up-to-date install declares it already. A checkout whose install
    predates the entry point (an editable install of another tree) gets a
    dist-info of its own on ``sys.path`` carrying pyproject's declaration,
    so the tests read the entry point as written, not a copy of it.
    """
    if _installed_entry_point() is not None:
        yield
        return
    site = tmp_path_factory.mktemp("site")
    _fake_dist_info(site)
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    xr.backends.plugins.list_engines.cache_clear()
    try:
        yield
    finally:
        sys.path.remove(str(site))
        importlib.invalidate_caches()
        xr.backends.plugins.list_engines.cache_clear()


def _declared_entry_points() -> dict[str, str]:
    with (ROOT / "pyproject.toml").open("rb") as f:
        project = tomllib.load(f)["project"]
    return dict(project["entry-points"]["xarray.backends"])


def _installed_entry_point() -> importlib.metadata.EntryPoint | None:
    found = importlib.metadata.entry_points(group="xarray.backends", name="gradpipe")
    return next(iter(found), None)


def _fake_dist_info(site: Path) -> None:
    info = site / "gradpipe_xarray_checkout-0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: gradpipe-xarray-checkout\nVersion: 0.0\n"
    )
    lines = ["[xarray.backends]", *(f"{k} = {v}" for k, v in _declared_entry_points().items())]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")


def dump_tensors(kit: types.ModuleType, step: int, peer: str) -> dict[str, np.ndarray]:
    """Every dtype gradpipe keeps, several chunks, a 0-d and an empty tensor; NaN payloads."""
    tensors = kit.numeric_tensors(step * 10 + PEERS.index(peer), bf16=True)
    if (step, peer) == PARTIAL[0]:
        del tensors[PARTIAL[1]]
    return tensors


def write_dumps(root: str, dumps: Dumps) -> str:
    """``dumps`` as safetensors files under ``root`` (a path or URL); their pattern."""
    import fsspec

    fs, _, [base] = fsspec.get_fs_token_paths(root)
    for (step, peer), tensors in dumps.items():
        path = f"{base}/step={step}/peer={peer}.safetensors"
        fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        meta = {"num_examples": str(10 * step + len(peer)), "lr": "1e-3", "tag": f"{peer}{step}"}
        with fs.open(path, "wb") as f:
            write_safetensors(f, tensors, meta)
    return f"{root}/step={{step}}/peer={{peer}}.safetensors"


@pytest.fixture
def sample(store_url: str, kit: types.ModuleType, small_chunks: None) -> tuple[gp.Store, Dumps]:
    """A run ``r`` of 3 steps x 3 peers with two pairs missing, on local disk and S3."""
    dumps = {(s, p): dump_tensors(kit, s, p) for s in STEPS for p in PEERS if (s, p) not in MISSING}
    store = gp.open_store(store_url, mode="w")
    report = gp.ingest(store, write_dumps(f"{store_url}-dumps", dumps), run="r")
    assert report.ok, report.summary()
    return store, dumps


def expected(dumps: Dumps, name: str) -> np.ndarray:
    """What the backend must give for tensor ``name``: the dumps stacked, the fill elsewhere."""
    first = next(t[name] for t in dumps.values() if name in t)
    fill: Any = np.nan if first.dtype.kind == "f" or dtype_name(first.dtype) == "bfloat16" else 0
    out = np.full((len(STEPS), len(PEERS), *first.shape), fill, dtype=first.dtype)
    for (step, peer), tensors in dumps.items():
        if name in tensors:
            out[STEPS.index(step), PEERS.index(peer)] = tensors[name]
    return out


def assert_same_bits(got: np.ndarray, want: np.ndarray, what: str = "") -> None:
    assert isinstance(got, np.ndarray), what
    assert got.dtype == want.dtype, what
    assert got.shape == want.shape, what
    assert np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(want).tobytes(), what


def count_reads(store: gp.Store) -> list[list[str]]:
    """Record the keys of every batched read of ``store`` (one list per call)."""
    calls: list[list[str]] = []
    inner = store.backend.read_many

    def counted(keys: Any) -> Any:
        calls.append(list(keys))
        return inner(keys)

    store.backend.read_many = counted  # type: ignore[method-assign]
    return calls


# --- the engine -------------------------------------------------------------------
def test_pyproject_registers_the_engine() -> None:
    assert _declared_entry_points() == {"gradpipe": "gradpipe.xarray:GradpipeBackendEntrypoint"}


def test_engine_is_listed_and_light(gradpipe_engine: None) -> None:
    """xarray lists ``gradpipe``; discovering engines imports no distributed, bokeh or s3fs."""
    code = textwrap.dedent(
        """
        import json, sys
        import xarray as xr
        engines = xr.backends.list_engines()
        heavy = [m for m in ("distributed", "bokeh", "s3fs") if m in sys.modules]
        entry = engines.get("gradpipe")
        print(json.dumps({
            "listed": entry is not None,
            "heavy": heavy,
            "parameters": list(entry.open_dataset_parameters) if entry else None,
            "groups": bool(entry and entry.supports_groups),
        }))
        """
    )
    path = [p for p in sys.path if p]
    env = {"PYTHONPATH": ":".join([str(ROOT), *path]), "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    doc = json.loads(done.stdout.strip().splitlines()[-1])
    assert doc["listed"], done.stderr
    assert doc["heavy"] == []
    assert doc["groups"]
    # Explicit keyword parameters: xarray could read them (a **kwargs signature is refused).
    assert {"run", "kind", "name", "at", "storage_options", "drop_variables"} <= set(
        doc["parameters"]
    )


def test_open_dataset_matches_dump_read(
    sample: tuple[gp.Store, Dumps], gradpipe_engine: None
) -> None:
    store, dumps = sample
    ds = xr.open_dataset(store.url, engine="gradpipe", run="r")
    run = gp.open_run(store, "r")
    assert dict(ds.sizes)["step"] == 3
    assert dict(ds.sizes)["peer"] == 3
    assert ds["step"].values.tolist() == list(STEPS)
    assert ds["peer"].values.tolist() == list(PEERS)
    names = set(next(iter(dumps.values()))) | {PARTIAL[1]}
    assert set(ds.data_vars) == names | {"present"}
    for name in names:
        assert ds[name].dims[:2] == ("step", "peer")
        assert ds[name].dims[2:] == tuple(f"{name}_dim{i}" for i in range(ds[name].ndim - 2))
        assert_same_bits(ds[name].values, expected(dumps, name), name)
        for step, peer in dumps:
            if name in dumps[step, peer]:
                want = run.dump(step, peer).read(name)
                got = ds[name].sel(step=step, peer=peer)
                if name != "bf16":  # xarray's equality has no bfloat16 (its isnull refuses it)
                    xr.testing.assert_equal(got.variable, xr.Variable(got.dims, want))
                assert_same_bits(got.values, want, f"{name} {step} {peer}")
    assert ds.attrs["run_id"] == run.id
    assert ds.attrs["kind"] == "run"
    assert ds.attrs["store"] == store.url
    assert ds["big"].attrs["tensor"] == "big"
    assert ds["bf16"].attrs["dtype"] == "bfloat16"


def test_missing_pairs_read_as_fill_and_present_says_so(sample: tuple[gp.Store, Dumps]) -> None:
    store, dumps = sample
    ds = gp.open_dataset(store, run="r")
    present = ds["present"].values
    for i, step in enumerate(STEPS):
        for j, peer in enumerate(PEERS):
            assert present[i, j] == ((step, peer) in dumps)
    gap = {"step": 1, "peer": "b"}
    assert np.isnan(ds["big"].sel(gap).values).all()  # float64
    assert np.isnan(ds["wide"].sel(gap).values.astype("f8")).all()  # float32
    assert np.isnan(ds["bf16"].sel(gap).values.astype("f8")).all()  # bfloat16 keeps its dtype
    assert (ds["i.int32"].sel(gap).values == 0).all()  # integers: 0, dtype kept
    assert ds["i.int32"].dtype == np.int32
    assert not ds["mask"].sel(gap).values.any()  # bools: False
    assert ds["mask"].dtype == bool
    # A dump without one tensor: that tensor alone reads as the fill value there.
    (step, peer), name = PARTIAL
    assert np.isnan(ds[name].sel(step=step, peer=peer).values.astype("f8")).all()
    assert ds["present"].sel(step=step, peer=peer)
    # Metadata: typed coordinates on (step, peer); strings are "" and numbers NaN where missing.
    assert ds["num_examples"].dims == ("step", "peer")
    assert ds["num_examples"].dtype == np.float64  # a pair is missing: NaN there
    assert ds["num_examples"].sel(step=2, peer="b").item() == 21
    assert np.isnan(ds["num_examples"].sel(gap).item())
    assert ds["lr"].sel(step=0, peer="a").item() == 1e-3
    assert ds["tag"].sel(step=2, peer="b").item() == "b2"
    assert ds["tag"].sel(gap).item() == ""
    assert ds["dump_id"].sel(step=0, peer="c").item() == gp.open_run(store, "r").dump(0, "c").id
    assert ds["source"].sel(step=0, peer="a").item().endswith("step=0/peer=a.safetensors")


@pytest.mark.parametrize("chunks", [None, {}])
def test_indexing_as_numpy_does(sample: tuple[gp.Store, Dumps], chunks: Any) -> None:
    """Slices with steps, integer arrays (unsorted, repeated, negative), ints: numpy's results."""
    store, dumps = sample
    ds = gp.open_dataset(store, run="r", chunks=chunks)
    want = expected(dumps, "wide")  # (3, 3, 64, 40) float32 in chunks of 25 rows
    cases: list[dict[str, Any]] = [
        {"step": slice(None, None, 2), "wide_dim0": slice(3, 60, 7)},
        {"peer": [2, 0, 0], "wide_dim0": [63, 0, 24, 25, 24], "wide_dim1": slice(1, 40, 13)},
        {"step": -1, "peer": 1, "wide_dim1": -3},
        {"step": [1], "wide_dim0": slice(20, 30), "wide_dim1": [39, 0]},
        {"wide_dim0": slice(50, 10, -4)},
        {"step": slice(0, 0)},
    ]
    dims = ds["wide"].dims
    for case in cases:
        got = ds["wide"].isel(case).values
        index = tuple(case.get(d, slice(None)) for d in dims)
        ref = want
        for axis in reversed(range(len(dims))):  # outer indexing, one axis at a time
            sel = index[axis]
            ref = (
                ref[(slice(None),) * axis + (sel,)]
                if not isinstance(sel, list)
                else (np.take(ref, sel, axis=axis))
            )
        assert_same_bits(got, ref, str(case))
    # .sel by labels
    got = ds["big"].sel(step=[2, 0], peer="c").values
    assert_same_bits(got, expected(dumps, "big")[[2, 0], 2])
    if chunks is None:
        assert isinstance(ds["wide"].variable._data, xr.core.indexing.ExplicitlyIndexed)
    else:
        assert isinstance(ds["wide"].data, dask.array.Array)


def test_chunks_match_the_stored_chunks(sample: tuple[gp.Store, Dumps]) -> None:
    store, _ = sample
    info = gp.open_run(store, "r").dump(0, "a").info("wide")
    assert info.chunk_shape == (25, 40)
    ds = gp.open_dataset(store, run="r", chunks={})
    assert ds["wide"].encoding["preferred_chunks"] == {
        "step": 1,
        "peer": 1,
        "wide_dim0": 25,
        "wide_dim1": 40,
    }
    assert ds["wide"].chunks == ((1, 1, 1), (1, 1, 1), (25, 25, 14), (40,))
    big = gp.open_run(store, "r").dump(0, "a").info("big")
    assert ds["big"].chunks[2:] == tuple(
        (c,) * (n // c) for n, c in zip(big.shape, big.chunk_shape, strict=True)
    )
    eager = gp.open_dataset(store, run="r").load()
    computed = ds.compute()
    # xarray compares NaNs through isnull, which has no bfloat16: bits for that one.
    assert_same_bits(computed["bf16"].values, eager["bf16"].values)
    xr.testing.assert_identical(computed.drop_vars("bf16"), eager.drop_vars("bf16"))


def test_a_selection_reads_only_the_chunks_it_touches(
    store_url: str, kit: types.ModuleType, small_chunks: None, no_inline: None
) -> None:
    dumps = {(s, p): dump_tensors(kit, s, p) for s in STEPS for p in PEERS}
    store = gp.open_store(store_url, mode="w")
    assert gp.ingest(store, write_dumps(f"{store_url}-dumps", dumps), run="r").ok
    dump = gp.open_run(store, "r").dump(1, "c")
    wide = dump.info("wide")
    fresh = gp.open_store(store_url, mode="r")
    calls = count_reads(fresh)
    ds = gp.open_dataset(fresh, run="r")
    # Opening reads manifests only: the dumps' in one batch, no data block.
    run = gp.open_run(store, "r")
    assert len(calls) == 1
    assert sorted(calls[0]) == sorted(block_key(e.dump) for e in run)
    calls.clear()
    # Rows 30..34 of one dump: chunk 1 of 3 (rows 25..49) only.
    got = ds["wide"].isel(step=1, peer=2, wide_dim0=slice(30, 35)).values
    assert_same_bits(got, dumps[1, "c"]["wide"][30:35])
    fetched = [k for call in calls for k in call]
    assert len(fetched) == 1
    assert fetched == [block_key(str(wide.blocks[1]))]
    calls.clear()
    # Rows 0 and 60 of two peers: chunks 0 and 2 of each, four blocks.
    ds["wide"].isel(step=0, peer=[0, 2], wide_dim0=[60, 0]).values  # noqa: B018
    assert len([k for call in calls for k in call]) == 4
    calls.clear()
    # The same through dask: one task per block, only the blocks selected.
    lazy = gp.open_dataset(fresh, run="r", chunks={})
    calls.clear()
    with dask.config.set(scheduler="sync"):
        lazy["wide"].isel(step=1, peer=2, wide_dim0=slice(30, 35)).values  # noqa: B018
    assert [k for call in calls for k in call] == fetched


def test_dask_keys_follow_the_content(
    sample: tuple[gp.Store, Dumps], kit: types.ModuleType
) -> None:
    store, _ = sample
    one = gp.open_dataset(store, run="r", chunks={})
    two = gp.open_dataset(store.url, run="r", chunks={})
    assert one["wide"].data.name == two["wide"].data.name
    assert dask.base.tokenize(one) == dask.base.tokenize(two)
    # Rechunking a lazily indexed (chunks=None) open tokenizes the backend array.
    lazy_one = gp.open_dataset(store, run="r").chunk({})
    lazy_two = gp.open_dataset(store.url, run="r").chunk({})
    assert lazy_one["wide"].data.name == lazy_two["wide"].data.name
    # A new dump changes the run: new keys, for the variables of the run.
    extra = {(3, "a"): dump_tensors(kit, 3, "a")}
    assert gp.ingest(store, write_dumps(f"{store.url}-more", extra), run="r").ok
    three = gp.open_dataset(store, run="r", chunks={})
    assert three["wide"].data.name != one["wide"].data.name
    assert gp.open_dataset(store, run="r").chunk({})["wide"].data.name != (
        lazy_one["wide"].data.name
    )
    # Pinned at the old state: the old keys, and the old content.
    old = xr.open_dataset(store, engine=GradpipeBackendEntrypoint, run="r", at=one.attrs["run_id"])
    assert old.sizes["step"] == 3
    assert old.attrs["run_id"] == one.attrs["run_id"]


def test_delta_chained_run_reads_bit_exact(store_url: str) -> None:
    rng = np.random.default_rng(5)
    dumps: Dumps = {}
    for peer in ("a", "b"):
        w = rng.standard_normal(4096).astype("float32")
        for step in range(5):
            w = w + np.float32(1e-4) * rng.standard_normal(4096).astype("float32")
            dumps[step, peer] = {"w": w.reshape(64, 64).copy(), "bias": w[:8].copy()}
    store = gp.open_store(store_url, mode="w")
    with dask.config.set({"gradpipe.chunk-bytes": 4096, "gradpipe.inline-bytes": 0}):
        report = gp.ingest(
            store,
            write_dumps(f"{store_url}-dumps", dumps),
            run="p",
            delta=True,
            keyframe_interval=3,
        )
    assert report.ok
    assert report.chains is not None
    assert report.chains.delta_chunks > 0
    run = gp.open_run(store, "p")
    assert run.dump(1, "a").info("w").depth == 1  # the test reads real chains
    for chunks in (None, {}):
        ds = gp.open_dataset(store, run="p", chunks=chunks)
        for (step, peer), tensors in dumps.items():
            for name, array in tensors.items():
                got = ds[name].sel(step=step, peer=peer).values
                assert_same_bits(got, array, f"{name} {step} {peer}")


def test_open_through_storage_options(
    s3_server: S3Server,
    kit: types.ModuleType,
    gradpipe_engine: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An S3 store reached through ``storage_options`` alone (no AWS environment)."""
    s3_server.reset()
    s3_server.make_bucket("gradpipe-test")
    for key in s3_server.environ:
        monkeypatch.delenv(key, raising=False)
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    options = s3_server.storage_options
    url = f"s3://gradpipe-test/{uuid.uuid4().hex[:8]}"
    store = gp.open_store(url, mode="w", storage_options=options)
    tensors = {"w": np.arange(12, dtype="f4").reshape(3, 4)}
    store.put_tensor(tensors["w"])  # the store works through the options
    dumps = {(0, "a"): tensors, (1, "a"): {"w": tensors["w"] * 2}}
    local = Path(f"/tmp/gp-xr-{uuid.uuid4().hex[:8]}")
    try:
        assert gp.ingest(store, write_dumps(str(local), dumps), run="r").ok
    finally:
        import shutil

        shutil.rmtree(local, ignore_errors=True)
    ds = xr.open_dataset(url, engine="gradpipe", run="r", storage_options=options)
    assert_same_bits(ds["w"].values, np.stack([[tensors["w"]], [tensors["w"] * 2]]))
    again = gp.open_dataset(url, run="r", chunks={}, storage_options=options)
    assert_same_bits(again["w"].values, ds["w"].values)
    with pytest.raises(InvalidInputError, match="storage_options"):
        gp.open_dataset(store, run="r", storage_options=options)


# Local disk only: the S3 reads are the same code, and a cluster per store kind costs ~25 s.
@pytest.mark.parametrize("store_url", ["local"], indirect=True)
def test_lazy_dataset_computes_on_a_cluster_of_processes(
    sample: tuple[gp.Store, Dumps],
) -> None:
    distributed = pytest.importorskip("distributed")
    store, dumps = sample
    with (
        distributed.LocalCluster(
            n_workers=2,
            threads_per_worker=1,
            processes=True,
            dashboard_address=":0",
            silence_logs=40,
        ) as cluster,
        distributed.Client(cluster, set_as_default=False) as client,
    ):
        lazy = gp.open_dataset(store, run="r")  # lazily indexed, not dask: pickled whole
        got = client.submit(_load_wide, lazy).result()
        assert_same_bits(got, expected(dumps, "wide"))
        chunked = gp.open_dataset(store, run="r", chunks={})
        total = client.compute(chunked["big"].sum(["big_dim0", "big_dim1"])).result()
        want = np.nansum(expected(dumps, "big"), axis=(2, 3))
        want[~chunked["present"].values] = 0.0
        np.testing.assert_allclose(total.values, want, rtol=1e-12)
    assert pickle.loads(pickle.dumps(lazy))["wide"].shape == lazy["wide"].shape


def _load_wide(ds: xr.Dataset) -> np.ndarray:
    return ds["wide"].values


# --- aggregates and snapshots -----------------------------------------------------
def test_aggregate_opens_over_steps(store_url: str, small_chunks: None) -> None:
    rng = np.random.default_rng(2)
    dumps = {
        (s, p): {
            "wide": rng.standard_normal((64, 40)).astype("f4"),
            "b": rng.standard_normal(3),
        }
        for s in STEPS
        for p in PEERS
        if (s, p) not in MISSING
    }
    store = gp.open_store(store_url, mode="w")
    assert gp.ingest(store, write_dumps(f"{store_url}-dumps", dumps), run="r").ok
    report = gp.aggregate(store, run="r", method="mean", steps=[0, 2], force=True)
    assert report.ok, report.summary()
    ds = gp.open_dataset(store, run="r", kind="aggregate", name="mean")
    run = gp.open_run(store, "r")
    assert ds["step"].values.tolist() == [0, 2]
    assert ds["wide"].dims == ("step", "wide_dim0", "wide_dim1")
    for step in (0, 2):
        agg = run.aggregate("mean", step=step)
        for name in agg.names:
            assert_same_bits(ds[name].sel(step=step).values, agg.read(name), f"{name} {step}")
        assert ds["aggregate_id"].sel(step=step).item() == agg.id
        for peer, weight in agg.weights.items():
            assert ds["weight"].sel(step=step, peer=peer).item() == weight
    assert np.isnan(ds["weight"].sel(step=2, peer="c").item())  # no dump, not an input
    assert ds["method"].values.tolist() == ["mean", "mean"]
    assert ds["stale"].values.tolist() == ["", ""]
    assert ds.attrs["kind"] == "aggregate"
    assert ds.attrs["name"] == "mean"
    with pytest.raises(NotFoundError, match="no aggregate 'fedavg'"):
        gp.open_dataset(store, run="r", kind="aggregate", name="fedavg")
    # A coordinate or dimension missing from the reserved names would clash with a tensor.
    metadata = set(run.dump(step=0, peer="a").metadata)  # shown as coordinates too
    for view in (ds, gp.open_dataset(store, run="r")):
        assert fixed_names(view) - metadata <= RUN_RESERVED, fixed_names(view) - RUN_RESERVED


@pytest.fixture
def snapshots(store_url: str) -> tuple[gp.Store, dict[int, dict[str, Any]]]:
    store = gp.open_store(store_url, mode="w")
    rng = np.random.default_rng(3)
    states = {}
    w = rng.standard_normal((32, 16)).astype("float32")
    for step in (10, 20, 30):
        w = w + np.float32(0.01) * rng.standard_normal((32, 16)).astype("float32")
        state: dict[str, Any] = {
            "model": {"fc.weight": w.copy(), "fc.bias": np.full(4, step, dtype="float64")},
            "epoch": step // 10,
        }
        if step == 30:
            state["model"]["head"] = np.ones(3, dtype="int16")  # new in the last version
        gp.snapshot(store, "train", state, step=step, loss=1.0 / step, metadata={"lr": "0.1"})
        states[step] = state
    return store, states


def test_snapshot_chain_opens_over_versions(
    snapshots: tuple[gp.Store, dict[int, dict[str, Any]]],
) -> None:
    store, states = snapshots
    for chunks in (None, {}):
        ds = gp.open_dataset(store, kind="snapshot", name="train", chunks=chunks)
        assert ds["version"].values.tolist() == [0, 1, 2]
        assert ds["step"].values.tolist() == [10, 20, 30]
        assert ds["model.fc.weight"].dims == (
            "version",
            "model.fc.weight_dim0",
            "model.fc.weight_dim1",
        )
        for version, step in enumerate((10, 20, 30)):
            restored = gp.restore(store, "train", step=step)
            for key in ("fc.weight", "fc.bias"):
                assert_same_bits(
                    ds[f"model.{key}"].isel(version=version).values, restored["model"][key]
                )
        assert (ds["model.head"].isel(version=[0, 1]).values == 0).all()  # absent: fill 0
        assert_same_bits(ds["model.head"].isel(version=2).values, states[30]["model"]["head"])
        np.testing.assert_allclose(ds["loss"].values, [0.1, 0.05, 1 / 30])
        assert ds["lr"].values.tolist() == [0.1, 0.1, 0.1]
        assert ds["time"].dtype.kind == "M"
        log = gp.snapshot_log(store, "train")
        assert ds["snapshot_id"].values.tolist() == [i.id for i in log]
        assert ds.attrs["snapshot_id"] == log[-1].id
        assert fixed_names(ds) - {"lr"} <= SNAPSHOT_RESERVED  # lr: the snapshots' metadata


def fixed_names(ds: xr.Dataset) -> set[str]:
    """A view's own coordinates and dimensions: all but the tensors' ``<name>_dimN``."""
    return {str(n) for n in (*ds.coords, *ds.dims) if "_dim" not in str(n)}


def test_bad_arguments_say_what_to_do(sample: tuple[gp.Store, Dumps]) -> None:
    store, _ = sample
    with pytest.raises(NotFoundError, match="no run 'nope'"):
        gp.open_dataset(store, run="nope")
    with pytest.raises(InvalidInputError, match="needs run="):
        gp.open_dataset(store)
    with pytest.raises(InvalidInputError, match="kind must be one of"):
        gp.open_dataset(store, run="r", kind="stats")  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="and no run"):
        gp.open_dataset(store, run="r", kind="snapshot", name="x")
    with pytest.raises(InvalidInputError, match="needs name="):
        gp.open_dataset(store, run="r", kind="aggregate")
    with pytest.raises(InvalidInputError, match="not BytesIO"):
        xr.open_dataset(io.BytesIO(b"x"), engine=GradpipeBackendEntrypoint, run="r")
    with pytest.raises(NotFoundError, match="no gradpipe store"):
        gp.open_dataset(f"{store.url}-absent", run="r")
    ds = gp.open_dataset(store, run="r", drop_variables=["big", "tag"])
    assert "big" not in ds
    assert "tag" not in ds.coords
    assert "wide" in ds


# --- the tree ---------------------------------------------------------------------
def test_open_datatree_gives_the_whole_store(
    snapshots: tuple[gp.Store, dict[int, dict[str, Any]]],
    gradpipe_engine: None,
    tmp_path: Path,
) -> None:
    store, _ = snapshots
    writable = gp.open_store(store.url, mode="r+")
    state = {
        "params/w": np.arange(6, dtype="f4").reshape(2, 3),
        "step/w": np.array(3.0, dtype="f4"),  # a group "step" would clash with the coordinate
        "loss": np.array([0.5], dtype="f4"),
    }
    dumps = {(0, "p"): state, (1, "p"): {k: v + 1 for k, v in state.items()}}
    url = str(tmp_path / "dumps") if "://" not in store.url else f"{store.url}-tree-dumps"
    assert gp.ingest(writable, write_dumps(url, dumps), run="states").ok
    assert gp.aggregate(writable, run="states", method="sum", force=True).ok
    for chunks in (None, {}):
        tree = xr.open_datatree(store.url, engine="gradpipe", chunks=chunks)
        assert set(tree.groups) >= {
            "/",
            "/runs",
            "/runs/states",
            "/runs/states/params",
            "/aggregates/states/sum",
            "/snapshots/train",
            "/stats/states",
        }
        assert tree.attrs["kind"] == "store"
        run = tree["runs/states"]
        assert_same_bits(run["loss"].values, np.stack([[state["loss"]], [state["loss"] + 1]]))
        params = tree["runs/states/params"]
        assert params.attrs["tensor_prefix"] == "params"
        assert params["w"].attrs["tensor"] == "params/w"
        assert params["w"].dims == ("step", "peer", "params/w_dim0", "params/w_dim1")
        assert params["step"].values.tolist() == [0, 1]  # inherited from the run
        assert_same_bits(
            params["w"].values, np.stack([[state["params/w"]], [state["params/w"] + 1]])
        )
        # A group "step" would clash with the coordinate: the tensor stays, '/' escaped.
        assert "/runs/states/step" not in tree.groups
        assert run["step%2Fw"].attrs["tensor"] == "step/w"
        assert run["step%2Fw"].values.tolist() == [[3.0], [4.0]]
        agg = tree["aggregates/states/sum"]
        assert agg["loss"].dims == ("step", "loss_dim0")
        stats = tree["stats/states"].to_dataset()
        assert float(stats["raw_bytes"].sum().compute()) == sum(
            a.nbytes for d in dumps.values() for a in d.values()
        )
        snap = tree["snapshots/train"].to_dataset()
        xr.testing.assert_identical(
            snap.compute(), gp.open_dataset(store, kind="snapshot", name="train").load()
        )


def test_a_tree_node_is_one_function(
    sample: tuple[gp.Store, Dumps], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new kind of group is one builder in TREE_NODES."""
    import gradpipe.xarray.backend as gx

    def notes_nodes(store: gp.Store, drop: set[str]) -> dict[str, xr.Dataset]:
        return {f"notes/{run}": xr.Dataset(attrs={"run": run}) for run in gp.list_runs(store)}

    monkeypatch.setattr(gx, "TREE_NODES", (*gx.TREE_NODES, notes_nodes))
    store, _ = sample
    tree = xr.open_datatree(store, engine=GradpipeBackendEntrypoint)
    assert tree["notes/r"].attrs == {"run": "r"}
    assert "wide" in tree["runs/r"].data_vars


@pytest.mark.parametrize("store_url", ["local"], indirect=True)
def test_xarray_guesses_the_engine_of_a_local_store(
    sample: tuple[gp.Store, Dumps], gradpipe_engine: None, tmp_path: Path
) -> None:
    store, dumps = sample
    entry = GradpipeBackendEntrypoint()
    assert entry.guess_can_open(store.url)
    assert not entry.guess_can_open(str(tmp_path))  # a directory, no store marker
    assert not entry.guess_can_open("s3://bucket/archive")  # never a request to guess
    ds = xr.open_dataset(store.url, run="r")  # no engine given
    assert_same_bits(ds["big"].values, expected(dumps, "big"))


# --- tensor names -----------------------------------------------------------------
#: Pieces of tensor names that clash with what a view names itself (coordinates,
#: dimensions, path steps, escapes) and with each other once escaped or suffixed.
NAME_PIECES = (
    *("/", ".", "..", "%", "%2F", "%25", "%73", "%2E", "_", "_dim0", "_dim1", "dim0"),
    *("step", "peer", "present", "dump_id", "source", "version", "weight", "method"),
    *("loss", "time", "snapshot_id", "metadata_", "lr", "w", "a", "b", "é", " "),
)
tensor_names = st.one_of(
    st.lists(st.sampled_from(NAME_PIECES), min_size=1, max_size=5).map("".join),
    st.text(alphabet="/.%_ab", min_size=1, max_size=8),
)
#: Names whose shown forms clashed (or broke the DataTree) before they were escaped.
CLASHING_NAMES = (
    ["a/../b", "x"],
    ["a/./b", "a/b"],
    [".."],
    ["a//b", "a/_/b"],
    ["step", "step_"],
    ["w", "w_dim0"],
    ["a/b", "a/b/c"],
    ["a/step", "a/step/x"],
    ["peer", "weight", "weight_", "%77eight"],
    ["lr/x", "a/b%2Fc", "a/b/c"],
)


def commit_named_dumps(
    store: gp.Store, run: str, dumps: Dumps, metadata: dict[str, str] | None = None
) -> None:
    """``dumps`` committed as the ingest commits them, without files (fast: many per test)."""
    from gradpipe.core.manifest import manifest_id
    from gradpipe.core.run_manifest import DumpEntry, DumpManifest, TensorSchema
    from gradpipe.ingestion.discover import DumpFile
    from gradpipe.ingestion.tasks import DumpResult, commit_run
    from gradpipe.storage.blocks import WriteStats

    manifests, results, files = [], [], []
    for (step, peer), tensors in dumps.items():
        kept = {name: store.write_tensor(array) for name, array in tensors.items()}
        ids = {name: manifest_id(t) for name, t in kept.items()}
        path = f"named/{step}/{peer}"
        manifests.append(
            DumpManifest(
                run,
                step,
                peer,
                tuple(ids.items()),
                metadata=dict(metadata or {}),
                source={"path": path, "fingerprint": path},
                embedded={ids[n]: t for n, t in kept.items()},
            )
        )
        schema = {n: TensorSchema(dtype_name(a.dtype), a.shape) for n, a in tensors.items()}
        files.append(DumpFile(step, peer, path, 16, path))
        results.append((DumpEntry(step, peer, "", path), schema))
    dump_ids = store.put_manifests(manifests)
    done = [
        DumpResult(DumpEntry(e.step, e.peer, i, e.fingerprint), s, WriteStats(), 16, {})
        for (e, s), i in zip(results, dump_ids, strict=True)
    ]
    with store.writing(f"commit named dumps into run {run}") as lease:
        commit_run(store, run, files, done, "named dumps", False, lease.key if lease else None)


def named_values(names: list[str]) -> Dumps:
    """Two steps of peer ``p`` and one of ``q``: tensor ``i`` has ``i + 1`` values ``i + step``."""
    return {
        (step, peer): {n: np.full(i + 1, i + 10 * step, dtype="f4") for i, n in enumerate(names)}
        for step, peer in ((0, "p"), (1, "p"), (1, "q"))
    }


def assert_every_tensor_shown(
    variables: dict[str, xr.DataArray], dumps: Dumps, where: str, lead: str = "run"
) -> None:
    """Each tensor of ``dumps`` is exactly one of ``variables``, its name in ``attrs``."""
    from gradpipe.xarray.view_names import original_name

    by_tensor: dict[str, list[str]] = {}
    for key, variable in variables.items():
        if "tensor" in variable.attrs:
            by_tensor.setdefault(variable.attrs["tensor"], []).append(key)
    tensors = dumps[(0, "p")]
    assert sorted(by_tensor) == sorted(tensors), where
    for name, (key,) in by_tensor.items():
        assert original_name(key) == name, (where, key)  # the shown name is reversible
        variable = variables[key]
        assert variable.dims[-1].endswith("_dim0"), (where, key)
        if lead == "run":
            got = variable.transpose("step", "peer", ...).values
            assert_same_bits(got[0, 0], tensors[name], f"{where} {key}")
            assert_same_bits(got[1, 1], dumps[(1, "q")][name], f"{where} {key}")
            assert np.isnan(got[0, 1]).all(), (where, key)  # (0, "q") has no dump
        else:
            assert_same_bits(variable.isel({lead: 0}).values, tensors[name], f"{where} {key}")


def tree_variables(tree: xr.DataTree, under: str) -> dict[str, xr.DataArray]:
    """Every variable of ``under`` and the groups below it, by path (``params/w``).

    Each is looked up by its path, as a user would, and no group is a path step.
    """
    out = {}
    for node in tree[under].subtree:
        assert node.name not in ("", ".", ".."), node.path
        prefix = node.relative_to(tree[under])
        for key in node.to_dataset(inherit=False).data_vars:
            path = str(key) if prefix == "." else f"{prefix}/{key}"
            out[path] = tree[f"{under}/{path}"]
            assert out[path].attrs == node[key].attrs, path
    return out


@settings(max_examples=60, deadline=None)
@given(
    names=st.lists(tensor_names, min_size=1, max_size=6, unique=True),
    keys=st.lists(tensor_names, max_size=3, unique=True),
)
@example(names=["a/../b", "x"], keys=[])
@example(names=["w", "w_dim0", "a/b", "a/b/c", "lr/x"], keys=["w_dim0", "lr", "a%2Fb", "x/y"])
def test_every_tensor_name_is_shown_once_and_the_tree_opens(
    names: list[str], keys: list[str], gradpipe_engine: None
) -> None:
    """Whatever the names, each tensor is one variable (name in attrs) and the DataTree opens."""
    check_names_shown(names, keys)


@pytest.mark.parametrize("names", CLASHING_NAMES, ids=repr)
def test_names_that_clashed_are_all_shown(names: list[str], gradpipe_engine: None) -> None:
    """The examples of issue 18: a dropped tensor, a ``..`` group, a tree that did not open."""
    check_names_shown(names, [])


def check_names_shown(names: list[str], keys: list[str]) -> None:
    """Run, snapshot and DataTree of tensors ``names`` with metadata ``keys``: all shown."""
    store = gp.open_store(f"memory://names-{uuid.uuid4().hex}", mode="w")
    dumps = named_values(names)
    metadata = {k: str(i) for i, k in enumerate(keys)}
    commit_named_dumps(store, "r", dumps, metadata)
    gp.snapshot(store, "s", dumps[(0, "p")], step=0, metadata=metadata)
    ds = gp.open_dataset(store, run="r")
    assert_every_tensor_shown(dict(ds.data_vars), dumps, "dataset")
    assert len(ds.coords) == 4 + len(keys)  # step, peer, dump_id, source + every metadata key
    for name in names:
        shown = next(k for k, v in ds.data_vars.items() if v.attrs.get("tensor") == name)
        if _ordinary(name, RUN_RESERVED):
            assert shown == name  # an ordinary name is shown as it is
    snap = gp.open_dataset(store, kind="snapshot", name="s")
    assert_every_tensor_shown(dict(snap.data_vars), dumps, "snapshot", lead="version")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is left out
        tree = xr.open_datatree(store, engine=GradpipeBackendEntrypoint)
    assert_every_tensor_shown(tree_variables(tree, "runs/r"), dumps, "tree")
    assert_every_tensor_shown(
        tree_variables(tree, "snapshots/s"), dumps, "tree snapshot", lead="version"
    )
    assert len(tree["runs/r"].coords) == 4 + len(keys)


def _ordinary(name: str, reserved: Collection[str]) -> bool:
    return not (
        "%" in name
        or name in reserved
        or name in (".", "..")
        or re.search(r"_dim[0-9]+\Z", name) is not None
    )


def test_aggregate_shows_tensors_named_like_its_coordinates(gradpipe_engine: None) -> None:
    """``peer`` and ``weight`` are coordinates of an aggregate; tensors so named are kept."""
    names = ["peer", "weight", "weight_", "%77eight", "w", "w_dim0", "method/x"]
    store = gp.open_store(f"memory://names-{uuid.uuid4().hex}", mode="w")
    dumps = named_values(names)
    commit_named_dumps(store, "r", dumps)
    assert gp.aggregate(store, run="r", method="mean", steps=[0], force=True).ok
    ds = gp.open_dataset(store, run="r", kind="aggregate", name="mean")
    mean: Dumps = {(0, "p"): dumps[(0, "p")]}  # step 0 has one dump: the mean is that dump
    assert_every_tensor_shown(dict(ds.data_vars), mean, "aggregate", lead="step")
    assert ds["peer"].values.tolist() == ["p"]  # the coordinate, not the tensor
    assert ds["weight"].dims == ("step", "peer")
    tree = xr.open_datatree(store, engine=GradpipeBackendEntrypoint)
    assert_every_tensor_shown(
        tree_variables(tree, "aggregates/r/mean"), mean, "tree aggregate", lead="step"
    )


def test_tensors_drop_by_their_name_or_shown_name() -> None:
    store = gp.open_store(f"memory://names-{uuid.uuid4().hex}", mode="w")
    commit_named_dumps(store, "r", named_values(["step", "a", "b"]))
    ds = gp.open_dataset(store, run="r", drop_variables=["step", "a"])  # tensor "step", not the dim
    assert sorted(ds.data_vars) == ["b", "present"]
    assert ds["step"].values.tolist() == [0, 1]
    ds = gp.open_dataset(store, run="r", drop_variables=["%73tep"])
    assert sorted(ds.data_vars) == ["a", "b", "present"]


def test_a_name_the_tree_cannot_show_is_left_out_with_a_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A node whose coordinate ``a/b`` escapes to its own ``a%2Fb``: left out, named; the rest
    opens. (gradpipe's own datasets escape ``%``, so only a node from elsewhere can.)"""
    import gradpipe.xarray.backend as gx

    def odd_nodes(store: gp.Store, drop: set[str]) -> dict[str, xr.Dataset]:
        odd = xr.Dataset(
            {"a%2Fb": ("x", [1, 2]), "c": ("x", [5, 6])}, coords={"a/b": ("x", [3, 4])}
        )
        return {"odd": odd}

    monkeypatch.setattr(gx, "TREE_NODES", (*gx.TREE_NODES, odd_nodes))
    store = gp.open_store(f"memory://names-{uuid.uuid4().hex}", mode="w")
    commit_named_dumps(store, "r", named_values(["wide"]))
    with pytest.warns(UserWarning, match=r"/odd: variable 'a/b' is left out .*'a%2Fb'"):
        tree = xr.open_datatree(store, engine=GradpipeBackendEntrypoint)
    assert tree["odd/a%2Fb"].values.tolist() == [1, 2]
    assert tree["odd/c"].values.tolist() == [5, 6]
    assert "wide" in tree["runs/r"].data_vars
