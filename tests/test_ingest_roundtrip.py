"""Ingest round trips: every dump format, local and S3, threads and a process cluster.

What goes in comes out bit-exact (NaN payloads, -0.0, bfloat16, 0-d and empty
tensors), with its metadata, as numpy, as a dask.array on the stored chunk
grid, and exported back to safetensors.
"""

from __future__ import annotations

import os
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import dask.array as da
import numpy as np
import pytest
from dask.utils import key_split

import gradpipe as gp
from gradpipe.config import get_bytes
from gradpipe.core.chunking import choose_chunk_shape, dask_chunks
from gradpipe.core.dtypes import parse_dtype
from gradpipe.formats.dump import read_dump_header
from gradpipe.formats.safetensors import read_safetensors
from gradpipe.ingestion.api import ingest
from gradpipe.ingestion.plan import plan_units
from gradpipe.runs import export_dump, open_run
from gradpipe.testing.ids import run_tensor_ids

STEPS = [0, 1]
PEERS = ["a", "b"]
# The sidecar of peer "b": numbers and booleans are kept as their JSON text and
# override the file's own metadata (num_examples here).
SIDECAR = {"num_examples": 99, "lr": 0.5, "flag": True, "note": "fixed"}
SIDECAR_META = {"num_examples": "99", "lr": "0.5", "flag": "true", "note": "fixed"}

Expected = dict[tuple[int, str], tuple[dict[str, np.ndarray], dict[str, str]]]


@dataclass
class Batch:
    """One ingest: a pattern, the run it goes to, what each (step, peer) must hold."""

    run: str
    pattern: str
    format: str
    expected: Expected = field(default_factory=dict)
    paths: dict[tuple[int, str], str] = field(default_factory=dict)


def _with_sidecar(place, batch: Batch, rel: str, step: int, peer: str, meta: dict[str, str]):  # type: ignore[no-untyped-def]
    batch.paths[step, peer] = place.path(rel)
    if peer == "b":
        place.write_sidecar(rel, SIDECAR)
        return {**meta, **SIDECAR_META}
    return meta


def make_batches(kit: types.ModuleType, place, fmt: str) -> list[Batch]:  # type: ignore[no-untyped-def]
    """Write 2 steps x 2 peers of dumps in ``fmt``; return the ingests that read them back.

    On S3, where every request costs, two integer dtypes stand for all eight.
    """
    ints = kit.INT_DTYPES if place.kind == "local" else ("int8", "uint64")
    batches: list[Batch] = []
    if fmt == "npy":
        # One tensor per .npy file, named by the file's stem: one run per tensor.
        singles = {
            "wide": lambda s: kit.special_f32((64, 40), s),
            "fortran": lambda s: np.asfortranarray(np.arange(63.0).reshape(9, 7) + s).astype(">f8"),
            "scalar": lambda s: np.array(-s - 7, dtype="<i2"),
            "empty": lambda s: np.zeros((0,), dtype="u1"),
        }
        for name, make in singles.items():
            batch = Batch(
                f"npy-{name}", place.url(f"npy/step={{step}}/peer={{peer}}/{name}.npy"), fmt
            )
            for step in STEPS:
                for i, peer in enumerate(PEERS):
                    arr = make(10 * step + i)
                    rel = f"npy/step={step}/peer={peer}/{name}.npy"
                    place.write(rel, kit.npy_bytes(arr))
                    meta = _with_sidecar(place, batch, rel, step, peer, {})
                    batch.expected[step, peer] = ({name: arr}, meta)
            batches.append(batch)
        return batches

    ext = {"safetensors": "safetensors", "npz": "npz", "npz-compressed": "npz", "torch": "pt"}[fmt]
    batch = Batch(fmt, place.url(f"{fmt}/step={{step}}/peer={{peer}}.{ext}"), fmt)
    for step in STEPS:
        for i, peer in enumerate(PEERS):
            seed = 10 * step + i
            rel = f"{fmt}/step={step}/peer={peer}.{ext}"
            if fmt == "safetensors":
                tensors = kit.numeric_tensors(seed, bf16=True, ints=ints)
                own = {"num_examples": str(32 * (i + 1)), "step": str(step), "peer": peer}
                place.write(rel, kit.safetensors_bytes(tensors, own))
            elif fmt.startswith("npz"):
                tensors = kit.numeric_tensors(seed, bf16=False, ints=ints)
                # Read whole (not by byte range): big-endian and Fortran-ordered members.
                tensors["be"] = np.arange(12, dtype=">i4").reshape(3, 4) - seed
                tensors["fortran"] = np.asfortranarray(kit.special_f32((5, 6), seed))
                data = kit.npz_bytes(tensors, compressed=fmt == "npz-compressed")
                place.write(rel, data)
                own = {}
            else:
                flat = kit.numeric_tensors(seed, bf16=True, ints=ints)
                checkpoint = {
                    "model": {"layer": {"big": flat["big"], "wide": flat["wide"]}},
                    "bf16": flat["bf16"],
                    "grads": [flat[k] for k in flat if k.startswith("i.")],
                    "misc": (flat["half"], flat["mask"], flat["scalar"], flat["empty"]),
                    "step": step,
                    "lr": 0.5,
                    "tag": "warmup",
                    "none": None,
                }
                tensors = {
                    "model.layer.big": flat["big"],
                    "model.layer.wide": flat["wide"],
                    "bf16": flat["bf16"],
                    **{f"grads.{j}": a for j, a in enumerate(checkpoint["grads"])},
                    **{f"misc.{j}": a for j, a in enumerate(checkpoint["misc"])},
                }
                checkpoint = _to_torch(kit, checkpoint)
                place.write(rel, kit.torch_bytes(checkpoint))
                own = {"step": str(step), "lr": "0.5", "tag": "warmup", "none": "None"}
            meta = _with_sidecar(place, batch, rel, step, peer, own)
            batch.expected[step, peer] = (tensors, meta)
    return [batch]


def _to_torch(kit: types.ModuleType, obj: object) -> object:
    if isinstance(obj, np.ndarray):
        return kit.torch_tensor(obj)
    if isinstance(obj, dict):
        return {k: _to_torch(kit, v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_to_torch(kit, v) for v in obj)
    return obj


def check_batch(
    kit: types.ModuleType, store: gp.Store, batch: Batch, export_to: str, *, thorough: bool = True
) -> None:
    """Ingested tensors and metadata read back bit-exact, lazily too, and export exactly.

    ``thorough=False`` (for S3, where each request costs) reads every tensor
    but checks the lazy view and the export on one dump only.
    """
    chunk_bytes = get_bytes("chunk-bytes")
    run = open_run(store, batch.run)
    assert run.grid() == dict.fromkeys(STEPS, PEERS)
    for (step, peer), (tensors, meta) in batch.expected.items():
        where = f"{batch.run} step {step} peer {peer}"
        dump = run.dump(step, peer)
        assert dump.metadata == meta, where
        assert dump.source["path"] == batch.paths[step, peer]
        assert dump.source["format"] == batch.format.removesuffix("-compressed")
        got = dump.read_all()
        assert list(got) == dump.names
        assert sorted(got) == sorted(tensors), where
        for name, want in tensors.items():
            kit.assert_bit_exact(got[name], want, f"{where}: {name}")
        if not thorough and (step, peer) != (STEPS[-1], PEERS[-1]):
            continue
        for name, want in tensors.items():
            info = dump.info(name)
            itemsize = parse_dtype(info.dtype).itemsize
            assert info.chunk_shape == choose_chunk_shape(want.shape, itemsize, chunk_bytes)
            lazy = dump.read(name, lazy=True)
            assert isinstance(lazy, da.Array)
            assert lazy.chunks == dask_chunks(info.shape, info.chunk_shape)
            kit.assert_bit_exact(lazy.compute(scheduler="threads"), want, f"{where}: lazy {name}")
        out = f"{export_to}/{batch.run}-{step}-{peer}.safetensors"
        exported = export_dump(store, batch.run, step, peer, out)
        assert exported.id == dump.id
        back, back_meta = read_safetensors(out)
        assert back_meta == meta, where
        assert sorted(back) == sorted(tensors), where
        for name, want in tensors.items():
            kit.assert_bit_exact(back[name], want, f"{where}: exported {name}")


def ingest_batch(store: gp.Store, batch: Batch, **kwargs: object) -> None:
    report = ingest(store, batch.pattern, run=batch.run, **kwargs)  # type: ignore[arg-type]
    assert report.ok, report.summary()
    assert (report.ingested, report.skipped) == (len(batch.expected), 0)
    assert report.run_id == open_run(store, batch.run).id
    assert report.tensors == sum(len(t) for t, _ in batch.expected.values())
    assert report.raw_bytes == sum(a.nbytes for t, _ in batch.expected.values() for a in t.values())


FORMATS = ["safetensors", "npz", "npz-compressed", "npy", "torch"]


# Every format and chunking on local disk. On S3 (slower per request), with several
# chunks and read units per dump, one format per way of reading: ranged reads of a
# safetensors file, of stored npz members, and a whole-file load (torch).
CASES = [
    *[("local", fmt, chunking) for fmt in FORMATS for chunking in ["one-chunk", "multi-chunk"]],
    *[("s3", fmt, "multi-chunk") for fmt in ["safetensors", "npz", "torch"]],
]


@pytest.mark.parametrize(("place", "fmt", "chunking"), CASES, indirect=["place"])
def test_roundtrip(
    place,  # type: ignore[no-untyped-def]
    fmt: str,
    chunking: str,
    kit: types.ModuleType,
    request: pytest.FixtureRequest,
    tmp_path: Path,
) -> None:
    if fmt == "torch":
        pytest.importorskip("torch")
    if chunking == "multi-chunk":
        request.getfixturevalue("small_chunks")
    batches = make_batches(kit, place, fmt)
    store = gp.open_store(place.store_url, mode="w")
    export_to = str(tmp_path) if place.kind == "local" else place.url("exported")
    for batch in batches:
        ingest_batch(store, batch)
        check_batch(kit, store, batch, export_to, thorough=place.kind == "local")
    if place.kind == "local":
        assert gp.verify(store).ok


def test_multi_chunk_dumps_take_several_reads(
    local, kit: types.ModuleType, small_chunks: None
) -> None:  # type: ignore[no-untyped-def]
    """The small-chunk setting really exercises chunked, multi-unit ingest (a precondition)."""
    place = local
    [batch] = make_batches(kit, place, "safetensors")
    header = read_dump_header(place.fs, batch.paths[0, "a"])
    units = plan_units(
        header, chunk_bytes=get_bytes("chunk-bytes"), unit_bytes=get_bytes("ingest.task-bytes")
    )
    assert len(units) >= 3
    store = gp.open_store(place.store_url, mode="w")
    ingest_batch(store, batch)
    info = open_run(store, batch.run).dump(0, "a").info("big")
    assert info.chunk_shape == (8, 64)
    assert len(info.blocks) == 8
    lazy = open_run(store, batch.run).dump(1, "b").read("big", lazy=True)
    assert lazy.numblocks == (8, 1)
    kit.assert_bit_exact(lazy.compute(scheduler="threads"), batch.expected[1, "b"][0]["big"])


# --- a distributed cluster of processes -----------------------------------------------
@pytest.fixture(scope="module")
def client(s3_server) -> Iterator[object]:  # type: ignore[no-untyped-def]
    """Two worker processes; their environment reaches the loopback S3 server."""
    distributed = pytest.importorskip("distributed")
    env = {
        **s3_server.environ,
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with (
            distributed.LocalCluster(
                n_workers=2,
                threads_per_worker=1,
                processes=True,
                dashboard_address=":0",
                silence_logs=40,
            ) as cluster,
            distributed.Client(cluster, set_as_default=False) as c,
        ):
            yield c
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_process_cluster_matches_threads(
    place, kit: types.ModuleType, client, small_chunks: None, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    [batch] = make_batches(kit, place, "safetensors")
    threaded = gp.open_store(place.store_url, mode="w")
    ingest_batch(threaded, batch)
    cluster_store = gp.open_store(place.store_url + "-cluster", mode="w")
    from distributed import get_task_stream

    with get_task_stream(client) as stream:
        report = ingest(cluster_store, batch.pattern, run=batch.run, client=client)
    assert report.ok, report.summary()
    assert report.ingested == len(batch.expected)
    assert report.dashboard == client.dashboard_link
    # The work ran on the worker processes, under names that read well on the dashboard.
    workers = set(client.scheduler_info()["workers"])
    assert {t["worker"] for t in stream.data} <= workers
    names = {key_split(t["key"]) for t in stream.data}
    expected = {"gradpipe-inspect", "gradpipe-read", "gradpipe-encode", "gradpipe-dump"}
    assert expected | {"gradpipe-commit"} <= names
    ids = run_tensor_ids(cluster_store, batch.run)
    assert len(ids) == sum(len(t) for t, _ in batch.expected.values())
    assert ids == run_tensor_ids(threaded, batch.run)
    # Same files, same content: the whole run manifest is the same object.
    assert open_run(cluster_store, batch.run).id == open_run(threaded, batch.run).id
    export_to = str(tmp_path) if place.kind == "local" else place.url("exported")
    check_batch(kit, cluster_store, batch, export_to, thorough=False)
    # A re-run on the cluster finds everything recorded.
    again = ingest(cluster_store, batch.pattern, run=batch.run, client=client)
    assert (again.ingested, again.skipped, again.writes.blocks_written) == (0, 4, 0)
