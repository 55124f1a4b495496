"""A nightly batch job through the Python API, and the checks that nothing was lost.

Fault tests and ``benchmarks/bench_faults.py`` run the job users schedule
every night (issue 12) against a flaky S3 endpoint, then check the store
with the faults off:

>>> job = Nightly(store="s3://bucket/archive", dumps="s3://bucket/dumps/step={step}/"
...               "peer={peer}.safetensors", states="s3://bucket/state/step={step}.safetensors")
>>> report = run_nightly(job)  # doctest: +SKIP
>>> problems = check_nightly(job, sample, reference=reference_store)  # doctest: +SKIP

The job: ingest every dump matching the pattern into a run; aggregate it with
FedAvg; snapshot the training state file of every recorded step newer than the
newest snapshot (``newer_only``, so a re-run or a racing copy writes each step
once); prune the snapshots to the newest ``keep_last``; collect garbage; verify.
Each stage is idempotent, so running the job again, or two copies at once,
adds only what is new. ``python -m gradpipe.testing.nightly JOB.json`` runs it
in a process of its own (what crash and race tests kill or start twice).
"""

from __future__ import annotations

import itertools
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

    from gradpipe.graph.runner import Runner
    from gradpipe.storage.store import Store
    from gradpipe.testing.training import RunFiles

__all__ = ["Nightly", "NightlyReport", "check_nightly", "run_nightly"]


@dataclass(frozen=True)
class Nightly:
    """One nightly job: the dumps and state files it reads, the store and what it keeps."""

    store: str
    dumps: str  # a pattern with {step} and {peer}
    states: str  # a pattern with {step}: the training state after each step (safetensors)
    storage_options: dict[str, Any] = field(default_factory=dict)
    run: str = "nightly"
    aggregate: str = "fedavg"
    snapshot: str = "model"
    keep_last: int = 2
    grace: float = 0.0  # gc: collect what the prune freed at once (safe: leases)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Nightly:
        return cls(**json.loads(text))


@dataclass
class NightlyReport:
    """What each stage did (its report's ``to_dict()``) and took (seconds)."""

    stages: dict[str, dict[str, Any]] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(stage.get("ok", True) for stage in self.stages.values())

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "stages": self.stages, "seconds": self.seconds}


def run_nightly(job: Nightly, *, runner: Runner | None = None) -> NightlyReport:
    """Run the job once; returns what each stage did."""
    import gradpipe as gp
    from gradpipe.formats.safetensors import read_safetensors

    report = NightlyReport()
    options = job.storage_options

    def stage(name: str, result: dict[str, Any], start: float) -> None:
        report.stages[name] = result
        report.seconds[name] = time.perf_counter() - start

    start = time.perf_counter()
    store = gp.open_store(job.store, mode="a", storage_options=options)
    ingested = gp.ingest(store, job.dumps, run=job.run, storage_options=options, runner=runner)
    stage("ingest", ingested.to_dict(), start)

    start = time.perf_counter()
    aggregated = gp.aggregate(
        store, run=job.run, method="fedavg", name=job.aggregate, runner=runner
    )
    stage("aggregate", aggregated.to_dict(), start)

    start = time.perf_counter()
    written = []
    for step in gp.open_run(store, job.run).steps:
        path = job.states.format(step=f"{step:04d}")
        tensors, meta = read_safetensors(path, storage_options=options)
        state = {"tensors": tensors, "metadata": meta}
        written.append(gp.snapshot(store, job.snapshot, state, step=step, newer_only=True))
    stage("snapshot", {"ok": True, "ids": written}, start)

    start = time.perf_counter()
    stage("prune", gp.prune(store, job.snapshot, keep_last=job.keep_last).to_dict(), start)
    start = time.perf_counter()
    stage("gc", gp.gc(store, grace=job.grace).to_dict(), start)
    start = time.perf_counter()
    stage("verify", gp.verify(store).to_dict(), start)
    return report


def check_nightly(
    store: Store,
    job: Nightly,
    sample: RunFiles,
    *,
    steps: list[int] | None = None,
    reference: Store | None = None,
) -> list[str]:
    """Everything wrong with ``store`` after the job ran over ``steps`` of ``sample``.

    Checks, with the store read as it is (run it with faults off): ``verify``
    is clean; the run holds each (step, peer) exactly once and each exports
    byte for byte as its source file; each step has exactly one aggregate named
    ``job.aggregate``, not stale, whose export is bit-exact against the one in
    ``reference`` (the same job run without faults); the snapshot chain holds
    exactly the newest ``keep_last`` steps, each restored bit-exact against
    its state file (as :func:`run_nightly` or ``gradpipe run``'s snapshot stage
    keeps it); no ref history repeats an entry (a commit made twice).
    An empty list means nothing was lost, doubled or damaged.
    """
    import gradpipe as gp
    from gradpipe.formats.safetensors import read_safetensors

    steps = sample.steps if steps is None else steps
    problems: list[str] = []
    checked = gp.verify(store)
    if not checked.ok:
        problems.append(f"verify: {checked.summary()}")
    run = gp.open_run(store, job.run)
    recorded = [(e.step, e.peer) for e in run]
    want = [(s, p) for s in steps for p in sample.peers]
    if sorted(recorded) != sorted(want) or len(set(recorded)) != len(recorded):
        problems.append(f"run {job.run!r} records {sorted(recorded)}, not {want} once each")
    with tempfile.TemporaryDirectory(prefix="gradpipe-check-") as tmp:
        out = Path(tmp) / "export.safetensors"
        for step, peer in sorted(set(recorded) & set(want)):
            gp.export_dump(store, job.run, step, peer, out)
            if out.read_bytes() != Path(sample.dump_path(step, peer)).read_bytes():
                problems.append(f"export of step {step}, peer {peer!r} differs from its file")
        problems += _check_aggregates(store, job, steps, reference, Path(tmp))
    problems += _check_snapshots(store, job, sample, steps, read_safetensors)
    for ref in (f"runs/{job.run}", f"snapshots/{job.snapshot}"):
        targets = [e.target for e in store.refs.history(ref)]
        doubled = [t for a, t in itertools.pairwise(targets) if a == t]
        if doubled:
            problems.append(f"ref {ref} recorded {doubled[0]} twice in a row (a doubled commit)")
    return problems


def _check_aggregates(
    store: Store, job: Nightly, steps: list[int], reference: Store | None, tmp: Path
) -> list[str]:
    import gradpipe as gp
    from gradpipe.formats.safetensors import read_safetensors

    problems = []
    run = gp.open_run(store, job.run)
    entries = [(a.step, a.name) for a in run.aggregates if a.name == job.aggregate]
    if sorted(entries) != [(s, job.aggregate) for s in steps]:
        problems.append(f"aggregates {sorted(entries)}: not one {job.aggregate!r} per step")
    for step in sorted({s for s, _ in entries}):
        found = gp.export_aggregate(store, job.run, step, job.aggregate, tmp / "a.safetensors")
        if found.stale is not None:
            problems.append(f"aggregate of step {step} is stale: {found.stale}")
        if reference is None:
            continue
        gp.export_aggregate(reference, job.run, step, job.aggregate, tmp / "b.safetensors")
        got, _ = read_safetensors(tmp / "a.safetensors")
        want, _ = read_safetensors(tmp / "b.safetensors")
        if not _same(got, want):
            problems.append(f"aggregate of step {step} differs from the fault-free one")
    return problems


def _check_snapshots(
    store: Store, job: Nightly, sample: RunFiles, steps: list[int], read: Any
) -> list[str]:
    import gradpipe as gp

    kept = [v.step for v in gp.snapshot_log(store, job.snapshot)]
    want = steps[-job.keep_last :]
    problems = [] if kept == want else [f"snapshots at steps {kept}, not {want} once each"]
    for step in sorted(set(kept) & set(want)):
        tensors, meta = read(sample.state_path(step))
        state = gp.restore(store, job.snapshot, step=step)
        if "tensors" not in state:  # written by `gradpipe run`'s snapshot stage: the file's tensors
            state = {"tensors": state, "metadata": meta}
        if state["metadata"] != meta or not _same(state["tensors"], tensors):
            problems.append(f"snapshot of step {step} differs from its state file")
    return problems


def _same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> bool:
    """Same names, dtypes, shapes and bytes."""
    return sorted(got) == sorted(want) and all(
        got[k].dtype == want[k].dtype
        and got[k].shape == want[k].shape
        and got[k].tobytes() == want[k].tobytes()
        for k in want
    )


def main(argv: list[str] | None = None) -> int:
    """Run the job described by the JSON file ``argv[0]``; print its report as JSON."""
    args = sys.argv[1:] if argv is None else argv
    job = Nightly.from_json(Path(args[0]).read_text(encoding="utf-8"))
    report = run_nightly(job)
    print(json.dumps(report.to_dict(), default=str))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
