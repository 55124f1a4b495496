"""Worker warm-up: the task modules imported before a graph's first task (issue 19)."""

from __future__ import annotations

import json
import subprocess
import sys

from gradpipe.graph.warmup import TASK_MODULES


def _modules_after(code: str) -> list[str]:
    probe = (
        f"import json, sys\n{code}\n"
        f"print(json.dumps([m for m in {list(TASK_MODULES)!r} if m in sys.modules]))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return list(json.loads(done.stdout))


def test_warm_up_imports_every_task_module() -> None:
    assert _modules_after("from gradpipe.graph.warmup import warm_up; warm_up()") == list(
        TASK_MODULES
    )


def test_dask_preload_entry_point_warms_up() -> None:
    assert _modules_after("from gradpipe.graph.warmup import dask_setup; dask_setup(None)") == list(
        TASK_MODULES
    )


def test_import_gradpipe_stays_light() -> None:
    # The warm-up is for workers; a plain import (the CLI's start-up) imports no task module.
    assert _modules_after("import gradpipe") == []
