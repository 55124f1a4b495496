"""Design notes: each heading carries its own number, and every reference finds its note."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTES = sorted((ROOT / "docs" / "design").glob("*.md"))
# docs/design/003, docs/design/003-gc-safety.md, ...
_REFERENCE = re.compile(r"docs/design/(\d{3})([\w.-]*)")

pytestmark = pytest.mark.skipif(not NOTES, reason="no docs/design in this checkout")


def test_headings_carry_the_file_number() -> None:
    numbers = []
    for note in NOTES:
        number = note.name[:3]
        assert re.fullmatch(r"\d{3}-[a-z0-9-]+\.md", note.name), note.name
        first = note.read_text(encoding="utf-8").splitlines()[0]
        assert first.startswith(f"# {number} — "), f"{note.name}: heading {first!r}"
        numbers.append(number)
    assert len(set(numbers)) == len(numbers), "two notes share a number"


def test_references_name_existing_notes() -> None:
    by_number = {note.name[:3]: note.name for note in NOTES}
    sources = [ROOT / "README.md", ROOT / "CHANGELOG.md", *NOTES]
    sources += sorted((ROOT / "gradpipe").rglob("*.py"))
    wrong = []
    for source in sources:
        if not source.exists():
            continue
        for match in _REFERENCE.finditer(source.read_text(encoding="utf-8")):
            number, rest = match[1], match[2].rstrip(".")
            name = by_number.get(number)
            if name is None or (rest and f"{number}{rest}" != name):
                wrong.append(
                    f"{source.relative_to(ROOT)}: {match[0]} (notes: {sorted(by_number.values())})"
                )
    assert not wrong, "\n".join(wrong)
