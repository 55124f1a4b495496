"""CRC-32 of pieces read apart, joined: equal to zlib's CRC-32 of the whole, for any split."""

from __future__ import annotations

import itertools
import zlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gradpipe.errors import InvalidInputError
from gradpipe.formats.checksum import (
    check_crc32,
    crc32_combine,
    crc32_remove_prefix,
    join_crc32,
)


@given(st.binary(max_size=300), st.binary(max_size=300))
def test_combine_and_remove_prefix_match_zlib(a: bytes, b: bytes) -> None:
    whole = zlib.crc32(a + b)
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == whole
    assert crc32_remove_prefix(whole, zlib.crc32(a), len(b)) == zlib.crc32(b)


@given(st.binary(max_size=2000), st.lists(st.integers(0, 2000), max_size=8))
def test_join_of_any_split_is_the_crc_of_the_whole(data: bytes, cuts: list[int]) -> None:
    bounds = [0, *sorted(min(c, len(data)) for c in cuts), len(data)]
    pieces = [data[lo:hi] for lo, hi in itertools.pairwise(bounds)]
    assert join_crc32((zlib.crc32(p), len(p)) for p in pieces) == (zlib.crc32(data), len(data))


def test_long_lengths_shift_as_zlib_does() -> None:
    # A length of a few MiB goes through 22 powers of x in the table, not only the first.
    zeros = bytes(3 << 20)
    head = zlib.crc32(b"grad")
    assert crc32_combine(head, zlib.crc32(zeros), len(zeros)) == zlib.crc32(b"grad" + zeros)
    twice = crc32_combine(zlib.crc32(zeros), zlib.crc32(zeros), len(zeros))
    assert twice == zlib.crc32(zeros + zeros)


def test_a_mismatch_names_the_file_and_tensor_and_says_what_to_do() -> None:
    check_crc32("d.npz", "w", 5, 5)
    with pytest.raises(InvalidInputError, match=r"'d\.npz': tensor 'w' is damaged.*copy it again"):
        check_crc32("d.npz", "w", 5, 6)
