"""HTML for Jupyter: compact tables of what gradpipe objects already know (no data is read).

Every handle (store, run, dump, aggregate, snapshot) and every report has a
``_repr_html_`` built from these few helpers, so they look alike in a
notebook, and a plain ``__repr__`` that fits on a line.
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gradpipe.core.report import Report

__all__ = ["ReportHtml", "human_bytes", "key_values", "report_html", "table"]

_STYLE = (
    "<style>.gp-repr table{border-collapse:collapse;font-size:12px}"
    ".gp-repr td,.gp-repr th{padding:2px 8px;text-align:left;border-bottom:1px solid #ddd}"
    ".gp-repr .gp-ok{color:#1a7f37}.gp-repr .gp-bad{color:#cf222e}"
    ".gp-repr pre{margin:4px 0;font-size:12px}</style>"
)


def human_bytes(n: float) -> str:
    """``1536`` → ``"1.5 KiB"``.

    >>> human_bytes(3 * 2**30)
    '3.0 GiB'
    """
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def _cell(value: Any) -> str:
    return html.escape(str(value))


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]], *, limit: int = 20) -> str:
    """An HTML table of at most ``limit`` rows (then a row saying how many more)."""
    head = "".join(f"<th>{_cell(h)}</th>" for h in headers)
    body, extra = [], 0
    for i, row in enumerate(rows):
        if i >= limit:
            extra += 1
            continue
        body.append("<tr>" + "".join(f"<td>{_cell(v)}</td>" for v in row) + "</tr>")
    if extra:
        body.append(f'<tr><td colspan="{len(headers)}">… {extra} more</td></tr>')
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def key_values(title: str, pairs: Mapping[str, Any], *parts: str) -> str:
    """A titled block: key/value rows, then any further HTML ``parts`` (tables)."""
    rows = "".join(f"<tr><th>{_cell(k)}</th><td>{_cell(v)}</td></tr>" for k, v in pairs.items())
    return (
        f'<div class="gp-repr">{_STYLE}<b>{_cell(title)}</b>'
        f"<table>{rows}</table>{''.join(parts)}</div>"
    )


def report_html(kind: str, ok: bool, summary: str) -> str:
    """A report: its kind, ok or not, and its summary lines."""
    badge = '<span class="gp-ok">ok</span>' if ok else '<span class="gp-bad">not ok</span>'
    return (
        f'<div class="gp-repr">{_STYLE}<b>{_cell(kind)}</b> {badge}'
        f"<pre>{_cell(summary)}</pre></div>"
    )


class ReportHtml:
    """Mixin for reports (``ok`` and ``summary()``): their Jupyter rendering."""

    def _repr_html_(self: Report) -> str:
        return report_html(type(self).__name__, self.ok, self.summary())
