"""``gradpipe snapshot``, ``restore``, ``log`` and ``prune`` on state files of every kind."""

from __future__ import annotations

from pathlib import Path

import dask.config
import numpy as np
import pytest
from safetensors.numpy import save_file

import gradpipe as gp
from gradpipe.cli.testing import run_cli, run_cli_json
from gradpipe.formats.state_file import read_state_file

SMALL = {"gradpipe.chunk-bytes": 4096, "gradpipe.inline-bytes": 0}


def _weights(steps: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 256)).astype("float32")
    out = []
    for _ in range(steps):
        out.append({"layer.0.weight": w.copy(), "layer.0.bias": np.arange(4, dtype="float32")})
        w = w + (rng.standard_normal(w.shape) * 1e-4).astype("float32")
    return out


def test_safetensors_round_trip_byte_for_byte_and_log(tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    gp.open_store(store, mode="w")  # snapshot never creates a store: init does
    files = []
    with dask.config.set(SMALL):
        for step, tensors in enumerate(_weights(4)):
            path = tmp_path / f"s{step}.safetensors"
            save_file(tensors, str(path), metadata={"format": "pt", "z": "last", "a": "1"})
            files.append(path)
            status, doc = run_cli_json(
                "snapshot", store, "ckpt", str(path), "--step", str(step * 100),
                "--loss", str(1.5 - step), "--meta", "host=n1",
            )  # fmt: skip
            assert status == 0, doc
            assert doc["step"] == step * 100
            assert doc["depth"] == min(step, 1)  # every delta is against its keyframe
    status, doc = run_cli_json("log", store, "ckpt")
    assert status == 0
    rows = doc["snapshots"]
    assert [r["step"] for r in rows] == [0, 100, 200, 300]
    assert [r["loss"] for r in rows] == [1.5, 0.5, -0.5, -1.5]
    assert rows[0]["ratio"] == 1.0
    assert all(r["ratio"] < 0.9 for r in rows[1:])
    assert rows[2]["metadata"]["host"] == "n1"
    text = run_cli("log", store, "ckpt").out
    assert "4 snapshot(s)" in text
    assert rows[3]["id"][:16] in text
    for step, path in enumerate(files):
        out = tmp_path / f"back{step}.safetensors"
        status, doc = run_cli_json(
            "restore", store, "ckpt", "--step", str(step * 100), "-o", str(out)
        )
        assert status == 0, doc
        assert out.read_bytes() == path.read_bytes()  # names, order, metadata: the same file
    newest = tmp_path / "newest.safetensors"
    assert run_cli("restore", store, "ckpt", "-o", str(newest)).status == 0
    assert newest.read_bytes() == files[-1].read_bytes()


def test_torch_checkpoint_round_trip(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 3}, path)
    store = str(tmp_path / "store")
    gp.open_store(store, mode="w")  # snapshot never creates a store: init does
    assert run_cli("snapshot", store, "t", str(path), "--step", "1").status == 0
    out = tmp_path / "back.pt"
    assert run_cli("restore", store, "t", "-o", str(out)).status == 0
    want, _ = read_state_file(path)
    got, info = read_state_file(out)
    assert info.kind == "torch"
    assert got["epoch"] == 3
    assert list(got["optimizer"]["state"]) == [0, 1, 2, 3]  # int keys stay ints
    assert got["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.999)
    for key, value in want["model"].items():
        assert got["model"][key].tobytes() == value.tobytes()
    fresh = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16))
    fresh.load_state_dict(torch.load(out, weights_only=True)["model"])


def test_npz_and_python_made_snapshots(tmp_path: Path) -> None:
    store_path = tmp_path / "store"
    gp.open_store(str(store_path), mode="w")
    tensors = _weights(1)[0]
    npz = tmp_path / "w.npz"
    np.savez(npz, **tensors)
    assert run_cli("snapshot", str(store_path), "n", str(npz), "--step", "0").status == 0
    out = tmp_path / "w-back.npz"
    assert run_cli("restore", str(store_path), "n", "-o", str(out)).status == 0
    back = np.load(out)
    assert sorted(back.files) == sorted(tensors)
    # The output must be the kind the snapshot came from.
    status, doc = run_cli_json(
        "restore", str(store_path), "n", "-o", str(tmp_path / "w.safetensors")
    )
    assert status == 2
    assert "npz file" in doc["error"]
    # A snapshot made in Python: the output's extension chooses the kind.
    store = gp.open_store(store_path, mode="a")
    gp.snapshot(store, "py", tensors, step=7)
    out = tmp_path / "py.safetensors"
    assert run_cli("restore", str(store_path), "py", "-o", str(out)).status == 0
    got, _ = read_state_file(out)
    assert all(got[k].tobytes() == v.tobytes() for k, v in tensors.items())


def test_a_snapshot_command_run_again_writes_nothing_and_says_so(tmp_path: Path) -> None:
    """Killed after its commit landed, the same command again: exit 0, no second version."""
    store = str(tmp_path / "store")
    gp.open_store(store, mode="w")  # snapshot never creates a store: init does
    weights = _weights(2)
    paths = []
    for step, tensors in enumerate(weights):
        path = tmp_path / f"s{step}.safetensors"
        save_file(tensors, str(path), metadata={"format": "pt"})
        paths.append(path)
    argv = ["snapshot", store, "ckpt", str(paths[0]), "--step", "7", "--loss", "0.5"]
    status, first = run_cli_json(*argv)
    assert status == 0, first
    assert first["written"] is True
    status, again = run_cli_json(*argv)
    assert status == 0, again
    assert again["written"] is False
    assert again["id"] == first["id"]
    assert again["step"] == 7
    text = run_cli(*argv)
    assert text.status == 0
    assert f"snapshot 'ckpt' step 7 already recorded as {first['id']}: nothing written" in text.out
    assert [v.id for v in gp.snapshot_log(gp.open_store(store), "ckpt")] == [first["id"]]
    # Another file at the same step is a new version of the step (a step taken again).
    status, other = run_cli_json("snapshot", store, "ckpt", str(paths[1]), "--step", "7")
    assert status == 0, other
    assert other["written"] is True
    assert [v.step for v in gp.snapshot_log(gp.open_store(store), "ckpt")] == [7, 7]
    out = tmp_path / "back.safetensors"
    assert run_cli("restore", store, "ckpt", "--step", "7", "-o", str(out)).status == 0
    assert out.read_bytes() == paths[1].read_bytes()


@pytest.mark.parametrize(
    ("argv", "status", "word"),
    [
        (["snapshot", "STORE", "n", "MISSING", "--step", "1"], 1, "MISSING"),
        (["snapshot", "STORE", "n", "GOOD", "--step", "-1"], 2, "step"),
        (["snapshot", "STORE", "n", "GOOD", "--step", "1", "--meta", "novalue"], 2, "KEY=VALUE"),
        (["snapshot", "STORE", "n", "BAD", "--step", "1"], 2, "BAD"),
        (["restore", "STORE", "nobody", "-o", "OUT"], 1, "no snapshot 'nobody'"),
        (["restore", "STORE", "n", "--step", "9", "-o", "OUT"], 1, "has no step 9"),
        (["log", "STORE", "nobody"], 1, "no snapshot 'nobody'"),
        (["prune", "STORE", "n", "--keep-last", "0"], 2, "keep-last"),
    ],
)
def test_errors_name_what_is_wrong(argv: list[str], status: int, word: str, tmp_path: Path) -> None:
    store = tmp_path / "store"
    gp.open_store(str(store), mode="w")
    good = tmp_path / "good.safetensors"
    save_file(_weights(1)[0], str(good))
    assert run_cli("snapshot", str(store), "n", str(good), "--step", "0").status == 0
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\xff" * 64)
    subs = {
        "STORE": str(store),
        "GOOD": str(good),
        "BAD": str(bad),
        "MISSING": str(tmp_path / "missing.safetensors"),
        "OUT": str(tmp_path / "out.safetensors"),
    }
    argv = [subs.get(a, a) for a in argv]
    got, doc = run_cli_json(*argv)
    assert got == status, doc
    assert (
        word.replace("MISSING", "missing.safetensors").replace("BAD", "bad.safetensors")
        in (doc["error"])
    )
    assert not (tmp_path / "out.safetensors").exists()
    assert [v.step for v in gp.snapshot_log(gp.open_store(store), "n")] == [0]


def test_prune_dry_run_then_prune_and_gc(tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    gp.open_store(store, mode="w")  # snapshot never creates a store: init does
    weights = _weights(6)
    with dask.config.set(SMALL):
        for step, tensors in enumerate(weights):
            path = tmp_path / f"s{step}.safetensors"
            save_file(tensors, str(path))
            assert run_cli("snapshot", store, "c", str(path), "--step", str(step)).status == 0
        status, dry = run_cli_json("prune", store, "c", "--keep-last", "2", "--dry-run")
        assert status == 0
        assert dry["dry_run"] is True
        assert dry["dropped_steps"] == [0, 1, 2, 3]
        assert dry["freed_bytes"] > 0
        assert (
            "would drop 4 version(s)"
            in run_cli("prune", store, "c", "--keep-last", "2", "--dry-run").out
        )
        status, done = run_cli_json("prune", store, "c", "--keep-last", "2")
        assert status == 0
        assert done["kept_steps"] == [4, 5]
        assert run_cli("gc", store, "--grace", "0s").status == 0
    for step in (4, 5):
        out = tmp_path / f"back{step}.safetensors"
        assert run_cli("restore", store, "c", "--step", str(step), "-o", str(out)).status == 0
        assert out.read_bytes() == (tmp_path / f"s{step}.safetensors").read_bytes()
    assert run_cli("verify", store).status == 0


def test_snapshot_and_prune_never_create_a_store(tmp_path: Path) -> None:
    good = tmp_path / "good.safetensors"
    save_file(_weights(1)[0], str(good))
    missing = tmp_path / "typo"
    for argv in (
        ["snapshot", str(missing), "n", str(good), "--step", "0"],
        ["prune", str(missing), "n", "--keep-last", "1"],
    ):
        status, doc = run_cli_json(*argv)
        assert status == 2, doc
        assert "gradpipe init" in doc["error"]
        assert not missing.exists()
