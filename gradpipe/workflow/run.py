"""Running a workflow: its stages in order on one runner, retried on infrastructure errors.

Each stage ends in one of these states, and the workflow's exit status is the
worst of them:

============  =========================================================  ======
state         meaning                                                    exit
============  =========================================================  ======
``ok``        the operation did all it was asked                         0
``failed``    it ran, and some inputs failed (listed in its report);     1
              the next stages still run on what succeeded
``error``     it could not run as written (an unknown run, a bad          2
              value the file could not be checked for); the rest is
              not run
``broken``    infrastructure errors (storage, network, the cluster)      3
              outlived the stage's retries; the rest is not run
``not-run``   an earlier stage stopped the workflow
============  =========================================================  ======

A file that does not check out is exit 2 before anything runs. Retries wait
``backoff * 2**k`` seconds (k = 0, 1, ...), each wait at most an hour. Every
operation is idempotent (a dump already recorded is skipped, an aggregate
memoised, a snapshot step kept), so a retried stage, or a second run of the
same workflow, does no work twice.
Two runs of one workflow at once (a cron job overlapping the previous night's)
take turns: a run holds a mutex in the store (:mod:`gradpipe.storage.mutex`)
while its stages run, and the other waits up to ``wait`` (default 1h), then
finds the work done. Runs of different workflows are kept apart by the
store's compare-and-swap refs only.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from gradpipe.core.display import NAME_LIMIT, PATH_LIMIT, printable, printable_text
from gradpipe.core.html import ReportHtml
from gradpipe.errors import (
    GradpipeError,
    InvalidInputError,
    LockedError,
    NotFoundError,
    StorageError,
)
from gradpipe.workflow.spec import Stage, Workflow, load_workflow, missing_requirements
from gradpipe.workflow.stages import RUNNERS, StageContext

if TYPE_CHECKING:
    from distributed import Client

    from gradpipe.storage.store import Mode, Store

__all__ = ["EXIT_STATUS", "StageOutcome", "WorkflowReport", "retry_wait", "run_workflow"]

#: The longest wait before one retry, however many came before it.
MAX_RETRY_WAIT: Final = 3600.0

#: The exit status of each stage state (the workflow's is the largest).
EXIT_STATUS: Final = {"ok": 0, "planned": 0, "failed": 1, "error": 2, "broken": 3, "not-run": 0}


@dataclass
class StageOutcome:
    """What one stage did."""

    index: int
    kind: str
    params: dict[str, Any]  # as written in the file (secrets not substituted)
    state: str = "not-run"
    attempts: int = 0
    seconds: float = 0.0
    report: dict[str, Any] | None = None
    summary: str = ""
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "stage": self.index,
            "kind": self.kind,
            "params": self.params,
            "state": self.state,
            "attempts": self.attempts,
            "seconds": round(self.seconds, 3),
            "report": self.report,
            "error": self.error,
        }


@dataclass
class WorkflowReport(ReportHtml):
    """What a workflow run did, stage by stage, and the exit status a scheduler acts on."""

    path: str
    store: str  # as written in the file
    name: str | None = None
    dry_run: bool = False
    stages: list[StageOutcome] = field(default_factory=list)
    seconds: float = 0.0
    #: The store could not be reached (after the workflow's retries): nothing ran.
    error: str | None = None

    @property
    def exit_status(self) -> int:
        worst = max((EXIT_STATUS[s.state] for s in self.stages), default=0)
        return 3 if self.error is not None else worst

    @property
    def ok(self) -> bool:
        return self.exit_status == 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "exit_status": self.exit_status,
            "workflow": self.path,
            "name": self.name,
            "store": self.store,
            "dry_run": self.dry_run,
            "seconds": round(self.seconds, 3),
            "error": self.error,
            "stages": [s.to_dict() for s in self.stages],
        }

    def summary(self) -> str:
        shown = printable_text(self.name or self.path, limit=PATH_LIMIT)
        title = f"workflow {shown}"
        store = printable(self.store, limit=PATH_LIMIT)
        if self.dry_run:
            lines = [f"{title}: {len(self.stages)} stages on store {store} (dry run)"]
            lines += [f"  {s.index + 1}. {s.kind} {_shown(s.params)}" for s in self.stages]
            return "\n".join(lines)
        done = sum(1 for s in self.stages if s.state == "ok")
        if self.error is not None:
            return f"{title}: nothing ran (exit {self.exit_status}): {self.error}"
        lines = [
            f"{title}: {done} of {len(self.stages)} stages ok on store {store} "
            f"in {self.seconds:.1f} s (exit {self.exit_status})"
        ]
        for s in self.stages:
            retried = f", {s.attempts} attempts" if s.attempts > 1 else ""
            lines.append(f"  {s.index + 1}. {s.kind}: {s.state}{retried} ({s.seconds:.1f} s)")
            text = s.error or s.summary
            lines += [f"       {line}" for line in text.splitlines()]
        return "\n".join(lines)


def _shown(params: Mapping[str, Any]) -> str:
    # The keys are the stage's own fields; the values come from the workflow file. A list's
    # str() is its whole repr, aliases expanded: printable writes only what it shows.
    return ", ".join(f"{k}={_value(v)}" for k, v in params.items())


def _value(value: object) -> str:
    if isinstance(value, str):
        return printable_text(value, limit=NAME_LIMIT)
    return printable(value, limit=NAME_LIMIT)


def run_workflow(
    path: str | os.PathLike[str],
    *,
    scheduler: str | None = None,
    client: Client | None = None,
    processes: bool = False,
    dry_run: bool = False,
    only: Collection[int] | None = None,
    performance_report: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> WorkflowReport:
    """Run the workflow file at ``path``; its report (``exit_status`` for a scheduler).

    Parameters
    ----------
    path : str or path
        A workflow file (version 1, see :mod:`gradpipe.workflow.spec`).
    scheduler, client : optional
        Where the stages' graphs run: a Dask scheduler's address or a client
        (default: local threads). One runner serves every stage.
    processes : bool
        Without a scheduler or client, run the stages' graphs on single-threaded
        local processes instead of threads (:func:`gradpipe.runner`).
    dry_run : bool
        Check the file and the store, list the stages, run nothing.
    only : collection of int, optional
        Run only these stages (0-based, in file order); the others are
        reported ``not-run``. An orchestrator that runs each stage as a task
        of its own (``workflows/prefect_nightly.py``) uses this.
    performance_report : path, optional
        Write Dask's performance report of every stage to this HTML file (the
        stages then run on a ``distributed`` cluster: the scheduler's, else an
        in-process one).
    env : mapping, optional
        Where ``${VAR}`` comes from (default: the process environment).
    sleep : callable
        How to wait between retries (tests pass a fake clock).

    Raises
    ------
    InvalidInputError
        For a file that does not check out (with file, line and column) or a
        store that is not there (unless ``create: true``); nothing runs.
    """
    started = time.perf_counter()
    workflow = load_workflow(path, env=env)
    wanted = set(range(len(workflow.stages)) if only is None else only)
    unknown = sorted(wanted - set(range(len(workflow.stages))))
    if unknown:
        raise InvalidInputError(
            f"{printable_text(workflow.path, limit=PATH_LIMIT)}: no stage {unknown[0]} "
            f"(stages 0 to {len(workflow.stages) - 1})"
        )
    # What the stages about to run need and this machine lacks (a plot without matplotlib):
    # refused now, --dry-run included, before anything is written. Stages not run here
    # (``only``: a worker running one stage) need nothing here.
    missing = [m for s in workflow.stages if s.index in wanted for m in missing_requirements(s)]
    if missing:
        raise InvalidInputError("; ".join(missing))
    report = WorkflowReport(
        workflow.path,
        workflow.store_shown,
        workflow.name,
        dry_run,
        [StageOutcome(s.index, s.kind, s.shown) for s in workflow.stages],
    )
    try:
        store = _retrying(lambda: _open(workflow, dry_run=dry_run), workflow, sleep)
    except Exception as exc:
        if _classify(exc) != "broken":
            raise
        shown = printable(workflow.store_shown, limit=PATH_LIMIT)
        report.error = f"store {shown}: {_message(exc)}"
        report.seconds = time.perf_counter() - started
        return report
    if dry_run or store is None:
        for outcome in report.stages:
            outcome.state = "planned"
        return report
    from gradpipe.graph.runner import job_runner
    from gradpipe.storage.mutex import store_mutex

    title = workflow.name or workflow.path

    try:
        with (
            store_mutex(
                store, _mutex_name(workflow), f"workflow {title}", wait=workflow.wait
            ) as still_held,
            job_runner(
                report=performance_report, client=client, scheduler=scheduler, processes=processes
            ) as active,
        ):
            for stage, outcome in zip(workflow.stages, report.stages, strict=True):
                if stage.index not in wanted:
                    continue
                still_held()  # a lapsed mutex may have passed to another run: stop here
                _run_stage(stage, outcome, StageContext(store, active), sleep)
                if outcome.state in ("error", "broken"):
                    break
    except Exception as exc:  # the mutex (held elsewhere, lapsed) or the cluster, not a stage
        if _classify(exc) != "broken":
            raise
        report.error = _message(exc)
    report.seconds = time.perf_counter() - started
    return report


def retry_wait(backoff: float, attempt: int) -> float:
    """Seconds before retry ``attempt`` (0 for the first): doubling, at most an hour.

    >>> [retry_wait(5, k) for k in (0, 1, 2)], retry_wait(3600, 20)
    ([5.0, 10.0, 20.0], 3600.0)
    """
    return float(min(backoff * 2.0**attempt, MAX_RETRY_WAIT))


def _mutex_name(workflow: Workflow) -> str:
    """Runs of one workflow (by name, else by file) exclude each other on a store."""
    key = workflow.name or str(Path(workflow.path).resolve())
    return "workflow-" + hashlib.sha256(key.encode()).hexdigest()[:16]


def _open(workflow: Workflow, *, dry_run: bool) -> Store | None:
    """The workflow's store: must exist unless ``create: true`` (a dry run creates nothing)."""
    from gradpipe.storage.open import open_store

    mode: Mode = "a" if workflow.create and not dry_run else "r" if dry_run else "r+"
    try:
        return open_store(workflow.store_url, mode=mode, storage_options=workflow.storage_options)
    except NotFoundError as exc:
        if dry_run and workflow.create:
            return None  # the run would create it
        raise InvalidInputError(
            f"{printable_text(workflow.path, limit=PATH_LIMIT)}: store "
            f"{printable(workflow.store_shown, limit=PATH_LIMIT)}: {exc} "
            "(write `store: {url: ..., create: true}` to create it)"
        ) from None


def _retrying(
    func: Callable[[], Store | None], workflow: Workflow, sleep: Callable[[float], None]
) -> Store | None:
    """``func()``, retried like a stage on infrastructure errors."""
    for attempt in range(workflow.retries + 1):
        try:
            return func()
        except Exception as exc:
            if _classify(exc) != "broken" or attempt == workflow.retries:
                raise
            sleep(retry_wait(workflow.backoff, attempt))
    raise AssertionError("unreachable")  # pragma: no cover


def _run_stage(
    stage: Stage, outcome: StageOutcome, ctx: StageContext, sleep: Callable[[float], None]
) -> None:
    began = time.perf_counter()
    for attempt in range(stage.retries + 1):
        outcome.attempts = attempt + 1
        try:
            with _span(stage.kind):
                result = RUNNERS[stage.kind](ctx, dict(stage.params))
        except Exception as exc:
            kind = _classify(exc)
            outcome.error = f"{stage.where}: {stage.kind}: {_message(exc)}"
            if kind == "broken" and attempt < stage.retries:
                sleep(retry_wait(stage.backoff, attempt))
                continue
            outcome.state = kind
            break
        outcome.state = "ok" if result.ok else "failed"
        outcome.report = result.to_dict()
        outcome.summary = result.summary()
        outcome.error = None
        break
    outcome.seconds = time.perf_counter() - began


def _classify(exc: BaseException) -> str:
    """``broken`` for what a retry may cure (storage, network, cluster), else ``error``."""
    if isinstance(exc, StorageError | LockedError | ConnectionError | TimeoutError):
        return "broken"
    # The file as written (a bad value, an unknown run, an output folder that is not there).
    written = (InvalidInputError, NotFoundError, FileNotFoundError, NotADirectoryError)
    if isinstance(exc, (*written, IsADirectoryError)):
        return "error"
    # Integrity, conflicts that outlived their retries; a filesystem or a socket; the
    # cluster (KilledWorker, CommClosedError, ...): what a later attempt may not meet.
    infrastructure = isinstance(exc, GradpipeError | OSError)
    return "broken" if infrastructure or type(exc).__module__.startswith("distributed") else "error"


def _message(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if isinstance(exc, GradpipeError) and text else f"{type(exc).__name__}: {text}"


@contextlib.contextmanager
def _span(kind: str) -> Iterator[None]:
    """Group the stage's tasks on the dashboard when a distributed client runs them."""
    try:
        from distributed import span
    except ImportError:  # pragma: no cover - distributed is a dependency
        yield
        return
    with span(f"gradpipe-workflow-{kind}"):
        yield
