"""Optimizer replay's options as a command line offers them (no numpy: ``--help`` is fast)."""

from __future__ import annotations

from typing import Final

__all__ = ["DEFAULT_REPLAY_INTERVAL", "REPLAY_KINDS"]

#: A replayed chunk is stored self-contained again every this many versions, so a read
#: replays at most this many steps minus one (design note 016 measures the choice).
DEFAULT_REPLAY_INTERVAL: Final = 4

#: The optimizers a snapshot's chunks may be replayed with (gradpipe.core.replay).
REPLAY_KINDS: Final = ("adam", "adamw", "sgd")
