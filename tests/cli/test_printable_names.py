"""Names that reach a terminal are printable: escaped, shortened, never repeated (issue 18).

A run name typed on the command line, a peer name cut out of a file name, a
ref's message: whatever the text, ``gradpipe`` prints one short, printable
line per message, and ``--json`` keeps the exact names.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

import gradpipe as gp
from gradpipe.cli.testing import run_cli, run_cli_json
from gradpipe.core.display import printable
from gradpipe.errors import GradpipeError

LONG = "r" * 10_000
#: A newline that would forge a report line, and a right-to-left override that
#: would show "exe.txt" as "txt.exe".
EVIL_PEER = "evil\nFAILED step 9 peer p0: forged\u202eexe.txt"
BAD = ("\n", "\r", "\x1b", "\u202e", "\u2066")


def assert_safe(text: str) -> None:
    """Every line printable: no control, no bidi character, nothing a terminal acts on."""
    for line in text.split("\n"):
        assert line.isprintable(), line


@pytest.fixture
def store_url(tmp_path: Path) -> str:
    url = str(tmp_path / "store")
    gp.open_store(url, mode="w")
    return url


@pytest.mark.parametrize(
    "argv",
    [
        ["ls", "{store}", LONG],
        ["ls", "{store}", LONG[4:] + "\x1b[2J"],
        ["ingest", "{store}", "{pattern}", "--run", LONG],
        ["export", "{store}", "--run", LONG, "--step", "1", "--peer", "p0", "-o", "{out}"],
        ["log", "{store}", LONG],
    ],
)
def test_a_long_name_is_shortened_in_error_messages(
    argv: list[str], store_url: str, tmp_path: Path
) -> None:
    values = {
        "store": store_url,
        "pattern": str(tmp_path / "d/step={step}/peer={peer}.safetensors"),
        "out": str(tmp_path / "out.safetensors"),
    }
    outcome = run_cli(*(a.format(**values) if a.startswith("{") else a for a in argv))
    assert outcome.status == 2
    message = outcome.error_message(argv[0])
    assert len(message) < 400, message[:400]
    assert "(10000 characters)" in message
    assert_safe(outcome.err)


def test_a_long_name_is_shortened_in_python_errors(store_url: str) -> None:
    store = gp.open_store(store_url)
    with pytest.raises(GradpipeError) as caught:
        gp.open_run(store, LONG)
    assert len(str(caught.value)) < 400
    assert printable(LONG) in str(caught.value)


def write_dumps(folder: Path, peers: list[str]) -> str:
    for peer in peers:
        target = folder / "step=1" / f"peer={peer}.safetensors"
        target.parent.mkdir(parents=True, exist_ok=True)
        save_file({"w": np.arange(4, dtype=np.float32)}, str(target))
    return str(folder / "step={step}" / "peer={peer}.safetensors")


def test_a_peer_name_from_a_file_name_is_printed_escaped(store_url: str, tmp_path: Path) -> None:
    pattern = write_dumps(tmp_path / "d", ["p0", EVIL_PEER])

    outcome = run_cli("ingest", store_url, pattern, "--run", "r")
    assert outcome.status == 1  # the bad file fails, the good one is ingested
    assert_safe(outcome.out)
    for char in BAD[1:]:
        assert char not in outcome.out
    failed = [line for line in outcome.out.splitlines() if line.startswith("FAILED")]
    assert len(failed) == 1  # the newline in the name forged no second report line
    assert printable(EVIL_PEER) in failed[0]
    assert "rename the file" in failed[0]

    # --json keeps the exact name (JSON escapes it itself).
    status, doc = run_cli_json("ingest", store_url, pattern, "--run", "r")
    assert status == 1
    assert [f["peer"] for f in doc["failures"]] == [EVIL_PEER]
    assert EVIL_PEER in doc["failures"][0]["path"]

    outcome = run_cli("ls", store_url, "r")
    assert outcome.status == 0
    assert outcome.out.splitlines()[1].split() == ["step", "p0"]


def test_ls_escapes_what_a_ref_carries(store_url: str) -> None:
    store = gp.open_store(store_url, mode="r+")
    message = "made by\n\x1b[31mred\u202e text " + "m" * 5_000
    store.refs.set("tags/t", store.put_raw(b"x"), message=message)

    outcome = run_cli("ls", store_url)
    assert outcome.status == 0
    assert_safe(outcome.out)
    assert len(outcome.out.splitlines()) == 1
    assert len(outcome.out) < 400
    _status, doc = run_cli_json("ls", store_url)
    assert doc["refs"][0]["message"] == message


def test_a_damaged_ref_is_described_once(store_url: str) -> None:
    store = gp.open_store(store_url, mode="r+")
    store.refs.set("snapshots/t", store.put_raw(b"x"))
    (Path(store_url) / "refs" / "snapshots" / "t").write_bytes(b"{not json")

    for command in (["ls", store_url], ["log", store_url, "t"]):
        outcome = run_cli(*command)
        assert outcome.status == 1
        assert_safe(outcome.err)
        message = outcome.error_message(command[0])
        assert message.count("not valid JSON") == 1, message
        assert message.count("snapshots/t") == 1, message
        assert "the ref is damaged" in message

    status, doc = run_cli_json("verify", store_url)
    assert status == 1
    [problem] = doc["problems"]
    assert problem["id"] == "refs/snapshots/t"
    assert problem["detail"].count("not valid JSON") == 1, problem


def test_errors_stay_on_one_printable_line(store_url: str) -> None:
    # A name no message escaped itself (the STORE argument) is escaped on its way out.
    outcome = run_cli("ls", store_url + "/no\x1b[2Jwhere\u202e")
    assert outcome.status == 2
    assert_safe(outcome.err)
    assert len(outcome.err.splitlines()) == 1


def test_tensor_names_in_the_stats_table_are_escaped_and_short(
    store_url: str, tmp_path: Path
) -> None:
    # Tensor names may hold format characters (a zero-width non-joiner is part of
    # Persian words) and run to a thousand characters: accepted, and shown safely.
    bidi, long = "w\u202eexe", "layer." + "x" * 900
    target = tmp_path / "d" / "step=1" / "peer=p0.safetensors"
    target.parent.mkdir(parents=True)
    save_file({bidi: np.ones(4, np.float32), long: np.ones(4, np.float32)}, str(target))
    pattern = str(tmp_path / "d" / "step={step}" / "peer={peer}.safetensors")
    assert run_cli("ingest", store_url, pattern, "--run", "r").status == 0

    outcome = run_cli("stats", store_url, "--run", "r")
    assert outcome.status == 0
    assert_safe(outcome.out)
    assert max(map(len, outcome.out.splitlines())) < 400
    assert "w\\u202eexe" in outcome.out
    assert "(906 characters)" in outcome.out

    outcome = run_cli("stats", store_url, "--run", "r", "--format", "csv")
    assert bidi in outcome.out  # CSV is data: exact names
    assert long in outcome.out


def test_json_keeps_an_error_message_exact_while_stderr_escapes_it(store_url: str) -> None:
    extra = "evil\n\x1b[2J" + "y" * 5_000  # an argument gradpipe ls does not take

    status, doc = run_cli_json("ls", store_url, "r", extra)
    assert status == 2
    assert doc["error"] == f"unrecognized arguments: {extra}; see `gradpipe ls --help`"
    assert doc["type"] == "UsageError"

    outcome = run_cli("ls", store_url, "r", extra, "--json")
    assert_safe(outcome.err)
    assert len(outcome.err.splitlines()) == 1
    assert "evil \\x1b[2J" in outcome.err  # lines joined, the escape shown as text
    assert len(outcome.err) < 2_100
