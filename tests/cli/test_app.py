"""The ``gradpipe`` command as a whole: the command table, --help/--version, and how errors read.

Every command, given bad arguments, exits with the contract's status and says
what went wrong on one line of stderr (``gradpipe <cmd>: error: <message>``),
with one JSON object on stdout under ``--json``, never a traceback.
"""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import gradpipe as gp
import gradpipe.cli
from gradpipe.cli import COMMAND_GROUPS, build_parser
from gradpipe.cli.testing import run_cli
from gradpipe.testing.training import SampleRun

COMMANDS = [
    "init",
    "ls",
    "verify",
    "gc",
    "ingest",
    "aggregate",
    "rounds",
    "evaluate",
    "export",
    "snapshot",
    "restore",
    "log",
    "prune",
    "run",
    "stats",
    "analyze",
    "diff",
    "demo",
]
HEAVY = ("numpy", "dask", "distributed", "xarray", "fsspec", "numcodecs")


def test_every_command_group_module_is_in_the_table() -> None:
    helpers = {"testing"}  # the in-process runner for tests, not a command group
    modules = sorted(
        m.name
        for m in pkgutil.iter_modules(gradpipe.cli.__path__)
        if not m.name.startswith("_") and m.name not in helpers
    )
    assert sorted(COMMAND_GROUPS) == modules
    parser = build_parser()
    [sub] = [a for a in parser._actions if a.dest == "command"]
    assert list(sub.choices) == COMMANDS  # type: ignore[union-attr]


@pytest.mark.parametrize("command", COMMANDS)
def test_help(command: str) -> None:
    outcome = run_cli(command, "--help")
    assert outcome.status == 0
    assert outcome.out.startswith(f"usage: gradpipe {command}")
    assert "--json" in outcome.out
    # Every command names its store; `run` reads it from the workflow file.
    assert ("WORKFLOW.yaml" if command == "run" else "STORE") in outcome.out


def test_top_level_help_and_version() -> None:
    outcome = run_cli("--help")
    assert outcome.status == 0
    for command in COMMANDS:
        assert command in outcome.out
    assert "Exit status" in outcome.out
    outcome = run_cli("--version")
    assert (outcome.status, outcome.out.strip()) == (0, f"gradpipe {gp.__version__}")


@pytest.mark.parametrize(
    "argv", [["--version"], ["--help"], ["ingest", "--help"], ["run", "--help"]]
)
def test_help_and_version_load_no_numpy_or_dask(argv: list[str]) -> None:
    code = (
        "import sys\n"
        "from gradpipe.cli import main\n"
        f"try:\n    main({argv!r})\nexcept SystemExit as e:\n    assert e.code == 0, e.code\n"
        "print(sorted({m.split('.')[0] for m in sys.modules}))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = done.stdout.splitlines()[-1]
    assert "'gradpipe'" in loaded
    for heavy in HEAVY:
        assert f"'{heavy}'" not in loaded, heavy


#: What a command that reads a local store must not load: a cluster client, S3, torch, xarray.
NOT_FOR_READS = ("distributed", "s3fs", "torch", "xarray", "dask")


@pytest.mark.parametrize("command", ["ls", "ls-run", "export"])
def test_reading_commands_load_only_what_they_use(
    command: str, places: dict[str, str], tmp_path: Path
) -> None:
    argv = {
        "ls": ["ls", places["STORE"]],
        "ls-run": ["ls", places["STORE"], "train"],
        "export": [*EXPORT[:1], places["STORE"], *EXPORT[2:], "-o", str(tmp_path / "o.st")],
    }[command]
    code = (
        "import sys\n"
        "from gradpipe.cli import main\n"
        f"assert main({argv!r}) == 0\n"
        "print(sorted({m.split('.')[0] for m in sys.modules}))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = done.stdout.splitlines()[-1]
    assert "'numcodecs'" in loaded  # the check can see what a command loads
    for heavy in NOT_FOR_READS:
        assert f"'{heavy}'" not in loaded, heavy


def test_python_dash_m() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "gradpipe.cli", "--version"],
        check=False,
        capture_output=True,
        text=True,
    )
    assert (done.returncode, done.stdout.strip()) == (0, f"gradpipe {gp.__version__}")
    done = subprocess.run(
        [sys.executable, "-m", "gradpipe.cli", "gc", "no/such/store"],
        check=False,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2
    assert done.stderr.startswith("gradpipe gc: error: no gradpipe store at 'no/such/store'")


def test_no_package_shares_a_name_with_a_public_function() -> None:
    # Every public function stays a function whatever is imported first: no submodule of
    # gradpipe is named after one (they live in feature packages: ingestion, aggregation...).
    code = (
        "import gradpipe as gp, gradpipe.ingestion.api, gradpipe.aggregation.api\n"
        "import gradpipe.snapshots.api, gradpipe.aggregation.rounds, gradpipe.cli.ingest\n"
        "from gradpipe.ingestion.api import IngestReport\n"
        "import pkgutil, types\n"
        "subs = {m.name for m in pkgutil.iter_modules(gp.__path__)}\n"
        "assert not subs & {n for n in gp.__all__ if n.islower()}, subs\n"
        "for n in gp.__all__:\n"
        "    assert not isinstance(getattr(gp, n), types.ModuleType), n\n"
        "assert gp.ingest.__module__ == 'gradpipe.ingestion.api', gp.ingest\n"
        "assert gp.IngestReport is IngestReport\n"
        "assert set(gp.__all__) <= set(dir(gp))\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        gp.nope  # noqa: B018


def test_moved_modules_import_by_their_old_names_with_a_warning() -> None:
    # One release of shims: the old name gives the same module object, with a warning.
    code = (
        "import warnings, gradpipe\n"
        "from gradpipe._moved import MOVED\n"
        "import importlib\n"
        "for old, new in MOVED.items():\n"
        "    with warnings.catch_warnings(record=True) as seen:\n"
        "        warnings.simplefilter('always')\n"
        "        module = importlib.import_module(old)\n"
        "    assert module is importlib.import_module(new), old\n"
        "    assert module.__spec__.name == new, (old, module.__spec__.name)\n"
        "    assert any(issubclass(w.category, DeprecationWarning) and new in str(w.message)\n"
        "               for w in seen), (old, seen)\n"
        "from gradpipe.stats import compression_stats\n"
        "assert compression_stats is gradpipe.compression_stats\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --- bad arguments, every command ---------------------------------------------------
@pytest.fixture(scope="module")
def places(tmp_path_factory: pytest.TempPathFactory, sample: SampleRun) -> dict[str, str]:
    """Placeholders of the argument table: a store with run 'train', a missing one..."""
    root = tmp_path_factory.mktemp("places")
    store = gp.open_store(root / "store", mode="w")
    assert gp.ingest(store, sample.dump_pattern, run="train").ok
    (root / "foreign").mkdir()
    (root / "foreign" / "notes.txt").write_text("mine")
    return {
        "STORE": str(root / "store"),
        "MISSING": str(root / "missing"),
        "FOREIGN": str(root / "foreign"),
        "PATTERN": sample.dump_pattern,
        "OUT": str(root / "out.safetensors"),
        "CWD": str(root),
    }


EXPORT = ["export", "STORE", "--run", "train", "--step", "1", "--peer", "peer0"]

BAD_ARGUMENTS: list[tuple[list[str], int, str]] = [
    ([], 2, "required: COMMAND"),
    (["frobnicate"], 2, "invalid choice"),
    (["init"], 2, "required: STORE"),
    (["init", "ftp://host/x"], 2, "unsupported store URL scheme 'ftp'"),
    (["init", "FOREIGN"], 2, "not a gradpipe store and is not empty"),
    (["init", ""], 2, "non-empty"),
    (["ls", "MISSING"], 2, "gradpipe init"),
    (["ls", "STORE", "--nope"], 2, "unrecognized arguments: --nope"),
    (["ls", "STORE", "-S", "novalue"], 2, "KEY=VALUE"),
    (["ls", "STORE", "../up"], 2, "invalid run name"),
    (["ls", "STORE", "nope"], 1, "no run 'nope'"),
    (["verify", "MISSING"], 2, "no gradpipe store at"),
    (["verify", "STORE", "--all=yes"], 2, "ignored explicit argument"),
    (["gc", "MISSING"], 2, "gradpipe init"),
    (["gc", "STORE", "--grace", "soon"], 2, "is not a duration"),
    (["gc", "STORE", "--dry-run=yes"], 2, "ignored explicit argument"),
    (["ingest", "STORE"], 2, "required: PATTERN"),
    (["ingest", "STORE", "PATTERN"], 2, "required: --run"),
    (["ingest", "STORE", "PATTERN", "--run", "r", "--workers", "-3"], 2, "positive"),
    (["ingest", "STORE", "PATTERN", "--run", "r", "--workers", "many"], 2, "'many'"),
    (["ingest", "STORE", "PATTERN", "--run", "r", "--codec", "nonsense"], 2, "'nonsense'"),
    (["ingest", "STORE", "PATTERN", "--run", "../up"], 2, "invalid run name"),
    (["ingest", "gs://bucket/x", "PATTERN", "--run", "r"], 2, "unsupported store URL scheme"),
    (["ingest", "STORE", "CWD/nothing/{step}/{peer}.npz", "--run", "r"], 1, "no dump file"),
    ([*EXPORT[:5], "x", "--peer", "peer0", "-o", "OUT"], 2, "invalid int value: 'x'"),
    ([*EXPORT, "-o", ""], 2, "-o needs a file name"),
    ([*EXPORT, "-o", "CWD/"], 2, "-o needs a file name"),
    ([*EXPORT, "-o", "STORE/gradpipe.json"], 2, "inside the gradpipe store"),
    ([*EXPORT, "-o", "CWD"], 2, "is a directory"),
    (
        [*EXPORT[:2], "--run", "train", "--step", "1", "-o", "OUT"],
        2,
        "one of the arguments --peer --aggregate is required",
    ),
    ([*EXPORT[:5], "99", "--peer", "peer0", "-o", "OUT"], 1, "no dump for step 99"),
    (["export", "MISSING", *EXPORT[2:], "-o", "OUT"], 2, "gradpipe init"),
    (["demo"], 2, "required: STORE"),
    (["demo", "gs://bucket/x"], 2, "unsupported store URL scheme 'gs'"),
    (["demo", "s3://bucket/x"], 2, "--dumps DIR"),
    (["demo", "CWD/d", "--workers", "0"], 2, "positive"),
    (["demo", "FOREIGN"], 2, "not a gradpipe store"),
]


@pytest.mark.parametrize(
    ("argv", "status", "words"), BAD_ARGUMENTS, ids=[" ".join(a[0]) for a in BAD_ARGUMENTS]
)
def test_bad_arguments(
    argv: list[str],
    status: int,
    words: str,
    places: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(places["CWD"])
    before = sorted(p.name for p in Path(places["CWD"]).iterdir())
    for key, value in places.items():
        argv = [a.replace(key, value) for a in argv]
    command = argv[0] if argv and argv[0] in COMMANDS else None

    outcome = run_cli(*argv)
    assert outcome.status == status
    assert outcome.out == ""
    message = outcome.error_message(command)
    assert words in message

    outcome = run_cli(*argv, "--json")
    assert outcome.status == status
    assert outcome.doc["ok"] is False
    assert outcome.doc["error"] == outcome.error_message(command)
    assert outcome.doc["type"]
    # Nothing was created: no store at a mistyped path, no dumps, no output file.
    assert sorted(p.name for p in Path(places["CWD"]).iterdir()) == before
    assert not Path(places["MISSING"]).exists()


def test_unexpected_errors_still_have_words(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug of ours (an exception with no message) still prints a line that says something."""
    import gradpipe.cli.store

    def broken(args: object) -> None:
        raise AssertionError

    monkeypatch.setattr(gradpipe.cli.store, "run_verify", broken)
    outcome = run_cli("verify", "anywhere")
    assert outcome.status == 1
    message = outcome.error_message("verify")
    assert "AssertionError" in message
    assert "internal error" in message


# --- stored objects that are not what they should be ---------------------------------
@pytest.fixture
def wrong_kind(sample: SampleRun, tmp_path: Path) -> gp.Store:
    """A store whose run 'train' is fine and whose run 'x' points at a tensor manifest."""
    store = gp.open_store(tmp_path / "store", mode="w")
    assert gp.ingest(store, sample.dump_pattern, run="train").ok
    store.refs.set("runs/x", store.put_tensor(np.arange(5.0)), message="moved by hand")
    return store


WRONG_KIND_COMMANDS = [
    ["ls", "STORE", "x"],
    ["export", "STORE", "--run", "x", "--step", "1", "--peer", "peer0", "-o", "OUT"],
    ["ingest", "STORE", "PATTERN", "--run", "x"],
]


@pytest.mark.parametrize("argv", WRONG_KIND_COMMANDS, ids=lambda a: a[0])
def test_ref_to_wrong_kind_of_object(
    argv: list[str], wrong_kind: gp.Store, sample: SampleRun, tmp_path: Path
) -> None:
    subs = {"STORE": wrong_kind.url, "PATTERN": sample.dump_pattern}
    subs["OUT"] = str(tmp_path / "out.safetensors")
    argv = [subs.get(a, a) for a in argv]
    before = wrong_kind.refs.get("runs/x")
    outcome = run_cli(*argv, "--json")
    assert outcome.status == 1
    assert outcome.doc["type"] == "IntegrityError"
    message = outcome.error_message(argv[0])
    assert "run 'x'" in message
    assert "is a tensor manifest where a run was expected" in message
    assert "gradpipe verify" in message
    assert wrong_kind.refs.get("runs/x") == before  # ingest did not build on it
    assert not (tmp_path / "out.safetensors").exists()


def test_ls_store_flags_run_refs_to_wrong_objects(wrong_kind: gp.Store) -> None:
    block = wrong_kind.tensor_info(wrong_kind.refs.get("runs/x")).blocks[0]
    assert block is not None
    wrong_kind.refs.set("runs/raw", block)  # a data block, not a manifest at all
    outcome = run_cli("ls", wrong_kind.url, "--json")
    assert outcome.status == 1
    rows = {r["ref"]: r for r in outcome.doc["refs"]}
    assert rows["runs/train"]["summary"] == "3 steps x 3 peers"
    assert "problem" not in rows["runs/train"]
    # One message for a wrong-kind run, whoever reads it: the run loader's.
    with pytest.raises(gp.IntegrityError) as loader:
        gp.open_run(wrong_kind, "x")
    assert rows["runs/x"]["problem"] == " ".join(str(loader.value).split())
    assert "run 'raw'" in rows["runs/raw"]["problem"]
    outcome = run_cli("ls", wrong_kind.url)
    assert outcome.status == 1
    assert "PROBLEM: manifest" in outcome.out
    assert "(run 'x') is a tensor manifest where a run was expected" in outcome.out
    assert "3 steps x 3 peers" in outcome.out


def test_open_run_on_wrong_kind_raises_integrity_error(wrong_kind: gp.Store) -> None:
    with pytest.raises(gp.IntegrityError, match=r"run 'x'.*tensor manifest where a run"):
        gp.open_run(wrong_kind, "x")


MARKERS = [
    (b"garbage\n", "is damaged", "IntegrityError"),
    (b'{"gradpipe": "store"}', "is damaged: its 'format' is None", "IntegrityError"),
    (b'{"gradpipe": "store", "format": "1"}', "is damaged", "IntegrityError"),
    (b'{"something": "else"}', "not gradpipe's store marker", "IntegrityError"),
    (b'{"gradpipe": "store", "format": 99}', "upgrade gradpipe", "UnsupportedFormatError"),
]


@pytest.mark.parametrize("command", ["init", "ls", "verify", "gc", "ingest", "export"])
@pytest.mark.parametrize(("marker", "words", "kind"), MARKERS, ids=lambda m: str(m)[:12])
def test_damaged_marker_exits_1(
    command: str, marker: bytes, words: str, kind: str, tmp_path: Path, sample: SampleRun
) -> None:
    store = tmp_path / "store"
    store.mkdir()
    (store / "gradpipe.json").write_bytes(marker)
    extra = {
        "ingest": [sample.dump_pattern, "--run", "r"],
        "export": ["--run", "r", "--step", "1", "--peer", "p", "-o", str(tmp_path / "o")],
    }.get(command, [])
    outcome = run_cli(command, str(store), *extra, "--json")
    assert outcome.status == 1
    assert outcome.doc["type"] == kind
    message = outcome.error_message(command)
    assert words in message
    assert str(store / "gradpipe.json") in message or str(store) in message
    if kind == "IntegrityError":
        assert "upgrade" not in message
    assert [p.name for p in store.iterdir()] == ["gradpipe.json"]  # nothing written


def test_json_output_is_one_object(places: dict[str, str]) -> None:
    outcome = run_cli("ls", places["STORE"], "--json")
    assert outcome.status == 0
    assert json.loads(outcome.out) == outcome.doc
    assert outcome.err == ""
