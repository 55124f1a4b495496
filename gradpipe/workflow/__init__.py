"""Workflow files: a batch of gradpipe operations on one store, run by ``gradpipe run``.

:mod:`~gradpipe.workflow.spec` checks a file (version 1) and makes its JSON
Schema; :mod:`~gradpipe.workflow.stages` says what each stage does;
:mod:`~gradpipe.workflow.run` runs the stages with retries and reports.
"""

from __future__ import annotations

from gradpipe.workflow._yaml import WorkflowError
from gradpipe.workflow.run import StageOutcome, WorkflowReport, run_workflow
from gradpipe.workflow.spec import STAGES, Workflow, json_schema, load_workflow

__all__ = [
    "STAGES",
    "StageOutcome",
    "Workflow",
    "WorkflowError",
    "WorkflowReport",
    "json_schema",
    "load_workflow",
    "run_workflow",
]
