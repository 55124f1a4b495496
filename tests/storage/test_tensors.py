"""Writing tensors (``storage.tensors`` through ``Store.put_tensor``): what is refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from numcodecs import BitRound, Zstd

import gradpipe as gp


def test_lossy_codec_chain_is_refused_and_poisons_nothing(tmp_path: Path) -> None:
    store = gp.open_store(tmp_path / "s", mode="w")
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    with pytest.raises(gp.InvalidInputError, match="bit-exactly"):
        store.put_tensor(x, codecs=[BitRound(keepbits=5), Zstd()])
    assert list(store.backend.list("blocks")) == []
    tensor_id = store.put_tensor(x)  # the lossless default still stores it right
    assert store.get_tensor(tensor_id).tobytes() == x.tobytes()
