"""Forward and backward pass of a BERT-like encoder in plain numpy, and AdamW.

The fallback of :mod:`gradpipe.testing.transformer` when torch is not installed,
and the reference its tests check against finite differences. It computes what
``gradpipe.testing._transformer_torch`` computes (same parameter names, the
``y = x @ W.T + b`` layout of ``torch.nn.Linear``, LayerNorm eps 1e-12, the tanh
GELU, an additive attention mask, ``padding_idx=0``), so the two agree to
rounding and either can produce the benchmark data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np

__all__ = [
    "LN_EPS",
    "MASKED",
    "Batch",
    "NumpyTrainer",
    "adamw_update",
    "loss_and_gradients",
]

LN_EPS = 1e-12  # BERT's LayerNorm epsilon
MASKED = -1e9  # added to the attention scores of padding keys: exp() of it is 0
_GELU_C = math.sqrt(2 / math.pi)

Arrays = dict[str, np.ndarray]


class Batch(Protocol):
    """What a training step reads (see ``TransformerBatch``)."""

    @property
    def input_ids(self) -> np.ndarray: ...  # (batch, seq) int64
    @property
    def token_type_ids(self) -> np.ndarray: ...  # (batch, seq) int64
    @property
    def attention_mask(self) -> np.ndarray: ...  # (batch, seq) bool, False on padding
    @property
    def labels(self) -> np.ndarray: ...  # (batch,) int64


def _linear(x: np.ndarray, p: Arrays, name: str) -> np.ndarray:
    out: np.ndarray = x @ p[f"{name}.weight"].T + p[f"{name}.bias"]
    return out


def _linear_back(dy: np.ndarray, x: np.ndarray, p: Arrays, name: str, g: Arrays) -> np.ndarray:
    """Store the weight and bias gradients of ``name`` in ``g``; return d loss / d x."""
    x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    g[f"{name}.weight"] = dy2.T @ x2
    g[f"{name}.bias"] = dy2.sum(axis=0)
    dx: np.ndarray = dy @ p[f"{name}.weight"]
    return dx


def _layer_norm(
    x: np.ndarray, p: Arrays, name: str
) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
    centred = x - x.mean(axis=-1, keepdims=True)
    rstd = 1 / np.sqrt((centred * centred).mean(axis=-1, keepdims=True) + LN_EPS)
    xhat = centred * rstd
    return xhat * p[f"{name}.weight"] + p[f"{name}.bias"], (xhat, rstd)


def _layer_norm_back(
    dy: np.ndarray, cache: tuple[np.ndarray, np.ndarray], p: Arrays, name: str, g: Arrays
) -> np.ndarray:
    xhat, rstd = cache
    width = dy.shape[-1]
    g[f"{name}.weight"] = (dy * xhat).reshape(-1, width).sum(axis=0)
    g[f"{name}.bias"] = dy.reshape(-1, width).sum(axis=0)
    dxhat = dy * p[f"{name}.weight"]
    mean = dxhat.mean(axis=-1, keepdims=True)
    proj = (dxhat * xhat).mean(axis=-1, keepdims=True)
    dx: np.ndarray = rstd * (dxhat - mean - xhat * proj)
    return dx


def _gelu(u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The tanh GELU (numpy has no erf) and its derivative."""
    t = np.tanh(_GELU_C * (u + 0.044715 * u**3))
    out = 0.5 * u * (1 + t)
    grad = 0.5 * (1 + t) + 0.5 * u * (1 - t * t) * _GELU_C * (1 + 3 * 0.044715 * u * u)
    return out, grad


def _softmax(s: np.ndarray) -> np.ndarray:
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    out: np.ndarray = e / e.sum(axis=-1, keepdims=True)
    return out


@dataclass
class _LayerCache:
    """What the backward pass of one encoder layer needs from its forward pass."""

    x: np.ndarray
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    probs: np.ndarray
    context: np.ndarray
    ln1: tuple[np.ndarray, np.ndarray]
    h1: np.ndarray
    act: np.ndarray
    act_grad: np.ndarray
    ln2: tuple[np.ndarray, np.ndarray]


def _encoder_layer(
    x: np.ndarray, bias: np.ndarray, p: Arrays, prefix: str, heads: int
) -> tuple[np.ndarray, _LayerCache]:
    b, t, h = x.shape
    d = h // heads

    def split(a: np.ndarray) -> np.ndarray:
        return a.reshape(b, t, heads, d).transpose(0, 2, 1, 3)

    att = f"{prefix}attention."
    q, k, v = (split(_linear(x, p, f"{att}self.{m}")) for m in ("query", "key", "value"))
    probs = _softmax(q @ k.transpose(0, 1, 3, 2) / math.sqrt(d) + bias)
    context = (probs @ v).transpose(0, 2, 1, 3).reshape(b, t, h)
    h1, ln1 = _layer_norm(
        _linear(context, p, f"{att}output.dense") + x, p, f"{att}output.LayerNorm"
    )
    act, act_grad = _gelu(_linear(h1, p, f"{prefix}intermediate.dense"))
    out, ln2 = _layer_norm(
        _linear(act, p, f"{prefix}output.dense") + h1, p, f"{prefix}output.LayerNorm"
    )
    return out, _LayerCache(x, q, k, v, probs, context, ln1, h1, act, act_grad, ln2)


def _encoder_layer_back(
    dout: np.ndarray, c: _LayerCache, p: Arrays, prefix: str, *, heads: int, g: Arrays
) -> np.ndarray:
    b, t, h = c.x.shape
    d = h // heads
    att = f"{prefix}attention."
    dsum2 = _layer_norm_back(dout, c.ln2, p, f"{prefix}output.LayerNorm", g)
    du = _linear_back(dsum2, c.act, p, f"{prefix}output.dense", g) * c.act_grad
    dh1 = dsum2 + _linear_back(du, c.h1, p, f"{prefix}intermediate.dense", g)
    dsum1 = _layer_norm_back(dh1, c.ln1, p, f"{att}output.LayerNorm", g)
    dcontext = _linear_back(dsum1, c.context, p, f"{att}output.dense", g)
    dctx = dcontext.reshape(b, t, heads, d).transpose(0, 2, 1, 3)
    dprobs = dctx @ c.v.transpose(0, 1, 3, 2)
    dv = c.probs.transpose(0, 1, 3, 2) @ dctx
    # Softmax backward, then the 1/sqrt(d) scaling of the scores.
    ds = c.probs * (dprobs - (dprobs * c.probs).sum(axis=-1, keepdims=True)) / math.sqrt(d)
    dq, dk = ds @ c.k, ds.transpose(0, 1, 3, 2) @ c.q
    dx = dsum1  # the residual connection
    for m, dm in (("query", dq), ("key", dk), ("value", dv)):
        merged = dm.transpose(0, 2, 1, 3).reshape(b, t, h)
        dx = dx + _linear_back(merged, c.x, p, f"{att}self.{m}", g)
    return dx


def loss_and_gradients(
    params: Arrays, batch: Batch, *, layers: int, heads: int
) -> tuple[float, Arrays]:
    """Mean softmax cross-entropy of a batch and its gradient for every parameter.

    Parameters
    ----------
    params : dict of str to numpy.ndarray
        Named as in ``TransformerConfig.param_shapes``; computed in their dtype.
    batch : Batch
        Token ids, token types, attention mask and labels.
    layers, heads : int
        Encoder layers and attention heads.
    """
    ids, types = batch.input_ids, batch.token_type_ids
    b, t = ids.shape
    dtype = params["embeddings.word_embeddings.weight"].dtype
    x0 = (
        params["embeddings.word_embeddings.weight"][ids]
        + params["embeddings.position_embeddings.weight"][:t]
        + params["embeddings.token_type_embeddings.weight"][types]
    )
    hidden, ln0 = _layer_norm(x0, params, "embeddings.LayerNorm")
    bias = np.where(batch.attention_mask, 0, MASKED).astype(dtype)[:, None, None, :]
    caches = []
    for i in range(layers):
        hidden, cache = _encoder_layer(hidden, bias, params, f"encoder.layer.{i}.", heads)
        caches.append(cache)
    first = hidden[:, 0]
    pooled = np.tanh(_linear(first, params, "pooler.dense"))
    logits = _linear(pooled, params, "classifier")
    probs = _softmax(logits)
    rows = np.arange(b)
    loss = float(-np.mean(np.log(probs[rows, batch.labels])))

    g: Arrays = {}
    dlogits = probs.copy()
    dlogits[rows, batch.labels] -= 1
    dlogits /= b
    dpooled = _linear_back(dlogits, pooled, params, "classifier", g)
    dfirst = _linear_back(dpooled * (1 - pooled * pooled), first, params, "pooler.dense", g)
    dhidden = np.zeros_like(hidden)
    dhidden[:, 0] = dfirst
    for i in reversed(range(layers)):
        dhidden = _encoder_layer_back(
            dhidden, caches[i], params, f"encoder.layer.{i}.", heads=heads, g=g
        )
    dx0 = _layer_norm_back(dhidden, ln0, params, "embeddings.LayerNorm", g)
    width = dx0.shape[-1]
    flat = dx0.reshape(-1, width)
    for name, index in (("word", ids), ("token_type", types)):
        table = np.zeros_like(params[f"embeddings.{name}_embeddings.weight"])
        np.add.at(table, index.reshape(-1), flat)  # only the rows the batch used
        g[f"embeddings.{name}_embeddings.weight"] = table
    g["embeddings.word_embeddings.weight"][0] = 0  # padding_idx=0, as torch.nn.Embedding
    positions = np.zeros_like(params["embeddings.position_embeddings.weight"])
    positions[:t] = dx0.sum(axis=0)
    g["embeddings.position_embeddings.weight"] = positions
    return loss, {k: g[k].astype(dtype, copy=False) for k in params}


def adamw_update(
    params: Arrays,
    grads: Arrays,
    exp_avg: Arrays,
    exp_avg_sq: Arrays,
    step: int,
    *,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
) -> None:
    """One AdamW step in place, in the order of ``torch.optim.AdamW``; ``step`` counts from 1."""
    b1, b2 = betas
    step_size = lr / (1 - b1**step)
    root_c2 = math.sqrt(1 - b2**step)
    for name in params:
        grad = grads[name]
        params[name] *= 1 - lr * weight_decay  # decoupled weight decay, in place
        exp_avg[name] += (grad - exp_avg[name]) * (1 - b1)  # torch's lerp
        exp_avg_sq[name] *= b2
        exp_avg_sq[name] += (1 - b2) * grad * grad
        params[name] -= step_size * exp_avg[name] / (np.sqrt(exp_avg_sq[name]) / root_c2 + eps)


class NumpyTrainer:
    """A model's parameters and AdamW state, trained with :func:`loss_and_gradients`."""

    def __init__(
        self, params: Arrays, *, layers: int, heads: int, lr: float, weight_decay: float
    ) -> None:
        self.params = {k: v.copy() for k, v in params.items()}
        self.exp_avg = {k: np.zeros_like(v) for k, v in params.items()}
        self.exp_avg_sq = {k: np.zeros_like(v) for k, v in params.items()}
        self.step = 0
        self._layers, self._heads = layers, heads
        self._lr, self._wd = lr, weight_decay

    def gradients(self, batch: Batch) -> tuple[float, Arrays]:
        """Loss and gradients of ``batch`` at the current parameters."""
        return loss_and_gradients(self.params, batch, layers=self._layers, heads=self._heads)

    def update(self, grads: Arrays) -> None:
        """Apply one AdamW step with ``grads`` (the peers' average)."""
        self.step += 1
        cast = {k: np.asarray(g, dtype=self.params[k].dtype) for k, g in grads.items()}
        adamw_update(
            self.params,
            cast,
            self.exp_avg,
            self.exp_avg_sq,
            self.step,
            lr=self._lr,
            weight_decay=self._wd,
        )

    def state(self) -> tuple[Arrays, Arrays, Arrays]:
        """Copies of the parameters, ``exp_avg`` and ``exp_avg_sq``."""
        copies = [
            {k: v.copy() for k, v in group.items()}
            for group in (self.params, self.exp_avg, self.exp_avg_sq)
        ]
        return copies[0], copies[1], copies[2]
