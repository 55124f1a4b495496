"""``gradpipe evaluate``: the table, the JSON fields, exit statuses of bad input."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from gradpipe.cli.testing import run_cli
from gradpipe.core.codec_names import DEFAULT_CANDIDATES as DEFAULT_CODECS

FIGURES = (
    "ratio",
    "bits_per_value",
    "encode_mib_s",
    "decode_mib_s",
    "bit_exact",
    "max_abs_error",
    "rel_l2_error",
    "cosine",
    "norm_ratio",
    "sign_agreement",
    "bound",
    "bound_used",
    "bound_held",
)


def test_the_table_has_a_row_per_default_codec(ingested: str) -> None:
    outcome = run_cli("evaluate", ingested, "--run", "train", "--sample", "12")
    assert outcome.status == 0, outcome.err
    lines = outcome.out.splitlines()
    assert lines[0].startswith("run 'train': 12 sampled chunks (seed 0)")
    header = next(line for line in lines if line.startswith("codec"))
    for column in ("ratio", "bits/val", "enc MiB/s", "dec MiB/s", "rel L2", "cosine", "held"):
        assert column in header
    rows = {
        line.split()[0]: line for line in lines if line.split()[:1] in ([n] for n in DEFAULT_CODECS)
    }
    assert list(rows) == list(DEFAULT_CODECS)
    assert rows["default"].split()[6] == "yes"  # bit-exact
    assert "projection-0.1: does not reconstruct the vector" in outcome.out
    assert "topk-0.01: error feedback over up to 3 consecutive steps" in outcome.out


def test_json_holds_every_figure_of_every_codec(ingested: str) -> None:
    argv = ["evaluate", ingested, "--run", "train", "--json", "--sample", "9", "--seed", "4"]
    outcome = run_cli(*argv, "--codecs", "default,fp16,topk-0.1,projection-0.2")
    assert outcome.status == 0, outcome.err
    doc = outcome.doc
    assert (doc["ok"], doc["run"], doc["seed"], doc["store"]) == (True, "train", 4, ingested)
    assert len(doc["sample"]) == 9
    assert set(doc["sample"][0]) == {"step", "peer", "tensor", "chunk"}
    codecs = {c["name"]: c for c in doc["codecs"]}
    assert list(codecs) == ["default", "fp16", "topk-0.1", "projection-0.2"]
    for codec in codecs.values():
        assert set(FIGURES) <= set(codec), codec["name"]
        assert codec["chunks"] + sum(codec["skipped"].values()) == 9
    assert codecs["default"]["bit_exact"] is True
    assert codecs["fp16"]["overflows"] == 0
    assert codecs["fp16"]["bound"]["relative"] == 2.0**-11
    assert codecs["topk-0.1"]["feedback"]["with_feedback"]["rel_l2_error"] >= 0
    projection = codecs["projection-0.2"]
    assert projection["reconstructs"] is False
    assert projection["rel_l2_error"] is None
    assert projection["sketch"]["norm_epsilon_max"] > 0
    again = run_cli(*argv, "--codecs", "default,fp16,topk-0.1,projection-0.2").doc
    for doc_ in (doc, again):
        for codec in doc_["codecs"]:
            del codec["encode_mib_s"], codec["decode_mib_s"]
    assert again == doc


def test_bad_input_exits_2_with_one_line(ingested: str) -> None:
    for argv, words in [
        (["--codecs", "nope"], "unknown codec 'nope'; codecs are default, zstd, blosc"),
        (["--codecs", "topk-2"], "top-k fraction must be a number in (0, 1], not 2.0"),
        (["--codecs", "bf16+qsgd-4"], "a lossy codec must come first"),
        (["--sample", "0"], "--sample: expected a positive whole number"),
        (["--feedback-steps", "0"], "--feedback-steps: expected a positive whole number"),
    ]:
        outcome = run_cli("evaluate", ingested, "--run", "train", *argv)
        assert outcome.status == 2, argv
        assert words in outcome.error_message("evaluate")
    as_json = run_cli("evaluate", ingested, "--run", "train", "--codecs", "x", "--json")
    assert as_json.status == 2
    assert as_json.doc["ok"] is False
    assert "unknown codec 'x'" in as_json.doc["error"]


def test_a_run_without_values_or_without_a_name(ingested: str, tmp_path: Path) -> None:
    missing = run_cli("evaluate", ingested, "--run", "nope")
    assert missing.status == 1
    assert "no run 'nope'" in missing.error_message("evaluate")
    np.savez(tmp_path / "step=0.npz", g=np.zeros(0, dtype=np.float32))
    store = str(tmp_path / "store")
    assert run_cli("ingest", store, str(tmp_path / "step={step}.npz"), "--run", "e").status == 0
    empty = run_cli("evaluate", store, "--run", "e")
    assert empty.status == 2
    assert "run 'e'" in empty.error_message("evaluate")
    assert "stores no values" in empty.error_message("evaluate")
