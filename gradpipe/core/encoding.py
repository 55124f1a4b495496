"""Canonical JSON: one byte string per value, so equal manifests get equal ids.

Keys are sorted, separators carry no whitespace, text is UTF-8. JSON has no
NaN or infinities, so non-finite floats are written as the strings ``"NaN"``,
``"Infinity"`` and ``"-Infinity"``, as zarr v3 does for fill values.
"""

from __future__ import annotations

import json
import math
from typing import Any

from gradpipe.core.display import printable
from gradpipe.errors import InvalidInputError

__all__ = [
    "decode_float",
    "encode_float",
    "from_json_bytes",
    "reject_duplicate_keys",
    "to_json_bytes",
]

_NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def encode_float(value: float | None) -> float | str | None:
    """A float as a JSON-safe value."""
    if value is None or math.isfinite(value):
        return value
    if math.isnan(value):
        return "NaN"
    return "Infinity" if value > 0 else "-Infinity"


def decode_float(value: float | int | str | None) -> float | None:
    """The inverse of :func:`encode_float`."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            return _NON_FINITE[value]
        except KeyError:
            raise InvalidInputError(f"{printable(value)} is not a float") from None
    return float(value)


def to_json_bytes(value: Any) -> bytes:
    """Canonical JSON bytes of a JSON-able value."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def from_json_bytes(data: bytes, *, what: str) -> Any:
    """Parse JSON bytes, naming ``what`` in the error."""
    try:
        return json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidInputError(f"{what} is not valid JSON: {exc}") from None


def reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook`` for :func:`json.loads` that refuses a key given twice.

    Plain JSON parsing keeps the last value silently; in a file header that
    would hide a tensor or a metadata field.
    """
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {printable(key)}")
        out[key] = value
    return out
