"""What tests compare between two ways of doing the same work: the ids a store gives it.

Ids are content hashes of bytes, statistics and provenance, so two ingests of the same
dumps that agree on every tensor id stored the same thing, bit for bit.
"""

from __future__ import annotations

from gradpipe.runs import open_run
from gradpipe.storage.store import Store

__all__ = ["TensorIds", "run_tensor_ids"]

#: (step, peer, tensor name) -> tensor id.
TensorIds = dict[tuple[int, str, str], str]


def run_tensor_ids(store: Store, run: str) -> TensorIds:
    """The id of every tensor of every dump of ``run``."""
    view = open_run(store, run)
    return {
        (entry.step, entry.peer, name): tensor_id
        for entry in view
        for name, tensor_id in view.dump(entry.step, entry.peer).manifest.tensor_ids.items()
    }
