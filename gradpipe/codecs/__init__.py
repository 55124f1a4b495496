"""numcodecs codecs for gradient chunks (lossless, deltas, lossy), and the per-chunk policy.

Importing this package registers the codecs with numcodecs, so
``numcodecs.get_codec({"id": "gradpipe_sparse", "dtype": "float32"})`` works
even where the package's ``numcodecs.codecs`` entry points are not installed.
"""

from __future__ import annotations

from numcodecs.registry import register_codec

from gradpipe.codecs.bf16 import BF16Codec
from gradpipe.codecs.bitround import BitRoundCodec
from gradpipe.codecs.bytegroup import ByteGroupCodec
from gradpipe.codecs.delta import DELTA_KINDS, DeltaCodec
from gradpipe.codecs.fp16 import FP16Codec
from gradpipe.codecs.policy import SPARSE_MAX_DENSITY, choose_codec, default_codec_config
from gradpipe.codecs.powersgd import PowerSGDCodec
from gradpipe.codecs.projection import ProjectionCodec
from gradpipe.codecs.qsgd import QSGDCodec
from gradpipe.codecs.sparse import SparseCodec
from gradpipe.codecs.topk import TopKCodec

__all__ = [
    "DELTA_KINDS",
    "SPARSE_MAX_DENSITY",
    "BF16Codec",
    "BitRoundCodec",
    "ByteGroupCodec",
    "DeltaCodec",
    "FP16Codec",
    "PowerSGDCodec",
    "ProjectionCodec",
    "QSGDCodec",
    "SparseCodec",
    "TopKCodec",
    "choose_codec",
    "default_codec_config",
]

register_codec(ByteGroupCodec)
register_codec(DeltaCodec)
register_codec(SparseCodec)
# Lossy codecs (see gradpipe.codecs.registry for their names, gradpipe.codecs._lossy for
# what they share): the store marks every tensor written with one as lossy.
register_codec(BF16Codec)
register_codec(FP16Codec)
register_codec(BitRoundCodec)
register_codec(TopKCodec)
register_codec(QSGDCodec)
register_codec(PowerSGDCodec)
register_codec(ProjectionCodec)
