"""The value types of a workflow file: each parses a node (with its position) and describes
itself as JSON Schema, so the validator and the shipped schema can never disagree.

``${NAME}`` in a string is replaced by the environment variable ``NAME``, and
``${NAME:-default}`` by ``default`` when it is not set (``$$`` is a literal
``$``); a variable that is not set and has no default is an error at its position.
Values that came from the environment are never printed: the plan and the
report show the text as written in the file.

Text that parsing makes (each substitution's result, each path joined to the
file's folder) is new text the file's own limits never saw: an alias or a
``${BIG}`` repeated in every stage would copy it thousands of times. It is
charged to the :class:`Context`'s budget of :data:`MAX_WORKFLOW_TEXT`
characters, refused at the value that passes it.
"""

from __future__ import annotations

import importlib.util
import math
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gradpipe.core.display import printable
from gradpipe.workflow._yaml import MAX_WORKFLOW_TEXT, Node, WorkflowError

__all__ = [
    "Bool",
    "Choice",
    "Context",
    "Duration",
    "Field",
    "Float",
    "Int",
    "LocalPath",
    "NumberMap",
    "Options",
    "PathOrUrl",
    "Size",
    "StepRange",
    "Str",
    "StrList",
    "TextBudget",
]

_ENV = re.compile(r"\$(\$|\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\})")


def _has_digit(value: str | float) -> bool:
    """Whether a duration or size has a number in it (text without one is no amount)."""
    return not isinstance(value, str) or any(c.isdigit() for c in value)


@dataclass
class TextBudget:
    """How many characters of new text parsing one file may still make."""

    left: int = MAX_WORKFLOW_TEXT

    def charge(self, node: Node, chars: int) -> None:
        """Spend ``chars`` on the value of ``node``; past the budget, an error there."""
        self.left -= chars
        if self.left < 0:
            raise node.error(
                f"the values made from this workflow file (${{VAR}} substituted, paths joined "
                f"to the file's folder) pass {MAX_WORKFLOW_TEXT:,} characters, the most one "
                "workflow may make; use shorter values or variables, or fewer stages"
            )


@dataclass(frozen=True)
class Context:
    """What parsing needs beside the node: the environment, the file's folder, the budget."""

    env: Mapping[str, str]
    base: Path
    #: The new text parsing may still make (shared by every value of the file).
    budget: TextBudget = field(default_factory=TextBudget, compare=False)


def substitute(node: Node, ctx: Context) -> str:
    """The string of ``node`` with ``${NAME}`` replaced from the environment.

    Each variable's value is new text, charged to ``ctx.budget`` as it is
    put in, so ``${BIG}`` written 30,000 times in one string is refused
    before the string is made (the text around it the file wrote, and the
    loader counted). A string without ``$`` is returned as it is.
    """
    text: str = node.value
    if "$" not in text:
        return text

    def one(match: re.Match[str]) -> str:
        if match.group(1) == "$":
            return "$"
        name, default = match.group(2), match.group(3)
        if default is not None and not ctx.env.get(name):  # as the shell: unset or empty
            value = default
        elif name not in ctx.env:
            raise node.error(f"environment variable {name} is not set (used as ${{{name}}})")
        else:
            value = ctx.env[name]
        ctx.budget.charge(node, len(value))
        return value

    return _ENV.sub(one, text)


class Field(ABC):
    """One value type: ``parse`` checks a node and returns the value the stage gets."""

    help: str = ""

    @abstractmethod
    def parse(self, node: Node, ctx: Context) -> Any:
        """The value of ``node``, checked (raises :class:`WorkflowError` where it is wrong)."""

    @abstractmethod
    def schema(self) -> dict[str, Any]:
        """This type as JSON Schema."""

    def _wrong(self, node: Node, wanted: str) -> WorkflowError:
        return node.error(f"expected {wanted}, got {node.kind} ({printable(node.plain())})")


@dataclass(frozen=True)
class Str(Field):
    help: str = ""
    pattern: str | None = None  # a regex the value must match (after substitution)

    def parse(self, node: Node, ctx: Context) -> str:
        if not isinstance(node.value, str):
            raise self._wrong(node, "a string")
        value = substitute(node, ctx)
        if self.pattern is not None and not re.fullmatch(self.pattern, value):
            raise node.error(f"{printable(node.value)} is not valid here: {self.help}")
        return value

    def schema(self) -> dict[str, Any]:
        return {"type": "string", "description": self.help}


@dataclass(frozen=True)
class PathOrUrl(Field):
    """A local path (relative to the workflow file's folder) or a URL, kept as a string."""

    help: str = ""

    def parse(self, node: Node, ctx: Context) -> str:
        value = Str(self.help).parse(node, ctx)
        if not value:
            raise node.error("an empty path")
        if "://" in value or Path(value).is_absolute():
            return value
        joined = str(ctx.base / value)
        ctx.budget.charge(node, len(joined))
        return joined

    def schema(self) -> dict[str, Any]:
        return {"type": "string", "description": self.help}


@dataclass(frozen=True)
class LocalPath(Field):
    """A path on this machine (relative to the workflow file's folder): outputs, sample data.

    ``needs`` names a module that writing it takes, installed by gradpipe's extra ``extra``
    (a plot needs matplotlib): :func:`gradpipe.workflow.run.run_workflow` checks it for the
    stages it is about to run (``--dry-run`` included) before anything is written.
    """

    help: str = ""
    needs: str = ""
    extra: str = ""

    def parse(self, node: Node, ctx: Context) -> str:
        value = PathOrUrl(self.help).parse(node, ctx)
        if "://" in value:
            raise node.error(
                f"{printable(node.value)}: a local path is needed here ({self.help}), not a URL"
            )
        return value

    def missing(self) -> str | None:
        """What to install for this field here (``needs`` not importable), else None."""
        if not self.needs:
            return None
        try:
            found = importlib.util.find_spec(self.needs) is not None
        except (ImportError, ValueError):  # a stub module without a spec, a broken parent
            found = False
        if found:
            return None
        return (
            f"needs {self.needs}, which is not installed here: pip install 'gradpipe[{self.extra}]'"
        )

    def schema(self) -> dict[str, Any]:
        return {"type": "string", "description": self.help}


@dataclass(frozen=True)
class Bool(Field):
    help: str = ""

    def parse(self, node: Node, ctx: Context) -> bool:
        if not isinstance(node.value, bool):
            raise self._wrong(node, "true or false")
        return node.value

    def schema(self) -> dict[str, Any]:
        return {"type": "boolean", "description": self.help}


@dataclass(frozen=True)
class Int(Field):
    help: str = ""
    low: int = 0
    high: int | None = None

    def parse(self, node: Node, ctx: Context) -> int:
        if isinstance(node.value, bool) or not isinstance(node.value, int):
            raise self._wrong(node, "an integer")
        if node.value < self.low:
            raise node.error(f"{node.value} must be >= {self.low}")
        if self.high is not None and node.value > self.high:
            raise node.error(f"{node.value} is more than {self.high}, the most allowed here")
        return node.value

    def schema(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": "integer", "minimum": self.low, "description": self.help}
        if self.high is not None:
            out["maximum"] = self.high
        return out


@dataclass(frozen=True)
class Float(Field):
    """A finite number in ``[low, high]``, an end excluded when its ``*_open`` is true."""

    help: str = ""
    low: float = -math.inf
    positive: bool = False  # > 0 rather than >= low
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False

    def parse(self, node: Node, ctx: Context) -> float:
        if isinstance(node.value, bool) or not isinstance(node.value, int | float):
            raise self._wrong(node, "a number")
        try:
            value = float(node.value)
        except OverflowError:  # an integer of more than 308 digits
            raise node.error("the number is beyond float64's range (1.8e308)") from None
        if not math.isfinite(value):
            raise node.error(f"{printable(node.value)} must be a finite number")
        if self.positive and value <= 0:
            raise node.error(f"{printable(node.value)} must be > 0")
        if value < self.low or (self.low_open and value == self.low):
            raise node.error(
                f"{printable(node.value)} must be {'>' if self.low_open else '>='} {self.low}"
            )
        if value > self.high or (self.high_open and value == self.high):
            raise node.error(
                f"{printable(node.value)} must be {'<' if self.high_open else '<='} {self.high}"
            )
        return value

    def schema(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": "number", "description": self.help}
        if self.positive:
            out["exclusiveMinimum"] = 0
        elif math.isfinite(self.low):
            out["exclusiveMinimum" if self.low_open else "minimum"] = self.low
        if math.isfinite(self.high):
            out["exclusiveMaximum" if self.high_open else "maximum"] = self.high
        return out


@dataclass(frozen=True)
class Choice(Field):
    choices: tuple[str, ...] = ()
    help: str = ""

    def parse(self, node: Node, ctx: Context) -> str:
        if not isinstance(node.value, str):
            raise self._wrong(node, f"one of {', '.join(self.choices)}")
        if node.value not in self.choices:
            raise node.error(f"{printable(node.value)} is not one of {', '.join(self.choices)}")
        return node.value

    def schema(self) -> dict[str, Any]:
        return {"enum": list(self.choices), "description": self.help}


@dataclass(frozen=True)
class Duration(Field):
    """Seconds, as a number or text such as ``"24h"``, ``"90s"``, ``"5m"``."""

    help: str = ""
    high: float | None = None  # seconds

    def parse(self, node: Node, ctx: Context) -> float:
        from dask.utils import parse_timedelta

        value = node.value
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            raise self._wrong(node, 'a duration (seconds, or text like "24h")')
        given = substitute(node, ctx) if isinstance(value, str) else value
        try:
            if not _has_digit(given):  # dask fails on "" and reads "h" as an hour
                raise ValueError(given)
            seconds = float(parse_timedelta(given, default="s"))
        except (ValueError, KeyError, TypeError, IndexError, OverflowError):
            raise node.error(
                f'{printable(value)} is not a duration; write e.g. 90, "90s", "5m" or "24h"'
            ) from None
        if not math.isfinite(seconds) or seconds < 0:
            raise node.error(f"{printable(value)} must be a duration >= 0")
        if self.high is not None and seconds > self.high:
            raise node.error(
                f"{printable(value)} is longer than {self.high:g} s, the most allowed here"
            )
        return seconds

    def schema(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": ["number", "string"], "description": self.help}
        if self.high is not None:
            out["maximum"] = self.high  # applies to numbers; text is checked when parsed
        return out


@dataclass(frozen=True)
class Size(Field):
    """Bytes, as an integer or text such as ``"4 MiB"``."""

    help: str = ""

    def parse(self, node: Node, ctx: Context) -> int:
        from dask.utils import parse_bytes

        value = node.value
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise self._wrong(node, 'a size (bytes, or text like "4 MiB")')
        given = substitute(node, ctx) if isinstance(value, str) else value
        try:
            if not _has_digit(given):  # dask reads "" as one byte and "kB" as 1000
                raise ValueError(given)
            size = parse_bytes(given)
        except (ValueError, TypeError, OverflowError):
            raise node.error(
                f'{printable(value)} is not a size; write e.g. 4194304 or "4 MiB"'
            ) from None
        if size < 1:
            raise node.error(f"{printable(value)} must be at least one byte")
        return int(size)

    def schema(self) -> dict[str, Any]:
        return {"type": ["integer", "string"], "description": self.help}


@dataclass(frozen=True)
class StepRange(Field):
    """A half-open range of steps, ``"A:B"``."""

    help: str = ""

    def parse(self, node: Node, ctx: Context) -> range:
        text = node.value
        match = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", text) if isinstance(text, str) else None
        if match is None:
            raise node.error(
                f'{printable(text)} is not a step range; write "A:B" (half-open), e.g. "0:10"'
            )
        try:
            first, last = int(match.group(1)), int(match.group(2))
        except ValueError:  # more digits than Python converts (4300): no step is that large
            raise node.error(
                'a step range whose numbers are too long to be steps; write "A:B", e.g. "0:10"'
            ) from None
        if last <= first:
            raise node.error(f"step range {printable(text)} needs A < B")
        return range(first, last)

    def schema(self) -> dict[str, Any]:
        return {"type": "string", "pattern": r"^\s*\d+\s*:\s*\d+\s*$", "description": self.help}


@dataclass(frozen=True)
class StrList(Field):
    help: str = ""

    def parse(self, node: Node, ctx: Context) -> list[str]:
        if not isinstance(node.value, list) or not node.value:
            raise self._wrong(node, "a non-empty list of strings")
        return [Str().parse(item, ctx) for item in node.value]

    def schema(self) -> dict[str, Any]:
        return {
            "type": "array",
            "items": {"type": "string"},
            "minItems": 1,
            "description": self.help,
        }


@dataclass(frozen=True)
class NumberMap(Field):
    """A mapping of names to finite numbers > 0 (peer weights)."""

    help: str = ""

    def parse(self, node: Node, ctx: Context) -> dict[str, float]:
        if not isinstance(node.value, dict) or not node.value:
            raise self._wrong(node, "a mapping of names to numbers")
        positive = Float(positive=True)
        return {k: positive.parse(v, ctx) for k, v in node.value.items()}

    def schema(self) -> dict[str, Any]:
        return {
            "type": "object",
            "additionalProperties": {"type": "number", "exclusiveMinimum": 0},
            "description": self.help,
        }


@dataclass(frozen=True)
class Options(Field):
    """fsspec storage options: a mapping of strings to scalars or nested mappings.

    Values are substituted from the environment (credentials) and never printed.
    """

    help: str = ""

    def parse(self, node: Node, ctx: Context) -> dict[str, Any]:
        if not isinstance(node.value, dict):
            raise self._wrong(node, "a mapping of storage options")
        return {k: self._value(v, ctx) for k, v in node.value.items()}

    def _value(self, node: Node, ctx: Context) -> Any:
        if isinstance(node.value, dict):
            return {k: self._value(v, ctx) for k, v in node.value.items()}
        if isinstance(node.value, list):
            return [self._value(v, ctx) for v in node.value]
        if isinstance(node.value, str):
            return substitute(node, ctx)
        return node.value

    def schema(self) -> dict[str, Any]:
        return {"type": "object", "description": self.help}
