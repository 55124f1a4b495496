"""The builder of the codec-evaluation graph: sampled chunks in, one result per candidate out.

::

    read(chunk 0) read(chunk 1) ...            one task per stored chunk, named by its id
        │  └──────────┬─────────┐              (shared by every candidate, every window)
    chunk(c, 0)   chunk(c, 1) ...              per candidate and sampled chunk
    window(c, 0) ...                           per feedback candidate and sampled chunk:
                                               the chunk's window of consecutive steps
    pair(c, 0) ...                             per sketch candidate: the chunk and its partner
        └──── summary(c) ────┘                 per candidate: a CodecResult

Read tasks come from :func:`gradpipe.graph.chains.add_chunk_read`: a chunk
read by several candidates, or by several error-feedback windows, is read
once, and a delta chunk is rebuilt from its keyframe as every other read does.
Keys are tokenised from the store, the chunks (their block ids) and the
candidate, so equal work gets equal keys on a shared cluster; the dashboard
shows them as ``gradpipe-evaluation`` (per candidate), ``-chunk``, ``-window``
(error feedback) and ``-pair``. (Not ``gradpipe-evaluate-…``: ``key_split``
takes an eight-letter word that starts like hex, such as "evaluate", for a
token and drops it.)
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from dask.base import tokenize

from gradpipe.codecs.candidate import Candidate
from gradpipe.core.tensor_manifest import TensorManifest
from gradpipe.evaluation.sampling import Unit
from gradpipe.evaluation.tasks import (
    evaluate_chunk,
    evaluate_feedback,
    evaluate_pair,
    summarise,
)
from gradpipe.graph.chains import add_chunk_read
from gradpipe.storage.store import Store

__all__ = ["ChunkRef", "EvaluationPlan", "build_evaluate_graph"]


@dataclass(frozen=True)
class ChunkRef:
    """A stored chunk the evaluation reads: which one, and the tensor it belongs to."""

    unit: Unit
    manifest: TensorManifest

    @property
    def dtype(self) -> str:
        return self.manifest.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        """The tensor's shape (PowerSGD views its chunks as the tensor's rows)."""
        return self.manifest.shape

    @property
    def count(self) -> int:
        start, stop = self.manifest.chunk_ranges()[self.unit.chunk]
        return stop - start

    @property
    def where(self) -> str:
        return self.unit.describe()

    def key_token(self) -> Any:
        return (self.manifest.dtype, self.count, self.manifest.blocks[self.unit.chunk])


@dataclass(frozen=True)
class EvaluationPlan:
    """What to evaluate: the sample, each chunk's error-feedback window, each chunk's partner.

    ``windows[i]`` is the same chunk of the sampled tensor in consecutive steps
    of the same peer, oldest first, containing sample ``i``; ``partners[i]``
    is the same chunk in another dump (another peer of the step, else another
    step of the peer), or None.
    """

    chunks: Sequence[ChunkRef]
    windows: Sequence[Sequence[ChunkRef]]
    partners: Sequence[ChunkRef | None]


def build_evaluate_graph(
    store: Store, plan: EvaluationPlan, candidates: Sequence[Candidate]
) -> tuple[dict[Hashable, Any], list[Hashable]]:
    """The graph evaluating ``candidates`` on ``plan``, and each candidate's result key."""
    graph: dict[Hashable, Any] = {}

    def read(ref: ChunkRef) -> Hashable | None:
        return add_chunk_read(graph, store, ref.manifest, ref.unit.chunk, ref.where)

    sample = tokenize(store.url, [c.key_token() for c in plan.chunks])
    keys: list[Hashable] = []
    for candidate in candidates:
        token = tokenize(
            sample, candidate.name, [[w.key_token() for w in win] for win in plan.windows]
        )
        skipped: dict[str, int] = {}
        chunk_keys: list[Hashable] = []
        feedback_keys: list[Hashable] = []
        pair_keys: list[Hashable] = []
        evaluated: list[ChunkRef] = []
        for i, ref in enumerate(plan.chunks):
            reason = candidate.skip_reason(ref.dtype, ref.shape)
            if reason is not None:
                skipped[reason] = skipped.get(reason, 0) + 1
                continue
            key = (f"gradpipe-evaluation-chunk-{token}", i)
            graph[key] = (evaluate_chunk, candidate, read(ref), ref.dtype, ref.shape, ref.count, i)
            chunk_keys.append(key)
            evaluated.append(ref)
            window = plan.windows[i] if i < len(plan.windows) else ()
            if candidate.feedback and len(window) > 1:
                key = (f"gradpipe-evaluation-window-{token}", i)
                reads = [read(w) for w in window]
                graph[key] = (
                    evaluate_feedback,
                    candidate,
                    reads,
                    ref.dtype,
                    ref.shape,
                    ref.count,
                    i,
                )
                feedback_keys.append(key)
            partner = plan.partners[i] if i < len(plan.partners) else None
            if partner is not None and not candidate.bound(ref.dtype, ref.count).reconstructs:
                key = (f"gradpipe-evaluation-pair-{token}", i)
                graph[key] = (
                    evaluate_pair,
                    candidate,
                    read(ref),
                    read(partner),
                    ref.dtype,
                    ref.count,
                    i,
                )
                pair_keys.append(key)
        bound = candidate.bound(_common_dtype(evaluated), _largest(evaluated))
        result = f"gradpipe-evaluation-{token}"
        graph[result] = (summarise, candidate, bound, skipped, chunk_keys, feedback_keys, pair_keys)
        keys.append(result)
    return graph, keys


def _common_dtype(chunks: Sequence[ChunkRef]) -> str:
    """The float dtype most sampled chunks have (the one a row's stated bound is for)."""
    counts: dict[str, int] = {}
    for ref in chunks:
        counts[ref.dtype] = counts.get(ref.dtype, 0) + 1
    floats = [d for d in counts if d.startswith(("float", "bfloat"))]
    if not floats:  # nothing evaluated, or integers only: state the float32 bound
        return "float32"
    return max(floats, key=lambda d: counts[d])


def _largest(chunks: Sequence[ChunkRef]) -> int:
    return max((ref.count for ref in chunks), default=1) or 1
