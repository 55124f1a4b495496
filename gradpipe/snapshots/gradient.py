"""The gradient a replay version's step applied, as a writer gives it (``gradient=``).

An aggregate of a run (``"RUN:NAME@STEP"`` or a :class:`~gradpipe.runs.Aggregate`), kept
alive by the snapshot, which lists it as a child; or arrays by parameter name, recorded
with the snapshot. Readers find it from the version's
:class:`~gradpipe.core.replay_record.GradientRef`
(:func:`gradpipe.storage.replays.snapshot_version`; docs/design/016).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from gradpipe.core.display import printable
from gradpipe.core.replay_record import GradientRef
from gradpipe.errors import InvalidInputError
from gradpipe.runs import Aggregate, open_run
from gradpipe.storage.replays import combine_gradients

if TYPE_CHECKING:
    from gradpipe.storage.store import Store

__all__ = ["GivenGradient", "given_gradient"]


@dataclass(frozen=True)
class GivenGradient:
    """A writer's gradient: how the version will name it, and its arrays by name.

    ``ref`` is None for recorded arrays until they are written (their ids are then known).
    """

    ref: GradientRef | None
    arrays: Mapping[str, Callable[[], np.ndarray]]  # read on demand, one parameter at a time
    shapes: Mapping[str, tuple[str, tuple[int, ...]]]  # name -> (dtype, shape)
    label: str


def given_gradient(store: Store, gradient: Any) -> GivenGradient:
    """What ``gradient=`` names: ``"RUN:NAME@STEP"`` or an Aggregate, ``"RUN@STEP"`` (that
    step's dumps, averaged as :func:`~gradpipe.storage.replays.combine_gradients` does), or
    arrays by name."""
    if isinstance(gradient, str) and ":" not in gradient:
        return _dumps_of(store, gradient)
    if isinstance(gradient, str):
        gradient = _aggregate_of(store, gradient)
    if isinstance(gradient, Aggregate):
        label = f"{gradient.manifest.run}:{gradient.manifest.name}@{gradient.manifest.step}"
        ref = GradientRef(aggregate=gradient.id, label=label)
        infos = {name: gradient.info(name) for name in gradient.names}

        def reader(name: str) -> Callable[[], np.ndarray]:
            return lambda: np.asarray(gradient.read(name))

        return GivenGradient(
            ref,
            {name: reader(name) for name in infos},
            {name: (m.dtype, m.shape) for name, m in infos.items()},
            f"aggregate {label}",
        )
    if isinstance(gradient, Mapping):
        arrays = {}
        for name, value in gradient.items():
            if not isinstance(name, str):
                raise InvalidInputError(f"gradient names must be str, not {printable(name)}")
            arrays[name] = np.array(value, copy=True, order="C")  # the caller's may change
        return GivenGradient(
            None,
            {name: _constant(a) for name, a in arrays.items()},
            {name: (a.dtype.name, a.shape) for name, a in arrays.items()},
            "recorded gradient",
        )
    raise InvalidInputError(
        f"gradient= takes 'RUN:AGGREGATE@STEP', a run's Aggregate or arrays by parameter "
        f"name, not {printable(type(gradient).__name__)}"
    )


def _constant(array: np.ndarray) -> Callable[[], np.ndarray]:
    return lambda: array


def _dumps_of(store: Store, text: str, rule: str = "sum-then-scale") -> GivenGradient:
    """The dumps of one step of a run: ``"RUN@STEP"``; peers in the run's order."""
    name, at, step_text = text.rpartition("@")
    if not (at and name and step_text.isdigit()):
        raise InvalidInputError(
            f"gradient {printable(text)} is not RUN:AGGREGATE@STEP or RUN@STEP (for example "
            "'train:fedavg@12', or 'train@12' for that step's dumps, averaged)"
        )
    run, step = open_run(store, name), int(step_text)
    peers = run.grid().get(step)
    if not peers:
        raise InvalidInputError(f"run {printable(name)} has no dumps at step {step}")
    dumps = [run.dump(step, peer) for peer in peers]
    infos = [d.infos() for d in dumps]
    shapes: dict[str, tuple[str, tuple[int, ...]]] = {}
    for tensor in infos[0]:
        kinds = {(i[tensor].dtype, i[tensor].shape) if tensor in i else None for i in infos}
        if len(kinds) == 1 and None not in kinds:  # every peer has it, alike
            dtype, shape = infos[0][tensor].dtype, infos[0][tensor].shape
            shapes[tensor] = ("float64" if dtype == "float64" else "float32", shape)

    def reader(tensor: str) -> Callable[[], np.ndarray]:
        return lambda: combine_gradients([np.asarray(d.read(tensor)) for d in dumps], rule)

    label = f"{name}@{step}"
    ref = GradientRef(dumps=tuple((d.peer, d.id) for d in dumps), combine=rule, label=label)
    return GivenGradient(ref, {t: reader(t) for t in shapes}, shapes, f"dumps {label}")


def _aggregate_of(store: Store, text: str) -> Aggregate:
    run, sep, rest = text.partition(":")
    name, at, step = rest.rpartition("@")
    if not (sep and at and run and name and step.isdigit()):
        raise InvalidInputError(
            f"gradient {printable(text)} is not RUN:AGGREGATE@STEP (for example 'train:fedavg@12')"
        )
    return open_run(store, run).aggregate(name, step=int(step))
