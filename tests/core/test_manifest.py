from __future__ import annotations

import math

import numpy as np
import pytest

from gradpipe.core.chunk_stats import ChunkStats, chunk_stats, merge_stats
from gradpipe.core.encoding import to_json_bytes
from gradpipe.core.manifest import decode_manifest, encode_manifest
from gradpipe.core.names import parse_name, parse_ref_name
from gradpipe.core.ref_entry import RefEntry
from gradpipe.core.tensor_manifest import TensorManifest
from gradpipe.errors import IntegrityError, InvalidInputError, UnsupportedFormatError

ID = "b3:" + "ab" * 32


def _manifest() -> TensorManifest:
    stats = (
        ChunkStats(count=4, nonzero=3, nan=1, inf=0, min=-math.inf, max=2.0, sum=1.0, sumsq=5.0),
        ChunkStats(count=2, nonzero=0, min=0.0, max=0.0),
    )
    return TensorManifest("float32", (6,), (4,), (ID, None), stats)


def test_tensor_manifest_round_trips_with_non_finite_stats() -> None:
    manifest = _manifest()
    data = encode_manifest(manifest)
    assert b"-Infinity" in data  # JSON has no infinities: encoded as zarr does
    assert decode_manifest(data) == manifest
    assert encode_manifest(decode_manifest(data)) == data  # canonical


def test_manifest_rejects_inconsistent_chunk_lists() -> None:
    with pytest.raises(InvalidInputError, match="2 chunks"):
        TensorManifest("float32", (6,), (4,), (ID,), (ChunkStats(count=4, nonzero=0),))


def test_newer_format_and_unknown_type_are_refused() -> None:
    doc = {"type": "tensor", "format": 99}
    with pytest.raises(UnsupportedFormatError, match="upgrade gradpipe"):
        decode_manifest(to_json_bytes(doc))
    with pytest.raises(UnsupportedFormatError, match="unknown type"):
        decode_manifest(to_json_bytes({"type": "hologram", "format": 1}))
    with pytest.raises(IntegrityError, match="malformed"):
        decode_manifest(to_json_bytes({"type": "tensor", "format": 1, "dtype": "float32"}))
    with pytest.raises(IntegrityError, match="format field"):
        decode_manifest(to_json_bytes({"type": "tensor", "format": "1"}))


def test_ref_entry_round_trip() -> None:
    entry = RefEntry("runs/r1", ID, None, "2026-01-01T00:00:00+00:00", "w1", "m", {"k": "v"})
    assert decode_manifest(encode_manifest(entry)) == entry
    assert list(entry.manifest_children()) == []


def test_chunk_stats_conventions() -> None:
    stats = chunk_stats(np.array([-0.0, 0.0, np.nan, np.inf, 1.0, -2.0], np.float32))
    assert (stats.count, stats.nonzero, stats.nan, stats.inf) == (6, 4, 1, 1)
    assert (stats.min, stats.max) == (-2.0, math.inf)
    assert (stats.sum, stats.sumsq) == (-1.0, 5.0)  # finite values only
    merged = merge_stats([stats, chunk_stats(np.array([5], np.float32))])
    assert (merged.count, merged.max, merged.sum) == (7, math.inf, 4.0)
    ints = chunk_stats(np.array([3, -1, 0], np.int8))
    assert (ints.min, ints.max, ints.nonzero, ints.sumsq) == (-1.0, 3.0, 2, 10.0)


@pytest.mark.parametrize(
    "bad", ["", "..", "a/b", "../x", "a\x00b", "tab\tname", ".hidden", "x" * 201, 7]
)
def test_bad_names_are_refused(bad: object) -> None:
    with pytest.raises(InvalidInputError, match="invalid"):
        parse_name(bad)


def test_ref_names() -> None:
    assert parse_ref_name("runs/exp-1") == "runs/exp-1"
    for bad in ("runs", "runs/a/b", "runs/..", "/x", "runs/"):
        with pytest.raises(InvalidInputError):
            parse_ref_name(bad)


@pytest.mark.parametrize(
    ("data", "words"),
    [
        (b"{not json", "is not valid JSON"),
        (b"\xff\xfe", "is not valid JSON"),
        (b"[1, 2]", "is not a gradpipe manifest"),
        (b'{"type": "tensor", "format": "1"}', "has a malformed format field"),
    ],
)
def test_a_damaged_manifest_is_named_once(data: bytes, words: str) -> None:
    # The JSON parser's own message already names what it parsed: wrapping it must not
    # say "ref 'x' is not valid JSON: ref 'x' is not valid JSON: ...".
    with pytest.raises(IntegrityError) as caught:
        decode_manifest(data, what="ref 'runs/r'")
    message = str(caught.value)
    assert message.startswith(f"ref 'runs/r' {words}")
    assert message.count("runs/r") == 1
    assert message.count(words) == 1


@pytest.mark.parametrize("bad", ["x" * 10_000, "evil\n\u202erun", "a\x1b[2Jb"])
def test_name_errors_show_the_name_printable_and_short(bad: str) -> None:
    for check in (parse_name, parse_ref_name, lambda n: parse_ref_name(f"runs/{n}")):
        with pytest.raises(InvalidInputError) as caught:
            check(bad)
        message = str(caught.value)
        assert message.isprintable()
        assert len(message) < 300
