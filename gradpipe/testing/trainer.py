"""A stand-in for a training job that writes to S3: what the nightly workflow picks up.

    python -m gradpipe.testing.trainer s3://bucket --steps 4 --peers 3

Trains gradpipe's sample model and, for each step, uploads one safetensors
gradient dump per peer to ``<root>/dumps/step=NNNN/peer=<peer>.safetensors``
and snapshots the training state into the store ``<root>/archive`` as the
chain ``model``: the layout ``workflows/nightly.yaml`` expects. Used by
``docker/compose.yaml`` and its native twin in the tests. Steps already
uploaded and snapshotted are left as they are, so it can run again.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import fsspec

from gradpipe.errors import NotFoundError
from gradpipe.formats.state_file import read_state_file
from gradpipe.snapshots.api import snapshot, snapshot_log
from gradpipe.storage.open import open_store
from gradpipe.testing.training import TrainingConfig, write_sample_run

__all__ = ["main", "upload_sample"]


def upload_sample(root: str, config: TrainingConfig) -> int:
    """Upload the sample run's dumps under ``root`` and snapshot its states; dumps uploaded."""
    fs, base = fsspec.core.url_to_fs(root)
    store = open_store(f"{root.rstrip('/')}/archive", mode="a")
    try:
        done = {info.step for info in snapshot_log(store, "model")}
    except NotFoundError:  # no chain yet
        done = set()
    uploaded = 0
    with tempfile.TemporaryDirectory() as tmp:
        run = write_sample_run(tmp, config)
        for step in run.steps:
            for peer in run.peers:
                target = f"{base}/dumps/step={step:04d}/peer={peer}.safetensors"
                if not fs.exists(target):
                    fs.put_file(run.dump_path(step, peer), target)
                    uploaded += 1
            if step not in done and step > max(done, default=-1):
                state, _ = read_state_file(Path(run.state_path(step)))
                snapshot(store, "model", state, step=step)
    return uploaded


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gradpipe.testing.trainer")
    parser.add_argument("root", help="where to write, e.g. s3://bucket or a folder")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--peers", type=int, default=3)
    args = parser.parse_args(argv)
    config = TrainingConfig(
        vocab_size=2000, embed_dim=16, hidden=32, peers=args.peers, steps=args.steps
    )
    print(f"uploaded {upload_sample(args.root, config)} dumps to {args.root}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
