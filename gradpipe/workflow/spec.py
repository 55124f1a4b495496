"""The workflow file, version 1: its keys, its stages, and the parser that checks them.

.. code-block:: yaml

    version: 1
    store: ./archive            # or {url: s3://bucket/prefix, storage_options: {...}, create: true}
    retries: 2                  # per stage, on infrastructure errors (default 2)
    backoff: 5s                 # before the first retry, doubling (default 5s)
    wait: 1h                    # for an overlapping run of this workflow to finish
    stages:                     # run in order; each a one-key mapping
      - ingest: {pattern: "dumps/step={step}/peer={peer}.safetensors", run: exp7}
      - aggregate: {run: exp7, method: fedavg}
      - prune: {snapshot: model, keep_last: 3}
      - gc: {grace: 24h}
      - verify: {}

Every stage takes ``retries`` and ``backoff`` beside its own keys. The keys of
each stage are declared once, in :data:`STAGES`; the validator and the JSON
Schema (:func:`json_schema`) are both made from that table.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from gradpipe.aggregation.options import METHODS, PARAMS, Param
from gradpipe.analytics.options import ANALYSES, ANALYSIS_CHOICES, check_request
from gradpipe.analytics.options import PARAMS as ANALYSIS_PARAMS
from gradpipe.core.display import printable
from gradpipe.core.replay_options import DEFAULT_REPLAY_INTERVAL, REPLAY_KINDS
from gradpipe.errors import GradpipeError
from gradpipe.workflow._yaml import Node, load_nodes, read_workflow_text
from gradpipe.workflow.fields import (
    Bool,
    Choice,
    Context,
    Duration,
    Field,
    Float,
    Int,
    LocalPath,
    NumberMap,
    Options,
    PathOrUrl,
    Size,
    StepRange,
    Str,
    StrList,
)

__all__ = [
    "STAGES",
    "VERSION",
    "Stage",
    "StageSpec",
    "Workflow",
    "json_schema",
    "load_workflow",
    "parse_workflow",
]

#: The workflow file versions this gradpipe reads.
VERSION: Final = 1
DEFAULT_RETRIES: Final = 2
DEFAULT_BACKOFF: Final = 5.0
#: Most retries of a stage, and longest first backoff: enough to ride out an outage of an
#: hour or two, never a job that sleeps for ever (each wait is also capped: see ``run``).
MAX_RETRIES: Final = 20
MAX_BACKOFF: Final = 3600.0
DEFAULT_WAIT: Final = 3600.0
#: The longest a run waits for the store (a week): longer is a job that never gives up.
MAX_WAIT: Final = 7 * 24 * 3600.0
_WAIT: Final = Duration(
    "how long a run waits while another run of this workflow holds the store (default 1h)",
    high=MAX_WAIT,
)

_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]*"


@dataclass(frozen=True)
class StageSpec:
    """One kind of stage: its keys (name to type) and which are required."""

    help: str
    fields: Mapping[str, Field]
    required: tuple[str, ...] = ()
    #: What the keys must satisfy together (raises a GradpipeError), checked on load.
    check: Callable[[dict[str, Any]], None] | None = None


def _param_fields(
    table: Sequence[Param], choices: Mapping[str, tuple[str, ...]] | None = None
) -> dict[str, Field]:
    """A table's parameters (aggregation methods', analyses') as keys of a stage."""
    fields: dict[str, Field] = {}
    for param in table:
        text = f"{param.methods_text}: {param.help}"
        if param.name in (choices or {}):
            fields[param.name] = Choice((choices or {})[param.name], text)
        elif param.type is float:
            fields[param.name] = Float(
                text,
                low=param.low,
                high=param.high,
                low_open=param.low_open,
                high_open=param.high_open,
            )
        elif param.type is int:
            high = None if param.high == math.inf else int(param.high)
            fields[param.name] = Int(text, low=int(param.low), high=high)
        elif param.type is bool:
            fields[param.name] = Bool(text)
        else:  # text: a snapshot chain's name
            fields[param.name] = Str(text, _NAME)
    return fields


_RUN = Str("the run's name", pattern=_NAME)


def _check_aggregate(params: dict[str, Any]) -> None:
    """The stage's options together, as gp.aggregate checks them (which method takes what)."""
    from gradpipe.aggregation.api import check_request  # numpy: only for an aggregate stage

    keys = {p.name for p in PARAMS} | {"method", "name", "split_every"}
    check_request(**{k: v for k, v in params.items() if k in keys})


def _check_analyze(params: dict[str, Any]) -> None:
    """The analyses named exist, and each parameter goes to one of them."""
    names = {p.name for p in ANALYSIS_PARAMS}
    given = {k: v for k, v in params.items() if k in names}
    check_request(params.get("what"), params.get("aggregate"), given)


class _Quorum(Field):
    """A rounds quorum: ``all``, a count, a fraction or a percentage (kept as text)."""

    help = 'all, a count (3), a fraction (0.75) or a percentage ("75%")'

    def parse(self, node: Node, ctx: Context) -> str:
        from gradpipe.core.rounds import parse_quorum
        from gradpipe.errors import InvalidInputError

        if isinstance(node.value, bool) or not isinstance(node.value, int | float | str):
            raise self._wrong(node, self.help)
        text = str(node.value)
        try:
            parse_quorum(text)
        except InvalidInputError as exc:
            raise node.error(str(exc)) from None
        return text

    def schema(self) -> dict[str, Any]:
        return {"type": ["integer", "number", "string"], "description": self.help}


#: Every stage a workflow can have, in the order a nightly job would run them.
STAGES: Final[dict[str, StageSpec]] = {
    "sample": StageSpec(
        "write gradpipe's sample training run (gradient dumps and training states) to a "
        "folder, unless it is there already: data to try a workflow on",
        {
            "dir": LocalPath("the folder to write"),
            "steps": Int("training steps", low=1),
            "peers": Int("peers", low=1),
        },
        ("dir",),
    ),
    "ingest": StageSpec(
        "ingest the dumps matching a pattern into a run (already recorded dumps are skipped)",
        {
            "pattern": PathOrUrl("a path or URL with {step} and {peer} fields"),
            "run": _RUN,
            "storage_options": Options("fsspec options for the pattern's filesystem"),
            "replace": Bool("replace recorded dumps whose content changed"),
            "repair": Bool("rewrite the blocks of recorded dumps that are missing or corrupt"),
            "delta": Bool("store each dump's chunks as deltas against the previous step"),
            "chunk_bytes": Size("raw bytes per chunk"),
        },
        ("pattern", "run"),
    ),
    "rounds": StageSpec(
        "set a run's roster, quorum and deadline (gradpipe rounds)",
        {
            "run": _RUN,
            "expect": StrList("the peers expected at every step"),
            "quorum": _Quorum(),
            "deadline": Duration("after this long, missing peers count as failed"),
        },
        ("run",),
    ),
    "aggregate": StageSpec(
        "aggregate the ready steps of a run over its peers (memoised: done steps are not redone)",
        {
            "run": _RUN,
            "method": Choice(METHODS, "the aggregation method"),
            "name": Str("what the run records the aggregates as (default: the method)", _NAME),
            "steps": StepRange('half-open step range, e.g. "0:10" (default: every ready step)'),
            "weights": NumberMap("explicit peer weights"),
            "split_every": Int("partials per combine task, a power of two", low=2),
            "force": Bool("recompute recorded steps and aggregate steps that are not ready"),
            **_param_fields(PARAMS),
        },
        ("run", "method"),
        _check_aggregate,
    ),
    "stats": StageSpec(
        "compression statistics of a run (or of one of its aggregates), written as CSV, "
        "JSON and a plot; reads manifests only",
        {
            "run": _RUN,
            "aggregate": Str("an aggregate of the run instead of its dumps", _NAME),
            "csv": LocalPath("a CSV file of per-(step, peer, tensor) records"),
            "json": LocalPath("a JSON file of the records and totals"),
            "plot": LocalPath(
                "a PNG of ratios, density and norms (needs matplotlib)",
                needs="matplotlib",
                extra="plot",
            ),
        },
        ("run",),
    ),
    "analyze": StageSpec(
        "gradient analytics of a run, memoised in the store (gradpipe analyze): norms, spikes, "
        "the first non-finite value, peer agreement, the noise scale; written as CSV, JSON "
        "and a plot",
        {
            "run": _RUN,
            "what": StrList(f"the analyses (default: the defaults of {', '.join(ANALYSES)})"),
            "steps": StepRange('half-open step range, e.g. "0:10" (default: every step)'),
            "aggregate": Str("an aggregate of the run instead of its dumps", _NAME),
            "csv": LocalPath("a CSV file of per-(step, peer) headline records"),
            "json": LocalPath("a JSON file of the report"),
            "plot": LocalPath(
                "a PNG of norms with spikes, the noise scale and the agreement (needs matplotlib)",
                needs="matplotlib",
                extra="plot",
            ),
            **_param_fields(ANALYSIS_PARAMS, ANALYSIS_CHOICES),
        },
        ("run",),
        _check_analyze,
    ),
    "snapshot": StageSpec(
        "snapshot training-state files matching a pattern with {step}, one version per step, "
        "in step order (steps not newer than the chain's newest are passed over)",
        {
            "name": Str("the snapshot chain", _NAME),
            "pattern": LocalPath("state files (safetensors, npz, .pt) with a {step} field"),
            "delta": Choice(("int", "xor"), "how changed chunks are stored (default int)"),
            "gradient": Str(
                "the gradient each step applied, RUN:AGGREGATE@{step} or RUN@{step} (that "
                "step's dumps averaged), with optimizer: parameters and moments are stored "
                "against that step replayed",
                r"[A-Za-z0-9][A-Za-z0-9._-]*(:[A-Za-z0-9][A-Za-z0-9._-]*)?@\{step\}",
            ),
            "optimizer": Choice(
                REPLAY_KINDS,
                "the optimizer of the state files: with gradient, replayed; alone, the "
                "moments coded against their decay",
            ),
            "replay_interval": Int(
                "with optimizer, a version is stored self-contained every this many versions "
                f"(default {DEFAULT_REPLAY_INTERVAL})",
                low=1,
            ),
        },
        ("name", "pattern"),
    ),
    "prune": StageSpec(
        "keep the newest versions of a snapshot chain and drop the others (gc reclaims them)",
        {
            "snapshot": Str("the snapshot chain", _NAME),
            "keep_last": Int("versions to keep", low=1),
            "keep_every": Int("also keep versions whose step is a multiple of this", low=1),
        },
        ("snapshot", "keep_last"),
    ),
    "gc": StageSpec(
        "delete blocks and manifests nothing references, older than the grace period",
        {"grace": Duration("keep unreferenced objects younger than this (default 24h)")},
    ),
    "verify": StageSpec(
        "re-read and re-hash everything reachable",
        {"all_blocks": Bool("also check blocks nothing references")},
    ),
}

_COMMON: Final[dict[str, Field]] = {
    "retries": Int("attempts after the first, on infrastructure errors", high=MAX_RETRIES),
    "backoff": Duration(
        "seconds before the first retry; doubles every retry, each wait at most an hour",
        high=MAX_BACKOFF,
    ),
}


@dataclass(frozen=True)
class Stage:
    """One stage as the file wrote it, checked: its kind, its values, where it is."""

    index: int
    kind: str
    params: dict[str, Any]
    #: The values as written (``${VAR}`` not substituted; storage options hidden).
    shown: dict[str, Any]
    retries: int
    backoff: float
    where: str


@dataclass(frozen=True)
class Workflow:
    """A checked workflow file."""

    path: str
    store_url: str
    store_shown: str
    storage_options: dict[str, Any] | None
    create: bool
    stages: tuple[Stage, ...] = field(default_factory=tuple)
    name: str | None = None
    retries: int = DEFAULT_RETRIES
    backoff: float = DEFAULT_BACKOFF
    #: How long a run waits for another run of the same workflow on the store.
    wait: float = DEFAULT_WAIT


def load_workflow(path: str | os.PathLike[str], env: Mapping[str, str] | None = None) -> Workflow:
    """Read and check a workflow file; ``env`` is where ``${VAR}`` comes from (os.environ)."""
    name = os.fspath(path)
    return parse_workflow(read_workflow_text(name), name, env=env)


def parse_workflow(text: str, path: str, *, env: Mapping[str, str] | None = None) -> Workflow:
    """Check the text of a workflow file (``path`` names it in errors and anchors its paths)."""
    root = load_nodes(text, path)
    ctx = Context(os.environ if env is None else env, Path(path).resolve().parent)
    top = _mapping(root, "the workflow")
    _known(
        top, {"version", "name", "store", "stages", "retries", "backoff", "wait"}, "the workflow"
    )
    for key in ("version", "store", "stages"):
        if key not in top.value:
            raise root.error(f"the workflow needs {printable(key)} (version: 1, store, stages)")
    version = top.value["version"]
    if version.value != VERSION or isinstance(version.value, bool):
        raise version.error(
            f"this gradpipe reads workflow version {VERSION}, not {printable(version.value)}"
        )
    url, shown, options, create = _store(top.value["store"], ctx)
    retries = _common(top, "retries", DEFAULT_RETRIES, ctx)
    backoff = _common(top, "backoff", DEFAULT_BACKOFF, ctx)
    wait_node = top.value.get("wait")
    wait = DEFAULT_WAIT if wait_node is None else _WAIT.parse(wait_node, ctx)
    stages_node = top.value["stages"]
    if not isinstance(stages_node.value, list) or not stages_node.value:
        raise stages_node.error("stages must be a non-empty list, e.g. [{ingest: {...}}, ...]")
    stages = tuple(
        _stage(i, node, ctx, retries, backoff) for i, node in enumerate(stages_node.value)
    )
    title = top.value.get("name")
    return Workflow(
        path,
        url,
        shown,
        options,
        create,
        stages,
        None if title is None else Str().parse(title, ctx),
        retries,
        backoff,
        wait,
    )


def _mapping(node: Node, what: str) -> Node:
    if not isinstance(node.value, dict):
        raise node.error(f"{what} must be a mapping, got {node.kind}")
    return node


def _known(node: Node, keys: set[str] | Mapping[str, Any], what: str) -> None:
    for key, key_node in (node.keys or {}).items():
        if key not in keys:
            known = ", ".join(sorted(keys))
            raise key_node.error(f"unknown key {printable(key)} in {what} (known: {known})")


def _common(node: Node, key: str, default: Any, ctx: Context) -> Any:
    value = node.value.get(key)
    return default if value is None else _COMMON[key].parse(value, ctx)


def _store(node: Node, ctx: Context) -> tuple[str, str, dict[str, Any] | None, bool]:
    """The store's URL (local paths absolute), as written, its options, whether to create it."""
    where = PathOrUrl("the store")
    if isinstance(node.value, str):
        return where.parse(node, ctx), node.value, None, False
    if not isinstance(node.value, dict):
        raise node.error(f"store must be a path, a URL or a mapping with url, got {node.kind}")
    _known(node, {"url", "storage_options", "create"}, "store")
    if "url" not in node.value:
        raise node.error("store needs url: a path or a URL such as s3://bucket/prefix")
    url_node = node.value["url"]
    options = node.value.get("storage_options")
    create = node.value.get("create")
    return (
        where.parse(url_node, ctx),
        str(url_node.value),
        None if options is None else Options().parse(options, ctx),
        False if create is None else Bool().parse(create, ctx),
    )


def _stage(index: int, node: Node, ctx: Context, retries: int, backoff: float) -> Stage:
    if not isinstance(node.value, dict) or len(node.value) != 1:
        raise node.error(
            "each stage is a mapping with one key, the stage's kind, e.g. "
            "- ingest: {pattern: ..., run: ...}"
        )
    [(kind, body)] = node.value.items()
    kind_node = (node.keys or {})[kind]
    spec = STAGES.get(kind)
    if spec is None:
        raise kind_node.error(f"unknown stage {printable(kind)} (stages: {', '.join(STAGES)})")
    if body.value is None:  # `- verify:` with nothing after it
        body = Node({}, body.file, body.line, body.column, {})
    _mapping(body, f"stage {printable(kind)}")
    fields = {**spec.fields, **_COMMON}
    _known(body, fields, f"stage {printable(kind)}")
    for key in spec.required:
        if key not in body.value:
            raise body.error(
                f"stage {printable(kind)} needs {printable(key)}: {spec.fields[key].help}"
            )
    params = {k: fields[k].parse(v, ctx) for k, v in body.value.items() if k not in _COMMON}
    if spec.check is not None:
        try:
            spec.check(params)
        except GradpipeError as exc:
            raise body.error(f"stage {printable(kind)}: {exc}") from None
    shown = {
        k: ("<hidden>" if isinstance(fields[k], Options) else v.plain())
        for k, v in body.value.items()
        if k not in _COMMON
    }
    return Stage(
        index,
        kind,
        params,
        shown,
        _common(body, "retries", retries, ctx),
        _common(body, "backoff", backoff, ctx),
        node.where,
    )


def missing_requirements(stage: Stage) -> list[str]:
    """What ``stage`` needs that is not installed here: one message per field, with
    its place in the file and what to install (a stats ``plot`` without matplotlib)."""
    fields = STAGES[stage.kind].fields
    out = []
    for key in stage.params:
        field = fields.get(key)
        problem = field.missing() if isinstance(field, LocalPath) else None
        if problem:
            out.append(
                f"{stage.where}: stage {stage.index} ({stage.kind}): {key} {problem}, "
                f"or leave {key} out"
            )
    return out


def json_schema() -> dict[str, Any]:
    """The JSON Schema of a workflow file, made from :data:`STAGES` (shipped beside this module)."""
    common = {k: f.schema() for k, f in _COMMON.items()}
    stages = []
    for kind, spec in STAGES.items():
        body = {
            "type": ["object", "null"] if not spec.required else "object",
            "properties": {**{k: f.schema() for k, f in spec.fields.items()}, **common},
            "additionalProperties": False,
        }
        if spec.required:
            body["required"] = list(spec.required)
        stages.append(
            {
                "type": "object",
                "description": spec.help,
                "properties": {kind: body},
                "required": [kind],
                "additionalProperties": False,
            }
        )
    store_object = {
        "type": "object",
        "properties": {
            "url": {"type": "string"},
            "storage_options": {"type": "object"},
            "create": {"type": "boolean"},
        },
        "required": ["url"],
        "additionalProperties": False,
    }
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://gradpipe.dev/schemas/workflow-v1.json",
        "title": "gradpipe workflow",
        "type": "object",
        "properties": {
            "version": {"const": VERSION},
            "name": {"type": "string"},
            "store": {"anyOf": [{"type": "string"}, store_object]},
            "retries": common["retries"],
            "backoff": common["backoff"],
            "wait": _WAIT.schema(),
            "stages": {"type": "array", "minItems": 1, "items": {"oneOf": stages}},
        },
        "required": ["version", "store", "stages"],
        "additionalProperties": False,
    }
