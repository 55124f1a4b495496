"""YAML with positions: every value of a workflow file keeps its line and column.

Errors in a workflow file must say where they are (``nightly.yaml:12:7``), so
the file is composed into PyYAML's node graph, which carries marks, and
turned into :class:`Node` values instead of plain Python objects. Only YAML's
safe core types exist (strings, numbers, booleans, null, lists, mappings);
anchors and aliases work as in any YAML; duplicate keys are an error, not a
silent overwrite.

A workflow file is untrusted input, so reading it is bounded (see
``docs/design/005-input-limits.md``): at most :data:`MAX_WORKFLOW_BYTES` are
read, collections nest at most :data:`MAX_WORKFLOW_DEPTH` levels, and the file
holds at most :data:`MAX_WORKFLOW_VALUES` values and
:data:`MAX_WORKFLOW_TEXT` characters of scalars once its aliases are
expanded. The composer counts as it goes, an alias costing the values,
characters and levels of what it stands for, so a "billion laughs" file is refused at the
alias that crosses the limit, having allocated no more than the file itself
wrote. Aliases are then shared, never copied. Tags other than the core
schema's (``!!str``, ``!!int``, ``!!float``, ``!!bool``, ``!!null``,
``!!seq``, ``!!map``) are refused on every kind of node.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, TypeAlias

import yaml

from gradpipe.core.display import NAME_LIMIT, PATH_LIMIT, printable, printable_text
from gradpipe.errors import InvalidInputError

if TYPE_CHECKING:
    from yaml._yaml import Mark as _CMark

    #: Where an event starts, as PyYAML's stubs type it (pure-Python or libyaml's mark).
    _Mark: TypeAlias = yaml.error.Mark | _CMark | None

__all__ = [
    "MAX_WORKFLOW_BYTES",
    "MAX_WORKFLOW_DEPTH",
    "MAX_WORKFLOW_NUMBER_CHARS",
    "MAX_WORKFLOW_TEXT",
    "MAX_WORKFLOW_VALUES",
    "Node",
    "WorkflowError",
    "load_nodes",
    "read_workflow_text",
]

#: The largest workflow file read (1 MiB); real ones take a few kilobytes.
MAX_WORKFLOW_BYTES: Final = 1 << 20
#: How deep lists and mappings may nest (a workflow needs about 6 levels).
MAX_WORKFLOW_DEPTH: Final = 32
#: The most values (scalars, keys, lists, mappings) a file may hold, aliases expanded.
MAX_WORKFLOW_VALUES: Final = 100_000
#: The most characters of scalars (keys and values) a file may hold, aliases expanded: four
#: times what the file may write, so an alias of a few hundred bytes can repeat, a 500 KB
#: string repeated 19,000 times cannot (the stages would each get a copy).
MAX_WORKFLOW_TEXT: Final = 4 << 20
#: The longest number; longer ones cost quadratic time to convert (YAML 1.1's base 60).
MAX_WORKFLOW_NUMBER_CHARS: Final = 100

_CORE = "tag:yaml.org,2002:"
#: The explicit tags each kind of node may carry: the core schema's, nothing that builds objects.
_TAGS: Final[dict[type[yaml.Event], frozenset[str]]] = {
    yaml.ScalarEvent: frozenset(_CORE + t for t in ("str", "int", "float", "bool", "null")),
    yaml.SequenceStartEvent: frozenset({_CORE + "seq"}),
    yaml.MappingStartEvent: frozenset({_CORE + "map"}),
}
#: Plain scalars PyYAML's resolver gives a tag that means an operation, not a value.
_OPERATORS: Final = {_CORE + "merge": "merge key", _CORE + "value": "value key"}
#: Characters a str may hold but no path, name or option can (``os`` functions refuse them).
_UNUSABLE = re.compile("[\x00\ud800-\udfff]")


class WorkflowError(InvalidInputError):
    """A workflow file that cannot be run as written; the message says where and why."""


@dataclass(frozen=True)
class Node:
    """A value of the file and where it starts (1-based line and column).

    ``value`` is a plain scalar (str, int, float, bool, None), a list of
    nodes, or a dict of key to node (keys are strings). An aliased value is
    one node shared by every place that refers to it.
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


def read_workflow_text(path: str | os.PathLike[str]) -> str:
    """The text of the workflow file at ``path``: at most :data:`MAX_WORKFLOW_BYTES`, UTF-8.

    The read stops one byte past the limit, so a huge file, ``/dev/zero`` or a
    pipe that never ends costs no more than the limit.
    """
    path = os.fspath(path)
    # Messages start "FILE:LINE:COLUMN:" as compilers write them: the path escaped, not quoted.
    name = printable_text(path, limit=PATH_LIMIT)
    try:
        with Path(path).open("rb") as file:
            data = file.read(MAX_WORKFLOW_BYTES + 1)
    except FileNotFoundError:
        raise WorkflowError(f"{name}: no such workflow file") from None
    except OSError as exc:
        raise WorkflowError(
            f"{name}: cannot read the workflow file: {exc.strerror or type(exc).__name__}"
        ) from None
    if len(data) > MAX_WORKFLOW_BYTES:
        raise _too_long(name, data)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        if data.startswith((b"\xff\xfe", b"\xfe\xff")):
            raise WorkflowError(
                f"{name}:1:1: the file is UTF-16 or UTF-32 (it starts with that byte-order "
                "mark); save it as UTF-8"
            ) from None
        line, column = _position(data, exc.start)
        raise WorkflowError(
            f"{name}:{line}:{column}: not UTF-8 text (byte 0x{data[exc.start]:02x}); "
            "save the workflow file as UTF-8"
        ) from None


def load_nodes(text: str, file: str) -> Node:
    """Parse ``text`` (the contents of ``file``) into a :class:`Node` tree, within the limits."""
    # Every message and Node.where starts with the file name: escaped once, here.
    file = printable_text(file, limit=PATH_LIMIT)
    if len(text) > MAX_WORKFLOW_BYTES or len(_utf8(text)) > MAX_WORKFLOW_BYTES:
        raise _too_long(file, _utf8(text[: MAX_WORKFLOW_BYTES + 1]))
    try:
        loader = _Loader(text, file)  # the reader checks every character here
    except yaml.reader.ReaderError as exc:
        raise _unprintable(exc, text, file) from None
    try:
        root = loader.get_single_node()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f"{file}:{mark.line + 1}:{mark.column + 1}" if mark is not None else file
        # PyYAML's context says what it was reading and where that started ("found duplicate
        # anchor 'x'; first occurrence" at 4:20); the problem alone may not say what is wrong.
        said = [] if exc.context is None else [str(exc.context) + _at(exc.context_mark)]
        said += [] if exc.problem is None else [str(exc.problem)]
        problem = printable_text(", ".join(said), limit=PATH_LIMIT)  # may quote the file's text
        raise WorkflowError(f"{where}: not valid YAML: {problem}") from None
    except WorkflowError:  # the limits and tags, checked as the file is composed
        raise
    except (ValueError, OverflowError) as exc:
        # PyYAML's scanner calls chr() on the number of a \U escape: past U+10FFFF it fails
        # with ValueError (or OverflowError past 2**31) instead of a YAML error.
        if not isinstance(exc, OverflowError) and "chr()" not in str(exc):
            raise  # not that: a bug to see, not a message to guess
        mark = loader.get_mark()
        raise WorkflowError(
            f"{file}:{mark.line + 1}:{mark.column + 1}: not valid YAML: invalid escape: a code "
            "point beyond U+10FFFF; Unicode ends there (write \\U0010FFFF at most)"
        ) from None
    except yaml.YAMLError as exc:
        raise WorkflowError(
            f"{file}: not valid YAML: {printable_text(str(exc), limit=PATH_LIMIT)}"
        ) from None
    if root is None:
        raise WorkflowError(
            f"{file}: the file is empty; a workflow needs version, store and stages"
        )
    return _Converter(file, loader).convert(root)


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, composing within the limits and refusing unsupported tags.

    Each node counts one value; an alias counts the values of the node it
    refers to, and reaches as deep below itself as that node does, so what
    the limits see is the file with its aliases expanded, while nothing is
    expanded. The checks run before PyYAML descends into a node, so its
    recursive composer never nests deeper than the depth limit.
    """

    def __init__(self, text: str, file: str) -> None:
        super().__init__(text)
        self.file = file
        #: Values composed so far, each alias counting what it stands for.
        self.values = 0
        #: Characters of scalars composed so far, each alias counting what it stands for.
        self.chars = 0
        #: Collections open around the node being composed.
        self.level = 0
        #: The deepest level reached inside the node being composed.
        self.deepest = 0
        #: Each anchor's node once composed: its values, characters and the levels it spans.
        self.extents: dict[str, tuple[int, int, int]] = {}
        #: The ids of scalar nodes whose tag the file wrote (the rest were resolved).
        self.tagged: set[int] = set()

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        event = self.peek_event()  # type: ignore[no-untyped-call]
        if isinstance(event, yaml.AliasEvent):
            self._alias(event)
            return super().compose_node(parent, index)
        self._tag(event)
        start, chars, outer, level = self.values, self.chars, self.deepest, self.level
        self._count(1, event.start_mark)
        if isinstance(event, yaml.ScalarEvent):
            self._text(len(event.value), event.start_mark)
        self.deepest = level
        if isinstance(event, yaml.SequenceStartEvent | yaml.MappingStartEvent):
            self.level += 1
            self._reach(self.level, event.start_mark)
        node = super().compose_node(parent, index)
        self.level = level
        if isinstance(event, yaml.ScalarEvent) and event.tag not in (None, "!"):
            self.tagged.add(id(node))
        if event.anchor is not None:
            extent = (self.values - start, self.chars - chars, self.deepest - level)
            self.extents[event.anchor] = extent
        self.deepest = max(outer, self.deepest)
        return node

    def _alias(self, event: yaml.AliasEvent) -> None:
        anchor = event.anchor
        if anchor is None:  # PyYAML names the anchor of every alias
            return
        extent = self.extents.get(anchor)
        if extent is None:
            if anchor in self.anchors:  # still open: the alias is inside its own anchor
                first = self.anchors[anchor].start_mark
                name = _anchor(anchor)
                raise self._error(
                    event.start_mark,
                    f"the alias *{name} refers to a node that holds it (&{name} at "
                    f"{first.line + 1}:{first.column + 1}); a value cannot contain itself",
                )
            return  # an undefined alias: PyYAML's own error says so
        values, chars, levels = extent
        self._count(values, event.start_mark, anchor)
        self._text(chars, event.start_mark, anchor)
        self._reach(self.level + levels, event.start_mark, anchor)

    def _count(self, values: int, mark: _Mark, alias: str | None = None) -> None:
        self.values += values
        if self.values <= MAX_WORKFLOW_VALUES:
            return
        if alias is not None:
            raise self._error(
                mark,
                f"the alias *{_anchor(alias)} repeats {values:,} values, taking the file past "
                f"{MAX_WORKFLOW_VALUES:,} values with its aliases expanded, the most a "
                "workflow file may hold; alias smaller values, or split the workflow",
            )
        raise self._error(
            mark,
            f"the file holds more than {MAX_WORKFLOW_VALUES:,} values (scalars, keys, "
            "lists and mappings), the most a workflow file may hold; split the workflow",
        )

    def _text(self, chars: int, mark: _Mark, alias: str | None = None) -> None:
        # Each copy of a value a stage gets is this text again: count it as the values are.
        self.chars += chars
        if self.chars <= MAX_WORKFLOW_TEXT:
            return
        if alias is not None:
            raise self._error(
                mark,
                f"the alias *{_anchor(alias)} repeats {chars:,} characters of text, taking the "
                f"file past {MAX_WORKFLOW_TEXT:,} characters with its aliases expanded, the most "
                "a workflow file may hold; alias shorter text, or split the workflow",
            )
        raise self._error(
            mark,
            f"the file holds more than {MAX_WORKFLOW_TEXT:,} characters of text, the most a "
            "workflow file may hold; split the workflow",
        )

    def _reach(self, level: int, mark: _Mark, alias: str | None = None) -> None:
        self.deepest = max(self.deepest, level)
        if level <= MAX_WORKFLOW_DEPTH:
            return
        through = f" (through the alias *{_anchor(alias)})" if alias is not None else ""
        raise self._error(
            mark,
            f"lists and mappings nest deeper than {MAX_WORKFLOW_DEPTH} levels here{through}, "
            f"the most a workflow file may nest; flatten the value",
        )

    def _tag(self, event: yaml.Event) -> None:
        tag = getattr(event, "tag", None)
        if tag is None or tag == "!" or tag in _TAGS.get(type(event), ()):
            return
        raise self._error(
            event.start_mark,
            f"the tag {_short(tag)} is not supported: workflow files hold plain strings, "
            "numbers, booleans, null, lists and mappings; remove the tag",
        )

    def _error(self, mark: _Mark, message: str) -> WorkflowError:
        if mark is None:  # PyYAML marks every event; no position is still an error
            return WorkflowError(f"{self.file}: {message}")
        return WorkflowError(f"{self.file}:{mark.line + 1}:{mark.column + 1}: {message}")


class _Converter:
    """PyYAML nodes to :class:`Node` values, for one file; an aliased node converts once."""

    def __init__(self, file: str, loader: _Loader) -> None:
        self.file = file
        self.loader = loader
        #: Converted nodes by the id of their PyYAML node: aliases share, never copy.
        self.done: dict[int, Node] = {}

    def convert(self, node: yaml.Node) -> Node:
        done = self.done.get(id(node))
        if done is not None:
            return done
        line, column = node.start_mark.line + 1, node.start_mark.column + 1
        if isinstance(node, yaml.MappingNode):
            converted = self._mapping(node, line, column)
        elif isinstance(node, yaml.SequenceNode):
            converted = Node([self.convert(item) for item in node.value], self.file, line, column)
        else:
            converted = self._scalar(node, line, column)
        self.done[id(node)] = converted
        return converted

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
                    f"{printable(key.value)} appears twice in this mapping (first at {first.where})"
                )
            values[key.value] = self.convert(value_node)
            keys[key.value] = key
        return Node(values, self.file, line, column, keys)

    def _scalar(self, node: yaml.Node, line: int, column: int) -> Node:
        where = f"{self.file}:{line}:{column}"
        operator = _OPERATORS.get(node.tag)
        if operator is not None:
            raise WorkflowError(
                f"{where}: {printable(node.value)} is YAML's {operator}, which workflow files do "
                f"not support; write the keys out, or quote it ('{node.value}') to make it a string"
            )
        if node.tag in (_CORE + "int", _CORE + "float") and (
            len(node.value) > MAX_WORKFLOW_NUMBER_CHARS
        ):
            raise WorkflowError(
                f"{where}: a number of {len(node.value):,} characters; a number in a workflow file "
                f"has at most {MAX_WORKFLOW_NUMBER_CHARS} characters (quote it to make it a string)"
            )
        try:
            value = self.loader.construct_object(node)
        except yaml.constructor.ConstructorError as exc:
            raise WorkflowError(f"{where}: {exc.problem}") from None
        except (ValueError, KeyError, IndexError):  # e.g. !!int 'x': the tag's converter fails
            if id(node) not in self.loader.tagged:  # e.g. 2001-13-45: read as a timestamp
                raise WorkflowError(
                    f"{where}: {_brief(node.value)} reads as a {_short(node.tag)} but is not a "
                    "valid one; quote it to make it a string, or fix the value"
                ) from None
            raise WorkflowError(
                f"{where}: {_brief(node.value)} is not a valid {_short(node.tag)}; "
                "remove the tag or fix the value"
            ) from None
        if not isinstance(value, str | int | float | bool) and value is not None:
            # Timestamps: YAML types a workflow never needs; say so rather than guess.
            raise WorkflowError(
                f"{where}: {type(value).__name__} values are not supported here; "
                "quote it to make it a string"
            )
        if isinstance(value, str) and (bad := _UNUSABLE.search(value)) is not None:
            raise WorkflowError(
                f"{where}: the string holds U+{ord(bad.group()):04X} (an escape such as \\0 or "
                "\\ud800 makes it), which no path, name or option can hold; remove it"
            )
        return Node(value, self.file, line, column)


def _short(tag: str) -> str:
    """``!!int`` for ``tag:yaml.org,2002:int``, as the file would write it."""
    return "!!" + tag.removeprefix(_CORE) if tag.startswith(_CORE) else tag


def _anchor(name: str) -> str:
    """An anchor's name as messages show it: anchors may be as long as the file."""
    return printable_text(name, limit=NAME_LIMIT)


def _at(mark: _Mark) -> str:
    """`` at LINE:COLUMN`` of ``mark``, or nothing without one."""
    return "" if mark is None else f" at {mark.line + 1}:{mark.column + 1}"


def _brief(value: str) -> str:
    """``value`` quoted, cut short: messages stay one line whatever the file holds."""
    return repr(value) if len(value) <= 40 else repr(value[:40]) + "..."


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


def _position(data: bytes, offset: int) -> tuple[int, int]:
    """The 1-based line and column (in characters) of byte ``offset`` of ``data``."""
    start = data.rfind(b"\n", 0, offset) + 1
    column = len(data[start:offset].decode("utf-8", "replace")) + 1
    return data.count(b"\n", 0, offset) + 1, column


def _too_long(file: str, data: bytes) -> WorkflowError:
    line, column = _position(data, MAX_WORKFLOW_BYTES)
    return WorkflowError(
        f"{file}:{line}:{column}: the file goes on past {MAX_WORKFLOW_BYTES:,} bytes, the most "
        "a workflow file may hold (workflows take a few kilobytes); check that this is the "
        "workflow file, or split the work into several"
    )


def _unprintable(exc: yaml.reader.ReaderError, text: str, file: str) -> WorkflowError:
    start = text.rfind("\n", 0, exc.position) + 1
    line, column = text.count("\n", 0, exc.position) + 1, exc.position - start + 1
    return WorkflowError(
        f"{file}:{line}:{column}: not valid YAML: the character U+{exc.character:04X} is not "
        "allowed in YAML text; remove it, or write it as an escape in a double-quoted string"
    )
