"""The nightly workflow as a Prefect flow: each stage a Prefect task, on a Dask cluster.

    DASK_SCHEDULER_ADDRESS=tcp://dask-scheduler:8786 GRADPIPE_BUCKET=my-bucket \\
        python workflows/prefect_nightly.py

Needs ``prefect`` and ``prefect-dask``. The flow's tasks run on the cluster's
workers through ``DaskTaskRunner``; each runs one stage of ``nightly.yaml``
with :func:`gradpipe.run_workflow` (``only=[i]``), whose own graphs go to the
same scheduler. Stages run in the file's order, each after the previous one
succeeded; a stage whose inputs partly failed (exit 1) does not stop the next.
"""

from __future__ import annotations

import os
from pathlib import Path

from prefect import flow, task
from prefect_dask import DaskTaskRunner

import gradpipe as gp
from gradpipe.workflow import load_workflow

NIGHTLY = str(Path(__file__).with_name("nightly.yaml"))


class StageError(RuntimeError):
    """A stage that could not run (exit 2) or whose infrastructure failed (exit 3)."""


def stage(path: str, index: int, address: str | None) -> dict[str, object]:
    """Run stage ``index`` of the workflow at ``path``; its report as JSON."""
    report = gp.run_workflow(path, only=[index], scheduler=address)
    if report.exit_status >= 2:
        raise StageError(report.summary())
    return report.stages[index].to_dict()


# The task wraps a module-level function rather than decorating it, so that workers
# unpickle the function by reference (decorated, the module's name would be the Task).
run_stage = task(stage, name="gradpipe-stage", retries=1, retry_delay_seconds=60)


@flow(name="gradpipe-nightly")
def nightly(path: str = NIGHTLY, address: str | None = None) -> list[dict[str, object]]:
    """Every stage of the workflow at ``path``, in order."""
    address = address or os.environ.get("DASK_SCHEDULER_ADDRESS")
    results = []
    for stage in load_workflow(path).stages:
        results.append(run_stage.submit(path, stage.index, address).result())
    return results


def on_cluster(address: str) -> object:
    """The flow with its tasks on the Dask cluster at ``address``."""
    return nightly.with_options(task_runner=DaskTaskRunner(address=address))


if __name__ == "__main__":
    scheduler = os.environ["DASK_SCHEDULER_ADDRESS"]
    on_cluster(scheduler)(address=scheduler)  # type: ignore[operator]
