"""The plan of one server step: the snapshot's state checked against the aggregate, and what
each parameter tensor's step reads and writes.

:func:`gradpipe.aggregation.server_update.server_update` runs the plan.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

from gradpipe.aggregation.server_opt import ServerOptimizerConfig, state_dtype
from gradpipe.aggregation.server_opt_graph import NewArray, ServerPlan, TensorStep
from gradpipe.core.chain import DEFAULT_KEYFRAME_INTERVAL
from gradpipe.core.display import printable, printable_error
from gradpipe.core.dtypes import is_float, parse_dtype
from gradpipe.core.snapshot_manifest import SnapshotManifest
from gradpipe.core.state import ArraySpec, flatten_skeleton, state_skeleton
from gradpipe.core.tensor_manifest import TensorManifest
from gradpipe.errors import IntegrityError, InvalidInputError
from gradpipe.snapshots.api import (
    snapshot_tensor,
)

if TYPE_CHECKING:
    from gradpipe.storage.store import Store


_STATE_KEYS: Final = frozenset({"params", "server_optimizer"})


def plan_server_step(
    store: Store,
    snapshot: str,
    head: SnapshotManifest,
    *,
    step: int,
    updates: Mapping[str, TensorManifest],
    config: ServerOptimizerConfig,
) -> tuple[ServerPlan, dict[str, Any], list[str]]:
    """The step to compute from ``head``: the plan, the new state's tree and its array keys.

    Everything is checked here, from manifests, before a chunk is read.
    """

    try:
        skeleton = state_skeleton(head.state)
    except (ValueError, KeyError, TypeError) as exc:
        raise IntegrityError(
            f"snapshot {printable(snapshot)} at step {head.step} has a damaged state skeleton: "
            f"{printable_error(exc)}"
        ) from None
    params, stored, t = _parse_state(skeleton, snapshot, config)
    _check_updates(params, updates, snapshot, step, config)
    dtypes = _state_dtypes(params, stored, updates, config)
    new = {
        "params": {n: ArraySpec(p.dtype, p.shape) for n, p in params.items()},
        "server_optimizer": {
            **{
                k: {n: ArraySpec(dtypes[k][n], p.shape) for n, p in params.items()}
                for k in config.state_names
            },
            "t": t + 1,
            "config": config.to_dict(),
        },
    }
    tree, specs = flatten_skeleton(new, where=f"snapshot {printable(snapshot)}")
    placed = state_skeleton(tree)  # each new array with its key
    tensors = []
    for name, spec in params.items():
        outputs = [_new_array(store, head, placed["params"][name], "params")]
        outputs += [
            _new_array(store, head, placed["server_optimizer"][k][name], k)
            for k in config.state_names
        ]
        tensors.append(
            _tensor_step(
                store, head, name, spec=spec, stored=stored, updates=updates, outputs=outputs
            )
        )
    plan = ServerPlan(step, snapshot, tuple(tensors), config, t + 1, interval=_interval(head))
    return plan, tree, list(specs)


def _tensor_step(
    store: Store,
    head: SnapshotManifest,
    name: str,
    *,
    spec: ArraySpec,
    stored: dict[str, dict[str, ArraySpec]] | None,
    updates: Mapping[str, TensorManifest],
    outputs: list[NewArray],
) -> TensorStep:

    specs = {"params": spec, **{k: arrays[name] for k, arrays in (stored or {}).items()}}
    manifests = {role: snapshot_tensor(store, head, s.key) for role, s in specs.items()}
    for role, what in specs.items():
        manifest = manifests.pop(role) if role == "params" else manifests[role]
        if (manifest.dtype, manifest.shape) != (what.dtype, what.shape):
            raise IntegrityError(
                f"snapshot {printable(head.name)} at step {head.step}: array {what.key} is "
                f"{manifest.dtype}{list(manifest.shape)}, its state says "
                f"{what.dtype}{list(what.shape)}; run `gradpipe verify`"
            )
    params = snapshot_tensor(store, head, spec.key)
    return TensorStep(name, spec.shape, params, updates.get(name), manifests, tuple(outputs))


def _new_array(store: Store, head: SnapshotManifest, spec: ArraySpec, role: str) -> NewArray:
    """An array of the new snapshot, written after the array of the same key in ``head``."""

    parent_id = head.tensors.get(spec.key)
    parent = None if parent_id is None else snapshot_tensor(store, head, spec.key)
    return NewArray(spec.key, role, spec.dtype, parent, parent_id)


def _interval(head: SnapshotManifest) -> int:
    """The chain's keyframe interval, as its newest snapshot's tensors record it."""
    for manifest in head.embedded.values():
        if manifest.chain is not None:
            return manifest.chain.keyframe_interval
    return DEFAULT_KEYFRAME_INTERVAL


def _state_dtypes(
    params: Mapping[str, ArraySpec],
    stored: dict[str, dict[str, ArraySpec]] | None,
    updates: Mapping[str, TensorManifest],
    config: ServerOptimizerConfig,
) -> dict[str, dict[str, str]]:
    """The dtype of each new state array: as a step makes it, or as stored when carried over."""
    out: dict[str, dict[str, str]] = {}
    for k in config.state_names:
        out[k] = {}
        for name, spec in params.items():
            if stored is not None and name not in updates:
                out[k][name] = stored[k][name].dtype
            else:
                out[k][name] = state_dtype(parse_dtype(spec.dtype)).name
    return out


def _check_updates(
    params: Mapping[str, ArraySpec],
    updates: Mapping[str, TensorManifest],
    snapshot: str,
    step: int,
    config: ServerOptimizerConfig,
) -> None:
    for name, update in updates.items():
        where = f"aggregate of step {step}"
        if name not in params:
            raise InvalidInputError(
                f"server update: the {where} has tensor {printable(name)}, which snapshot "
                f"{printable(snapshot)} "
                f"has not (parameters: {', '.join(sorted(params))})"
            )
        spec = params[name]
        if spec.shape != update.shape:
            raise InvalidInputError(
                f"server update: tensor {printable(name)} has shape {list(update.shape)} "
                f"in the {where} "
                f"but {list(spec.shape)} in snapshot {printable(snapshot)}"
            )
        if not is_float(parse_dtype(spec.dtype)):
            raise InvalidInputError(
                f"server update: tensor {printable(name)} of snapshot "
                f"{printable(snapshot)} is {spec.dtype}; "
                f"{config.method.value} updates float parameters only"
            )


def _flat(state: Mapping[Any, Any]) -> bool:
    return bool(state) and all(
        isinstance(k, str) and isinstance(v, ArraySpec) for k, v in state.items()
    )


def _parse_state(
    state: Any, name: str, config: ServerOptimizerConfig
) -> tuple[dict[str, ArraySpec], dict[str, dict[str, ArraySpec]] | None, int]:
    """The parameters, the optimizer's stored state (None: it starts now) and its round."""
    shape = '{"params": {name: array}, "server_optimizer": {...}}'
    if isinstance(state, Mapping) and _flat(state):
        # A flat {name: array} (what `gradpipe snapshot` makes of a safetensors or npz
        # file): the parameters, at the first step.
        state = {"params": state}
    if not isinstance(state, Mapping) or "params" not in state or set(state) - _STATE_KEYS:
        keys = sorted(map(str, state)) if isinstance(state, Mapping) else type(state).__name__
        raise InvalidInputError(
            f"snapshot {printable(name)} holds {keys}, not a server state {shape}"
        )
    params = state["params"]
    if not isinstance(params, Mapping) or not all(
        isinstance(k, str) and isinstance(v, ArraySpec) for k, v in params.items()
    ):
        raise InvalidInputError(
            f"snapshot {printable(name)}: 'params' must map tensor names to arrays"
        )
    params = dict(params)
    server = state.get("server_optimizer")
    if server is None:  # the first round: the optimizer starts here
        return params, None, 0
    if not isinstance(server, Mapping) or not isinstance(server.get("config"), Mapping):
        raise InvalidInputError(f"snapshot {printable(name)}: 'server_optimizer' has no config")
    recorded = ServerOptimizerConfig.from_dict(dict(server["config"]))
    if recorded.method is not config.method:
        raise InvalidInputError(
            f"snapshot {printable(name)} holds {recorded.method.value} state; it cannot "
            "continue with "
            f"{config.method.value} (start a new chain from its params)"
        )
    t = server.get("t")
    if isinstance(t, bool) or not isinstance(t, int) or t < 0:
        raise InvalidInputError(
            f"snapshot {printable(name)}: server optimizer round t={printable(t)} is not >= 0"
        )
    stored: dict[str, dict[str, ArraySpec]] = {}
    for k in config.state_names:
        arrays = server.get(k)
        if not isinstance(arrays, Mapping) or set(arrays) != set(params):
            raise InvalidInputError(
                f"snapshot {printable(name)}: server optimizer state {printable(k)} must "
                "have one array per "
                f"parameter ({', '.join(sorted(params))})"
            )
        for tensor, spec in arrays.items():
            if not isinstance(spec, ArraySpec) or spec.shape != params[tensor].shape:
                got = list(spec.shape) if isinstance(spec, ArraySpec) else type(spec).__name__
                raise InvalidInputError(
                    f"server update: tensor {printable(tensor)}: {config.method.value} needs state "
                    f"{list(config.state_names)} of shape {list(params[tensor].shape)}; "
                    f"snapshot {printable(name)} holds {printable(k)} of shape {got}"
                )
        stored[k] = dict(arrays)
    return params, stored, t
