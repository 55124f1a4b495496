"""The ``/gradpipe`` page: the dashboard document as one server-rendered HTML page.

Plain HTML tables and a little CSS, refreshed by the browser every few seconds
(``?refresh=0`` stops it): nothing to build, nothing loaded from elsewhere, and
what a screenshot or ``--dump-dom`` shows is what the server wrote. Every value
that came from a client (runs, stores, failure reasons) is escaped.
"""

from __future__ import annotations

import datetime
import html
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

from dask.utils import format_bytes

__all__ = ["render_page"]

_STYLE: Final = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.2em 2em; color: #222; }
h1 { font-size: 1.5em; margin: 0 0 .2em; } h2 { font-size: 1.1em; margin: 1.4em 0 .4em; }
.meta { color: #666; } .meta a { color: #2060a0; }
table { border-collapse: collapse; } th, td { padding: .25em .7em; text-align: right; }
th { background: #eef2f6; font-weight: 600; } tr:nth-child(even) td { background: #f8f9fb; }
td.text, th.text { text-align: left; } code { font-size: .9em; }
.running { color: #1a6fb3; font-weight: 600; } .done { color: #2c8a3a; font-weight: 600; }
.failed { color: #c26a00; font-weight: 600; } .error { color: #c0282d; font-weight: 600; }
.bar { display: inline-block; width: 80px; height: .7em; background: #e3e8ee; }
.bar > span { display: block; height: 100%; background: #3b82c4; }
ul.failures { margin: 0; padding-left: 1.2em; color: #8a3a00; } .empty { color: #888; }
"""


def render_page(doc: Mapping[str, Any], *, refresh: int) -> str:
    """The page for ``doc`` (:meth:`gradpipe.dashboard.board.Board.document`)."""
    now = float(doc.get("time", 0.0))
    head = f'<meta http-equiv="refresh" content="{refresh}">' if refresh > 0 else ""
    scheduler = html.escape(str(doc.get("scheduler") or ""))
    parts = [
        "<!DOCTYPE html>",
        f'<html lang="en"><head><meta charset="utf-8">{head}<title>gradpipe</title>',
        f"<style>{_STYLE}</style></head><body>",
        "<h1>gradpipe</h1>",
        f'<p class="meta">scheduler <code>{scheduler}</code> &middot; updated {_clock(now)}'
        + (f" &middot; refreshes every {refresh} s" if refresh > 0 else "")
        + ' &middot; <a href="json/gradpipe.json">json/gradpipe.json</a>'
        ' &middot; <a href="metrics">metrics</a> &middot; <a href="status">Dask dashboard</a></p>',
        "<h2>Totals</h2>",
        _totals(doc.get("totals", [])),
        "<h2>Operations</h2>",
        _operations(doc.get("operations", [])),
        "<h2>Latest commits per run</h2>",
        _runs(doc.get("runs", [])),
        "<h2>Latest analyses per run</h2>",
        _analyses(doc.get("analyses", [])),
        "<h2>Failures</h2>",
        _failures(doc.get("operations", [])),
        "</body></html>",
    ]
    return "\n".join(parts)


def _table(headers: Sequence[str], rows: Iterable[Sequence[str]], *, text: int = 0) -> str:
    """A table; the first ``text`` columns are left-aligned. Cells are already HTML."""

    def cells(tag: str, values: Sequence[str]) -> str:
        return "".join(
            f'<{tag} class="text">{v}</{tag}>' if i < text else f"<{tag}>{v}</{tag}>"
            for i, v in enumerate(values)
        )

    out = [f"<table><tr>{cells('th', headers)}</tr>"]
    out += [f"<tr>{cells('td', row)}</tr>" for row in rows]
    if len(out) == 1:
        out.append(f'<tr><td class="text empty" colspan="{len(headers)}">none yet</td></tr>')
    out.append("</table>")
    return "".join(out)


def _totals(totals: Sequence[Mapping[str, Any]]) -> str:
    rows = (
        [
            html.escape(str(t["kind"])),
            str(t.get("running", 0)),
            str(t.get("done", 0)),
            str(t.get("failed", 0)),
            str(t.get("error", 0)),
            _bytes(t.get("bytes_in")),
            _bytes(t.get("bytes_stored")),
            _ratio(t.get("ratio")),
            _rate(t.get("mib_per_second")),
            str(t.get("failures", 0)),
        ]
        for t in totals
    )
    headers = ["kind", "running", "done", "failed", "error", "bytes in", "stored", "ratio",
               "MiB/s", "failed inputs"]  # fmt: skip
    return _table(headers, rows, text=1)


def _operations(operations: Sequence[Mapping[str, Any]]) -> str:
    rows = []
    for op in operations:
        tasks = op.get("tasks", {})
        total, done = int(tasks.get("total", 0)), int(tasks.get("done", 0))
        width = int(100 * done / total) if total else 0
        progress = f'<span class="bar"><span style="width:{width}%"></span></span> {done}/{total}'
        state = html.escape(str(op.get("state")))
        rows.append(
            [
                html.escape(str(op.get("kind"))),
                html.escape(str(op.get("run") or "")),
                f'<span class="{state}">{state}</span>',
                _clock(op.get("started")),
                f"{float(op.get('seconds') or 0):.1f} s",
                progress + (f" ({tasks['erred']} erred)" if tasks.get("erred") else ""),
                _bytes(op.get("bytes_in")),
                _bytes(op.get("bytes_read")),
                _bytes(op.get("bytes_stored")),
                _ratio(op.get("ratio")),
                _rate(op.get("mib_per_second")),
                str(op.get("failed", 0)),
                f"<code>{html.escape(str(op['commit'])[:12])}</code>" if op.get("commit") else "",
            ]
        )
    headers = ["kind", "run", "state", "started", "time", "tasks", "bytes in", "read", "stored",
               "ratio", "MiB/s", "failed inputs", "commit"]  # fmt: skip
    return _table(headers, rows, text=3)


def _runs(runs: Sequence[Mapping[str, Any]]) -> str:
    rows = (
        [
            html.escape(str(run["run"])),
            _clock(c.get("time")),
            html.escape(str(c.get("kind"))),
            f"<code>{html.escape(str(c.get('commit')))}</code>",
            html.escape(str(c.get("store") or "")),
        ]
        for run in runs
        for c in run.get("commits", [])
    )
    return _table(["run", "committed", "by", "run manifest", "store"], rows, text=5)


def _analyses(analyses: Sequence[Mapping[str, Any]]) -> str:
    def cell(value: Any, fmt: str = "{}") -> str:
        return "" if value is None or value == "" else html.escape(fmt.format(value))

    rows = (
        [
            html.escape(str(a["run"])),
            _clock(a.get("time")),
            html.escape(str(a.get("state") or "")),
            cell(a.get("spike_count")),
            cell(a.get("first_nonfinite")),
            cell(a.get("outlier_peers")) or "none",
            cell(a.get("gns_latest"), "{:.4g}"),
            cell(a.get("chunks_read")),
        ]
        for a in analyses
    )
    headers = ["run", "analysed", "state", "spikes", "first non-finite", "outlier peers",
               "noise scale", "chunks read"]  # fmt: skip
    return _table(headers, rows, text=6)


def _failures(operations: Sequence[Mapping[str, Any]]) -> str:
    items = []
    for op in operations:
        lines = list(op.get("failures", []))
        if op.get("error"):
            lines.insert(0, str(op["error"]))
        if not lines:
            continue
        more = int(op.get("failed", 0)) - len(op.get("failures", []))
        label = html.escape(f"{op.get('kind')} {op.get('run') or ''}".strip())
        body = "".join(f"<li>{html.escape(str(line))}</li>" for line in lines)
        if more > 0:
            body += f"<li>... and {more} more (the operation's report lists them all)</li>"
        items.append(f"<p><b>{label}</b> ({_clock(op.get('started'))})</p>")
        items.append(f'<ul class="failures">{body}</ul>')
    return "\n".join(items) or '<p class="empty">none</p>'


def _bytes(value: Any) -> str:
    return format_bytes(int(value)) if isinstance(value, int | float) else ""


def _ratio(value: Any) -> str:
    return f"{value:.2f}" if isinstance(value, int | float) else ""


def _rate(value: Any) -> str:
    return f"{value:.0f}" if isinstance(value, int | float) else ""


def _clock(when: Any) -> str:
    if not isinstance(when, int | float) or not when:
        return ""
    return datetime.datetime.fromtimestamp(when).strftime("%H:%M:%S")
