"""The BERT-like encoder in plain ``torch.nn`` modules, trained with ``torch.optim.AdamW``.

Imported only when torch is installed and asked for. Module attributes are
named so that ``named_parameters()`` gives exactly the names of a Hugging Face
BERT encoder (``embeddings.word_embeddings.weight``,
``encoder.layer.0.attention.self.query.weight``, ...), and the arithmetic is that
of :mod:`gradpipe.testing._transformer_numpy` (tanh GELU, LayerNorm eps 1e-12,
an additive attention mask, ``padding_idx=0``). Weights come from the caller
(drawn with numpy from the run's seed), so both implementations start from the
same point and nothing is downloaded.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from gradpipe.testing._transformer_numpy import LN_EPS, MASKED, Arrays, Batch

__all__ = ["TorchTrainer"]


class _Embeddings(nn.Module):
    def __init__(self, vocab: int, positions: int, types: int, hidden: int) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, hidden, padding_idx=0)
        self.position_embeddings = nn.Embedding(positions, hidden)
        self.token_type_embeddings = nn.Embedding(types, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=LN_EPS)

    def forward(self, ids: torch.Tensor, types: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1])
        x = self.word_embeddings(ids) + self.position_embeddings(positions)
        out: torch.Tensor = self.LayerNorm(x + self.token_type_embeddings(types))
        return out


class _SelfAttention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        d = h // self.heads

        def split(a: torch.Tensor) -> torch.Tensor:
            return a.reshape(b, t, self.heads, d).transpose(1, 2)

        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        probs = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d) + bias, dim=-1)
        return (probs @ v).transpose(1, 2).reshape(b, t, h)


class _DenseNorm(nn.Module):
    """``LayerNorm(dense(x) + residual)``: BERT's ``attention.output`` and ``output``."""

    def __init__(self, n_in: int, hidden: int) -> None:
        super().__init__()
        self.dense = nn.Linear(n_in, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=LN_EPS)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.LayerNorm(self.dense(x) + residual)
        return out


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.self = _SelfAttention(hidden, heads)
        self.output = _DenseNorm(hidden, hidden)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.output(self.self(x, bias), x)
        return out


class _Intermediate(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, intermediate)
        self.act = nn.GELU(approximate="tanh")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.act(self.dense(x))
        return out


class _Layer(nn.Module):
    def __init__(self, hidden: int, heads: int, intermediate: int) -> None:
        super().__init__()
        self.attention = _Attention(hidden, heads)
        self.intermediate = _Intermediate(hidden, intermediate)
        self.output = _DenseNorm(intermediate, hidden)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        h1 = self.attention(x, bias)
        out: torch.Tensor = self.output(self.intermediate(h1), h1)
        return out


class _Encoder(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, intermediate: int) -> None:
        super().__init__()
        self.layer = nn.ModuleList(_Layer(hidden, heads, intermediate) for _ in range(layers))

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        for layer in self.layer:
            x = layer(x, bias)
        return x


class _Pooler(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(x[:, 0]))


class _Classifier(nn.Module):
    """A BERT encoder, its pooler and a linear classification head."""

    def __init__(
        self,
        *,
        vocab: int,
        positions: int,
        types: int,
        hidden: int,
        layers: int,
        heads: int,
        intermediate: int,
        labels: int,
    ) -> None:
        super().__init__()
        self.embeddings = _Embeddings(vocab, positions, types, hidden)
        self.encoder = _Encoder(layers, hidden, heads, intermediate)
        self.pooler = _Pooler(hidden)
        self.classifier = nn.Linear(hidden, labels)

    def forward(self, ids: torch.Tensor, types: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(ids, types)
        bias = torch.zeros(mask.shape, dtype=x.dtype).masked_fill(~mask, MASKED)
        out: torch.Tensor = self.classifier(self.pooler(self.encoder(x, bias[:, None, None, :])))
        return out


class TorchTrainer:
    """The torch twin of ``NumpyTrainer``: same methods, same names, same numbers to rounding."""

    def __init__(
        self,
        params: Arrays,
        *,
        layers: int,
        heads: int,
        lr: float,
        weight_decay: float,
        seed: int,
    ) -> None:
        torch.manual_seed(seed)  # nothing random is drawn by torch here; a guard for later
        emb = params["embeddings.word_embeddings.weight"]
        self.model = _Classifier(
            vocab=emb.shape[0],
            positions=params["embeddings.position_embeddings.weight"].shape[0],
            types=params["embeddings.token_type_embeddings.weight"].shape[0],
            hidden=emb.shape[1],
            layers=layers,
            heads=heads,
            intermediate=params["encoder.layer.0.intermediate.dense.weight"].shape[0],
            labels=params["classifier.weight"].shape[0],
        ).to(torch.float64 if emb.dtype == np.float64 else torch.float32)
        self.named = dict(self.model.named_parameters())
        if self.named.keys() != params.keys():
            raise AssertionError(f"torch names differ: {sorted(self.named.keys() ^ params.keys())}")
        with torch.no_grad():
            for name, p in self.named.items():
                p.copy_(torch.from_numpy(params[name]))
        self.optimizer = torch.optim.AdamW(
            self.named.values(), lr=lr, weight_decay=weight_decay, foreach=False
        )

    def gradients(self, batch: Batch) -> tuple[float, Arrays]:
        """Loss and gradients of ``batch`` at the current parameters."""
        self.model.zero_grad(set_to_none=True)
        logits = self.model(
            torch.from_numpy(batch.input_ids),
            torch.from_numpy(batch.token_type_ids),
            torch.from_numpy(batch.attention_mask),
        )
        loss = nn.functional.cross_entropy(logits, torch.from_numpy(batch.labels))
        loss.backward()
        grads = {}
        for name, p in self.named.items():
            assert p.grad is not None  # every parameter takes part in the loss
            grads[name] = p.grad.numpy().copy()
        return float(loss.detach()), grads

    def update(self, grads: Arrays) -> None:
        """Apply one AdamW step with ``grads`` (the peers' average)."""
        for name, p in self.named.items():
            p.grad = torch.from_numpy(np.asarray(grads[name])).to(p.dtype)
        self.optimizer.step()

    def state(self) -> tuple[Arrays, Arrays, Arrays]:
        """Copies of the parameters, ``exp_avg`` and ``exp_avg_sq``."""
        params, exp_avg, exp_avg_sq = {}, {}, {}
        for name, p in self.named.items():
            params[name] = p.detach().numpy().copy()
            state = self.optimizer.state[p]
            exp_avg[name] = state["exp_avg"].numpy().copy()
            exp_avg_sq[name] = state["exp_avg_sq"].numpy().copy()
        return params, exp_avg, exp_avg_sq
