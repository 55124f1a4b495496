"""Ingest into S3 beside a plain ``s3fs`` upload of the same files, with requests per dump.

The dumps are ``gradpipe.testing.write_transformer_run`` with
``TransformerConfig.for_dump_size(--mib)`` (a MiniLM-L6-shaped encoder
fine-tuned by 2 peers; 87 MiB float32 safetensors dumps of 105 tensors, as
users' dumps are; see ``benchmarks/README.md``), under a temporary directory
in /tmp. The S3 server is moto's on loopback
(``gradpipe.testing.s3server.S3Server``), by default in a child process so
that its request handling does not share this interpreter's GIL with the
clients (``--in-process`` to share it). Rows, all on the same files against
the same server in the same run:

- ``s3fs put``: ``fs.put(dump_dir, "s3://bench/up<i>", recursive=True)`` in this
  process, s3fs's defaults: the anchor,
- ``gradpipe ingest local->S3 (CLI)``: the whole ``gradpipe ingest s3://bench/store<i>
  PATTERN --run r`` command (a subprocess: interpreter start, imports, the
  graph, the commit), the dumps on local disk; and ``(API)``: ``gradpipe.ingestion.api.ingest``
  in this process (threads),
- ``gradpipe ingest S3->S3 (CLI)`` and ``(API)``: the same from the dumps
  uploaded by the ``s3fs put`` row (``s3://bench/dumps/step={step}/...``),
- ``gradpipe re-ingest (CLI)``: the CLI again into the last store (every dump
  recorded: nothing is read or written but refs).

Columns: wall seconds (the median of ``--repeat`` runs, default 3, each into
a new prefix), MiB/s of logical tensor bytes, speed relative to ``s3fs put``
(above 1: faster), then per dump the requests the server answered by S3
operation (HEAD, GET, PUT, COPY, LIST, DELETE incl. bulk deletes, POST:
multipart) and the MiB of request bodies PUT, counted by the server's
counting layer (``S3Server.count_requests``) in the median run.

moto is not S3: it serialises conditional writes (see
``gradpipe.testing.s3server``), keeps objects in memory or temporary files
and answers on loopback in microseconds, so these figures say where the
client's time and requests go, not what a real bucket would give.

Run: ``python benchmarks/bench_s3.py`` (``--mib M``, default 500: six dumps;
``--repeat N``; ``--concurrency N`` sets ``gradpipe.storage.concurrency``;
``--sweep`` adds a table of the API ingest local->S3 over concurrency and
``ingest.task-bytes``; ``--in-process``); a few minutes on two cores.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dask.config
from bench_ingest import check_ingest, cli_ingest  # the same CLI run and checks

BUCKET = "bench"
MiB = 2**20
OPERATIONS = ("HEAD", "GET", "PUT", "COPY", "LIST", "DELETE", "POST")


@dataclass
class Row:
    name: str
    seconds: float
    requests: dict[str, int]
    bytes_put: int
    rerun: bool = False


@contextmanager
def aws_environment(environ: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in environ}
    os.environ.update(environ)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def measure(
    name: str, repeat: int, server: Any, once: Callable[[int], None], cleanup: Callable[[int], None]
) -> Row:
    """Median wall time of ``once(i)`` over ``repeat`` runs, with the median run's requests."""
    runs = []
    for i in range(repeat):
        with server.count_requests() as counts:
            start = time.perf_counter()
            once(i)
            seconds = time.perf_counter() - start
        runs.append((seconds, counts))
        cleanup(i)
    runs.sort(key=lambda r: r[0])
    _, counts = runs[(len(runs) - 1) // 2]  # the median run (the lower one of an even count)
    median = statistics.median(r[0] for r in runs)
    return Row(name, median, dict(counts.by_operation), counts.bytes_put)


def run(args: argparse.Namespace, tmp: Path) -> None:
    import fsspec

    import gradpipe as gp
    from gradpipe.ingestion.api import ingest
    from gradpipe.testing import TransformerConfig, write_transformer_run
    from gradpipe.testing.s3server import S3Server

    start = time.perf_counter()
    config = TransformerConfig.for_dump_size(args.mib)
    sample = write_transformer_run(tmp / "sample", config, states=False)
    source = Path(sample.directory) / "dumps"
    files = sorted(p for p in source.rglob("*") if p.is_file())
    n = len(files)
    logical = config.dump_bytes()  # of all dumps
    file_bytes = sum(f.stat().st_size for f in files)
    generated = time.perf_counter() - start
    pattern = sample.dump_pattern
    relative = os.path.relpath(pattern, source)
    repeat = max(1, args.repeat)
    settings: dict[str, Any] = {}
    env: dict[str, str] = {}
    if args.concurrency:
        settings["gradpipe.storage.concurrency"] = args.concurrency
        env["DASK_GRADPIPE__STORAGE__CONCURRENCY"] = str(args.concurrency)

    with S3Server(process=not args.in_process) as server, aws_environment(server.environ):
        server.make_bucket(BUCKET)
        env.update(server.environ)
        fs = fsspec.filesystem("s3", **server.storage_options)

        def remove(prefix: str) -> Callable[[int], None]:
            def cleanup(i: int) -> None:
                fs.rm(f"{BUCKET}/{prefix}{i}", recursive=True)  # moto keeps every object
                fs.invalidate_cache()

            return cleanup

        def keep(i: int) -> None:
            pass

        rows: list[Row] = []

        def upload(i: int) -> None:
            fs.put(str(source), f"{BUCKET}/up{i}", recursive=True)

        rows.append(measure("s3fs put", repeat, server, upload, remove("up")))
        fs.put(str(source), f"{BUCKET}/dumps", recursive=True)  # the source of S3->S3, untimed
        s3_pattern = f"s3://{BUCKET}/dumps/{relative}"

        stores = {"last": ""}

        def cli_from(where: str) -> Callable[[int], None]:
            def once(i: int) -> None:
                url = f"s3://{BUCKET}/store{i}"
                check_ingest(cli_ingest(url, where, env), n)
                stores["last"] = url

            return once

        def api_from(where: str) -> Callable[[int], None]:
            def once(i: int) -> None:
                with dask.config.set(settings):
                    store = gp.open_store(f"s3://{BUCKET}/store{i}", mode="w")
                    check_ingest(ingest(store, where, run="r").to_dict(), n)

            return once

        drop = remove("store")
        first = measure("gradpipe ingest local->S3 (CLI)", repeat, server, cli_from(pattern), keep)
        rows.append(first)

        def again(i: int) -> None:
            check_ingest(cli_ingest(stores["last"], pattern, env), n, again=True)

        rerun = measure("gradpipe re-ingest (CLI)", repeat, server, again, keep)
        rerun.rerun = True
        for i in range(repeat):
            drop(i)
        rows += [
            measure("gradpipe ingest local->S3 (API)", repeat, server, api_from(pattern), drop),
            measure("gradpipe ingest S3->S3 (CLI)", repeat, server, cli_from(s3_pattern), drop),
            measure("gradpipe ingest S3->S3 (API)", repeat, server, api_from(s3_pattern), drop),
            rerun,
        ]
        sources = {"local->S3": pattern, "S3->S3": s3_pattern}
        sweep = run_sweep(args, server, sources, n) if args.sweep else []

    print("=== ingest into S3 (moto on loopback) beside a plain s3fs upload ===")
    print(
        f"data: transformer: write_transformer_run(TransformerConfig.for_dump_size({args.mib:g})): "
        f"{len(sample.steps)} steps x {len(sample.peers)} peers = {n} safetensors dumps, "
        f"{logical / MiB:.0f} MiB of float32 tensors ({file_bytes / MiB:.0f} MiB of files); "
        f"generated in {generated:.0f} s"
    )
    where = "this process (shares the GIL)" if args.in_process else "a child process"
    print(
        f"server: moto's ThreadedMotoServer app in {where}, writes serialised; "
        f"gradpipe.storage.concurrency = {args.concurrency or 'default'}"
    )
    print(
        f"median of {repeat} runs per row, each into a new prefix; requests per dump by "
        "operation and MiB of request bodies PUT per dump, as the server counted them\n"
    )
    print_table(rows, logical, n)
    if sweep:
        print("\nAPI ingest by setting (median wall s and MiB/s; the rows above use the defaults):")
        names = list(sweep[0][1])
        heads = "".join(f" {name + ' s':>12} {'MiB/s':>7}" for name in names)
        header = f"{'storage.concurrency':>19} {'ingest.task-bytes':>17}{heads}"
        print(header)
        print("-" * len(header))
        for (concurrency, task_bytes), by_source in sweep:
            cells = "".join(
                f" {r.seconds:>12.2f} {logical / MiB / r.seconds:>7.0f}" for r in by_source.values()
            )
            print(f"{concurrency:>19} {task_bytes:>17}{cells}")


def run_sweep(
    args: argparse.Namespace, server: Any, patterns: dict[str, str], n: int
) -> list[tuple[tuple[int, str], dict[str, Row]]]:
    """The API ingest from each source over ``storage.concurrency`` and ``ingest.task-bytes``."""
    import gradpipe as gp
    from gradpipe.config import get_setting
    from gradpipe.ingestion.api import ingest

    fs = server_fs(server)
    default_concurrency = int(get_setting("storage.concurrency"))
    default_task = str(get_setting("ingest.task-bytes"))
    grid = [(c, default_task) for c in (4, 8, 16, 32, 64)]
    grid += [(default_concurrency, t) for t in ("16 MiB", "64 MiB", "128 MiB")]
    out = []
    for concurrency, task_bytes in grid:
        settings = {
            "gradpipe.storage.concurrency": concurrency,
            "gradpipe.ingest.task-bytes": task_bytes,
        }
        rows = {}
        for source, pattern in patterns.items():

            def once(i: int, pattern: str = pattern, settings: dict[str, Any] = settings) -> None:
                with dask.config.set(settings):
                    store = gp.open_store(f"s3://{BUCKET}/store{i}", mode="w")
                    check_ingest(ingest(store, pattern, run="r").to_dict(), n)

            def cleanup(i: int) -> None:
                fs.rm(f"{BUCKET}/store{i}", recursive=True)
                fs.invalidate_cache()

            rows[source] = measure(source, max(1, args.repeat), server, once, cleanup)
        out.append(((concurrency, task_bytes), rows))
    return out


def server_fs(server: Any) -> Any:
    import fsspec

    return fsspec.filesystem("s3", **server.storage_options)


def print_table(rows: list[Row], logical: int, n: int) -> None:
    anchor = rows[0]
    ops = "".join(f" {op:>6}" for op in OPERATIONS)
    header = f"{'method':<34} {'wall s':>7} {'MiB/s':>7} {'speed/s3fs':>10}{ops} {'MiB PUT':>8}"
    print(f"{'':<61}{'requests per dump':^{7 * len(OPERATIONS)}}")
    print(header)
    print("-" * len(header))
    for row in rows:
        per = "".join(f" {row.requests.get(op, 0) / n:>6.1f}" for op in OPERATIONS)
        put = f"{row.bytes_put / n / MiB:>8.1f}"
        if row.rerun:
            print(f"{row.name:<34} {row.seconds:>7.3f} {'-':>7} {'-':>10}{per} {put}")
            continue
        print(
            f"{row.name:<34} {row.seconds:>7.2f} {logical / MiB / row.seconds:>7.0f}"
            f" {anchor.seconds / row.seconds:>10.2f}{per} {put}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=500, help="MiB of dumps (default 500)")
    parser.add_argument("--repeat", type=int, default=3, help="median of N runs (default 3)")
    parser.add_argument("--concurrency", type=int, default=0, help="gradpipe.storage.concurrency")
    parser.add_argument("--sweep", action="store_true", help="also sweep concurrency x task-bytes")
    parser.add_argument(
        "--in-process", action="store_true", help="moto in this process (shares the GIL)"
    )
    args = parser.parse_args()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gradpipe-bench-s3-", dir="/tmp") as tmp:
        run(args, Path(tmp))
    print(f"\ntotal {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
