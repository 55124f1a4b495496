"""Lossless numcodecs codecs for gradient chunks, and the per-chunk policy.

Importing this package registers the codecs with numcodecs, so
``numcodecs.get_codec({"id": "gradpipe_sparse", "dtype": "float32"})`` works
even where the package's ``numcodecs.codecs`` entry points are not installed.
"""

from __future__ import annotations

from numcodecs.registry import register_codec

from gradpipe.codecs.bytegroup import ByteGroupCodec
from gradpipe.codecs.policy import SPARSE_MAX_DENSITY, choose_codec, default_codec_config
from gradpipe.codecs.sparse import SparseCodec

__all__ = [
    "SPARSE_MAX_DENSITY",
    "ByteGroupCodec",
    "SparseCodec",
    "choose_codec",
    "default_codec_config",
]

register_codec(ByteGroupCodec)
register_codec(SparseCodec)
