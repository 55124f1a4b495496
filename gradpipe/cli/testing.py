"""Running the ``gradpipe`` command in-process, for tests of its commands (yours and ours).

>>> outcome = run_cli("--version")
>>> outcome.status, outcome.out.startswith("gradpipe ")
(0, True)
>>> run_cli_json("ls", "/nonexistent/store")[0]
2
"""

from __future__ import annotations

import contextlib
import io
import json
from dataclasses import dataclass
from typing import Any

__all__ = ["CliOutcome", "run_cli", "run_cli_json"]


@dataclass(frozen=True)
class CliOutcome:
    """What one ``gradpipe`` invocation did: exit status, stdout, stderr."""

    status: int
    out: str
    err: str

    @property
    def doc(self) -> dict[str, Any]:
        """stdout as the one JSON object ``--json`` promises (fails on anything else)."""
        doc = json.loads(self.out)
        if not isinstance(doc, dict):
            raise TypeError(f"--json printed {type(doc).__name__}, not one object: {self.out!r}")
        return doc

    def error_message(self, command: str | None) -> str:
        """The message of a one-line ``gradpipe <command>: error: <message>`` on stderr.

        Raises :class:`AssertionError` when stderr is anything else: several
        lines, a traceback, another prefix, or an empty message.
        """
        prefix = f"gradpipe {command}: error: " if command else "gradpipe: error: "
        lines = self.err.splitlines()
        if len(lines) != 1 or "Traceback" in self.err or not lines[0].startswith(prefix):
            raise AssertionError(f"expected one line {prefix!r}..., got stderr {self.err!r}")
        message = lines[0][len(prefix) :].strip()
        if not message:
            raise AssertionError(f"empty error message: {self.err!r}")
        return message


def run_cli(*argv: str) -> CliOutcome:
    """Run ``gradpipe *argv`` in this process and capture what it printed.

    ``SystemExit`` (``--help``, ``--version``, usage errors) becomes the status.
    """
    from gradpipe.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(list(argv))
        except SystemExit as exc:
            status = exc.code if isinstance(exc.code, int) else 1
    return CliOutcome(status, out.getvalue(), err.getvalue())


def run_cli_json(*argv: str) -> tuple[int, dict[str, Any]]:
    """Run ``gradpipe *argv --json``: the exit status and the one JSON object on stdout.

    Fails when stdout is anything but one JSON object (see :attr:`CliOutcome.doc`).
    """
    outcome = run_cli(*argv, "--json")
    return outcome.status, outcome.doc
