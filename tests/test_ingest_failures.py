"""Bad dumps never stop good ones; bad patterns fail before anything is written."""

from __future__ import annotations

import json
import pathlib
import types
from pathlib import Path

import numpy as np
import pytest

import gradpipe as gp
from gradpipe.cli import main
from gradpipe.errors import InvalidInputError, NotFoundError
from gradpipe.ingestion.api import ingest
from gradpipe.runs import open_run

PATTERN = "step={step}/peer={peer}.safetensors"


def good(step: int, peer: str) -> dict[str, np.ndarray]:
    seed = 10 * step + ord(peer[0])
    return {
        "w": np.random.default_rng(seed).standard_normal(8).astype("<f4"),
        "b": np.arange(3, dtype="<i8") + seed,
    }


class BadBatch:
    """A directory of safetensors dumps: good ones and one of every kind of bad one."""

    def __init__(self, kit: types.ModuleType, root: Path) -> None:
        self.root = root
        self.good: dict[tuple[int, str], dict[str, np.ndarray]] = {}
        self.bad: dict[tuple[int, str], tuple[str, list[str]]] = {}  # -> path, reason parts
        for step, peer in [(0, "a"), (0, "b"), (1, "a"), (2, "a"), (3, "c")]:
            self.good[step, peer] = good(step, peer)
            self.write(step, peer, kit.safetensors_bytes(good(step, peer), {"num_examples": "8"}))
        # NaN and Inf (with payloads) in a good dump: counted and stored bit-exact.
        self.good[0, "b"]["w"] = kit.special_f32((8,), 3)
        self.write(0, "b", kit.safetensors_bytes(self.good[0, "b"], {}))

        data = kit.safetensors_bytes(good(1, "b"), {})
        path = self.write(1, "b", data[:-5])
        self.bad[1, "b"] = (path, ["not a valid safetensors file", "ends at byte"])

        npz = kit.npz_bytes(good(1, "c"), compressed=False)
        path = self.write(1, "c", npz)  # an npz named .safetensors
        self.bad[1, "c"] = (path, ["not a valid safetensors file", "header length"])

        path = self.path(2, "b")
        Path(path).symlink_to(root / "nowhere.safetensors")  # dangling: unreadable
        self.bad[2, "b"] = (path, ["No such file"])

        path = self.path(2, "c")
        Path(path).mkdir()  # a directory named like a dump
        (Path(path) / "part0").write_bytes(b"x")
        self.bad[2, "c"] = (path, ["directory"])

        shape = good(3, "a")
        shape["w"] = np.zeros(5, dtype="<f4")
        path = self.write(3, "a", kit.safetensors_bytes(shape, {}))
        self.bad[3, "a"] = (
            path,
            ["tensor 'w'", "step 3", "peer 'a'", "float32 (5,)", "float32 (8,)"],
        )
        dtype = good(3, "b")
        dtype["b"] = dtype["b"].astype("<f8")
        path = self.write(3, "b", kit.safetensors_bytes(dtype, {}))
        self.bad[3, "b"] = (
            path,
            ["tensor 'b'", "step 3", "peer 'b'", "float64 (3,)", "int64 (3,)"],
        )

    @property
    def pattern(self) -> str:
        return str(self.root / PATTERN)

    def path(self, step: int, peer: str) -> str:
        path = self.root / PATTERN.format(step=step, peer=peer)
        path.parent.mkdir(parents=True, exist_ok=True)
        return str(path)

    def write(self, step: int, peer: str, data: bytes) -> str:
        path = self.path(step, peer)
        Path(path).write_bytes(data)
        return path


def check_failures(batch: BadBatch, failures: list[dict[str, object]]) -> None:
    assert len(failures) == len(batch.bad)
    by_key = {(f["step"], f["peer"]): f for f in failures}
    assert set(by_key) == set(batch.bad)
    for key, (path, parts) in batch.bad.items():
        failure = by_key[key]
        assert failure["path"] == path
        reason = str(failure["reason"])
        assert path in reason
        for part in parts:
            assert part.lower() in reason.lower(), (key, part, reason)


def test_bad_dumps_are_isolated(kit: types.ModuleType, tmp_path: Path) -> None:
    batch = BadBatch(kit, tmp_path / "dumps")
    store = gp.open_store(str(tmp_path / "store"), mode="w")
    report = ingest(store, batch.pattern, run="r")
    assert not report.ok
    assert report.ingested == len(batch.good)
    check_failures(batch, [f.to_dict() for f in report.failures])
    for f in report.failures:
        assert f"FAILED step {f.step} peer {f.peer!r}" in report.summary()

    run = open_run(store, "r")
    assert run.id == report.run_id
    assert run.grid() == {0: ["a", "b"], 1: ["a"], 2: ["a"], 3: ["c"]}
    for (step, peer), tensors in batch.good.items():
        dump = run.dump(step, peer)
        got = dump.read_all()
        assert sorted(got) == sorted(tensors)
        for name, want in tensors.items():
            kit.assert_bit_exact(got[name], want, f"{step} {peer} {name}")
    with pytest.raises(NotFoundError):
        run.dump(1, "b")

    # NaN and Inf are reported, per tensor, and stored bit-exact (payloads kept).
    assert len(report.nonfinite) == 1
    [warning] = report.nonfinite
    assert "tensor 'w' of step 0, peer 'b'" in warning
    assert "3 NaN and 2 Inf" in warning
    stored = run.dump(0, "b").read("w")
    assert stored.view("<u4")[:5].tolist() == kit.SPECIAL_F32[:5].tolist()


def test_cli_lists_failures_and_exits_1(
    kit: types.ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    batch = BadBatch(kit, tmp_path / "dumps")
    store = str(tmp_path / "store")
    capsys.readouterr()
    status = main(["ingest", store, batch.pattern, "--run", "r", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert status == 1
    assert doc["ok"] is False
    assert doc["ingested"] == len(batch.good)
    assert doc["failed"] == len(batch.bad)
    check_failures(batch, doc["failures"])
    assert len(doc["nonfinite"]) == 1
    # Text output lists the failures too, with the same exit status.
    status = main(["ingest", store, batch.pattern, "--run", "r2"])
    out = capsys.readouterr().out
    assert status == 1
    for step, peer in batch.bad:
        assert f"FAILED step {step} peer {peer!r}" in out


# --- torch files that would need unpickling ---------------------------------------------
class Payload:
    """Unpickling this creates a marker file: what a malicious checkpoint would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, ...]:
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def test_torch_files_are_never_unpickled(kit: types.ModuleType, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    root = tmp_path / "dumps"
    marker = tmp_path / "pwned"
    files = {
        "good": {"w": torch.ones(3), "step": 1},
        "evil": {"w": torch.ones(3), "extra": Payload(marker)},
        "evil2": Payload(marker),
    }
    paths = {}
    for peer, obj in files.items():
        path = root / "step=1" / f"peer={peer}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(kit.torch_bytes(obj))
        paths[peer] = str(path)
    garbage = root / "step=1" / "peer=garbage.pt"
    garbage.write_bytes(b"PK\x03\x04 this is not a torch zip" * 10)
    paths["garbage"] = str(garbage)

    store = gp.open_store(str(tmp_path / "store"), mode="w")
    report = ingest(store, str(root / "step={step}/peer={peer}.pt"), run="r")
    assert not marker.exists()
    assert report.ingested == 1
    assert {f.peer: f.path for f in report.failures} == {
        p: paths[p] for p in ["evil", "evil2", "garbage"]
    }
    reasons = {f.peer: f.reason for f in report.failures}
    assert "refused for safety" in reasons["evil"]
    assert "refused for safety" in reasons["evil2"]
    assert "not a readable PyTorch file" in reasons["garbage"]
    dump = open_run(store, "r").dump(1, "good")
    assert dump.metadata == {"step": "1"}
    kit.assert_bit_exact(dump.read("w"), np.ones(3, dtype="<f4"))
    # The payload is live: unrestricted unpickling would have run it.
    torch.load(paths["evil2"], weights_only=False)
    assert marker.exists()


# --- patterns ---------------------------------------------------------------------------
def write_dumps(kit: types.ModuleType, root: Path, names: list[str]) -> None:
    for name in names:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(kit.safetensors_bytes(good(0, "a"), {}))


@pytest.mark.parametrize(
    ("files", "pattern", "words"),
    [
        (["peer=a.safetensors"], "peer={peer}.safetensors", ["no {step} field"]),
        (["x/step=1.safetensors"], "*/step={step}.safetensors", ["wildcards"]),
        (["step=1/peer=a.safetensors"], "step={step}/peer={rank}.safetensors", ["field"]),
    ],
    ids=["no-step", "wildcard", "unknown-field"],
)
def test_bad_patterns(
    files: list[str],
    pattern: str,
    words: list[str],
    kit: types.ModuleType,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    write_dumps(kit, tmp_path / "d", files)
    store = gp.open_store(str(tmp_path / "store"), mode="w")
    with pytest.raises(InvalidInputError) as info:
        ingest(store, str(tmp_path / "d" / pattern), run="r")
    for word in words:
        assert word in str(info.value)
    assert store.refs.list("runs") == {}
    capsys.readouterr()
    status = main(["ingest", str(tmp_path / "store"), str(tmp_path / "d" / pattern), "--run", "r"])
    assert status == 2
    err = capsys.readouterr().err
    assert words[0] in err


@pytest.mark.parametrize(
    ("files", "words"),
    [
        (["step=1/peer=a.safetensors", "step=01/peer=a.safetensors"], ["all claim"]),
        (["step=1/peer=a b.safetensors"], ["invalid peer name", "'a b'"]),
        (["step=1/peer=-x.safetensors"], ["invalid peer name"]),
    ],
    ids=["same-step-peer", "peer-space", "peer-dash"],
)
def test_bad_file_names_fail_alone(
    files: list[str],
    words: list[str],
    kit: types.ModuleType,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A file whose name cannot be a (step, peer) is a failed input, not a stopped batch."""
    write_dumps(kit, tmp_path / "d", [*files, "step=2/peer=good.safetensors"])
    store = gp.open_store(str(tmp_path / "store"), mode="w")
    report = ingest(store, str(tmp_path / "d" / PATTERN), run="r")
    assert not report.ok
    assert report.ingested == 1
    assert len(report.failures) == len(files)
    for failure in report.failures:
        for word in words:
            assert word in failure.reason
    assert [(e.step, e.peer) for e in open_run(store, "r")] == [(2, "good")]
    capsys.readouterr()
    status = main(["ingest", str(tmp_path / "store2"), str(tmp_path / "d" / PATTERN), "--run", "r"])
    assert status == 1


def test_nothing_matches(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "d" / "step=1").mkdir(parents=True)
    (tmp_path / "d" / "step=1" / "peer=a.npz").write_bytes(b"")  # another extension
    store = gp.open_store(str(tmp_path / "store"), mode="w")
    pattern = str(tmp_path / "d" / PATTERN)
    with pytest.raises(NotFoundError, match="no dump file matches"):
        ingest(store, pattern, run="r")
    assert store.refs.list("runs") == {}
    capsys.readouterr()
    status = main(["ingest", str(tmp_path / "store"), pattern, "--run", "r", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert status == 1
    assert doc["ok"] is False
    assert doc["type"] == "NotFoundError"


@pytest.mark.parametrize(
    "argv",
    [
        ["ingest"],
        ["ingest", "STORE"],
        ["ingest", "STORE", "PATTERN"],  # --run is required
        ["ingest", "STORE", "PATTERN", "--run", "r", "--workers", "many"],
    ],
)
def test_cli_usage_errors_exit_2(argv: list[str], tmp_path: Path) -> None:
    argv = [str(tmp_path / "store") if a == "STORE" else a for a in argv]
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2


def test_cli_bad_run_name_exits_2(
    kit: types.ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_dumps(kit, tmp_path / "d", ["step=1/peer=a.safetensors"])
    store = str(tmp_path / "store")
    status = main(["ingest", store, str(tmp_path / "d" / PATTERN), "--run", "../up"])
    assert status == 2
    assert "invalid run name" in capsys.readouterr().err
    assert not (tmp_path / "up").exists()
