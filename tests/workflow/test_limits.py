"""Workflow files are bounded: size, nesting, values after aliases, tags, text, numbers.

Every hostile file ends as a :class:`WorkflowError` (exit 2 from the CLI) that says
``file:line:col``, the limit and what to do, in time and memory bounded by the limits.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import resource
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from gradpipe.cli import main
from gradpipe.workflow import WorkflowError, load_workflow
from gradpipe.workflow._yaml import (
    MAX_WORKFLOW_BYTES,
    MAX_WORKFLOW_DEPTH,
    MAX_WORKFLOW_NUMBER_CHARS,
    MAX_WORKFLOW_TEXT,
    MAX_WORKFLOW_VALUES,
    Node,
)
from gradpipe.workflow.fields import (
    Bool,
    Choice,
    Context,
    Duration,
    Field,
    Float,
    Int,
    LocalPath,
    NumberMap,
    Options,
    PathOrUrl,
    Size,
    StepRange,
    Str,
    StrList,
)
from gradpipe.workflow.spec import STAGES, parse_workflow

REPO = Path(__file__).resolve().parents[2]
HEAD = "version: 1\nstore: a\nstages:\n  - "
#: ``/data/w.yaml:LINE:COL: `` at the start of a message.
WHERE = re.compile(r"^/data/w\.yaml:(\d+):(\d+): ")


def _parse(text: str) -> object:
    return parse_workflow(text, "/data/w.yaml", env={})


def _refused(text: str) -> tuple[int, int, str]:
    """The line, column and message of the error ``text`` gets."""
    with pytest.raises(WorkflowError) as caught:
        _parse(text)
    message = str(caught.value)
    match = WHERE.match(message)
    assert match is not None, message
    return int(match.group(1)), int(match.group(2)), message


def _laughs(levels: int) -> str:
    """The "billion laughs" shape: each level a list of nine aliases of the one before."""
    lines = ["    l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"    l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels + 1)]
    body = "\n".join(lines)
    return f"version: 1\nstore:\n  url: a\n  storage_options:\n{body}\nstages: [gc: {{}}]\n"


# --- aliases ----------------------------------------------------------------------------------


def test_billion_laughs_is_refused_at_the_alias_that_crosses_the_limit() -> None:
    # 9**13 values if expanded; refused when the count passes the limit, without copying.
    line, column, message = _refused(_laughs(12))
    assert f"{MAX_WORKFLOW_VALUES:,}" in message
    assert "alias" in message
    # Before l0's line: the top mapping, version, 1, store, its mapping, url, a,
    # storage_options and its mapping (9); l0's line adds its key and 10 values. Each later
    # line adds its key, its list, and 9 aliases of the previous level's size.
    count, size, level = 9 + 1 + 10, 10, 0
    while count + 2 + 9 * size <= MAX_WORKFLOW_VALUES:
        count, size, level = count + 2 + 9 * size, 1 + 9 * size, level + 1
    level += 1  # the line where it crosses, and the alias on it that does
    alias = next(j for j in range(1, 10) if count + 2 + j * size > MAX_WORKFLOW_VALUES)
    assert line == 5 + level
    prefix = f"    l{level}: &l{level} ["
    assert column == len(prefix) + 1 + (alias - 1) * len(f"*l{level - 1}, ")


def test_aliases_below_the_limit_are_shared_not_copied() -> None:
    w = _parse(
        "version: 1\nstore: {url: a, storage_options: {x: &x {k: [1, 2]}, y: *x}}\nstages: [gc: {}]"
    )
    assert w.storage_options == {"x": {"k": [1, 2]}, "y": {"k": [1, 2]}}  # type: ignore[attr-defined]


def test_an_alias_counts_the_values_it_repeats() -> None:
    # One anchored list of n values, repeated by aliases until the total passes the limit:
    # an alias costs what it stands for, however short it is to write.
    n = 1000
    items = ", ".join(["1"] * n)
    repeats = MAX_WORKFLOW_VALUES // (n + 1) + 1
    aliases = ", ".join(["*big"] * repeats)
    text = (
        f"version: 1\nstore: {{url: a, storage_options: {{big: &big [{items}], "
        f"more: [{aliases}]}}}}\nstages: [gc: {{}}]"
    )
    line, _, message = _refused(text)
    assert line == 2
    assert "alias" in message
    assert f"{MAX_WORKFLOW_VALUES:,}" in message


_KEYS = ", ".join(f"{i:03}{'t' * 997}: 1" for i in range(100))  # PyYAML keys: 1024 at most


@pytest.mark.parametrize(
    ("anchored", "chars"),
    [
        ("&t " + "t" * 100_000, 100_000),
        ("&t {" + _KEYS + "}", 100_100),
        ("&t [" + "t" * 100_000 + ", " + "t" * 100_000 + "]", 200_000),
    ],
    ids=["string", "keys", "list"],
)
def test_an_alias_counts_the_text_it_repeats(anchored: str, chars: int) -> None:
    # 100,000 characters or more written once, repeated by short aliases: every stage would
    # get a copy, so the expanded text is limited as the values are.
    repeats = MAX_WORKFLOW_TEXT // 100_000 + 1
    text = (
        f"version: 1\nstore: {{url: a, storage_options: {{big: {anchored}, "
        f"more: [{', '.join(['*t'] * repeats)}]}}}}\nstages: [gc: {{}}]"
    )
    line, column, message = _refused(text)
    assert line == 2
    prefix = f"store: {{url: a, storage_options: {{big: {anchored}, more: ["
    before = len("version1storeurlastorage_optionsbigmore")  # the scalars before the aliases
    crossing = next(
        j for j in range(1, repeats + 1) if before + chars * (1 + j) > MAX_WORKFLOW_TEXT
    )
    assert column == len(prefix) + 1 + (crossing - 1) * len("*t, ")
    assert f"{MAX_WORKFLOW_TEXT:,}" in message
    assert f"*t repeats {chars:,} characters" in message


def test_text_below_the_limit_with_aliases_is_accepted() -> None:
    big = "t" * 100_000
    aliases = ", ".join(["*t"] * (MAX_WORKFLOW_TEXT // 100_000 - 2))
    w = _parse(
        f"version: 1\nstore: {{url: a, storage_options: {{big: &t {big}, more: [{aliases}]}}}}"
        "\nstages: [gc: {}]"
    )
    assert w.storage_options["more"][-1] == big  # type: ignore[attr-defined]


def test_a_long_anchor_name_is_shortened_in_messages() -> None:
    name = "n" * 5000
    _, _, message = _refused(f"version: 1\nstore: a\nstages: &{name} [gc: {{}}, *{name}]")
    assert "refers to a node that holds it" in message
    assert len(message) < 400
    big = "t" * 100_000
    repeats = ", ".join([f"*{name}"] * (MAX_WORKFLOW_TEXT // 100_000 + 1))
    _, _, message = _refused(
        f"version: 1\nstore: {{url: a, storage_options: {{big: &{name} {big}, more: [{repeats}]}}}}"
        "\nstages: [gc: {}]"
    )
    assert "characters of text" in message
    assert len(message) < 500


def test_substitutions_and_joined_paths_are_charged_to_one_budget() -> None:
    # ${BIG} (100,000 characters) in every stage makes new text the file never wrote.
    env = {"BIG": "b" * 100_000}
    stages = "".join("  - sample: {dir: '/x/${BIG}'}\n" for _ in range(50))
    text = f"version: 1\nstore: a\nstages:\n{stages}"
    with pytest.raises(WorkflowError) as caught:
        parse_workflow(text, "/data/w.yaml", env=env)
    message = str(caught.value)
    crossing = MAX_WORKFLOW_TEXT // 100_000 + 1  # the stage whose dir passes the budget
    assert message.startswith(f"/data/w.yaml:{3 + crossing}:19: "), message[:200]
    assert f"{MAX_WORKFLOW_TEXT:,}" in message
    # A relative path is joined to the file's folder: new text per use, however short the alias.
    folder = "/" + "d" * 4000
    stages = "  - sample: {dir: &d x}\n" + "  - sample: {dir: *d}\n" * 1100
    with pytest.raises(WorkflowError, match="the values made from this workflow file"):
        parse_workflow(f"version: 1\nstore: a\nstages:\n{stages}", f"{folder}/w.yaml", env={})
    # Within the budget: the same substitutions are made.
    w = parse_workflow(
        "version: 1\nstore: a\nstages:\n  - sample: {dir: '/x/${BIG}'}\n", "/data/w.yaml", env=env
    )
    assert w.stages[0].params["dir"] == "/x/" + env["BIG"]


def _parse_often(field: Field, node: Node, ctx: Context) -> None:
    """Parse ``node`` as often as one more than the budget has room for 1,000 characters."""
    for _ in range(MAX_WORKFLOW_TEXT // 1000 + 1):
        field.parse(node, ctx)


def test_the_budget_is_charged_by_the_fields_that_make_text() -> None:
    ctx = Context({"V": "v" * 1000}, Path("/" + "d" * 1000))
    node = Node("${V}", "/data/w.yaml", 4, 7)
    with pytest.raises(WorkflowError, match=r"^/data/w\.yaml:4:7: the values made"):
        _parse_often(Str(), node, ctx)
    ctx = Context({}, Path("/" + "d" * 1000))
    relative = Node("x", "/data/w.yaml", 5, 9)
    with pytest.raises(WorkflowError, match=r"^/data/w\.yaml:5:9: the values made"):
        _parse_often(PathOrUrl(), relative, ctx)


@pytest.mark.parametrize(
    ("escape", "column"), [("\\UFFFFFFFF", 22), ("\\U00110000", 22), ("a\\U7FFFFFFF", 23)]
)
def test_an_escape_beyond_unicode_says_where(escape: str, column: int) -> None:
    line, found, message = _refused(HEAD + f'sample: {{dir: "{escape}"}}')
    assert (line, found) == (4, column), message
    assert "beyond U+10FFFF" in message


def test_a_duplicate_anchor_names_both_occurrences() -> None:
    line, column, message = _refused(HEAD + "sample: {dir: &x a, steps: &x 2, peers: *x}")
    assert (line, column) == (4, 32)
    assert "duplicate anchor 'x'" in message
    assert "first occurrence at 4:19" in message


def test_an_implicit_timestamp_that_is_no_date_says_quote_it() -> None:
    _, _, message = _refused(HEAD + "sample: {dir: 2001-13-45}")
    assert "quote it" in message
    assert "remove the tag" not in message
    _, _, message = _refused(HEAD + "sample: {dir: !!timestamp 2001-13-45}")
    assert "remove the tag" in message


def test_an_alias_inside_its_own_anchor_is_refused_at_the_alias() -> None:
    line, column, message = _refused("version: 1\nstore: a\nstages: &a [gc: {}, *a]")
    assert (line, column) == (3, 21)
    assert "refers to a node that holds it" in message


# --- nesting ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("version: 1\nstore: a\nstages: " + "[" * 100_000, 3),
        ("version: 1\nstore: a\nstages: " + "{a: " * 100_000, 3),
        ("version: 1\nstore: a\nstages:\n" + "".join(f"{' ' * i}- \n" for i in range(200)), 0),
        # An alias of a deep anchor, put deeper still: the depth counts what it stands for.
        (
            "version: 1\nd: &d "
            + "[" * (MAX_WORKFLOW_DEPTH - 2)
            + "]" * (MAX_WORKFLOW_DEPTH - 2)
            + "\nstore: [[[[*d]]]]\nstages: [gc: {}]",
            3,
        ),
    ],
    ids=["flow-lists", "flow-mappings", "block-lists", "alias"],
)
def test_deep_nesting_is_refused_where_it_passes_the_limit(text: str, line: int) -> None:
    found, _, message = _refused(text)
    if line:
        assert found == line
    assert f"{MAX_WORKFLOW_DEPTH} levels" in message


def test_nesting_up_to_the_limit_is_accepted() -> None:
    deep = "[" * (MAX_WORKFLOW_DEPTH - 3) + "1" + "]" * (MAX_WORKFLOW_DEPTH - 3)
    w = _parse(f"version: 1\nstore: {{url: a, storage_options: {{x: {deep}}}}}\nstages: [gc: {{}}]")
    value = w.storage_options["x"]  # type: ignore[attr-defined]
    levels = 0
    while isinstance(value, list):
        value, levels = value[0], levels + 1
    assert (levels, value) == (MAX_WORKFLOW_DEPTH - 3, 1)


# --- size -------------------------------------------------------------------------------------


def test_a_file_over_the_size_limit_is_refused_before_it_is_parsed(tmp_path: Path) -> None:
    path = tmp_path / "w.yaml"
    valid = b"version: 1\nstore: a\nstages: [gc: {}]\n"
    pad = b"# padding\n" * (MAX_WORKFLOW_BYTES // 10)
    path.write_bytes(valid + pad)
    assert path.stat().st_size > MAX_WORKFLOW_BYTES
    with pytest.raises(WorkflowError) as caught:
        load_workflow(path)
    message = str(caught.value)
    assert message.startswith(f"{path}:")
    assert f"{MAX_WORKFLOW_BYTES:,} bytes" in message
    with pytest.raises(WorkflowError, match=f"{MAX_WORKFLOW_BYTES:,} bytes"):
        parse_workflow((valid + pad).decode(), "/data/w.yaml")  # text given directly too


def test_an_endless_file_is_read_only_up_to_the_limit() -> None:
    # /dev/zero never ends: the read stops one byte past the limit.
    with pytest.raises(WorkflowError, match=f"{MAX_WORKFLOW_BYTES:,} bytes"):
        load_workflow("/dev/zero")


def test_a_file_at_the_size_limit_is_read(tmp_path: Path) -> None:
    valid = b"version: 1\nstore: a\nstages: [gc: {}]\n"
    path = tmp_path / "w.yaml"
    path.write_bytes(valid + b"#" * (MAX_WORKFLOW_BYTES - len(valid)))
    assert load_workflow(path).stages[0].kind == "gc"


# --- tags -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "where", "tag"),
    [
        ("store: !!python/object:os.system {url: a}", "2:8", "python/object:os.system"),
        ("store: !custom {url: a}", "2:8", "!custom"),
        ("store: !!set {a}", "2:8", "set"),
        ("store: !!omap [url: a]", "2:8", "omap"),
        ("store: !!pairs [url: a]", "2:8", "pairs"),
        ("store: a\nstages: !list [gc: {}]", "3:9", "!list"),
        ("store: !!seq {url: a}", "2:8", "seq"),
        ("store: !!map [a]", "2:8", "map"),
        ("store: !!binary aGVsbG8=", "2:8", "binary"),
        ("store: !!timestamp 2020-01-01", "2:8", "timestamp"),
        ("store: !!python/str a", "2:8", "python/str"),
        ("store: !!seq a", "2:8", "seq"),
        ("store: !local a", "2:8", "!local"),
        ("store: {!k url: a}", "2:9", "!k"),
    ],
)
def test_unsupported_tags_are_refused_on_every_kind_of_node(
    text: str, where: str, tag: str
) -> None:
    if "stages" not in text:
        text += "\nstages: [gc: {}]"
    line, column, message = _refused("version: 1\n" + text)
    assert f"{line}:{column}" == where, message
    assert "tag" in message
    assert tag in message


@pytest.mark.parametrize(
    "text",
    [
        "version: !!int 1\nstore: !!map {url: !!str a}\nstages: !!seq [gc: {}]",
        "version: !!int '1'\nstore: ! a\nstages: [gc: {grace: !!float 3}]",
        "version: 1\nstore: a\nstages: [gc: {grace: !!str 3}, verify: !!null '']",
    ],
)
def test_the_core_schema_tags_are_accepted(text: str) -> None:
    assert _parse(text).stages  # type: ignore[attr-defined]


def test_merge_keys_are_refused_with_a_way_out() -> None:
    _, _, message = _refused("version: 1\nstore: a\nd: &d {grace: 1h}\nstages: [gc: {<<: *d}]")
    assert "merge" in message
    assert "quote" in message


# --- text -------------------------------------------------------------------------------------


def test_invalid_utf8_says_where(tmp_path: Path) -> None:
    path = tmp_path / "w.yaml"
    path.write_bytes(b"version: 1\nstore: ab\xffc\nstages: [gc: {}]\n")
    with pytest.raises(WorkflowError, match=re.escape(f"{path}:2:10: ")) as caught:
        load_workflow(path)
    assert "UTF-8" in str(caught.value)


def test_utf16_is_named(tmp_path: Path) -> None:
    path = tmp_path / "w.yaml"
    path.write_bytes("version: 1\nstore: a\nstages: [gc: {}]\n".encode("utf-16"))
    with pytest.raises(WorkflowError, match="UTF-16"):
        load_workflow(path)


def test_a_utf8_byte_order_mark_is_accepted(tmp_path: Path) -> None:
    path = tmp_path / "w.yaml"
    path.write_bytes(b"\xef\xbb\xbfversion: 1\nstore: a\nstages: [gc: {}]\n")
    assert load_workflow(path).stages[0].kind == "gc"


def test_a_control_character_says_where() -> None:
    line, column, message = _refused("version: 1\nstore: a\x01b\nstages: [gc: {}]")
    assert (line, column) == (2, 9)
    assert "U+0001" in message


@pytest.mark.parametrize(
    ("escape", "what"), [(r"\0", "U+0000"), (r"\ud800", "U+D800"), (r"\x00", "U+0000")]
)
def test_strings_that_no_path_or_name_can_hold_are_refused(escape: str, what: str) -> None:
    line, column, message = _refused(f'version: 1\nstore: "a{escape}b"\nstages: [gc: {{}}]')
    assert (line, column) == (2, 8)
    assert what in message


# --- numbers and values -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "number",
    [
        "9" * 5000,
        "0x" + "f" * 5000,
        ":".join(["1"] + ["59"] * 3000),  # YAML 1.1 base 60
        "1." + "0" * 5000,
        "!!int '" + "9" * 5000 + "'",
    ],
    ids=["decimal", "hex", "base60", "float", "tagged"],
)
def test_a_number_longer_than_the_limit_is_refused(number: str) -> None:
    line, column, message = _refused(f"version: 1\nstore: a\nretries: {number}\nstages: [gc: {{}}]")
    assert (line, column) == (3, 10)
    assert f"{MAX_WORKFLOW_NUMBER_CHARS} characters" in message


@pytest.mark.parametrize(
    ("body", "column", "words"),
    [
        ("gc: {grace: ''}", 17, "not a duration"),
        ("gc: {grace: ' '}", 17, "not a duration"),
        ("gc: {grace: h}", 17, "not a duration"),
        ("gc: {grace: 1e400h}", 17, "not a duration"),
        ("ingest: {pattern: p, run: r, chunk_bytes: ''}", 47, "not a size"),
        ("ingest: {pattern: p, run: r, chunk_bytes: kB}", 47, "not a size"),
        ("ingest: {pattern: p, run: r, chunk_bytes: 1e400}", 47, "not a size"),
        ("aggregate: {run: r, method: sum, steps: '" + "9" * 5000 + ":1'}", 45, "A:B"),
    ],
)
def test_values_that_crashed_the_checks_are_refused(body: str, column: int, words: str) -> None:
    line, found, message = _refused(HEAD + body)
    assert (line, found) == (4, column), message
    assert words in message


# --- the CLI ----------------------------------------------------------------------------------


def _limit_memory() -> None:  # pragma: no cover - runs in the child
    # 1 GiB of address space: the dry run needs ~200 MB; an unbounded expansion dies here.
    resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))


def _cli(path: Path, *options: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gradpipe.cli", "run", str(path), "--dry-run", *options],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO), "BIG": "b" * 100_000},
        preexec_fn=_limit_memory,
        timeout=300,  # the failure mode of an unbounded file; the bounded ones take a second
        check=False,
    )


@pytest.mark.parametrize(
    "content",
    [
        _laughs(12).encode(),
        b"version: 1\nstore: a\nstages: " + b"[" * 100_000,
        b"version: 1\nstore: a\nstages: [gc: {}]\n" + b"#" * (50 << 20),
        b"version: 1\nstore: !!python/object/apply:os.system {url: a}\nstages: [gc: {}]\n",
        b"version: 1\nstore: a\nretries: " + b"9" * 5000 + b"\nstages: [gc: {}]\n",
        b"version: 1\nstore: a\xff\xfe\nstages: [gc: {}]\n",
        b"version: 1\nstore: a\nstages:\n  - sample: {dir: &p "
        + b"p" * 500_000
        + b"}\n"
        + b"  - sample: {dir: *p}\n" * 19_000,
        b"version: 1\nstore: a\nstages:\n  - sample: {dir: '" + b"${BIG}" * 30_000 + b"'}\n",
        b"version: 1\nstore: a\nstages:\n  - sample: {dir: d, steps: [&s "
        + b"s" * 500_000
        + b", "
        + b"*s, " * 99_000
        + b"*s]}\n",
        b"version: 1\nstore: a\nstages:\n  - rounds: {run: r, expect: [&s "
        + b"s" * 500_000
        + b", "
        + b"*s, " * 99_000
        + b"*s]}\n",
        b'version: 1\nstore: a\nstages:\n  - sample: {dir: "\\UFFFFFFFF"}\n',
    ],
    ids=[
        "aliases",
        "nesting",
        "50MB",
        "tag",
        "number",
        "utf8",
        "aliased-text",
        "env",
        "wrong",
        "summary",
        "escape",
    ],
)
def test_the_cli_exits_2_with_a_location_and_no_traceback(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "w.yaml"
    path.write_bytes(content)
    done = _cli(path)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert re.search(rf"{re.escape(str(path))}:\d+:\d+: ", done.stderr), done.stderr[-2000:]
    assert len(done.stderr) < 2000  # one message, not a dump of the file


# --- fuzzing ----------------------------------------------------------------------------------

#: Pieces of YAML that break parsers: aliases, anchors, tags, flow and block nesting,
#: directives, documents, quotes, escapes, BOMs, control characters and invalid UTF-8.
_FRAGMENTS = [
    "&a ", "*a", "&b ", "*b", "*nope", "!!set ", "!!omap ", "!!python/object:os.system ",
    "!x ", "!!str ", "!!int ", "!!binary ", "!!timestamp ", "!<tag:x> ", "[", "]", "{", "}",
    ", ", ": ", "- ", "? ", "\n", "\n  ", "\n    ", "\t", "#c", "---\n", "...\n", "%YAML 1.1\n",
    "%TAG ! tag:x,2000:\n", "'", '"', '"\\0"', '"\\ud800"', '"\\x01"', "|\n  a", ">\n  a",
    "<<: *a", "=", "~", "null", "1e400", "0x" + "f" * 40, "1:2:3", "2020-01-01", "9" * 200,
    "x" * 300, "\ufeff", "\x00", "\x85", "\u2028", "version: 1", "store: a", "stages:",
    "gc: {}", "verify:", "a: 1\na: 2", "${X}", "$$", "${X:-y}", '"\\UFFFFFFFF"',
    '"\\U00110000"', "2001-13-45",
]  # fmt: skip


def _check_outcome(run: Callable[[], object]) -> None:
    """``run()`` returns, or raises a WorkflowError that says where (or that the file is empty)."""
    try:
        run()
    except WorkflowError as exc:
        message = str(exc)
        assert WHERE.match(message) or message.startswith("/data/w.yaml: the file is empty"), (
            message
        )


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.one_of(
            st.sampled_from(_FRAGMENTS),
            st.text(max_size=8),
            st.integers(1, 60).map(lambda n: "[" * n),
            st.integers(1, 60).map(lambda n: "{a: " * n),
        ),
        max_size=40,
    )
)
def test_any_text_is_a_workflow_or_a_workflow_error(pieces: list[str]) -> None:
    text = "".join(pieces)
    _check_outcome(lambda: _parse(text))
    _check_outcome(lambda: _parse("version: 1\nstore: a\nstages:\n  - " + text))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_are_a_workflow_or_a_workflow_error(data: bytes) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "w.yaml"
        path.write_bytes(data)
        try:
            load_workflow(path, env={})
        except WorkflowError as exc:
            message = str(exc)
            assert re.match(rf"{re.escape(str(path))}:\d+:\d+: ", message) or message.endswith(
                "the file is empty; a workflow needs version, store and stages"
            ), message


# Values of every kind a hostile file can put where a field expects its own.
_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.text(max_size=20),
    st.sampled_from(["", " ", "h", "kB", "1e400", "9" * 5000 + ":1", "-1", "0:0", "${NOPE}"]),
    st.text(max_size=3).map(lambda s: s * 2000),  # huge
)
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)


#: A valid value of each field type, so that some workflows check out and reach the store.
_VALID: dict[type[Field], object] = {
    Str: "r", PathOrUrl: "p/{step}/{peer}.npz", LocalPath: "out", Int: 2, Float: 0.5,
    Bool: True, Duration: "1h", Size: "4 MiB", StepRange: "0:10", StrList: ["p0"],
    NumberMap: {"p0": 1.0}, Options: {},
}  # fmt: skip


def _value(field: Field | None) -> st.SearchStrategy[object]:
    """A valid value for ``field`` half the time, anything at all the other half."""
    if isinstance(field, Choice):
        valid: st.SearchStrategy[object] = st.sampled_from(field.choices)
    elif field is not None and type(field) in _VALID:
        valid = st.just(_VALID[type(field)])
    else:
        valid = st.just(1)
    return st.one_of(valid, _VALUES)


@st.composite
def _stages(draw: st.DrawFn) -> list[dict[str, object]]:
    stages = []
    for kind in draw(st.lists(st.sampled_from(sorted(STAGES)), min_size=1, max_size=4)):
        spec = STAGES[kind]
        names = [*spec.fields, "retries", "backoff", "bogus"]
        body = {
            name: draw(_value(spec.fields.get(name)))
            for name in draw(st.lists(st.sampled_from(names), unique=True, max_size=5))
        }
        for name in spec.required:
            body.setdefault(name, draw(_value(spec.fields[name])))
        stages.append({kind: body})
    return stages


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(stages=_stages(), top=st.dictionaries(st.sampled_from(["retries", "backoff", "wait",
       "name"]), _VALUES, max_size=2), mangle=st.sampled_from(["none", "bom", "alias", "tag",
       "deep", "dup", "junk"]))  # fmt: skip
def test_a_dry_run_of_any_workflow_exits_0_or_2_with_a_message(
    tmp_path: Path, stages: list[dict[str, object]], top: dict[str, object], mangle: str
) -> None:
    doc = {"version": 1, "store": {"url": str(tmp_path / "archive"), "create": True}, **top}
    doc["stages"] = stages
    text = yaml.safe_dump(doc, allow_unicode=True, width=1 << 20)
    if mangle == "bom":
        text = "\ufeff" + text
    elif mangle == "alias":
        text = text.replace("stages:", "x: &s " + _laughs_flow(8) + "\nstages:")
    elif mangle == "tag":
        text = text.replace("store:", "store: !!omap", 1)
    elif mangle == "deep":
        text = text.replace("stages:", "stages: " + "[" * 5000, 1)
    elif mangle == "dup":
        text += "version: 1\n"
    data = text.encode("utf-8", "surrogatepass")
    if mangle == "junk":
        data = data[: len(data) // 2] + b"\xff\xc0\x00" + data[len(data) // 2 :]
    path = tmp_path / "w.yaml"
    path.write_bytes(data)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(["run", str(path), "--dry-run"])
    message = err.getvalue()
    assert status in (0, 2), message
    event(f"exit {status}")
    assert "Traceback" not in message
    assert "internal error" not in message
    if status == 2:
        assert message.startswith(f"gradpipe run: error: {path}"), message
    if mangle in ("alias", "tag", "deep", "dup", "junk"):
        assert status == 2
        assert re.match(rf"gradpipe run: error: {re.escape(str(path))}:\d+:\d+: ", message)


def _laughs_flow(levels: int) -> str:
    """Billion laughs on one line, as a flow mapping."""
    parts = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    parts += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels + 1)]
    return "{" + ", ".join(parts) + "}"


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("version: 1\nstore: a\nretries: 21\nstages:\n  - gc: {}\n", "more than 20"),
        ("version: 1\nstore: a\nstages:\n  - gc: {retries: 1000000000}\n", "more than 20"),
        ("version: 1\nstore: a\nbackoff: 2h\nstages:\n  - gc: {}\n", "longer than 3600 s"),
        ("version: 1\nstore: a\nstages:\n  - gc: {backoff: 1e300}\n", "longer than 3600 s"),
        ("version: 1\nstore: a\nwait: 1e300\nstages:\n  - gc: {}\n", "longer than 604800 s"),
        ("version: 1\nstore: a\nwait: 8d\nstages:\n  - gc: {}\n", "longer than 604800 s"),
    ],
)
def test_retries_and_backoff_are_bounded(text: str, words: str) -> None:
    """A workflow that would retry or sleep for ever is refused where it says so."""
    line, _, message = _refused(text)
    assert line in (3, 4)
    assert words in message


def test_each_retry_waits_at_most_an_hour() -> None:
    from gradpipe.workflow.run import MAX_RETRY_WAIT, retry_wait

    waits = [retry_wait(3600, attempt) for attempt in range(20)]
    assert waits[0] == 3600
    assert max(waits) == MAX_RETRY_WAIT
    assert [retry_wait(5, k) for k in range(4)] == [5, 10, 20, 40]


class _Counted:
    """A value that counts how often it is written out."""

    calls = 0

    def __repr__(self) -> str:
        _Counted.calls += 1
        return "c" * 100


def test_the_dry_run_summary_and_type_errors_write_only_what_they_show() -> None:
    # An aliased list of 100,000 long values: str() or repr() of it would write them all.
    from gradpipe.workflow.run import _shown

    many = [_Counted()] * 100_000
    _Counted.calls = 0
    shown = _shown({"expect": many, "run": "r"})
    assert shown.startswith("expect=[ccc")
    assert shown.endswith("run=r")
    assert len(shown) < 200
    assert _Counted.calls <= 10
    item = Node(_Counted(), "/data/w.yaml", 4, 20)
    error = Int("a count")._wrong(Node([item] * 100_000, "/data/w.yaml", 4, 19), "a number")
    assert str(error).startswith("/data/w.yaml:4:19: expected a number, got a list ([ccc")
    assert len(str(error)) < 200
    assert _Counted.calls <= 20
