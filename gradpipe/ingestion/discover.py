"""Finding the dump files of a run from a pattern with ``{step}`` and ``{peer}`` fields."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import fsspec

from gradpipe.core.display import PATH_LIMIT, printable
from gradpipe.core.names import parse_name
from gradpipe.errors import InvalidInputError, NotFoundError
from gradpipe.formats.dump import check_regular_file

__all__ = ["DumpFile", "Failure", "discover_dumps", "parse_pattern"]

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


@dataclass(frozen=True, slots=True)
class Failure:
    """A dump that could not be ingested, and why."""

    path: str
    step: int
    peer: str
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "step": self.step, "peer": self.peer, "reason": self.reason}


def parse_pattern(pattern: str) -> tuple[str, re.Pattern[str]]:
    """The glob and the regex of a dump pattern (a filesystem path, no protocol).

    >>> glob, regex = parse_pattern("d/step={step}/peer={peer}.safetensors")
    >>> glob
    'd/step=*/peer=*.safetensors'
    >>> regex.fullmatch("d/step=007/peer=p1.safetensors").groupdict()
    {'step': '007', 'peer': 'p1'}
    """
    fields = _FIELD.findall(pattern)
    shown = printable(pattern, limit=PATH_LIMIT)
    if "step" not in fields:
        raise InvalidInputError(
            f"pattern {shown} has no {{step}} field; write e.g. "
            "'dumps/step={step}/peer={peer}.safetensors'"
        )
    leftover = _FIELD.sub("", pattern)
    if "{" in leftover or "}" in leftover:
        raise InvalidInputError(f"pattern {shown} has a field other than {{step}} and {{peer}}")
    if any(c in leftover for c in "*?["):
        raise InvalidInputError(f"pattern {shown}: use {{step}}/{{peer}} fields, not wildcards")
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
) -> tuple[fsspec.AbstractFileSystem, list[DumpFile], list[Failure]]:
    """Expand ``pattern`` into dump files sorted by (step, peer).

    Returns the filesystem, the dumps, and the files refused as
    failures (a peer name that is not usable; a path that is not a regular
    file, such as a FIFO, a socket, a device or a directory, refused before
    anything opens it, since opening a FIFO blocks for ever; two files claiming
    the same (step, peer), as ``step=7`` and ``step=007`` would): a bad file
    never stops the good ones. Raises :class:`NotFoundError` when nothing
    matches and :class:`InvalidInputError` for a bad pattern.
    """
    fs, path = fsspec.core.url_to_fs(pattern, **(storage_options or {}))
    glob, regex = parse_pattern(path)
    found = fs.glob(glob, detail=True)
    claims: dict[tuple[int, str], list[DumpFile]] = {}
    refused: list[Failure] = []
    for candidate, info in sorted(found.items()):
        if candidate.endswith(".json"):
            continue  # sidecar metadata files ride along with their dump
        # A directory (or FIFO, socket, ...) named like a dump is refused below, and
        # the report lists it, rather than a (step, peer) silently going missing.
        match = regex.fullmatch(candidate.rstrip("/"))
        if match is None:
            continue
        step = int(match["step"])
        raw_peer = match.groupdict().get("peer") or SOLE_PEER
        try:
            # The peer keeps its exact text (JSON reports show it); messages escape it.
            peer = _parse_peer(raw_peer, candidate)
        except InvalidInputError as exc:
            refused.append(Failure(candidate, step, raw_peer, f"{exc}; rename the file"))
            continue
        try:
            check_regular_file(fs, candidate, info)
        except InvalidInputError as exc:
            refused.append(Failure(candidate, step, peer, str(exc)))
            continue
        dump = DumpFile(step, peer, candidate, int(info.get("size") or 0), _fingerprint(info))
        claims.setdefault((step, peer), []).append(dump)
    if not claims and not refused:
        raise NotFoundError(
            f"no dump file matches {printable(pattern, limit=PATH_LIMIT)} "
            f"(searched {printable(glob, limit=PATH_LIMIT)})"
        )
    dumps = []
    for (step, peer), group in sorted(claims.items()):
        if len(group) == 1:
            dumps.append(group[0])
            continue
        paths = " and ".join(printable(d.path, limit=PATH_LIMIT) for d in group)
        reason = (
            f"{paths} all claim step {step}, peer {printable(peer)}; remove all but one or make "
            "the pattern more specific"
        )
        refused.extend(Failure(d.path, step, peer, reason) for d in group)
    return fs, dumps, refused


def _parse_peer(raw: str, path: str) -> str:
    """The peer name cut out of the file name ``path``; an error names the file.

    The path is formatted only for a refusal: a glob may match a million files.
    """
    try:
        return parse_name(raw, what="peer name")
    except InvalidInputError:
        pass
    return parse_name(raw, what=f"peer name in {printable(path, limit=PATH_LIMIT)}")
