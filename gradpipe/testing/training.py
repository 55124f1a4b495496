"""A small but real federated training run, to produce realistic gradient dumps.

Tests, benchmarks and the demo job need gradients with the structure of real
ones, not random noise: an embedding over a vocabulary far larger than a batch
(so almost all of its gradient rows are exactly zero, with a Zipf-skewed set of
hot rows), dense layers with dense gradients, losses that fall and parameters
that drift slowly from step to step. This module trains such a model with plain
numpy backprop and Adam over several peers, each with its own (non-IID) data
shard and batch size, combined by FedAvg, deterministically from a seed.

Model: ``tokens → embedding → mean over tokens → dense1 → ReLU → dense2 → ReLU
→ classifier → softmax``; labels come from a fixed random *teacher* network, so
the task is learnable. Master weights and Adam moments are kept in float32
(float64 when ``dtype="float64"``, for gradient checks); gradients are emitted
(dumped, and averaged) in ``config.dtype``, as mixed-precision peers would send them.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from gradpipe.core.dtypes import parse_dtype
from gradpipe.errors import InvalidInputError
from gradpipe.formats.safetensors import write_safetensors

__all__ = [
    "RunFiles",
    "SampleRun",
    "StepResult",
    "TrainingConfig",
    "TrainingState",
    "loss_and_gradients",
    "sample_gradients",
    "train",
    "write_sample_run",
]

_ZIPF_EXPONENT = 1.1  # word frequencies in natural text are close to 1/rank
_BETAS = (0.9, 0.999)
_EPS = 1e-8
_LAYERS = ("dense1", "dense2", "classifier")


@dataclass(frozen=True)
class TrainingConfig:
    """Sizes and hyper-parameters of a synthetic training run (defaults: fast, for tests)."""

    vocab_size: int = 20_000
    embed_dim: int = 32
    hidden: int = 64
    num_classes: int = 10
    tokens_per_example: int = 12
    peers: int = 3
    examples_per_peer: tuple[int, ...] = (32, 64, 128)  # cycled when shorter than `peers`
    steps: int = 4
    learning_rate: float = 1e-3
    seed: int = 0
    dtype: str = "float32"

    def __post_init__(self) -> None:
        parse_dtype(self.dtype)
        if self.dtype not in ("float16", "bfloat16", "float32", "float64"):
            raise InvalidInputError(
                f"TrainingConfig.dtype must be a float dtype, not {self.dtype!r}"
            )
        sizes = (self.vocab_size, self.embed_dim, self.hidden, self.num_classes)
        if min(*sizes, self.tokens_per_example, self.peers, self.steps) < 1:
            raise InvalidInputError(f"TrainingConfig sizes must be positive: {self}")
        if not self.examples_per_peer or min(self.examples_per_peer) < 1:
            raise InvalidInputError("TrainingConfig.examples_per_peer needs positive batch sizes")

    @property
    def peer_names(self) -> list[str]:
        """``["peer0", "peer1", ...]``."""
        return [f"peer{i}" for i in range(self.peers)]

    def batch_size(self, peer: int) -> int:
        """Examples peer number ``peer`` contributes per step."""
        return self.examples_per_peer[peer % len(self.examples_per_peer)]

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Name → shape of every parameter (and so of every gradient)."""
        e, h, c = self.embed_dim, self.hidden, self.num_classes
        dims = {"dense1": (e, h), "dense2": (h, h), "classifier": (h, c)}
        shapes: dict[str, tuple[int, ...]] = {"embedding.weight": (self.vocab_size, e)}
        for layer, (n_in, n_out) in dims.items():
            shapes[f"{layer}.weight"] = (n_in, n_out)
            shapes[f"{layer}.bias"] = (n_out,)
        return shapes

    def dump_bytes(self) -> int:
        """Total bytes of tensor data in all gradient dumps of the run."""
        numel = sum(math.prod(s) for s in self.param_shapes().values())
        return numel * parse_dtype(self.dtype).itemsize * self.peers * self.steps

    @classmethod
    def for_dump_size(cls, mib: float, **overrides: Any) -> TrainingConfig:
        """A config whose gradient dumps total about ``mib`` MiB (within a few %).

        The embedding table carries the size, as in real models: ``embed_dim``
        grows with the square root of the target and ``vocab_size`` takes the rest.
        """
        base = cls(**overrides)
        per_elem = parse_dtype(base.dtype).itemsize * base.peers * base.steps
        dense = sum(math.prod(s) for k, s in base.param_shapes().items() if k != "embedding.weight")
        numel = max(int(mib * 2**20 / per_elem) - dense, 1)
        embed_dim = int(min(256, max(16, 2 ** round(math.log2(math.sqrt(numel / 2000) or 1)))))
        embed_dim = overrides.get("embed_dim", embed_dim)
        return replace(base, embed_dim=embed_dim, vocab_size=max(1, numel // embed_dim))


@dataclass(frozen=True)
class TrainingState:
    """Everything needed to resume training after ``step`` (master precision)."""

    step: int
    params: dict[str, np.ndarray]
    adam_m: dict[str, np.ndarray]
    adam_v: dict[str, np.ndarray]
    rng_state: dict[str, object]  # numpy bit-generator state; JSON-serialisable
    loss: float


@dataclass(frozen=True)
class StepResult:
    """One training step: the peers' gradients and the state after the update."""

    step: int
    loss: float  # FedAvg-weighted mean of the peers' losses, before the update
    gradients: dict[str, dict[str, np.ndarray]]  # peer → parameter name → gradient
    num_examples: dict[str, int]
    state: TrainingState
    peer_losses: dict[str, float] = field(default_factory=dict)


def loss_and_gradients(
    params: dict[str, np.ndarray], tokens: np.ndarray, labels: np.ndarray
) -> tuple[float, dict[str, np.ndarray]]:
    """Mean cross-entropy over a batch and its gradient for every parameter.

    Parameters
    ----------
    params : dict of str to numpy.ndarray
        As from :meth:`TrainingConfig.param_shapes`; computed in their dtype.
    tokens : numpy.ndarray of int, shape (batch, tokens_per_example)
    labels : numpy.ndarray of int, shape (batch,)
    """
    emb = params["embedding.weight"]
    batch, t = tokens.shape
    acts = [emb[tokens].mean(axis=1)]  # (batch, embed_dim)
    pre = []
    for layer in _LAYERS:
        z = acts[-1] @ params[f"{layer}.weight"] + params[f"{layer}.bias"]
        pre.append(z)
        acts.append(np.maximum(z, 0) if layer != "classifier" else z)
    logits = acts.pop()
    logits = logits - logits.max(axis=1, keepdims=True)  # stable softmax
    log_z = np.log(np.exp(logits).sum(axis=1))
    loss = float(np.mean(log_z - logits[np.arange(batch), labels]))

    grads: dict[str, np.ndarray] = {}
    delta = np.exp(logits - log_z[:, None])
    delta[np.arange(batch), labels] -= 1
    delta /= batch
    for i in reversed(range(len(_LAYERS))):
        layer = _LAYERS[i]
        grads[f"{layer}.weight"] = acts[i].T @ delta
        grads[f"{layer}.bias"] = delta.sum(axis=0)
        delta = delta @ params[f"{layer}.weight"].T
        if i > 0:
            delta *= pre[i - 1] > 0  # ReLU
    # Scatter-add into the few rows the batch touched: each token position gets
    # delta/t. bincount over (compact row, column) is one vectorised pass and,
    # unlike a bincount over the whole table, costs nothing per untouched row.
    rows, inverse = np.unique(tokens, return_inverse=True)
    dim = emb.shape[1]
    flat = (inverse.reshape(-1, 1) * dim + np.arange(dim)).reshape(-1)
    weights = np.repeat(delta / t, t, axis=0).reshape(-1)
    touched = np.bincount(flat, weights=weights, minlength=rows.size * dim).reshape(-1, dim)
    g_emb = np.zeros_like(emb)
    g_emb[rows] = touched
    grads["embedding.weight"] = g_emb
    return loss, {k: grads[k].astype(emb.dtype, copy=False) for k in params}


class _Run:
    """Fixed parts of a run: teacher, peers' token distributions, initial weights."""

    def __init__(self, config: TrainingConfig) -> None:
        self.config = config
        self.master = np.dtype(np.float64 if config.dtype == "float64" else np.float32)
        init = np.random.default_rng([config.seed, 1])
        v, c = config.vocab_size, config.num_classes
        ranks = np.arange(1, v + 1, dtype=np.float64)
        cdf = np.cumsum(ranks**-_ZIPF_EXPONENT)
        self.cdf = cdf / cdf[-1]
        # Non-IID shards: every peer has its own ranking of the vocabulary, but
        # they share the global head so the hottest rows overlap between peers.
        shared = init.permutation(v)
        self.vocab_maps = []
        for _ in range(config.peers):
            mapping = shared.copy()
            head = min(v, 64)
            mapping[head:] = init.permutation(mapping[head:])
            self.vocab_maps.append(mapping)
        rank = 8
        self.teacher = (init.standard_normal((v, rank)) @ init.standard_normal((rank, c))).astype(
            np.float32
        )
        self.params: dict[str, np.ndarray] = {}
        for name, shape in config.param_shapes().items():
            if name.endswith(".bias"):
                w = np.zeros(shape)
            elif name == "embedding.weight":
                w = init.standard_normal(shape)  # like torch.nn.Embedding
            else:
                w = init.standard_normal(shape) * math.sqrt(2.0 / shape[0])  # He init
            self.params[name] = w.astype(self.master)

    def batch(self, rng: np.random.Generator, peer: int) -> tuple[np.ndarray, np.ndarray]:
        n, t = self.config.batch_size(peer), self.config.tokens_per_example
        ranks = np.searchsorted(self.cdf, rng.random(n * t), side="right")
        tokens = self.vocab_maps[peer][np.minimum(ranks, self.config.vocab_size - 1)]
        tokens = tokens.reshape(n, t)
        labels = self.teacher[tokens].sum(axis=1).argmax(axis=1)
        return tokens, labels


def train(config: TrainingConfig, *, resume: TrainingState | None = None) -> Iterator[StepResult]:
    """Run the federated training, yielding one :class:`StepResult` per step.

    Steps are numbered from 0; ``result.state`` is the state after that step's
    update. With ``resume`` (a state from a run with the same config) training
    continues at ``resume.step + 1`` and is bit-identical to never stopping.
    """
    run = _Run(config)
    wire = parse_dtype(config.dtype)
    # One data stream for all peers, drawn in fixed peer order: a single
    # bit-generator state is then the whole RNG state of the run.
    rng = np.random.default_rng([config.seed, 2])
    if resume is None:
        params = run.params
        m = {k: np.zeros_like(p) for k, p in params.items()}
        v = {k: np.zeros_like(p) for k, p in params.items()}
        first = 0
    else:
        rng.bit_generator.state = resume.rng_state
        params, m, v, first = resume.params, resume.adam_m, resume.adam_v, resume.step + 1
    b1, b2 = _BETAS
    for step in range(first, config.steps):
        grads, losses, counts = {}, {}, {}
        for i, peer in enumerate(config.peer_names):
            tokens, labels = run.batch(rng, i)
            losses[peer], g = loss_and_gradients(params, tokens, labels)
            grads[peer] = {k: a.astype(wire) for k, a in g.items()}
            counts[peer] = len(labels)
        total = sum(counts.values())
        loss = sum(losses[p] * counts[p] for p in counts) / total
        t = step + 1
        new_p, new_m, new_v = {}, {}, {}
        for name, p in params.items():
            # FedAvg of what the peers sent, accumulated in float64.
            avg = sum(grads[q][name].astype(np.float64) * (counts[q] / total) for q in counts)
            avg = np.asarray(avg, dtype=run.master)
            new_m[name] = b1 * m[name] + (1 - b1) * avg
            new_v[name] = b2 * v[name] + (1 - b2) * avg * avg
            m_hat = new_m[name] / (1 - b1**t)
            v_hat = new_v[name] / (1 - b2**t)
            new_p[name] = (p - config.learning_rate * m_hat / (np.sqrt(v_hat) + _EPS)).astype(
                run.master
            )
        params, m, v = new_p, new_m, new_v
        state = TrainingState(step, params, m, v, dict(rng.bit_generator.state), loss)
        yield StepResult(step, loss, grads, counts, state, losses)


def sample_gradients(config: TrainingConfig | None = None) -> dict[str, np.ndarray]:
    """One peer's gradients of the first step: a realistic input for codec benchmarks."""
    first = next(train(config or TrainingConfig()))
    return first.gradients["peer0"]


@dataclass(frozen=True)
class RunFiles:
    """Where a generated run's files are, with ``{step}``/``{peer}`` patterns.

    The layout every generator in :mod:`gradpipe.testing` writes:
    ``dumps/step=NNNN/peer=<peer>.safetensors`` and ``state/step=NNNN.safetensors``.
    """

    directory: str
    dump_pattern: str
    state_pattern: str
    steps: list[int]
    peers: list[str]

    def dump_path(self, step: int, peer: str) -> str:
        """Path of the gradient dump of ``peer`` at ``step``."""
        return self.dump_pattern.format(step=f"{step:04d}", peer=peer)

    def state_path(self, step: int) -> str:
        """Path of the training-state file after ``step``."""
        return self.state_pattern.format(step=f"{step:04d}")


@dataclass(frozen=True)
class SampleRun(RunFiles):
    """Where :func:`write_sample_run` put its files, and the config that made them."""

    config: TrainingConfig


def write_sample_run(
    directory: str | os.PathLike[str], config: TrainingConfig | None = None
) -> SampleRun:
    """Train with ``config`` and write its gradient dumps and training states.

    Layout: ``dumps/step=NNNN/peer=<peer>.safetensors`` (metadata ``num_examples``,
    ``step``, ``peer``, ``loss``) and ``state/step=NNNN.safetensors`` (tensors
    ``params/<name>``, ``adam_m/<name>``, ``adam_v/<name>``; metadata ``step``,
    ``loss``, ``rng_state`` and ``config`` as JSON).
    """
    config = config or TrainingConfig()
    root = Path(directory)
    run = SampleRun(
        directory=str(root),
        dump_pattern=str(root / "dumps" / "step={step}" / "peer={peer}.safetensors"),
        state_pattern=str(root / "state" / "step={step}.safetensors"),
        steps=list(range(config.steps)),
        peers=config.peer_names,
        config=config,
    )
    (root / "state").mkdir(parents=True, exist_ok=True)
    config_json = json.dumps(asdict(config), sort_keys=True)
    for result in train(config):
        Path(run.dump_path(result.step, "x")).parent.mkdir(parents=True, exist_ok=True)
        for peer, grads in result.gradients.items():
            meta = {
                "num_examples": str(result.num_examples[peer]),
                "step": str(result.step),
                "peer": peer,
                "loss": repr(result.peer_losses[peer]),
            }
            write_safetensors(run.dump_path(result.step, peer), grads, meta)
        s = result.state
        tensors = {
            f"{kind}/{name}": arr
            for kind, group in (("params", s.params), ("adam_m", s.adam_m), ("adam_v", s.adam_v))
            for name, arr in group.items()
        }
        meta = {
            "step": str(s.step),
            "loss": repr(s.loss),
            "rng_state": json.dumps(s.rng_state),
            "config": config_json,
        }
        write_safetensors(run.state_path(s.step), tensors, meta)
    return run
