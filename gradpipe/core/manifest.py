"""Manifests: the structured objects of a store, themselves stored as blocks.

Every manifest is a frozen dataclass deriving from :class:`Manifest`, with
``to_dict``/``from_dict`` and a canonical JSON encoding, so it has exactly one
id and a whole object graph is verifiable from its root id. Each stored
manifest carries ``type`` and ``format``; a reader refuses a format newer than
it knows instead of misreading it.

The types a store may hold are listed in one explicit table,
:data:`MANIFEST_TYPES`, and imported only when a manifest of that type is first
decoded (numcodecs' codec registry and xarray's backend entry points work the
same way): a type is never known merely because some module happened to be
imported first.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar, Final, Protocol, Self, TypeVar

from gradpipe.core.display import printable, printable_error
from gradpipe.core.encoding import from_json_bytes, to_json_bytes
from gradpipe.core.ids import hash_bytes
from gradpipe.errors import IntegrityError, InvalidInputError, UnsupportedFormatError

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_TYPES",
    "Manifest",
    "ManifestSource",
    "decode_manifest",
    "encode_manifest",
    "manifest_class",
    "manifest_id",
]

#: The newest manifest format this version of gradpipe reads and writes.
#: 2: small chunks inline in tensor manifests, tensor manifests embedded in
#: dump manifests. 3: delta chains in tensor manifests, snapshots, aggregates. 4: tensors
#: stored with a lossy codec (and the runs that list their dumps as lossy), and runs whose
#: entries live in shards (``run-shard`` manifests). 5: snapshot versions written with
#: optimizer replay (tensors with replay links, docs/design/016). 6: analyses and the
#: index of a run's analyses (``analytics/<run>``, docs/design/017). A manifest
#: is written in the oldest format that can hold it (see
#: :meth:`Manifest.format_needed`), so an older gradpipe still reads every
#: manifest that uses nothing new, and an id never changes with a version bump.
FORMAT_VERSION: Final = 6

#: Every manifest type, by its stored ``type``: ``"module:Class"``, imported on first use.
MANIFEST_TYPES: Final[dict[str, str]] = {
    "aggregate": "gradpipe.core.aggregate_manifest:AggregateManifest",
    "analysis": "gradpipe.core.analysis_manifest:AnalysisManifest",
    "analytics": "gradpipe.core.analytics_index:AnalyticsIndex",
    "dump": "gradpipe.core.run_manifest:DumpManifest",
    "ref": "gradpipe.core.ref_entry:RefEntry",
    "rounds": "gradpipe.core.rounds:RoundsManifest",
    "run": "gradpipe.core.run_manifest:RunManifest",
    "run-shard": "gradpipe.core.run_shards:RunShard",
    "snapshot": "gradpipe.core.snapshot_manifest:SnapshotManifest",
    "tensor": "gradpipe.core.tensor_manifest:TensorManifest",
}
_LOADED: dict[str, type[Manifest]] = {}

M = TypeVar("M", bound="Manifest")


class ManifestSource(Protocol):
    """Where a manifest reads the manifests its content continues in (a store)."""

    def get_typed_many(
        self, manifest_ids: Sequence[str], cls: type[M], *, context: str = ""
    ) -> list[M]:
        """The manifests ``manifest_ids``, each of type ``cls``, in one batched read."""
        ...


class Manifest(ABC):
    """What every manifest type provides; subclasses are frozen dataclasses."""

    #: The stored ``type`` (a key of :data:`MANIFEST_TYPES`).
    type: ClassVar[str]

    @abstractmethod
    def to_dict(self) -> dict[str, Any]:
        """The JSON-able fields (without ``type`` and ``format``)."""

    @classmethod
    @abstractmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        """Parse what :meth:`to_dict` produced; raises on malformed input."""

    def format_needed(self) -> int:
        """The oldest manifest format that can hold this manifest (what it is written as)."""
        return 1

    def manifest_children(self) -> Iterator[str]:
        """Ids of the manifests this one links to (walked by verify and gc)."""
        return iter(())

    def data_children(self) -> Iterator[str]:
        """Ids of the data blocks this one links to (stored as objects of their own)."""
        return iter(())

    def inline_frames(self) -> Iterator[tuple[str, bytes, str]]:
        """``(block id, encoded frame, where)`` of the data blocks kept inside this manifest."""
        return iter(())

    def embedded_manifests(self) -> Iterator[tuple[str, Manifest]]:
        """``(id, manifest)`` of the manifests kept inside this one."""
        return iter(())

    def unstored_manifests(self) -> Iterator[Manifest]:
        """Manifests this one links to that are not stored yet (stored with it, first)."""
        return iter(())

    def with_source(self, source: ManifestSource) -> Self:
        """This manifest, reading what it links to through ``source`` when asked.

        A store calls it on every manifest it reads; only a manifest whose
        content continues in other manifests (a run in shards) keeps it.
        """
        return self


def manifest_class(kind: str, *, what: str = "manifest") -> type[Manifest]:
    """The class of a stored manifest type (imported on first use)."""
    cls = _LOADED.get(kind)
    if cls is not None:
        return cls
    try:
        module_name, _, attr = MANIFEST_TYPES[kind].partition(":")
    except KeyError:
        raise UnsupportedFormatError(
            f"{what} has unknown type {printable(kind)}; it was written by a newer gradpipe, "
            "upgrade it"
        ) from None
    loaded = getattr(importlib.import_module(module_name), attr)
    if not (isinstance(loaded, type) and issubclass(loaded, Manifest) and loaded.type == kind):
        raise TypeError(f"MANIFEST_TYPES[{kind!r}] names {loaded!r}, not its manifest class")
    _LOADED[kind] = loaded
    return loaded


def encode_manifest(manifest: Manifest) -> bytes:
    """Canonical bytes of a manifest (what its id is the hash of)."""
    version = manifest.format_needed()
    return to_json_bytes({"type": manifest.type, "format": version, **manifest.to_dict()})


def manifest_id(manifest: Manifest) -> str:
    """The id a manifest has once stored (the hash of its canonical bytes)."""
    return hash_bytes(encode_manifest(manifest))


def decode_manifest(data: bytes, *, what: str = "manifest") -> Manifest:
    """Parse stored manifest bytes of any known type.

    Raises :class:`IntegrityError` for bytes that are not a well-formed
    manifest (stored data is damaged, not a bad argument) and
    :class:`UnsupportedFormatError` for a newer format or an unknown type.
    """
    try:
        doc = from_json_bytes(data, what=what)
    except InvalidInputError as exc:
        # Its message already says "<what> is not valid JSON: ..."; only the kind
        # changes (stored data is damaged, not a bad argument), never the words.
        raise IntegrityError(str(exc)) from None
    except UnsupportedFormatError:
        raise
    except Exception as exc:  # e.g. RecursionError on JSON nested too deep
        raise IntegrityError(f"{what} is not valid JSON: {printable_error(exc)}") from None
    if not isinstance(doc, dict) or "type" not in doc or "format" not in doc:
        raise IntegrityError(f"{what} is not a gradpipe manifest (no type and format)")
    version = doc.pop("format")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise IntegrityError(f"{what} has a malformed format field {printable(version)}")
    if version > FORMAT_VERSION:
        raise UnsupportedFormatError(
            f"{what} has format {version}, newer than this gradpipe reads "
            f"({FORMAT_VERSION}); upgrade gradpipe"
        )
    kind = doc.pop("type")
    cls = manifest_class(str(kind), what=what)
    try:
        return cls.from_dict(doc)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise IntegrityError(
            f"{what} of type {printable(kind)} is malformed: {printable_error(exc)}"
        ) from None
