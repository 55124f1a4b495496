"""Every example in gradpipe's docstrings runs and prints what it shows.

The examples are documentation; run as tests, they cannot drift from the code.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import gradpipe

#: Modules that cannot be imported for their docstrings (``gradpipe.cli.__main__`` runs the CLI).
_NOT_IMPORTED = {"gradpipe.cli.__main__"}

MODULES = sorted(
    info.name
    for info in pkgutil.walk_packages(gradpipe.__path__, "gradpipe.")
    if info.name not in _NOT_IMPORTED
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_hold(name: str) -> None:
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.partition(".")[0] == "gradpipe":
            raise
        pytest.skip(f"{name} needs {exc.name}, which is not installed")
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in doctest.DocTestFinder().find(module, name):  # the module's own objects only
        runner.run(test)
    summary = runner.summarize(verbose=False)
    assert summary.failed == 0, f"{summary.failed} docstring examples in {name} failed (above)"


def test_the_examples_are_found() -> None:
    assert {"gradpipe.core.lossy", "gradpipe.codecs.ops.qsgd", "gradpipe.cli.ingest"} <= set(
        MODULES
    )
    found = doctest.DocTestFinder().find(importlib.import_module("gradpipe.core.lossy"))
    assert sum(len(test.examples) for test in found) >= 3
