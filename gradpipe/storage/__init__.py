"""The content-addressed store over fsspec: blocks, manifests, tensors, refs."""

from gradpipe.storage.open import open_store
from gradpipe.storage.refs import ANY, Refs
from gradpipe.storage.store import Store, WriteStats

__all__ = ["ANY", "Refs", "Store", "WriteStats", "open_store"]
