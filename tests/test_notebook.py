"""``docs/explore.ipynb`` runs top to bottom (nbclient), so the notebook cannot rot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

NOTEBOOK = Path(__file__).resolve().parents[1] / "docs" / "explore.ipynb"


def test_the_notebook_runs(tmp_path: Path) -> None:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = json.dumps([o.get("data", {}) for o in outputs])
    assert "gp-repr" in text  # the reports and handles rendered as HTML
    assert "(True, True)" in text  # the restore was bit-exact
    assert "image/png" in text  # the plots
    assert "spike_count" in text
    assert "gns_latest" in text
    # Outputs stay small: the notebook is meant to be read on GitHub.
    assert len(json.dumps(nbformat.v4.new_notebook(cells=nb.cells))) < 400_000
