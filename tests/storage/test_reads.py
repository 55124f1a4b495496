"""The parallel read path (``storage.reads``): bit-exact, windowed, errors in chunk order."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import dask.config
import numpy as np
import pytest

import gradpipe as gp
from gradpipe.core.ids import block_key
from gradpipe.storage import reads
from gradpipe.storage.store import Store


@pytest.fixture(params=["pool", "serial"])
def threads(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways of decoding: the thread pool, and this thread alone (one core)."""
    if request.param == "serial":
        monkeypatch.setattr(reads, "read_threads", lambda: 1)
    else:
        monkeypatch.setattr(reads, "read_threads", lambda: 3)
    return str(request.param)


@pytest.fixture
def small_windows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Windows of at most 3 chunks or 3 KiB; returns the size of every batched fetch."""
    monkeypatch.setattr(reads, "READ_WINDOW", 3)
    monkeypatch.setattr(reads, "READ_WINDOW_BYTES", 3 * 1024)
    return []  # filled by the store of _store()


def _tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    dense = rng.standard_normal((40, 25)).astype(np.float32)
    sparse = np.zeros((64, 16), np.float32)
    sparse[::9] = rng.standard_normal((8, 16))
    zeros = np.zeros((32, 32), np.float32)  # every chunk all-zero: no block at all
    small = rng.standard_normal(7).astype(np.float32)  # inline in its manifest
    return {"dense": dense, "sparse": sparse, "zeros": zeros, "small": small, "empty": dense[:0]}


def _store(tmp_path: Path, batches: list[int]) -> tuple[Store, list[str]]:
    store = gp.open_store(tmp_path / "s", mode="w")
    with dask.config.set({"gradpipe.chunk-bytes": 512, "gradpipe.inline-bytes": 256}):
        ids = [store.put_tensor(a) for a in _tensors().values()]
    real = store.backend.read_many

    def counted(keys: Sequence[str]) -> list[bytes | Exception]:
        batches.append(len(keys))
        return real(keys)

    store.backend.read_many = counted  # type: ignore[method-assign]
    return store, ids


def test_read_tensors_is_bit_exact_in_windows(
    tmp_path: Path, threads: str, small_windows: list[int]
) -> None:
    store, ids = _store(tmp_path, small_windows)
    manifests = [store.tensor_info(i) for i in ids]
    assert sum(len(m.inline) for m in manifests) >= 1  # the case of inline chunks is covered
    got = store.read_tensors(manifests)
    for want, back in zip(_tensors().values(), got, strict=True):
        assert back.dtype == want.dtype
        assert back.shape == want.shape
        assert back.tobytes() == want.tobytes()
    fetched = sum(len(m.blocks) - len(m.inline) - m.blocks.count(None) for m in manifests)
    assert sum(small_windows) == fetched  # every stored block fetched once...
    assert len(small_windows) > 2
    assert max(small_windows) <= 3  # ...in windows of at most READ_WINDOW


def test_iter_tensors_yields_in_order(tmp_path: Path, threads: str) -> None:
    store, ids = _store(tmp_path, [])
    manifests = [store.tensor_info(i) for i in ids]
    got = list(store.iter_tensors(manifests))
    assert [g.tobytes() for g in got] == [a.tobytes() for a in _tensors().values()]
    assert store.read_tensor(manifests[0]).tobytes() == _tensors()["dense"].tobytes()


def _damage(store: Store, block_id: str) -> None:
    path = Path(store.backend.url) / block_key(block_id)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.unlink()
    path.write_bytes(bytes(data))


def test_the_first_bad_chunk_in_order_is_reported(
    tmp_path: Path, threads: str, small_windows: list[int]
) -> None:
    store, ids = _store(tmp_path, small_windows)
    manifest = store.tensor_info(ids[0])
    stored = [i for i, b in enumerate(manifest.blocks) if b and i not in manifest.inline]
    first, later = stored[1], stored[2]  # one window: the later one may fail first
    _damage(store, manifest.blocks[later])  # type: ignore[arg-type]
    (Path(store.backend.url) / block_key(manifest.blocks[first])).unlink()  # type: ignore[arg-type]
    with pytest.raises(gp.NotFoundError, match=f"chunk {first}\\b"):
        store.read_tensors([manifest], contexts=["tensor 'dense'"])
    with pytest.raises(gp.IntegrityError, match=f"tensor 'later', chunk {later}\\b"):
        store.read_tensors(
            [store.tensor_info(ids[1]), _only(manifest, later)], contexts=["x", "tensor 'later'"]
        )


def _only(manifest: gp.TensorManifest, index: int) -> gp.TensorManifest:
    """``manifest`` with every block but ``index`` dropped (read as zeros)."""
    blocks = tuple(b if i == index else None for i, b in enumerate(manifest.blocks))
    inline = {i: f for i, f in manifest.inline.items() if i == index}
    return gp.TensorManifest(
        manifest.dtype, manifest.shape, manifest.chunk_shape, blocks, manifest.stats, inline
    )
