"""Gradient analytics (docs/design/017, step 9) beside the numpy and listings they replace.

One table, every row labelled with its data and the machine, gradpipe and its anchor
measured in the same run on the same data: medians of ``--repeat`` (default 3), page cache
warm (every store and dump file is read once, untimed, first). "x anchor" is the anchor's
seconds over gradpipe's (above 1: gradpipe is faster); for MiB/s rows the same thing.

"Cold" means the run's analytics ref (``analytics/<run>``) is deleted, untimed, before the
call (``store.refs.set("analytics/r", None)``), so every step is computed and its result
written and recorded again; the result objects are on disk after the first run and are
rewritten (content-addressed: the same bytes), as a first call would write them.
"Memoised" is the second call: the index and the stored results only.

Rows (targets from docs/design/017, step 9 and its risk R1):

1. **norms + spikes** on ``bench-data/stats`` (2,000 dumps x 105 tensors, 440 KiB of float32
   each, made by ``bench_stats.prepare`` if absent and copied once to
   ``bench-data/analytics/`` so the analyses do not add objects to ``bench_stats``' store):
   ``gp.gradient_norms`` + ``gp.spikes`` cold on local threads and on
   ``gp.runner(processes=True)`` (started and warmed before the timed part), and memoised;
   the chunks read (``ds.attrs["chunks_read"]``, must be 0). Anchors: ``gp.compression_stats``
   on the same run (12.0 s in the design) and ``fsspec`` ``find(STORE, detail=True)``.
   Target: <= 15 s cold, 0 chunks read.
2. **agreement + GNS** on a MiniLM-shaped run (``write_transformer_run(TransformerConfig(
   steps=--agreement-steps, peers=--peers))``: full width, 87 MiB float32 dumps of 105
   tensors, real backprop; ingested once, untimed): ``gp.peer_agreement`` + ``gp.noise_scale``
   (one shared chunk pass per step, memoised as "peers"), cold, in a child process, on
   threads and on the process pool. Anchor, in a child process too: numpy on arrays already
   in memory: each step's dumps loaded untimed (``load_file``), then timed per tensor
   ``np.stack(...).astype(float64)``, ``X @ X.T``, the weighted mean, the squared distances
   to it and ``|G|^2``, and the sign matrices (elements non-zero in both, and agreeing minus
   disagreeing) by ``@`` of 0/1 and ±1 float32 matrices (``(x > 0) - (x < 0)`` of the float32
   stack: ``np.sign`` gives the same 8x slower); seconds per kernel in a note. Target:
   anchor s / gradpipe s >= 0.5. Peak RSS of each child (and of a pool worker): ``VmHWM``,
   not ``ru_maxrss``, which Linux carries over ``fork`` + ``exec`` from the parent.
   gradpipe's bound is threads x P x chunk bytes plus decode windows, numpy's one step of
   dumps plus float64 copies. The design wants 16 steps x 8 peers (11.1 GB); the default
   here is 4 x 8 (2.8 GB) to fit a routine run on two cores. The total cosines of both sides
   are compared.
3. **influence**: ``--influence-dumps`` (default 64) dumps of
   ``TransformerConfig.for_dump_size`` at 8 MiB each (2 peers), ingested once; projected once
   at k = 8192 (``gp.project_gradients``, cold: s per dump and MiB/s); then a 10-example
   query (10 further dumps of the same training, stacked on a leading axis) scored against
   every stored dump (``gp.influence(..., lr=)`` on ``gp.runner(workers=2)``, projections
   memoised: mostly projecting the query). Anchor: exact float64 dot products in numpy over
   the same dumps, loaded untimed. Printed: max and RMS of ``(score - exact) / (lr |q| |g|)``
   against the bound sqrt(2/k) = 0.0156 (the standard deviation), and how collinear the
   query and the dumps are. The design wants 1,000 dumps (8 GB); projecting them takes too
   long for a routine run here (the projection time at 1,000 is extrapolated). Target:
   <= 60 s per query (at 1,000 dumps).
4. **diff** on the agreement run: against a second run of the same files (ids only: chunks
   read must be 0) and against a run whose every non-zero value is one ulp larger in
   magnitude (every chunk differs and is read: MiB/s of one side's logical bytes).
   Anchors: numpy ``np.array_equal`` per tensor, and numpy's max |a - b| and max ulp
   (what the report holds), on the arrays loaded untimed.
5. **histograms**: ``gp.gradient_histograms`` (2 bins per octave over [2^-32, 2^16),
   cold) on the first ``--hist-steps`` steps of the agreement run, in MiB/s, beside
   ``np.histogram`` with the same finite edges (``bin_layout(2).lower/upper``) on the
   arrays in memory.

Data goes under ``--data`` (default ``bench-data``): ``stats/`` (shared with
``bench_stats.py``) and ``analytics/``, written once and reused. ``--quick`` uses tiny data
(under ``analytics/quick/``) and one repeat to smoke-test the script; its PASS/FAIL lines
do not judge the targets, which are for the default sizes.

Run: ``python benchmarks/bench_analytics.py`` from the repository root (``--repeat N``,
``--only norms,agreement,influence,diff,histograms``, ``--agreement-steps N``,
``--peers N``, ``--influence-dumps N``, ``--hist-steps N``, ``--quick``, ``--data DIR``);
about seven minutes the first time on two cores (training and ingesting 2.8 GB), three
after; ``--quick`` under half a minute.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
MiB = 2**20
ROWS = ("norms", "agreement", "influence", "diff", "histograms")
RUN = "r"
LR = 1e-4  # TransformerConfig's learning rate; the dumps record none


# --- sizes, machine, helpers -------------------------------------------------------------------
@dataclass(frozen=True)
class Sizes:
    """What each row runs on (``--quick`` shrinks all of it)."""

    norm_dumps: int
    norm_peers: int
    steps: int
    peers: int
    dump_mib: float | None  # None: the full MiniLM width (87 MiB per dump)
    influence_dumps: int
    influence_mib: float
    queries: int
    k: int
    hist_steps: int
    folder: str  # under --data

    @classmethod
    def of(cls, args: argparse.Namespace) -> Sizes:
        if args.quick:
            return cls(160, 4, 2, min(args.peers, 4), 0.5, 8, 0.5, 4, 8192, 1, "analytics/quick")
        return cls(
            2000,
            4,
            args.agreement_steps,
            args.peers,
            None,
            args.influence_dumps,
            8.0,
            10,
            8192,
            min(args.hist_steps, args.agreement_steps),
            "analytics",
        )


def machine() -> str:
    """The CPU model, cores usable of all, memory, OS, Python and numpy: every row's label."""
    model = platform.processor() or platform.machine()
    try:
        with Path("/proc/cpuinfo").open() as f:
            model = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model
            )
    except OSError:
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (
        f"{model}, {usable} of {os.cpu_count()} cores, {memory:.0f} GiB, "
        f"{platform.system()} {platform.release()}, Python {platform.python_version()}, "
        f"numpy {np.__version__}"
    )


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def timed(fn: Callable[[], object]) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def median(samples: list[float]) -> float:
    return statistics.median(samples) if samples else math.nan


def warm(*paths: Path) -> None:
    """Read every file under ``paths`` once: the page cache is warm for every row."""
    for top in paths:
        for folder, _, files in os.walk(top):
            for name in files:
                with (Path(folder) / name).open("rb") as f:
                    while f.read(16 * MiB):
                        pass


def forget(store: Any, run: str) -> None:
    """Delete the run's analytics ref (its history is kept): the next call is cold."""
    if store.refs.entry(f"analytics/{run}") is not None:
        store.refs.set(f"analytics/{run}", None, message="bench_analytics: forget")


def dump_files(folder: Path) -> dict[tuple[int, str], Path]:
    """``(step, peer)`` → file of a ``dumps/step=NNNN/peer=P.safetensors`` tree."""
    out = {}
    for path in sorted(folder.glob("step=*/peer=*.safetensors")):
        step = int(path.parent.name.removeprefix("step="))
        out[step, path.stem.removeprefix("peer=")] = path
    return out


def load(path: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(path))


def header(path: Path) -> Any:
    """The file's safetensors header (entries with their sizes, and its metadata)."""
    from gradpipe.formats.safetensors import read_header

    with path.open("rb") as f:
        return read_header(f, path=str(path))


def logical_bytes(files: list[Path]) -> int:
    return sum(e.nbytes for path in files for e in header(path).tensors.values())


def high_water_kib(pid: int | str = "self") -> int:
    """Peak RSS of a process, KiB: ``VmHWM``, which starts afresh at ``exec``.

    Not ``ru_maxrss``: Linux carries it over ``fork`` + ``exec``, so a child would
    report at least its parent's peak at the fork.
    """
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def shown(path: Path) -> str:
    """``path`` relative to the working directory where it lies below it."""
    return str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else str(path)


def rss_mib(kib: float) -> str:
    return f"{kib / 1024:,.0f} MiB"


# --- the table ---------------------------------------------------------------------------------
@dataclass
class Line:
    measure: str
    ours: str
    anchor: str = ""
    ratio: str = ""
    target: str = ""


@dataclass
class Section:
    title: str
    data: str
    lines: list[Line] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, *args: str) -> None:
        self.lines.append(Line(*args))


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def ratio(anchor: float, ours: float) -> str:
    return f"{anchor / ours:.2f}x" if ours > 0 and math.isfinite(anchor / ours) else "-"


def print_table(sections: list[Section], args: argparse.Namespace, label: str) -> None:
    widths = (44, 26, 40, 9)
    head = ("measure", "gradpipe", "anchor", "x anchor", "target")
    print(f"\n=== gradpipe analytics (docs/design/017 step 9); machine: {label} ===")
    print(
        f"median of {args.repeat} run(s), page cache warm; cold = analytics ref deleted first; "
        "x anchor = anchor s / gradpipe s (above 1: gradpipe faster)"
    )
    if args.quick:
        print("--quick: tiny data to smoke-test the script; PASS/FAIL do not judge the targets")
    rule = "-" * (sum(widths) + len(widths) + 24)
    for section in sections:
        print(f"\n{section.title}\n  data: {section.data}\n  machine: {label}")
        print("  " + " ".join(h.ljust(w) for h, w in zip(head, widths, strict=False)) + head[-1])
        print("  " + rule)
        for line in section.lines:
            cells = (line.measure, line.ours, line.anchor, line.ratio)
            print("  " + " ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)), end="")
            print(f" {line.target}".rstrip())
        for note in section.notes:
            print(f"  note: {note}")


# --- children: a timed side in a process of its own (peak RSS its own) ------------------------
def child_main(name: str, params: dict[str, Any]) -> None:
    result = CHILDREN[name](params)
    result["rss_kib"] = high_water_kib()
    print(json.dumps(result))


def run_child(name: str, params: dict[str, Any]) -> dict[str, Any]:
    argv = [sys.executable, __file__, "--child", name, "--child-params", json.dumps(params)]
    environ = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(argv, capture_output=True, text=True, env=environ, check=False)
    if done.returncode != 0:
        raise SystemExit(f"child {name} failed:\n{done.stdout}\n{done.stderr}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def child_agreement_gradpipe(params: dict[str, Any]) -> dict[str, Any]:
    import psutil

    import gradpipe as gp

    store = gp.open_store(params["store"], mode="r+")
    start_kib = high_water_kib()  # after the imports
    with gp.runner(processes=params["processes"], workers=params["workers"]) as active:
        active.get({"x": 1, "y": (sum, ["x", "x"])}, ["y"], name="gradpipe-warm")
        seconds, chunks = [], 0
        for _ in range(params["repeat"]):
            forget(store, RUN)

            def both() -> tuple[Any, Any]:
                agreement = gp.peer_agreement(store, RUN, runner=active)
                return agreement, gp.noise_scale(store, RUN, runner=active)

            t, (agreement, gns) = timed(both)
            seconds.append(t)
            chunks = int(agreement.attrs["chunks_read"])
            if gns.attrs["memoised_steps"] != agreement.attrs["computed_steps"]:
                raise SystemExit(f"noise_scale did not reuse the peers' pass: {gns.attrs}")
        workers = [high_water_kib(c.pid) for c in psutil.Process().children(recursive=True)]
    cosine = agreement["cosine"].transpose("step", "peer", "peer_b").values
    peers = [str(x) for x in agreement["peer"].values]
    return {
        "seconds": seconds,
        "chunks_read": chunks,
        "cosine": cosine.tolist(),
        "peers": peers,
        "rss_start_kib": start_kib,
        "rss_workers_kib": max(workers, default=0),
    }


def child_agreement_numpy(params: dict[str, Any]) -> dict[str, Any]:
    """numpy on arrays already in memory: each step's dumps loaded untimed, the kernels timed."""
    import safetensors.numpy  # noqa: F401 (imported before the baseline RSS)

    start_kib = high_water_kib()
    files = {(int(s), str(p)): Path(v) for (s, p), v in params["files"]}
    steps = sorted({s for s, _ in files})
    seconds: list[float] = []
    kernels: dict[str, list[float]] = {k: [] for k in KERNELS}
    cosines: list[list[list[float]]] = []
    for _ in range(params["repeat"]):
        spent = dict.fromkeys(KERNELS, 0.0)
        cosines = []
        for step in steps:
            paths = [files[key] for key in sorted(files) if key[0] == step]
            dumps = [load(p) for p in paths]  # untimed: "already in memory"
            weights = [float(header(p).metadata.get("num_examples", 1)) for p in paths]
            share = np.array(weights) / sum(weights)
            gram_total = np.zeros((len(dumps), len(dumps)))
            for name in dumps[0]:
                clock = time.perf_counter()
                x32 = np.stack([d[name].reshape(-1) for d in dumps])
                x = x32.astype(np.float64)
                clock = _lap(spent, "stack + astype(float64)", clock)
                gram = x @ x.T
                clock = _lap(spent, "X @ X.T", clock)
                mean = share @ x
                diff = x - mean
                dist_sq = np.einsum("ij,ij->i", diff, diff)
                mean_sq = mean @ mean
                clock = _lap(spent, "weighted mean, d_p^2, |G|^2", clock)
                # ±1, 0 where zero; np.sign(x32) gives the same but takes 8x as long here
                signs = np.subtract(x32 > 0, x32 < 0, dtype=np.float32)
                nonzero = (x32 != 0).astype(np.float32)
                agree = signs @ signs.T  # agreeing minus disagreeing, where both are non-zero
                both = nonzero @ nonzero.T
                _ = (dist_sq, mean_sq, (both - agree) / 2)
                _lap(spent, "sign matrices (float32 @)", clock)
                gram_total += gram
                del x32, x, diff, signs, nonzero
            norms = np.sqrt(np.diag(gram_total))
            cosines.append((gram_total / np.outer(norms, norms)).tolist())
            del dumps
        seconds.append(sum(spent.values()))
        for k, v in spent.items():
            kernels[k].append(v)
    peers = sorted({p for _, p in files})
    return {
        "seconds": seconds,
        "kernels": {k: median(v) for k, v in kernels.items()},
        "cosine": cosines,
        "peers": peers,
        "rss_start_kib": start_kib,
    }


KERNELS = (
    "stack + astype(float64)",
    "X @ X.T",
    "weighted mean, d_p^2, |G|^2",
    "sign matrices (float32 @)",
)


def _lap(spent: dict[str, float], kernel: str, since: float) -> float:
    now = time.perf_counter()
    spent[kernel] += now - since
    return now


CHILDREN: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "agreement-gradpipe": child_agreement_gradpipe,
    "agreement-numpy": child_agreement_numpy,
}


# --- data --------------------------------------------------------------------------------------
def norms_store(data: Path, sizes: Sizes, quick: bool) -> Path:
    """``bench_stats``' store (made if missing), copied once under ``analytics/``."""
    import bench_stats  # the same builder and data as bench_stats.py

    bench_stats.DATA = data / sizes.folder / "stats" if quick else data / "stats"
    source = bench_stats.prepare(sizes.norm_dumps, sizes.norm_peers, fresh=False)
    copy = data / sizes.folder / f"norms-{source.name}"
    if not copy.exists():
        print(f"copying {source} to {copy} ...", flush=True)
        partial = copy.parent / f"{copy.name}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        shutil.copytree(source, partial, symlinks=True)
        partial.rename(copy)
    return copy


def minilm_data(data: Path, sizes: Sizes) -> Path:
    """The agreement run, its copy and its one-ulp twin, ingested once into one store."""
    import gradpipe as gp
    from gradpipe.formats.safetensors import write_safetensors
    from gradpipe.testing.transformer import TransformerConfig, write_transformer_run

    width = "full" if sizes.dump_mib is None else f"{sizes.dump_mib:g}MiB"
    folder = data / sizes.folder / f"minilm-{sizes.steps}x{sizes.peers}-{width}"
    if (folder / "done").exists():
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    if sizes.dump_mib is None:
        config = TransformerConfig(steps=sizes.steps, peers=sizes.peers)
    else:
        total = sizes.dump_mib * sizes.steps * sizes.peers
        config = TransformerConfig.for_dump_size(total, steps=sizes.steps, peers=sizes.peers)
    print(
        f"training and writing {sizes.steps} x {sizes.peers} dumps under {folder} ...", flush=True
    )
    write_transformer_run(folder / "run", config, states=False)
    print("writing the one-ulp twin ...", flush=True)
    for (step, peer), path in dump_files(folder / "run" / "dumps").items():
        meta = header(path).metadata
        twin = {}
        for name, a in load(path).items():
            away = np.copysign(np.float32(np.inf), a).astype(a.dtype)
            twin[name] = np.where(a != 0, np.nextafter(a, away), a)
        out = folder / "ulp" / f"step={step:04d}" / f"peer={peer}.safetensors"
        out.parent.mkdir(parents=True, exist_ok=True)
        write_safetensors(str(out), twin, meta)
    print("ingesting ...", flush=True)
    store = gp.open_store(str(folder / "store"), mode="w")
    pattern = str(folder / "run" / "dumps" / "step={step}" / "peer={peer}.safetensors")
    gp.ingest(store, pattern, run=RUN)
    gp.ingest(store, pattern, run=f"{RUN}-copy")
    gp.ingest(store, str(folder / "ulp" / "step={step}" / "peer={peer}.safetensors"), run="r-ulp")
    (folder / "done").write_text(repr(config))
    return folder


def influence_data(data: Path, sizes: Sizes) -> Path:
    """``influence_dumps`` training dumps ingested, and ``queries`` more kept apart."""
    import gradpipe as gp
    from gradpipe.testing.transformer import TransformerConfig, write_transformer_run

    folder = data / sizes.folder / f"influence-{sizes.influence_dumps}x{sizes.influence_mib:g}MiB"
    if (folder / "done").exists():
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    train_steps = math.ceil(sizes.influence_dumps / 2)
    steps = train_steps + math.ceil(sizes.queries / 2)
    config = TransformerConfig.for_dump_size(sizes.influence_mib * 2 * steps, steps=steps, peers=2)
    print(f"training and writing {2 * steps} dumps of {config} under {folder} ...", flush=True)
    write_transformer_run(folder / "run", config, states=False)
    for (step, _), path in dump_files(folder / "run" / "dumps").items():
        if step >= train_steps and path.parent.exists():
            (folder / "query").mkdir(exist_ok=True)
            path.parent.rename(folder / "query" / path.parent.name)
    store = gp.open_store(str(folder / "store"), mode="w")
    gp.ingest(
        store, str(folder / "run" / "dumps" / "step={step}" / "peer={peer}.safetensors"), run=RUN
    )
    (folder / "done").write_text(repr(config))
    return folder


def minilm_label(folder: Path, sizes: Sizes) -> tuple[str, int]:
    files = list(dump_files(folder / "run" / "dumps").values())
    nbytes = logical_bytes(files)
    width = "full MiniLM width" if sizes.dump_mib is None else f"shrunk to ~{sizes.dump_mib:g} MiB"
    return (
        f"{shown(folder)}: "
        f"write_transformer_run(TransformerConfig, {width}), {sizes.steps} steps x "
        f"{sizes.peers} peers, {len(files)} float32 dumps of "
        f"{nbytes / len(files) / MiB:.1f} MiB ({nbytes / MiB:,.0f} MiB)",
        nbytes,
    )


# --- row 1: norms + spikes ---------------------------------------------------------------------
def row_norms(args: argparse.Namespace, sizes: Sizes) -> Section:
    import fsspec

    import gradpipe as gp

    path = norms_store(Path(args.data), sizes, args.quick)
    store = gp.open_store(str(path), mode="r+")
    view = gp.open_run(store, RUN)
    section = Section(
        "1. norms + spikes (gp.gradient_norms + gp.spikes, manifests only)",
        f"{shown(path)}: bench_stats.py's run, {len(view)} dumps ({len(view.steps)} steps x "
        f"{len(view.peers)} peers) x 105 tensors, 440 KiB float32 each",
    )
    warm(path)
    local = fsspec.filesystem("file")
    gp.compression_stats(store, run=RUN)  # warm the imports and the manifests

    def norms_spikes(runner: Any = None) -> tuple[Any, Any]:
        ds = gp.gradient_norms(store, RUN, runner=runner)
        return ds, gp.spikes(ds)

    times: dict[str, list[float]] = {k: [] for k in ("cold", "proc", "memo", "spk", "cs", "find")}
    attrs: dict[str, dict[str, Any]] = {}
    with gp.runner(processes=True, workers=cores()) as pool:
        pool.get({"x": 1, "y": (sum, ["x", "x"])}, ["y"], name="gradpipe-warm")
        for _ in range(args.repeat):
            forget(store, RUN)
            t, (ds, _) = timed(norms_spikes)
            times["cold"].append(t)
            attrs["cold"] = dict(ds.attrs)
            t, (ds, _) = timed(norms_spikes)
            times["memo"].append(t)
            attrs["memo"] = dict(ds.attrs)
            times["spk"].append(timed(partial(gp.spikes, ds))[0])
            forget(store, RUN)
            t, (ds, _) = timed(lambda: norms_spikes(pool))
            times["proc"].append(t)
            attrs["proc"] = dict(ds.attrs)
            times["cs"].append(timed(lambda: gp.compression_stats(store, run=RUN))[0])
            times["find"].append(timed(lambda: local.find(str(path), detail=True))[0])
    m = {k: median(v) for k, v in times.items()}
    cs = f"gp.compression_stats {m['cs']:.2f} s"
    find = f"fsspec find {m['find']:.2f} s"
    for key, label in (("cold", "threads"), ("proc", "runner(processes=True)")):
        a = attrs[key]
        section.add(
            f"cold, {label} (s)",
            f"{m[key]:.2f} s",
            cs,
            ratio(m["cs"], m[key]),
            f"<= 15 s cold: {verdict(m[key] <= 15)}",
        )
        section.add(
            "  chunks read, steps computed",
            f"{a['chunks_read']}, {a['computed_steps']}",
            "",
            "",
            f"0 chunks: {verdict(a['chunks_read'] == 0)}",
        )
    section.add(
        "cold, threads, beside a listing (s)",
        f"{m['cold']:.2f} s",
        find,
        ratio(m["find"], m["cold"]),
    )
    a = attrs["memo"]
    section.add(
        "memoised (s)",
        f"{m['memo']:.2f} s",
        cs,
        ratio(m["cs"], m["memo"]),
        f"0 chunks: {verdict(a['chunks_read'] == 0)}",
    )
    section.add(
        "  chunks read, steps memoised",
        f"{a['chunks_read']}, {a['memoised_steps']}",
    )
    section.add("gp.spikes of memoised norms (ms)", f"{1000 * m['spk']:.1f} ms")
    section.add(
        "ms per dump, cold threads / memoised",
        f"{1000 * m['cold'] / len(view):.2f} / {1000 * m['memo'] / len(view):.2f}",
        f"compression_stats {1000 * m['cs'] / len(view):.2f}",
    )
    section.notes.append(
        "the design's anchor figure for gp.compression_stats is 12.0 s on its machine; the one "
        "above was measured here, in this run"
    )
    return section


# --- row 2: agreement + GNS --------------------------------------------------------------------
def row_agreement(args: argparse.Namespace, sizes: Sizes) -> Section:
    folder = minilm_data(Path(args.data), sizes)
    label, nbytes = minilm_label(folder, sizes)
    section = Section("2. agreement + GNS (gp.peer_agreement + gp.noise_scale, cold)", label)
    warm(folder / "store", folder / "run")
    files = [[list(k), str(v)] for k, v in dump_files(folder / "run" / "dumps").items()]
    common = {"store": str(folder / "store"), "repeat": args.repeat}
    ours = run_child("agreement-gradpipe", {**common, "processes": False, "workers": cores()})
    pool = run_child("agreement-gradpipe", {**common, "processes": True, "workers": cores()})
    anchor = run_child("agreement-numpy", {"files": files, "repeat": args.repeat})
    a = median(anchor["seconds"])
    numpy_label = f"numpy in memory {a:.2f} s"
    for result, how in ((ours, "threads"), (pool, "processes")):
        t = median(result["seconds"])
        section.add(
            f"cold, {how if how == 'threads' else 'runner(processes=True)'} (s)",
            f"{t:.2f} s",
            numpy_label,
            ratio(a, t),
            f">= 0.5x: {verdict(a / t >= 0.5)}",
        )
        section.add("  MiB/s of dumps", f"{nbytes / MiB / t:,.0f}", f"{nbytes / MiB / a:,.0f}")
        section.add(
            "  peak RSS (at the start)",
            f"{rss_mib(result['rss_kib'])} ({rss_mib(result['rss_start_kib'])})",
            f"numpy {rss_mib(anchor['rss_kib'])} ({rss_mib(anchor['rss_start_kib'])})",
        )
        if how != "threads":
            section.add("  peak RSS of a worker process", rss_mib(result["rss_workers_kib"]))
    section.add("  chunks read per cold call", f"{ours['chunks_read']:,}")
    order = [anchor["peers"].index(x) for x in ours["peers"]]
    theirs = np.array(anchor["cosine"])[:, order][:, :, order]
    diff = np.nanmax(np.abs(np.array(ours["cosine"]) - theirs))
    section.add("  max |cosine - numpy's| (total)", f"{diff:.1e}")
    section.notes.append(
        "numpy's seconds by kernel: "
        + ", ".join(f"{k} {v:.2f}" for k, v in anchor["kernels"].items())
        + " (its fresh arrays' page faults count: new float64 copies of every tensor)"
    )
    section.notes.append(
        "the design's row is 16 steps x 8 peers (11.1 GB); this one is "
        f"{sizes.steps} x {sizes.peers} (--agreement-steps, --peers) to fit a routine run here"
    )
    return section


# --- row 3: influence --------------------------------------------------------------------------
def row_influence(args: argparse.Namespace, sizes: Sizes) -> Section:
    import gradpipe as gp

    folder = influence_data(Path(args.data), sizes)
    train = dump_files(folder / "run" / "dumps")
    queries = list(dump_files(folder / "query").values())[: sizes.queries]
    nbytes = logical_bytes(list(train.values()))
    section = Section(
        f"3. influence (gp.project_gradients at k = {sizes.k}, then gp.influence)",
        f"{shown(folder)}: write_transformer_run(TransformerConfig.for_dump_size(...)), "
        f"{len(train)} float32 dumps (2 peers) of {nbytes / len(train) / MiB:.1f} MiB "
        f"({nbytes / MiB:,.0f} MiB); a {len(queries)}-example query from {len(queries)} "
        "further dumps of the same training",
    )
    warm(folder)
    store = gp.open_store(str(folder / "store"), mode="r+")
    arrays = [load(p) for p in queries]
    query = {name: np.stack([a[name] for a in arrays]) for name in arrays[0]}
    del arrays
    names = list(query)
    dumps = {key: load(path) for key, path in train.items()}  # the anchor's, untimed
    flat = {key: np.concatenate([d[n].reshape(-1) for n in names]) for key, d in dumps.items()}
    del dumps
    q_flat = np.concatenate([query[n].reshape(len(queries), -1) for n in names], axis=1)

    project_s, query_s, anchor_s = [], [], []
    with gp.runner(workers=2) as active:
        for _ in range(args.repeat):
            forget(store, RUN)
            t, projected = timed(lambda: gp.project_gradients(store, RUN, k=sizes.k, runner=active))
            project_s.append(t)
            t, scores = timed(
                lambda: gp.influence(store, RUN, query, k=sizes.k, lr=LR, runner=active)
            )
            query_s.append(t)

            def exact() -> dict[tuple[int, str], np.ndarray]:
                q64 = q_flat.astype(np.float64)
                return {key: LR * (q64 @ g.astype(np.float64)) for key, g in flat.items()}

            t, truth = timed(exact)
            anchor_s.append(t)
    if projected.attrs["computed_steps"] == 0 or scores.attrs["chunks_read"] != 0:
        section.notes.append(f"unexpected: projection {projected.attrs}, influence {scores.attrs}")
    q_norm = np.sqrt(np.einsum("ij,ij->i", q_flat.astype(np.float64), q_flat.astype(np.float64)))
    errors, cosines = [], []
    for (step, peer), g in flat.items():
        g_norm = math.sqrt(float(g.astype(np.float64) @ g.astype(np.float64)))
        got = scores["score"].sel(step=step, peer=peer).values
        errors.append((got - truth[step, peer]) / (LR * q_norm * g_norm))
        cosines.append(truth[step, peer] / (LR * q_norm * g_norm))
    err = np.abs(np.concatenate(errors))
    cos = np.abs(np.concatenate(cosines))
    bound = math.sqrt(2 / sizes.k)
    p, qs, a = median(project_s), median(query_s), median(anchor_s)
    section.add(
        "project every dump, cold (s)",
        f"{p:.2f} s",
        "",
        "",
        f"{projected.attrs['chunks_read']:,} chunks read",
    )
    section.add(
        "  s per dump, MiB/s of projection",
        f"{p / len(train):.3f} s, {nbytes / MiB / p:,.0f} MiB/s",
        f"1,000 dumps: ~{1000 * p / len(train):,.0f} s (extrapolated)",
    )
    section.add(
        f"{len(queries)}-example query, projections memoised (s)",
        f"{qs:.2f} s",
        f"numpy exact dots {a:.2f} s",
        ratio(a, qs),
        f"<= 60 s: {verdict(qs <= 60)} (at {len(train)} dumps)",
    )
    section.add(
        "  normalised score error, RMS / max",
        f"{math.sqrt(float(np.mean(err**2))):.4f} / {float(err.max()):.4f}",
        f"bound sqrt(2/k) = {bound:.4f} (std)",
        "",
        f"RMS <= bound: {verdict(math.sqrt(float(np.mean(err**2))) <= bound)}",
    )
    section.add("  |cosine(query, dump)|, median (min)", f"{np.median(cos):.3f} ({cos.min():.3f})")
    section.notes.append(
        f"the design's row is 1,000 dumps of 8 MiB (8 GB); projecting them takes too long on "
        f"this machine for a routine run, so {len(train)} (--influence-dumps): the query's "
        "time is mostly projecting the query, which does not grow with the dumps"
    )
    section.notes.append(
        "error = (score - exact) / (lr |q| |g|) over every (example, step, peer); the bound "
        "is its standard deviation. One projection serves every pair, so where the gradients "
        "are nearly collinear (|cosine| near 1: the pooler and 2-label classifier carry most "
        "of the norm) the pairs' errors are one draw, not independent samples"
    )
    return section


# --- row 4: diff -------------------------------------------------------------------------------
def row_diff(args: argparse.Namespace, sizes: Sizes) -> Section:
    import gradpipe as gp

    folder = minilm_data(Path(args.data), sizes)
    label, nbytes = minilm_label(folder, sizes)
    section = Section(
        "4. diff (gp.diff of two runs)", label + "; the same files again, and a one-ulp twin"
    )
    warm(folder)
    store = gp.open_store(str(folder / "store"), mode="r")
    a_files = dump_files(folder / "run" / "dumps")
    b_files = dump_files(folder / "ulp")
    ours: dict[str, list[float]] = {"equal": [], "ulp": []}
    numpy_eq: dict[str, list[float]] = {"equal": [], "ulp": []}
    numpy_fig: list[float] = []
    reports: dict[str, Any] = {}
    gp.diff(store, RUN, f"{RUN}-copy")  # untimed: the first call's imports
    for _ in range(args.repeat):
        for key, other in (("equal", f"{RUN}-copy"), ("ulp", "r-ulp")):
            t, reports[key] = timed(partial(gp.diff, store, RUN, other))
            ours[key].append(t)
        totals = {"equal": 0.0, "ulp": 0.0, "fig": 0.0}
        for step_peer, path in a_files.items():
            left = load(path)
            for key, other_path in (("equal", path), ("ulp", b_files[step_peer])):
                right = load(other_path)
                totals[key] += timed(partial(_numpy_equal, left, right))[0]
                if key == "ulp":
                    totals["fig"] += timed(partial(_numpy_figures, left, right))[0]
        for key in ("equal", "ulp"):
            numpy_eq[key].append(totals[key])
        numpy_fig.append(totals["fig"])
    eq, ulp = reports["equal"], reports["ulp"]
    t_eq, t_ulp = median(ours["equal"]), median(ours["ulp"])
    a_eq, a_ulp, a_fig = median(numpy_eq["equal"]), median(numpy_eq["ulp"]), median(numpy_fig)
    section.add(
        "equal runs, ids only (s)",
        f"{t_eq:.3f} s",
        f"np.array_equal {a_eq:.2f} s",
        ratio(a_eq, t_eq),
        f"0 chunks: {verdict(eq.chunks_read == 0 and eq.equal)}",
    )
    section.add("  equal runs: chunks read, equal", f"{eq.chunks_read}, {eq.equal}")
    section.add(
        "one-ulp runs (s)",
        f"{t_ulp:.2f} s",
        f"np.array_equal {a_ulp:.2f} s",
        ratio(a_ulp, t_ulp),
    )
    section.add("", "", f"numpy max|a-b| + max ulp {a_fig:.2f} s", ratio(a_fig, t_ulp))
    section.add(
        "  one-ulp runs: MiB/s of one side",
        f"{nbytes / MiB / t_ulp:,.0f}",
        f"{nbytes / MiB / a_ulp:,.0f} / {nbytes / MiB / a_fig:,.0f}",
    )
    worst = max((t.max_ulp or 0) for t in ulp.tensors)
    section.add(
        "  one-ulp runs: chunks read, equal, max ulp",
        f"{ulp.chunks_read:,}, {ulp.equal}, {worst}",
        "",
        "",
        f"found: {verdict(not ulp.equal and worst == 1)}",
    )
    section.notes.append(
        "the twin moves every non-zero value one ulp away from zero (zeros stay), so every "
        "chunk that holds a non-zero value differs and is read on both sides"
    )
    return section


def _numpy_equal(left: dict[str, np.ndarray], right: dict[str, np.ndarray]) -> list[bool]:
    return [bool(np.array_equal(a, right[name])) for name, a in left.items()]


def _numpy_figures(left: dict[str, np.ndarray], right: dict[str, np.ndarray]) -> list[Any]:
    out = []
    for name, a in left.items():
        b = right[name]
        ia, ib = a.view(np.int32).astype(np.int64), b.view(np.int32).astype(np.int64)
        ia = np.where(ia < 0, np.int64(-(2**31)) - ia, ia)  # sign-magnitude to ordered ints
        ib = np.where(ib < 0, np.int64(-(2**31)) - ib, ib)
        out.append(
            (
                np.max(np.abs(a.astype(np.float64) - b), initial=0),
                np.max(np.abs(ia - ib), initial=0),
            )
        )
    return out


# --- row 5: histograms -------------------------------------------------------------------------
def row_histograms(args: argparse.Namespace, sizes: Sizes) -> Section:
    import gradpipe as gp
    from gradpipe.analytics.histogram_bins import bin_layout, histogram_counts

    folder = minilm_data(Path(args.data), sizes)
    steps = list(range(sizes.hist_steps))
    files = {k: v for k, v in dump_files(folder / "run" / "dumps").items() if k[0] in steps}
    span = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"
    nbytes = logical_bytes(list(files.values()))
    section = Section(
        "5. histograms (gp.gradient_histograms, 2 bins per octave over [2^-32, 2^16), cold)",
        f"{shown(folder)}: {span} of the agreement run, {len(files)} float32 "
        f"dumps ({nbytes / MiB:,.0f} MiB)",
    )
    warm(folder / "store", *files.values())
    store = gp.open_store(str(folder / "store"), mode="r+")
    layout = bin_layout(2)
    edges = np.unique(np.concatenate([layout.lower, layout.upper]))
    edges = edges[np.isfinite(edges)]
    histogram_counts(np.zeros(4, np.float32), layout)  # untimed: the layout's counting plans
    ours, theirs = [], []
    for _ in range(args.repeat):
        forget(store, RUN)
        t, counts = timed(lambda: gp.gradient_histograms(store, RUN, steps=steps))
        ours.append(t)
        total = 0.0
        for path in files.values():
            arrays = load(path)
            total += timed(partial(_numpy_histograms, arrays, edges))[0]
        theirs.append(total)
    t, a = median(ours), median(theirs)
    section.add(
        "MiB/s of dumps",
        f"{nbytes / MiB / t:,.0f} ({t:.2f} s)",
        f"np.histogram in memory {nbytes / MiB / a:,.0f} ({a:.2f} s)",
        ratio(a, t),
    )
    section.add(
        "  chunks read, steps computed",
        f"{counts.attrs['chunks_read']:,}, {counts.attrs['computed_steps']}",
    )
    section.notes.append(
        f"np.histogram gets the {len(edges)} finite edges of bin_layout(2) (values beyond them "
        "are dropped); gradpipe also counts zeros, under/overflow, infinities and NaN per sign"
    )
    return section


def _numpy_histograms(arrays: dict[str, np.ndarray], edges: np.ndarray) -> list[Any]:
    return [np.histogram(x, bins=edges) for x in arrays.values()]


ROW_FUNCTIONS: dict[str, Callable[[argparse.Namespace, Sizes], Section]] = {
    "norms": row_norms,
    "agreement": row_agreement,
    "influence": row_influence,
    "diff": row_diff,
    "histograms": row_histograms,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--repeat", type=int, default=None, help="median of N (default 3; 1 with --quick)"
    )
    parser.add_argument("--quick", action="store_true", help="tiny data, to smoke-test the script")
    parser.add_argument("--only", default=",".join(ROWS), help="a subset of " + ",".join(ROWS))
    parser.add_argument("--data", default=str(ROOT / "bench-data"), help="where data is kept")
    parser.add_argument(
        "--agreement-steps", type=int, default=4, help="steps of the MiniLM run (default 4)"
    )
    parser.add_argument("--peers", type=int, default=8, help="peers of the MiniLM run (default 8)")
    parser.add_argument(
        "--influence-dumps", type=int, default=64, help="dumps projected (default 64)"
    )
    parser.add_argument("--hist-steps", type=int, default=1, help="steps histogrammed (default 1)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-params", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child_main(args.child, json.loads(args.child_params))
        return
    args.repeat = args.repeat or (1 if args.quick else 3)
    args.data = str(Path(args.data).resolve())
    rows = [r.strip() for r in args.only.split(",") if r.strip()]
    unknown = sorted(set(rows) - set(ROWS))
    if unknown:
        parser.error(f"--only: unknown rows {unknown}; choose from {', '.join(ROWS)}")
    if (
        args.peers < 2
        or args.agreement_steps < 1
        or args.influence_dumps < 2
        or args.hist_steps < 1
    ):
        parser.error("--peers needs 2 or more; the other sizes 1 or more (--influence-dumps 2)")
    sizes = Sizes.of(args)
    label = machine()
    start = time.perf_counter()
    sections = []
    for row in ROWS:
        if row in rows:
            print(f"row {row} ...", flush=True)
            sections.append(ROW_FUNCTIONS[row](args, sizes))
    print_table(sections, args, label)
    print(f"\ntotal {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
