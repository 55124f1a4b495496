"""Ingest of a whole training run: gradpipe beside ``cp -r``, zarr v3 and ZipNN.

Prints one table per data set (``--data``, default ``transformer``):

- ``transformer``: ``gradpipe.testing.write_transformer_run`` with
  ``TransformerConfig.for_dump_size(--mib)``: a BERT-small / MiniLM-L6-shaped
  encoder (vocabulary 30522, hidden 384, 6 layers) fine-tuned by 2 peers with
  real backprop and AdamW; each float32 dump holds 105 tensors (half of them
  small LayerNorm/bias vectors, a 45 MiB token-embedding gradient with ~0.3% of
  rows non-zero, dense 384x384 and 384x1536 gradients), 87 MiB each, as users'
  dumps are; they compress about 2x,
- ``sparse``: ``gradpipe.testing.write_sample_run`` with
  ``TrainingConfig.for_dump_size(--mib)``: a toy model whose huge sparse
  embedding gradient carries the size (compresses several hundred times),
- ``dense``: the toy model with big dense layers and a small embedding,
- ``all``: each of them in turn.

The dumps are safetensors files under a temporary directory in /tmp. Rows, all on
the same files in the same run:

- ``cp -r``: the dump directory copied by ``cp -r`` (a subprocess); the anchor,
- ``gradpipe ingest (CLI)``: the whole ``gradpipe ingest STORE PATTERN --run r``
  command (a subprocess: interpreter start, imports, discovery, the graph,
  the commit) into a new local store,
- ``gradpipe re-ingest (CLI)``: the same command again over the same files and
  store (everything is recorded already: nothing is read or written but refs),
- ``gradpipe ingest (API, threads)``: ``gradpipe.ingestion.api.ingest`` in this process
  with the default local threaded scheduler, into a new local store; and
  ``gradpipe re-ingest (API)``, the same call again into that store,
- ``gradpipe ingest (API, LocalCluster)``: the same with ``client=`` a
  ``distributed.LocalCluster(n_workers=<cores>, threads_per_worker=1)`` of
  processes (cluster start-up not timed): why threads are the default,
- ``gradpipe ingest to S3 (CLI)``: the CLI into ``s3://`` on moto's server on
  loopback (``gradpipe.testing.s3server.S3Server``, in this process; the dumps
  stay on local disk),
- ``zarr v3``: every tensor read from its file (``read_safetensors``) and
  written with ``zarr.create_array`` and zarr's default chunks and codecs
  (``BytesCodec`` + ``ZstdCodec(level=0)``) into a ``zarr.storage.LocalStore``,
  one array per (step, peer, tensor),
- ``zipnn``: every tensor read from its file and compressed with
  ``zipnn.ZipNN(input_format="numpy", bytearray_dtype="float32")`` (its
  defaults otherwise: AUTO method, one thread per core), one file per tensor.

Fairness: ``cp -r`` runs once untimed first, so every row reads the dumps from
the page cache; ``os.sync()`` runs (untimed) before each row, so no row pays for
writing back another's dirty pages; no row fsyncs. Columns: wall seconds, MiB/s
of logical tensor bytes, bytes on disk (apparent sizes of every file the row
created; S3: object sizes), logical / stored, and speed (inverse wall time) and
stored size relative to ``cp -r`` and to zarr v3. Each row is the best of
``--repeat`` runs (default 3), each into a new store or directory; on a small
shared machine the figures still move by tens of percent from run to run.

Run: ``python benchmarks/bench_ingest.py`` (``--data KIND``, ``--mib M``, ``--repeat N``,
``--skip-s3``, ``--skip-cluster``); a few minutes on two cores.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from gradpipe import open_store
from gradpipe.formats.safetensors import read_safetensors
from gradpipe.ingestion.api import ingest
from gradpipe.testing import (
    SampleRun,
    TrainingConfig,
    TransformerConfig,
    TransformerRun,
    write_sample_run,
    write_transformer_run,
)

BIN = Path(sys.executable).parent
BUCKET = "bench"
MiB = 2**20
KINDS = ("transformer", "sparse", "dense")


@dataclass
class Row:
    name: str
    seconds: float
    stored: int
    note: str = ""
    objects: int = 0  # files the method wrote (0: not counted)
    note_ratio: float = 0.0  # cp -r time / this time, median over paired runs


def disk_bytes(root: Path) -> int:
    """Apparent size of every file under ``root``."""
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def file_count(root: Path) -> int:
    """Number of files under ``root`` (objects a method wrote)."""
    return sum(1 for p in root.rglob("*") if p.is_file())


def timed(func: Callable[[], Any]) -> tuple[float, Any]:
    os.sync()  # untimed: no row pays for another's dirty pages
    start = time.perf_counter()
    out = func()
    return time.perf_counter() - start, out


def dump_files(sample: SampleRun) -> list[tuple[int, str, str]]:
    return [(s, p, sample.dump_path(s, p)) for s in sample.steps for p in sample.peers]


# --- rows -------------------------------------------------------------------------
def cli_ingest(
    store: str, pattern: str, env: dict[str, str] | None = None, *, options: Sequence[str] = ()
) -> dict[str, Any]:
    environ = {k: v for k, v in os.environ.items() if k != "DASK_SCHEDULER_ADDRESS"}
    environ.update(env or {})
    command = [str(BIN / "gradpipe"), "ingest", store, pattern, "--run", "r", "--json", *options]
    done = subprocess.run(command, capture_output=True, env=environ, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr.decode()}")
    doc: dict[str, Any] = json.loads(done.stdout)
    return doc


def check_ingest(doc: dict[str, Any], dumps: int, *, again: bool = False) -> None:
    want = (0, dumps) if again else (dumps, 0)
    got = (doc["ingested"], doc["skipped"])
    if not doc["ok"] or got != want:
        raise AssertionError(f"ingest report {got} != {want}: {doc}")


def zarr_write(sample: SampleRun, root: Path) -> None:
    import zarr
    from zarr.storage import LocalStore

    store = LocalStore(root, read_only=False)
    zarr.open_group(store, mode="w")
    for step, peer, path in dump_files(sample):
        tensors, _ = read_safetensors(path)
        for name, tensor in tensors.items():
            zarr.create_array(store, name=f"step{step}/{peer}/{name}", data=tensor)


def zipnn_compressor() -> Any:
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        from zipnn import ZipNN

        return ZipNN(input_format="numpy", bytearray_dtype="float32")


def zipnn_write(sample: SampleRun, root: Path, zipnn: Any) -> None:
    for step, peer, path in dump_files(sample):
        tensors, _ = read_safetensors(path)
        folder = root / f"step{step}" / peer
        folder.mkdir(parents=True)
        for name, tensor in tensors.items():
            (folder / f"{name}.znn").write_bytes(zipnn.compress(tensor))


def check_zipnn(sample: SampleRun, root: Path, zipnn: Any) -> None:
    step, peer, path = dump_files(sample)[-1]
    tensors, _ = read_safetensors(path)
    for name, tensor in tensors.items():
        back = zipnn.decompress((root / f"step{step}" / peer / f"{name}.znn").read_bytes())
        if np.asarray(back).tobytes() != tensor.tobytes():
            raise AssertionError(f"zipnn round trip of {name} is not bit-exact")


@contextlib.contextmanager
def local_cluster(workers: int) -> Iterator[Any]:
    from distributed import Client, LocalCluster

    with (
        LocalCluster(
            n_workers=workers,
            threads_per_worker=1,
            processes=True,
            dashboard_address=None,
            host="127.0.0.1",
        ) as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        yield client


# --- the table ------------------------------------------------------------------------
def best_of(repeat: int, once: Callable[[int], tuple[float, int]]) -> tuple[float, int]:
    """Best wall time of ``once(i)`` over ``repeat`` runs (each into a fresh place)."""
    results = [once(i) for i in range(repeat)]
    return min(results, key=lambda r: r[0])


def median_of(results: list[tuple[float, int]]) -> tuple[float, int]:
    """The run of median wall time (the lower middle one for an even count)."""
    ordered = sorted(results, key=lambda r: r[0])
    return ordered[(len(ordered) - 1) // 2]


Sample = SampleRun | TransformerRun


def make_data(kind: str, mib: float, root: Path) -> tuple[Sample, int, str]:
    """Write the dumps of ``kind``: the run, its logical bytes and a description.

    transformer: a BERT-small fine-tuning run (the default; what users' dumps look
    like); sparse: gradpipe.testing.training's run sized by its big embedding;
    dense: the same model with big dense layers and a small embedding.
    """
    if kind == "transformer":
        config = TransformerConfig.for_dump_size(mib)
        sample = write_transformer_run(root, config, states=False)
        shapes = config.param_shapes()
        what = (
            f"transformer: write_transformer_run(TransformerConfig.for_dump_size({mib:g})): "
            f"BERT-like encoder, vocab {config.vocab_size}, hidden {config.hidden}, "
            f"{config.layers} layers, {len(shapes)} tensors per dump, embedding gradient rows "
            f"touched ~0.3%, batch {config.batch_size}x{config.seq_len}, torch/AdamW"
        )
        return sample, config.dump_bytes(), what
    if kind == "sparse":
        training = TrainingConfig.for_dump_size(mib)
        what = f"sparse: write_sample_run(TrainingConfig.for_dump_size({mib:g}))"
    else:
        one_step = TrainingConfig(vocab_size=2_000, embed_dim=64, hidden=2_048, steps=1)
        steps = max(1, round(mib * MiB / one_step.dump_bytes()))
        training = replace(one_step, steps=steps)
        what = (
            f"dense: write_sample_run(TrainingConfig(vocab_size=2000, hidden=2048, steps={steps}))"
        )
    what += f", embedding {training.vocab_size}x{training.embed_dim}"
    return write_sample_run(root, training), training.dump_bytes(), what


def run(args: argparse.Namespace, kind: str, tmp: Path) -> tuple[list[Row], int, str, int]:
    seconds, (sample, logical, what) = timed(lambda: make_data(kind, args.mib, tmp / "sample"))
    n = len(dump_files(sample))
    pattern = sample.dump_pattern
    source = Path(sample.directory) / "dumps"
    desc = (
        f"data: {what}; {len(sample.steps)} steps x {len(sample.peers)} peers = {n} "
        f"safetensors dumps, {logical / MiB:.0f} MiB of float32 tensors "
        f"({disk_bytes(source) / MiB:.0f} MiB of files); generated in {seconds:.0f} s"
    )
    repeat = max(1, args.repeat)
    rows: list[Row] = []

    def fresh(name: str, i: int) -> Path:
        """A new destination; the previous repetition's is removed (not timed)."""
        if i:
            shutil.rmtree(tmp / f"{name}{i - 1}")
        return tmp / f"{name}{i}"

    subprocess.run(["cp", "-r", str(source), str(tmp / "warm")], check=True)  # page cache
    shutil.rmtree(tmp / "warm")

    def copy(i: int) -> tuple[float, int]:
        dest = fresh("cp", i)
        seconds, _ = timed(lambda: subprocess.run(["cp", "-r", str(source), str(dest)], check=True))
        return seconds, disk_bytes(dest)

    def cli(i: int) -> tuple[float, int]:
        dest = fresh("gp-cli", i)
        seconds, doc = timed(lambda: cli_ingest(str(dest), pattern))
        check_ingest(doc, n)
        return seconds, disk_bytes(dest)

    # cp -r and the CLI run in pairs, one right after the other, and the median
    # of each is reported (a shared machine's load moves both alike).
    pairs = [(copy(i), cli(i)) for i in range(max(3, repeat))]
    paired_ratios = sorted(c[0] / g[0] for c, g in pairs)
    cli_store = tmp / f"gp-cli{len(pairs) - 1}"
    rows.append(Row("cp -r", *median_of([c for c, _ in pairs]), objects=file_count(source)))
    rows.append(
        Row(
            "gradpipe ingest (CLI)",
            *median_of([g for _, g in pairs]),
            objects=file_count(cli_store),
            note_ratio=paired_ratios[(len(paired_ratios) - 1) // 2],
        )
    )
    before = disk_bytes(cli_store)

    def again(i: int) -> tuple[float, int]:
        seconds, doc = timed(lambda: cli_ingest(str(cli_store), pattern))
        check_ingest(doc, n, again=True)
        return seconds, disk_bytes(cli_store) - before

    rows.append(Row("gradpipe re-ingest (CLI)", *best_of(repeat, again), "new"))

    def api(i: int, client: Any = None, name: str = "gp-api") -> tuple[float, int]:
        dest = fresh(name, i)
        store = open_store(str(dest), mode="w")
        seconds, report = timed(lambda: ingest(store, pattern, run="r", client=client))
        check_ingest(report.to_dict(), n)
        return seconds, disk_bytes(dest)

    rows.append(Row("gradpipe ingest (API, threads)", *best_of(repeat, api)))
    api_path = tmp / f"gp-api{repeat - 1}"
    rows[-1].objects = file_count(api_path)
    api_store = open_store(str(api_path), mode="a")
    before = disk_bytes(api_path)

    def api_again(i: int) -> tuple[float, int]:
        seconds, report = timed(lambda: ingest(api_store, pattern, run="r"))
        check_ingest(report.to_dict(), n, again=True)
        return seconds, disk_bytes(api_path) - before

    rows.append(Row("gradpipe re-ingest (API)", *best_of(repeat, api_again), "new"))

    if not args.skip_cluster:
        workers = os.cpu_count() or 1
        with local_cluster(workers) as client:
            result = best_of(repeat, lambda i: api(i, client, "gp-cluster"))
        rows.append(Row(f"gradpipe ingest (API, LocalCluster {workers}x1)", *result))

    if not args.skip_s3:
        import fsspec

        from gradpipe.testing.s3server import S3Server

        with S3Server() as server:
            server.make_bucket(BUCKET)
            fs = fsspec.filesystem("s3", **server.storage_options)

            def s3(i: int) -> tuple[float, int]:
                url = f"s3://{BUCKET}/store{i}"
                seconds, doc = timed(lambda: cli_ingest(url, pattern, env=server.environ))
                check_ingest(doc, n)
                stored = sum(int(info["size"]) for info in fs.find(url, detail=True).values())
                fs.rm(url, recursive=True)  # moto keeps objects in memory
                return seconds, stored

            rows.append(Row("gradpipe ingest to S3 (CLI)", *best_of(repeat, s3)))

    def zarr_row(i: int) -> tuple[float, int]:
        dest = fresh("zarr", i)
        seconds, _ = timed(lambda: zarr_write(sample, dest))
        return seconds, disk_bytes(dest)

    rows.append(Row("zarr v3 (default codecs)", *best_of(repeat, zarr_row)))
    rows[-1].objects = file_count(tmp / f"zarr{repeat - 1}")

    zipnn = zipnn_compressor()

    def zipnn_row(i: int) -> tuple[float, int]:
        dest = fresh("zipnn", i)
        seconds, _ = timed(lambda: zipnn_write(sample, dest, zipnn))
        check_zipnn(sample, dest, zipnn)
        return seconds, disk_bytes(dest)

    rows.append(Row("zipnn (numpy, float32)", *best_of(repeat, zipnn_row)))
    return rows, logical, desc, n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=500, help="MiB of dumps (default 500)")
    parser.add_argument("--repeat", type=int, default=3, help="best of N runs (default 3)")
    parser.add_argument(
        "--data",
        choices=[*KINDS, "all"],
        default="transformer",
        help="transformer: a BERT-small fine-tuning run, as users' dumps (default); sparse: "
        "embedding gradients with few touched rows; dense: big dense layers; all: each in turn",
    )
    parser.add_argument("--skip-s3", action="store_true", help="no S3 row")
    parser.add_argument("--skip-cluster", action="store_true", help="no LocalCluster row")
    args = parser.parse_args()
    for kind in KINDS if args.data == "all" else [args.data]:
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="gradpipe-bench-ingest-", dir="/tmp") as tmp:
            rows, logical, desc, dumps = run(args, kind, Path(tmp))
        print_table(args, kind, rows, logical, desc, dumps)
        print(f"\ntotal {time.perf_counter() - start:.0f} s\n")


def print_table(
    args: argparse.Namespace, kind: str, rows: list[Row], logical: int, desc: str, dumps: int
) -> None:
    by_name = {row.name: row for row in rows}
    cp, zarr = by_name["cp -r"], by_name["zarr v3 (default codecs)"]

    print(f"=== ingest of a training run's dumps, data: {kind} ===")
    print(desc)
    print(
        f"cp -r and the CLI ingest: medians of {max(3, args.repeat)} paired runs; other rows: best "
        f"of {max(1, args.repeat)}; each run into a new store/directory"
    )
    print(
        "page cache: cp -r ran once untimed first, so every row reads the dumps from memory; "
        "os.sync() before each row; no fsync anywhere (writes land in the page cache)"
    )
    print(
        "MiB/s of logical tensor bytes; stored = bytes of the files/objects written; "
        "ratio = logical / stored; speed = wall-time ratio (above 1: faster than the anchor); "
        "size/zarr = stored / zarr's stored\n"
    )
    header = (
        f"{'method':<40} {'wall s':>7} {'MiB/s':>7} {'stored MiB':>11} {'ratio':>7}"
        f" {'speed/cp':>9} {'speed/zarr':>11} {'size/zarr':>10} {'obj/dump':>9} {'KiB/dump':>9}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        stored = f"{row.stored / MiB:>11.2f}"
        if row.note:  # a re-ingest: reads and writes next to nothing, rates mean nothing
            print(
                f"{row.name:<40} {row.seconds:>7.3f} {'-':>7} {stored} {'-':>7} {'-':>9}"
                f" {'-':>11} {'-':>10}  (stored: {row.note} bytes)"
            )
            continue
        per_dump = (
            f" {row.objects / dumps:>9.1f} {row.stored / dumps / 1024:>9.0f}" if row.objects else ""
        )
        print(
            f"{row.name:<40} {row.seconds:>7.2f} {logical / MiB / row.seconds:>7.0f} {stored}"
            f" {logical / row.stored:>7.1f} {cp.seconds / row.seconds:>9.2f}"
            f" {zarr.seconds / row.seconds:>11.2f} {row.stored / zarr.stored:>10.3f}{per_dump}"
        )

    cli = by_name["gradpipe ingest (CLI)"]
    api = by_name["gradpipe ingest (API, threads)"]
    again = by_name["gradpipe re-ingest (CLI)"]
    api_again = by_name["gradpipe re-ingest (API)"]
    zipnn = by_name["zipnn (numpy, float32)"]

    def verdict(ok: bool) -> str:
        return "PASS" if ok else "FAIL"

    print(f"\ntargets on {kind} data (gradpipe = the CLI, the whole command; the API beside it):")
    print(
        f"  {verdict(cli.note_ratio >= 0.5)}  ingest >= 0.5x the speed of cp -r (goal 1x), median "
        f"of paired runs: {cli.note_ratio:.2f}x ({cli.seconds:.2f} s vs {cp.seconds:.2f} s; "
        f"API {api.seconds:.2f} s)"
    )
    print(
        f"  {verdict(zarr.seconds / cli.seconds >= 2)}  >= 2x zarr v3 throughput: "
        f"{zarr.seconds / cli.seconds:.2f}x (API {zarr.seconds / api.seconds:.2f}x)"
    )
    print(
        f"  {verdict(cli.stored <= zipnn.stored)}  stored <= zipnn's: "
        f"{cli.stored / MiB:.2f} MiB vs {zipnn.stored / MiB:.2f} MiB"
    )
    print(
        f"  {verdict(zarr.stored >= 1.1 * cli.stored)}  stored >= 1.1x smaller than zarr v3's: "
        f"{zarr.stored / cli.stored:.2f}x smaller"
    )
    print(
        f"  {verdict(again.seconds <= 0.25 * cli.seconds)}  re-ingest <= 25% of first ingest: "
        f"{100 * again.seconds / cli.seconds:.0f}% "
        f"(API {100 * api_again.seconds / api.seconds:.0f}%)"
    )
    cluster = next((r for r in rows if "LocalCluster" in r.name), None)
    if cluster is not None:
        print(
            f"  info  default threads vs {cluster.name.split('(API, ')[1][:-1]}: "
            f"{api.seconds:.2f} s vs {cluster.seconds:.2f} s "
            f"(threads {cluster.seconds / api.seconds:.2f}x as fast)"
        )


if __name__ == "__main__":
    main()
