"""Which layer a tensor belongs to, from its name.

The default rule takes the name up to and including its first dotted segment
that is an integer (``encoder.layer.3.attention.self.query.weight`` →
``encoder.layer.3``, ``h.11.mlp.c_fc.weight`` → ``h.11``), else its first
segment (``embeddings.word_embeddings.weight`` → ``embeddings``). A regular
expression (its first group, or the whole match) or a function may replace it.
Layers are a way of reading stored per-tensor figures, never part of them: a
new rule needs no recomputation.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from typing import Final

from gradpipe.core.display import printable
from gradpipe.errors import InvalidInputError

__all__ = ["LayerRule", "layer_of", "layers_of", "model_order"]

#: How to name a tensor's layer: None (the default rule), a regex, or a function.
LayerRule = str | re.Pattern[str] | Callable[[str], str] | None


def model_order(names: Iterable[str]) -> list[str]:
    """Tensor names as a model lists them: numbers by value (``h.2`` before ``h.10``).

    Dumps list tensors as their files do (safetensors by dtype and size), so
    results use this order instead: the same for every dump of a run.

    >>> model_order(["h.10.w", "h.2.w", "emb"])
    ['emb', 'h.2.w', 'h.10.w']
    """
    return sorted(set(names), key=_natural_key)


def _natural_key(name: str) -> list[tuple[int, int | str]]:
    return [(0, int(part)) if part.isdigit() else (1, part) for part in _PARTS.findall(name)]


_PARTS: Final = re.compile(r"\d+|\D+")


def layer_of(name: str) -> str:
    """The default rule.

    >>> layer_of("encoder.layer.3.attention.self.query.weight")
    'encoder.layer.3'
    >>> layer_of("embeddings.word_embeddings.weight")
    'embeddings'
    >>> layer_of("bias")
    'bias'
    """
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return parts[0]


def layers_of(names: Sequence[str], rule: LayerRule = None) -> list[str]:
    """The layer of each tensor name under ``rule``.

    A regex names the layer by its first group (or its whole match if it has
    none); a name it does not match is its own layer.
    """
    if rule is None:
        return [layer_of(n) for n in names]
    if callable(rule) and not isinstance(rule, re.Pattern):
        out = [rule(n) for n in names]
        for name, layer in zip(names, out, strict=True):
            if not isinstance(layer, str) or not layer:
                raise InvalidInputError(
                    f"the layer rule gave {printable(layer)} for tensor {printable(name)}, "
                    "not a layer name"
                )
        return out
    try:
        pattern = re.compile(rule)
    except re.error as exc:
        raise InvalidInputError(f"layer pattern {printable(rule)} is not a regex: {exc}") from None
    out = []
    for n in names:
        match = pattern.search(n)
        if match is None:
            out.append(n)
        else:
            out.append(match.group(1) if pattern.groups else match.group(0))
    return out
