"""Messages that name a ``gradpipe`` command or a ``--flag`` name one that exists.

A message that sends the user to ``gradpipe log`` before there is such a
command, or to ``gc --wait`` before gc has the flag, is a dead end. Every
string literal in the package (docstrings aside: they may describe plans) is
searched for command lines and flags, and each is checked against the parser.
"""

from __future__ import annotations

import argparse
import ast
import re
from collections.abc import Iterator
from pathlib import Path

import gradpipe
from gradpipe.cli import build_parser

PACKAGE = Path(gradpipe.__file__).parent

#: The commands of the contract (DESIGN.md), built or not: ``gradpipe log`` is one.
#: A mention of one of these needs no backticks to count.
CONTRACT_COMMANDS = frozenset(
    [
        "init",
        "ingest",
        "ls",
        "export",
        "aggregate",
        "rounds",
        "snapshot",
        "restore",
        "log",
        "prune",
        "stats",
        "evaluate",
        "verify",
        "gc",
        "run",
        "demo",
    ]
)

# `gradpipe WORD ...` in backticks, or gradpipe + a contract command anywhere; the
# command line it starts runs to a backtick, a |, a ; or a parenthesis.
_BACKTICKED = re.compile(r"`gradpipe ([a-z][a-z-]*)([^`]*)`")
_BARE = re.compile(r"\bgradpipe ([a-z][a-z-]*)([^`|;()\n]*)")
# A command word right before a flag, as in "(gc --wait, ...)".
_COMMAND_FLAG = re.compile(r"(?<![\w.-])([a-z][a-z-]*) (--[a-z][a-z0-9-]*)")
_FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def _option_strings(parser: argparse.ArgumentParser) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings}


def _command_table() -> tuple[dict[str, set[str]], set[str]]:
    parser = build_parser()
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    commands = {name: _option_strings(p) for name, p in sub.choices.items()}
    return commands, _option_strings(parser)


#: Modules that are programs of their own (``python -m ...``), with flags of their own.
OWN_PROGRAMS = {"testing/trainer.py"}


def _messages() -> Iterator[tuple[str, str]]:
    """``(where, text)`` of every string literal but docstrings; f-string fields read ``{}``."""
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).as_posix() in OWN_PROGRAMS:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        skip: set[int] = set()
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            if (
                isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
                and body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
            ):
                skip.add(id(body[0].value))
            if isinstance(node, ast.JoinedStr):
                skip.update(id(part) for part in node.values)
        for node in ast.walk(tree):
            if isinstance(node, ast.JoinedStr):
                text = "".join(
                    part.value if isinstance(part, ast.Constant) else "{}" for part in node.values
                )
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                if id(node) in skip:
                    continue
                text = node.value
            else:
                continue
            yield f"{path.relative_to(PACKAGE.parent)}:{node.lineno}", text


def mentions(text: str, commands: set[str]) -> Iterator[tuple[str, list[str]]]:
    """``(command, flags)`` of every gradpipe command line, and command + flag, in ``text``."""
    rest = text
    for pattern, any_word in ((_BACKTICKED, True), (_BARE, False)):
        for match in pattern.finditer(rest):
            if any_word or match[1] in CONTRACT_COMMANDS:
                yield match[1], _FLAG.findall(match[2])
                # Blank it out: its arguments ("--run demo --step") are not "demo --step".
                rest = rest[: match.start()] + " " * len(match[0]) + rest[match.end() :]
    for match in _COMMAND_FLAG.finditer(rest):
        if match[1] in commands:
            yield match[1], [match[2]]


def test_the_search_finds_what_it_should() -> None:
    """The patterns themselves, on the kinds of message they must catch and leave alone."""
    commands = {"gc", "verify", "init", "export"}
    found = list(
        mentions(
            "run `gradpipe verify`, or `gradpipe log {} --all`; raise the wait (gc --wait, "
            "gradpipe.lock.wait); this gradpipe reads version 2; next: gradpipe export {} "
            "--run demo --step 0 | gradpipe snapshot",
            commands,
        )
    )
    assert found == [
        ("verify", []),
        ("log", ["--all"]),
        ("export", ["--run", "--step"]),
        ("snapshot", []),
        ("gc", ["--wait"]),
    ]


def test_messages_name_only_commands_and_flags_that_exist() -> None:
    commands, top_level = _command_table()
    every_flag = set().union(top_level, *commands.values())
    wrong = []
    for where, text in _messages():
        for command, flags in mentions(text, set(commands)):
            if command not in commands:
                wrong.append(f"{where}: `gradpipe {command}` is not a command: {text!r}")
                continue
            wrong += [
                f"{where}: `gradpipe {command}` has no {flag}: {text!r}"
                for flag in flags
                if flag not in commands[command]
            ]
        wrong += [
            f"{where}: no command has {flag}: {text!r}"
            for flag in _FLAG.findall(text)
            if flag not in every_flag
        ]
    assert not wrong, "\n".join(wrong)
