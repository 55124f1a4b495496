"""Store throughput: ``put_tensor`` / ``get_tensor`` beside raw fsspec on the same bytes.

Prints one table: MiB/s (of logical, uncompressed tensor bytes) for gradpipe's
``Store.put_tensor`` and ``Store.get_tensor`` and for the anchors they compete
with, raw fsspec writes and reads of the same uncompressed bytes:

- ``raw 4MiB``: ``fs.pipe`` / ``fs.cat`` of one object per 4 MiB chunk (the
  store's chunking; a dict/list call, so s3fs runs the requests concurrently),
- ``raw 1obj``: ``fs.pipe`` / ``fs.cat`` of one object per tensor,

on local disk (a temporary directory under /tmp, fsspec ``LocalFileSystem``) and
on S3 (moto's server on loopback, started here with ``gradpipe.testing.S3Server``;
one s3fs filesystem shared by gradpipe and the anchors), all in the same run.
"gp/4MiB" and "gp/1obj" are gradpipe's MiB/s over the anchor's: above 1 gradpipe
is faster. "stored" and "ratio" are what gradpipe's store holds (blocks and
manifests) and logical/stored; the raw anchors store the bytes as they are.

Data (``--data``, default ``transformer``), each set about ``--mib`` MiB:

- ``transformer``: one peer's gradient dump of a BERT-small / MiniLM-L6-shaped
  encoder's fine-tuning step (``gradpipe.testing.train_transformer``; by default
  the real model: 105 float32 tensors, 87 MiB, half of them small vectors, the
  embedding gradient ~0.3% non-zero rows) and the model's parameters after
  that AdamW step: what users store,
- ``sparse``: one peer's gradients of ``gradpipe.testing.sample_gradients`` (a
  toy model whose huge sparse embedding gradient compresses hundreds of times)
  and dense float32 parameters drawn from N(0, 0.02),
- ``dense``: the toy model with a big dense layer instead, and N(0, 0.02),
- ``all``: all of them.

Operations, each the best of ``--repeat`` runs unless it says "first":

- ``put first`` / ``put best``: into a fresh, empty store or prefix every run;
  "first" is the first run (after a small warm-up of every code path),
- ``put fsync`` (local): the same with ``gradpipe.storage.fsync`` on, and the raw
  files fsynced after writing: what a durable write costs on this disk,
- ``re-put``: every tensor again into the store that holds it (gradpipe only
  checks that its blocks exist and writes a manifest; "stored" is what it wrote
  new); the raw anchors have no dedup and overwrite their objects,
- ``get warm`` (local: from the page cache, just written) and ``get cold``
  (local: files evicted from the page cache with ``posix_fadvise(DONTNEED)``
  before each run, so they come from the disk); on S3 ``get`` (moto keeps
  objects in memory or its own temporary files). ``get_tensor`` checks every
  block against its hash; ``fs.cat`` checks nothing.

Local ``put`` without fsync measures writing into the page cache, not the disk:
neither gradpipe nor fsspec waits for writeback.

Run: ``python benchmarks/bench_store.py`` (``--data KIND``, ``--repeat N``, ``--mib M``,
``--skip-s3``).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dask.config
import fsspec
import numpy as np

from gradpipe import open_store
from gradpipe.storage.marker import MARKER_KEY
from gradpipe.storage.store import Store

CHUNK_BYTES = 4 << 20
EMBED_DIM = 64
HIDDEN = 1024
BUCKET = "bench"

Tensors = dict[str, np.ndarray]


# --- data ---------------------------------------------------------------------
def transformer(mib: float | None) -> list[tuple[str, Tensors, str]]:
    """One peer's gradient dump of a BERT-small fine-tuning step, and the parameters after it."""
    from gradpipe.testing import TransformerConfig, train_transformer

    if mib is None:
        config = TransformerConfig(steps=1, peers=1)  # one dump of the real model: 87 MiB
        how = "TransformerConfig(steps=1, peers=1)"
    else:
        config = TransformerConfig.for_dump_size(mib, steps=1, peers=1)
        how = f"TransformerConfig.for_dump_size({mib:g}, steps=1, peers=1)"
    (result,) = train_transformer(config)
    grads = result.gradients["peer0"]
    emb = grads["embeddings.word_embeddings.weight"]
    rows = np.count_nonzero(np.any(emb != 0, axis=1))
    model = (
        f"vocab {config.vocab_size}, hidden {config.hidden}, {config.layers} layers, "
        f"{len(grads)} float32 tensors"
    )
    return [
        (
            "transformer gradients",
            grads,
            f"transformer gradients: train_transformer({how}): one peer's dump, {model}, "
            f"embedding rows touched {rows}/{emb.shape[0]}",
        ),
        (
            "transformer params",
            result.params,
            f"transformer params: the float32 master weights after that step, {model}",
        ),
    ]


def sparse(mib: float | None) -> list[tuple[str, Tensors, str]]:
    """One peer's gradients of the toy run (embedding sized to ``mib``), and N(0, 0.02)."""
    from gradpipe.testing import TrainingConfig, sample_gradients

    mib = 64 if mib is None else mib
    dense = EMBED_DIM * HIDDEN + HIDDEN + HIDDEN * HIDDEN + HIDDEN + HIDDEN * 10 + 10
    vocab = max(1000, int(mib * 2**20 / 4 - dense) // EMBED_DIM)
    config = TrainingConfig(vocab_size=vocab, embed_dim=EMBED_DIM, hidden=HIDDEN)
    grads = sample_gradients(config)
    emb = grads["embedding.weight"]
    rows = np.count_nonzero(np.any(emb != 0, axis=1))
    desc = (
        f"sparse gradients: sample_gradients(TrainingConfig(vocab_size={vocab}, "
        f"embed_dim={EMBED_DIM}, hidden={HIDDEN})), {len(grads)} float32 tensors, "
        f"embedding rows touched {rows}/{emb.shape[0]}"
    )
    return [("sparse gradients", grads, desc), random_params("sparse", mib)]


def dense(mib: float | None) -> list[tuple[str, Tensors, str]]:
    """One peer's gradients of the toy model with big dense layers, and N(0, 0.02)."""
    from gradpipe.testing import TrainingConfig, sample_gradients

    mib = 64 if mib is None else mib
    hidden = max(64, int(math.sqrt(mib * 2**20 / 4)))  # dense2 (hidden x hidden) carries it
    config = TrainingConfig(vocab_size=2000, embed_dim=64, hidden=hidden)
    grads = sample_gradients(config)
    desc = (
        f"dense gradients: sample_gradients(TrainingConfig(vocab_size=2000, embed_dim=64, "
        f"hidden={hidden})), {len(grads)} float32 tensors"
    )
    return [("dense gradients", grads, desc), random_params("dense", mib)]


def random_params(kind: str, mib: float) -> tuple[str, Tensors, str]:
    """Dense float32 parameters, N(0, 0.02), one tensor of ``mib`` MiB."""
    rows = max(1, int(mib * 2**20 / 4) // 1024)
    rng = np.random.default_rng(0)
    params = rng.normal(0, 0.02, (rows, 1024)).astype(np.float32)
    return (
        f"{kind} params",
        {"weight": params},
        f"{kind} params: float32 N(0, 0.02), {params.shape}",
    )


DATA = {"transformer": transformer, "sparse": sparse, "dense": dense}


def logical_bytes(tensors: Tensors) -> int:
    return sum(t.nbytes for t in tensors.values())


def raw_objects(tensors: Tensors, per_chunk: bool) -> dict[str, bytes]:
    """Relative object name → the uncompressed bytes (built once, outside the timing)."""
    out = {}
    for name, tensor in tensors.items():
        data = np.ascontiguousarray(tensor).reshape(-1).view(np.uint8)
        if not per_chunk:
            out[name] = data.tobytes()
            continue
        for i, start in enumerate(range(0, max(data.size, 1), CHUNK_BYTES)):
            out[f"{name}/{i:05d}"] = data[start : start + CHUNK_BYTES].tobytes()
    return out


# --- where the bytes go -------------------------------------------------------
@dataclass
class Target:
    """A place to write: a store URL maker and a raw fsspec filesystem and root."""

    name: str
    fs: Any
    root: str  # fsspec path under which every run gets its own folder
    storage_options: dict[str, Any] = field(default_factory=dict)
    local: bool = False

    def fresh(self) -> str:
        return f"{self.root}/{uuid.uuid4().hex[:12]}"

    def store_url(self, path: str) -> str:
        return path if self.local else f"s3://{path}"

    def open(self, path: str) -> Store:
        return open_store(self.store_url(path), mode="w", storage_options=self.storage_options)

    def remove(self, path: str) -> None:
        if self.local:
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(path, recursive=True)
            self.fs.invalidate_cache()

    def evict(self, path: str) -> None:
        """Drop the files under ``path`` from the page cache (local only)."""
        if not self.local:
            return
        for file in Path(path).rglob("*"):
            if file.is_file():
                fd = os.open(file, os.O_RDONLY)
                try:
                    os.fsync(fd)  # dirty pages cannot be dropped
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def fsync_files(paths: list[str]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def targets(skip_s3: bool) -> Iterator[list[Target]]:
    with tempfile.TemporaryDirectory(prefix="gradpipe-bench-", dir="/tmp") as tmp:
        local = Target("local", fsspec.filesystem("file"), tmp, local=True)
        if skip_s3:
            yield [local]
            return
        from gradpipe.testing.s3server import S3Server

        with S3Server() as server:
            server.make_bucket(BUCKET)
            fs = fsspec.filesystem("s3", **server.storage_options)
            s3 = Target("s3", fs, BUCKET, storage_options=server.storage_options)
            yield [local, s3]


# --- the three methods --------------------------------------------------------
class GradpipeMethod:
    """put_tensor / get_tensor of every tensor into one store."""

    def __init__(self, target: Target, tensors: Tensors) -> None:
        self.target, self.tensors = target, tensors
        self.path = ""
        self.store: Store | None = None
        self.ids: dict[str, str] = {}

    def prepare(self) -> None:
        """A fresh, empty store (not timed)."""
        self.path = self.target.fresh()
        self.store = self.target.open(self.path)

    def put(self) -> None:
        assert self.store is not None
        self.ids = {name: self.store.put_tensor(t) for name, t in self.tensors.items()}

    def get(self) -> None:
        assert self.store is not None
        for tensor_id in self.ids.values():
            self.store.get_tensor(tensor_id)

    def check(self) -> None:
        assert self.store is not None
        for name, tensor_id in self.ids.items():
            got = self.store.get_tensor(tensor_id)
            if got.tobytes() != self.tensors[name].tobytes():
                raise AssertionError(f"gradpipe round trip of {name} is not bit-exact")

    def stored_bytes(self) -> int:
        assert self.store is not None
        return sum(k.size for k in self.store.backend.list("") if k.key != MARKER_KEY)

    def new_bytes(self) -> int:
        assert self.store is not None
        return self.store.write_stats.stored_bytes

    def files(self) -> list[str]:
        return [str(p) for p in Path(self.path).rglob("*") if p.is_file()]


class RawMethod:
    """fs.pipe / fs.cat of the uncompressed bytes, per chunk or per tensor."""

    def __init__(self, target: Target, tensors: Tensors, per_chunk: bool) -> None:
        self.target = target
        self.objects = raw_objects(tensors, per_chunk)
        self.path = ""
        self.paths: dict[str, bytes] = {}

    def prepare(self) -> None:
        self.path = self.target.fresh()
        self.paths = {f"{self.path}/{name}": data for name, data in self.objects.items()}
        if self.target.local:  # the store makes its folders inside its put; these are few
            for parent in {p.rsplit("/", 1)[0] for p in self.paths}:
                Path(parent).mkdir(parents=True, exist_ok=True)

    def put(self) -> None:
        self.target.fs.pipe(self.paths)

    def get(self) -> None:
        paths = list(self.paths)
        if len(paths) == 1:
            self.target.fs.cat_file(paths[0])
        else:
            self.target.fs.cat(paths)

    def check(self) -> None:
        got = self.target.fs.cat(list(self.paths))
        if got != self.paths:
            raise AssertionError("raw round trip is not bit-exact")

    def files(self) -> list[str]:
        return list(self.paths)


Method = GradpipeMethod | RawMethod


# --- timing -------------------------------------------------------------------
def timed(func: Callable[[], object]) -> float:
    start = time.perf_counter()
    func()
    return time.perf_counter() - start


@dataclass
class Row:
    op: str
    seconds: list[float]  # gradpipe, raw 4MiB, raw 1obj
    stored: int | None = None


def measure_puts(
    target: Target, methods: list[Method], repeat: int, *, fsync: bool = False
) -> tuple[list[float], list[float], int]:
    """First and best put time of each method, each run into a fresh location.

    The locations of the last run are kept (for re-put and get); gradpipe's
    stored bytes are those of its last run.
    """
    first: list[float] = []
    best = [float("inf")] * len(methods)
    stored = 0
    for run in range(repeat):
        for i, method in enumerate(methods):
            if run:
                target.remove(method.path)
            # A local store reads the fsync setting when it opens.
            with dask.config.set({"gradpipe.storage.fsync": fsync}):
                method.prepare()
                seconds = timed(method.put)
            if isinstance(method, GradpipeMethod):
                stored = method.stored_bytes()
            elif fsync:
                seconds += timed(lambda m=method: fsync_files(m.files()))
            if run == 0:
                first.append(seconds)
            best[i] = min(best[i], seconds)
    return first, best, stored


def measure_best(
    methods: list[Method], op: str, repeat: int, before: Callable[[Method], None] | None = None
) -> list[float]:
    best = [float("inf")] * len(methods)
    for _ in range(repeat):
        for i, method in enumerate(methods):
            if before is not None:
                before(method)
            best[i] = min(best[i], timed(getattr(method, op)))
    return best


def bench(target: Target, tensors: Tensors, repeat: int) -> list[Row]:
    gp = GradpipeMethod(target, tensors)
    methods: list[Method] = [
        gp,
        RawMethod(target, tensors, True),
        RawMethod(target, tensors, False),
    ]
    rows = []
    first, best, stored = measure_puts(target, methods, repeat)
    rows += [Row("put first", first, stored), Row("put best", best, stored)]
    if target.local:
        _, best, stored = measure_puts(target, methods, repeat, fsync=True)
        rows.append(Row("put fsync", best, stored))
    for method in methods:
        method.check()

    written = gp.new_bytes()
    best = measure_best(methods, "put", repeat)
    rows.append(Row("re-put (dedup)", best, (gp.new_bytes() - written) // repeat))

    if target.local:
        rows.append(Row("get warm (cache)", measure_best(methods, "get", repeat), stored))
        evict = lambda m: target.evict(m.path)  # noqa: E731
        rows.append(Row("get cold (disk)", measure_best(methods, "get", repeat, evict), stored))
    else:
        rows.append(Row("get", measure_best(methods, "get", repeat), stored))
    for method in methods:
        target.remove(method.path)
    return rows


def warm_up(target: Target) -> None:
    """Run every code path once on small data so that "put first" is not import time."""
    rng = np.random.default_rng(1)
    small = {
        "dense": rng.normal(0, 0.02, 300_000).astype(np.float32),
        "sparse": np.where(rng.random(300_000) < 0.01, np.float32(1e-3), np.float32(0)),
    }
    bench(target, small, 1)


def fs_type(path: str) -> str:
    """The file system type of the mount holding ``path`` (from /proc/mounts)."""
    best, kind = "", "unknown file system"
    with contextlib.suppress(OSError):
        for line in Path("/proc/mounts").read_text().splitlines():
            _, mount, fstype, *_ = line.split()
            inside = path == mount or path.startswith(mount.rstrip("/") + "/")
            if inside and len(mount) >= len(best):
                best, kind = mount, fstype
    return kind


# --- table --------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="best of N runs (default 3)")
    parser.add_argument(
        "--mib",
        type=float,
        default=None,
        help="MiB per data set (default: one dump of the real model, 87 MiB, for transformer; "
        "64 for the others)",
    )
    parser.add_argument(
        "--data",
        choices=[*DATA, "all"],
        default="transformer",
        help="transformer: a BERT-small fine-tuning step, as users' dumps (default); sparse: "
        "the toy run's sparse embedding gradients; dense: its big dense layers; all: each",
    )
    parser.add_argument("--skip-s3", action="store_true", help="local disk only")
    args = parser.parse_args()
    repeat = max(1, args.repeat)

    kinds = list(DATA) if args.data == "all" else [args.data]
    sets = [s for kind in kinds for s in DATA[kind](args.mib)]
    print(f"=== store put/get, data: {', '.join(kinds)} ===")
    for _, _, desc in sets:
        print(f"data: {desc}")
    print(
        f"chunks of {CHUNK_BYTES >> 20} MiB; best of {repeat}; MiB/s of logical bytes; "
        "gp/4MiB, gp/1obj = gradpipe MiB/s over the raw fsspec anchor's"
    )
    print(
        f"local: {fs_type('/tmp')} under /tmp; 'put first/best' and 'get warm' run against "
        "the page cache (no fsync, no wait for the disk); 'put fsync' and 'get cold' reach it"
    )
    print("s3: moto server on loopback (one process, writes serialized), s3fs client\n")
    width = max(len(label) for label, _, _ in sets)
    header = (
        f"{'where':<6} {'data':<{width}} {'op':<17} {'MiB':>6} {'gp MiB/s':>9} {'raw 4MiB':>9}"
        f" {'raw 1obj':>9} {'gp/4MiB':>8} {'gp/1obj':>8} {'stored MiB':>10} {'ratio':>8}"
    )
    print(header)
    print("-" * len(header))
    start = time.perf_counter()
    with targets(args.skip_s3) as places:
        for target in places:
            warm_up(target)
            for label, tensors, _ in sets:
                mib = logical_bytes(tensors) / 2**20
                for row in bench(target, tensors, repeat):
                    gp, raw4, raw1 = (mib / s for s in row.seconds)
                    stored = "" if row.stored is None else f"{row.stored / 2**20:10.2f}"
                    ratio = (
                        f"{logical_bytes(tensors) / row.stored:8.1f}" if row.stored else f"{'-':>8}"
                    )
                    print(
                        f"{target.name:<6} {label:<{width}} {row.op:<17} {mib:>6.1f} {gp:>9.0f}"
                        f" {raw4:>9.0f} {raw1:>9.0f} {gp / raw4:>8.2f} {gp / raw1:>8.2f}"
                        f" {stored:>10} {ratio}"
                    )
                print()
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
