"""The PyTorch adapter: resuming training bit-exactly, background saves, space, errors."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

import gradpipe as gp
from gradpipe.errors import InvalidInputError, NotFoundError, ReadOnlyError

torch = pytest.importorskip("torch")
gpt = pytest.importorskip("gradpipe.torch")
nn = torch.nn

VOCAB, DIM = 256, 64  # the embedding and the output layer hold 64 KiB each: delta-eligible


@pytest.fixture(autouse=True)
def _deterministic() -> Iterator[None]:
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)


def make_model(seed: int) -> Any:
    """Embedding, LayerNorm and Linear, plus a bfloat16 parameter and a bfloat16 buffer."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Embedding(VOCAB, DIM), nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB))
    model.register_parameter("shift", nn.Parameter(torch.randn(VOCAB).to(torch.bfloat16)))
    model.register_buffer("scale", torch.rand(VOCAB).to(torch.bfloat16))
    return model


def make(seed: int) -> tuple[Any, Any]:
    model = make_model(seed)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def train_step(model: Any, optimizer: Any, step: int) -> float:
    """One step on a batch that depends on the step alone (not on the global RNG)."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (4, 6), generator=g)
    target = torch.randn(4, 6, VOCAB, generator=g)
    out = model[2](model[1](model[0](tokens))) * model.scale.float() + model.shift.float()
    loss = nn.functional.mse_loss(out, target)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return float(loss.item())


def assert_same(got: Any, want: Any, where: str = "state") -> None:
    """Nested states equal: tensors of the same dtype and shape, bit for bit."""
    assert type(got) is type(want), where
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype, where
        assert got.shape == want.shape, where
        assert torch.equal(got.cpu(), want.cpu()), where
    elif isinstance(want, dict):
        assert list(got) == list(want), where
        for k in want:
            assert_same(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, list | tuple):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_same(a, b, f"{where}[{i}]")
    else:
        assert got == want, where


def gate_writes(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Hold every background write until the returned event is set."""
    gate = threading.Event()
    real: Callable[..., str] = gpt.snapshot

    def gated(*args: Any, **kwargs: Any) -> str:
        assert gate.wait(60), "the test never opened the gate"
        return real(*args, **kwargs)

    monkeypatch.setattr(gpt, "snapshot", gated)
    return gate


def test_resumed_training_reaches_the_same_loss(tmp_path: Path) -> None:
    store = gp.open_store(str(tmp_path / "store"), mode="w")
    model, opt = make(seed=0)
    losses = []
    for step in range(8):
        losses.append(train_step(model, opt, step))
        gpt.save_state(store, "run", model, opt, step=step, loss=losses[-1])

    fresh, fresh_opt = make(seed=1)  # other initial values: loading must replace them all
    info = gpt.load_state(store, "run", fresh, fresh_opt, step=3)
    assert isinstance(info, gp.SnapshotInfo)
    assert (info.step, info.loss) == (3, losses[3])
    resumed = [train_step(fresh, fresh_opt, step) for step in range(4, 8)]

    assert [x.hex() for x in resumed] == [x.hex() for x in losses[4:]]
    assert_same(fresh.state_dict(), model.state_dict(), "model")
    assert_same(fresh_opt.state_dict(), opt.state_dict(), "optimizer")
    assert fresh.shift.dtype == fresh.scale.dtype == torch.bfloat16


def test_load_state_defaults_to_the_newest_and_the_model_alone(tmp_path: Path) -> None:
    store = gp.open_store(str(tmp_path / "store"), mode="w")
    model, opt = make(seed=0)
    for step in (10, 20):
        train_step(model, opt, step)
        gpt.save_state(store, "run", model, opt, step=step)
    fresh = make_model(seed=1)
    info = gpt.load_state(store, "run", fresh)  # no optimizer: its chunks are not read
    assert info.step == 20
    assert info.id == gp.snapshot_log(store, "run")[-1].id
    assert_same(fresh.state_dict(), model.state_dict(), "model")

    # Built on the meta device, the model gets the loaded tensors as its parameters.
    with torch.device("meta"):
        empty = make_model(seed=2)
    gpt.load_state(store, "run", empty, map_location="cpu", assign=True)
    assert_same(empty.state_dict(), model.state_dict(), "model")


def test_a_model_saved_without_optimizer_refuses_one(tmp_path: Path) -> None:
    store = gp.open_store(str(tmp_path / "store"), mode="w")
    model, _ = make(seed=0)
    gpt.save_state(store, "run", model, None, step=0)
    assert set(gp.restore(store, "run")) == {"model"}
    fresh, fresh_opt = make(seed=1)
    with pytest.raises(NotFoundError, match="optimizer"):
        gpt.load_state(store, "run", fresh, fresh_opt)


def test_background_save_keeps_the_values_of_the_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = gp.open_store(str(tmp_path / "store"), mode="w")
    model, opt = make(seed=0)
    train_step(model, opt, 0)
    want_model = copy.deepcopy(model.state_dict())
    want_opt = copy.deepcopy(opt.state_dict())
    gate = gate_writes(monkeypatch)

    future = gpt.save_state(store, "run", model, opt, step=0, blocking=False)
    assert isinstance(future, Future)
    assert not future.done()
    train_step(model, opt, 1)  # changes parameters and Adam's moments in place
    assert not torch.equal(model[2].weight, want_model["2.weight"])
    gate.set()

    assert future.result() == gp.snapshot_log(store, "run")[0].id
    fresh, fresh_opt = make(seed=1)
    gpt.load_state(store, "run", fresh, fresh_opt)
    assert_same(fresh.state_dict(), want_model, "model")
    assert_same(fresh_opt.state_dict(), want_opt, "optimizer")


def test_saves_land_in_the_order_they_were_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second save waits for the first: one pending host copy at most, saves in order."""
    store = gp.open_store(str(tmp_path / "store"), mode="w")
    model, opt = make(seed=0)
    gate = gate_writes(monkeypatch)
    first = gpt.save_state(store, "run", model, opt, step=1, blocking=False)
    train_step(model, opt, 1)
    opener = threading.Timer(0.05, gate.set)
    opener.start()
    second = gpt.save_state(store, "run", model, opt, step=2, blocking=False)
    assert first.done()  # the second call waited for it before copying its own state
    train_step(model, opt, 2)
    third = gpt.save_state(store, "run", model, opt, step=3)
    opener.join()
    assert second.done()
    log = gp.snapshot_log(store, "run")
    assert [i.step for i in log] == [1, 2, 3]
    assert [i.id for i in log] == [first.result(), second.result(), third]


def test_a_save_from_the_writer_thread_is_refused(tmp_path: Path) -> None:
    store = gp.open_store(str(tmp_path / "store"), mode="w")
    model, opt = make(seed=0)
    errors: list[BaseException] = []

    def again(_: object) -> None:
        try:
            gpt.save_state(store, "run", model, opt, step=2, blocking=False)
        except InvalidInputError as exc:
            errors.append(exc)

    future = gpt.save_state(store, "run", model, opt, step=1, blocking=False)
    future.add_done_callback(again)
    future.result()
    gpt.save_state(store, "run", model, opt, step=3)  # the writer is still alive
    assert errors
    assert "wait for itself" in str(errors[0])


def test_a_failed_background_save_raises_from_its_future(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    gp.open_store(url, mode="w")
    model, opt = make(seed=0)
    future = gpt.save_state(gp.open_store(url, mode="r"), "run", model, opt, step=0, blocking=False)
    with pytest.raises(ReadOnlyError, match="read-only"):
        future.result()
    # The writer thread survives the failure.
    writable = gp.open_store(url, mode="a")
    assert gpt.save_state(writable, "run", model, opt, step=0, blocking=False).result()
    assert [i.step for i in gp.snapshot_log(writable, "run")] == [0]


def test_an_unstorable_tensor_is_refused_at_the_call(tmp_path: Path) -> None:
    store = gp.open_store(str(tmp_path / "store"), mode="w")
    model = make_model(seed=0)
    model.register_buffer("phase", torch.zeros(3, dtype=torch.complex64))
    with pytest.raises(InvalidInputError, match="phase"):
        gpt.save_state(store, "run", model, step=0, blocking=False)


def test_a_chain_of_steps_takes_less_than_full_copies(tmp_path: Path) -> None:
    store = gp.open_store(str(tmp_path / "store"), mode="w")
    model, opt = make(seed=0)
    for step in range(6):
        train_step(model, opt, step)
        gpt.save_state(store, "run", model, opt, step=step)
    log = gp.snapshot_log(store, "run")
    assert [i.step for i in log] == list(range(6))
    assert all(i.ratio < 0.9 for i in log[1:]), [round(i.ratio, 3) for i in log]
    assert sum(i.stored_bytes for i in log) < 0.9 * sum(i.full_bytes for i in log)


def test_a_save_run_again_records_its_step_once(tmp_path: Path) -> None:
    """A job killed after its save landed saves the step again on restart: no new version."""
    store = gp.open_store(str(tmp_path / "store"), mode="w")
    model, opt = make(seed=0)
    loss = train_step(model, opt, 0)
    first = gpt.save_state(store, "run", model, opt, step=0, loss=loss)
    assert gpt.save_state(store, "run", model, opt, step=0, loss=loss) == first
    again = gpt.save_state(store, "run", model, opt, step=0, loss=loss, blocking=False)
    assert again.result() == first
    assert [i.id for i in gp.snapshot_log(store, "run")] == [first]
    train_step(model, opt, 1)  # other values at the same step: a new version, as before
    assert gpt.save_state(store, "run", model, opt, step=0, loss=loss) != first
    assert [i.step for i in gp.snapshot_log(store, "run")] == [0, 0]


def test_background_saves_round_trip_on_every_store(store: gp.Store) -> None:
    model, opt = make(seed=0)
    futures = []
    for step in range(3):
        train_step(model, opt, step)
        futures.append(gpt.save_state(store, "run", model, opt, step=step, blocking=False))
    ids = [f.result() for f in futures]
    assert [i.id for i in gp.snapshot_log(store, "run")] == ids
    fresh, fresh_opt = make(seed=1)
    assert gpt.load_state(store, "run", fresh, fresh_opt).id == ids[-1]
    assert_same(fresh.state_dict(), model.state_dict(), "model")
    assert_same(fresh_opt.state_dict(), opt.state_dict(), "optimizer")
    assert train_step(fresh, fresh_opt, 3).hex() == train_step(model, opt, 3).hex()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_gets_its_own_writer(tmp_path: Path) -> None:
    """A child forked after a background save inherits no writer thread: it must start one."""
    code = textwrap.dedent(
        f"""
        import os, torch, gradpipe as gp
        from gradpipe.torch import save_state
        model, store = torch.nn.Linear(3, 2), gp.open_store({str(tmp_path / "s")!r}, mode="w")
        save_state(store, "parent", model, step=0, blocking=False).result()
        pid = os.fork()
        if pid == 0:
            save_state(store, "child", model, step=1, blocking=False).result()
            os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0
        """
    )
    # The timeout only ends a hang (the failure this guards against); nothing is timed.
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    store = gp.open_store(str(tmp_path / "s"), mode="r")
    assert [i.step for i in gp.snapshot_log(store, "child")] == [1]
