"""``gradpipe init/ls/verify/gc``: exit codes, one JSON object, --dry-run, missing stores."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

import gradpipe as gp
from gradpipe.cli.testing import run_cli, run_cli_json
from gradpipe.core.ids import block_key
from gradpipe.testing import TrainingConfig, write_sample_run

# These tests damage and count data blocks: every chunk is a block of its own.
pytestmark = pytest.mark.usefixtures("no_inline")


def listing(store: gp.Store) -> list[str]:
    return sorted(info.key for info in store.backend.list(""))


def test_init_ls_verify_gc(store_url: str) -> None:
    status, doc = run_cli_json("init", store_url)
    assert status == 0
    assert doc["store"] == store_url
    status, doc = run_cli_json("init", store_url)  # again: nothing happens
    assert status == 0

    status, doc = run_cli_json("ls", store_url)
    assert (status, doc["refs"]) == (0, [])

    store = gp.open_store(store_url, mode="a")
    tensor_id = store.put_tensor(np.arange(100, dtype="float32"))
    # Not under runs/: `ls` checks that a run ref points at a run manifest.
    store.refs.set("models/r1", tensor_id, message="first")
    store.refs.set("tags/best", tensor_id)
    store.refs.set("tags/gone", tensor_id)
    store.refs.set("tags/gone", None)
    status, doc = run_cli_json("ls", store_url)
    assert status == 0
    refs = doc["refs"]
    assert [r["ref"] for r in refs] == ["models/r1", "tags/best"]  # type: ignore[index]
    assert refs[0]["target"] == tensor_id  # type: ignore[index]
    assert refs[0]["message"] == "first"  # type: ignore[index]
    outcome = run_cli("ls", store_url)
    assert outcome.status == 0
    assert "models/r1" in outcome.out
    assert "tags/best" in outcome.out
    assert "tags/gone" not in outcome.out

    status, doc = run_cli_json("verify", store_url)
    assert status == 0
    assert doc["ok"] is True
    assert doc["problems"] == []
    assert doc["blocks"] == 1
    assert doc["bytes"] == 400
    outcome = run_cli("verify", store_url)
    assert outcome.status == 0
    assert "all good" in outcome.out

    status, doc = run_cli_json("gc", store_url)
    assert status == 0
    assert doc["deleted"] == 0
    assert doc["reachable"] == int(doc["reachable"]) > 0  # type: ignore[call-overload]


def test_gc_dry_run_deletes_nothing(store_url: str) -> None:
    store = gp.open_store(store_url, mode="w")
    kept = store.put_tensor(np.arange(50, dtype="int32"))
    store.refs.set("tags/r", kept)
    orphan = store.put_tensor(np.arange(1, 51, dtype="int32"))
    before = listing(store)

    status, doc = run_cli_json("gc", store_url, "--grace", "0s", "--dry-run")
    assert status == 0
    assert doc["dry_run"] is True
    assert doc["deleted"] == 2  # the orphan's manifest and its data block
    assert listing(store) == before

    status, doc = run_cli_json("gc", store_url, "--grace", "24h")
    assert (status, doc["deleted"], doc["kept_young"]) == (0, 0, 2)
    assert listing(store) == before

    outcome = run_cli("gc", store_url, "--grace", "0s")
    assert outcome.status == 0
    assert "deleted 2 unreferenced" in outcome.out
    assert len(listing(store)) == len(before) - 2
    with pytest.raises(gp.NotFoundError):
        store.get_tensor(orphan)
    assert store.get_tensor(kept).tolist() == list(range(50))


def test_verify_reports_damage_exit_1(store_url: str) -> None:
    store = gp.open_store(store_url, mode="w")
    tensor_id = store.put_tensor(np.arange(64, dtype="float64"))
    store.refs.set("tags/r", tensor_id)
    block = store.tensor_info(tensor_id).blocks[0]
    assert block is not None
    store.backend.delete(block_key(block))

    status, doc = run_cli_json("verify", store_url)
    assert status == 1
    assert doc["ok"] is False
    assert [(p["kind"], p["id"]) for p in doc["problems"]] == [("missing", block)]  # type: ignore[union-attr]
    outcome = run_cli("verify", store_url)
    assert outcome.status == 1
    assert "1 problem(s)" in outcome.out
    assert block in outcome.out

    store.backend.delete(block_key(tensor_id))  # now a reachable manifest is gone too
    status, doc = run_cli_json("gc", store_url, "--grace", "0s")
    assert status == 1
    assert doc["ok"] is False
    assert doc["type"] == "IntegrityError"


def test_errors_exit_codes(tmp_path: Path) -> None:
    missing = str(tmp_path / "nowhere")
    for command in ["ls", "verify", "gc"]:
        status, doc = run_cli_json(command, missing)
        assert status == 2  # a path that names no store is a usage error
        assert doc["type"] == "NotFoundError"
        assert f"no gradpipe store at '{missing}'" in str(doc["error"])  # escaped, quoted
        assert f"gradpipe init '{missing}'" in str(doc["error"])
    assert not Path(missing).exists()

    status, doc = run_cli_json("init", "ftp://host/x")
    assert status == 2
    assert doc["type"] == "InvalidInputError"

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "file.txt").write_text("mine")
    outcome = run_cli("init", str(foreign))
    assert outcome.status == 2
    assert outcome.out == ""
    assert "gradpipe init: error:" in outcome.err
    assert "not a gradpipe store" in outcome.err
    assert [p.name for p in foreign.iterdir()] == ["file.txt"]

    gp.open_store(tmp_path / "s", mode="w")
    status, doc = run_cli_json("gc", str(tmp_path / "s"), "--grace", "soon")
    assert status == 2
    assert "duration" in str(doc["error"])
    status, doc = run_cli_json("ls", str(tmp_path / "s"), "-S", "novalue")
    assert status == 2


@pytest.mark.parametrize("command", ["ls", "verify", "gc"])
def test_commands_never_create_a_store(command: str, store_url: str) -> None:
    """`gradpipe gc nostore` (a typo) used to create an empty store and exit 0."""
    outcome = run_cli(command, store_url)
    assert outcome.status == 2
    assert outcome.out == ""
    assert outcome.err.startswith(f"gradpipe {command}: error: no gradpipe store at '{store_url}'")
    assert "gradpipe init" in outcome.err
    with pytest.raises(gp.NotFoundError):
        gp.open_store(store_url, mode="r")  # still nothing there
    assert run_cli("init", store_url).status == 0  # init is the command that creates
    assert run_cli(command, store_url).status == 0


def test_gc_grace_is_respected(tmp_path: Path) -> None:
    store = gp.open_store(tmp_path / "s", mode="w")
    store.put_tensor(np.arange(10, dtype="int8") + 1)
    time.sleep(0.05)
    status, doc = run_cli_json("gc", str(tmp_path / "s"), "--grace", "1h")
    assert (status, doc["deleted"], doc["kept_young"]) == (0, 0, 2)
    status, doc = run_cli_json("gc", str(tmp_path / "s"), "--grace", "10ms")
    assert (status, doc["deleted"], doc["kept_young"]) == (0, 2, 0)


def test_ls_store_summarises_runs(tmp_path: Path) -> None:
    sample = write_sample_run(tmp_path / "d", TrainingConfig(steps=3, peers=2))
    store = gp.open_store(tmp_path / "store", mode="w")
    assert gp.ingest(store, sample.dump_pattern, run="r1").ok
    store.refs.set("tags/best", store.refs.get("runs/r1"))
    status, doc = run_cli_json("ls", str(tmp_path / "store"))
    assert status == 0
    rows = {r["ref"]: r for r in doc["refs"]}  # type: ignore[attr-defined]
    assert (rows["runs/r1"]["steps"], rows["runs/r1"]["peers"], rows["runs/r1"]["dumps"]) == (
        3,
        2,
        6,
    )
    assert "steps" not in rows["tags/best"]  # only run refs are described
    outcome = run_cli("ls", str(tmp_path / "store"))
    assert outcome.status == 0
    assert "3 steps x 2 peers" in outcome.out


# --- the texts are the reports' own ---------------------------------------------------
def test_verify_and_gc_tell_about_unreferenced_blocks(store_url: str) -> None:
    """An unnamed put_tensor is unreferenced: verify and gc --dry-run say so, as the README does.

    The commands used to build their own text, which said "all good" and nothing
    about the blocks verify had not checked, nor gc --dry-run about unreferenced ones.
    """
    store = gp.open_store(store_url, mode="w")
    named = store.put_tensor(np.arange(30, dtype="float32"), name="kept")
    store.put_tensor(np.arange(40, dtype="float32"))  # a manifest and a data block, no ref

    status, doc = run_cli_json("verify", store_url)
    assert (status, doc["ok"], doc["unreferenced"], doc["unchecked"]) == (0, True, 2, 2)
    assert doc["store"] == store_url
    outcome = run_cli("verify", store_url)
    assert outcome.status == 0
    assert outcome.out.strip() == gp.verify(store).summary()
    assert "2 unreferenced block(s) not checked" in outcome.out
    assert "--all checks them too" in outcome.out
    status, doc = run_cli_json("verify", store_url, "--all")
    assert (status, doc["unreferenced"], doc["unchecked"]) == (0, 2, 0)
    assert "not checked" not in run_cli("verify", store_url, "--all").out

    status, doc = run_cli_json("gc", store_url, "--dry-run")  # default grace: all are young
    assert (status, doc["ok"], doc["dry_run"], doc["unreferenced"]) == (0, True, True, 2)
    assert (doc["deleted"], doc["kept_young"]) == (0, 2)
    outcome = run_cli("gc", store_url, "--dry-run")
    assert outcome.status == 0
    assert outcome.out.strip() == gp.gc(store, dry_run=True).summary()
    assert "2 block(s) are unreferenced" in outcome.out
    assert "would delete 0 unreferenced block(s)" in outcome.out

    status, doc = run_cli_json("gc", store_url, "--grace", "0s")
    assert (status, doc["unreferenced"], doc["deleted"]) == (0, 2, 2)
    status, doc = run_cli_json("verify", store_url)
    assert (status, doc["unreferenced"], doc["unchecked"]) == (0, 0, 0)
    assert store.get_tensor(store.refs.get("tensors/kept")).tolist() == list(range(30))
    assert store.refs.get("tensors/kept") == named


def test_gc_wait_gives_up_on_a_live_writer(store_url: str) -> None:
    """`gc --wait 0.2s` facing a writer's lease gives up with one line, exit 1."""
    gp.open_store(store_url, mode="w")
    writer = gp.open_store(store_url, mode="a")  # another Store object: another job
    with writer.writing("test"):
        outcome = run_cli("gc", store_url, "--wait", "0.2s", "--grace", "0s")
        assert outcome.status == 1
        message = outcome.error_message("gc")
        assert "in use by 1 job(s)" in message
        assert "(test by " in message  # names the writer's purpose
        assert "gc --wait" in message
        assert outcome.out == ""
        status, doc = run_cli_json("gc", store_url, "--wait", "0s")
        assert (status, doc["type"]) == (1, "LockedError")
    status, doc = run_cli_json("gc", store_url, "--wait", "0.2s")  # the writer is gone
    assert (status, doc["ok"]) == (0, True)


def test_gc_wait_is_a_duration(store_url: str) -> None:
    gp.open_store(store_url, mode="w")
    status, doc = run_cli_json("gc", store_url, "--wait", "soon")
    assert status == 2
    assert "'soon' is not a duration" in str(doc["error"])
    outcome = run_cli("gc", "--help")
    assert "--wait DURATION" in outcome.out
    assert "gradpipe.lock.wait" in outcome.out


def test_verify_delete_corrupt(tmp_path: Path) -> None:
    url = str(tmp_path / "s")
    store = gp.open_store(url, mode="w")
    tensor_id = store.put_tensor(np.arange(5000, dtype="float32"), name="t")
    [block] = [b for b in store.tensor_info(tensor_id).blocks if b is not None]
    path = tmp_path / "s" / block_key(block)
    frame = bytearray(path.read_bytes())
    frame[-1] ^= 0x01
    path.write_bytes(bytes(frame))
    status, doc = run_cli_json("verify", url)
    assert (status, doc["deleted_corrupt"]) == (1, [])
    assert "--delete-corrupt" in run_cli("verify", url).out
    status, doc = run_cli_json("verify", url, "--delete-corrupt")
    assert (status, doc["deleted_corrupt"]) == (1, [block])
    assert not path.exists()
    status, doc = run_cli_json("verify", url)
    assert [p["kind"] for p in doc["problems"]] == ["missing"]
