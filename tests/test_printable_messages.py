"""Names from users and files reach error messages escaped and short (issue 18).

Every module that formats a run, peer, tensor, snapshot or member name, a path
or a store URL into a message passes it through
:func:`gradpipe.core.display.printable`: a newline, an escape sequence or a
bidirectional control shows as its escape, and a 5,000-character name is cut
to a few hundred characters. These checks take one refusal of each kind of
source: dump readers, the workflow parser, the API over a store.
"""

from __future__ import annotations

import io
import json
import struct
from pathlib import Path

import numpy as np
import pytest

import gradpipe as gp
from gradpipe.formats.dump import dump_format
from gradpipe.formats.npz import read_npz_arrays
from gradpipe.formats.safetensors import read_header
from gradpipe.workflow import WorkflowError
from gradpipe.workflow._yaml import read_workflow_text
from gradpipe.workflow.spec import parse_workflow

#: What a hostile name holds: a line break, a colour escape, a right-to-left override.
HOSTILE = "\n\x1b[31m\u202e"
#: A name of 5,000 characters and more that starts with them.
LONG = HOSTILE + "x" * 5000
#: The longest a message with a few such names in it may be.
SHORT = 1500


def _assert_safe(message: str) -> None:
    for raw, escaped in (("\n", "\\n"), ("\x1b", "\\x1b[31m"), ("\u202e", "\\u202e")):
        assert raw not in message, message[:300]
        assert escaped in message, message[:300]
    assert len(message) < SHORT, len(message)


def test_a_damaged_npz_member_is_named_escaped_with_its_path() -> None:
    buffer = io.BytesIO()
    values = np.arange(64, dtype=np.float32)
    np.savez(buffer, **{LONG: values})
    data = bytearray(buffer.getvalue())
    data[data.find(values.tobytes()) + 10] ^= 0xFF  # its CRC-32 no longer matches
    with pytest.raises(gp.InvalidInputError) as caught:
        read_npz_arrays(io.BytesIO(bytes(data)), path=LONG + ".npz", size=len(data))
    message = str(caught.value)
    assert "is damaged: its bytes do not have the CRC-32" in message
    assert "damaged on disk or in transfer: re-create it or copy it again" in message
    _assert_safe(message)


def test_an_unreadable_safetensors_file_is_named_escaped() -> None:
    with pytest.raises(gp.InvalidInputError) as caught:
        read_header(io.BytesIO(b"\xff" * 64), path=LONG + ".safetensors")
    assert "not a valid safetensors file" in str(caught.value)
    _assert_safe(str(caught.value))


def test_a_safetensors_tensor_of_an_unknown_dtype_is_named_escaped() -> None:
    header = json.dumps({LONG: {"dtype": LONG, "shape": [1], "data_offsets": [0, 4]}}).encode()
    data = struct.pack("<Q", len(header)) + header + b"\0" * 4
    with pytest.raises(gp.GradpipeError) as caught:
        read_header(io.BytesIO(data), path="w.safetensors")
    assert "which gradpipe does not store" in str(caught.value)
    _assert_safe(str(caught.value))


def test_a_file_of_no_known_format_is_named_escaped() -> None:
    with pytest.raises(gp.InvalidInputError) as caught:
        dump_format(LONG + ".bin")
    assert "not a known dump format" in str(caught.value)
    _assert_safe(str(caught.value))


def test_a_workflow_stage_naming_a_hostile_run_is_refused_escaped() -> None:
    run = json.dumps(LONG)  # a double-quoted YAML string: \n, \u001b and \u202e escapes
    text = f"version: 1\nstore: /data/store\nstages:\n  - aggregate: {{run: {run}, method: mean}}\n"
    with pytest.raises(WorkflowError) as caught:
        parse_workflow(text, LONG + ".yaml", env={})
    message = str(caught.value)
    assert "is not valid here" in message
    assert message.count("\\u202e") == 2  # the file's path and the run name
    _assert_safe(message)


def test_a_missing_workflow_file_is_named_escaped(tmp_path: Path) -> None:
    with pytest.raises(WorkflowError) as caught:
        read_workflow_text(tmp_path / (HOSTILE + "x" * 200))
    assert "no such workflow file" in str(caught.value)
    _assert_safe(str(caught.value))


@pytest.fixture
def hostile_store(tmp_path: Path) -> gp.Store:
    """A store under six directories whose names hold the hostile characters (1,200 long)."""
    where = tmp_path.joinpath(*[HOSTILE + "d" * 190] * 6)
    where.mkdir(parents=True)
    return gp.open_store(where / "store", mode="a")


def test_restoring_a_missing_snapshot_names_the_store_escaped(hostile_store: gp.Store) -> None:
    with pytest.raises(gp.NotFoundError) as caught:
        gp.restore(hostile_store, "nope")
    assert "no snapshot 'nope' in store" in str(caught.value)
    _assert_safe(str(caught.value))


def test_aggregating_a_missing_run_names_the_store_escaped(hostile_store: gp.Store) -> None:
    with pytest.raises(gp.NotFoundError) as caught:
        gp.aggregate(hostile_store, run="nope", method="mean")
    assert "no run 'nope' in store" in str(caught.value)
    _assert_safe(str(caught.value))


def test_opening_a_missing_store_names_it_escaped(tmp_path: Path) -> None:
    with pytest.raises(gp.NotFoundError) as caught:
        gp.open_store(tmp_path / (HOSTILE + "s" * 240), mode="r")
    assert "no gradpipe store at" in str(caught.value)
    _assert_safe(str(caught.value))


def test_an_ingest_schema_conflict_names_a_long_hostile_path_short(tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    # HOSTILE less its "[", which a pattern refuses as a wildcard; 1,200 characters and more.
    folder = tmp_path.joinpath(*["\n\x1b\u202e" + "d" * 190] * 6)
    for step, size in ((1, 4), (2, 5)):  # step 2 breaks the schema step 1 fixed
        target = folder / f"step={step}" / "peer=p0.safetensors"
        target.parent.mkdir(parents=True, exist_ok=True)
        save_file({"w": np.zeros(size, dtype=np.float32)}, str(target))
    store = gp.open_store(tmp_path / "store", mode="w")
    pattern = str(folder / "step={step}" / "peer={peer}.safetensors")
    report = gp.ingest(store, pattern, run="r")
    assert [f.step for f in report.failures] == [2]
    reason = report.failures[0].reason
    assert "but the run has it as" in reason
    for raw, escaped in (("\n", "\\n"), ("\x1b", "\\x1b"), ("\u202e", "\\u202e")):
        assert raw not in reason, reason[:300]
        assert escaped in reason, reason[:300]
    assert len(reason) < SHORT, len(reason)
    assert report.failures[0].path.startswith(str(folder))  # the record keeps the exact path


def test_an_aggregate_input_error_names_a_hostile_peer_and_tensor_short() -> None:
    from gradpipe.aggregation.inputs import check_peer_chunks

    chunks = [np.zeros(4, np.float32), np.full(4, np.nan, np.float32)]
    with pytest.raises(gp.InvalidInputError) as caught:
        check_peer_chunks(chunks, step=3, peers=["p0", LONG], tensor=LONG)
    assert "the update holds NaN or infinity" in str(caught.value)
    _assert_safe(str(caught.value))

    with pytest.raises(gp.InvalidInputError) as caught:
        check_peer_chunks([np.zeros(4, np.float32), np.zeros(5, np.float32)], peers=[LONG, "p1"])
    assert "differs from peer" in str(caught.value)
    _assert_safe(str(caught.value))


def test_an_aggregate_manifest_listing_a_peer_twice_lists_them_short() -> None:
    from gradpipe.core.aggregate_manifest import AggregateInput, AggregateManifest
    from gradpipe.core.ids import hash_bytes

    dump = hash_bytes(b"d")
    inputs = tuple(AggregateInput("p" * 200, dump, 1.0) for _ in range(30))
    with pytest.raises(gp.InvalidInputError) as caught:
        AggregateManifest("r", 1, "a", "mean", {}, inputs, (), dump)
    message = str(caught.value)
    assert "lists a peer twice" in message
    assert "and 20 more" in message
    assert len(message) < SHORT, len(message)


def test_a_block_header_naming_a_hostile_codec_is_refused_short() -> None:
    from gradpipe.core.ids import hash_bytes
    from gradpipe.storage.blocks import BLOCK_VERSION, decode_block

    # numcodecs quotes the unknown codec id whole in its own error.
    header = json.dumps({"size": 4, "codecs": [{"id": LONG}]}).encode()
    frame = struct.pack("<4sBI", b"GPBK", BLOCK_VERSION, len(header)) + header + b"\0" * 4
    with pytest.raises(gp.IntegrityError) as caught:
        decode_block(frame, hash_bytes(b"\0" * 4))
    message = str(caught.value)
    assert "has a damaged header" in message
    assert "\n" not in message
    assert "\x1b" not in message
    assert len(message) < 400, len(message)
