"""Everything reachable from the refs: the graph that verify checks and gc keeps."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from gradpipe.core.ids import hash_bytes, parse_id
from gradpipe.core.manifest import Manifest
from gradpipe.errors import GradpipeError, IntegrityError, NotFoundError, UnsupportedFormatError
from gradpipe.storage.store import Store

__all__ = ["Problem", "Reachable", "walk_reachable"]


@dataclass(frozen=True, slots=True)
class Problem:
    """A missing or corrupt object, and where it was needed."""

    kind: str  # "missing" | "corrupt" | "unreadable"
    id: str
    context: str
    detail: str

    def to_dict(self) -> dict[str, str]:
        """JSON-able form."""
        return {"kind": self.kind, "id": self.id, "context": self.context, "detail": self.detail}


@dataclass
class Reachable:
    """Ids reachable from refs, each with the first context that reached it."""

    manifests: dict[str, str] = field(default_factory=dict)
    data: dict[str, str] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self.manifests or block_id in self.data


def _roots(store: Store, found: Reachable) -> Iterator[tuple[str, str]]:
    """(manifest id, context) of every ref's current entry and target.

    A ref that cannot be read is recorded in ``found.problems``, not raised:
    verify must report it and gc must refuse to run.
    """
    for info in store.backend.list("refs"):
        parts = info.key.split("/")
        if len(parts) != 3 or parts[2].startswith("."):
            continue
        name = f"{parts[1]}/{parts[2]}"
        current = store.backend.read_versioned(info.key)
        if current is None:
            continue
        try:
            entry = store.refs.entry(name)
        except GradpipeError as exc:
            kind = "unreadable" if isinstance(exc, UnsupportedFormatError) else "corrupt"
            found.problems.append(Problem(kind, info.key, f"ref {name!r}", str(exc)))
            continue
        # The current entry was written as a block too; it heads the history.
        yield hash_bytes(current.data), f"history of ref {name!r}"
        if entry is not None and entry.target is not None:
            yield entry.target, f"ref {name!r}"


def walk_reachable(store: Store) -> Reachable:
    """Read every manifest reachable from the refs (checking each) and collect ids.

    Data blocks are collected, not read: :func:`gradpipe.storage.verify.verify`
    reads them, gc does not need to.
    """
    found = Reachable()
    todo: list[tuple[str, str]] = list(_roots(store, found))
    while todo:
        manifest_id, context = todo.pop()
        if manifest_id in found.manifests:
            continue
        found.manifests[manifest_id] = context
        try:
            manifest: Manifest = store.get_manifest(parse_id(manifest_id), context=context)
        except NotFoundError as exc:
            found.problems.append(Problem("missing", manifest_id, context, str(exc)))
            continue
        except IntegrityError as exc:
            found.problems.append(Problem("corrupt", manifest_id, context, str(exc)))
            continue
        except GradpipeError as exc:
            found.problems.append(Problem("unreadable", manifest_id, context, str(exc)))
            continue
        kind = type(manifest).type
        here = f"{kind} {manifest_id} ({context})"
        todo.extend((child, here) for child in manifest.manifest_children())
        for i, block_id in enumerate(manifest.data_children()):
            found.data.setdefault(block_id, f"{here}, block {i}")
    return found
