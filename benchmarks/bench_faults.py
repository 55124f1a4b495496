"""Nightly jobs against a flaky S3 endpoint: faults injected, data lost, the cost of the retries.

Every night new dumps and training states arrive on S3 (``--steps-per-night``
steps of a transformer-shaped run, below), and the nightly job runs: ingest
the new dumps into a store on S3, FedAvg them, snapshot the training state of
every new step, prune the snapshots to the newest 2, gc (grace 0, so the pruned
versions' blocks are deleted), verify. It runs twice per night, on the same
files against the same S3 server (moto on loopback, in a child process):

- *without faults*, into one store: the anchor;
- *with faults*, into another, through :class:`gradpipe.testing.faultproxy.FaultProxy`,
  which injects, at seeded random, ``--rate`` of the requests each (default 2%)
  of 500 InternalError (after the request landed), 502, 503 SlowDown, slow
  replies (50-250 ms), connection resets, truncated bodies (GET and LIST) and
  dropped replies to requests that landed (conditional PUTs of blocks and refs
  included): about 14% of all requests.

Two drivers, each a table row: the Python API (``gradpipe.testing.nightly.run_nightly``)
and ``gradpipe run WORKFLOW.yaml`` (``gp.run_workflow`` in this process, the
same code as the command, with ``retries: 0`` so that no stage is retried:
what survives is the S3 client's retries and gradpipe's idempotent commits).
Requests get 8 attempts (``gradpipe.storage.retries.max-attempts``; the
default, 5, suits endpoints that fail far less often than this one).

Every night's own ``verify`` stage must pass; after the last night (after
every one with ``--check-every-night``), with the faults off, both stores are
checked (``gradpipe.testing.nightly.check_nightly``): ``verify`` clean; each (step,
peer) recorded exactly once and exported byte for byte as its source file;
one FedAvg aggregate per step, not stale, exported bit-exact against the
fault-free store's; the snapshot chain holding exactly the newest 2 steps,
each restored bit-exact against its state file; no ref history with a
commit made twice. A problem is printed and counted as lost or corrupt data.

Columns: nights, requests the proxy saw, faults injected by kind (and those
on conditional PUTs), problems found by the checks, wall seconds of all
nights without and with faults and their ratio (the overhead of the retries:
botocore's standard mode backs off exponentially with jitter).

Run: ``python benchmarks/bench_faults.py`` (``--nights N``, default 7;
``--steps-per-night K``, default 2; ``--rate R``, default 0.02; ``--seed S``;
``--mib M``, MiB of dumps in all, default 14; ``--skip-workflow``;
``--check-every-night``); about twenty minutes on two shared cores (the job
verifies the whole store every night, so later nights take longer).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dask.config

BUCKET = "bench"
KINDS = ("500", "502", "503", "slow", "reset", "truncate", "drop")
WORKFLOW = """\
version: 1
name: nightly-{tag}
store:
  url: s3://{bucket}/{tag}/store
  create: true
  storage_options: &s3
    endpoint_url: "${{BENCH_ENDPOINT}}"
    key: testing
    secret: testing
    client_kwargs: {{region_name: us-east-1}}
retries: 0
stages:
  - ingest:
      pattern: "s3://{bucket}/src/dumps/step={{step}}/peer={{peer}}.safetensors"
      run: nightly
      storage_options: *s3
  - aggregate: {{run: nightly, method: fedavg, name: fedavg}}
  - snapshot: {{name: model, pattern: "{states}/step={{step}}.safetensors"}}
  - prune: {{snapshot: model, keep_last: 2}}
  - gc: {{grace: 0s}}
  - verify: {{}}
"""


@dataclass
class Driver:
    """One way of running the nightly job, and what it met."""

    name: str
    seconds: dict[str, float] = field(default_factory=lambda: {"clean": 0.0, "faults": 0.0})
    requests: int = 0
    faults: Counter[str] = field(default_factory=Counter)
    conditional: int = 0  # faults on conditional PUTs
    problems: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    checked: Counter[str] = field(default_factory=Counter)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nights", type=int, default=7)
    parser.add_argument("--steps-per-night", type=int, default=2)
    parser.add_argument("--rate", type=float, default=0.02, help="per fault kind")
    parser.add_argument("--seed", type=int, default=12)
    parser.add_argument("--mib", type=float, default=14, help="MiB of gradient dumps in all")
    parser.add_argument("--skip-workflow", action="store_true")
    parser.add_argument(
        "--check-every-night", action="store_true", help="not only after the last night"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gradpipe-bench-faults-") as tmp:
        run(args, Path(tmp))


def run(args: argparse.Namespace, tmp: Path) -> None:
    import fsspec

    from gradpipe.testing import TransformerConfig, write_transformer_run
    from gradpipe.testing.faultproxy import FaultProxy
    from gradpipe.testing.s3server import S3Server

    steps = args.nights * args.steps_per_night
    config = TransformerConfig.for_dump_size(args.mib, steps=steps)
    start = time.perf_counter()
    sample = write_transformer_run(tmp / "sample", config)
    dump_bytes = sum(
        Path(sample.dump_path(s, p)).stat().st_size for s in sample.steps for p in sample.peers
    )
    print(
        f"data: write_transformer_run(TransformerConfig.for_dump_size({args.mib:g}, "
        f"steps={steps})): {len(sample.peers)} peers x {steps} steps, "
        f"{dump_bytes / 2**20:.1f} MiB of float32 safetensors dumps "
        f"({dump_bytes / 2**20 / (steps * len(sample.peers)):.2f} MiB each: vocab "
        f"{config.vocab_size}, hidden {config.hidden}, {config.layers} layers), "
        f"training states (params + AdamW moments) per step; generated in "
        f"{time.perf_counter() - start:.0f} s"
    )
    rates = dict.fromkeys(KINDS, args.rate)
    drivers = [Driver("Python API (run_nightly)")]
    if not args.skip_workflow:
        drivers.append(Driver("gradpipe run WORKFLOW.yaml"))
    with (
        S3Server(process=True) as server,
        FaultProxy(server.endpoint_url, seed=args.seed, rates=rates) as proxy,
    ):
        server.make_bucket(BUCKET)
        fs = fsspec.filesystem("s3", skip_instance_cache=True, **server.storage_options)
        states = tmp / "states"  # `gradpipe run`'s snapshot stage reads local state files
        states.mkdir()
        for night in range(args.nights):
            new = sample.steps[night * args.steps_per_night : (night + 1) * args.steps_per_night]
            upload(fs, sample, new, states)
            done = sample.steps[: (night + 1) * args.steps_per_night]
            last = night == args.nights - 1
            for driver in drivers:
                night_of(driver, server, proxy, sample, done, tmp, states)
                if args.check_every_night or last:
                    check(driver, server, proxy, sample, done)
            print(
                f"night {night + 1}/{args.nights}: "
                + "; ".join(
                    f"{d.name}: {sum(d.faults.values())} faults, {len(d.problems)} problems, "
                    f"{d.seconds['clean']:.0f} s clean / {d.seconds['faults']:.0f} s faults"
                    for d in drivers
                ),
                flush=True,
            )
    report(args, drivers)


def upload(fs: Any, sample: Any, steps: list[int], states: Path) -> None:
    """The training job writes the night's dumps and states (no faults: not ours)."""
    for step in steps:
        for peer in sample.peers:
            fs.put(
                sample.dump_path(step, peer),
                f"{BUCKET}/src/dumps/step={step:04d}/peer={peer}.safetensors",
            )
        fs.put(sample.state_path(step), f"{BUCKET}/src/state/step={step:04d}.safetensors")
        shutil.copy(sample.state_path(step), states / f"step={step:04d}.safetensors")
    fs.invalidate_cache()


def night_of(
    driver: Driver,
    server: Any,
    proxy: Any,
    sample: Any,
    done: list[int],
    tmp: Path,
    states: Path,
) -> None:
    """One night of ``driver``: without faults, then with them."""
    workflow = driver.name.startswith("gradpipe run")
    for tag, options in (("clean", server.storage_options), ("faults", proxy.storage_options)):
        prefix = f"{'wf' if workflow else 'api'}-{tag}"
        before = proxy.injected[:]
        requests = sum(proxy.requests.values())
        start = time.perf_counter()
        with proxy.paused() if tag == "clean" else contextlib.nullcontext():
            ok, what = (
                _workflow(prefix, options, tmp, states) if workflow else _api(_job(prefix, options))
            )
        driver.seconds[tag] += time.perf_counter() - start
        if tag == "faults":
            new = proxy.injected[len(before) :]
            driver.faults.update(f.kind for f in new)
            driver.conditional += sum(1 for f in new if f.operation == "CPUT")
            driver.requests += sum(proxy.requests.values()) - requests
        if not ok:  # a stage failed (its own verify included) or raised
            driver.failures.append(f"{tag} night over steps {done}: {what}")


def _job(prefix: str, options: dict[str, Any]) -> Any:
    from gradpipe.testing.nightly import Nightly

    return Nightly(
        store=f"s3://{BUCKET}/{prefix}/store",
        dumps=f"s3://{BUCKET}/src/dumps/step={{step}}/peer={{peer}}.safetensors",
        states=f"s3://{BUCKET}/src/state/step={{step}}.safetensors",
        storage_options=options,
    )


def check(driver: Driver, server: Any, proxy: Any, sample: Any, done: list[int]) -> None:
    """Both stores of ``driver``, read past the proxy: what was lost, doubled or damaged."""
    import gradpipe as gp
    from gradpipe.testing.nightly import check_nightly

    prefix = "wf" if driver.name.startswith("gradpipe run") else "api"
    with proxy.paused():
        clean_job = _job(f"{prefix}-clean", server.storage_options)
        faulty_job = _job(f"{prefix}-faults", server.storage_options)
        clean = gp.open_store(clean_job.store, storage_options=server.storage_options)
        faulty = gp.open_store(faulty_job.store, storage_options=server.storage_options)
        for tag, job, store, reference in (
            ("clean", clean_job, clean, None),
            ("faults", faulty_job, faulty, clean),
        ):
            problems = check_nightly(store, job, sample, steps=done, reference=reference)
            driver.problems += [f"{tag}, steps {done}: {p}" for p in problems]
        run = gp.open_run(faulty, "nightly")
        driver.checked.update(dumps=len(run), aggregates=len(run.aggregates), snapshots=2, checks=1)


def _api(job: Any) -> tuple[bool, str]:
    from gradpipe.testing.nightly import run_nightly

    try:
        report = run_nightly(job)
    except Exception as exc:  # a figure: the night failed, and how
        return False, f"{type(exc).__name__}: {exc}"
    bad = [k for k, v in report.stages.items() if not v.get("ok", True)]
    return report.ok, f"stages not ok: {bad}"


def _workflow(prefix: str, options: dict[str, Any], tmp: Path, states: Path) -> tuple[bool, str]:
    import gradpipe as gp

    path = tmp / f"{prefix}.yaml"
    path.write_text(WORKFLOW.format(tag=prefix, bucket=BUCKET, states=states), encoding="utf-8")
    env = {**os.environ, "BENCH_ENDPOINT": options["endpoint_url"]}
    report = gp.run_workflow(path, env=env)
    return report.ok, report.summary()


def report(args: argparse.Namespace, drivers: list[Driver]) -> None:
    print()
    print(
        f"Faults: {args.nights} nights of the nightly job (ingest, fedavg, snapshot, prune, "
        f"gc, verify) per driver, {args.rate:.1%} of requests per fault kind, seed {args.seed}"
    )
    head = ["driver", "requests", "faults", *KINDS, "on CPUT", "lost/corrupt", "failed nights"]
    head += ["s clean", "s faults", "overhead"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for d in drivers:
        clean, faults = d.seconds["clean"], d.seconds["faults"]
        row = [d.name, str(d.requests), str(sum(d.faults.values()))]
        row += [str(d.faults[k]) for k in KINDS]
        row += [str(d.conditional), str(len(d.problems)), str(len(d.failures))]
        row += [f"{clean:.1f}", f"{faults:.1f}", f"{faults / clean:.2f}x"]
        print("| " + " | ".join(row) + " |")
    total = sum(sum(d.faults.values()) for d in drivers)
    print()
    for d in drivers:
        c = d.checked
        print(
            f"{d.name}: {c['checks']} check(s) of both stores: verify, "
            f"{c['dumps']} dump exports byte for byte against their files, {c['aggregates']} "
            f"aggregate exports bit-exact against the fault-free store's, {c['snapshots']} "
            f"snapshot restores bit-exact, each present exactly once: "
            f"{len(d.problems)} problems"
        )
        for problem in d.problems[:20]:
            print(f"  PROBLEM {problem}")
        for failure in d.failures[:10]:
            print(f"  FAILED {failure}")
    lost = sum(len(d.problems) for d in drivers)
    failed = sum(len(d.failures) for d in drivers)
    verdict = "PASS" if total >= 1000 and lost == 0 and failed == 0 else "FAIL"
    print(
        f"{verdict}: {total} faults injected (target >= 1000), {lost} lost or corrupt "
        f"(target 0), {failed} failed nights"
    )


if __name__ == "__main__":
    # 8 attempts per S3 request (the default is 5): what an endpoint this flaky calls for.
    with dask.config.set(
        {"gradpipe.lock.poll": "0.1s", "gradpipe.storage.retries.max-attempts": 8}
    ):
        main()
