"""Training-state snapshots as a chain: gradpipe beside zarr v3, ZipNN, torch.save and safetensors.

The data: ``--snapshots N`` (default 8) consecutive training states of a
MiniLM-L6 / BERT-small-shaped encoder (``gradpipe.testing.transformer``: vocabulary
30522, hidden 384, 6 layers, 105 parameter tensors) fine-tuned by 2 data-parallel
peers with real backprop and AdamW (torch), written once by
``write_transformer_run`` under a temporary directory in /tmp and read back into
memory, so every contender sees the same bytes. Snapshot ``k`` is the state after
step ``k``, nested as a torch training loop keeps it::

    {"model": {name: params},
     "optimizer": {"exp_avg": {name: ...}, "exp_avg_sq": {name: ...}, "step": step}}

where ``step`` is a float32 0-d array (``k + 1``, the update count, as
``torch.optim.AdamW`` keeps it). All tensors are dense float32: parameters plus
both Adam moments are 260 MiB per snapshot by default (``--mib M`` shrinks the
model, through ``TransformerConfig.for_dump_size``, for a quick run; it cannot grow
past the full shape). Flat formats see the same arrays under dotted names
(``model.<name>``, ``optimizer.exp_avg.<name>``, ``optimizer.step``).

Rows, each writing the N snapshots in order into its own new directory:

- ``gradpipe chain + decay (no grad)``: the same without the gradient (``optimizer=``
  alone): the moments coded against ``beta * previous`` where that is smaller;
- ``gradpipe chain + replay``: the nested chain with optimizer replay (issue 21, design
  note 016): ``gp.snapshot(..., gradient=grads, optimizer=groups, replay_interval=K)``
  with the gradient each step applied (the peers' float32 mean, fixed peer order, as the
  trainer took it) recorded with the snapshot. Its ``stored MiB`` is the state's own:
  every file the row wrote minus the recorded gradients' blocks (printed apart: replay
  pays when the gradients are kept anyway, and they are not counted against ZipNN);

- ``gradpipe chain (API, nested)``: ``gp.snapshot(store, "state", state, step=k,
  loss=loss)`` of the nested state into a local store; restore:
  ``gp.restore(open_store(url), "state")`` (the newest), flattened for the check,
- ``gradpipe chain (API, flat)``: the same with the flat dotted-name dict, under
  the name ``flat`` in a second store (separate, so that content addressing
  does not share blocks with the nested row). ``gradpipe restore`` writes a
  flat safetensors file, so this chain is the one the whole-command restore reads,
- ``zarr v3``: ``zarr.create_array`` with zarr's default chunks and codecs
  (``BytesCodec`` + ``ZstdCodec(level=0)``), one array per tensor per snapshot
  (``step<k>/<dotted name>``) in a ``LocalStore``; restore: every array of the
  newest snapshot's group,
- ``zipnn``: ``ZipNN(input_format="numpy", bytearray_dtype="float32")`` (as in
  ``bench_ingest.py``), one file per tensor per snapshot; restore: decompress the
  newest snapshot's files,
- ``torch.save``: the nested state as torch tensors (``torch.from_numpy``, no
  copy), one file per snapshot; restore: ``torch.load(weights_only=True)``,
- ``safetensors save_file``: ``safetensors.numpy.save_file`` of the flat dict, one
  file per snapshot; restore: ``load_file``.

Columns: total stored MiB (apparent size of every file the row wrote), how many
times smaller than ZipNN's, snapshot MiB/s (logical tensor MiB over the summed
wall time of the N writes, best of ``--passes`` (default 2) passes, each into a
new directory; ``os.sync()``, untimed, before each write, no fsync anywhere),
throughput over ``save_file``'s, restore seconds of the newest snapshot in this
process (median of ``--repeat``, page cache warm), and whether the restored state
is bit-exact (names, dtypes, shapes and bytes).

Then the whole-command restore: ``gradpipe restore STORE flat -o OUT.safetensors``
(a subprocess: interpreter start, imports, reading the chain, writing the file)
beside ``python -c "from safetensors.numpy import load_file; load_file(P)"`` of
the newest ``save_file`` snapshot; each runs once untimed first, then
``--repeat`` alternating runs, medians. The output is checked bit-exact.

Last, ``gradpipe ingest STORE PATTERN --run r`` against the same command with
``--delta`` on the run's gradient dumps (N steps x 2 peers, same training):
stored bytes and wall seconds.

While the snapshot API, ``gradpipe restore`` or ``ingest --delta`` are missing
from the build, their rows say so and the anchors are still measured.

``--replay-intervals 2,4,8`` adds one line per interval K: the replay chain's own bytes,
how many times smaller than ZipNN's, and the newest version's restore time beside
``load_file``'s (the newest version replays ``(N - 1) mod K`` steps).

Run: ``python benchmarks/bench_snapshots.py`` (``--snapshots N``, ``--mib M``,
``--passes N``, ``--repeat N``, ``--skip-ingest``, ``--replay-intervals``); a few minutes at
the default size on two cores
(the anchors alone: 90 s, a third of it training).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from bench_ingest import (  # the same helpers and CLI run as the ingest benchmark
    BIN,
    check_ingest,
    cli_ingest,
    disk_bytes,
    file_count,
    zipnn_compressor,
)

import gradpipe as gp
from gradpipe.core.replay_options import DEFAULT_REPLAY_INTERVAL
from gradpipe.formats.safetensors import read_safetensors
from gradpipe.testing import TransformerConfig, TransformerRun, write_transformer_run

MiB = 2**20
UNAVAILABLE = "not available in this build"
LR, WEIGHT_DECAY = 1e-4, 0.01  # set from the run's config by make_data

Flat = dict[str, np.ndarray]


@dataclass(frozen=True)
class Snapshot:
    """One training state: its step, loss and tensors (nested and flat views of the same arrays)."""

    step: int
    loss: float
    state: dict[str, Any]
    flat: Flat
    grads: Flat = field(default_factory=dict)  # the gradient the step applied, by parameter

    @property
    def groups(self) -> list[dict[str, Any]]:
        """``optimizer=`` of ``gp.snapshot``: one AdamW group naming each parameter's arrays."""
        from gradpipe.core.replay import OptimizerStep

        counter = int(self.state["optimizer"]["step"])
        step = OptimizerStep("adamw", lr=LR, step=counter, weight_decay=WEIGHT_DECAY)
        params = {
            name: {
                "param": f"model.{name}",
                "exp_avg": f"optimizer.exp_avg.{name}",
                "exp_avg_sq": f"optimizer.exp_avg_sq.{name}",
            }
            for name in self.state["model"]
        }
        return [{"step": step, "params": params}]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.flat.values())


@dataclass
class Row:
    name: str
    stored: int = 0
    write_seconds: float = 0.0
    restore_seconds: float = 0.0
    exact: str = ""
    objects: int = 0
    missing: str = ""  # why the row could not run (a feature missing from this build)
    extra: dict[str, Any] = field(default_factory=dict)


# --- the data ---------------------------------------------------------------------------
def flatten(tree: Mapping[str, Any], prefix: str = "") -> Flat:
    """Dotted names → arrays (``{"a": {"b": x}}`` → ``{"a.b": x}``)."""
    flat: Flat = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            flat |= flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def applied_gradient(run: TransformerRun, step: int) -> Flat:
    """The gradient the step applied: the peers' mean, float32, in fixed peer order."""
    dumps = [read_safetensors(run.dump_path(step, peer))[0] for peer in run.peers]
    out = {}
    for name in dumps[0]:
        total = np.zeros(dumps[0][name].shape, dtype=np.float32)
        for dump in dumps:
            total += dump[name]
        out[name] = total / np.float32(len(dumps))
    return out


def load_snapshot(run: TransformerRun, step: int) -> Snapshot:
    """The training state ``write_transformer_run`` wrote for ``step``, shaped as torch keeps it."""
    tensors, meta = read_safetensors(run.state_path(step))
    groups: dict[str, dict[str, np.ndarray]] = {"params": {}, "exp_avg": {}, "exp_avg_sq": {}}
    counter = None
    for key, array in tensors.items():
        kind, name = key.split("/", 1)
        if kind == "step":
            counter = array  # the same update count for every parameter
        else:
            groups[kind][name] = array
    if counter is None:
        raise ValueError(f"{run.state_path(step)} holds no optimizer step counter")
    state: dict[str, Any] = {
        "model": groups["params"],
        "optimizer": {
            "exp_avg": groups["exp_avg"],
            "exp_avg_sq": groups["exp_avg_sq"],
            "step": np.array(counter, dtype=np.float32),
        },
    }
    grads = applied_gradient(run, step)
    return Snapshot(int(meta["step"]), float(meta["loss"]), state, flatten(state), grads)


def make_data(args: argparse.Namespace, root: Path) -> tuple[TransformerRun, list[Snapshot], str]:
    global LR, WEIGHT_DECAY
    peers = 2
    # for_dump_size sizes one gradient dump (= the parameters); the state is three times that.
    config = TransformerConfig.for_dump_size(
        args.mib / 3 * args.snapshots * peers, steps=args.snapshots, peers=peers
    )
    start = time.perf_counter()
    run = write_transformer_run(root, config, backend="auto")
    LR, WEIGHT_DECAY = config.learning_rate, config.weight_decay
    seconds = time.perf_counter() - start
    snapshots = [load_snapshot(run, step) for step in run.steps]
    per = snapshots[-1].nbytes
    what = (
        f"data: write_transformer_run(TransformerConfig.for_dump_size(..., steps={args.snapshots}, "
        f"peers={peers})): BERT-like encoder, vocab {config.vocab_size}, hidden {config.hidden}, "
        f"{config.layers} layers, {config.numel() / 1e6:.1f}M parameters, torch/AdamW, "
        f"float32, dense;\n  {args.snapshots} snapshots of the state after steps "
        f"0..{args.snapshots - 1} (params + exp_avg + exp_avg_sq + step, "
        f"{len(snapshots[-1].flat)} tensors), {per / MiB:.1f} MiB each, "
        f"{args.snapshots * per / MiB:.0f} MiB in all; trained and written in {seconds:.0f} s"
    )
    return run, snapshots, what


# --- checks --------------------------------------------------------------------------------
def mismatch(got: Mapping[str, Any], want: Flat) -> str:
    """Empty when ``got`` holds exactly ``want``'s names, dtypes, shapes and bytes; else why not."""
    if set(got) != set(want):
        extra, lost = sorted(set(got) - set(want)), sorted(set(want) - set(got))
        return f"names differ: extra {extra[:3]}, missing {lost[:3]}"
    for name, expected in want.items():
        array = np.asarray(got[name])
        if array.dtype != expected.dtype or array.shape != expected.shape:
            return f"{name}: {array.dtype}{array.shape} != {expected.dtype}{expected.shape}"
        if array.tobytes() != expected.tobytes():
            return f"{name}: bytes differ"
    return ""


# --- contenders: write snapshot k into root / restore the newest as a flat dict -------------
Write = Callable[[Path, Snapshot], None]
Restore = Callable[[Path, Snapshot], Mapping[str, Any]]


def gradpipe_contender(name: str, *, nested: bool) -> tuple[Write, Restore, Callable[[Path], None]]:
    stores: dict[Path, Any] = {}

    def setup(root: Path) -> None:
        gp.snapshot, gp.restore  # noqa: B018  AttributeError while the API is missing
        stores[root] = gp.open_store(str(root), mode="w")

    def write(root: Path, snap: Snapshot) -> None:
        state = snap.state if nested else snap.flat
        gp.snapshot(stores[root], name, state, step=snap.step, loss=snap.loss)

    def restore(root: Path, snap: Snapshot) -> Mapping[str, Any]:
        state = gp.restore(gp.open_store(str(root), mode="r"), name)
        return flatten(state)

    return write, restore, setup


def replay_contender(
    interval: int, *, with_gradient: bool = True
) -> tuple[Write, Restore, Callable[[Path], None]]:
    stores: dict[Path, Any] = {}

    def setup(root: Path) -> None:
        stores[root] = gp.open_store(str(root), mode="w")

    def write(root: Path, snap: Snapshot) -> None:
        gp.snapshot(
            stores[root],
            "replay",
            snap.state,
            step=snap.step,
            loss=snap.loss,
            gradient=snap.grads if with_gradient else None,
            optimizer=snap.groups,
            replay_interval=interval,
        )

    def restore(root: Path, snap: Snapshot) -> Mapping[str, Any]:
        return flatten(gp.restore(gp.open_store(str(root), mode="r"), "replay"))

    return write, restore, setup


def replay_bytes(root: Path) -> tuple[int, int, list[int]]:
    """The replay chain's own bytes (every file but the recorded gradients' blocks), the
    gradients' bytes, and each version's own block bytes."""
    log = gp.snapshot_log(gp.open_store(str(root), mode="r"), "replay")
    gradients = sum(v.gradient_bytes for v in log)
    return disk_bytes(root) - gradients, gradients, [v.stored_bytes for v in log]


def zarr_write(root: Path, snap: Snapshot) -> None:
    import zarr
    from zarr.storage import LocalStore

    store = LocalStore(root, read_only=False)
    if snap.step == 0:
        zarr.open_group(store, mode="w")
    for name, array in snap.flat.items():
        zarr.create_array(store, name=f"step{snap.step}/{name}", data=array)


def zarr_restore(root: Path, snap: Snapshot) -> Flat:
    import zarr
    from zarr.storage import LocalStore

    group = zarr.open_group(LocalStore(root, read_only=True), path=f"step{snap.step}", mode="r")
    return {name: np.asarray(array[...]) for name, array in group.arrays()}


def zipnn_contender() -> tuple[Write, Restore]:
    zipnn = zipnn_compressor()

    def write(root: Path, snap: Snapshot) -> None:
        folder = root / f"step{snap.step}"
        folder.mkdir(parents=True)
        for name, array in snap.flat.items():
            (folder / f"{name}.znn").write_bytes(zipnn.compress(array))

    def restore(root: Path, snap: Snapshot) -> Flat:
        folder = root / f"step{snap.step}"
        return {p.name[:-4]: zipnn.decompress(p.read_bytes()) for p in folder.glob("*.znn")}

    return write, restore


def torch_write(root: Path, snap: Snapshot) -> None:
    import torch

    def tensors(tree: Mapping[str, Any]) -> dict[str, Any]:
        return {
            k: tensors(v) if isinstance(v, Mapping) else torch.from_numpy(v)
            for k, v in tree.items()
        }

    root.mkdir(exist_ok=True)
    torch.save(tensors(snap.state), root / f"step{snap.step}.pt")


def torch_restore(root: Path, snap: Snapshot) -> Flat:
    import torch

    state = torch.load(root / f"step{snap.step}.pt", weights_only=True)
    return {name: tensor.numpy() for name, tensor in flatten(state).items()}


def safetensors_write(root: Path, snap: Snapshot) -> None:
    from safetensors.numpy import save_file

    root.mkdir(exist_ok=True)
    save_file(snap.flat, str(root / f"step{snap.step}.safetensors"))


def safetensors_restore(root: Path, snap: Snapshot) -> Flat:
    from safetensors.numpy import load_file

    return load_file(str(root / f"step{snap.step}.safetensors"))


def measure(
    name: str,
    root: Path,
    snapshots: list[Snapshot],
    write: Write,
    restore: Restore,
    *,
    passes: int,
    repeat: int,
    setup: Callable[[Path], None] | None = None,
) -> Row:
    """Write every snapshot in order (timed, summed; best of ``passes``), restore the newest.

    Each pass writes into a new directory; the last pass's, ``root``, is kept
    for the stored bytes and the restores (median of ``repeat``).
    """
    row = Row(name)
    totals = []
    for i in reversed(range(max(1, passes))):
        dest = root.with_name(f"{root.name}-pass{i}") if i else root
        if setup is not None:
            try:
                setup(dest)
            except AttributeError as error:  # the gradpipe API this row needs is not there yet
                row.missing = f"{UNAVAILABLE} ({error})"
                return row
        total = 0.0
        for snap in snapshots:
            os.sync()  # untimed: no write pays for another's dirty pages
            start = time.perf_counter()
            write(dest, snap)
            total += time.perf_counter() - start
        totals.append(total)
        if i:
            shutil.rmtree(dest)
    row.write_seconds = min(totals)
    row.stored, row.objects = disk_bytes(root), file_count(root)
    newest = snapshots[-1]
    times = []
    for _ in range(max(1, repeat)):
        start = time.perf_counter()
        got = restore(root, newest)
        times.append(time.perf_counter() - start)
    row.restore_seconds = statistics.median(times)
    why = mismatch(got, newest.flat)
    row.exact = "yes" if not why else f"NO: {why}"
    return row


# --- whole-command restore ------------------------------------------------------------------
@dataclass
class CommandRestore:
    """Median seconds of ``python -c load_file`` and of ``gradpipe restore`` (when there)."""

    anchor: float = 0.0
    ours: float = 0.0
    exact: str = ""
    missing: str = ""  # why ``gradpipe restore`` was not measured


def command_seconds(command: list[str]) -> float:
    environ = {k: v for k, v in os.environ.items() if k != "DASK_SCHEDULER_ADDRESS"}
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, env=environ, check=False)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr.decode()}")
    return seconds


def command_restore(
    store: Path | None, anchor: Path, out: Path, newest: Snapshot, repeat: int
) -> CommandRestore:
    """``gradpipe restore STORE flat -o OUT`` beside ``python -c load_file(anchor)``, warm.

    Each runs once untimed first (page cache, the interpreter's files), then
    ``repeat`` alternating runs; medians. ``store`` None: gradpipe's chain was not written.
    """
    load = f"from safetensors.numpy import load_file; load_file({str(anchor)!r})"
    theirs = [sys.executable, "-c", load]
    result = CommandRestore()
    ours = None
    if store is None:
        result.missing = f"gp.snapshot: {UNAVAILABLE}"
    else:
        ours = [str(BIN / "gradpipe"), "restore", str(store), "flat", "-o", str(out)]
        try:
            command_seconds(ours)
        except RuntimeError as error:
            if "invalid choice" not in str(error):
                raise
            result.missing = f"gradpipe restore: {UNAVAILABLE}"
            ours = None
    command_seconds(theirs)
    pairs = [
        (command_seconds(ours) if ours else 0.0, command_seconds(theirs))
        for _ in range(max(1, repeat))
    ]
    result.ours = statistics.median(p[0] for p in pairs)
    result.anchor = statistics.median(p[1] for p in pairs)
    if ours:
        from safetensors.numpy import load_file

        why = mismatch(load_file(str(out)), newest.flat)
        result.exact = "yes" if not why else f"NO: {why}"
    return result


# --- ingest with --delta ----------------------------------------------------------------------
def delta_ingest(run: TransformerRun, tmp: Path) -> str:
    """One line: stored bytes of a plain ingest of the run's dumps against ``--delta``."""
    dumps = len(run.steps) * len(run.peers)
    logical = sum(Path(run.dump_path(s, p)).stat().st_size for s in run.steps for p in run.peers)
    head = (
        f"ingest on {dumps} gradient dumps ({len(run.steps)} steps x {len(run.peers)} peers, "
        f"{logical / MiB:.0f} MiB of files)"
    )
    results = {}
    for label, options in (("plain", ()), ("--delta", ("--delta",))):
        dest = tmp / f"ingest-{label.strip('-')}"
        os.sync()
        start = time.perf_counter()
        try:
            doc = cli_ingest(str(dest), run.dump_pattern, options=options)
        except RuntimeError as error:
            if "unrecognized arguments: --delta" not in str(error):
                raise
            plain, plain_s = results["plain"]
            return f"{head}: plain {plain / MiB:.1f} MiB in {plain_s:.1f} s; --delta: {UNAVAILABLE}"
        seconds = time.perf_counter() - start
        check_ingest(doc, dumps)
        results[label] = (disk_bytes(dest), seconds)
    (plain, plain_s), (delta, delta_s) = results["plain"], results["--delta"]
    return (
        f"{head}: plain {plain / MiB:.1f} MiB in {plain_s:.1f} s, --delta {delta / MiB:.1f} MiB "
        f"in {delta_s:.1f} s (--delta stores {delta / plain:.3f}x plain's bytes)"
    )


# --- the run and the table --------------------------------------------------------------------
def run(args: argparse.Namespace, tmp: Path) -> None:
    data, snapshots, what = make_data(args, tmp / "run")
    newest = snapshots[-1]
    logical = sum(s.nbytes for s in snapshots)
    rows: list[Row] = []

    def contender(name: str, folder: str, write: Write, restore: Restore, **kw: Any) -> Row:
        row = measure(
            name,
            tmp / folder,
            snapshots,
            write,
            restore,
            passes=args.passes,
            repeat=args.repeat,
            **kw,
        )
        rows.append(row)
        return row

    nested_w, nested_r, nested_setup = gradpipe_contender("state", nested=True)
    contender("gradpipe chain (API, nested)", "gp", nested_w, nested_r, setup=nested_setup)
    shutil.rmtree(tmp / "gp", ignore_errors=True)
    replay_w, replay_r, replay_setup = replay_contender(DEFAULT_REPLAY_INTERVAL)
    replay = contender(
        f"gradpipe chain + replay (K={DEFAULT_REPLAY_INTERVAL})",
        "gp-replay",
        replay_w,
        replay_r,
        setup=replay_setup,
    )
    decay_w, decay_r, decay_setup = replay_contender(DEFAULT_REPLAY_INTERVAL, with_gradient=False)
    contender("gradpipe chain + decay (no grad)", "gp-decay", decay_w, decay_r, setup=decay_setup)
    shutil.rmtree(tmp / "gp-decay", ignore_errors=True)
    own, gradients, versions = replay_bytes(tmp / "gp-replay")
    replay.extra = {
        "gradients": gradients,
        "versions": versions,
        "disk": replay.stored,
        "interval": DEFAULT_REPLAY_INTERVAL,
    }
    replay.stored = own
    shutil.rmtree(tmp / "gp-replay", ignore_errors=True)
    flat_w, flat_r, flat_setup = gradpipe_contender("flat", nested=False)
    flat = contender("gradpipe chain (API, flat)", "gp-flat", flat_w, flat_r, setup=flat_setup)
    contender("zarr v3 (default codecs)", "zarr", zarr_write, zarr_restore)
    shutil.rmtree(tmp / "zarr")
    contender("zipnn (numpy, float32)", "zipnn", *zipnn_contender())
    shutil.rmtree(tmp / "zipnn")
    contender("torch.save", "torch", torch_write, torch_restore)
    shutil.rmtree(tmp / "torch")
    contender("safetensors save_file", "st", safetensors_write, safetensors_restore)
    intervals = [
        (k, *sweep_interval(k, tmp, snapshots, args.repeat))
        for k in (int(x) for x in args.replay_intervals.split(",") if x)
    ]

    command = command_restore(
        None if flat.missing else tmp / "gp-flat",
        tmp / "st" / f"step{newest.step}.safetensors",
        tmp / "restored.safetensors",
        newest,
        args.repeat,
    )
    ingest_line = "ingest --delta: skipped (--skip-ingest)"
    if not args.skip_ingest:
        ingest_line = delta_ingest(data, tmp)
    print_table(args, what, rows, logical, command, ingest_line)
    print_replay(args, rows, intervals)


def sweep_interval(
    interval: int, tmp: Path, snapshots: list[Snapshot], repeat: int
) -> tuple[int, float]:
    """The replay chain's own bytes and the newest version's restore seconds, with K."""
    write, restore, setup = replay_contender(interval)
    row = measure(
        f"K={interval}", tmp / f"k{interval}", snapshots, write, restore,
        passes=1, repeat=repeat, setup=setup,
    )  # fmt: skip
    own = replay_bytes(tmp / f"k{interval}")[0]
    shutil.rmtree(tmp / f"k{interval}")
    if row.exact != "yes":
        raise RuntimeError(f"replay chain with K={interval}: {row.exact}")
    return own, row.restore_seconds


def print_replay(
    args: argparse.Namespace, rows: list[Row], intervals: list[tuple[int, int, float]]
) -> None:
    by_name = {row.name: row for row in rows}
    zipnn, st = by_name["zipnn (numpy, float32)"], by_name["safetensors save_file"]
    plain = by_name["gradpipe chain (API, nested)"]
    replay = by_name[f"gradpipe chain + replay (K={DEFAULT_REPLAY_INTERVAL})"]
    if replay.missing:
        return

    def verdict(ok: bool) -> str:
        return "PASS" if ok else "FAIL"

    versions = replay.extra["versions"]
    n = len(versions)
    print("\noptimizer replay (the gradient each step applied recorded with the snapshot):")
    print(
        f"  the {n} versions' own blocks, MiB: "
        + ", ".join(f"{v / MiB:.2f}" for v in versions)
        + f"; recorded gradients {replay.extra['gradients'] / MiB:.1f} MiB (not counted); "
        f"manifests and refs {(replay.stored - sum(versions)) / MiB:.2f} MiB (counted)"
    )
    smaller = zipnn.stored / replay.stored
    print(
        f"  {verdict(smaller >= 20 and replay.exact == 'yes')}  {n} snapshots' own bytes >= 20x "
        f"smaller than zipnn's: {smaller:.1f}x ({replay.stored / MiB:.2f} MiB vs "
        f"{zipnn.stored / MiB:.1f} MiB; bit-exact {replay.exact})"
    )
    # A version is replayed unless it is the first or its chunks reached the interval.
    replayed = [v for i, v in enumerate(versions) if i % replay.extra["interval"]]
    share = zipnn.stored * len(replayed) / n
    print(
        f"  info  the {len(replayed)} replayed versions: {sum(replayed) / MiB:.2f} MiB of blocks, "
        f"{share / max(sum(replayed), 1):.0f}x smaller than zipnn's {len(replayed)} "
        "(the first version has nothing to replay from, and every K-th is self-contained)"
    )
    ratio = replay.restore_seconds / st.restore_seconds
    print(
        f"  {verdict(ratio <= 2)}  restoring the newest <= 2x load_file: {ratio:.2f}x "
        f"({replay.restore_seconds:.3f} s vs {st.restore_seconds:.3f} s, in this process)"
    )
    decay = by_name["gradpipe chain + decay (no grad)"]
    smaller = zipnn.stored / decay.stored
    print(
        f"  {verdict(smaller >= 2 and decay.exact == 'yes')}  without gradients >= 2x smaller "
        f"than zipnn's: {smaller:.2f}x ({decay.stored / MiB:.1f} MiB; the chain without the "
        f"decay prediction: {zipnn.stored / plain.stored:.2f}x; bit-exact {decay.exact})"
    )
    slower = replay.write_seconds / plain.write_seconds
    print(
        f"  {verdict(slower <= 1.1)}  the snapshot write no slower than today's: {slower:.2f}x "
        f"the chain without replay ({replay.write_seconds:.2f} s vs {plain.write_seconds:.2f} s "
        f"for {n} snapshots)"
    )
    for k, own, seconds in intervals:
        print(
            f"  K={k:<3} own {own / MiB:8.2f} MiB, {zipnn.stored / own:6.1f}x smaller than "
            f"zipnn's; restore of the newest (depth {(n - 1) % k}) {seconds:.3f} s, "
            f"{seconds / st.restore_seconds:.2f}x load_file"
        )


def print_table(
    args: argparse.Namespace,
    what: str,
    rows: list[Row],
    logical: int,
    command: CommandRestore,
    ingest_line: str,
) -> None:
    by_name = {row.name: row for row in rows}
    zipnn, st = by_name["zipnn (numpy, float32)"], by_name["safetensors save_file"]
    st_rate = logical / MiB / st.write_seconds

    print("=== training-state snapshots, data: transformer ===")
    print(what)
    print(
        f"every row writes the {args.snapshots} snapshots in order into a new directory "
        f"(best of {max(1, args.passes)} passes, os.sync() untimed before each snapshot, no "
        "fsync); restore = the newest snapshot in this process, median of "
        f"{max(1, args.repeat)}, page cache warm"
    )
    print(
        "stored = bytes of the files written; x smaller = zipnn's stored / this; MiB/s of logical "
        "tensor bytes over the summed write time; vs save_file = MiB/s / save_file's MiB/s\n"
    )
    header = (
        f"{'method':<30} {'stored MiB':>11} {'x smaller/zipnn':>16} {'snap MiB/s':>11}"
        f" {'vs save_file':>13} {'restore s':>10} {'files':>6}  bit-exact"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        if row.missing:
            print(f"{row.name:<30} gradpipe: {row.missing}")
            continue
        rate = logical / MiB / row.write_seconds
        print(
            f"{row.name:<30} {row.stored / MiB:>11.1f} {zipnn.stored / row.stored:>16.2f}"
            f" {rate:>11.0f} {rate / st_rate:>13.2f} {row.restore_seconds:>10.3f}"
            f" {row.objects:>6}  {row.exact}"
        )

    print("\nrestore of the newest snapshot, whole command (median of alternating runs, warm):")
    print(f"  python -c load_file(newest save_file snapshot): {command.anchor:.2f} s")
    if command.missing:
        print(f"  {command.missing}")
    else:
        print(
            f"  gradpipe restore STORE flat -o OUT.safetensors: {command.ours:.2f} s, "
            f"{command.ours / command.anchor:.2f}x the anchor (bit-exact: {command.exact})"
        )

    def verdict(ok: bool) -> str:
        return "PASS" if ok else "FAIL"

    gp_row = by_name["gradpipe chain (API, nested)"]
    print("\ntargets (gradpipe = the nested chain through the API; restore = the whole command):")
    if gp_row.missing:
        print(f"  ----  stored >= 1.5x smaller than zipnn's, bit-exact: gradpipe {UNAVAILABLE}")
        print(f"  ----  snapshot throughput >= save_file's: gradpipe {UNAVAILABLE}")
    else:
        smaller = zipnn.stored / gp_row.stored
        print(
            f"  {verdict(smaller >= 1.5 and gp_row.exact == 'yes')}  stored >= 1.5x smaller than "
            f"zipnn's, bit-exact: {smaller:.2f}x ({gp_row.stored / MiB:.1f} MiB vs "
            f"{zipnn.stored / MiB:.1f} MiB; bit-exact {gp_row.exact})"
        )
        rate = logical / MiB / gp_row.write_seconds
        print(
            f"  {verdict(rate >= st_rate)}  snapshot throughput >= save_file's: {rate:.0f} vs "
            f"{st_rate:.0f} MiB/s ({rate / st_rate:.2f}x)"
        )
    if command.missing:
        print(f"  ----  gradpipe restore <= 4x python -c load_file: {command.missing}")
    else:
        ours, theirs = command.ours, command.anchor
        ok = ours <= 4 * theirs and command.exact == "yes"
        print(
            f"  {verdict(ok)}  gradpipe restore <= 4x python -c load_file: {ours / theirs:.2f}x "
            f"({ours:.2f} s vs {theirs:.2f} s; bit-exact {command.exact})"
        )
    print(f"  info  {ingest_line}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--snapshots", type=int, default=8, help="consecutive snapshots (default 8)"
    )
    parser.add_argument(
        "--mib",
        type=float,
        default=260,
        help="MiB per snapshot (default 260: the full MiniLM shape, also the largest)",
    )
    parser.add_argument(
        "--passes", type=int, default=2, help="best of N passes of writes (default 2)"
    )
    parser.add_argument(
        "--repeat", type=int, default=3, help="median of N restores and commands (default 3)"
    )
    parser.add_argument(
        "--skip-ingest", action="store_true", help="no plain-versus---delta ingest line"
    )
    parser.add_argument(
        "--replay-intervals",
        default="",
        help="comma-separated replay intervals K to sweep (bytes, restore time), e.g. 2,4,8",
    )
    args = parser.parse_args()
    if args.snapshots < 2:
        parser.error("--snapshots must be at least 2 (a chain)")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gradpipe-bench-snapshots-", dir="/tmp") as tmp:
        run(args, Path(tmp))
    print(f"\ntotal {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
