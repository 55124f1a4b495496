"""The nightly workflow as an Airflow DAG: one task that runs it on the Dask cluster.

Copy this file into Airflow's ``dags/`` folder on a machine where gradpipe is
installed and ``workflows/nightly.yaml`` is at ``GRADPIPE_WORKFLOW``. The task
opens a ``distributed.Client`` to ``DASK_SCHEDULER_ADDRESS`` and runs the
workflow there; exit status 1 (some inputs failed) is logged as a warning,
2 and 3 fail the task (Airflow's retries then apply).
"""

from __future__ import annotations

import logging
import os
from datetime import datetime, timedelta

from airflow import DAG
from airflow.exceptions import AirflowException
from airflow.operators.python import PythonOperator

WORKFLOW = os.environ.get("GRADPIPE_WORKFLOW", "/srv/gradpipe/workflows/nightly.yaml")


def run_nightly() -> dict[str, object]:
    from distributed import Client

    import gradpipe as gp

    with Client(os.environ["DASK_SCHEDULER_ADDRESS"]) as client:
        report = gp.run_workflow(WORKFLOW, client=client)
    if report.exit_status >= 2:
        raise AirflowException(report.summary())
    if report.exit_status == 1:
        logging.getLogger(__name__).warning("gradpipe nightly: %s", report.summary())
    return report.to_dict()


with DAG(
    dag_id="gradpipe_nightly",
    schedule="30 2 * * *",
    start_date=datetime(2026, 1, 1),
    catchup=False,
    max_active_runs=1,
    default_args={"retries": 2, "retry_delay": timedelta(minutes=10)},
    tags=["gradpipe"],
) as dag:
    PythonOperator(task_id="nightly", python_callable=run_nightly)
