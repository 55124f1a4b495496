"""One state of a ref, stored as a manifest so that a ref's history is a chain of blocks."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

from gradpipe.core.ids import parse_id
from gradpipe.core.manifest import Manifest
from gradpipe.core.names import parse_ref_name

__all__ = ["REF_TARGET_TYPES", "RefEntry", "target_type"]

#: What the refs of each kind point at (a manifest ``type``); a kind not listed
#: may point at anything. A ref moved by hand to another kind of object is
#: damage that verify reports and readers refuse.
REF_TARGET_TYPES: dict[str, str] = {
    "analytics": "analytics",
    "rounds": "rounds",
    "runs": "run",
    "snapshots": "snapshot",
    "tensors": "tensor",
}


def target_type(ref: str) -> str | None:
    """The manifest type ref ``ref`` (``kind/name``) must point at, if its kind says."""
    return REF_TARGET_TYPES.get(ref.partition("/")[0])


@dataclass(frozen=True)
class RefEntry(Manifest):
    """One state of a ref: what it points at, and the entry it replaced.

    Entries chain through ``previous`` into the ref's history (its reflog).
    ``write_id`` is unique per attempted update, so a writer whose response was
    lost can tell its own landed write from someone else's.
    """

    type: ClassVar[str] = "ref"

    ref: str
    target: str | None
    previous: str | None
    time: str
    write_id: str
    message: str = ""
    meta: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        parse_ref_name(self.ref)
        if self.target is not None:
            parse_id(self.target)
        if self.previous is not None:
            parse_id(self.previous)

    def manifest_children(self) -> Iterator[str]:
        # The history chain is kept; old targets are not roots (see docs on gc).
        return iter(() if self.previous is None else (self.previous,))

    def to_dict(self) -> dict[str, Any]:
        return {
            "ref": self.ref,
            "target": self.target,
            "previous": self.previous,
            "time": self.time,
            "write_id": self.write_id,
            "message": self.message,
            "meta": dict(self.meta),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RefEntry:
        return cls(
            ref=data["ref"],
            target=data["target"],
            previous=data["previous"],
            time=data["time"],
            write_id=data["write_id"],
            message=data.get("message", ""),
            meta={str(k): str(v) for k, v in data.get("meta", {}).items()},
        )
