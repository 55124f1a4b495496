"""The CLI's JSON: indented as ``json.dumps(indent=2)``, long top-level lists a line per item."""

from __future__ import annotations

import json
from pathlib import Path

from gradpipe.cli._common import json_text


def test_a_short_document_reads_as_indented_json() -> None:
    doc = {"ok": True, "runs": ["a", "b"], "nested": {"records": [1, 2]}, "path": Path("/x")}
    assert json_text(doc) == json.dumps(doc, indent=2, default=str)


def test_long_lists_are_one_item_per_line_and_parse_the_same() -> None:
    records = [{"step": i, "tensor": f"t{i}", "ratio": i / 3, "name": "ü"} for i in range(500)]
    doc = {
        "ok": True,
        "records": records,
        "note": 'a "records": [] string\n  "records": []',
        "summary": list(range(100)),
        "nested": {"records": list(range(100))},
    }
    text = json_text(doc)
    assert json.loads(text) == json.loads(json.dumps(doc))
    lines = text.splitlines()
    assert lines[0] == "{"
    assert '    {"step": 0, "tensor": "t0", "ratio": 0.0, "name": "\\u00fc"},' in lines
    assert len(lines) > 500  # one line per record, not one line for all
