"""Manifests of training runs: one per dump, one per run.

A run ref (``runs/<name>``) points at a :class:`RunManifest`, which lists
every recorded dump with its source fingerprint (so a re-run of an ingest
can skip a file without reading it), the run's tensor schema (so every
dump of the run agrees on each tensor's dtype and shape) and the aggregates
computed from its dumps, each under its memo key (format 3). A run too large
for one shard keeps its entries in trees of shards (format 4,
:mod:`gradpipe.core.run_shards`); the accessors read the same either way.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, ClassVar, cast

from gradpipe.core.display import printable
from gradpipe.core.ids import parse_id
from gradpipe.core.manifest import Manifest, ManifestSource
from gradpipe.core.names import parse_name
from gradpipe.core.run_entries import AggregateEntry, DumpEntry, EntryKey, TensorSchema
from gradpipe.core.run_shards import (
    RunShard,
    ShardCache,
    ShardLink,
    TreeShape,
    find,
    scan,
    upsert,
)
from gradpipe.core.tensor_manifest import EmbeddedTensors, LazyTensors, TensorManifest
from gradpipe.errors import InvalidInputError

__all__ = [
    "AggregateEntry",
    "DumpEntry",
    "DumpManifest",
    "RunManifest",
    "TensorSchema",
    "merge_run",
    "record_aggregates",
]


@dataclass(frozen=True)
class DumpManifest(EmbeddedTensors, Manifest):
    """The tensors of one (run, step, peer), with metadata and provenance.

    ``tensors`` keeps the file's order (pairs of name and tensor id), so the
    dump lists its tensors as the file did. ``embedded`` holds the manifests of
    tensors kept inside this one (format 2: ingest embeds every tensor of a
    dump, so a dump is one object plus its large chunks); a tensor's id is the
    hash of its own encoding wherever it is kept.
    """

    type: ClassVar[str] = "dump"

    run: str
    step: int
    peer: str
    tensors: tuple[tuple[str, str], ...]
    metadata: dict[str, str] = field(default_factory=dict)
    source: dict[str, str] = field(default_factory=dict)
    embedded: Mapping[str, TensorManifest] = field(default_factory=dict)

    def __post_init__(self) -> None:
        parse_name(self.run, what="run name")
        parse_name(self.peer, what="peer name")
        if self.step < 0:
            raise InvalidInputError(f"step must be >= 0, got {self.step}")
        for _, tensor_id in self.tensors:
            parse_id(tensor_id)
        listed = {tensor_id for _, tensor_id in self.tensors}
        for tensor_id in self.embedded:
            if tensor_id not in listed:
                raise InvalidInputError(f"embedded tensor {tensor_id} is not one of the dump's")

    @cached_property
    def tensor_ids(self) -> dict[str, str]:
        """Tensor name → tensor id."""
        return dict(self.tensors)

    def manifest_children(self) -> Iterator[str]:
        return (t for t in dict.fromkeys(self.tensor_ids.values()) if t not in self.embedded)

    def format_needed(self) -> int:
        return 2 if self.embedded else 1

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "run": self.run,
            "step": self.step,
            "peer": self.peer,
            "tensors": [list(pair) for pair in self.tensors],
            "metadata": dict(self.metadata),
            "source": dict(self.source),
        }
        if self.embedded:
            out["embedded"] = {t: m.to_dict() for t, m in self.embedded.items()}
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DumpManifest:
        return cls(
            run=data["run"],
            step=int(data["step"]),
            peer=data["peer"],
            tensors=tuple((str(n), str(t)) for n, t in data["tensors"]),
            metadata={str(k): str(v) for k, v in data["metadata"].items()},
            source={str(k): str(v) for k, v in data["source"].items()},
            embedded=LazyTensors(data.get("embedded", {})),
        )


#: The stored fields of a run's manifest (what its id covers).
_FIELDS = (
    "run",
    "schema",
    "inline_dumps",
    "inline_aggregates",
    "dump_shards",
    "aggregate_shards",
)


@dataclass(frozen=True, init=False)
class RunManifest(Manifest):
    """A run: its dumps in (step, peer) order, the schema they share, its aggregates.

    A run whose dumps (and aggregates) fit one shard keeps them here, as every
    gradpipe did (formats 1 and 3). A larger one keeps them in a tree of
    :class:`~gradpipe.core.run_shards.RunShard` manifests that this one links
    to (``dump_shards``, ``aggregate_shards``; format 4), so that a commit
    rewrites a path of the tree, not the whole run. The accessors read the
    same either way: a run read from a store loads the shards it needs when
    first asked, one batched read per level of the tree. Construct a run in
    memory as ``RunManifest(run, dumps, schema, aggregates)``.
    """

    type: ClassVar[str] = "run"

    run: str
    schema: dict[str, TensorSchema]
    #: The dumps kept in this manifest itself (none once they are in shards).
    inline_dumps: tuple[DumpEntry, ...]
    #: The aggregates kept in this manifest itself (none once they are in shards).
    inline_aggregates: tuple[AggregateEntry, ...]
    #: The top shard of the dumps' tree, once the run has outgrown one shard.
    dump_shards: ShardLink | None
    #: The top shard of the aggregates' tree, once they have outgrown one shard.
    aggregate_shards: ShardLink | None

    def __init__(
        self,
        run: str,
        dumps: Iterable[DumpEntry] = (),
        schema: Mapping[str, TensorSchema] | None = None,
        aggregates: Iterable[AggregateEntry] = (),
        *,
        dump_shards: ShardLink | None = None,
        aggregate_shards: ShardLink | None = None,
    ) -> None:
        values = {
            "run": parse_name(run, what="run name"),
            "schema": dict(schema or {}),
            "inline_dumps": tuple(dumps),
            "inline_aggregates": tuple(aggregates),
            "dump_shards": dump_shards,
            "aggregate_shards": aggregate_shards,
        }
        for name, value in values.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_cache", ShardCache(None, f"run {printable(run)}"))
        object.__setattr__(self, "_unstored", {})
        keys = [d.sort_key for d in self.inline_dumps]
        if keys != sorted(set(keys)):
            raise InvalidInputError(f"run {printable(self.run)} lists dumps out of order or twice")
        named = [a.sort_key for a in self.inline_aggregates]
        if named != sorted(set(named)):
            raise InvalidInputError(
                f"run {printable(self.run)} lists aggregates out of order or twice"
            )
        if (dump_shards and self.inline_dumps) or (aggregate_shards and self.inline_aggregates):
            raise InvalidInputError(
                f"run {printable(self.run)} lists entries both in its manifest and in shards"
            )

    # The shards read or made so far (shared by every state derived from one read),
    # and the shards made in memory that a store must write with this manifest.
    _cache: ShardCache = field(compare=False, repr=False)
    _unstored: dict[str, RunShard] = field(compare=False, repr=False)

    def _evolve(self, made: Mapping[str, RunShard] | None = None, **changes: Any) -> RunManifest:
        """A copy with ``changes`` to the stored fields, sharing the cache, unchecked."""
        new = object.__new__(RunManifest)
        for name in _FIELDS:
            object.__setattr__(new, name, changes.get(name, getattr(self, name)))
        cache = changes.get("_cache", self._cache)
        object.__setattr__(new, "_cache", cache)
        unstored = {**self._unstored, **(made or {})}
        object.__setattr__(new, "_unstored", unstored)
        cache.nodes.update(made or {})
        return new

    def with_source(self, source: ManifestSource) -> RunManifest:
        cache = ShardCache(source, f"run {printable(self.run)}")
        cache.nodes.update(self._cache.nodes)
        return self._evolve(_cache=cache)

    # --- the dumps ------------------------------------------------------------
    @property
    def dumps(self) -> tuple[DumpEntry, ...]:
        """Every recorded dump, in (step, peer) order (reads all the run's dump shards)."""
        return self._all_dumps

    @cached_property
    def _all_dumps(self) -> tuple[DumpEntry, ...]:
        if self.dump_shards is None:
            return self.inline_dumps
        found = scan(self.dump_shards, "dumps", self._cache.load, self._where("dumps"))
        return cast(tuple[DumpEntry, ...], tuple(found))

    @property
    def dump_count(self) -> int:
        """How many dumps the run records (read from its manifest alone)."""
        return len(self.inline_dumps) if self.dump_shards is None else self.dump_shards.count

    @cached_property
    def _index(self) -> dict[EntryKey, DumpEntry]:
        return {d.sort_key: d for d in self.dumps}

    @cached_property
    def _by_step(self) -> dict[int, list[DumpEntry]]:
        out: dict[int, list[DumpEntry]] = {}
        for d in self.dumps:
            out.setdefault(d.step, []).append(d)
        return out

    def _unloaded_tree(self) -> ShardLink | None:
        """The dumps' top shard while the dumps are not all in memory (else None)."""
        return None if "_all_dumps" in self.__dict__ else self.dump_shards

    def dump_entries(self, keys: Iterable[EntryKey]) -> dict[EntryKey, DumpEntry]:
        """The dumps recorded for several ``(step, peer)`` keys (absent ones left out).

        Reads only the shards on the keys' paths, one batched read per level:
        call it before looking up many dumps one by one with :meth:`entry`.
        """
        wanted = list(keys)
        top = self._unloaded_tree()
        if top is None:
            return {k: self._index[k] for k in wanted if k in self._index}
        found = find(top, wanted, "dumps", self._cache.load, self._where("dumps"))
        return cast(dict[EntryKey, DumpEntry], found)

    def entry(self, step: int, peer: str) -> DumpEntry | None:
        """The dump recorded for (step, peer), if any."""
        return self.dump_entries([(step, peer)]).get((step, peer))

    def step_dumps(self, step: int) -> list[DumpEntry]:
        """The dumps of one step, in peer order."""
        top = self._unloaded_tree()
        if top is None:
            return list(self._by_step.get(step, ()))
        found = scan(
            top,
            "dumps",
            self._cache.load,
            self._where("dumps"),
            lo=(step, ""),  # "" sorts before every peer name
            hi=(step + 1, ""),
        )
        return cast(list[DumpEntry], found)

    @property
    def steps(self) -> list[int]:
        """Recorded steps, ascending."""
        return sorted(self._by_step)

    @property
    def peers(self) -> list[str]:
        """Peers seen in any step, sorted."""
        return sorted({d.peer for d in self.dumps})

    # --- the aggregates -----------------------------------------------------------
    @property
    def aggregates(self) -> tuple[AggregateEntry, ...]:
        """Every recorded aggregate, in (step, name) order (reads all their shards)."""
        return self._all_aggregates

    @cached_property
    def _all_aggregates(self) -> tuple[AggregateEntry, ...]:
        if self.aggregate_shards is None:
            return self.inline_aggregates
        found = scan(
            self.aggregate_shards, "aggregates", self._cache.load, self._where("aggregates")
        )
        return cast(tuple[AggregateEntry, ...], tuple(found))

    def aggregate_entry(self, step: int, name: str) -> AggregateEntry | None:
        """The aggregate recorded as ``name`` for ``step``, if any."""
        if self.aggregate_shards is None or "_all_aggregates" in self.__dict__:
            return next((a for a in self.aggregates if a.sort_key == (step, name)), None)
        found = find(
            self.aggregate_shards,
            [(step, name)],
            "aggregates",
            self._cache.load,
            self._where("aggregates"),
        )
        return cast(AggregateEntry | None, found.get((step, name)))

    def _where(self, tree: str) -> str:
        return f"run {printable(self.run)} ({tree})"

    # --- stored form ------------------------------------------------------------
    def manifest_children(self) -> Iterator[str]:
        yield from (d.dump for d in self.inline_dumps)
        yield from (a.aggregate for a in self.inline_aggregates)
        yield from (link.id for link in (self.dump_shards, self.aggregate_shards) if link)

    def unstored_manifests(self) -> Iterator[Manifest]:
        # The shards made in memory that this state still links to (a commit
        # retried from a newer run made others, now unreferenced).
        todo = [link.id for link in (self.dump_shards, self.aggregate_shards) if link]
        while todo:
            node = self._unstored.get(todo.pop())
            if node is not None:
                yield node
                todo.extend(c.id for c in node.children)

    def format_needed(self) -> int:
        if self.dump_shards is not None or self.aggregate_shards is not None:
            return 4
        # A run without aggregates is written as before, so older readers still read it.
        if any(d.lossy for d in self.inline_dumps):  # lossy dumps: tensors older ones can't read
            return 4
        return 3 if self.inline_aggregates else 1

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"run": self.run}
        if self.dump_shards is None:
            out["dumps"] = [d.to_dict() for d in self.inline_dumps]
        else:
            out["dump_shards"] = self.dump_shards.to_dict()
        out["schema"] = {name: s.to_dict() for name, s in sorted(self.schema.items())}
        if self.inline_aggregates:
            out["aggregates"] = [a.to_dict() for a in self.inline_aggregates]
        if self.aggregate_shards is not None:
            out["aggregate_shards"] = self.aggregate_shards.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunManifest:
        dump_shards = data.get("dump_shards")
        aggregate_shards = data.get("aggregate_shards")
        return cls(
            data["run"],
            tuple(DumpEntry.from_dict(d) for d in data.get("dumps", ())),
            {str(k): TensorSchema.from_dict(v) for k, v in data["schema"].items()},
            tuple(AggregateEntry.from_dict(a) for a in data.get("aggregates", ())),
            dump_shards=ShardLink.from_dict(dump_shards) if dump_shards is not None else None,
            aggregate_shards=(
                ShardLink.from_dict(aggregate_shards) if aggregate_shards is not None else None
            ),
        )


def merge_run(
    run: RunManifest,
    new: list[DumpEntry],
    schema: dict[str, TensorSchema],
    *,
    shape: TreeShape | None = None,
) -> RunManifest:
    """``run`` with ``new`` dumps added (a dump already there is replaced); aggregates kept.

    Only the shards on the paths to the new dumps are read and remade; the
    result writes them with itself when stored (``store.put_manifest``).
    """
    tree = upsert(
        run.dump_shards,
        run.inline_dumps,
        new,
        "dumps",
        run._cache.load,
        where=run._where("dumps"),
        shape=shape,
    )
    merged_schema = dict(run.schema)
    for name, spec in schema.items():
        merged_schema.setdefault(name, spec)
    return run._evolve(
        tree.made,
        schema=merged_schema,
        inline_dumps=tree.inline,
        dump_shards=tree.top,
    )


def record_aggregates(
    run: RunManifest, new: list[AggregateEntry], *, shape: TreeShape | None = None
) -> RunManifest:
    """``run`` with ``new`` aggregates recorded (one of the same step and name is replaced)."""
    tree = upsert(
        run.aggregate_shards,
        run.inline_aggregates,
        new,
        "aggregates",
        run._cache.load,
        where=run._where("aggregates"),
        shape=shape,
    )
    return run._evolve(tree.made, inline_aggregates=tree.inline, aggregate_shards=tree.top)
