"""``gradpipe run``: a workflow file's stages, in order, on one cluster."""

from __future__ import annotations

import argparse
import json

from gradpipe.cli._common import (
    CommandResult,
    Commands,
    add_report_argument,
    add_where_arguments,
    with_performance_report,
)

__all__ = ["register"]


def register(commands: Commands) -> None:
    """Add ``run``."""
    p = commands.add(
        "run",
        run_workflow_command,
        "run a workflow file: ingest, aggregate, snapshot, prune, gc, verify... in order",
        store=False,
    )
    p.epilog = (
        "Exit status: 0 every stage ok; 1 some input failed; 2 the workflow is not valid (or a "
        "stage could not run as written); 3 infrastructure errors outlived the retries."
    )
    p.add_argument("workflow", metavar="WORKFLOW.yaml", nargs="?", help="the workflow file")
    add_where_arguments(p)
    p.add_argument(
        "--dry-run", action="store_true", help="check the file and the store, list the stages"
    )
    add_report_argument(p)
    p.add_argument(
        "--schema",
        action="store_true",
        help="print the JSON Schema of workflow files (for editors) and exit",
    )


def run_workflow_command(args: argparse.Namespace) -> CommandResult:
    if args.schema:
        from gradpipe.workflow.spec import json_schema

        schema = json_schema()
        return CommandResult(schema, json.dumps(schema, indent=2))
    if args.workflow is None:
        from gradpipe.errors import InvalidInputError

        raise InvalidInputError("a workflow file is required: gradpipe run WORKFLOW.yaml")
    from gradpipe.workflow.run import run_workflow

    report = run_workflow(
        args.workflow,
        scheduler=args.scheduler,
        processes=args.processes,
        dry_run=args.dry_run,
        performance_report=args.report,
    )
    result = CommandResult(report.to_dict(), report.summary(), report.exit_status)
    if args.report is None or args.dry_run:
        return result
    return with_performance_report(result, args.report)
