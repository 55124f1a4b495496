"""The one shape every operation's report has: ``ok``, ``to_dict()``, ``summary()``.

A workflow chains operations and must judge each stage the same way (did it
succeed, what to log, what to print), whatever the operation was; the
command line prints ``summary()``, or ``to_dict()`` with ``--json``, and exits
1 when ``ok`` is false. :class:`Report` is a structural protocol, so a report
needs no base class to conform, and lower layers (``storage.gc``,
``storage.verify``) define theirs without importing operations above them.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = ["Report"]


@runtime_checkable
class Report(Protocol):
    """What an operation did, in a form both programs and people can read.

    ``isinstance(x, Report)`` checks that the three members exist (not their
    types); the public-API tests check every report gradpipe returns.
    """

    @property
    def ok(self) -> bool:
        """True when the operation did everything it was asked to, without failures."""
        ...

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able form, with ``"ok"`` among its keys (what ``--json`` prints)."""
        ...

    def summary(self) -> str:
        """A few lines for people (what the command line prints)."""
        ...
