"""Gradient dumps of a real (small) transformer fine-tuning run, for benchmarks and tests.

:mod:`gradpipe.testing.training` makes dumps that compress several hundred
times; users' dumps compress about 2.4x. This module makes data shaped like
theirs: a BERT-like encoder with the tensor names and shapes of MiniLM-L6 /
BERT-small by default (vocabulary 30522, hidden 384, 6 layers of 12 heads,
intermediate 1536, 512 positions, 2 token types; about 105 tensors per dump,
half of them LayerNorm and bias vectors of at most 6 KiB, and a 47 MB
token-embedding gradient), trained by real backpropagation and AdamW on
synthetic sentence-classification batches, by several data-parallel peers.

The data: sentences of 8 to 32 tokens (``[CLS] w ... w [SEP]`` then padding
to ``seq_len``, masked out of attention), words drawn from a Zipf distribution
over the vocabulary, labels from a fixed random bag-of-words rule, so the loss
falls. Each peer's embedding gradient is non-zero only in the rows of the
tokens its batch used: about 0.3% of them with batch 8 x 128. Weights and
batches come from numpy generators seeded by ``config.seed``; with torch
installed the model is a ``torch.nn`` module trained by ``torch.optim.AdamW``,
otherwise :mod:`gradpipe.testing._transformer_numpy` computes the same numbers.
Gradients are emitted in ``config.dtype`` (float32, or bfloat16 as
mixed-precision peers send them); master weights and optimizer state stay float32.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np

from gradpipe.core.dtypes import parse_dtype
from gradpipe.errors import InvalidInputError
from gradpipe.formats.safetensors import write_safetensors
from gradpipe.testing._transformer_numpy import Arrays, Batch, NumpyTrainer
from gradpipe.testing.training import RunFiles

__all__ = [
    "TransformerBatch",
    "TransformerConfig",
    "TransformerRun",
    "TransformerStep",
    "train_transformer",
    "write_transformer_run",
]

Backend = Literal["auto", "torch", "numpy"]

_ZIPF_EXPONENT = 1.1  # word frequencies in natural text are close to 1/rank
_PAD = 0
_RULE_DECAY = 1.0  # teacher weight of the word of rank r: r**-_RULE_DECAY


@dataclass(frozen=True)
class TransformerConfig:
    """Shape and training of the encoder (defaults: MiniLM-L6 / BERT-small, 2 x 12 dumps)."""

    vocab_size: int = 30_522
    hidden: int = 384
    layers: int = 6
    heads: int = 12
    intermediate: int = 1536
    max_positions: int = 512
    type_vocab_size: int = 2
    num_labels: int = 2
    seq_len: int = 128
    batch_size: int = 8
    peers: int = 2
    steps: int = 12
    learning_rate: float = 1e-4
    weight_decay: float = 0.01
    dtype: str = "float32"
    seed: int = 0

    def __post_init__(self) -> None:
        parse_dtype(self.dtype)
        if self.dtype not in ("float16", "bfloat16", "float32", "float64"):
            raise InvalidInputError(
                f"TransformerConfig.dtype must be a float dtype, not {self.dtype!r}"
            )
        sizes = (self.hidden, self.layers, self.heads, self.intermediate, self.type_vocab_size)
        counts = (self.num_labels, self.batch_size, self.peers, self.steps)
        if min(*sizes, *counts) < 1 or self.vocab_size < 4 or self.seq_len < 3:
            raise InvalidInputError(f"TransformerConfig sizes must be positive: {self}")
        if self.hidden % self.heads:
            raise InvalidInputError(
                f"TransformerConfig.hidden ({self.hidden}) must be a multiple of heads "
                f"({self.heads})"
            )
        if self.seq_len > self.max_positions:
            raise InvalidInputError(
                f"TransformerConfig.seq_len ({self.seq_len}) exceeds max_positions "
                f"({self.max_positions})"
            )

    @classmethod
    def tiny(cls, **overrides: Any) -> TransformerConfig:
        """A config small enough for unit tests (milliseconds per step)."""
        sizes: dict[str, Any] = {"vocab_size": 300, "hidden": 16, "layers": 2, "heads": 2}
        sizes |= {"intermediate": 32, "max_positions": 40, "seq_len": 32, "batch_size": 8}
        sizes |= {"peers": 2, "steps": 3, "learning_rate": 3e-3}
        return cls(**(sizes | overrides))

    @property
    def peer_names(self) -> list[str]:
        """``["peer0", "peer1", ...]``."""
        return [f"peer{i}" for i in range(self.peers)]

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Name → shape of every parameter (and gradient), in the model's order."""
        h, i = self.hidden, self.intermediate
        shapes: dict[str, tuple[int, ...]] = {
            "embeddings.word_embeddings.weight": (self.vocab_size, h),
            "embeddings.position_embeddings.weight": (self.max_positions, h),
            "embeddings.token_type_embeddings.weight": (self.type_vocab_size, h),
        }
        norm = {"LayerNorm.weight": (h,), "LayerNorm.bias": (h,)}
        shapes |= {f"embeddings.{k}": s for k, s in norm.items()}
        for n in range(self.layers):
            p = f"encoder.layer.{n}."
            for m in ("query", "key", "value"):
                shapes |= {
                    f"{p}attention.self.{m}.weight": (h, h),
                    f"{p}attention.self.{m}.bias": (h,),
                }
            shapes |= {
                f"{p}attention.output.dense.weight": (h, h),
                f"{p}attention.output.dense.bias": (h,),
            }
            shapes |= {f"{p}attention.output.{k}": s for k, s in norm.items()}
            shapes |= {f"{p}intermediate.dense.weight": (i, h), f"{p}intermediate.dense.bias": (i,)}
            shapes |= {f"{p}output.dense.weight": (h, i), f"{p}output.dense.bias": (h,)}
            shapes |= {f"{p}output.{k}": s for k, s in norm.items()}
        shapes |= {"pooler.dense.weight": (h, h), "pooler.dense.bias": (h,)}
        shapes |= {"classifier.weight": (self.num_labels, h), "classifier.bias": (self.num_labels,)}
        return shapes

    def numel(self) -> int:
        """Number of parameters of the model."""
        return sum(math.prod(s) for s in self.param_shapes().values())

    def dump_bytes(self) -> int:
        """Total bytes of tensor data in all gradient dumps of the run."""
        return self.numel() * parse_dtype(self.dtype).itemsize * self.peers * self.steps

    @classmethod
    def for_dump_size(cls, mib: float, **overrides: Any) -> TransformerConfig:
        """A config whose gradient dumps total roughly ``mib`` MiB.

        The model keeps its shape and the number of steps grows; only when one
        step of all peers is more than ``mib`` (or ``steps`` is given and each
        dump must be smaller) does the model shrink: fewer layers and a smaller
        vocabulary, in proportion, so the embedding keeps its share of the
        bytes, and below about 10 MiB a narrower hidden size too. Sizes land
        within about 10% of the target.
        """
        base = cls(**overrides)
        target = mib * 2**20
        per_dump = base.dump_bytes() / (base.peers * base.steps)
        steps = (
            base.steps if "steps" in overrides else max(1, round(target / (per_dump * base.peers)))
        )
        want = target / (steps * base.peers)  # bytes of one dump
        config = replace(base, steps=steps)
        if want >= 0.9 * per_dump:
            return config
        itemsize = parse_dtype(base.dtype).itemsize
        while True:
            fraction = want / (config.numel() * itemsize)
            layers = max(1, min(config.layers, round(config.layers * fraction)))
            trial = replace(config, layers=layers, vocab_size=4)
            rest = trial.numel() - 4 * trial.hidden
            vocab = int((want / itemsize - rest) // trial.hidden)
            if vocab >= 1000 or trial.hidden <= 16:
                return replace(trial, vocab_size=max(vocab, 100))
            half = max(16, trial.hidden // 2)
            heads = max(1, min(trial.heads, half // 32))
            config = replace(trial, hidden=half, heads=heads, intermediate=4 * half)


@dataclass(frozen=True)
class TransformerBatch:
    """One peer's batch: token ids, token types, attention mask (False on padding), labels."""

    input_ids: np.ndarray
    token_type_ids: np.ndarray
    attention_mask: np.ndarray
    labels: np.ndarray


@dataclass(frozen=True)
class TransformerStep:
    """One training step: each peer's gradients, and the state after the update."""

    step: int
    loss: float  # mean of the peers' losses, before the update
    peer_losses: dict[str, float]
    gradients: dict[str, dict[str, np.ndarray]]  # peer → parameter name → gradient
    num_examples: dict[str, int]
    params: dict[str, np.ndarray]  # master weights after the update
    exp_avg: dict[str, np.ndarray]
    exp_avg_sq: dict[str, np.ndarray]


class _Data:
    """The run's fixed word distribution and labelling rule, and its batches."""

    def __init__(self, config: TransformerConfig) -> None:
        self.config = config
        init = np.random.default_rng([config.seed, 3])
        v = config.vocab_size
        # BERT's ids where the vocabulary has room for them: [CLS] 101, [SEP] 102.
        self.cls, self.sep = (101, 102) if v > 102 else (1, 2)
        words = np.setdiff1d(np.arange(v), [_PAD, self.cls, self.sep])
        self.words = init.permutation(words)  # rank → token id: hot rows spread out
        cdf = np.cumsum(np.arange(1, words.size + 1, dtype=np.float64) ** -_ZIPF_EXPONENT)
        self.cdf = cdf / cdf[-1]
        # A random bag-of-words rule whose weights fall with the word's rank,
        # so the frequent words, which every batch holds, mostly decide the
        # label: a few hundred examples teach it and the loss falls.
        self.teacher = np.zeros((v, config.num_labels))
        weight = np.arange(1, words.size + 1, dtype=np.float64) ** -_RULE_DECAY
        self.teacher[self.words] = init.standard_normal((words.size, config.num_labels))
        self.teacher[self.words] *= weight[:, None]
        # Centre the scores on those of a reference sample so the classes are balanced.
        self.offset = np.zeros(config.num_labels)
        self.offset = self._scores(self._tokens(init, 2048)[0]).mean(axis=0)

    def _tokens(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        t = self.config.seq_len
        # Sentence lengths of a short-text task (SST-2-like): 1/16 to 1/4 of seq_len.
        low = min(t, max(3, t // 16))
        lengths = rng.integers(low, max(low, t // 4) + 1, size=n)
        ranks = np.searchsorted(self.cdf, rng.random((n, t)), side="right")
        ids = self.words[np.minimum(ranks, self.words.size - 1)]
        mask = np.arange(t) < lengths[:, None]
        ids = np.where(mask, ids, _PAD)
        ids[:, 0] = self.cls
        ids[np.arange(n), lengths - 1] = self.sep
        return ids.astype(np.int64), mask

    def _scores(self, ids: np.ndarray) -> np.ndarray:
        scores: np.ndarray = self.teacher[ids].sum(axis=1) - self.offset
        return scores

    def batch(self, rng: np.random.Generator) -> TransformerBatch:
        ids, mask = self._tokens(rng, self.config.batch_size)
        labels = self._scores(ids).argmax(axis=1)
        types = np.zeros_like(ids)  # one sentence per example
        return TransformerBatch(ids, types, mask, labels)


def init_params(config: TransformerConfig) -> Arrays:
    """BERT's initialisation from the seed: N(0, 0.02) weights, zero biases, unit LayerNorms."""
    master = np.dtype(np.float64 if config.dtype == "float64" else np.float32)
    rng = np.random.default_rng([config.seed, 1])
    params = {}
    for name, shape in config.param_shapes().items():
        if "LayerNorm" in name:
            value = np.ones(shape) if name.endswith("weight") else np.zeros(shape)
        elif name.endswith("bias"):
            value = np.zeros(shape)
        else:
            value = rng.normal(0, 0.02, shape)
        params[name] = value.astype(master)
    params["embeddings.word_embeddings.weight"][_PAD] = 0  # padding_idx=0
    return params


class _Trainer(Protocol):
    def gradients(self, batch: Batch) -> tuple[float, Arrays]: ...
    def update(self, grads: Arrays) -> None: ...
    def state(self) -> tuple[Arrays, Arrays, Arrays]: ...


def _trainer(config: TransformerConfig, backend: Backend) -> _Trainer:
    if backend not in ("auto", "torch", "numpy"):
        raise InvalidInputError(f"backend must be 'auto', 'torch' or 'numpy', not {backend!r}")
    params = init_params(config)
    lr, wd = config.learning_rate, config.weight_decay
    if backend != "numpy":
        try:
            from gradpipe.testing._transformer_torch import TorchTrainer
        except ImportError:
            if backend == "torch":
                raise
        else:
            return TorchTrainer(
                params,
                layers=config.layers,
                heads=config.heads,
                lr=lr,
                weight_decay=wd,
                seed=config.seed,
            )
    return NumpyTrainer(params, layers=config.layers, heads=config.heads, lr=lr, weight_decay=wd)


def train_transformer(
    config: TransformerConfig | None = None, *, backend: Backend = "auto"
) -> Iterator[TransformerStep]:
    """Train the encoder data-parallel over ``config.peers``, one step at a time.

    Every peer computes the gradient of its own batch; the optimizer takes
    their mean (accumulated in float32 in fixed peer order, from what the peers
    sent, as an all-reduce would). ``backend`` ``"auto"`` uses torch when it is
    installed; both give the same numbers to rounding, and each is
    deterministic given the seed.
    """
    config = config or TransformerConfig()
    trainer = _trainer(config, backend)
    data = _Data(config)
    wire = parse_dtype(config.dtype)
    rng = np.random.default_rng([config.seed, 2])  # one stream, peers in fixed order
    for step in range(config.steps):
        grads, losses, counts = {}, {}, {}
        for peer in config.peer_names:
            batch = data.batch(rng)
            losses[peer], g = trainer.gradients(batch)
            grads[peer] = {k: a.astype(wire) for k, a in g.items()}
            counts[peer] = len(batch.labels)
        master = np.float64 if config.dtype == "float64" else np.float32
        avg = {}
        for name in grads[config.peer_names[0]]:
            total = np.zeros(grads[config.peer_names[0]][name].shape, dtype=master)
            for peer in config.peer_names:
                total += grads[peer][name]
            avg[name] = total / master(config.peers)
        trainer.update(avg)
        params, exp_avg, exp_avg_sq = trainer.state()
        loss = sum(losses.values()) / config.peers
        yield TransformerStep(step, loss, losses, grads, counts, params, exp_avg, exp_avg_sq)


@dataclass(frozen=True)
class TransformerRun(RunFiles):
    """Where :func:`write_transformer_run` put its files (the layout of ``SampleRun``)."""

    config: TransformerConfig


def write_transformer_run(
    directory: str | os.PathLike[str],
    config: TransformerConfig | None = None,
    *,
    backend: Backend = "auto",
    states: bool = True,
) -> TransformerRun:
    """Train with ``config`` and write its gradient dumps and (``states``) training states.

    Layout: ``dumps/step=NNNN/peer=<peer>.safetensors`` (metadata ``num_examples``,
    ``step``, ``peer``, ``loss``) and ``state/step=NNNN.safetensors`` (tensors
    ``params/<name>``, ``exp_avg/<name>``, ``exp_avg_sq/<name>`` and the
    optimizer's step counter ``step/<name>``, as ``torch.optim.AdamW`` keeps
    them; metadata ``step``, ``loss`` and ``config`` as JSON).
    """
    config = config or TransformerConfig()
    root = Path(directory)
    run = TransformerRun(
        directory=str(root),
        dump_pattern=str(root / "dumps" / "step={step}" / "peer={peer}.safetensors"),
        state_pattern=str(root / "state" / "step={step}.safetensors"),
        steps=list(range(config.steps)),
        peers=config.peer_names,
        config=config,
    )
    if states:
        (root / "state").mkdir(parents=True, exist_ok=True)
    config_json = json.dumps(asdict(config), sort_keys=True)
    for result in train_transformer(config, backend=backend):
        Path(run.dump_path(result.step, "x")).parent.mkdir(parents=True, exist_ok=True)
        for peer, grads in result.gradients.items():
            meta = {
                "num_examples": str(result.num_examples[peer]),
                "step": str(result.step),
                "peer": peer,
                "loss": repr(result.peer_losses[peer]),
            }
            write_safetensors(run.dump_path(result.step, peer), grads, meta)
        if not states:
            continue
        tensors = {
            f"{kind}/{name}": arr
            for kind, group in (
                ("params", result.params),
                ("exp_avg", result.exp_avg),
                ("exp_avg_sq", result.exp_avg_sq),
            )
            for name, arr in group.items()
        }
        counter = np.array(result.step + 1, dtype=np.float32)  # torch keeps it as a tensor
        tensors |= {f"step/{name}": counter for name in result.params}
        meta = {"step": str(result.step), "loss": repr(result.loss), "config": config_json}
        write_safetensors(run.state_path(result.step), tensors, meta)
    return run
