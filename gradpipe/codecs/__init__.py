"""numcodecs codecs for gradient chunks (lossless ones, deltas), and the per-chunk policy.

Importing this package registers the codecs with numcodecs, so
``numcodecs.get_codec({"id": "gradpipe_sparse", "dtype": "float32"})`` works
even where the package's ``numcodecs.codecs`` entry points are not installed.
"""

from __future__ import annotations

from numcodecs.registry import register_codec

from gradpipe.codecs.bytegroup import ByteGroupCodec
from gradpipe.codecs.delta import DELTA_KINDS, DeltaCodec
from gradpipe.codecs.policy import SPARSE_MAX_DENSITY, choose_codec, default_codec_config
from gradpipe.codecs.sparse import SparseCodec

__all__ = [
    "DELTA_KINDS",
    "SPARSE_MAX_DENSITY",
    "ByteGroupCodec",
    "DeltaCodec",
    "SparseCodec",
    "choose_codec",
    "default_codec_config",
]

register_codec(ByteGroupCodec)
register_codec(DeltaCodec)
register_codec(SparseCodec)
