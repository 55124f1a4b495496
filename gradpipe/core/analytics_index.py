"""The index of a run's analyses: (step, name) → the result's id and memo key.

What the ref ``analytics/<run>`` points at. Analyses are recorded apart from the
run's manifest so that computing one never races ingest's compare-and-swap on
``runs/<run>``, and never changes the run's id (from which dataset keys derive).
Its entries live in the index itself while they fit one shard, and in a tree of
:class:`~gradpipe.core.run_shards.RunShard` manifests of kind ``analyses`` once
they do not, exactly as a run's aggregates do (format 6).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, ClassVar, cast

from gradpipe.core.display import printable
from gradpipe.core.manifest import Manifest, ManifestSource
from gradpipe.core.names import parse_name
from gradpipe.core.run_entries import AnalysisEntry, EntryKey
from gradpipe.core.run_shards import (
    RunShard,
    ShardCache,
    ShardLink,
    TreeShape,
    find,
    scan,
    upsert,
)
from gradpipe.errors import InvalidInputError

__all__ = ["AnalyticsIndex", "record_analyses"]

_KIND = "analyses"


@dataclass(frozen=True, init=False)
class AnalyticsIndex(Manifest):
    """The analyses of one run, in (step, name) order: inline while few, in shards once many."""

    type: ClassVar[str] = "analytics"

    run: str
    #: The entries kept in this manifest itself (none once they are in shards).
    inline: tuple[AnalysisEntry, ...]
    #: The top shard of the entries' tree, once they have outgrown one shard.
    shards: ShardLink | None

    def __init__(
        self,
        run: str,
        entries: Iterable[AnalysisEntry] = (),
        *,
        shards: ShardLink | None = None,
    ) -> None:
        object.__setattr__(self, "run", parse_name(run, what="run name"))
        object.__setattr__(self, "inline", tuple(entries))
        object.__setattr__(self, "shards", shards)
        object.__setattr__(self, "_cache", ShardCache(None, self._where))
        object.__setattr__(self, "_unstored", {})
        keys = [e.sort_key for e in self.inline]
        if keys != sorted(set(keys)):
            raise InvalidInputError(
                f"the analyses of run {printable(run)} are listed out of order or twice"
            )
        if shards is not None and self.inline:
            raise InvalidInputError(
                f"the analyses of run {printable(run)} are listed both inline and in shards"
            )

    _cache: ShardCache = field(compare=False, repr=False)
    _unstored: dict[str, RunShard] = field(compare=False, repr=False)

    @property
    def _where(self) -> str:
        return f"analyses of run {printable(self.run)}"

    def _evolve(self, made: Mapping[str, RunShard], **changes: Any) -> AnalyticsIndex:
        """A copy with other entries, sharing the cache, unchecked (what :func:`upsert` made)."""
        new = object.__new__(AnalyticsIndex)
        for name in ("run", "inline", "shards"):
            object.__setattr__(new, name, changes.get(name, getattr(self, name)))
        cache = changes.get("_cache", self._cache)
        object.__setattr__(new, "_cache", cache)
        object.__setattr__(new, "_unstored", {**self._unstored, **made})
        cache.nodes.update(made)
        return new

    def with_source(self, source: ManifestSource) -> AnalyticsIndex:
        cache = ShardCache(source, self._where)
        cache.nodes.update(self._cache.nodes)
        return self._evolve({}, _cache=cache)

    @property
    def entries(self) -> tuple[AnalysisEntry, ...]:
        """Every recorded analysis, in (step, name) order (reads all the shards)."""
        return self._all

    @cached_property
    def _all(self) -> tuple[AnalysisEntry, ...]:
        if self.shards is None:
            return self.inline
        return cast(tuple[AnalysisEntry, ...], tuple(self._scan()))

    def _scan(self, lo: EntryKey | None = None, hi: EntryKey | None = None) -> list[Any]:
        assert self.shards is not None
        return scan(self.shards, _KIND, self._cache.load, self._where, lo=lo, hi=hi)

    def __len__(self) -> int:
        return len(self.inline) if self.shards is None else self.shards.count

    def lookup(self, keys: Iterable[EntryKey]) -> dict[EntryKey, AnalysisEntry]:
        """The entries of several ``(step, name)`` keys (absent ones left out).

        Reads only the shards on the keys' paths, one batched read per level.
        """
        wanted = list(keys)
        if self.shards is None or "_all" in self.__dict__:
            held = {e.sort_key: e for e in self.entries}
            return {k: held[k] for k in wanted if k in held}
        found = find(self.shards, wanted, _KIND, self._cache.load, self._where)
        return cast(dict[EntryKey, AnalysisEntry], found)

    def manifest_children(self) -> Iterator[str]:
        yield from (e.analysis for e in self.inline)
        if self.shards is not None:
            yield self.shards.id

    def unstored_manifests(self) -> Iterator[Manifest]:
        todo = [self.shards.id] if self.shards is not None else []
        while todo:
            node = self._unstored.get(todo.pop())
            if node is not None:
                yield node
                todo.extend(c.id for c in node.children)

    def format_needed(self) -> int:
        return 6

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"run": self.run}
        if self.shards is None:
            out["entries"] = [e.to_dict() for e in self.inline]
        else:
            out["shards"] = self.shards.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AnalyticsIndex:
        shards = data.get("shards")
        return cls(
            str(data["run"]),
            tuple(AnalysisEntry.from_dict(e) for e in data.get("entries", ())),
            shards=ShardLink.from_dict(shards) if shards is not None else None,
        )


def record_analyses(
    index: AnalyticsIndex, new: list[AnalysisEntry], *, shape: TreeShape | None = None
) -> AnalyticsIndex:
    """``index`` with ``new`` entries recorded (one of the same step and name is replaced)."""
    tree = upsert(
        index.shards,
        index.inline,
        new,
        _KIND,
        index._cache.load,
        where=index._where,
        shape=shape,
    )
    return index._evolve(tree.made, inline=tree.inline, shards=tree.top)
