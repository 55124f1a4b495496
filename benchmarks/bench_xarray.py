"""The xarray engine beside zarr v3: open a run, read one tensor across all steps and peers.

Data: ``gradpipe.testing.write_transformer_run`` with ``TransformerConfig(steps=--steps)``
(default 4 steps x 2 peers, eight 87 MiB float32 dumps of a MiniLM-L6-shaped
encoder fine-tuned with real backprop and AdamW: 105 tensors each, half of them
small bias/LayerNorm vectors kept inline in gradpipe's manifests, a 45 MiB
token-embedding gradient with ~0.3% of its rows non-zero, dense 384x384 and
1536x384 gradients). Written under ``bench-data/xarray/`` once, then:

- ingested into a gradpipe store (default codecs), opened with
  ``xr.open_dataset(STORE, engine="gradpipe", run="r")``;
- copied into a zarr v3 store (zarr's default codecs, one array per tensor of
  shape ``(step, peer, ...)`` chunked ``(1, 1, <gradpipe's chunk shape>)``, so
  both read the same blocks; consolidated metadata), opened with
  ``xr.open_zarr``.

Tables (medians of ``--repeat`` runs, the two contenders alternating, page cache
warm):

(a) open: seconds to open the whole run, lazily (``chunks=None``) and as dask
    arrays (``chunks={}`` / ``open_zarr``'s default, one block per stored chunk);
(b) read: MiB/s of logical tensor bytes reading one tensor across every step and
    peer (``ds[name].values``) after an open, eagerly and through dask's
    threaded scheduler, for the dense 1536x384 gradient and the sparse
    word-embedding gradient, with the ratio to zarr;
(c) scale: opening a run of ``--scale-dumps`` dumps (default 2,000: 200 steps x
    10 peers of ``TransformerConfig.tiny(layers=6)``, 105 tensors per dump, all
    small enough to live inline) — wall and CPU seconds and the number of
    batched manifest reads. The first run writes and ingests it (minutes).

PASS/FAIL lines follow for the targets: open <= zarr's, read >= 1x zarr.

Run: ``python benchmarks/bench_xarray.py`` (``--repeat N``, ``--steps N``,
``--scale-dumps N``, ``--skip-scale``, ``--fresh``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "bench-data" / "xarray"
RUN = "r"
TENSORS = {
    "dense": "encoder.layer.0.intermediate.dense.weight",
    "sparse": "embeddings.word_embeddings.weight",
}
MiB = 2**20


def prepare(steps: int, fresh: bool) -> tuple[Path, Path]:
    """The gradpipe store and the zarr store of the transformer run, made if missing."""
    import gradpipe as gp
    from gradpipe.testing.transformer import TransformerConfig, write_transformer_run

    if fresh:
        shutil.rmtree(DATA, ignore_errors=True)
    run_dir, store_dir, zarr_dir = DATA / "run", DATA / "store", DATA / "zarr"
    config = TransformerConfig(steps=steps)
    if not (run_dir / "done").exists():
        shutil.rmtree(run_dir, ignore_errors=True)
        print(f"writing {config.steps} steps x {config.peers} peers under {run_dir} ...")
        write_transformer_run(run_dir, config, states=False)
        (run_dir / "done").touch()
    store = gp.open_store(store_dir, mode="a")
    if RUN not in gp.list_runs(store) or len(gp.open_run(store, RUN)) < steps * config.peers:
        print(f"ingesting into {store_dir} ...")
        pattern = str(run_dir / "dumps" / "step={step}" / "peer={peer}.safetensors")
        report = gp.ingest(store, pattern, run=RUN)
        if not report.ok:
            raise SystemExit(report.summary())
        shutil.rmtree(zarr_dir, ignore_errors=True)
    if not (zarr_dir / "done").exists():
        print(f"copying into zarr v3 at {zarr_dir} ...")
        write_zarr(store, zarr_dir)
        (zarr_dir / "done").touch()
    return store_dir, zarr_dir


def write_zarr(store: Any, path: Path) -> None:
    """Every tensor of the run as a zarr v3 array (step, peer, ...) in gradpipe's chunks."""
    import zarr
    from zarr.storage import LocalStore

    import gradpipe as gp

    shutil.rmtree(path, ignore_errors=True)
    run = gp.open_run(store, RUN)
    first = run.dump(run.steps[0], run.peers[0])
    infos = first.infos()
    group = zarr.open_group(LocalStore(path), mode="w", zarr_format=3)
    group.create_array("step", data=np.array(run.steps, dtype=np.int64), dimension_names=["step"])
    peers = np.array(run.peers, dtype=np.dtypes.StringDType())  # zarr v3's variable-length text
    group.create_array("peer", data=peers, dimension_names=["peer"])
    arrays = {}
    for name, info in infos.items():
        dims = ["step", "peer", *(f"{name}_dim{i}" for i in range(len(info.shape)))]
        arrays[name] = group.create_array(
            name,
            shape=(len(run.steps), len(run.peers), *info.shape),
            chunks=(1, 1, *(c or 1 for c in info.chunk_shape)),
            dtype=info.dtype,
            dimension_names=dims,
            fill_value=np.nan,
        )
    for i, step in enumerate(run.steps):
        for j, peer in enumerate(run.peers):
            dump = run.dump(step, peer)
            for name, array in zip(dump.names, dump.iter_read(), strict=True):
                arrays[name][i, j] = array
    zarr.consolidate_metadata(LocalStore(path))


def alternate(contenders: dict[str, Callable[[], float]], repeat: int) -> dict[str, float]:
    """Median of ``repeat`` runs of each, run in turn (one of each per round)."""
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(repeat):
        for name, run in contenders.items():
            times[name].append(run())
    return {name: statistics.median(t) for name, t in times.items()}


def timed(call: Callable[[], object]) -> Callable[[], float]:
    def run() -> float:
        start = time.perf_counter()
        call()
        return time.perf_counter() - start

    return run


def read_after_open(open_: Callable[[], Any], name: str) -> Callable[[], float]:
    """Seconds to read ``name`` whole from a fresh open (the open is not timed)."""

    def run() -> float:
        ds = open_()
        start = time.perf_counter()
        values = ds[name].values
        took = time.perf_counter() - start
        ds.close()
        del values
        return took

    return run


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def scale(dumps: int) -> str:
    """Open a run of ``dumps`` dumps of 105 small tensors: wall, CPU, manifest batches."""
    import gradpipe as gp
    from gradpipe.testing.transformer import TransformerConfig, write_transformer_run

    peers = 10
    config = TransformerConfig.tiny(layers=6, steps=max(1, dumps // peers), peers=peers)
    where = DATA / f"scale-{config.steps}x{peers}"
    if not (where / "run" / "done").exists():
        print(f"writing {config.steps * peers} tiny dumps under {where} (minutes) ...")
        shutil.rmtree(where, ignore_errors=True)
        write_transformer_run(where / "run", config, states=False, backend="numpy")
        (where / "run" / "done").touch()
    store = gp.open_store(where / "store", mode="a")
    if "big" not in gp.list_runs(store):
        print("ingesting them (minutes) ...")
        pattern = str(where / "run" / "dumps" / "step={step}" / "peer={peer}.safetensors")
        report = gp.ingest(store, pattern, run="big")
        if not report.ok:
            raise SystemExit(report.summary())
    reader = gp.open_store(where / "store", mode="r")
    calls: list[int] = []
    inner = reader.backend.read_many

    def counted(keys: Any) -> Any:
        calls.append(len(keys))
        return inner(keys)

    reader.backend.read_many = counted  # type: ignore[method-assign]
    rows = []
    for chunks in (None, {}):
        calls.clear()
        wall, cpu = time.perf_counter(), time.process_time()
        ds = gp.open_dataset(reader, run="big", chunks=chunks)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        tensors = len(ds.data_vars) - 1  # without `present`
        rows.append(
            f"  chunks={chunks!s:<5} {config.steps * peers} dumps x {tensors} tensors: "
            f"{wall:.1f} s wall, {cpu:.1f} s CPU, {len(calls)} batched manifest reads "
            f"(largest {max(calls, default=0)} manifests), no data block read"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--scale-dumps", type=int, default=2000)
    parser.add_argument("--skip-scale", action="store_true")
    parser.add_argument("--fresh", action="store_true", help="write, ingest and copy again")
    args = parser.parse_args()

    import dask
    import xarray as xr

    import gradpipe as gp
    from gradpipe.storage.reads import read_threads
    from gradpipe.xarray.backend import GradpipeBackendEntrypoint

    store_dir, zarr_dir = prepare(args.steps, args.fresh)
    # The engine class itself: the same code as engine="gradpipe", installed or not.
    engine: Any = GradpipeBackendEntrypoint

    def gp_open(chunks: Any) -> Callable[[], Any]:
        return lambda: xr.open_dataset(store_dir, engine=engine, run=RUN, chunks=chunks)

    def zarr_open(chunks: Any) -> Callable[[], Any]:
        if chunks is None:
            return lambda: xr.open_zarr(zarr_dir, chunks=None)
        return lambda: xr.open_zarr(zarr_dir)

    # Bit-exact, and the same values through both.
    check = gp_open(None)()
    zcheck = zarr_open(None)()
    for name in TENSORS.values():
        want = gp.open_run(gp.open_store(store_dir), RUN).dump(0, "peer0").read(name)
        got = check[name].isel(step=0, peer=0).values
        if got.tobytes() != want.tobytes() or zcheck[name].values.tobytes() != (
            check[name].values.tobytes()
        ):
            raise SystemExit(f"{name}: gradpipe and zarr disagree")
    n_steps, n_peers = check.sizes["step"], check.sizes["peer"]

    opens: dict[str, dict[str, float]] = {}
    for label, chunks in (("lazy (chunks=None)", None), ("dask (chunks={})", {})):
        gp_open(chunks)()  # warm imports and the page cache
        zarr_open(chunks)()
        opens[label] = alternate(
            {"gradpipe": timed(gp_open(chunks)), "zarr": timed(zarr_open(chunks))}, args.repeat
        )
    reads: dict[tuple[str, str], dict[str, float]] = {}
    for kind, name in TENSORS.items():
        for label, chunks in (("eager (chunks=None)", None), ("dask threads", {})):
            with dask.config.set(scheduler="threads"):
                reads[kind, label] = alternate(
                    {
                        "gradpipe": read_after_open(gp_open(chunks), name),
                        "zarr": read_after_open(zarr_open(chunks), name),
                    },
                    args.repeat,
                )
    mib = {kind: check[name].nbytes / MiB for kind, name in TENSORS.items()}
    scale_rows = "  skipped (--skip-scale)" if args.skip_scale else scale(args.scale_dumps)

    print(
        f"\ndata: transformer run (MiniLM-L6 shape, float32 gradients), {n_steps} steps x "
        f"{n_peers} peers, 105 tensors per dump; gradpipe default codecs vs zarr v3 default "
        f"codecs in the same chunks; median of {args.repeat}, alternating; "
        f"{read_threads()} decoding threads; load average {os.getloadavg()[0]:.1f} on "
        f"{os.cpu_count()} cores\n"
    )
    print(f"{'(a) open the run':28s} {'gradpipe s':>11s} {'zarr s':>8s} {'gp / zarr':>10s}")
    for label, t in opens.items():
        print(
            f"{label:28s} {t['gradpipe']:11.3f} {t['zarr']:8.3f} {t['gradpipe'] / t['zarr']:10.2f}"
        )
    print(
        f"\n{'(b) read one tensor':40s} {'MiB':>7s} {'gradpipe MiB/s':>15s} {'zarr MiB/s':>11s}"
        f" {'gp / zarr':>10s}"
    )
    for (kind, label), t in reads.items():
        size = mib[kind]
        title = f"{kind} {TENSORS[kind]} {label}"
        print(f"{title:40s}" if len(title) <= 40 else title)
        gp_rate, z_rate = size / t["gradpipe"], size / t["zarr"]
        print(f"{'':40s} {size:7.1f} {gp_rate:15.0f} {z_rate:11.0f} {gp_rate / z_rate:10.2f}")
    print(f"\n(c) scale: opening a large run\n{scale_rows}\n")
    for label, t in opens.items():
        ok = t["gradpipe"] <= t["zarr"]
        print(f"{verdict(ok)}: open {label} <= zarr's ({t['gradpipe']:.3f} s vs {t['zarr']:.3f} s)")
    for (kind, label), t in reads.items():
        ratio = t["zarr"] / t["gradpipe"]
        print(f"{verdict(ratio >= 1)}: read {kind} {label} >= 1x zarr ({ratio:.2f}x)")


if __name__ == "__main__":
    main()
