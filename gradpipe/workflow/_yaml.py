"""YAML with positions: every value of a workflow file keeps its line and column.

Errors in a workflow file must say where they are (``nightly.yaml:12:7``), so
the file is composed into PyYAML's node graph, which carries marks, and
turned into :class:`Node` values instead of plain Python objects. Only YAML's
safe core types exist (strings, numbers, booleans, null, lists, mappings);
anchors and aliases work as in any YAML; duplicate keys are an error, not a
silent overwrite.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import yaml

from gradpipe.errors import InvalidInputError

__all__ = ["Node", "WorkflowError", "load_nodes"]


class WorkflowError(InvalidInputError):
    """A workflow file that cannot be run as written; the message says where and why."""


@dataclass(frozen=True)
class Node:
    """A value of the file and where it starts (1-based line and column).

    ``value`` is a plain scalar (str, int, float, bool, None), a list of
    nodes, or a dict of key to node (keys are strings).
    """

    value: Any
    file: str
    line: int
    column: int
    #: The key nodes of a mapping, for errors about keys.
    keys: dict[str, Node] | None = None

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}:{self.column}"

    def error(self, message: str) -> WorkflowError:
        return WorkflowError(f"{self.where}: {message}")

    @property
    def kind(self) -> str:
        """What the value is, in the words of the file's author."""
        if isinstance(self.value, dict):
            return "a mapping"
        if isinstance(self.value, list):
            return "a list"
        if self.value is None:
            return "empty (null)"
        if isinstance(self.value, bool):
            return "a boolean"
        if isinstance(self.value, int | float):
            return "a number"
        return "a string"

    def plain(self) -> Any:
        """The value with the positions dropped."""
        if isinstance(self.value, dict):
            return {k: v.plain() for k, v in self.value.items()}
        if isinstance(self.value, list):
            return [v.plain() for v in self.value]
        return self.value


def load_nodes(text: str, file: str) -> Node:
    """Parse ``text`` (the contents of ``file``) into a :class:`Node` tree."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f"{file}:{mark.line + 1}:{mark.column + 1}" if mark is not None else file
        raise WorkflowError(f"{where}: not valid YAML: {exc.problem}") from None
    except yaml.YAMLError as exc:
        raise WorkflowError(f"{file}: not valid YAML: {exc}") from None
    if root is None:
        raise WorkflowError(
            f"{file}: the file is empty; a workflow needs version, store and stages"
        )
    return _Converter(file).convert(root)


class _Converter:
    """PyYAML nodes to :class:`Node` values, for one file."""

    def __init__(self, file: str) -> None:
        self.file = file
        self.loader = yaml.SafeLoader("")
        #: The nodes being converted: an alias of one inside itself would recurse for ever.
        self.open: set[int] = set()

    def convert(self, node: yaml.Node) -> Node:
        line, column = node.start_mark.line + 1, node.start_mark.column + 1
        if id(node) in self.open:
            raise WorkflowError(
                f"{self.file}:{line}:{column}: an alias refers to a node that holds it"
            )
        if isinstance(node, yaml.MappingNode):
            return self._nested(node, lambda: self._mapping(node, line, column))
        if isinstance(node, yaml.SequenceNode):
            return self._nested(node, lambda: self._sequence(node, line, column))
        return self._scalar(node, line, column)

    def _sequence(self, node: yaml.SequenceNode, line: int, column: int) -> Node:
        return Node([self.convert(item) for item in node.value], self.file, line, column)

    def _nested(self, node: yaml.Node, build: Callable[[], Node]) -> Node:
        self.open.add(id(node))
        try:
            return build()
        finally:
            self.open.discard(id(node))

    def _mapping(self, node: yaml.MappingNode, line: int, column: int) -> Node:
        values: dict[str, Node] = {}
        keys: dict[str, Node] = {}
        for key_node, value_node in node.value:
            key = self.convert(key_node)
            if not isinstance(key.value, str):
                raise key.error(f"a key must be a string, not {key.kind}")
            if key.value in values:
                first = keys[key.value]
                raise key.error(
                    f"{key.value!r} appears twice in this mapping (first at {first.where})"
                )
            values[key.value] = self.convert(value_node)
            keys[key.value] = key
        return Node(values, self.file, line, column, keys)

    def _scalar(self, node: yaml.Node, line: int, column: int) -> Node:
        where = f"{self.file}:{line}:{column}"
        try:
            value = self.loader.construct_object(node)
        except yaml.constructor.ConstructorError as exc:
            raise WorkflowError(f"{where}: {exc.problem}") from None
        if not isinstance(value, str | int | float | bool) and value is not None:
            # Timestamps and binary: YAML types a workflow never needs; say so rather than guess.
            raise WorkflowError(
                f"{where}: {type(value).__name__} values are not supported here; "
                "quote it to make it a string"
            )
        return Node(value, self.file, line, column)
