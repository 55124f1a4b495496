"""Shared fixtures: stores on local disk and on a real S3 server on loopback, and dump files.

The dump helpers (files in every format, bit-exact comparisons) are reached
through the ``kit`` fixture: with ``--import-mode=importlib`` a test module
cannot import a conftest.
"""

from __future__ import annotations

import io
import json
import os
import struct
import subprocess
import sys
import types
import uuid
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import dask.config
import fsspec
import numpy as np
import pytest

import gradpipe as gp
from gradpipe.core.dtypes import bfloat16, dtype_name
from gradpipe.formats.safetensors import write_safetensors
from gradpipe.testing.s3server import S3Server

_ROOT = Path(__file__).resolve().parents[1]  # the checkout, for child processes

#: Set (to 1) to run the tests marked slow too: stress, crash and deployment tests of
#: several minutes on 2 cores. `.ci/run` sets it; a local `python -m pytest` leaves them out.
RUN_SLOW = os.environ.get("GRADPIPE_RUN_SLOW", "") not in ("", "0")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if RUN_SLOW or config.getoption("-m"):  # `-m slow` asks for them explicitly
        return
    skip = pytest.mark.skip(reason="slow: set GRADPIPE_RUN_SLOW=1 (as .ci/run does) to run it")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


BUCKET = "gradpipe-test"


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """moto's S3 on loopback, one per test session (as s3fs's own tests do)."""
    with S3Server() as server:
        yield server


@pytest.fixture
def s3(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """A clean S3 server with one bucket; the AWS environment points at it."""
    s3_server.reset()
    s3_server.make_bucket(BUCKET)
    for key, value in s3_server.environ.items():
        monkeypatch.setenv(key, value)
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    return s3_server


@pytest.fixture(scope="session")
def s3_faults_server() -> Iterator[S3Server]:
    """A second loopback server with the fault layer in front of moto (moto's state is shared)."""
    with S3Server(fault_layer=True) as server:
        yield server


@pytest.fixture
def s3_faults(s3_faults_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """Like ``s3``, on the server that can lose replies (``server.lose_replies(...)``)."""
    s3_faults_server.reset()
    s3_faults_server.make_bucket(BUCKET)
    for key, value in s3_faults_server.environ.items():
        monkeypatch.setenv(key, value)
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    return s3_faults_server


@pytest.fixture(params=["local", "s3"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A URL for a new store, on local disk and on S3."""
    if request.param == "local":
        return str(tmp_path / "store")
    request.getfixturevalue("s3")
    return f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}"


@pytest.fixture
def store(store_url: str) -> gp.Store:
    """A new, empty, writable store (local and S3)."""
    return gp.open_store(store_url, mode="w")


@pytest.fixture(autouse=True)
def _no_aws_config_files(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # A developer's ~/.aws must not change what the tests see.
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)


@pytest.fixture(autouse=True)
def _short_lock_ttl(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Leases expire in seconds, not minutes: tests kill writers and then run gc.

    A killed writer's lock blocks gc until its ttl passes, by design; the
    subprocesses tests start read the same setting from the environment.
    """
    monkeypatch.setenv("DASK_GRADPIPE__LOCK__TTL", "6s")
    monkeypatch.setenv("DASK_GRADPIPE__LOCK__POLL", "0.05s")
    with dask.config.set({"gradpipe.lock.ttl": "6s", "gradpipe.lock.poll": "0.05s"}):
        yield


# --- dump files ----------------------------------------------------------------
#: Bit patterns of float32 values a careless reader would change: NaN payloads
#: (quiet, signalling, negative), infinities, -0.0 and a subnormal.
SPECIAL_F32 = np.array(
    [0x7FC00001, 0xFFC12345, 0x7F800001, 0x7F800000, 0xFF800000, 0x80000000, 0x00000001],
    dtype="<u4",
)


def canonical(arr: np.ndarray) -> np.ndarray:
    """What gradpipe stores for ``arr``: C order, little-endian, the same bits."""
    arr = np.asarray(arr)
    if arr.dtype.byteorder == ">":
        arr = arr.byteswap().view(arr.dtype.newbyteorder("<"))
    return arr.copy(order="C") if not arr.flags.c_contiguous else arr


def assert_bit_exact(got: np.ndarray, want: np.ndarray, what: str = "") -> None:
    """Same dtype, shape and bytes (NaN payloads and -0.0 included)."""
    want = canonical(want)
    assert isinstance(got, np.ndarray), what
    assert dtype_name(got.dtype) == dtype_name(want.dtype), what
    assert got.dtype.byteorder != ">", what
    assert got.shape == want.shape, what
    assert np.ascontiguousarray(got).tobytes() == want.tobytes(), what


def assert_all_bit_exact(got: Mapping[str, np.ndarray], want: Mapping[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for name, arr in want.items():
        assert_bit_exact(got[name], arr, name)


def special_f32(shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Random float32 values with the special bit patterns sprinkled in."""
    rng = np.random.default_rng(seed)
    arr = rng.standard_normal(shape).astype("<f4").reshape(-1)
    bits = arr.view("<u4")
    bits[: SPECIAL_F32.size] = SPECIAL_F32[: bits.size]
    return arr.reshape(shape)


INT_DTYPES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")


def numeric_tensors(
    seed: int, *, bf16: bool, ints: tuple[str, ...] = INT_DTYPES
) -> dict[str, np.ndarray]:
    """Every stored dtype (bfloat16 when the format keeps it), 0-d, empty and multi-chunk tensors.

    With ``gradpipe.chunk-bytes`` at 4096, ``big`` (32 KiB) and ``wide``
    (10 KiB, 25 rows per chunk) span several chunks and ``big`` more than one
    read unit of 16 KiB.
    """
    rng = np.random.default_rng(seed)
    ints = {
        name: rng.integers(np.iinfo(name).min, np.iinfo(name).max, size=(3, 5), dtype=name)
        for name in ints
    }
    out: dict[str, np.ndarray] = {
        "big": rng.standard_normal((64, 64)),  # float64
        "wide": special_f32((64, 40), seed),
        "half": rng.standard_normal(17).astype("<f2"),
        "mask": rng.random((4, 4)) > 0.5,
        "scalar": np.array(seed * 1.5 + 0.25, dtype="<f8"),
        "count": np.array(seed, dtype="<i8"),
        "empty": np.zeros((0, 3), dtype="<f4"),
        **{f"i.{k}": v for k, v in ints.items()},
    }
    if bf16:
        words = rng.integers(0, 1 << 16, size=(6, 7), dtype="<u2")
        words[0, :3] = [0x7FC1, 0xFF81, 0x8000]  # NaN payloads and -0.0
        out["bf16"] = words.view(bfloat16())
    return out


def npz_bytes(tensors: Mapping[str, np.ndarray], *, compressed: bool) -> bytes:
    buf = io.BytesIO()
    (np.savez_compressed if compressed else np.savez)(buf, **tensors)
    return buf.getvalue()


def npy_bytes(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


def safetensors_bytes(tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str]) -> bytes:
    buf = io.BytesIO()
    write_safetensors(buf, tensors, metadata)
    return buf.getvalue()


def torch_tensor(arr: np.ndarray):  # type: ignore[no-untyped-def]
    import torch

    if arr.dtype == bfloat16():
        return torch.from_numpy(arr.view("<i2").copy()).view(torch.bfloat16)
    return torch.from_numpy(arr.copy())


def torch_bytes(obj: object) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def npy_head(shape: tuple[int, ...], descr: str = "|u1") -> bytes:
    """A version 1.0 ``.npy`` header, padded as numpy pads it."""
    text = f"{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape!r}, }}"
    text += " " * (-(10 + len(text) + 1) % 64) + "\n"
    return b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text.encode()


def bomb_npz(claim: int) -> bytes:
    """A one-member npz whose zip directory and ``.npy`` header both claim ``claim`` bytes.

    The deflated member really holds its ``.npy`` header and 64 zero bytes; the
    sizes are written by hand (zip64 above 4 GiB), as an attacker would.
    """
    head = npy_head((claim - len(npy_head((claim,))),))
    assert len(head) == len(npy_head((claim,)))
    payload = head + bytes(64)
    packer = zlib.compressobj(9, zlib.DEFLATED, -15)
    data = packer.compress(payload) + packer.flush()
    crc = zlib.crc32(payload)
    name = b"w.npy"
    zip64 = claim >= 0xFFFFFFFF
    size32 = 0xFFFFFFFF if zip64 else claim
    extra = struct.pack("<HHQ", 1, 8, claim) if zip64 else b""
    version = 45 if zip64 else 20
    local = struct.pack(
        "<4sHHHHHIIIHH", b"PK\x03\x04", version, 0, 8, 0, 0x21, crc, len(data), size32,
        len(name), len(extra),
    )  # fmt: skip
    central = struct.pack(
        "<4sHHHHHHIIIHHHHHII", b"PK\x01\x02", version, version, 0, 8, 0, 0x21, crc, len(data),
        size32, len(name), len(extra), 0, 0, 0, 0, 0,
    )  # fmt: skip
    body = local + name + extra + data
    directory = central + name + extra
    end = struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, 1, 1, len(directory), len(body), 0)
    return body + directory + end


def lying_npz(body: bytes, ratio: int) -> bytes:
    """A one-member deflated npz that holds ``body`` but claims ``ratio`` x its compressed size.

    The member's ``.npy`` header and its zip directory both claim the larger size
    (within deflate's 1032 x, so the header read accepts it); only ``body`` follows.
    """
    packer = zlib.compressobj(1, zlib.DEFLATED, -15)
    claim = len(packer.compress(body) + packer.flush()) * ratio
    head = npy_head((claim - len(npy_head((claim,))),))
    payload = head + body
    packer = zlib.compressobj(1, zlib.DEFLATED, -15)
    data = packer.compress(payload) + packer.flush()
    assert claim <= len(data) * ratio < 0xFFFFFFFF  # within deflate's bound, and no zip64
    name, crc = b"w.npy", zlib.crc32(payload)
    local = struct.pack(
        "<4sHHHHHIIIHH", b"PK\x03\x04", 20, 0, 8, 0, 0x21, crc, len(data), claim, len(name), 0
    )
    central = struct.pack(
        "<4sHHHHHHIIIHHHHHII", b"PK\x01\x02", 20, 20, 0, 8, 0, 0x21, crc, len(data), claim,
        len(name), 0, 0, 0, 0, 0, 0,
    )  # fmt: skip
    records = local + name + data
    end = struct.pack(
        "<4sHHHHIIH", b"PK\x05\x06", 0, 0, 1, 1, len(central) + len(name), len(records), 0
    )
    return records + central + name + end


# Reads a dump in a child process whose address space is capped a little above what
# its imports take: a reader that allocates what a file claims fails there with
# MemoryError instead of taking gigabytes from the machine the tests share.
CAPPED_READ = """
import json, resource, sys
import fsspec
from gradpipe.errors import InvalidInputError
from gradpipe.formats import read_dump_header, read_dump_tensors

def vm_bytes():
    for line in open("/proc/self/status"):
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024

fs = fsspec.filesystem("file")
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
limit = vm_bytes() + (1 << 30)
resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
try:
    header = read_dump_header(fs, sys.argv[1])
    read_dump_tensors(fs, sys.argv[1], header)
    outcome = "read"
except InvalidInputError as exc:
    outcome = "refused: " + str(exc)
except MemoryError:
    outcome = "MemoryError"
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(json.dumps({"outcome": outcome, "grown_kib": grown}))
"""


def read_in_capped_child(path: Path) -> dict[str, object]:
    """Read a dump whole in a capped child process: its outcome and how far its memory grew.

    ``outcome`` is ``"read"``, ``"refused: <message>"`` or ``"MemoryError"``.
    """
    proc = subprocess.run(
        [sys.executable, "-c", CAPPED_READ, str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(_ROOT), "PATH": "/usr/bin:/bin", "MALLOC_ARENA_MAX": "2"},
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


@dataclass
class Place:
    """Where one test keeps its dump files and its store: local disk or the S3 bucket."""

    kind: str
    root: str  # directory or s3://bucket/prefix of the dump files
    store_url: str

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        return fsspec.core.url_to_fs(self.root)[0]

    def url(self, relative: str) -> str:
        return f"{self.root}/{relative}"

    def path(self, relative: str) -> str:
        """The path gradpipe records for a dump (an S3 URL loses its protocol)."""
        return fsspec.core.url_to_fs(self.url(relative))[1]

    def write(self, relative: str, data: bytes) -> str:
        url = self.url(relative)
        if self.kind == "local":
            Path(url).parent.mkdir(parents=True, exist_ok=True)
            Path(url).write_bytes(data)
        else:
            with fsspec.open(url, "wb") as f:
                f.write(data)
        return url

    def write_sidecar(self, relative: str, meta: Mapping[str, object]) -> None:
        self.write(relative + ".json", json.dumps(meta).encode())


@pytest.fixture(params=["local", "s3"])
def place(request: pytest.FixtureRequest, tmp_path: Path) -> Place:
    """Dumps and store together, on local disk and on the loopback S3 server."""
    if request.param == "local":
        return Place("local", str(tmp_path / "dumps"), str(tmp_path / "store"))
    request.getfixturevalue("s3")
    prefix = f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}"
    return Place("s3", f"{prefix}/dumps", f"{prefix}/store")


@pytest.fixture
def local(tmp_path: Path) -> Place:
    return Place("local", str(tmp_path / "dumps"), str(tmp_path / "store"))


@pytest.fixture
def no_inline() -> Iterator[None]:
    """Every chunk a block of its own (tests that damage or count data blocks)."""
    with dask.config.set({"gradpipe.inline-bytes": 0}):
        yield


@pytest.fixture
def small_chunks() -> Iterator[None]:
    """Chunks of 4 KiB and read units of 16 KiB: several of each per dump."""
    with dask.config.set({"gradpipe.chunk-bytes": 4096, "gradpipe.ingest.task-bytes": 16384}):
        yield


@pytest.fixture(scope="session")
def kit() -> types.ModuleType:
    """This module: its helpers, for test modules (importlib mode cannot import conftest)."""
    return sys.modules[__name__]
