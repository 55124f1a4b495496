"""Everything reachable from the refs: the graph that verify checks and gc keeps."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field

from gradpipe.core.display import printable
from gradpipe.core.ids import block_key, hash_bytes, parse_id
from gradpipe.core.manifest import Manifest, decode_manifest
from gradpipe.core.ref_entry import target_type
from gradpipe.errors import GradpipeError, IntegrityError, NotFoundError, UnsupportedFormatError
from gradpipe.storage.blocks import decode_block
from gradpipe.storage.store import Store

__all__ = ["Problem", "Reachable", "Visitor", "find_missing", "walk_reachable"]


@dataclass(frozen=True, slots=True)
class Problem:
    """A missing, corrupt or misplaced object, and where it was needed."""

    # "missing" | "corrupt" | "corrupt inline" | "bad delta" | "bad shard" | "unreadable"
    # | "wrong kind"
    kind: str
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


#: A manifest to read: its id, the context that needs it, and the type it must
#: have (None: any).
Wanted = tuple[str, str, str | None]
#: Called with each manifest the walk reads: (its id, the manifest, its context).
Visitor = Callable[[str, Manifest, str], None]

# Manifests fetched per batched round trip while walking. A dump manifest holds
# its small tensors inline (up to a few MB for a large model), so batches stay
# modest: 64 in flight still hide S3's latency.
_BATCH = 64


def _roots(store: Store, found: Reachable, skip: Collection[str] = ()) -> Iterator[Wanted]:
    """Every ref's current entry and target (but the refs named in ``skip``).

    A ref that cannot be read is recorded in ``found.problems``, not raised:
    verify must report it and gc must refuse to run.
    """
    for name in store.refs.names():
        if name in skip:
            continue
        try:
            current, entry = store.refs.read(name)
        except GradpipeError as exc:
            kind = "unreadable" if isinstance(exc, UnsupportedFormatError) else "corrupt"
            found.problems.append(Problem(kind, f"refs/{name}", f"ref {printable(name)}", str(exc)))
            continue
        if current is None:
            continue
        # The current entry was written as a block too; it heads the history.
        yield hash_bytes(current.data), f"history of ref {printable(name)}", "ref"
        if entry is not None and entry.target is not None:
            yield entry.target, f"ref {printable(name)}", target_type(name)


def _read_levels(
    store: Store, level: list[Wanted], done: Collection[str]
) -> Iterator[tuple[str, str, Manifest | Problem]]:
    """Read manifests level by level, in batches, each once; queue their manifest children.

    Yields ``(id, context, manifest or problem)`` for every manifest reachable
    from ``level`` that is not in ``done``. On S3 a level is a few concurrent
    round trips instead of one request after another.
    """
    seen: set[str] = set()
    while level:
        wanted: dict[str, Wanted] = {}
        for item in level:
            if item[0] not in done and item[0] not in seen and item[0] not in wanted:
                wanted[item[0]] = item
        seen.update(wanted)
        level = []
        items = list(wanted.values())
        for lo in range(0, len(items), _BATCH):
            batch = items[lo : lo + _BATCH]
            frames = store.backend.read_many([block_key(parse_id(i)) for i, _, _ in batch])
            for (manifest_id, context, kind), frame in zip(batch, frames, strict=True):
                manifest = _parse(manifest_id, context, frame, kind)
                if isinstance(manifest, Manifest):
                    here = f"{manifest.type} {manifest_id} ({context})"
                    level.extend((child, here, None) for child in manifest.manifest_children())
                yield manifest_id, context, manifest


def walk_reachable(
    store: Store,
    *,
    known: Reachable | None = None,
    visit: Visitor | None = None,
    skip_refs: Collection[str] = (),
) -> Reachable:
    """Read every manifest reachable from the refs (checking each) and collect ids.

    The walk goes level by level (refs, runs, dumps, tensors). Data blocks
    are collected, not read: :func:`gradpipe.storage.verify.verify` reads
    them, gc does not need to. A ref whose target is not the kind of object
    its name says (``runs/x`` at a tensor) is a problem, as a damaged one is.

    With ``known`` (an earlier walk), manifests already walked are not read
    again: they are immutable, so their children are known. gc walks once
    without the lock and again, incrementally, while holding it. ``visit``
    sees every manifest read (verify checks what is kept inside manifests).
    ``skip_refs`` leaves those refs out (what else keeps a block alive).
    """
    found = Reachable()
    if known is not None:
        found.manifests.update(known.manifests)
        found.data.update(known.data)
    roots = list(_roots(store, found, skip_refs))
    for manifest_id, context, manifest in _read_levels(store, roots, set(found.manifests)):
        found.manifests[manifest_id] = context
        if isinstance(manifest, Problem):
            found.problems.append(manifest)
            continue
        here = f"{manifest.type} {manifest_id} ({context})"
        if visit is not None:
            visit(manifest_id, manifest, here)
        for i, block_id in enumerate(manifest.data_children()):
            found.data.setdefault(block_id, f"{here}, block {i}")
    return found


def _parse(
    manifest_id: str, context: str, frame: bytes | Exception, kind: str | None
) -> Manifest | Problem:
    """A fetched manifest, or the problem that keeps it from being read."""
    try:
        if isinstance(frame, Exception):
            raise frame
        data = decode_block(frame, manifest_id, context=context)
        manifest = decode_manifest(bytes(data), what=f"manifest {manifest_id} ({context})")
        for _ in manifest.embedded_manifests():  # decoded lazily elsewhere; a walk checks all
            pass
    except NotFoundError as exc:
        return Problem("missing", manifest_id, context, str(exc))
    except IntegrityError as exc:
        return Problem("corrupt", manifest_id, context, str(exc))
    except GradpipeError as exc:
        return Problem("unreadable", manifest_id, context, str(exc))
    if kind is not None and manifest.type != kind:
        detail = (
            f"a {manifest.type} manifest where a {kind} was expected: the ref was moved to the "
            "wrong object; move it back to an earlier entry of its history"
        )
        return Problem("wrong kind", manifest_id, context, detail)
    return manifest


def find_missing(store: Store, roots: Sequence[tuple[str, str]]) -> list[list[Problem]]:
    """For each ``(manifest id, context)`` root, the objects below it that cannot be read.

    Manifests are read and checked; data blocks are only checked for presence
    (one batched existence check, no data read), so this costs what gc's walk
    costs, not what verify's does. A block shared by several roots is reported
    under each of them. Used by ``ingest(repair=True)`` to find recorded dumps
    whose objects went missing.
    """
    children: dict[str, list[str]] = {}
    problems: dict[str, Problem] = {}
    data: dict[str, str] = {}
    level: list[Wanted] = [(root, context, None) for root, context in roots]
    for manifest_id, context, manifest in _read_levels(store, level, ()):
        if isinstance(manifest, Problem):
            problems[manifest_id] = manifest
            continue
        here = f"{manifest.type} {manifest_id} ({context})"
        blocks = list(manifest.data_children())
        children[manifest_id] = [*manifest.manifest_children(), *blocks]
        for i, block_id in enumerate(blocks):
            data.setdefault(block_id, f"{here}, block {i}")
    items = list(data.items())
    for lo in range(0, len(items), _BATCH * 4):
        batch = items[lo : lo + _BATCH * 4]
        mtimes = store.backend.mtimes([block_key(parse_id(i)) for i, _ in batch])
        for (block_id, context), mtime in zip(batch, mtimes, strict=True):
            if mtime is None:
                problems[block_id] = Problem("missing", block_id, context, "block not found")
    return [_below(root, children, problems) for root, _ in roots]


def _below(
    root: str, children: dict[str, list[str]], problems: dict[str, Problem]
) -> list[Problem]:
    """The problems of ``root`` and everything under it."""
    out: list[Problem] = []
    seen: set[str] = set()
    todo = [root]
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if node in problems:
            out.append(problems[node])
        todo.extend(children.get(node, ()))
    return out
