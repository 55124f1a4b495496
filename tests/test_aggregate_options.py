"""The aggregation options table agrees with all that lists the options: ``gp.aggregate``'s
keywords and checks, ``gradpipe aggregate``'s arguments, the workflow schema and the docs."""

from __future__ import annotations

import argparse
import inspect
import math
import re
from pathlib import Path

import pytest

import gradpipe as gp
from gradpipe.aggregation.api import _parse_request
from gradpipe.aggregation.options import (
    METHODS,
    PARAMS,
    Param,
    check_value,
    markdown_tables,
    params_of,
)
from gradpipe.cli._app import build_parser
from gradpipe.errors import InvalidInputError
from gradpipe.workflow.fields import Bool, Choice, Float, Int, Str
from gradpipe.workflow.spec import STAGES, json_schema

#: The keywords of gp.aggregate that are not a method's parameter.
RUN_LEVEL = {"run", "steps", "method", "name", "weights", "split_every", "force", "runner"}
REPO = Path(__file__).resolve().parents[1]


def _aggregate_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices["aggregate"]


def _valid(param: Param) -> object:
    """A value inside the parameter's range."""
    if param.type is bool:
        return True
    if param.type is str:
        return "chain"
    low = 0.0 if param.low == -math.inf else param.low
    value = low + (0.25 if param.type is float else 1) if param.low_open else low
    return param.type(value)


def _invalid(param: Param) -> list[object]:
    """Values outside the range, or of the wrong type."""
    if param.type is bool:
        return [1, "yes"]
    if param.type is str:
        return [3]
    out: list[object] = ["1", True, math.nan]
    if param.low != -math.inf:
        out.append(param.type(param.low) if param.low_open else param.low - 1)
    if param.high != math.inf:
        out.append(param.high if param.high_open else param.high + 1)
    return out


def test_gp_aggregate_takes_every_parameter_of_the_table_and_no_other() -> None:
    keywords = set(inspect.signature(gp.aggregate).parameters) - {"store"}
    assert keywords == RUN_LEVEL | {p.name for p in PARAMS}
    for p in PARAMS:  # and documents each, from the table
        assert f"    {p.name} : " in (gp.aggregate.__doc__ or ""), p.name


def test_the_cli_offers_the_methods_and_every_parameter_with_its_type() -> None:
    parser = _aggregate_parser()
    actions = {a.dest: a for a in parser._actions}
    assert tuple(actions["method"].choices) == METHODS
    for p in PARAMS:
        action = actions[p.name]
        assert action.option_strings == [p.flag]
        if p.type is bool:
            assert isinstance(action, argparse._StoreTrueAction)
        else:
            assert action.type is p.type, p.name
        assert p.help in " ".join((action.help or "").split()), p.name


def test_the_workflow_stage_takes_every_parameter_with_its_range() -> None:
    fields = STAGES["aggregate"].fields
    method = fields["method"]
    assert isinstance(method, Choice)
    assert method.choices == METHODS
    kinds = {float: Float, int: Int, bool: Bool, str: Str}
    for p in PARAMS:
        assert isinstance(fields[p.name], kinds[p.type]), p.name
    schema = json_schema()
    text = str(schema)
    for p in PARAMS:
        assert f"'{p.name}'" in text


@pytest.mark.parametrize("param", PARAMS, ids=[p.name for p in PARAMS])
def test_api_cli_and_workflow_refuse_the_same_values(param: Param, tmp_path: Path) -> None:
    from gradpipe.workflow.spec import load_workflow

    method = param.methods[0]
    base: dict[str, object] = (
        {"snapshot": "chain", "server_lr": 0.1}
        if method in ("sgd", "fedavgm", "fedadagrad", "fedadam", "fedyogi")
        else {}
    )
    if method == "dp-fedavg":
        base["clip_norm"] = 1.0
        if param.name in ("target_quantile", "clip_lr"):
            base["adaptive_clip"] = True

    def workflow(value: object) -> Path:
        import yaml

        stage = {"run": "r", "method": method, **base, param.name: value}
        path = tmp_path / "w.yaml"
        path.write_text(
            yaml.safe_dump({"version": 1, "store": "s", "stages": [{"aggregate": stage}]})
        )
        return path

    good = _valid(param)
    assert check_value(param.name, good) == good
    _parse_request(method, None, None, {**base, param.name: good})
    load_workflow(workflow(good))
    for bad in _invalid(param):
        with pytest.raises(InvalidInputError):
            check_value(param.name, bad)
        with pytest.raises(InvalidInputError):
            _parse_request(method, None, None, {**base, param.name: bad})
        with pytest.raises(gp.GradpipeError):
            load_workflow(workflow(bad))


@pytest.mark.parametrize("method", METHODS)
def test_a_method_refuses_the_parameters_it_does_not_take(method: str) -> None:
    takes = {p.name for p in params_of(method)}
    base: dict[str, object] = {}
    if "snapshot" in takes:
        base = {"snapshot": "chain", "server_lr": 0.1}
    if method == "dp-fedavg":
        base = {"clip_norm": 1.0}
    if method == "weighted-mean":
        base = {}
    _parse_request(method, None, None, base)
    for p in PARAMS:
        if p.name in takes:
            continue
        with pytest.raises(InvalidInputError, match=f"takes no {p.name}|{p.name}"):
            _parse_request(method, None, None, {**base, p.name: _valid(p)})


def test_the_table_names_its_methods_once() -> None:
    assert len(set(METHODS)) == len(METHODS)
    assert len({p.name for p in PARAMS}) == len(PARAMS)
    for p in PARAMS:
        assert set(p.methods) <= set(METHODS), p.name
        assert set(p.required_by) <= set(p.methods), p.name
        assert re.fullmatch(r"[a-z][a-z0-9_]*", p.name)


def test_the_docs_show_the_generated_table() -> None:
    pages = [
        p for p in (REPO / "docs").rglob("*.md") if "| parameter | command line" in p.read_text()
    ]
    assert pages, "no documentation page shows the aggregation options table"
    for page in pages:
        assert markdown_tables() in page.read_text(), (
            f"{page}: regenerate with python -m gradpipe.aggregation.options"
        )


#: Requests and the memo keys gradpipe 0.1.0's first releases recorded for them (two peers of
#: fixed dumps): an unchanged request must find its aggregate again after an upgrade. Integers
#: stay integers (``server_lr=1`` records ``"lr": 1``).
PINNED_KEYS = [
    ("fedavg", {}, "b3:bf290c6544a11937166831013ebd08c0ac61c1f8cb0310bb9d16bc4446a4ca6e"),
    (
        "fedavg",
        {"clip_norm": 1},
        "b3:28f454fc0d332e68905ca295990952294f7353ce213a3c3dbf038808212dc675",
    ),
    (
        "sum",
        {"clip_aggregate": 2.5},
        "b3:237c3d6cf10066c27c5bad0997934cfba590b7607ab1109418a3b584b4a3711f",
    ),
    ("trimmed-mean", {}, "b3:d1e01347737b3c20abefed5ad5163e1b50b2bf5f7ad6fad93f6137c53306315a"),
    (
        "trimmed-mean",
        {"trim": 0.2},
        "b3:4921110ef72cdd4d36e413a6335498b557d505bf9b0bb496b37aa1ea93bb0115",
    ),
    (
        "krum",
        {"byzantine": 1},
        "b3:a12cd4211e16d3f1933159e8f67dcc2f6a731e487346f5ee8f16198002d52353",
    ),
    (
        "multi-krum",
        {"byzantine": 1, "keep": 3},
        "b3:01f03b22e4e19d10cc48a92f8eefc4ec8b0888ddfb0b65d8f334fc2b553ba523",
    ),
    ("bulyan", {}, "b3:e7449885f7efdabb5630cf56fcbefaafb5fb20ae9f3b3dc2fdf9c75ec9ff16fd"),
    (
        "median",
        {"clip_aggregate": 1},
        "b3:a9b2eed68fcd9a5400205c7d56bbafe9e5d340ee781eaa7cf4c7ea4ffa6774fe",
    ),
    (
        "dp-fedavg",
        {"clip_norm": 1, "seed": 7},
        "b3:5ab0f04e97ca3d136af4677474f55f29e4d22a3796ad9c196d48c0bbfb55dce8",
    ),
    (
        "dp-fedavg",
        {"clip_norm": 0.5, "adaptive_clip": True, "noise_multiplier": 0.3},
        "b3:d2502f2e867c86de68d61e557e1f6e64fd0cfa39110a91c5cf6c84f72d77c457",
    ),
    (
        "dp-fedavg",
        {"clip_norm": 0.5, "adaptive_clip": True, "target_quantile": 0.7, "clip_lr": 0.5},
        "b3:8b2dc1b994a17adcf4280525f51833757a3572c755032808c020c7ee1b278e82",
    ),
    (
        "sgd",
        {"snapshot": "g", "server_lr": 1},
        "b3:69c6397af95bae938c20488b33cac76f0b4a31f82d4acf8f31578fb00559626a",
    ),
    (
        "fedavgm",
        {"snapshot": "g", "server_lr": 0.1, "momentum": 0},
        "b3:32f414e1a68d79b2e533078d3667185197c6f582c69856c63f3e760a470b0c64",
    ),
    (
        "fedadam",
        {"snapshot": "g", "server_lr": 1, "beta1": 0, "tau": 1, "bias_correction": True},
        "b3:483139e44b3d45c7b334bf4f7653d7a3df45d4f57c0d4004d71314c9298d9c32",
    ),
    (
        "fedyogi",
        {"snapshot": "g", "server_lr": 0.01, "initial_accumulator": 0, "clip_norm": 2},
        "b3:a38213cfadb383c8c759d93104c6d0154a46b73c78b6b7f5365f742fa5000fc0",
    ),
]


@pytest.mark.parametrize(("method", "given", "key"), PINNED_KEYS)
def test_memo_keys_of_unchanged_requests_do_not_change(
    method: str, given: dict[str, object], key: str
) -> None:
    from gradpipe.core.aggregate_manifest import AggregateInput, aggregate_key

    inputs = (
        AggregateInput("p0", "b3:" + "0" * 64, 1.0),
        AggregateInput("p1", "b3:" + "1" * 64, 3.0),
    )
    request = _parse_request(method, None, None, given)
    assert aggregate_key(request.method.value, request.params, inputs) == key
