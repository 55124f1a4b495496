"""Finding the dump files of a run from a pattern with ``{step}`` and ``{peer}`` fields."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import fsspec

from gradpipe.core.names import parse_name
from gradpipe.errors import InvalidInputError, NotFoundError

__all__ = ["DumpFile", "discover_dumps", "parse_pattern"]

_FIELD = re.compile(r"\{(step|peer)\}")
#: Peer name used when the pattern has no ``{peer}`` field (a single-process run).
SOLE_PEER = "0"


@dataclass(frozen=True, slots=True)
class DumpFile:
    """One discovered dump file: its (step, peer), path and fingerprint."""

    step: int
    peer: str
    path: str
    size: int
    fingerprint: str


def parse_pattern(pattern: str) -> tuple[str, re.Pattern[str]]:
    """The glob and the regex of a dump pattern (a filesystem path, no protocol).

    >>> glob, regex = parse_pattern("d/step={step}/peer={peer}.safetensors")
    >>> glob
    'd/step=*/peer=*.safetensors'
    >>> regex.fullmatch("d/step=007/peer=p1.safetensors").groupdict()
    {'step': '007', 'peer': 'p1'}
    """
    fields = _FIELD.findall(pattern)
    if "step" not in fields:
        raise InvalidInputError(
            f"pattern {pattern!r} has no {{step}} field; write e.g. "
            "'dumps/step={step}/peer={peer}.safetensors'"
        )
    leftover = _FIELD.sub("", pattern)
    if "{" in leftover or "}" in leftover:
        raise InvalidInputError(f"pattern {pattern!r} has a field other than {{step}} and {{peer}}")
    if any(c in leftover for c in "*?["):
        raise InvalidInputError(f"pattern {pattern!r}: use {{step}}/{{peer}} fields, not wildcards")
    regex, glob, seen = [], [], set()
    for piece in _FIELD.split(pattern):
        if piece in ("step", "peer") and f"{{{piece}}}" in pattern:
            if piece in seen:
                regex.append(f"(?P={piece})")
            else:
                regex.append(r"(?P<step>\d+)" if piece == "step" else r"(?P<peer>[^/]+?)")
                seen.add(piece)
            glob.append("*")
        else:
            regex.append(re.escape(piece))
            glob.append(piece)
    return "".join(glob), re.compile("".join(regex))


def _fingerprint(info: dict[str, Any]) -> str:
    """What identifies this version of a file without reading it."""
    size = int(info.get("size") or 0)
    etag = info.get("ETag") or info.get("etag")
    if etag:
        return f"size={size};etag={str(etag).strip(chr(34))}"
    mtime: Any = info.get("mtime") or info.get("LastModified") or info.get("created")
    if hasattr(mtime, "timestamp"):
        mtime = mtime.timestamp()
    return f"size={size};mtime={mtime}"


def discover_dumps(
    pattern: str, storage_options: dict[str, Any] | None = None
) -> tuple[fsspec.AbstractFileSystem, list[DumpFile]]:
    """Expand ``pattern`` into dump files sorted by (step, peer).

    Raises :class:`NotFoundError` when nothing matches and
    :class:`InvalidInputError` when two files claim the same (step, peer) or
    a peer name is not usable.
    """
    fs, path = fsspec.core.url_to_fs(pattern, **(storage_options or {}))
    glob, regex = parse_pattern(path)
    found = fs.glob(glob, detail=True)
    claims: dict[tuple[int, str], DumpFile] = {}
    for candidate, info in sorted(found.items()):
        if candidate.endswith(".json"):
            continue  # sidecar metadata files ride along with their dump
        # A directory named like a dump is kept: reading it fails, and the report
        # lists it, rather than a (step, peer) silently going missing.
        match = regex.fullmatch(candidate.rstrip("/"))
        if match is None:
            continue
        step = int(match["step"])
        peer = parse_name(
            match.groupdict().get("peer") or SOLE_PEER, what=f"peer name in {candidate}"
        )
        dump = DumpFile(step, peer, candidate, int(info.get("size") or 0), _fingerprint(info))
        other = claims.get((step, peer))
        if other is not None:
            raise InvalidInputError(
                f"{other.path} and {candidate} both claim step {step}, peer {peer!r}; "
                "remove one or make the pattern more specific"
            )
        claims[(step, peer)] = dump
    if not claims:
        raise NotFoundError(f"no dump file matches {pattern!r} (searched {glob!r})")
    return fs, [claims[key] for key in sorted(claims)]
