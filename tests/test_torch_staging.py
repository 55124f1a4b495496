"""save_state's staging buffers: reused by later saves, pinned for GPU tensors, never mixed up.

Every test runs on the CPU and, where a CUDA device is present, on it too; without one
the CUDA cases skip, saying so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import gradpipe as gp
from gradpipe.errors import InvalidInputError, NotFoundError

torch = pytest.importorskip("torch")
gpt = pytest.importorskip("gradpipe.torch")
nn = torch.nn

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(
            not torch.cuda.is_available(), reason="no CUDA device here: the GPU path is untested"
        ),
    ),
]


@pytest.fixture(autouse=True)
def _fresh_staging() -> Any:
    gpt.release_staging()
    yield
    gpt.release_staging()


def make(device: str, width: int = 64) -> tuple[Any, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width), nn.Linear(width, 8))
    model.register_buffer("scale", torch.rand(width).to(torch.bfloat16))
    model = model.to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model: Any, optimizer: Any, step: int) -> None:
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, model[0].in_features, generator=g).to(device)
    loss = (model(x) * model.scale.float().mean()).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def host_tensors(state: Any) -> dict[str, Any]:
    return {k: v.detach().cpu().clone() for k, v in state.items()}


def buffer_pointers() -> set[int]:
    return {b.data_ptr() for b in gpt._STAGING._buffers.values()}


@pytest.mark.parametrize("device", DEVICES)
def test_background_saves_reuse_their_buffers_and_keep_each_calls_values(
    tmp_path: Path, device: str
) -> None:
    store = gp.open_store(str(tmp_path / "store"), mode="w")
    model, opt = make(device)
    wanted, pointers = [], []
    for step in range(4):
        train_step(model, opt, step)
        wanted.append(host_tensors(model.state_dict()))
        gpt.save_state(store, "run", model, opt, step=step, blocking=False)
        pointers.append(buffer_pointers())
        train_step(model, opt, 100 + step)  # change everything while the save is writing
    gpt.release_staging()  # waits for the last write

    assert pointers[0], "a background save stages its tensors"
    assert all(p == pointers[0] for p in pointers), "later saves allocate new buffers"
    for step, want in enumerate(wanted):
        fresh, _ = make(device)
        gpt.load_state(store, "run", fresh, step=step)
        got = host_tensors(fresh.state_dict())
        assert list(got) == list(want)
        for key in want:
            assert torch.equal(got[key], want[key]), f"step {step}: {key} differs"


@pytest.mark.parametrize("device", DEVICES)
def test_a_state_of_other_shapes_gets_new_buffers(tmp_path: Path, device: str) -> None:
    store = gp.open_store(str(tmp_path / "store"), mode="w")
    small, small_opt = make(device, width=16)
    train_step(small, small_opt, 0)
    gpt.save_state(store, "small", small, small_opt, step=0, blocking=False).result()
    big, big_opt = make(device, width=32)
    train_step(big, big_opt, 0)
    want = host_tensors(big.state_dict())
    gpt.save_state(store, "big", big, big_opt, step=0, blocking=False).result()

    shapes = sorted(tuple(b.shape) for b in gpt._STAGING._buffers.values())
    assert (32, 32) in shapes
    assert (16, 16) not in shapes, "buffers of the previous state are kept"
    fresh, _ = make(device, width=32)
    gpt.load_state(store, "big", fresh)
    got = host_tensors(fresh.state_dict())
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_gpu_tensors_are_staged_in_page_locked_memory(tmp_path: Path) -> None:
    store = gp.open_store(str(tmp_path / "store"), mode="w")
    model, opt = make("cuda")
    train_step(model, opt, 0)
    gpt.save_state(store, "run", model, opt, step=0, blocking=False).result()
    # Keys end in the source's device kind: AdamW keeps its step counters on the CPU.
    staged = {key[-1]: [] for key in gpt._STAGING._buffers}
    for key, buffer in gpt._STAGING._buffers.items():
        staged[key[-1]].append(buffer)
    assert staged["cuda"], "the GPU tensors are staged"
    assert all(b.is_pinned() and b.device.type == "cpu" for b in staged["cuda"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_load_state_onto_the_gpu(tmp_path: Path) -> None:
    store = gp.open_store(str(tmp_path / "store"), mode="w")
    model, opt = make("cuda")
    train_step(model, opt, 0)
    want = host_tensors(model.state_dict())
    gpt.save_state(store, "run", model, opt, step=0)
    fresh, fresh_opt = make("cuda")
    gpt.load_state(store, "run", fresh, fresh_opt, map_location="cuda")
    assert all(v.device.type == "cuda" for v in fresh.state_dict().values())
    got = host_tensors(fresh.state_dict())
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_blocking_cpu_saves_read_in_place_and_stage_nothing(tmp_path: Path) -> None:
    store = gp.open_store(str(tmp_path / "store"), mode="w")
    model, opt = make("cpu")
    train_step(model, opt, 0)
    gpt.save_state(store, "run", model, opt, step=0)
    assert buffer_pointers() == set()


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")  # deprecated
@pytest.mark.parametrize("blocking", [True, False])
@pytest.mark.parametrize(
    "make_bad",
    [
        pytest.param(lambda: torch.zeros(4, 4).to_sparse(), id="sparse"),
        pytest.param(
            lambda: torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8), id="quantized"
        ),
        pytest.param(lambda: torch.ones(1, 4).expand(8, 4), id="expanded"),
    ],
)
def test_unstorable_tensors_are_refused_at_the_call_whether_blocking_or_not(
    tmp_path: Path, make_bad: Any, blocking: bool
) -> None:
    store = gp.open_store(str(tmp_path / "store"), mode="w")
    model, opt = make("cpu")
    model.register_buffer("bad", make_bad())
    with pytest.raises(InvalidInputError, match="bad"):
        gpt.save_state(store, "run", model, opt, step=0, blocking=blocking)
    with pytest.raises(NotFoundError):
        gp.snapshot_log(store, "run")  # nothing was written


def test_saves_from_two_threads_never_share_buffers(tmp_path: Path) -> None:
    """Two training threads saving at once: each snapshot holds its own thread's values."""
    import threading

    store = gp.open_store(str(tmp_path / "store"), mode="w")
    models = [make("cpu") for _ in range(2)]
    for i, (model, opt) in enumerate(models):
        train_step(model, opt, i)
    wanted = [host_tensors(m.state_dict()) for m, _ in models]
    futures: list[Any] = [None, None]
    start = threading.Barrier(2)

    def save(i: int) -> None:
        model, opt = models[i]
        start.wait()
        for step in range(3):
            futures[i] = gpt.save_state(store, f"run{i}", model, opt, step=step, blocking=False)

    threads = [threading.Thread(target=save, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    gpt.release_staging()
    for i in range(2):
        for step in range(3):
            fresh, _ = make("cpu")
            gpt.load_state(store, f"run{i}", fresh, step=step)
            got = host_tensors(fresh.state_dict())
            assert all(torch.equal(got[k], wanted[i][k]) for k in wanted[i]), (i, step)
