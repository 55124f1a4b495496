"""Optimizer replay's options as a command line offers them (no numpy: ``--help`` is fast)."""

from __future__ import annotations

from typing import Final

__all__ = ["DEFAULT_REPLAY_INTERVAL", "REPLAY_KINDS"]

#: A replayed chunk is stored self-contained again every this many versions, so a read
#: replays at most this many steps minus one. Bytes fall as 1/K, restores grow with K:
#: on a 260 MiB AdamW state (2 cores), K = 4 stores 8 snapshots 4.3x below ZipNN and restores
#: the deepest in 1.2 s; K = 8, 8.7x and 2.4 s (design note 016).
DEFAULT_REPLAY_INTERVAL: Final = 8

#: The optimizers a snapshot's chunks may be replayed with (gradpipe.core.replay).
REPLAY_KINDS: Final = ("adam", "adamw", "sgd")
