"""Every code block of the README and the documentation pages runs, so the docs cannot drift.

Per page, in a fresh temporary working directory and in the page's order:

- ```` ```python ```` blocks are executed in one namespace (a page's blocks build on each
  other);
- ```` ```bash ````, ```` ```sh ```` and ```` ```console ```` blocks are shell commands
  (``console``: the lines after ``$ ``; the others are the output shown), each run with bash and
  expected to exit 0, with ``gradpipe`` and ``python`` taken from this test's environment.

A command is not run when it matches one of the rules in :data:`NOT_RUN`, each saying why
(installing packages, a remote store or scheduler, a server that runs until stopped, ...).
In a ``a && b`` chain the rule applies to its parts, so ``pip install . && gradpipe demo X``
runs ``gradpipe demo X``. A Python block whose info string says ``{not-run}`` is not run
either; :data:`NOT_RUN_PYTHON_BLOCKS` counts them, so a new one is a decision, not a slip.
A block that needs PyTorch runs only where torch is installed. Design notes
(``docs/design``) are kept as written and are not run.

The pages run from a checkout, so the repository's ``workflows/`` folder is copied into the
working directory first (``gradpipe run workflows/quickstart.yaml`` works as written).

A page whose examples take long is listed in :data:`SLOW_PAGES` and runs with
``GRADPIPE_RUN_SLOW=1``, as the other slow tests do.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [
    ROOT / "README.md",
    *sorted(DOCS.glob("*.md")),
    *sorted((DOCS / "user-guide").glob("*.md")),
]

#: Commands the pages show but the test does not run: (pattern, why). Keep it small.
NOT_RUN: list[tuple[str, str]] = [
    (r"^pip install\b", "installs packages: the test runs in the environment it has"),
    (r"\bpython -m pytest\b", "runs the test suite, which this test is part of"),
    (r"^sphinx-build\b", "builds the site: .ci/run builds it strictly"),
    (r"^python -m http\.server\b", "serves the site until stopped"),
    (r"^(ruff|mypy|lint-imports|bash \.ci/run)\b", "development tools, run by .ci/run"),
    (r"^python benchmarks/", "benchmarks take minutes and print figures, not pass/fail"),
    (r"^dask (scheduler|worker)\b", "a long-running Dask server (the dashboard tests start one)"),
    (r"s3://|^export AWS_", "needs a remote S3 store and its credentials"),
    (r"tcp://", "needs a running Dask scheduler at that address"),
]
#: Python blocks marked ``{not-run}`` in their info string, over all pages.
NOT_RUN_PYTHON_BLOCKS = 0
#: Pages whose examples take more than a few seconds on 2 cores.
SLOW_PAGES: frozenset[str] = frozenset()

SHELL = {"bash", "sh", "shell", "console"}
PYTHON = {"python", "py"}
_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    language: str
    options: str
    text: str

    @property
    def where(self) -> str:
        name = self.page.relative_to(ROOT) if self.page.is_relative_to(ROOT) else self.page.name
        return f"{name}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced code blocks of a Markdown page, indented ones (in list items) included."""
    found = []
    lines = page.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence = len(opening["indent"]), opening["fence"]
        info = opening["info"].strip().split(maxsplit=1)
        body = []
        j = i + 1
        while j < len(lines):
            closing = _FENCE.match(lines[j])
            if closing and closing["fence"].startswith(fence) and not closing["info"].strip():
                break
            line = lines[j]
            body.append(line[indent:] if not line[:indent].strip() else line)
            j += 1
        else:
            raise AssertionError(f"{page.relative_to(ROOT)}:{i + 1}: fence never closed")
        language = info[0] if info else ""
        options = info[1] if len(info) > 1 else ""
        found.append(Block(page, i + 1, language, options, "\n".join(body) + "\n"))
        i = j + 1
    return found


def shell_commands(block: Block) -> list[str]:
    """The commands of a shell block, continuation lines joined."""
    commands: list[str] = []
    pending: list[str] | None = None
    for raw in block.text.splitlines():
        line = raw.rstrip()
        if pending is not None:
            pending.append(line)
        elif block.language == "console":
            if not line.startswith("$ "):
                continue  # output
            pending = [line[2:]]
        else:
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            pending = [line]
        if not line.endswith("\\"):
            commands.append("\n".join(pending))
            pending = None
    assert pending is None, f"{block.where}: a command ends with a line continuation"
    return commands


def why_not_run(part: str) -> str | None:
    for pattern, why in NOT_RUN:
        if re.search(pattern, part.strip()):
            return why
    return None


def runnable(command: str) -> str | None:
    """The part of ``a && b && c`` to run, the parts a :data:`NOT_RUN` rule names left out."""
    parts = [part for part in command.split(" && ") if why_not_run(part) is None]
    return " && ".join(parts) if parts else None


def _needs_torch(block: Block) -> bool:
    return bool(re.search(r"^\s*(import torch|from gradpipe\.torch import)", block.text, re.M))


def run_page(page: Path, workdir: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Run the page's blocks in order in ``workdir``; what ran, one line per block/command."""
    monkeypatch.chdir(workdir)
    if not (workdir / "workflows").exists():
        shutil.copytree(ROOT / "workflows", workdir / "workflows")
    env = dict(os.environ)
    # `gradpipe` and `python` are this environment's, whatever PATH the test runs with.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    has_torch = importlib.util.find_spec("torch") is not None
    namespace: dict[str, object] = {"__name__": "__docs__"}
    ran = []
    for block in blocks(page):
        if block.language in PYTHON:
            if "{not-run}" in block.options:
                continue
            if _needs_torch(block) and not has_torch:
                ran.append(f"{block.where}: skipped, needs torch")
                continue
            code = compile(block.text, block.where, "exec")
            exec(code, namespace)
            ran.append(f"{block.where}: python")
        elif block.language in SHELL:
            for command in shell_commands(block):
                part = runnable(command)
                if part is None:
                    continue
                outcome = subprocess.run(
                    ["bash", "-euo", "pipefail", "-c", part],
                    cwd=workdir,
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=300,
                    check=False,
                )
                assert outcome.returncode == 0, (
                    f"{block.where}: `{part}` exited {outcome.returncode}\n"
                    f"stdout:\n{outcome.stdout[-3000:]}\nstderr:\n{outcome.stderr[-3000:]}"
                )
                ran.append(f"{block.where}: $ {part}")
    return ran


def _page_param(page: Path) -> object:
    name = str(page.relative_to(ROOT))
    marks = [pytest.mark.slow] if name in SLOW_PAGES else []
    return pytest.param(page, id=name, marks=marks)


@pytest.mark.parametrize("page", [_page_param(page) for page in PAGES])
def test_page_examples_run(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ran = run_page(page, tmp_path, monkeypatch)
    code = [b for b in blocks(page) if b.language in PYTHON | SHELL]
    if code:  # a page with examples runs at least one of them
        assert ran, f"{page.relative_to(ROOT)}: none of its {len(code)} code blocks ran"


def test_every_page_is_found() -> None:
    names = {str(page.relative_to(ROOT)) for page in PAGES}
    assert {"README.md", "docs/getting-started.md", "docs/user-guide/ingest.md"} <= names
    assert names >= SLOW_PAGES


def test_not_run_python_blocks_are_counted() -> None:
    marked = [
        block.where
        for page in PAGES
        for block in blocks(page)
        if block.language in PYTHON and "{not-run}" in block.options
    ]
    assert len(marked) == NOT_RUN_PYTHON_BLOCKS, marked


def test_the_rules_leave_the_pages_commands_runnable() -> None:
    """The rules skip what they say and nothing else: each gradpipe command runs."""
    demo = "gradpipe demo ./gradpipe-demo"
    assert runnable(f"pip install . && {demo}") == demo
    assert runnable('pip install -e ".[test]" && python -m pytest') is None
    assert runnable("gradpipe ingest s3://b/x 'p/{step}/{peer}.npy' --run r") is None
    assert runnable("gradpipe ls ./store") == "gradpipe ls ./store"


def test_a_broken_example_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner reports a failing block with its page and line."""
    page = tmp_path / "page.md"
    page.write_text(
        "```python\nx = 1\n```\n\n```python\nassert x == 2, 'the docs drifted'\n```\n",
        encoding="utf-8",
    )
    with pytest.raises(AssertionError, match="the docs drifted"):
        run_page(page, tmp_path, monkeypatch)
    page.write_text("```console\n$ gradpipe ls ./no-such-store\n```\n", encoding="utf-8")
    with pytest.raises(AssertionError, match=r"page\.md:1: `gradpipe ls ./no-such-store` exited 2"):
        run_page(page, tmp_path, monkeypatch)


def test_the_api_reference_lists_every_public_name() -> None:
    """docs/api.md documents each name of ``gradpipe.__all__`` as ``gradpipe.X``."""
    import gradpipe

    listed = set(re.findall(r"^ {3}gradpipe\.(\w+)$", (DOCS / "api.md").read_text("utf-8"), re.M))
    public = set(gradpipe.__all__) - {"__version__"}
    assert public - listed == set(), "public names missing from docs/api.md"
    assert listed - public <= {"xarray", "torch", "dashboard", "testing"}, "not public"


def test_workflow_files_in_the_docs_are_valid(tmp_path: Path) -> None:
    """YAML blocks that are workflow files parse and check as gradpipe run would load them."""
    from gradpipe.workflow import load_workflow

    found = [b for page in PAGES for b in blocks(page) if b.language in ("yaml", "yml")]
    workflows = [b for b in found if b.text.lstrip().startswith("version:")]
    assert workflows, "no workflow file in the docs any more: drop this test"
    for block in workflows:
        names = set(re.findall(r"\$\{(\w+)", block.text))
        path = tmp_path / f"{block.line}.yaml"
        path.write_text(block.text, encoding="utf-8")
        try:
            load_workflow(path, env={name: f"placeholder-{name.lower()}" for name in names})
        except Exception as exc:
            raise AssertionError(f"{block.where}: {exc}") from None
