"""PyTorch adapter: a model's and optimizer's state as snapshots, saved in the background.

>>> import gradpipe as gp                                              # doctest: +SKIP
>>> from gradpipe.torch import load_state, save_state                  # doctest: +SKIP
>>> store = gp.open_store("s3://bucket/ckpt", mode="a")                # doctest: +SKIP
>>> for step in range(start, steps):                                   # doctest: +SKIP
...     loss = train_step(model, optimizer)
...     save_state(store, "run1", model, optimizer, step=step, loss=loss.item(), blocking=False)
>>> info = load_state(store, "run1", model, optimizer)                 # doctest: +SKIP
>>> start = info.step + 1                                              # doctest: +SKIP

:func:`save_state` writes ``{"model": model.state_dict(), "optimizer":
optimizer.state_dict()}`` with :func:`gradpipe.snapshot`: every snapshot of a
name is stored as deltas against the previous one, so keeping every step
costs a fraction of a full checkpoint each. ``blocking=False`` works like
``torch.distributed.checkpoint.async_save``: the state is copied to host
memory during the call (the next ``optimizer.step()`` changes the parameters
in place) and written by one background thread, which writes the saves of
this process one after another, in the order they were asked for. Saves still
pending when the interpreter exits are finished first.

Host copies go into staging buffers that later saves of the same state reuse
(page-locked for GPU tensors), so a save allocates nothing once the first one
is made. A GPU tensor is copied by a non-blocking device-to-host copy on a
side stream that waits for the training stream's work so far; the call waits
once for all of them, so the training loop is held only for the copies.
The buffers hold one state: saving states of other shapes in turn (two
models from one process) allocates them anew each time. Tensors are checked
before they are copied (sparse, quantized and storage-repeating tensors are
refused at the call, as a blocking save refuses them). :func:`release_staging`
gives the buffers back.

torch is an optional dependency (the ``torch`` extra); ``import gradpipe``
does not import this module.
"""

from __future__ import annotations

import itertools
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any, Literal, overload

from gradpipe.core.chain import DEFAULT_KEYFRAME_INTERVAL
from gradpipe.core.display import printable
from gradpipe.errors import InvalidInputError
from gradpipe.formats.state_file import check_torch, from_torch, to_torch
from gradpipe.snapshots.api import SnapshotInfo, find_snapshot, snapshot
from gradpipe.snapshots.replay_plan import (
    DEFAULT_REPLAY_INTERVAL,
    OptimizerGroup,
    torch_groups,
)
from gradpipe.snapshots.restore import restore_manifest

if TYPE_CHECKING:
    import torch

    from gradpipe.storage.store import Store

__all__ = ["load_state", "release_staging", "replay_groups", "save_state"]


class _Writer:
    """One writer thread per process, so saves land in the order they were made.

    At most one save is pending: a new save first waits for the one before it
    (as torch's async checkpointing does), so host copies of the state never
    pile up when writing is slower than training.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid = -1
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future[str] | None = None

    def executor(self) -> ThreadPoolExecutor:
        with self._lock:
            # A forked child inherits the parent's executor without its thread: start anew.
            if self._executor is None or self._pid != os.getpid():
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="gradpipe-save")
                self._pid = os.getpid()
                self._pending = None
            return self._executor

    def wait_for_pending(self) -> None:
        """Wait until the previous save finished (its error stays with its future)."""
        if threading.current_thread().name.startswith("gradpipe-save"):
            raise InvalidInputError(
                "save_state called from the background writer (a future's callback?) would "
                "wait for itself; call it from the training thread"
            )
        pending = self._pending if self._pid == os.getpid() else None
        if pending is not None:
            wait([pending])

    def submit(self, future_of: Callable[[ThreadPoolExecutor], Future[str]]) -> Future[str]:
        future = future_of(self.executor())
        self._pending = future
        return future


_WRITER = _Writer()


@overload
def save_state(
    store: Store,
    name: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = ...,
    *,
    step: int,
    loss: float | None = ...,
    metadata: Mapping[str, str] | None = ...,
    blocking: Literal[True] = ...,
    delta: str = ...,
    threshold: float = ...,
    keyframe_interval: int = ...,
    gradients: bool = ...,
    replay_interval: int = ...,
) -> str: ...
@overload
def save_state(
    store: Store,
    name: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = ...,
    *,
    step: int,
    loss: float | None = ...,
    metadata: Mapping[str, str] | None = ...,
    blocking: Literal[False],
    delta: str = ...,
    threshold: float = ...,
    keyframe_interval: int = ...,
    gradients: bool = ...,
    replay_interval: int = ...,
) -> Future[str]: ...
def save_state(
    store: Store,
    name: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    step: int,
    loss: float | None = None,
    metadata: Mapping[str, str] | None = None,
    blocking: bool = True,
    delta: str = "int",
    threshold: float = 0.0,
    keyframe_interval: int = DEFAULT_KEYFRAME_INTERVAL,
    gradients: bool = False,
    replay_interval: int = DEFAULT_REPLAY_INTERVAL,
) -> str | Future[str]:
    """Save a model's and optimizer's state as the next snapshot of ``name``.

    Parameters
    ----------
    store : Store
        A writable store.
    name : str
        The snapshot chain (see :func:`gradpipe.snapshot`).
    model : torch.nn.Module
        Saved as ``state["model"] = model.state_dict()``, on any device.
    optimizer : torch.optim.Optimizer, optional
        Saved as ``state["optimizer"]``; omitted when None.
    step : int
        The training step; ``load_state(step=...)`` finds it.
    loss : float, optional
        Shown by ``gradpipe log``.
    metadata : mapping of str to str, optional
        Free-form string fields.
    blocking : bool
        If False, return once the state is copied to host memory and write it
        in the background; the parameters may be changed right away.
    delta, threshold, keyframe_interval
        Passed to :func:`gradpipe.snapshot`.
    gradients : bool
        Record the gradients the last ``optimizer.step()`` applied (each parameter's
        ``.grad``, after clipping and unscaling, so call this before ``zero_grad``) and
        store the parameters and the optimizer's moments as residuals against that step
        replayed from the previous snapshot (design note 016): mostly nothing. The
        learning rate each step applied is recorded by a hook installed on the optimizer
        at the first such save, before a scheduler moves it. Adam, AdamW and SGD are
        replayed; the gradients are kept with the snapshot (``gradpipe log`` shows their
        bytes apart). :func:`load_state` is unchanged.
    replay_interval : int
        With ``gradients``, a parameter is stored self-contained again every this many
        snapshots (a load replays at most ``replay_interval - 1`` steps).

    Returns
    -------
    str or concurrent.futures.Future of str
        The snapshot id, or (``blocking=False``) a future of it whose
        ``result()`` raises what the write raised.

    Raises
    ------
    InvalidInputError
        At the call, for a tensor gradpipe cannot store (sparse, quantized, an
        unsupported dtype), naming it.

    Examples
    --------
    >>> future = save_state(store, "run1", model, opt, step=7, blocking=False)  # doctest: +SKIP
    >>> opt.step()  # safe: the save holds its own copy                        # doctest: +SKIP
    >>> future.result()                                                         # doctest: +SKIP
    'b3f1...'
    """
    state: dict[str, Any] = {"model": model.state_dict()}
    if optimizer is not None:
        state["optimizer"] = optimizer.state_dict()
    where = f"save_state {printable(name)}"
    replay: dict[str, Any] = {}
    if gradients:
        if optimizer is None:
            raise InvalidInputError(f"{where}: gradients=True needs the optimizer")
        groups, grads = replay_groups(model, optimizer)
        state["__gradients__"] = grads  # staged with the state, split off below
        replay = {"optimizer": groups, "replay_interval": replay_interval}
    check_torch(state, path=where)  # as the tensors are: a copy must not densify a bad one
    # One save at a time stages and submits: the previous save has finished (waited for
    # here, under the lock, so no other thread's save slips in between), so its staging
    # buffers are free to reuse.
    with _SAVING:
        _WRITER.wait_for_pending()
        # A blocking save may read CPU tensors in place: the caller waits for it.
        host = from_torch(_STAGING.stage(state, copy=not blocking), path=where)
        if gradients:
            replay["gradient"] = host.pop("__gradients__")
        future = _WRITER.submit(
            lambda executor: executor.submit(
                snapshot,
                store,
                name,
                host,
                step=step,
                loss=loss,
                metadata=metadata,
                delta=delta,
                threshold=threshold,
                keyframe_interval=keyframe_interval,
                **replay,
            )
        )
    return future if not blocking else future.result()


def replay_groups(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[list[OptimizerGroup], dict[str, torch.Tensor]]:
    """The optimizer's groups as a replay names them, and the gradients its last step applied.

    Parameters are matched to their names by identity (``model.named_parameters()``) and to
    their state by the numbering ``optimizer.state_dict()`` uses. A parameter without a
    gradient or without state yet is left out (it is then stored as usual).
    """
    kind = _replay_kind(optimizer)
    names = {id(p): n for n, p in model.named_parameters()}
    applied = _APPLIED_LR.get(optimizer)
    if optimizer not in _HOOKED:  # from now on, each step's learning rate is recorded
        optimizer.register_step_post_hook(_record_lr)
        _HOOKED.add(optimizer)
    groups: list[OptimizerGroup] = []
    grads: dict[str, torch.Tensor] = {}
    index = 0
    for g, group in enumerate(optimizer.param_groups):
        by_count: dict[int, dict[str, dict[str, str]]] = {}
        for p in group["params"]:
            i, index = index, index + 1
            name, entry = names.get(id(p)), optimizer.state.get(p)
            stateless = kind == "sgd" and not group.get("momentum")  # plain SGD keeps none
            if name is None or p.grad is None or p.grad.is_sparse or not (entry or stateless):
                continue
            entry = entry or {}
            count = int(entry["step"]) if "step" in entry else 1
            arrays = {"param": f"model.{name}"}
            arrays.update(
                {r: f"optimizer.state.{i}.{r}" for r, v in entry.items() if _is_role(r, v)}
            )
            by_count.setdefault(count, {})[name] = arrays
            grads[name] = p.grad
        hyper = dict(group)
        if applied is not None and g < len(applied):
            hyper["lr"] = applied[g]
        groups += torch_groups(kind, hyper, by_count)
    return groups, grads


def _is_role(name: str, value: Any) -> bool:
    """Whether a parameter's state entry is a replayed array (not the count, not a None)."""
    return name != "step" and value is not None


#: The learning rate of each group at each optimizer's last step (a scheduler moves it after).
_APPLIED_LR: weakref.WeakKeyDictionary[Any, list[float]] = weakref.WeakKeyDictionary()
#: The optimizers whose steps are hooked (once each).
_HOOKED: weakref.WeakSet[Any] = weakref.WeakSet()


def _record_lr(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    _APPLIED_LR[optimizer] = [float(group["lr"]) for group in optimizer.param_groups]


def _replay_kind(optimizer: torch.optim.Optimizer) -> str:
    import torch

    if isinstance(optimizer, torch.optim.AdamW):
        return "adamw"
    if isinstance(optimizer, torch.optim.Adam):
        decoupled = any(g.get("decoupled_weight_decay") for g in optimizer.param_groups)
        return "adamw" if decoupled else "adam"
    if isinstance(optimizer, torch.optim.SGD):
        return "sgd"
    raise InvalidInputError(
        f"gradients=True replays Adam, AdamW and SGD; {type(optimizer).__name__} is not "
        "replayed (save without gradients)"
    )


def load_state(
    store: Store,
    name: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    step: int | None = None,
    map_location: str | torch.device | None = None,
    strict: bool = True,
    assign: bool = False,
) -> SnapshotInfo:
    """Load a snapshot saved by :func:`save_state` into a model and optimizer.

    Parameters
    ----------
    store : Store
    name : str
    model : torch.nn.Module
        Gets ``model.load_state_dict(...)``; values are copied into its
        parameters and buffers on their device.
    optimizer : torch.optim.Optimizer, optional
        Gets ``optimizer.load_state_dict(...)`` (torch moves each state to its
        parameter's device). When None, only the model's chunks are read.
    step : int, optional
        The snapshot at this step; the newest by default.
    map_location : str or torch.device, optional
        Move the model's tensors here before loading (with ``assign=True``
        they become the parameters); by default they stay in host memory.
    strict, assign : bool
        Passed to ``model.load_state_dict``.

    Returns
    -------
    SnapshotInfo
        The snapshot loaded: ``info.step``, ``info.loss``, ``info.id``...

    Raises
    ------
    NotFoundError
        If there is no snapshot ``name`` (at ``step``), or it holds no
        optimizer state and ``optimizer`` was given.

    Examples
    --------
    >>> info = load_state(store, "run1", model, opt)  # doctest: +SKIP
    >>> start = info.step + 1                          # doctest: +SKIP
    """
    snapshot_id, manifest = find_snapshot(store, name, step)
    keys = ["model"] if optimizer is None else ["model", "optimizer"]
    # One manifest for the read and the answer, even if a save lands meanwhile.
    state = restore_manifest(store, manifest, keys=keys, snapshot_id=snapshot_id)
    model_state = to_torch(state["model"])
    if map_location is not None:
        model_state = _to_device(model_state, map_location)
    model.load_state_dict(model_state, strict=strict, assign=assign)
    if optimizer is not None:
        optimizer.load_state_dict(to_torch(state["optimizer"]))
    return SnapshotInfo.of(snapshot_id, manifest)


class _Staging:
    """Host buffers for the tensors of a save, reused by the next save of the same shapes.

    Buffers are keyed by a tensor's place in the state (its order in the walk),
    dtype, shape and device kind; a save of other shapes replaces them, so they
    never hold more than one state. GPU tensors land in page-locked memory,
    copied on one side stream per device and waited for once.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}

    def stage(self, state: Any, *, copy: bool) -> Any:
        """``state`` with every tensor in host memory (CPU tensors copied if ``copy``)."""
        import torch

        with self._lock:
            old, self._buffers = self._buffers, {}
            streams: dict[torch.device, torch.cuda.Stream] = {}
            position = itertools.count()

            def move(t: torch.Tensor) -> torch.Tensor:
                t = t.detach()
                if t.device.type == "cpu" and not copy:
                    return t
                key = (next(position), t.dtype, tuple(t.shape), t.device.type)
                buffer = old.pop(key, None)
                if buffer is None:
                    buffer = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.device.type == "cuda")
                self._buffers[key] = buffer
                if t.device.type != "cuda":
                    buffer.copy_(t)
                    return buffer
                stream = streams.get(t.device)
                if stream is None:
                    stream = streams[t.device] = torch.cuda.Stream(t.device)
                    # The copies must see what the training stream has queued so far.
                    stream.wait_stream(torch.cuda.current_stream(t.device))
                with torch.cuda.stream(stream):
                    buffer.copy_(t, non_blocking=True)
                return buffer

            try:
                host = _map_tensors(state, move)
            finally:
                for stream in streams.values():
                    stream.synchronize()
            return host

    def release(self) -> None:
        with self._lock:
            self._buffers = {}


_STAGING = _Staging()
#: Held from the wait for the previous save to the submit of the next (see save_state).
_SAVING = threading.Lock()


def _after_fork_in_child() -> None:
    # A lock held by a parent's thread is never released here, and pinned buffers belong
    # to the parent's CUDA context: the child starts with its own.
    global _STAGING, _SAVING
    _STAGING, _SAVING = _Staging(), threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def release_staging() -> None:
    """Give back the host buffers :func:`save_state` keeps for the next save.

    Waits for a background save still writing from them first.
    """
    with _SAVING:
        _WRITER.wait_for_pending()
        _STAGING.release()


def _to_device(obj: Any, device: str | torch.device) -> Any:
    return _map_tensors(obj, lambda t: t.to(device))


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """A copy of a nested state (as :func:`from_torch` walks it) with ``fn`` on each tensor."""
    import torch

    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if type(obj) in (list, tuple):
        return type(obj)(_map_tensors(v, fn) for v in obj)
    if type(obj) in (dict, OrderedDict):
        out = type(obj)((k, _map_tensors(v, fn)) for k, v in obj.items())
        for attr, value in vars(obj).items() if type(obj) is OrderedDict else ():
            setattr(out, attr, _map_tensors(value, fn))  # a state_dict's _metadata
        return out
    return obj
