"""Opening stores: bad URLs, modes, foreign locations, newer formats, bad names, pickling."""

from __future__ import annotations

import os
import pickle
import shutil
import uuid
from pathlib import Path

import numpy as np
import pytest

import gradpipe as gp
from gradpipe.core.encoding import to_json_bytes
from gradpipe.core.manifest import FORMAT_VERSION
from gradpipe.errors import (
    IntegrityError,
    InvalidInputError,
    NotFoundError,
    ReadOnlyError,
    UnsupportedFormatError,
)
from gradpipe.testing.s3server import S3Server

BUCKET = "gradpipe-test"


def tree(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` and its bytes."""
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def listing(store: gp.Store) -> dict[str, bytes]:
    return {info.key: store.backend.read(info.key) for info in store.backend.list("")}


def put_file(url: str, key: str, data: bytes) -> None:
    """Write ``key`` under a store URL without going through gradpipe."""
    if url.startswith("s3://"):
        import s3fs

        s3fs.S3FileSystem().pipe_file(f"{url.removeprefix('s3://')}/{key}", data)
    else:
        path = Path(url, key)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def keys_under(url: str) -> list[str]:
    if url.startswith("s3://"):
        import s3fs

        fs = s3fs.S3FileSystem()
        fs.invalidate_cache()
        return sorted(fs.find(url.removeprefix("s3://")))
    return sorted(p.relative_to(url).as_posix() for p in Path(url).rglob("*"))


# --- URLs and modes ---------------------------------------------------------------
@pytest.mark.parametrize("url", ["ftp://host/store", "gs://bucket/store", "mystery://x"])
def test_unknown_url_scheme(url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidInputError, match="unsupported store URL scheme"):
        gp.open_store(url, mode="a")
    assert list(tmp_path.iterdir()) == []


def test_url_without_a_location(s3: S3Server) -> None:
    for url in ["", "s3://", "s3a://"]:
        with pytest.raises(InvalidInputError):
            gp.open_store(url, mode="a")


def test_bad_mode(store_url: str) -> None:
    with pytest.raises(InvalidInputError, match="mode"):
        gp.open_store(store_url, mode="x")  # type: ignore[arg-type]
    assert keys_under(store_url) == []


def test_missing_store_read_only(store_url: str) -> None:
    with pytest.raises(NotFoundError, match="no gradpipe store") as info:
        gp.open_store(store_url, mode="r")
    assert isinstance(info.value, KeyError)
    assert not store_url.startswith("/") or not Path(store_url).exists()
    assert keys_under(store_url) == []


@pytest.mark.parametrize("mode", ["a", "w", "w-"])
def test_foreign_location_is_never_written(store_url: str, mode: str) -> None:
    put_file(store_url, "notes.txt", b"my thesis")
    put_file(store_url, "data/table.csv", b"a,b\n1,2\n")
    before = keys_under(store_url)
    with pytest.raises(InvalidInputError, match="not a gradpipe store"):
        gp.open_store(store_url, mode=mode)  # type: ignore[arg-type]
    assert keys_under(store_url) == before
    if store_url.startswith("/"):
        assert tree(Path(store_url)) == {"data/table.csv": b"a,b\n1,2\n", "notes.txt": b"my thesis"}


def test_foreign_marker_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "s"
    put_file(str(root), "gradpipe.json", b'{"hello": "world"}')
    with pytest.raises(IntegrityError, match="not gradpipe's"):
        gp.open_store(root, mode="w")
    assert tree(root) == {"gradpipe.json": b'{"hello": "world"}'}


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b"\x00garbage{", "damaged"),
        (b'{"gradpipe": "store"}', "damaged: its 'format' is None"),
        (b'{"gradpipe": "store", "format": "1"}', "damaged"),
    ],
)
def test_damaged_marker_is_an_integrity_error_not_an_upgrade(
    tmp_path: Path, content: bytes, match: str
) -> None:
    root = tmp_path / "s"
    put_file(str(root), "gradpipe.json", content)
    for mode in ("r", "r+", "a"):
        with pytest.raises(IntegrityError, match=match) as info:
            gp.open_store(root, mode=mode)  # type: ignore[arg-type]
        assert "upgrade" not in str(info.value)
    assert tree(root) == {"gradpipe.json": content}


def test_mode_r_plus_never_creates(tmp_path: Path) -> None:
    with pytest.raises(NotFoundError, match="no gradpipe store"):
        gp.open_store(tmp_path / "typo", mode="r+")
    assert not (tmp_path / "typo").exists()
    gp.open_store(tmp_path / "s", mode="a")
    assert gp.open_store(tmp_path / "s", mode="r+").writable


@pytest.mark.parametrize("mode", ["r", "a", "w", "w-"])
def test_store_of_a_newer_format(store_url: str, mode: str) -> None:
    gp.open_store(store_url, mode="w").put_tensor(np.arange(4))
    marker = to_json_bytes({"gradpipe": "store", "format": 99})
    put_file(store_url, "gradpipe.json", marker)
    before = keys_under(store_url)
    with pytest.raises(UnsupportedFormatError, match="upgrade gradpipe"):
        gp.open_store(store_url, mode=mode)  # type: ignore[arg-type]
    assert keys_under(store_url) == before  # not even mode="w" wipes it


def test_manifest_of_a_newer_format(store: gp.Store) -> None:
    newer = to_json_bytes(
        {"type": "tensor", "format": FORMAT_VERSION + 1, "dtype": "float32", "shape": [1]}
    )
    manifest_id = store.put_raw(newer)
    with pytest.raises(UnsupportedFormatError, match="upgrade gradpipe"):
        store.get_tensor(manifest_id)
    store.refs.set("tags/future", manifest_id)
    report = gp.verify(store)
    assert [(p.kind, p.id) for p in report.problems] == [("unreadable", manifest_id)]
    with pytest.raises(gp.IntegrityError):
        gp.gc(store, grace=0)
    assert bytes(store.get_raw(manifest_id)) == newer


def test_mode_w_wipes_an_existing_store(store_url: str) -> None:
    store = gp.open_store(store_url, mode="w")
    tensor_id = store.put_tensor(np.arange(1000, dtype="float32"))
    store.refs.set("tags/r", tensor_id)
    assert len(listing(store)) > 3

    fresh = gp.open_store(store_url, mode="w")
    assert list(listing(fresh)) == ["gradpipe.json"]
    assert fresh.refs.list() == {}
    with pytest.raises(NotFoundError):
        fresh.get_tensor(tensor_id)
    with pytest.raises(NotFoundError):
        fresh.refs.get("runs/r")


def test_mode_w_dash_refuses_an_existing_store(store_url: str) -> None:
    store = gp.open_store(store_url, mode="w-")
    tensor_id = store.put_tensor(np.arange(10))
    before = listing(store)
    with pytest.raises(InvalidInputError, match="already exists"):
        gp.open_store(store_url, mode="w-")
    assert listing(store) == before
    assert gp.open_store(store_url, mode="r").get_tensor(tensor_id).tolist() == list(range(10))


def test_mode_a_creates_then_reopens(store_url: str) -> None:
    store = gp.open_store(store_url, mode="a")
    tensor_id = store.put_tensor(np.arange(5))
    again = gp.open_store(store_url, mode="a")
    assert again.get_tensor(tensor_id).tolist() == [0, 1, 2, 3, 4]


def test_a_new_store_opened_twice_at_once_is_one_store(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two processes open a new store (mode 'a') at once: the one that looked for the marker
    before the other made it finds the location holding only that marker, and opens it;
    a foreign file appearing there instead is still refused."""
    import gradpipe.storage.open as opening
    from gradpipe.storage.marker import MARKER_KEY, marker_bytes

    real = opening.read_marker

    def other_opener_first(content: bytes):
        def racing(backend):
            if not racing.done:  # type: ignore[attr-defined]
                racing.done = True  # type: ignore[attr-defined]
                backend.write_if_absent(MARKER_KEY, content)  # the other opener, just now
                return None
            return real(backend)

        racing.done = False  # type: ignore[attr-defined]
        return racing

    monkeypatch.setattr(opening, "read_marker", other_opener_first(marker_bytes()))
    store = gp.open_store(store_url, mode="a")
    monkeypatch.undo()
    tensor_id = store.put_tensor(np.arange(3))
    assert gp.open_store(store_url, mode="r").get_tensor(tensor_id).tolist() == [0, 1, 2]
    other = f"{store_url}-foreign"
    monkeypatch.setattr(opening, "read_marker", other_opener_first(b'{"not": "ours"}'))
    with pytest.raises(IntegrityError, match="not gradpipe's store marker"):
        gp.open_store(other, mode="a")


# --- names ------------------------------------------------------------------------
BAD_REF_NAMES = [
    "",
    "runs",
    "runs/",
    "/r",
    "runs/..",
    "../runs/x",
    "runs/../x",
    "runs/a/b",
    "runs/a..b",
    "runs/.hidden",
    "..runs/x",
    "runs/a\nb",
    "runs/a\x00",
    "runs/tab\there",
    "runs/with space",
    "runs/" + "x" * 201,
    "runs\\x/y",
]


def test_bad_ref_names_write_nothing(store: gp.Store) -> None:
    tensor_id = store.put_tensor(np.arange(3))
    before = listing(store)
    for name in BAD_REF_NAMES:
        with pytest.raises(InvalidInputError, match="invalid ref"):
            store.refs.set(name, tensor_id)
        with pytest.raises(InvalidInputError):
            store.refs.set(name, None)
        with pytest.raises(InvalidInputError):
            store.refs.get(name)
    assert listing(store) == before
    for kind in ["", "..", "a/b", "x\x7f", "-lead"]:
        with pytest.raises(InvalidInputError):
            store.refs.list(kind)


def test_good_ref_names(store: gp.Store) -> None:
    tensor_id = store.put_tensor(np.arange(3))
    names = ["runs/r-7", "tags/v1.0", "snapshots/a+b=c@d", "x/" + "y" * 200]
    for name in names:
        store.refs.set(name, tensor_id)
    assert sorted(store.refs.list()) == sorted(names)


def test_bad_ids(store: gp.Store) -> None:
    before = listing(store)
    for bad in ["", "b3:xyz", "sha256:" + "0" * 64, "b3:" + "0" * 63, "../../etc/passwd"]:
        with pytest.raises(InvalidInputError):
            store.get_tensor(bad)
        with pytest.raises(InvalidInputError):
            store.refs.set("runs/r", bad)
    assert listing(store) == before


# --- read-only --------------------------------------------------------------------
def test_read_only_store_refuses_writes(store_url: str) -> None:
    writer = gp.open_store(store_url, mode="w")
    tensor_id = writer.put_tensor(np.arange(6))
    writer.refs.set("tags/r", tensor_id)
    reader = gp.open_store(store_url, mode="r")
    before = listing(reader)
    assert not reader.writable
    for attempt in [
        lambda: reader.put_tensor(np.ones(3)),
        lambda: reader.put_raw(b"bytes"),
        lambda: reader.refs.set("tags/r", None),
        lambda: reader.refs.set("runs/new", tensor_id),
        lambda: gp.gc(reader, grace=0),
    ]:
        with pytest.raises(ReadOnlyError, match="read-only"):
            attempt()
    assert listing(reader) == before
    assert reader.get_tensor(tensor_id).tolist() == list(range(6))
    assert reader.refs.get("tags/r") == tensor_id
    assert gp.verify(reader).ok


# --- pickling ---------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["w", "a", "r"])
def test_store_pickles(store_url: str, mode: str) -> None:
    writer = gp.open_store(store_url, mode="w")
    store = writer if mode == "w" else gp.open_store(store_url, mode=mode)  # type: ignore[arg-type]
    tensor_id = writer.put_tensor(np.arange(12, dtype="float64").reshape(3, 4))
    writer.refs.set("tags/r", tensor_id)

    clone = pickle.loads(pickle.dumps(store))
    assert clone.url == store.url
    # A store opened with "w" must not wipe itself when it lands on a worker.
    np.testing.assert_array_equal(clone.get_tensor(tensor_id), np.arange(12.0).reshape(3, 4))
    assert clone.refs.get("tags/r") == tensor_id
    if mode == "r":
        with pytest.raises(ReadOnlyError):
            clone.put_tensor(np.ones(2))
    else:
        other = clone.put_tensor(np.ones(2))
        assert store.get_tensor(other).tolist() == [1.0, 1.0]


def test_s3_store_pickles_with_storage_options(
    s3_server: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    s3_server.reset()
    s3_server.make_bucket(BUCKET)
    for key in s3_server.environ:
        monkeypatch.delenv(key, raising=False)
    url = f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}"
    store = gp.open_store(url, mode="w", storage_options=s3_server.storage_options)
    tensor_id = store.put_tensor(np.arange(7))
    clone = pickle.loads(pickle.dumps(store))
    assert clone.storage_options == s3_server.storage_options
    assert clone.get_tensor(tensor_id).tolist() == list(range(7))
    assert "AWS_ENDPOINT_URL_S3" not in os.environ


def test_a_worker_never_creates_the_store_it_was_sent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    store = gp.open_store("relative-store", mode="w")
    assert store.url == str(tmp_path / "relative-store")  # travels as an absolute path
    data = pickle.dumps(store)
    other = tmp_path / "elsewhere"
    other.mkdir()
    monkeypatch.chdir(other)
    assert pickle.loads(data).url == store.url
    gone = gp.open_store(tmp_path / "gone", mode="w")
    payload = pickle.dumps(gone)
    shutil.rmtree(tmp_path / "gone")
    (tmp_path / "gone").mkdir()
    with pytest.raises(gp.NotFoundError):
        pickle.loads(payload)
    assert not any((tmp_path / "gone").iterdir())
