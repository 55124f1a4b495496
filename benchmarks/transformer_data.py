"""Dense training state of a small BERT-like encoder, for the codec benchmarks.

A MiniLM-sized stack (hidden 384, 12 heads, intermediate 1536, GELU, pre-LN
residuals) is trained with AdamW for a few steps on random token batches with
a masked-token objective, in float32 on the CPU. What comes out is what a
fine-tuning run dumps: the gradients of the last step, the parameters after
it and AdamW's ``exp_avg`` / ``exp_avg_sq``, each keyed by parameter name.

Only the dense 2-D weights of the encoder layers are returned (the 384×384
attention projections and the 384×1536 / 1536×384 MLP matrices): they are the
bulk of a transformer's bytes and the chunks the dense codec sees. Embedding
gradients are row-sparse and go to ``gradpipe_sparse`` instead.

Another module (``gradpipe.testing.transformer``) may replace this one; keep
the entry point :func:`transformer_state`.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["transformer_state"]


def transformer_state(
    *, layers: int = 4, steps: int = 8, batch: int = 8, seq: int = 128, seed: int = 0
) -> dict[str, dict[str, np.ndarray]]:
    """Train briefly; return ``{kind: {name: float32 array}}``.

    ``kind`` is ``"gradients"``, ``"params"``, ``"exp_avg"`` or ``"exp_avg_sq"``.
    """
    import torch
    from torch import nn
    from torch.nn import functional as F  # noqa: N812

    torch.manual_seed(seed)
    torch.set_num_threads(1)
    hidden, heads, inter, vocab = 384, 12, 1536, 8192

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.query = nn.Linear(hidden, hidden)
            self.key = nn.Linear(hidden, hidden)
            self.value = nn.Linear(hidden, hidden)
            self.output = nn.Linear(hidden, hidden)
            self.intermediate = nn.Linear(hidden, inter)
            self.ffn_output = nn.Linear(inter, hidden)
            self.ln1 = nn.LayerNorm(hidden)
            self.ln2 = nn.LayerNorm(hidden)
            for lin in (self.query, self.key, self.value, self.output):
                nn.init.normal_(lin.weight, std=0.02)
            nn.init.normal_(self.intermediate.weight, std=0.02)
            nn.init.normal_(self.ffn_output.weight, std=0.02)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, _ = x.shape
            h = self.ln1(x)
            q, k, v = (
                f(h).view(b, t, heads, hidden // heads).transpose(1, 2)
                for f in (self.query, self.key, self.value)
            )
            att = F.scaled_dot_product_attention(q, k, v)
            x = x + self.output(att.transpose(1, 2).reshape(b, t, hidden))
            return x + self.ffn_output(F.gelu(self.intermediate(self.ln2(x))))

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, hidden)
            self.position = nn.Embedding(seq, hidden)
            nn.init.normal_(self.embed.weight, std=0.02)
            nn.init.normal_(self.position.weight, std=0.02)
            self.layers = nn.ModuleList(Layer() for _ in range(layers))
            self.norm = nn.LayerNorm(hidden)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            x = self.embed(tokens) + self.position.weight[: tokens.shape[1]]
            for layer in self.layers:
                x = layer(x)
            return self.norm(x) @ self.embed.weight.T  # tied output head

    model = Encoder()
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-4, weight_decay=0.01)
    generator = torch.Generator().manual_seed(seed)
    # Zipf-skewed tokens, as in text; 15% masked, predicted from context.
    ranks = torch.arange(1, vocab + 1, dtype=torch.float64)
    weights = 1.0 / ranks**1.1
    for _ in range(steps):
        tokens = torch.multinomial(weights, batch * seq, True, generator=generator)
        tokens = tokens.view(batch, seq)
        masked = torch.rand(batch, seq, generator=generator) < 0.15
        inputs = tokens.masked_fill(masked, 0)
        logits = model(inputs)
        loss = F.cross_entropy(logits[masked], tokens[masked])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    if not math.isfinite(float(loss.detach())):
        raise RuntimeError("transformer_state: training diverged")

    out: dict[str, dict[str, np.ndarray]] = {
        "gradients": {},
        "params": {},
        "exp_avg": {},
        "exp_avg_sq": {},
    }
    for name, param in model.named_parameters():
        if not name.startswith("layers.") or param.ndim != 2:
            continue
        state = optimizer.state[param]
        assert param.grad is not None
        out["gradients"][name] = param.grad.detach().numpy().copy()
        out["params"][name] = param.detach().numpy().copy()
        out["exp_avg"][name] = state["exp_avg"].numpy().copy()
        out["exp_avg_sq"][name] = state["exp_avg_sq"].numpy().copy()
    return out
