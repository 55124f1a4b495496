"""``gradpipe ingest`` (and ``ls RUN`` of what it ingested): output, exit codes, --json, --codec."""

from __future__ import annotations

import json
import struct
import types
from pathlib import Path

import pytest

import gradpipe as gp
from gradpipe.cli.testing import run_cli, run_cli_json
from gradpipe.core.ids import block_key
from gradpipe.formats.safetensors import read_safetensors
from gradpipe.runs import open_run
from gradpipe.storage.tensors import chunk_frames
from gradpipe.testing.training import SampleRun


def test_ingest_ls_export(sample: SampleRun, kit: types.ModuleType, tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    outcome = run_cli("ingest", store, sample.dump_pattern, "--run", "train")
    assert outcome.status == 0
    assert "run 'train': 9 dumps ingested, 0 skipped" in outcome.out

    status, doc = run_cli_json("ingest", store, sample.dump_pattern, "--run", "train")
    assert status == 0
    assert (doc["ok"], doc["ingested"], doc["skipped"], doc["blocks_written"]) == (True, 0, 9, 0)
    assert doc["run_id"] == open_run(gp.open_store(store), "train").id

    outcome = run_cli("ls", store, "train")
    assert outcome.status == 0
    lines = outcome.out.splitlines()
    assert lines[0].startswith("run 'train': 3 steps x 3 peers, 9 dumps, 7 tensors")
    assert lines[1].split() == ["step", *sample.peers]
    assert [line.split() for line in lines[2:]] == [[str(s), "x", "x", "x"] for s in sample.steps]

    status, doc = run_cli_json("ls", store, "train")
    assert status == 0
    assert doc["steps"] == sample.steps
    assert doc["peers"] == sample.peers
    assert [(d["step"], d["peer"]) for d in doc["dumps"]] == [
        (s, p) for s in sample.steps for p in sample.peers
    ]
    assert doc["schema"]["embedding.weight"] == {"dtype": "float32", "shape": [3000, 8]}

    status, doc = run_cli_json("ls", store)
    assert status == 0
    assert [r["ref"] for r in doc["refs"]] == ["runs/train"]

    out_file = tmp_path / "out.safetensors"
    outcome = run_cli(
        "export", store, "--run", "train", "--step", "1", "--peer", "peer2", "-o", str(out_file)
    )
    assert outcome.status == 0
    assert "wrote 7 tensors of step 1, peer 'peer2'" in outcome.out
    src = sample.dump_path(1, "peer2")
    tensors, meta = read_safetensors(out_file)
    want, want_meta = read_safetensors(src)
    assert meta == want_meta
    assert meta["num_examples"] == "128"
    assert sorted(tensors) == sorted(want)
    for name, arr in want.items():
        kit.assert_bit_exact(tensors[name], arr, name)
    # Same writer, same layout: the export is the very file that was ingested.
    assert out_file.read_bytes() == Path(src).read_bytes()


def test_ls_unknown_run_exits_1(tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    assert run_cli("init", store).status == 0
    status, doc = run_cli_json("ls", store, "nope")
    assert status == 1
    assert "no run 'nope'" in doc["error"]


def block_codecs(frame: bytes) -> list[dict]:
    """The codec chain recorded in a block's header."""
    _, _, header_len = struct.unpack_from("<4sBI", frame)
    start = struct.calcsize("<4sBI")
    return json.loads(frame[start : start + header_len])["codecs"]


def test_codec_option(sample: SampleRun, kit: types.ModuleType, tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    status, doc = run_cli_json(
        "ingest", url, sample.dump_pattern, "--run", "z", "--codec", "zstd:level=3"
    )
    assert status == 0
    assert doc["ingested"] == 9
    store = gp.open_store(url)
    dump = open_run(store, "z").dump(2, "peer0")
    want, _ = read_safetensors(sample.dump_path(2, "peer0"))
    frames = [f for name in dump.names for f in chunk_frames(store, dump.info(name)) if f]
    assert frames
    for frame in frames:
        [codec] = block_codecs(frame)
        assert (codec["id"], codec["level"]) == ("zstd", 3)
    for name, arr in want.items():
        kit.assert_bit_exact(dump.read(name), arr, name)


@pytest.mark.parametrize("spec", ["nonsense", "zstd:level", "zstd:levle=3"])
def test_bad_codec_exits_2(spec: str, sample: SampleRun, tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    status, doc = run_cli_json("ingest", url, sample.dump_pattern, "--run", "z", "--codec", spec)
    assert status == 2
    assert doc["ok"] is False
    assert spec in doc["error"]
    assert not (tmp_path / "store" / "refs" / "runs").exists()


def test_repair_after_verify_finds_a_missing_block(sample: SampleRun, tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    assert run_cli("ingest", store, sample.dump_pattern, "--run", "train").status == 0
    opened = gp.open_store(store)
    dump = open_run(opened, "train").dump(sample.steps[0], sample.peers[0])
    block = next(iter(dump.info("embedding.weight").data_children()))
    opened.backend.delete(block_key(block))
    status, doc = run_cli_json("verify", store)
    assert status == 1
    assert doc["ok"] is False

    status, doc = run_cli_json("ingest", store, sample.dump_pattern, "--run", "train")
    assert (status, doc["repaired"], doc["skipped"]) == (0, 0, 9)  # not checked without --repair
    status, doc = run_cli_json("ingest", store, sample.dump_pattern, "--run", "train", "--repair")
    assert status == 0
    assert doc["repaired"] >= 1
    assert doc["repaired"] + doc["skipped"] == 9
    status, doc = run_cli_json("verify", store)
    assert (status, doc["ok"]) == (0, True)


def test_delta_ingest_reports_chains_and_ls_shows_depth(
    sample: SampleRun, kit: types.ModuleType, tmp_path: Path
) -> None:
    import dask.config

    store = str(tmp_path / "store")
    # Chunks of 8 KiB, none inline: the sample's tensors are small.
    with dask.config.set({"gradpipe.chunk-bytes": 8192, "gradpipe.inline-bytes": 0}):
        status, doc = run_cli_json(
            "ingest", store, sample.dump_pattern, "--run", "train", "--delta",
            "--keyframe-interval", "2",
        )  # fmt: skip
    assert status == 0
    chains = doc["chains"]
    assert chains["tensors"] == 9 * 7
    assert chains["chained_tensors"] == 6 * 7  # steps 1 and 2 of 3 peers
    assert chains["delta_chunks"] + chains["full_chunks"] > 0
    assert chains["max_depth"] <= 1  # K = 2
    assert chains["saved_bytes"] == chains["full_bytes"] - chains["stored_bytes"]

    outcome = run_cli("ls", store, "train", "--depth")
    assert outcome.status == 0
    rows = [line.split() for line in outcome.out.splitlines()[2:]]
    depths = {
        (int(row[0]), peer): int(mark)
        for row in rows
        for peer, mark in zip(sample.peers, row[1:], strict=True)
    }
    assert set(depths) == {(s, p) for s in sample.steps for p in sample.peers}
    assert all(depths[0, p] == 0 for p in sample.peers)
    assert max(depths.values()) <= 1
    status, listing = run_cli_json("ls", store, "train", "--depth")
    assert status == 0
    assert {(d["step"], d["peer"]): d["depth"] for d in listing["dumps"]} == depths

    for step in sample.steps:
        for peer in sample.peers:
            out_file = tmp_path / f"out-{step}-{peer}.safetensors"
            args = ("--run", "train", "--step", str(step), "--peer", peer, "-o", str(out_file))
            assert run_cli("export", store, *args).status == 0
            kit.assert_all_bit_exact(
                read_safetensors(out_file)[0], read_safetensors(sample.dump_path(step, peer))[0]
            )


def test_delta_summary_says_when_deltas_do_not_pay(sample: SampleRun, tmp_path: Path) -> None:
    outcome = run_cli(
        "ingest", str(tmp_path / "store"), sample.dump_pattern, "--run", "t", "--delta"
    )
    assert outcome.status == 0
    assert "delta chains:" in outcome.out
    assert "did not pay" in outcome.out  # gradients of consecutive steps


@pytest.mark.parametrize(
    "extra",
    [
        ["--delta-kind", "xor"],
        ["--keyframe-interval", "4"],
        ["--delta", "--codec", "zstd"],
        ["--delta", "--delta-kind", "sparse"],
        ["--delta", "--keyframe-interval", "0"],
    ],
)
def test_bad_delta_options_exit_2(extra: list[str], sample: SampleRun, tmp_path: Path) -> None:
    store = tmp_path / "store"
    outcome = run_cli("ingest", str(store), sample.dump_pattern, "--run", "t", *extra)
    assert outcome.status == 2
    assert not store.exists()  # refused before the store was opened


def test_delta_flags_in_help_match_the_library() -> None:
    from gradpipe.cli import ingest as cli_ingest
    from gradpipe.core.chain import DEFAULT_KEYFRAME_INTERVAL
    from gradpipe.ingestion.api import DELTA_KINDS

    assert cli_ingest.DELTA_KINDS == DELTA_KINDS
    assert cli_ingest.DEFAULT_KEYFRAME_INTERVAL == DEFAULT_KEYFRAME_INTERVAL
    outcome = run_cli("ingest", "--help")
    assert outcome.status == 0
    text = " ".join(outcome.out.split())
    for flag in ("--delta ", "--delta-kind {int,xor}", "--keyframe-interval K"):
        assert flag in text
    assert f"(default: {DEFAULT_KEYFRAME_INTERVAL})" in text


def test_ls_depth_needs_a_run(ingested: str) -> None:
    assert run_cli("ls", ingested, "--depth").status == 2
