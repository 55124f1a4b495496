"""Codec names: the one table of what ``gradpipe evaluate``, ``--codec`` and the docs call them.

A name is a family, with a parameter for some: ``default``, ``zstd``, ``blosc``, ``bf16``,
``fp16``, ``bitround-K`` (K mantissa bits kept), ``topk-F`` (fraction F kept), ``qsgd-S``
(S levels), ``powersgd-R`` (rank R) and ``projection-R`` (the ratio R of the dimension). Each
family names its class as ``"module:Class"``, imported on first use by
:func:`gradpipe.codecs.registry.make_codec`, like numcodecs' own registry. This module imports
no numpy, so the command line's help is built from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

__all__ = ["CODEC_FAMILIES", "CODEC_NAMES", "DEFAULT_CANDIDATES", "CodecFamily"]


@dataclass(frozen=True, slots=True)
class CodecFamily:
    """One codec family: where its class is, and what its name's parameter means."""

    target: str | None  # "module:Class"; None for the store's own lossless policy
    keyword: str | None  # the constructor argument the name's parameter sets
    kind: type | None  # int or float
    lossy: bool
    help: str
    letter: str = ""  # the parameter as help texts write it: bitround-K
    takes_dtype: bool = True

    def shown(self, family: str) -> str:
        """The name as help texts show it: ``bitround-K``, ``zstd``."""
        return f"{family}-{self.letter}" if self.letter else family


#: Every codec family by name.
CODEC_FAMILIES: Final[dict[str, CodecFamily]] = {
    "default": CodecFamily(
        None, None, None, lossy=False, help="the store's lossless policy, chosen per chunk"
    ),
    "zstd": CodecFamily(
        "numcodecs:Zstd", None, None, lossy=False, help="numcodecs' Zstd", takes_dtype=False
    ),
    "blosc": CodecFamily(
        "numcodecs:Blosc", None, None, lossy=False, help="numcodecs' Blosc", takes_dtype=False
    ),
    "bf16": CodecFamily(
        "gradpipe.codecs.bf16:BF16Codec", None, None, lossy=True, help="bfloat16, rounded"
    ),
    "fp16": CodecFamily(
        "gradpipe.codecs.fp16:FP16Codec", None, None, lossy=True, help="float16, rounded"
    ),
    "bitround": CodecFamily(
        "gradpipe.codecs.bitround:BitRoundCodec",
        "keepbits",
        int,
        lossy=True,
        help="K mantissa bits kept, rounded to nearest even",
        letter="K",
    ),
    "topk": CodecFamily(
        "gradpipe.codecs.topk:TopKCodec",
        "fraction",
        float,
        lossy=True,
        help="the fraction F of largest magnitudes kept",
        letter="F",
    ),
    "qsgd": CodecFamily(
        "gradpipe.codecs.qsgd:QSGDCodec",
        "levels",
        int,
        lossy=True,
        help="QSGD's stochastic quantisation to S levels",
        letter="S",
    ),
    "powersgd": CodecFamily(
        "gradpipe.codecs.powersgd:PowerSGDCodec",
        "rank",
        int,
        lossy=True,
        help="PowerSGD's rank-R approximation of matrices",
        letter="R",
    ),
    "projection": CodecFamily(
        "gradpipe.codecs.projection:ProjectionCodec",
        "ratio",
        float,
        lossy=True,
        help="a sparse random projection to the ratio R of the dimension",
        letter="R",
    ),
}

#: The names, as help texts show them.
CODEC_NAMES: Final = tuple(family.shown(name) for name, family in CODEC_FAMILIES.items())

#: What an evaluation compares when not told: the lossless default and numcodecs' own codecs,
#: then one setting of each lossy family.
DEFAULT_CANDIDATES: Final = (
    "default",
    "zstd",
    "blosc",
    "bf16",
    "fp16",
    "bitround-7+zstd",
    "topk-0.01",
    "qsgd-16",
    "powersgd-4",
    "projection-0.1",
)
