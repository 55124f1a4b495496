"""Modules that moved into feature packages, importable by their old names for one release.

``import gradpipe.stats`` still works, warns (``DeprecationWarning``) and gives the module now at
:mod:`gradpipe.statistics.api`: the same object, so patching either name patches both. The old
names of the modules that shared their name with a public function (``gradpipe.ingest``,
``gradpipe.aggregate``, ``gradpipe.rounds``, ``gradpipe.snapshot``) are not kept: importing one
would hide the function ``gp.ingest`` behind a module.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from collections.abc import Sequence
from typing import Final

#: Old module name → where it lives now. Removed in the release after 0.x's next.
MOVED: Final[dict[str, str]] = {
    "gradpipe.aggregate_report": "gradpipe.aggregation.report",
    "gradpipe.aggregate_server": "gradpipe.aggregation.server_opt_method",
    "gradpipe.server": "gradpipe.aggregation.server_update",
    "gradpipe.snapshot_content": "gradpipe.snapshots.content",
    "gradpipe.snapshot_prune": "gradpipe.snapshots.prune",
    "gradpipe.stats": "gradpipe.statistics.api",
    "gradpipe.stats_plot": "gradpipe.statistics.plot",
    "gradpipe.evaluate": "gradpipe.evaluation.api",
    "gradpipe.evaluate_report": "gradpipe.evaluation.report",
    "gradpipe.core.aggregate": "gradpipe.aggregation.reduce",
    "gradpipe.core.aggregate_input": "gradpipe.aggregation.inputs",
    "gradpipe.core.aggregate_kernel": "gradpipe.aggregation.kernel",
    "gradpipe.core.robust": "gradpipe.aggregation.robust",
    "gradpipe.core.privacy": "gradpipe.aggregation.privacy",
    "gradpipe.core.server_opt": "gradpipe.aggregation.server_opt",
    "gradpipe.core.result_range": "gradpipe.aggregation.result_range",
    "gradpipe.core.exact": "gradpipe.aggregation.exact",
    "gradpipe.core.tensor_stats": "gradpipe.statistics.tensor_stats",
    "gradpipe.core.sampling": "gradpipe.evaluation.sampling",
    "gradpipe.core.fidelity": "gradpipe.evaluation.fidelity",
    "gradpipe.core.delta": "gradpipe.codecs.ops.delta",
    "gradpipe.core.lowrank": "gradpipe.codecs.ops.lowrank",
    "gradpipe.core.qsgd": "gradpipe.codecs.ops.qsgd",
    "gradpipe.core.sparsify": "gradpipe.codecs.ops.sparsify",
    "gradpipe.core.projection": "gradpipe.codecs.ops.projection",
    "gradpipe.core.rounding": "gradpipe.codecs.ops.half_precision",
    "gradpipe.core.view_names": "gradpipe.xarray.view_names",
    "gradpipe.graph.aggregate": "gradpipe.aggregation.graph",
    "gradpipe.graph.aggregate_plan": "gradpipe.aggregation.plan",
    "gradpipe.graph.aggregate_clip": "gradpipe.aggregation.clip",
    "gradpipe.graph.aggregate_tasks": "gradpipe.aggregation.tasks",
    "gradpipe.graph.robust": "gradpipe.aggregation.robust_graph",
    "gradpipe.graph.robust_tasks": "gradpipe.aggregation.robust_tasks",
    "gradpipe.graph.server": "gradpipe.aggregation.server_opt_graph",
    "gradpipe.graph.server_tasks": "gradpipe.aggregation.server_opt_tasks",
    "gradpipe.graph.ingest": "gradpipe.ingestion.graph",
    "gradpipe.graph.ingest_plan": "gradpipe.ingestion.plan",
    "gradpipe.graph.ingest_tasks": "gradpipe.ingestion.tasks",
    "gradpipe.graph.ingest_chains": "gradpipe.ingestion.chains",
    "gradpipe.graph.discover": "gradpipe.ingestion.discover",
    "gradpipe.graph.evaluate": "gradpipe.evaluation.graph",
    "gradpipe.graph.evaluate_result": "gradpipe.evaluation.result",
    "gradpipe.graph.evaluate_tasks": "gradpipe.evaluation.tasks",
    "gradpipe.testing.cli": "gradpipe.cli.testing",
}


class _Alias(importlib.abc.Loader):
    """Loads an old name as the module at its new name."""

    def __init__(self, target: str) -> None:
        self._target = target
        self._spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        warnings.warn(
            f"{spec.name} moved to {self._target}; import it from there "
            "(the old name goes in the next release)",
            DeprecationWarning,
            stacklevel=2,
        )
        module = importlib.import_module(self._target)
        self._spec = module.__spec__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        # The import system set the alias's spec on the shared module object: give it back its own.
        module.__spec__ = self._spec


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """A finder, last on ``sys.meta_path``, for the names in :data:`MOVED` only."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        new = MOVED.get(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias(new))


def install() -> None:
    """Put the finder on ``sys.meta_path`` once (importing :mod:`gradpipe` calls this)."""
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
