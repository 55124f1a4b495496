"""``evaluate_codecs``: candidate codecs measured on a sample of a run's stored chunks.

The user operation: check the candidates and parameters before any I/O, draw
a seeded sample of the run's chunks stratified over tensors, steps and peers
(:mod:`gradpipe.evaluation.sampling`, reading only the manifests of the dumps it
draws from), add each sampled chunk's error-feedback window and its partner
for inner products, then compute one graph (:mod:`gradpipe.evaluation.graph`)
and report (:class:`~gradpipe.evaluation.report.EvaluationReport`).

The sampled unit is a stored chunk. gradpipe chunks a tensor into runs of
whole rows (a row larger than a chunk aside), so for PowerSGD a chunk of a
matrix is a block of its rows: the evaluation measures what storing with
``--codec powersgd-R`` gives, which factors each chunk on its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from gradpipe.codecs._lossy import parse_seed
from gradpipe.codecs.candidate import Candidate, parse_candidates
from gradpipe.core.display import printable
from gradpipe.core.run_manifest import DumpManifest
from gradpipe.core.tensor_manifest import TensorManifest
from gradpipe.errors import InvalidInputError
from gradpipe.evaluation.graph import ChunkRef, EvaluationPlan, build_evaluate_graph
from gradpipe.evaluation.report import EvaluationReport
from gradpipe.evaluation.result import CodecResult
from gradpipe.evaluation.sampling import Unit, order_dumps, parse_sample_size, sample_units
from gradpipe.graph.runner import Runner, use_runner
from gradpipe.runs import Dump, Run, open_run
from gradpipe.storage.store import Store

__all__ = [
    "DEFAULT_FEEDBACK_STEPS",
    "DEFAULT_SAMPLE",
    "CodecResult",
    "EvaluationReport",
    "evaluate_codecs",
]

#: Chunks sampled when not told.
DEFAULT_SAMPLE: Final = 64
#: Consecutive steps an error-feedback chain runs over when not told.
DEFAULT_FEEDBACK_STEPS: Final = 8

_Key = tuple[int, str]


def evaluate_codecs(
    store: Store,
    *,
    run: str,
    codecs: Sequence[str] | str | None = None,
    sample: int = DEFAULT_SAMPLE,
    seed: int = 0,
    feedback_steps: int = DEFAULT_FEEDBACK_STEPS,
    runner: Runner | None = None,
) -> EvaluationReport:
    """Measure candidate codecs on a seeded, stratified sample of the chunks of ``run``.

    Parameters
    ----------
    store : Store
        The store (read only).
    run : str
        The run whose gradient dumps to sample.
    codecs : list of str, or str, optional
        Candidate names (a list or one comma-separated string):
        ``default``, ``zstd``, ``blosc``, ``bf16``, ``fp16``, ``bitround-K``,
        ``topk-F``, ``qsgd-S``, ``powersgd-R``, ``projection-R``, or a lossy
        one followed by lossless ones, ``bitround-7+zstd``. Default:
        :data:`gradpipe.codecs.candidate.DEFAULT_CANDIDATES`.
    sample : int
        How many chunks to sample (fewer if the run has fewer): every tensor
        gets the same share, spread over steps and peers.
    seed : int
        Seed of the sample; the same seed gives the same sample and figures
        (but the speeds).
    feedback_steps : int
        Consecutive steps of each sampled chunk's peer over which top-k and
        PowerSGD run with error feedback (1: no simulation).
    runner : Runner, optional
        Where the graph runs (default: a temporary one, see :func:`gradpipe.runner`).

    Returns
    -------
    EvaluationReport
        One :class:`~gradpipe.evaluation.tasks.CodecResult` per candidate;
        ``ok`` when every deterministic bound held on every chunk.

    Examples
    --------
    >>> report = gp.evaluate_codecs(store, run="train", codecs="bf16,topk-0.01")  # doctest: +SKIP
    >>> print(report.summary())  # doctest: +SKIP
    """
    candidates = parse_candidates(codecs)
    parse_sample_size(sample)
    seed = parse_seed(seed)
    whole = isinstance(feedback_steps, int) and not isinstance(feedback_steps, bool)
    if not whole or feedback_steps < 1:
        raise InvalidInputError(
            f"feedback_steps must be a whole number of steps >= 1, not {printable(feedback_steps)}"
        )
    view = open_run(store, run)
    if not len(view):
        raise InvalidInputError(
            f"run {printable(run)} in {store.url} has no dumps to evaluate codecs on; "
            "ingest some first with `gradpipe ingest`"
        )
    dumps = _Dumps(view)
    order = order_dumps([(e.step, e.peer) for e in view], seed)[:sample]
    dumps.load(order)
    counts = {
        d: {name: len(m.blocks) for name, m in dumps.tensors(d).items() if m.size} for d in order
    }
    units = sample_units(order, counts, sample, seed)
    if not units:
        raise InvalidInputError(
            f"run {printable(run)} in {store.url} stores no values: every tensor of its "
            "dumps is empty"
        )
    chunks = [ChunkRef(u, dumps.tensors((u.step, u.peer))[u.tensor]) for u in units]
    windows: list[list[ChunkRef]] = []
    if feedback_steps > 1 and any(c.feedback for c in candidates):
        windows = _windows(dumps, view, chunks, feedback_steps)
    partners: list[ChunkRef | None] = []
    if any(_sketch(c) for c in candidates):
        partners = _partners(dumps, view, chunks)
    plan = EvaluationPlan(chunks, windows, partners)
    graph, keys = build_evaluate_graph(store, plan, candidates)
    with use_runner(runner) as active:
        results = active.get(graph, keys, name="gradpipe-evaluate")
    return EvaluationReport(run, seed, sample, feedback_steps, units, results)


def _sketch(candidate: Candidate) -> bool:
    return candidate.lossy and not candidate.bound("float32", 1).reconstructs


class _Dumps:
    """The tensor manifests of a run's dumps, read in batches, each dump once."""

    def __init__(self, view: Run) -> None:
        self._view = view
        self._tensors: dict[_Key, dict[str, TensorManifest]] = {}

    def load(self, keys: Sequence[_Key]) -> None:
        wanted = sorted({k for k in keys if k not in self._tensors})
        entries = [self._view.manifest.entry(*k) for k in wanted]
        ids = [e.dump for e in entries if e is not None]
        store = self._view.store
        manifests = store.get_typed_many(
            ids, DumpManifest, context=f"run {printable(self._view.name)}"
        )
        for key, dump_id, manifest in zip(wanted, ids, manifests, strict=True):
            self._tensors[key] = Dump(store, dump_id, manifest).infos()

    def tensors(self, key: _Key) -> dict[str, TensorManifest]:
        return self._tensors[key]


def _same_chunk(ref: ChunkRef, other: TensorManifest | None) -> bool:
    """Whether ``other`` has the chunk ``ref`` is, at the same place (the same grid)."""
    m = ref.manifest
    return other is not None and (other.dtype, other.shape, other.chunk_shape) == (
        m.dtype,
        m.shape,
        m.chunk_shape,
    )


def _windows(dumps: _Dumps, view: Run, chunks: list[ChunkRef], length: int) -> list[list[ChunkRef]]:
    """Each sampled chunk in ``length`` consecutive steps of its peer (fewer at the run's end).

    The window starts at the sampled step and is moved back when the peer has
    fewer steps after it; it stops where the tensor is missing or chunked otherwise.
    """
    steps_of: dict[str, list[int]] = {}
    for entry in view:
        steps_of.setdefault(entry.peer, []).append(entry.step)
    spans: list[list[_Key]] = []
    for ref in chunks:
        steps = steps_of[ref.unit.peer]
        at = steps.index(ref.unit.step)
        start = max(0, min(at, len(steps) - length))
        spans.append([(s, ref.unit.peer) for s in steps[start : start + length]])
    dumps.load([k for span in spans for k in span])
    out = []
    for ref, span in zip(chunks, spans, strict=True):
        at = span.index((ref.unit.step, ref.unit.peer))
        members = [dumps.tensors(k).get(ref.unit.tensor) for k in span]
        lo, hi = at, at
        while lo > 0 and _same_chunk(ref, members[lo - 1]):
            lo -= 1
        while hi + 1 < len(span) and _same_chunk(ref, members[hi + 1]):
            hi += 1
        out.append(
            [
                ChunkRef(Unit(k[0], k[1], ref.unit.tensor, ref.unit.chunk), m)
                for k, m in zip(span[lo : hi + 1], members[lo : hi + 1], strict=True)
                if m is not None
            ]
        )
    return out


def _partners(dumps: _Dumps, view: Run, chunks: list[ChunkRef]) -> list[ChunkRef | None]:
    """The same chunk in the next peer of the step, else the peer's next step (or None)."""
    grid = view.grid()
    steps_of: dict[str, list[int]] = {}
    for entry in view:
        steps_of.setdefault(entry.peer, []).append(entry.step)
    picks: list[_Key | None] = []
    for ref in chunks:
        step, peer = ref.unit.step, ref.unit.peer
        peers, steps = grid[step], steps_of[peer]
        if len(peers) > 1:
            picks.append((step, peers[(peers.index(peer) + 1) % len(peers)]))
        elif len(steps) > 1:
            picks.append((steps[(steps.index(step) + 1) % len(steps)], peer))
        else:
            picks.append(None)
    dumps.load([k for k in picks if k is not None])
    out: list[ChunkRef | None] = []
    for ref, key in zip(chunks, picks, strict=True):
        other = None if key is None else dumps.tensors(key).get(ref.unit.tensor)
        if key is None or other is None or not _same_chunk(ref, other):
            out.append(None)
        else:
            out.append(ChunkRef(Unit(key[0], key[1], ref.unit.tensor, ref.unit.chunk), other))
    return out
