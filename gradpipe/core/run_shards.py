"""Shards of a run: its entries in small B+-trees of immutable manifests, keyed by step.

A run that outgrows one shard (:attr:`TreeShape.leaf` entries) keeps its dumps,
and its aggregates, in a tree of :class:`RunShard` manifests instead of in its
own manifest (format 4, ``docs/design/012-run-shards.md``). A leaf holds up to
``leaf`` entries in ``(step, peer)`` (or ``(step, name)``) order; an inner shard
holds up to ``branch`` links, each naming a shard one level down by id, with
the first key and the number of entries below it. Every shard is named by
the hash of its content, so a commit writes only the shards on the paths to
the entries it adds, plus the run's manifest, and reuses every other subtree
by id: O(log N + entries committed) bytes instead of the whole run.

Pure logic: shards are read through a *loader* (:class:`ShardCache`, which
reads through a store) and the shards a change makes are returned for the
caller to store before it moves the run's ref.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from itertools import pairwise
from typing import Any, ClassVar, Final

from gradpipe.core.display import printable
from gradpipe.core.ids import parse_id
from gradpipe.core.manifest import Manifest, ManifestSource, manifest_id
from gradpipe.core.run_entries import AggregateEntry, AnalysisEntry, DumpEntry, EntryKey
from gradpipe.errors import IntegrityError, InvalidInputError

__all__ = [
    "DEFAULT_SHAPE",
    "KINDS",
    "RunShard",
    "ShardCache",
    "ShardLink",
    "ShardLoader",
    "TreeShape",
    "Upserted",
    "find",
    "link_mismatch",
    "scan",
    "upsert",
]

Entry = DumpEntry | AggregateEntry | AnalysisEntry

#: The trees, by the ``kind`` their shards carry, and their entries' class: a run's dumps
#: and aggregates, and the analyses of a run's index (format 6).
KINDS: Final[dict[str, type[DumpEntry] | type[AggregateEntry] | type[AnalysisEntry]]] = {
    "dumps": DumpEntry,
    "aggregates": AggregateEntry,
    "analyses": AnalysisEntry,
}

#: Shards read per batched round trip (a leaf is tens of KB: 64 still hide S3's latency).
_READ_BATCH: Final = 64


@dataclass(frozen=True, slots=True)
class TreeShape:
    """How big shards get: entries per leaf, links per inner shard.

    A run whose entries fit one leaf keeps them in its own manifest (as
    gradpipe did before shards). Readers accept shards of any size; the shape
    only decides where a writer splits.
    """

    leaf: int = 128
    branch: int = 64

    def __post_init__(self) -> None:
        if self.leaf < 1 or self.branch < 2:
            raise InvalidInputError(
                "a tree shape needs at least 1 entry per leaf and 2 links per inner shard, "
                f"got {self.leaf} and {self.branch}"
            )


#: The shape writers use: a leaf of 128 dump entries is ~20 KB of JSON (~9 KB stored).
DEFAULT_SHAPE: Final = TreeShape()


@dataclass(frozen=True, slots=True)
class ShardLink:
    """A shard named from above: its id, the key of its first entry, how many entries it holds."""

    id: str
    first: EntryKey
    count: int

    def __post_init__(self) -> None:
        if self.count < 1:
            raise InvalidInputError(f"shard {self.id} links {self.count} entries; a shard has some")

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "first": [self.first[0], self.first[1]], "count": self.count}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ShardLink:
        step, name = data["first"]
        return cls(parse_id(data["id"]), (int(step), str(name)), int(data["count"]))


@dataclass(frozen=True)
class RunShard(Manifest):
    """One node of a run's tree: a leaf of entries (level 0) or links to shards one level down."""

    type: ClassVar[str] = "run-shard"

    #: ``"dumps"`` or ``"aggregates"``: which of the run's trees the shard belongs to.
    kind: str
    level: int
    entries: tuple[Entry, ...] = ()
    children: tuple[ShardLink, ...] = ()

    def __post_init__(self) -> None:
        cls = KINDS.get(self.kind)
        if cls is None:
            raise InvalidInputError(f"run shard of unknown kind {printable(self.kind)}")
        if self.level < 0:
            raise InvalidInputError(f"run shard at level {self.level}")
        if self.level == 0:
            if self.children or not self.entries:
                raise InvalidInputError("a leaf shard holds entries, and only entries")
            if not all(isinstance(e, cls) for e in self.entries):
                raise InvalidInputError(f"a shard of {self.kind} holds another kind of entry")
        elif self.entries or not self.children:
            raise InvalidInputError("an inner shard holds links, and only links")
        if any(a >= b for a, b in pairwise(self.keys)):
            raise InvalidInputError(f"a shard of {self.kind} lists its keys out of order or twice")

    @cached_property
    def keys(self) -> list[EntryKey]:
        """The sort keys of the entries (leaf) or the first keys of the children (inner)."""
        if self.level == 0:
            return [e.sort_key for e in self.entries]
        return [c.first for c in self.children]

    @property
    def first(self) -> EntryKey:
        """The key of the first entry below this shard."""
        return self.keys[0]

    @cached_property
    def count(self) -> int:
        """How many entries are below this shard."""
        return len(self.entries) if self.level == 0 else sum(c.count for c in self.children)

    def manifest_children(self) -> Iterator[str]:
        if self.level == 0:
            return (e.target for e in self.entries)
        return (c.id for c in self.children)

    def format_needed(self) -> int:
        return 6 if self.kind == "analyses" else 4

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "level": self.level}
        if self.level == 0:
            out["entries"] = [e.to_dict() for e in self.entries]
        else:
            out["children"] = [c.to_dict() for c in self.children]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunShard:
        kind = str(data["kind"])
        entry_cls = KINDS.get(kind)
        if entry_cls is None:
            raise InvalidInputError(f"run shard of unknown kind {printable(kind)}")
        return cls(
            kind,
            int(data["level"]),
            tuple(entry_cls.from_dict(e) for e in data.get("entries", ())),
            tuple(ShardLink.from_dict(c) for c in data.get("children", ())),
        )


#: Reads shards by id (in one batch), in the order asked.
ShardLoader = Callable[[Sequence[str]], list[RunShard]]


class ShardCache:
    """The shards one state of a run has read or made, by id; the rest read through ``source``.

    Shards are immutable, so every state derived from one read of a run (a
    commit's merged run, say) shares its cache.
    """

    def __init__(self, source: ManifestSource | None, where: str) -> None:
        self.source = source
        self.where = where
        self.nodes: dict[str, RunShard] = {}

    def __reduce__(self) -> tuple[Any, ...]:
        return (ShardCache, (self.source, self.where))  # a cache is rebuilt, not shipped

    def load(self, ids: Sequence[str]) -> list[RunShard]:
        """The shards ``ids``, reading those not cached in batches."""
        missing = [i for i in dict.fromkeys(ids) if i not in self.nodes]
        if not missing:
            return [self.nodes[i] for i in ids]
        source = self.source
        if source is None:
            raise InvalidInputError(
                f"the manifest of {self.where} was decoded without a store to read its shards "
                "from; read runs with store.get_typed or gradpipe.storage.catalog.read_run"
            )
        for lo in range(0, len(missing), _READ_BATCH):
            batch = missing[lo : lo + _READ_BATCH]
            found = source.get_typed_many(batch, RunShard, context=f"shard of {self.where}")
            self.nodes.update(zip(batch, found, strict=True))
        return [self.nodes[i] for i in ids]


def link_mismatch(link: ShardLink, node: RunShard, kind: str, level: int | None) -> str | None:
    """Why ``node`` is not the shard ``link`` promises (kind, level, first key, count), or None."""
    if node.kind != kind:
        return f"a shard of {node.kind} where one of {kind} was expected"
    if level is not None and node.level != level:
        return f"a shard at level {node.level} where level {level} was expected"
    if node.first != link.first or node.count != link.count:
        return (
            f"its link says first key {list(link.first)} and {link.count} entries, the shard "
            f"has {list(node.first)} and {node.count}"
        )
    return None


def _load_links(
    links: Sequence[ShardLink], kind: str, level: int | None, load: ShardLoader, where: str
) -> list[RunShard]:
    """The shards ``links`` name (one batch), each checked against its link."""
    nodes = load([link.id for link in links])
    for link, node in zip(links, nodes, strict=True):
        why = link_mismatch(link, node, kind, level)
        if why is not None:
            raise IntegrityError(
                f"shard {link.id} of {where} does not match its link: {why}; run `gradpipe verify`"
            )
    return nodes


def _child_index(node: RunShard, key: EntryKey) -> int:
    """Which child of an inner shard ``key`` belongs under (keys before all: the first)."""
    return max(bisect_right(node.keys, key) - 1, 0)


def find(
    top: ShardLink, keys: Sequence[EntryKey], kind: str, load: ShardLoader, where: str
) -> dict[EntryKey, Entry]:
    """The entries of ``keys`` in the tree under ``top`` (absent keys left out).

    The tree is walked level by level for all keys at once: one batched read
    per level, of the shards on the keys' paths only.
    """
    found: dict[EntryKey, Entry] = {}
    [node] = _load_links([top], kind, None, load, where)
    frontier: list[tuple[RunShard, list[EntryKey]]] = [(node, sorted(set(keys)))]
    while frontier:
        if frontier[0][0].level == 0:
            for leaf, wanted in frontier:
                for key in wanted:
                    i = bisect_right(leaf.keys, key) - 1
                    if i >= 0 and leaf.keys[i] == key:
                        found[key] = leaf.entries[i]
            return found
        routed: dict[str, tuple[ShardLink, list[EntryKey]]] = {}
        for parent, wanted in frontier:
            for key in wanted:
                child = parent.children[_child_index(parent, key)]
                routed.setdefault(child.id, (child, []))[1].append(key)
        links = [link for link, _ in routed.values()]
        nodes = _load_links(links, kind, frontier[0][0].level - 1, load, where)
        frontier = [(n, wanted) for n, (_, wanted) in zip(nodes, routed.values(), strict=True)]
    return found


def scan(
    top: ShardLink,
    kind: str,
    load: ShardLoader,
    where: str,
    *,
    lo: EntryKey | None = None,
    hi: EntryKey | None = None,
) -> list[Entry]:
    """The entries under ``top`` with ``lo <= key < hi``, in order (one batched read per level)."""
    [node] = _load_links([top], kind, None, load, where)
    nodes = [node]
    while nodes[0].level > 0:
        links: list[ShardLink] = []
        for parent in nodes:
            for i, child in enumerate(parent.children):
                if hi is not None and child.first >= hi:
                    break
                after = parent.children[i + 1].first if i + 1 < len(parent.children) else None
                if lo is not None and after is not None and after <= lo:
                    continue
                links.append(child)
        if not links:
            return []
        nodes = _load_links(links, kind, nodes[0].level - 1, load, where)
    return [
        e
        for leaf in nodes
        for e in leaf.entries
        if (lo is None or e.sort_key >= lo) and (hi is None or e.sort_key < hi)
    ]


@dataclass
class Upserted:
    """A tree after :func:`upsert`: where it is now, and the shards to store first."""

    #: The tree's top shard, or None while its entries fit in the run's manifest.
    top: ShardLink | None
    #: The entries kept in the run's manifest itself (empty once the tree has shards).
    inline: tuple[Entry, ...]
    #: Shards made by the change, by id; unchanged subtrees are reused, not listed.
    made: dict[str, RunShard] = field(default_factory=dict)


def _merge(old: Sequence[Entry], new: Sequence[Entry]) -> tuple[Entry, ...]:
    """``old`` (in key order) with ``new`` added; an entry of the same key is replaced."""
    by_key = {e.sort_key: e for e in new}
    ordered = sorted(by_key)
    if not old or ordered[0] > old[-1].sort_key:  # appending, the usual case
        return (*old, *(by_key[k] for k in ordered))
    merged = {e.sort_key: e for e in old}
    merged.update(by_key)
    return tuple(merged[k] for k in sorted(merged))


def _cut(items: Sequence[Any], limit: int, rightmost: bool) -> list[Sequence[Any]]:
    """``items`` in pieces of at most ``limit``.

    At the right edge of the tree, where a run grows as steps go by, pieces
    are filled from the left (the last one takes the rest and the next
    commit's entries); elsewhere the pieces are even, leaving room on both
    sides for entries that arrive late.
    """
    n = len(items)
    if n <= limit:
        return [items]
    if rightmost:
        return [items[i : i + limit] for i in range(0, n, limit)]
    pieces = -(-n // limit)
    size, extra = divmod(n, pieces)
    out, start = [], 0
    for j in range(pieces):
        stop = start + size + (1 if j < extra else 0)
        out.append(items[start:stop])
        start = stop
    return out


class _Builder:
    """Makes new shards for :func:`upsert`: names each by its hash, keeps it for the caller."""

    def __init__(self, kind: str, shape: TreeShape, load: ShardLoader, where: str) -> None:
        self.kind, self.shape, self.load, self.where = kind, shape, load, where
        self.made: dict[str, RunShard] = {}

    def leaves(self, entries: Sequence[Entry], rightmost: bool) -> list[ShardLink]:
        pieces = _cut(entries, self.shape.leaf, rightmost)
        return [self._make(RunShard(self.kind, 0, entries=tuple(p))) for p in pieces]

    def inner(self, level: int, links: Sequence[ShardLink], rightmost: bool) -> list[ShardLink]:
        pieces = _cut(links, self.shape.branch, rightmost)
        return [self._make(RunShard(self.kind, level, children=tuple(p))) for p in pieces]

    def _make(self, node: RunShard) -> ShardLink:
        node_id = manifest_id(node)
        self.made[node_id] = node
        return ShardLink(node_id, node.first, node.count)

    def rebuild(self, node: RunShard, new: list[Entry], rightmost: bool) -> list[ShardLink] | None:
        """The shards that replace ``node`` once ``new`` is added (None: nothing changed)."""
        if node.level == 0:
            merged = _merge(node.entries, new)
            if merged == node.entries:  # recording what is recorded: no shard to write
                return None
            return self.leaves(merged, rightmost)
        groups: dict[int, list[Entry]] = {}
        for entry in new:
            groups.setdefault(_child_index(node, entry.sort_key), []).append(entry)
        touched = sorted(groups)
        kids = _load_links(
            [node.children[i] for i in touched], self.kind, node.level - 1, self.load, self.where
        )
        last = len(node.children) - 1
        replaced: dict[int, list[ShardLink]] = {}
        for i, kid in zip(touched, kids, strict=True):
            links = self.rebuild(kid, groups[i], rightmost and i == last)
            if links is not None:
                replaced[i] = links
        if not replaced:
            return None
        children = [link for i, old in enumerate(node.children) for link in replaced.get(i, [old])]
        return self.inner(node.level, children, rightmost)


def upsert(
    top: ShardLink | None,
    inline: Sequence[Entry],
    new: Sequence[Entry],
    kind: str,
    load: ShardLoader,
    *,
    where: str,
    shape: TreeShape | None = None,
) -> Upserted:
    """Add ``new`` entries to a tree (an entry of the same key is replaced).

    The tree is either ``inline`` (the entries a run's manifest holds itself,
    ``top`` None) or the shards under ``top``. Only the shards on the paths
    to the new keys are read (one batch per level) and rewritten; a tree that
    outgrows one leaf moves out of the run's manifest into shards.
    ``shape`` defaults to :data:`DEFAULT_SHAPE`.
    """
    shape = shape or DEFAULT_SHAPE
    if not new:
        return Upserted(top, tuple(inline))
    builder = _Builder(kind, shape, load, where)
    if top is None:
        merged = _merge(inline, new)
        if len(merged) <= shape.leaf:
            return Upserted(None, merged)
        links = builder.leaves(merged, rightmost=True)
        level = 0
    else:
        find(top, [e.sort_key for e in new], kind, load, where)  # read the paths, level by level
        [node] = _load_links([top], kind, None, load, where)
        rebuilt = builder.rebuild(node, list(new), rightmost=True)
        if rebuilt is None:
            return Upserted(top, ())
        links, level = rebuilt, node.level
    while len(links) > 1:
        level += 1
        links = builder.inner(level, links, rightmost=True)
    return Upserted(links[0], (), builder.made)
