"""``gp.aggregate`` end to end for the robust and private methods.

Median, trimmed mean, Krum, Multi-Krum and Bulyan against an independent
float64 reference and Flower's functions on a ``gradpipe.testing`` sample run;
DP-FedAvg's noise statistics over seeds; adaptive clipping's convergence.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import dask.config
import numpy as np
import pytest

import gradpipe as gp
from gradpipe.formats.safetensors import write_safetensors
from gradpipe.testing.training import SampleRun, TrainingConfig, write_sample_run

agg = pytest.importorskip("flwr.server.strategy.aggregate")

#: 7 peers: Krum tolerates f = 2, Bulyan f = 1; the embedding spans several chunks.
SEVEN = TrainingConfig(vocab_size=3000, embed_dim=16, hidden=16, peers=7, steps=2)
EPS32 = float(np.finfo(np.float32).eps)


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> SampleRun:
    return write_sample_run(tmp_path_factory.mktemp("sample7"), SEVEN)


def _ingest(url: str | Path, pattern: str, chunk: str = "48 KiB") -> gp.Store:
    store = gp.open_store(url, mode="a")
    with dask.config.set({"gradpipe.chunk-bytes": chunk}):
        report = gp.ingest(store, pattern, run="r")
    assert report.ok, report.failures
    return store


@pytest.fixture(scope="module")
def store(sample: SampleRun, tmp_path_factory: pytest.TempPathFactory) -> gp.Store:
    return _ingest(tmp_path_factory.mktemp("store7") / "s", sample.dump_pattern)


def _dumps(store: gp.Store, step: int) -> tuple[list[str], list[dict[str, np.ndarray]]]:
    run = gp.open_run(store, "r")
    peers = [p for p in run.peers if run.manifest.entry(step, p)]
    return peers, [run.dump(step, p).read_all() for p in peers]


def _num_examples(store: gp.Store, step: int, peers: list[str]) -> list[int]:
    run = gp.open_run(store, "r")
    return [int(run.dump(step, p).metadata["num_examples"]) for p in peers]


def _ulp32(ref: np.ndarray) -> np.ndarray:
    return np.spacing(np.abs(ref).astype(np.float32)).astype(np.float64)


def _distances(dumps: list[dict[str, np.ndarray]]) -> np.ndarray:
    flat = [np.concatenate([a.astype(np.float64).ravel() for a in d.values()]) for d in dumps]
    return np.array([[math.fsum((a - b) ** 2) for b in flat] for a in flat])


def _krum_ref(dist: np.ndarray, f: int, m: int) -> list[int]:
    n = dist.shape[0]
    k = n - f - 2
    scores = [math.fsum(sorted(np.delete(dist[i], i))[:k]) for i in range(n)]
    return sorted(sorted(range(n), key=lambda i: (scores[i], i))[:m])


def _bulyan_ref(dist: np.ndarray, f: int) -> list[int]:
    remaining, chosen = list(range(dist.shape[0])), []
    for _ in range(dist.shape[0] - 2 * f):
        sub = dist[np.ix_(remaining, remaining)]
        k = max(1, len(remaining) - f - 2)
        scores = [math.fsum(sorted(np.delete(sub[i], i))[:k]) for i in range(len(remaining))]
        chosen.append(remaining.pop(min(range(len(remaining)), key=lambda i: (scores[i], i))))
    return sorted(chosen)


def _bound(arrays: list[np.ndarray], n: int) -> float:
    # Flower sums in float32: |Δ| <= 2·n·ε₃₂·max|x|
    return 2 * n * EPS32 * max(float(np.abs(a).max()) for a in arrays)


@pytest.mark.parametrize("step", [0, 1])
def test_median_and_trimmed_mean_match_a_reference_and_flower(store: gp.Store, step: int) -> None:
    gp.aggregate(store, run="r", method="median", steps=[step])
    gp.aggregate(store, run="r", method="trimmed-mean", trim=0.2, steps=[step])
    run = gp.open_run(store, "r")
    peers, dumps = _dumps(store, step)
    names = list(dumps[0])
    results = [([d[t] for t in names], 1) for d in dumps]
    flower_median = agg.aggregate_median(results)
    flower_trimmed = agg.aggregate_trimmed_avg(results, 0.2)
    cut = int(0.2 * len(peers))
    for i, t in enumerate(names):
        stack = np.stack([d[t] for d in dumps]).astype(np.float64)
        med = run.aggregate("median", step=step).read(t)
        # 7 peers: the median is one of the values, exactly
        assert med.dtype == np.float32
        assert (med == np.median(stack, axis=0).astype(np.float32)).all(), t
        assert (med == flower_median[i]).all(), t
        trimmed = run.aggregate("trimmed-mean", step=step).read(t)
        kept = np.sort(stack, axis=0)[cut : len(peers) - cut]
        ref = kept.sum(axis=0) / kept.shape[0]
        assert (np.abs(trimmed - ref) <= _ulp32(ref)).all(), t
        bound = _bound([d[t] for d in dumps], len(peers))
        assert np.abs(trimmed.astype(np.float64) - flower_trimmed[i]).max() <= bound, t
    assert run.aggregate("trimmed-mean", step=step).params["trim"] == 0.2


@pytest.mark.parametrize(("method", "f", "keep"), [("krum", 2, None), ("multi-krum", 1, 3)])
def test_krum_and_multi_krum_select_exactly_and_match_flower(
    store: gp.Store, method: str, f: int, keep: int | None
) -> None:
    kwargs: dict[str, Any] = {"byzantine": f} | ({"keep": keep} if keep else {})
    report = gp.aggregate(store, run="r", method=method, **kwargs)
    assert report.ok, report.summary()
    run = gp.open_run(store, "r")
    for step in range(SEVEN.steps):
        peers, dumps = _dumps(store, step)
        names = list(dumps[0])
        m = keep or 1
        chosen = _krum_ref(_distances(dumps), f, m)
        found = run.aggregate(method, step=step)
        assert found.params["selected"] == [peers[i] for i in chosen]
        assert sorted(found.params["scores"]) == sorted(peers)
        weights = _num_examples(store, step, peers)
        results = [([d[t] for t in names], w) for d, w in zip(dumps, weights, strict=True)]
        flower = agg.aggregate_krum(results, num_malicious=f, to_keep=0 if m == 1 else m)
        for i, t in enumerate(names):
            got = found.read(t)
            if m == 1:  # the selected peer's update, bit for bit
                assert got.tobytes() == dumps[chosen[0]][t].tobytes()
                assert got.tobytes() == flower[i].tobytes()
                continue
            w = [weights[p] for p in chosen]
            ref = sum(wi * dumps[p][t].astype(np.float64) for wi, p in zip(w, chosen, strict=True))
            ref = ref / sum(w)
            assert (np.abs(got - ref) <= _ulp32(ref)).all(), t
            bound = _bound([dumps[p][t] for p in chosen], m)
            assert np.abs(got.astype(np.float64) - flower[i]).max() <= bound, t


def test_bulyan_selects_exactly_and_matches_flower(store: gp.Store) -> None:
    report = gp.aggregate(store, run="r", method="bulyan", byzantine=1)
    assert report.ok, report.summary()
    run = gp.open_run(store, "r")
    for step in range(SEVEN.steps):
        peers, dumps = _dumps(store, step)
        names = list(dumps[0])
        chosen = _bulyan_ref(_distances(dumps), 1)
        found = run.aggregate("bulyan", step=step)
        assert found.params["selected"] == [peers[i] for i in chosen]
        flower = agg.aggregate_bulyan(
            [([d[t] for t in names], 1) for d in dumps],
            num_malicious=1,
            aggregation_rule=agg.aggregate_krum,
            to_keep=0,
        )
        theta, beta = len(chosen), len(chosen) - 2
        for i, t in enumerate(names):
            got = found.read(t)
            stack = np.stack([dumps[p][t] for p in chosen]).astype(np.float64).reshape(theta, -1)
            dist = np.abs(stack - np.median(stack, axis=0))
            order = np.argsort(dist, axis=0, kind="stable")[:beta]
            ref = (np.take_along_axis(stack, order, axis=0).sum(axis=0) / beta).reshape(got.shape)
            assert (np.abs(got - ref) <= _ulp32(ref)).all(), t
            bound = _bound([dumps[p][t] for p in chosen], theta)
            assert np.abs(got.astype(np.float64) - flower[i]).max() <= bound, t


@pytest.mark.parametrize("method", ["median", "krum", "bulyan"])
def test_robust_results_do_not_depend_on_tree_or_chunk_grid(
    store: gp.Store, sample: SampleRun, tmp_path: Path, method: str
) -> None:
    kw: dict[str, Any] = {} if method == "median" else {"byzantine": 1}
    # A name keeps the method it was first given (another one needs force): one per method.
    name_a, name_b = f"{method}-grid-a", f"{method}-grid-b"
    a = gp.aggregate(store, run="r", method=method, name=name_a, split_every=2, force=True, **kw)
    b = gp.aggregate(store, run="r", method=method, name=name_b, split_every=16, **kw)
    assert a.ok
    assert b.ok
    run = gp.open_run(store, "r")
    for step in range(SEVEN.steps):  # the names differ, so the ids: compare the tensors
        x, y = run.aggregate(name_a, step=step), run.aggregate(name_b, step=step)
        assert x.manifest.tensors == y.manifest.tensors
        assert x.params == y.params
    other = _ingest(tmp_path / "other", sample.dump_pattern, chunk="16 KiB")
    gp.aggregate(other, run="r", method=method, name=name_a, **kw)
    for step in range(SEVEN.steps):
        x = gp.open_run(store, "r").aggregate(name_a, step=step)
        y = gp.open_run(other, "r").aggregate(name_a, step=step)
        assert x.params.get("selected") == y.params.get("selected")
        for t in x.names:
            assert x.read(t).tobytes() == y.read(t).tobytes()


def _store_files(store: gp.Store) -> list[str]:
    root = Path(store.url.removeprefix("file://"))
    return sorted(str(p) for p in root.rglob("*") if p.is_file() and "locks" not in p.parts)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"method": "krum", "byzantine": 3}, ["step 0", "krum", "f=3", "9 peers", "got 7"]),
        ({"method": "bulyan", "byzantine": 2}, ["step 0", "bulyan", "11 peers", "got 7"]),
        ({"method": "multi-krum", "byzantine": 1, "keep": 8}, ["step 0", "keep=8"]),
        ({"method": "krum", "byzantine": -1}, ["byzantine"]),
        ({"method": "krum", "weights": {"peer0": 1.0}}, ["unweighted"]),
        ({"method": "dp-fedavg", "clip_norm": 1.0, "trim": 0.1}, ["dp-fedavg", "trim"]),
        (
            {"method": "dp-fedavg", "clip_norm": 1.0, "target_quantile": 0.5},
            ["--adaptive-clip"],
        ),
        (
            {
                "method": "dp-fedavg",
                "clip_norm": 1.0,
                "noise_multiplier": 2.0,
                "adaptive_clip": True,
            },
            ["step 0", "--noise-multiplier"],
        ),
    ],
)
def test_bad_input_names_the_step_and_writes_nothing(
    sample: SampleRun, tmp_path: Path, kwargs: dict[str, Any], words: list[str]
) -> None:
    store = _ingest(tmp_path / "s", sample.dump_pattern)
    ref = store.refs.get("runs/r")
    files = _store_files(store)
    with pytest.raises(gp.InvalidInputError) as caught:
        gp.aggregate(store, run="r", **kwargs)
    for word in words:
        assert word in str(caught.value)
    assert store.refs.get("runs/r") == ref
    assert _store_files(store) == files


def _clipped_mean(dumps: list[dict[str, np.ndarray]], clip: float) -> dict[str, np.ndarray]:
    out = {}
    scales = []
    for d in dumps:
        norm = math.sqrt(sum(float(np.sum(a.astype(np.float64) ** 2)) for a in d.values()))
        scales.append(min(1.0, clip / norm))
    for t in dumps[0]:
        total = sum(s * d[t].astype(np.float64) for s, d in zip(scales, dumps, strict=True))
        out[t] = total / len(dumps)
    return out


def test_dp_fedavg_noise_has_the_stated_distribution(store: gp.Store) -> None:
    clip, z, n = 0.05, 1.0, SEVEN.peers
    std = z * clip / n
    _, dumps = _dumps(store, 1)
    ref = _clipped_mean(dumps, clip)
    residuals = []
    for seed in range(4):
        name = f"dp{seed}"
        report = gp.aggregate(
            store, run="r", method="dp-fedavg", name=name, clip_norm=clip, noise_multiplier=z,
            seed=seed, steps=[1],
        )  # fmt: skip
        assert report.ok, report.summary()
        found = gp.open_run(store, "r").aggregate(name, step=1)
        assert found.params["seed"] == seed
        assert found.params["clip_norm"] == clip
        residuals.append(np.concatenate([(found.read(t) - ref[t]).ravel() / std for t in ref]))
    total = np.concatenate(residuals)
    count = total.size
    assert count > 100_000
    # N(0, 1) per element: the mean within 5 standard errors, the variance within 5
    assert abs(float(total.mean())) < 5 / math.sqrt(count)
    assert abs(float(total.var()) - 1.0) < 5 * math.sqrt(2 / count)
    # different seeds: uncorrelated noise
    corr = float(np.corrcoef(residuals[0], residuals[1])[0, 1])
    assert abs(corr) < 5 / math.sqrt(residuals[0].size)


def test_dp_fedavg_seed_is_recorded_and_the_noise_ignores_the_chunk_grid(
    store: gp.Store, sample: SampleRun, tmp_path: Path
) -> None:
    kw: dict[str, Any] = {"method": "dp-fedavg", "clip_norm": 0.05, "noise_multiplier": 0.5}
    first = gp.aggregate(store, run="r", name="dp-picked", **kw)
    run = gp.open_run(store, "r")
    picked = run.aggregate("dp-picked", step=0).params["seed"]
    assert isinstance(picked, int)
    assert run.aggregate("dp-picked", step=1).params["seed"] == picked
    again = gp.aggregate(store, run="r", name="dp-picked", **kw)  # memoised: no new noise
    assert again.memoised == SEVEN.steps
    assert [s.aggregate for s in again.steps] == [s.aggregate for s in first.steps]
    # the same seed on another chunk grid: the same noise per element, the same bits
    other = _ingest(tmp_path / "other", sample.dump_pattern, chunk="16 KiB")
    gp.aggregate(other, run="r", name="dp-picked", seed=picked, **kw)
    for step in range(SEVEN.steps):
        x = run.aggregate("dp-picked", step=step)
        y = gp.open_run(other, "r").aggregate("dp-picked", step=step)
        for t in x.names:
            assert x.read(t).tobytes() == y.read(t).tobytes()
        # steps draw different noise
    x0, x1 = (run.aggregate("dp-picked", step=s) for s in (0, 1))
    t = x0.names[0]
    assert x0.read(t).tobytes() != x1.read(t).tobytes()


NORMS = [0.5 * (i + 1) for i in range(20)]  # the peers' update norms: 0.5 .. 10


@pytest.fixture(scope="module")
def norms_store(tmp_path_factory: pytest.TempPathFactory) -> gp.Store:
    """20 peers x 40 steps whose update norms are NORMS (in random directions)."""
    root = tmp_path_factory.mktemp("norms")
    rng = np.random.default_rng(0)
    for step in range(40):
        for p, norm in enumerate(NORMS):
            v = rng.standard_normal(8)
            v = (v / np.linalg.norm(v) * norm).astype(np.float32)
            path = root / "dumps" / f"step={step}" / f"peer={p:02d}.safetensors"
            path.parent.mkdir(parents=True, exist_ok=True)
            write_safetensors(str(path), {"w": v}, {})
    return _ingest(root / "store", str(root / "dumps/step={step}/peer={peer}.safetensors"))


def _clip_norms(store: gp.Store, name: str, steps: range) -> list[float]:
    run = gp.open_run(store, "r")
    return [float(run.aggregate(name, step=s).params["clip_norm_used"]) for s in steps]


@pytest.mark.parametrize("target", [0.25, 0.5, 0.9])
def test_adaptive_clipping_converges_to_the_target_quantile(
    norms_store: gp.Store, target: float
) -> None:
    kw: dict[str, Any] = {
        "method": "dp-fedavg",
        "clip_norm": 1.0,
        "noise_multiplier": 0.0,
        "adaptive_clip": True,
        "target_quantile": target,
        "seed": 1,
    }
    name = f"adaptive-{int(target * 100)}"
    report = gp.aggregate(norms_store, run="r", name=name, **kw)
    assert report.ok, report.summary()
    used = _clip_norms(norms_store, name, range(40))
    assert used[0] == 1.0
    # the last steps clip at the target quantile of the norms: the fraction of
    # updates under the clip norm is within one peer (1/n) of γ, up to the
    # oscillation of one geometric step (exp(η/2))
    for c in used[-10:]:
        below = sum(1 for v in NORMS if v <= c * math.exp(0.1)) / len(NORMS)
        above = sum(1 for v in NORMS if v <= c / math.exp(0.1)) / len(NORMS)
        assert above - 1 / len(NORMS) <= target <= below + 1 / len(NORMS), (c, used)
    # resuming in a second call starts from the recorded next clip norm: the same sequence
    gp.aggregate(norms_store, run="r", name=name + "-split", steps=range(15), **kw)
    gp.aggregate(norms_store, run="r", name=name + "-split", steps=range(15, 40), **kw)
    assert _clip_norms(norms_store, name + "-split", range(40)) == used


def test_adaptive_clipping_with_noise_converges(norms_store: gp.Store) -> None:
    report = gp.aggregate(
        norms_store, run="r", name="adaptive-noised", method="dp-fedavg", clip_norm=1.0,
        noise_multiplier=0.5, adaptive_clip=True, seed=3,
    )  # fmt: skip
    assert report.ok, report.summary()
    found = gp.open_run(norms_store, "r").aggregate("adaptive-noised", step=39)
    assert found.params["count_stddev"] == 1.0  # n/20
    assert found.params["update_noise_multiplier"] > 0.5
    used = _clip_norms(norms_store, "adaptive-noised", range(20, 40))
    # the median norm is 5.25; the noised count keeps the clip norm around it
    assert 3.0 < float(np.median(used)) < 8.0
