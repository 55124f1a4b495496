"""Settings in the ``gradpipe`` namespace of Dask's configuration."""

from __future__ import annotations

import os
import subprocess
import sys

import dask.config
import pytest

from gradpipe.config import DEFAULTS, get_bytes, get_setting


def test_defaults_survive_a_config_block_around_the_first_import() -> None:
    # gradpipe's modules load lazily: the first may load inside a user's
    # ``dask.config.set`` block, which undoes the defaults merged at import.
    code = (
        "import dask.config\n"
        "with dask.config.set({'gradpipe.lock.ttl': '6s'}):\n"
        "    from gradpipe.config import get_setting\n"
        "    assert get_setting('lock.ttl') == '6s'\n"
        "assert get_setting('storage.concurrency') == 32, get_setting('storage.concurrency')\n"
        "assert get_setting('lock.ttl') == '5m'\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("DASK_")}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_settings_read_config_then_defaults() -> None:
    assert get_setting("chunk-bytes") == DEFAULTS["gradpipe"]["chunk-bytes"]
    with dask.config.set({"gradpipe.chunk-bytes": "1 MiB"}):
        assert get_bytes("chunk-bytes") == 1 << 20
    with pytest.raises(KeyError, match=r"gradpipe\.no\.such"):
        get_setting("no.such")
