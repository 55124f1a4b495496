"""Inputs that would make gradpipe allocate without bound, or store what it cannot give back,
fail one dump each; the good dumps of the batch still commit and export."""

from __future__ import annotations

import io
import json
import os
import struct
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import dask.config
import numpy as np
import pytest

import gradpipe as gp
from gradpipe.cli.testing import run_cli_json
from gradpipe.formats import read_safetensors
from gradpipe.ingestion.api import ingest
from gradpipe.runs import export_dump, open_run

ROOT = Path(__file__).resolve().parents[1]


def raw_safetensors(entries: dict[str, object], data: bytes) -> bytes:
    text = json.dumps(entries).encode()
    return struct.pack("<Q", len(text)) + text + data


def test_values_the_store_could_not_give_back_fail_per_dump(
    kit: types.ModuleType, tmp_path: Path
) -> None:
    root = tmp_path / "dumps"
    (root / "step=1").mkdir(parents=True)
    good = {"w": np.arange(6, dtype="<f4"), "m": np.array([True, False])}
    files = {
        "a": kit.safetensors_bytes(good, {}),
        # BOOL byte 0x02: numpy shows True, writes back 0x02, every reader refuses it.
        "bool": raw_safetensors(
            {"flag": {"dtype": "BOOL", "shape": [3], "data_offsets": [0, 3]}}, b"\0\1\2"
        ),
        # No elements, but numpy cannot build an array of this shape.
        "huge": raw_safetensors(
            {"h": {"dtype": "F32", "shape": [2**32, 2**32, 0], "data_offsets": [0, 0]}}, b""
        ),
        "big": kit.safetensors_bytes({"z": np.zeros(1000, "<f4")}, {}),
    }
    for peer, data in files.items():
        (root / "step=1" / f"peer={peer}.safetensors").write_bytes(data)
    store = gp.open_store(str(tmp_path / "store"), mode="w")
    with dask.config.set({"gradpipe.max-tensor-bytes": 1000}):
        report = ingest(store, str(root / "step={step}/peer={peer}.safetensors"), run="r")
    assert report.ingested == 1
    reasons = {f.peer: f.reason for f in report.failures}
    assert sorted(reasons) == ["big", "bool", "huge"]
    for peer, reason in reasons.items():
        assert str(root / "step=1" / f"peer={peer}.safetensors") in reason
    assert "tensor 'flag'" in reasons["bool"]
    assert "other than 0 and 1" in reasons["bool"]
    assert "tensor 'h'" in reasons["huge"]
    assert "too large" in reasons["huge"]
    assert "tensor 'z'" in reasons["big"]
    assert "max-tensor-bytes" in reasons["big"]
    # What was committed can be given back.
    out = tmp_path / "out.safetensors"
    export_dump(store, "r", 1, "a", out)
    tensors, _ = read_safetensors(out)
    assert sorted(tensors) == ["m", "w"]
    assert open_run(store, "r").grid() == {1: ["a"]}


# The bombs are ingested in a child process whose address space is capped: a reader
# that allocated what the file claims fails there, not on the machine the tests share.
CHILD = """
import json, resource, sys
import gradpipe as gp

def vm_bytes():
    for line in open("/proc/self/status"):
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024

store = gp.open_store(sys.argv[1], mode="w")
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
limit = vm_bytes() + (1536 << 20)
resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
report = gp.ingest(store, sys.argv[2], run="r", workers=1)
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(json.dumps({"report": report.to_dict(), "grown_kib": grown}))
"""


def test_npz_bombs_fail_per_dump(kit: types.ModuleType, tmp_path: Path) -> None:
    root = tmp_path / "dumps"
    (root / "step=1").mkdir(parents=True)
    good = {"g": np.arange(6, dtype="<f4")}
    (root / "step=1" / "peer=a.npz").write_bytes(kit.npz_bytes(good, compressed=True))
    (root / "step=1" / "peer=two.npz").write_bytes(kit.bomb_npz(2 << 30))
    (root / "step=1" / "peer=eight.npz").write_bytes(kit.bomb_npz(8 << 30))
    # 4 MiB held, 3.6 GB claimed (within deflate's bound): fails when it ends short.
    liar = kit.lying_npz(np.random.default_rng(0).bytes(4 << 20), 900)
    (root / "step=1" / "peer=liar.npz").write_bytes(liar)
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            CHILD,
            str(tmp_path / "store"),
            str(root / "step={step}/peer={peer}.npz"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT), "MALLOC_ARENA_MAX": "2"},
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    report = result["report"]
    assert report["ingested"] == 1
    reasons = {f["peer"]: f["reason"] for f in report["failures"]}
    assert sorted(reasons) == ["eight", "liar", "two"]
    for peer, reason in reasons.items():
        assert str(root / "step=1" / f"peer={peer}.npz") in reason
        assert "'w.npy'" in reason
    assert f"holds only {4 << 20}" in reasons["liar"]
    assert result["grown_kib"] < 256 * 1024
    store = gp.open_store(str(tmp_path / "store"))
    kit.assert_bit_exact(open_run(store, "r").dump(1, "a").read("g"), good["g"])


def test_expanded_torch_view_fails_per_dump(kit: types.ModuleType, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    root = tmp_path / "dumps"
    (root / "step=1").mkdir(parents=True)
    (root / "step=1" / "peer=a.pt").write_bytes(kit.torch_bytes({"w": torch.ones(4)}))
    # 1.6 KB on disk, 2 GiB once expanded: refused before anything is materialised.
    bad = root / "step=1" / "peer=b.pt"
    bad.write_bytes(kit.torch_bytes({"w": torch.ones(1).expand(2**29)}))
    store = gp.open_store(str(tmp_path / "store"), mode="w")
    report = ingest(store, str(root / "step={step}/peer={peer}.pt"), run="r")
    assert report.ingested == 1
    [failure] = report.failures
    assert failure.path == str(bad)
    assert "tensor 'w'" in failure.reason
    assert ".contiguous()" in failure.reason
    kit.assert_bit_exact(open_run(store, "r").dump(1, "a").read("w"), np.ones(4, "<f4"))


# A sidecar that blocks (a FIFO) or never ends (a device) must fail its dump, not hang the
# batch: the ingest runs in a child process with a timeout so a regression fails here.
SIDECAR_CHILD = """
import json, resource, sys
import gradpipe as gp

def vm_bytes():
    for line in open("/proc/self/status"):
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024

store = gp.open_store(sys.argv[1], mode="w")
limit = vm_bytes() + (1536 << 20)  # reading /dev/zero whole fails here, not on the machine
resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
report = gp.ingest(store, sys.argv[2], run="r", workers=2)
print(json.dumps(report.to_dict()))
"""


def test_bad_sidecars_fail_their_dump_and_the_good_dump_commits(
    kit: types.ModuleType, tmp_path: Path
) -> None:
    from gradpipe.formats.dump import MAX_SIDECAR_BYTES

    root = tmp_path / "dumps" / "step=1"
    root.mkdir(parents=True)
    good = {"w": np.arange(3, dtype="<f4")}
    for peer in "abcd":
        (root / f"peer={peer}.safetensors").write_bytes(kit.safetensors_bytes(good, {}))
    (root / "peer=a.safetensors.json").write_text('{"num_examples": 4}')
    os.mkfifo(root / "peer=b.safetensors.json")
    (root / "peer=c.safetensors.json").symlink_to("/dev/zero")
    with (root / "peer=d.safetensors.json").open("wb") as f:
        f.truncate(MAX_SIDECAR_BYTES + 1)  # sparse: costs no disk
    try:
        proc = subprocess.run(
            [
                sys.executable,
                "-c",
                SIDECAR_CHILD,
                str(tmp_path / "store"),
                str(tmp_path / "dumps" / "step={step}/peer={peer}.safetensors"),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            check=False,
        )
    except subprocess.TimeoutExpired:  # run() has killed the child
        pytest.fail("ingest hung on a sidecar")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["ingested"] == 1
    assert report["run_id"] is not None
    reasons = {f["peer"]: f["reason"] for f in report["failures"]}
    assert sorted(reasons) == ["b", "c", "d"]
    for peer, reason in reasons.items():
        assert str(root / f"peer={peer}.safetensors.json") in reason
        assert "sidecar" in reason
    assert "named pipe (FIFO), not a regular file" in reasons["b"]
    assert "character device, not a regular file" in reasons["c"]
    assert str(MAX_SIDECAR_BYTES) in reasons["d"]
    store = gp.open_store(str(tmp_path / "store"))
    dump = open_run(store, "r").dump(1, "a")
    kit.assert_bit_exact(dump.read("w"), good["w"])


def test_torch_file_whose_names_share_one_storage_fails_per_dump(
    kit: types.ModuleType, tmp_path: Path
) -> None:
    torch = pytest.importorskip("torch")
    root = tmp_path / "dumps" / "step=1"
    root.mkdir(parents=True)
    (root / "peer=a.pt").write_bytes(kit.torch_bytes({"w": torch.ones(4)}))
    shared = torch.ones(1 << 18)  # 1 MiB on disk, claimed 64 times
    bad = root / "peer=b.pt"
    bad.write_bytes(kit.torch_bytes({f"layer{i}.weight": shared for i in range(64)}))
    store = gp.open_store(str(tmp_path / "store"), mode="w")
    report = ingest(store, str(tmp_path / "dumps" / "step={step}/peer={peer}.pt"), run="r")
    assert report.ingested == 1
    [failure] = report.failures
    assert failure.path == str(bad)
    assert str(64 * shared.nbytes) in failure.reason
    assert ".clone()" in failure.reason
    assert report.raw_bytes == 16


def damage_stored_npz(data: bytes, member: str, *, from_end: int, mask: int = 0x01) -> bytes:
    """``data`` (an np.savez archive) with one byte of ``member`` XORed by ``mask``.

    The byte is ``from_end`` bytes before the end of the member (its ``.npy`` data
    for small values); the zip directory's CRC-32 is left as it was.
    """
    raw = bytearray(data)
    info = zipfile.ZipFile(io.BytesIO(data)).getinfo(member)
    name_len, extra_len = struct.unpack_from("<HH", raw, info.header_offset + 26)
    start = info.header_offset + 30 + name_len + extra_len
    raw[start + info.file_size - 1 - from_end] ^= mask
    return bytes(raw)


def padding_at(data: bytes, member: str) -> int:
    """How far before the end of ``member`` a padding space of its ``.npy`` header is."""
    info = zipfile.ZipFile(io.BytesIO(data)).getinfo(member)
    body = zipfile.ZipFile(io.BytesIO(data)).read(member)
    newline = body.index(b"\n")  # the header ends with padding spaces and a newline
    assert body[newline - 1 : newline] == b" "
    return info.file_size - newline


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("read", ["ranged", "whole"])
@pytest.mark.parametrize("delta", [False, True], ids=["plain", "delta"])
@pytest.mark.parametrize("where", ["data", "npy-header"])
def test_damaged_stored_npz_member_fails_its_dump(
    kit: types.ModuleType, tmp_path: Path, delta: bool, where: str, read: str
) -> None:
    """A byte flipped in a stored (``np.savez``) member is caught by its CRC-32.

    Ranged: the damaged tensor spans several read units (4 KiB chunks, 16 KiB
    units), so its CRC-32 is put together from pieces read by different tasks.
    Whole: a big-endian member makes ingest read the file whole, through zipfile.
    """
    root = tmp_path / "dumps"
    (root / "step=1").mkdir(parents=True)
    (root / "step=2").mkdir(parents=True)
    good = {"w": np.arange(20_000, dtype="<f4"), "b": np.arange(7, dtype="<i8")}
    if read == "whole":
        good["be"] = np.arange(3, dtype=">i4")
    data = kit.npz_bytes(good, compressed=False)
    if where == "data":
        bad = damage_stored_npz(data, "w.npy", from_end=50_000)
    else:  # a header padding space made a tab: the header still parses, the CRC differs
        bad = damage_stored_npz(data, "w.npy", from_end=padding_at(data, "w.npy"), mask=0x29)
    with pytest.raises(zipfile.BadZipFile, match="CRC"):  # numpy refuses the file
        np.load(io.BytesIO(bad))["w"]
    (root / "step=1" / "peer=a.npz").write_bytes(data)
    (root / "step=2" / "peer=a.npz").write_bytes(data)
    damaged = root / "step=1" / "peer=b.npz"
    damaged.write_bytes(bad)
    store = gp.open_store(str(tmp_path / "store"), mode="w")
    report = ingest(store, str(root / "step={step}/peer={peer}.npz"), run="r", delta=delta)
    assert report.ingested == 2
    [failure] = report.failures
    assert failure.path == str(damaged)
    assert str(damaged) in failure.reason
    named = "member 'w.npy' is damaged" if read == "whole" else "tensor 'w' is damaged"
    assert named in failure.reason
    assert "re-create it or copy it again" in failure.reason
    run = open_run(store, "r")
    assert run.grid() == {1: ["a"], 2: ["a"]}
    for step in (1, 2):
        for name, want in good.items():
            kit.assert_bit_exact(run.dump(step, "a").read(name), want)


def test_cli_ingest_of_a_damaged_npz_exits_1_and_commits_the_rest(
    kit: types.ModuleType, tmp_path: Path
) -> None:
    root = tmp_path / "dumps"
    (root / "step=1").mkdir(parents=True)
    good = {"w": np.arange(300, dtype="<f4")}
    data = kit.npz_bytes(good, compressed=False)
    (root / "step=1" / "peer=a.npz").write_bytes(data)
    damaged = root / "step=1" / "peer=b.npz"
    damaged.write_bytes(damage_stored_npz(data, "w.npy", from_end=10))
    store = str(tmp_path / "store")
    status, doc = run_cli_json(
        "ingest", store, str(root / "step={step}/peer={peer}.npz"), "--run", "r"
    )
    assert status == 1
    assert doc["ingested"] == 1
    [failure] = doc["failures"]
    assert failure["path"] == str(damaged)
    assert "tensor 'w' is damaged" in failure["reason"]
    kit.assert_bit_exact(open_run(gp.open_store(store), "r").dump(1, "a").read("w"), good["w"])


def test_damaged_torch_storage_fails_its_dump(kit: types.ModuleType, tmp_path: Path) -> None:
    """torch.load checks no CRC-32; ingest does, and the good dump still commits."""
    torch = pytest.importorskip("torch")
    root = tmp_path / "dumps"
    (root / "step=1").mkdir(parents=True)
    data = kit.torch_bytes({"w": torch.arange(1000.0)})
    (root / "step=1" / "peer=a.pt").write_bytes(data)
    raw = bytearray(data)
    info = zipfile.ZipFile(io.BytesIO(data)).getinfo("archive/data/0")
    name_len, extra_len = struct.unpack_from("<HH", raw, info.header_offset + 26)
    raw[info.header_offset + 30 + name_len + extra_len + 17] ^= 0x40
    damaged = root / "step=1" / "peer=b.pt"
    damaged.write_bytes(bytes(raw))
    store = gp.open_store(str(tmp_path / "store"), mode="w")
    report = ingest(store, str(root / "step={step}/peer={peer}.pt"), run="r")
    assert report.ingested == 1
    [failure] = report.failures
    assert failure.path == str(damaged)
    assert "record 'archive/data/0' is damaged" in failure.reason
    want = np.arange(1000, dtype="<f4")
    kit.assert_bit_exact(open_run(store, "r").dump(1, "a").read("w"), want)
