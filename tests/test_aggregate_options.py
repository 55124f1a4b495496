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
