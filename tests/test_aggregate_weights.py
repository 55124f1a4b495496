"""``gp.aggregate`` and ``gradpipe aggregate`` with extreme weights and results that do not fit.

Issue 18, item 2: through the store and the graph (the one-task reduction, the
tree of partials with a small ``split_every``, Multi-Krum's FedAvg of the kept
peers), weights from ``num_examples`` or ``--weights`` anywhere in float64's
range give the weighted mean; a ``sum`` beyond the output dtype fails the step
with the tensor, chunk and element named, and the CLI exits 1.
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import dask.config
import numpy as np
import pytest

import gradpipe as gp
from gradpipe.aggregation.reduce import reduce_peers
from gradpipe.cli.testing import run_cli, run_cli_json
from gradpipe.formats.safetensors import write_safetensors

PEERS = ("a", "b", "c")


def _run(
    tmp_path: Path, arrays: dict[str, np.ndarray], meta: dict[str, str] | None = None
) -> gp.Store:
    """One step (3) of one tensor 'w' per peer; chunks of 64 bytes, so several per tensor."""
    for peer, array in arrays.items():
        path = tmp_path / "dumps" / f"step=3/peer={peer}.safetensors"
        path.parent.mkdir(parents=True, exist_ok=True)
        extra = {"num_examples": meta[peer]} if meta and peer in meta else {}
        write_safetensors(str(path), {"w": array}, extra)
    store = gp.open_store(tmp_path / "store", mode="a")
    pattern = str(tmp_path / "dumps/step={step}/peer={peer}.safetensors")
    with dask.config.set({"gradpipe.chunk-bytes": "64 B"}):
        assert gp.ingest(store, pattern, run="r").ok
    return store


def _arrays(dtype: str = "float32", size: int = 40) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    return {p: rng.standard_normal(size).astype(dtype) for p in PEERS}


def _exact_mean(arrays: dict[str, np.ndarray], weights: dict[str, float]) -> np.ndarray:
    total = sum(Fraction(weights[p]) for p in PEERS)
    share = {p: Fraction(weights[p]) / total for p in PEERS}
    return np.array(
        [
            float(sum(share[p] * Fraction(float(arrays[p][j])) for p in PEERS))
            for j in range(arrays["a"].size)
        ]
    )


@pytest.mark.parametrize(
    "num_examples",
    [
        {"a": "5e-324", "b": "1e-323", "c": "1.5e-323"},  # subnormal: every product underflowed
        {"a": "1e-320", "b": "5e-324", "c": "3e-321"},
        {"a": "1e300", "b": "1.7976931348623157e308", "c": "1e308"},  # the total overflowed
        {"a": "1e-300", "b": "1e300", "c": "1"},
    ],
)
@pytest.mark.parametrize("split_every", [2, 8])
def test_fedavg_of_extreme_num_examples_is_the_weighted_mean(
    tmp_path: Path, num_examples: dict[str, str], split_every: int
) -> None:
    arrays = _arrays()
    store = _run(tmp_path, arrays, num_examples)
    report = gp.aggregate(store, run="r", method="fedavg", split_every=split_every)
    assert report.ok, report.steps
    got = gp.open_run(store, "r").aggregate("fedavg", step=3).read("w")
    weights = {p: float(v) for p, v in num_examples.items()}
    # the graph's bits are the core's, for a tree of partials (split_every 2) as in one task
    want = reduce_peers([arrays[p] for p in PEERS], weights=[weights[p] for p in PEERS])
    assert got.tobytes() == want.tobytes()
    exact = _exact_mean(arrays, weights)
    ulp = np.spacing(np.abs(exact).astype(np.float32)).astype(np.float64)
    assert (np.abs(got.astype(np.float64) - exact) <= ulp).all()


def test_multi_krum_averages_the_kept_peers_with_extreme_weights(tmp_path: Path) -> None:
    arrays = _arrays()
    store = _run(tmp_path, arrays)
    weights = {"a": 5e-324, "b": 1e-323, "c": 1.5e-323}
    report = gp.aggregate(store, run="r", method="multi-krum", byzantine=0, weights=weights)
    assert report.ok, report.steps
    got = gp.open_run(store, "r").aggregate("multi-krum", step=3).read("w")
    exact = _exact_mean(arrays, weights)  # keep = n - f = every peer
    ulp = np.spacing(np.abs(exact).astype(np.float32)).astype(np.float64)
    assert (np.abs(got.astype(np.float64) - exact) <= ulp).all()


def test_num_examples_beyond_float64_are_refused_as_written(tmp_path: Path) -> None:
    store = _run(tmp_path, _arrays(), {"a": "3", "b": "1e-400", "c": "3"})
    with pytest.raises(gp.InvalidInputError) as caught:
        gp.aggregate(store, run="r", method="fedavg")
    assert "step 3, peer 'b': num_examples '1e-400' is outside float64's range" in str(caught.value)


@pytest.mark.parametrize("split_every", [2, 8])
def test_a_sum_beyond_float16_fails_the_step_naming_tensor_chunk_and_element(
    tmp_path: Path, split_every: int
) -> None:
    arrays = {p: np.full(40, 1.0, np.float16) for p in PEERS}
    arrays["b"][37] = 60000.0  # with a and c (1 each): 60002, which fits float16
    arrays["c"][37] = 30000.0  # 90001 does not (65504 at most)
    store = _run(tmp_path, arrays)
    before = store.refs.get("runs/r")
    report = gp.aggregate(store, run="r", method="sum", split_every=split_every)
    assert not report.ok
    [step] = report.steps
    assert step.status == "failed"
    assert "tensor 'w' of step 3, chunk 1" in step.reason  # 64-byte chunks: 32 float16 each
    assert "element 5 of the result is 90001, beyond float16's largest finite value" in (
        step.reason
    )
    assert store.refs.get("runs/r") == before
    mean = gp.aggregate(store, run="r", method="mean")
    assert mean.ok  # the mean of the same updates fits
    assert gp.open_run(store, "r").aggregate("mean", step=3).read("w")[37] == np.float16(30000.3)


def test_the_cli_exits_1_on_a_result_that_does_not_fit_and_takes_tiny_weights(
    tmp_path: Path,
) -> None:
    arrays = {p: np.full(8, 40000.0, np.float16) for p in PEERS}
    _run(tmp_path, arrays)
    url = str(tmp_path / "store")
    outcome = run_cli("aggregate", url, "--run", "r", "--method", "sum")
    assert outcome.status == 1
    assert "element 0 of the result is 120000, beyond float16's" in outcome.out + outcome.err
    status, doc = run_cli_json(
        "aggregate", url, "--run", "r", "--method", "weighted-mean",
        "--weights", '{"a": 5e-324, "b": 1e-323, "c": 1e-320}',
    )  # fmt: skip
    assert status == 0, doc
    got = gp.open_run(gp.open_store(url), "r").aggregate("weighted-mean", step=3).read("w")
    assert got.tolist() == [40000.0] * 8  # was 0: every product underflowed
    outcome = run_cli(
        "aggregate", url, "--run", "r", "--method", "weighted-mean",
        "--weights", '{"a": 1e-400, "b": 1, "c": 1}',
    )  # fmt: skip
    assert outcome.status == 2
    assert "peer 'a': weight '1e-400' is outside float64's range" in outcome.err


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ('{"a": 1' + "0" * 400 + "}", "peer 'a': weight '10000000000000000000...0000000000' is"),
        ('{"a": 1e400}', "peer 'a': weight '1e400' is outside float64's range"),
        ('{"a": 2, "b": 1e-400}', "peer 'b': weight '1e-400' is outside float64's range"),
        ('{"a": "3"}', "peer 'a' has weight '3', not a number"),
        ('{"a": NaN}', "peer 'a' has weight nan, not a number"),
        ('{"a": 0}', "peer 'a' has weight 0.0; weights must be finite and > 0"),
    ],
)
def test_weights_beyond_float64_are_refused_as_written(text: str, words: str) -> None:
    from gradpipe.cli.aggregate import parse_weights_arg

    with pytest.raises(gp.InvalidInputError) as caught:
        parse_weights_arg(text)
    assert words in str(caught.value)
    assert parse_weights_arg('{"a": 5e-324, "b": 1.7976931348623157e308}') == {
        "a": 5e-324,
        "b": 1.7976931348623157e308,
    }


def test_python_weights_beyond_float64_are_refused_naming_the_peer(tmp_path: Path) -> None:
    store = _run(tmp_path, _arrays())
    with pytest.raises(gp.InvalidInputError, match=r"step 3, peer 'b': weight 1000.* float64"):
        gp.aggregate(store, run="r", method="fedavg", weights={"a": 1, "b": 10**400, "c": 1})


_CONTEXT = "aggregate 'robust' of tensor 'w' of step 3, chunk 0"
_OVERFLOW = "element 0 of the result is inf in float64 (the float64 computation overflows)"


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize(
    ("method", "peers"),
    [("median", 4), ("trimmed-mean", 3), ("bulyan", 3), ("multi-krum", 3)],
)
def test_a_robust_result_beyond_float64_names_step_tensor_and_chunk_once(
    monkeypatch: pytest.MonkeyPatch, method: str, peers: int
) -> None:
    """The chunk's context leads the refusal once, as ``write_chunk``'s does (no ``tensor "…"``)."""
    from gradpipe.aggregation import robust_tasks
    from gradpipe.aggregation.result_range import round_result
    from gradpipe.aggregation.tasks import StepFailure

    chunks = [np.full(4, 1.7e308 - i * 1e307) for i in range(peers)]  # sums beyond float64
    monkeypatch.setattr(robust_tasks, "read_group", lambda *args: chunks)
    monkeypatch.setattr(robust_tasks, "_read", lambda store, source, *args: chunks[source])
    if method == "multi-krum":  # its FedAvg is exact and fits: the refusal comes from finish
        monkeypatch.setattr(
            robust_tasks, "finish", lambda *args, **kwargs: round_result(np.array([np.inf]))
        )
    contexts = [f"peer {p}" for p in range(peers)]
    if method in ("median", "trimmed-mean"):
        failure = robust_tasks.robust_chunk(
            3, None, [[]] * peers, 0, 4, "float64", contexts, method, 0.0, _CONTEXT
        )
    else:
        everyone = tuple(range(peers))
        selection = robust_tasks.Selection(everyone, tuple(map(str, everyone)), (0.0,) * peers)
        failure = robust_tasks.selected_chunk(
            3, None, list(everyone), 0, 4, "float64", contexts, selection, method, 0,
            [1.0] * peers, _CONTEXT,
        )  # fmt: skip
    assert isinstance(failure, StepFailure)
    assert failure.reason.startswith(f"{_CONTEXT}: {_OVERFLOW}"), failure.reason
    assert failure.reason.count("tensor") == 1
