"""The backend conformance suite: every :class:`Backend` runs the same tests.

Subclass :class:`BackendTests` in a test module and provide a ``backend``
fixture returning a new, empty backend (zarr's ``StoreTests`` and fsspec's
abstract tests are the model)::

    class TestMemoryBackend(BackendTests):
        @pytest.fixture
        def backend(self):
            return MemoryBackend(uuid.uuid4().hex)

A backend that can set a key's last-modified time directly overrides
:meth:`BackendTests.set_mtime`, which lets the suite check that ``touch``
moves an old time forward (without it only monotonicity is checked: time
stamps on S3 have one-second resolution, and the suite never sleeps).

The contract, as :mod:`gradpipe.storage.refs` and :mod:`gradpipe.storage.gc`
rely on it:

- ``write_if_absent`` is atomic: of racing creates of one key exactly one
  returns True and its bytes are what every reader sees.
- ``swap`` is a compare-and-swap: of racing swaps from one token exactly one
  wins. A token changes whenever the bytes change; swapping in *identical*
  bytes may give back the same token (an S3 ETag is an MD5, the local token a
  hash), so a caller that must tell two writes apart writes unique bytes, as
  refs do with their ``write_id``.
- ``list`` may also show a backend's own bookkeeping files (a lock file beside
  a ref on local disk, temporary files of killed writers); their last path
  segment starts with ``.``, and gradpipe never names a key that way.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np
import pytest

from gradpipe.core.buffers import Buffer
from gradpipe.errors import ConflictError, NotFoundError
from gradpipe.storage.backend import Backend

__all__ = ["ODD_KEYS", "BackendTests", "race", "visible_keys"]

#: Legal keys with characters a careless backend (URL quoting, globbing, path
#: joining) would mangle. gradpipe's own names use only ``[A-Za-z0-9._+=@-]``,
#: but a backend must not depend on that: any character but ``/`` is data.
ODD_KEYS: tuple[str, ...] = (
    "odd/with space/a b",
    "odd/plus+equals=amp&/x",
    "odd/percent%20encoded%2Fslash",
    "odd/unicode/ünïcödé-日本",
    "odd/glob[ab]*?{x,y}",
    "odd/step=3,peer=0;v:1@host~!$'()",
    "odd/dots/a..b/.../c.d.",
)

T = TypeVar("T")

#: Threads in each race; enough to collide on every backend, few enough for moto.
RACERS = 8


def visible_keys(backend: Backend, prefix: str) -> dict[str, int]:
    """Listed keys under ``prefix`` and their sizes, without bookkeeping files."""
    out: dict[str, int] = {}
    for info in backend.list(prefix):
        if not info.key.rsplit("/", 1)[-1].startswith("."):
            assert info.key not in out, f"{info.key!r} listed twice"
            out[info.key] = info.size
    return out


def race(fn: Callable[[int], T], n: int = RACERS) -> list[T | Exception]:
    """Run ``fn(0) ... fn(n-1)`` in ``n`` threads released together; results in order."""
    barrier = threading.Barrier(n)
    out: list[T | Exception] = [RuntimeError("did not run")] * n

    def one(i: int) -> None:
        barrier.wait()
        try:
            out[i] = fn(i)
        except Exception as exc:
            out[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return out


class BackendTests:
    """What every backend's primitives must do, exactly."""

    #: Examples of the random-operations test; a slow backend asks for fewer.
    model_examples: int = 40

    def set_mtime(self, backend: Backend, key: str, mtime: float) -> None:
        """Set ``key``'s last-modified time; override where the backend allows."""
        pytest.skip(f"{type(backend).__name__} cannot age an object in a test")

    # --- write_if_absent / write_many_if_absent ----------------------------------
    def test_write_if_absent_creates_once_and_keeps_the_first(self, backend: Backend) -> None:
        assert backend.write_if_absent("blocks/aa/one", b"first") is True
        assert backend.write_if_absent("blocks/aa/one", b"second, longer") is False
        assert backend.read("blocks/aa/one") == b"first"
        assert visible_keys(backend, "blocks") == {"blocks/aa/one": 5}

    def test_write_if_absent_takes_memoryview_and_empty_bytes(self, backend: Backend) -> None:
        assert backend.write_if_absent("k/view", memoryview(b"0123456789")[2:5]) is True
        assert backend.write_if_absent("k/empty", b"") is True
        assert backend.read("k/view") == b"234"
        assert backend.read("k/empty") == b""
        assert visible_keys(backend, "k") == {"k/view": 3, "k/empty": 0}

    def test_write_many_if_absent_mixes_new_and_existing(self, backend: Backend) -> None:
        assert backend.write_if_absent("m/old", b"old") is True
        items: list[tuple[str, bytes | memoryview]] = [
            ("m/new1", b"n1"),
            ("m/old", b"replacement"),
            ("m/deep/new2", memoryview(b"n2")),
        ]
        assert backend.write_many_if_absent(items) == [True, False, True]
        assert backend.read_many(["m/new1", "m/old", "m/deep/new2"]) == [b"n1", b"old", b"n2"]
        assert backend.write_many_if_absent([]) == []

    def test_write_many_if_absent_same_key_twice_in_one_batch(self, backend: Backend) -> None:
        result = backend.write_many_if_absent([("d/k", b"a"), ("d/k", b"b")])
        assert sorted(result) == [False, True]
        assert backend.read("d/k") == (b"a" if result[0] else b"b")

    # --- read / read_many ----------------------------------------------------------
    def test_write_parts_if_absent_writes_the_parts_joined(self, backend: Backend) -> None:
        # Bytes, memoryviews, uint8 arrays and empty parts, in one object and across objects.
        parts: list[Buffer] = [b"head", memoryview(b"er"), np.arange(3, dtype=np.uint8), b""]
        parts.append(memoryview(b"!"))
        empty: list[Buffer] = [np.zeros(0, np.uint8)]
        items: list[tuple[str, Sequence[Buffer]]] = [
            ("parts/a", parts),
            ("parts/b", [b""]),
            ("parts/c", empty),
        ]
        assert backend.write_parts_if_absent(items) == [True, True, True]
        assert backend.read("parts/a") == b"header\x00\x01\x02!"
        assert backend.read("parts/b") == backend.read("parts/c") == b""
        assert backend.write_parts_if_absent([("parts/a", [b"x"]), ("parts/d", [b"y"])]) == [
            False,
            True,
        ]
        assert backend.read("parts/a") == b"header\x00\x01\x02!"

    def test_read_of_absent_key_is_not_found(self, backend: Backend) -> None:
        with pytest.raises(NotFoundError, match="nothing/here"):
            backend.read("nothing/here")
        with pytest.raises(KeyError):
            backend.read("nothing/here")

    def test_read_many_returns_failures_in_place(self, backend: Backend) -> None:
        backend.write_if_absent("r/1", b"one")
        backend.write_if_absent("r/3", b"three")
        got = backend.read_many(["r/1", "r/2", "r/3", "r/1"])
        assert got[0] == b"one"
        assert isinstance(got[1], NotFoundError)
        assert got[2:] == [b"three", b"one"]
        assert backend.read_many([]) == []

    # --- mtimes / touch ------------------------------------------------------------
    def test_mtimes_none_for_absent_in_input_order(self, backend: Backend) -> None:
        backend.write_if_absent("t/a", b"a")
        backend.write_if_absent("t/b", b"b")
        got = backend.mtimes(["t/b", "t/missing", "t/a", "missing/too"])
        assert got[1] is None
        assert got[3] is None
        assert isinstance(got[0], float)
        assert isinstance(got[2], float)
        assert backend.mtimes([]) == []

    def test_touch_keeps_content_and_time_never_goes_back(self, backend: Backend) -> None:
        backend.write_if_absent("t/k", b"payload")
        [before] = backend.mtimes(["t/k"])
        backend.touch("t/k")
        [after] = backend.mtimes(["t/k"])
        assert before is not None
        assert after is not None
        assert after >= before
        assert backend.read("t/k") == b"payload"

    def test_touch_moves_an_old_time_forward(self, backend: Backend) -> None:
        backend.write_if_absent("t/old", b"x")
        [now] = backend.mtimes(["t/old"])
        assert now is not None
        old = now - 10 * 86400
        self.set_mtime(backend, "t/old", old)
        assert backend.mtimes(["t/old"]) == [pytest.approx(old, abs=1)]
        backend.touch("t/old")
        [touched] = backend.mtimes(["t/old"])
        assert touched is not None
        assert touched >= now - 1
        assert backend.read("t/old") == b"x"

    def test_touch_of_absent_key_is_not_found(self, backend: Backend) -> None:
        with pytest.raises(NotFoundError):
            backend.touch("t/never")
        assert backend.mtimes(["t/never"]) == [None]  # and it did not create it

    # --- delete / delete_many ----------------------------------------------------------
    def test_delete_removes_and_absent_is_no_error(self, backend: Backend) -> None:
        backend.write_if_absent("x/a", b"a")
        backend.write_if_absent("x/b", b"b")
        backend.delete("x/a")
        backend.delete("x/a")
        backend.delete("never/was")
        with pytest.raises(NotFoundError):
            backend.read("x/a")
        assert backend.mtimes(["x/a"]) == [None]
        assert visible_keys(backend, "x") == {"x/b": 1}
        assert backend.write_if_absent("x/a", b"again") is True  # the name is free again

    def test_delete_many_mixes_present_and_absent(self, backend: Backend) -> None:
        for i in range(5):
            backend.write_if_absent(f"y/{i}", b"v")
        backend.delete_many(["y/0", "y/missing", "y/2", "y/4", "y/0"])
        backend.delete_many([])
        assert visible_keys(backend, "y") == {"y/1": 1, "y/3": 1}

    # --- list --------------------------------------------------------------------------
    def test_list_nested_keys_under_a_prefix_exactly(self, backend: Backend) -> None:
        data = {
            "p/a": b"1",
            "p/q/b": b"22",
            "p/q/r/c": b"333",
            "pq/x": b"4444",  # shares the string prefix "p", not the folder
            "p.q": b"55555",
            "other/p/a": b"666666",
        }
        for key, value in data.items():
            backend.write_if_absent(key, value)
        assert visible_keys(backend, "p") == {"p/a": 1, "p/q/b": 2, "p/q/r/c": 3}
        assert visible_keys(backend, "p/q") == {"p/q/b": 2, "p/q/r/c": 3}
        assert visible_keys(backend, "p/q/r") == {"p/q/r/c": 3}
        assert visible_keys(backend, "absent") == {}
        everything = visible_keys(backend, "")
        assert {k: v for k, v in everything.items() if k in data} == {
            k: len(v) for k, v in data.items()
        }

    def test_list_under_a_key_is_not_the_key(self, backend: Backend) -> None:
        backend.write_if_absent("f/leaf", b"x")
        backend.write_if_absent("f/leafy", b"y")
        assert visible_keys(backend, "f/leaf") == {}
        assert visible_keys(backend, "f") == {"f/leaf": 1, "f/leafy": 1}

    def test_list_times_agree_with_mtimes(self, backend: Backend) -> None:
        backend.write_if_absent("l/a", b"a")
        [listed] = list(backend.list("l"))
        [mtime] = backend.mtimes(["l/a"])
        assert mtime is not None
        assert listed.mtime == pytest.approx(mtime, abs=1)  # S3 lists ms, HEAD says seconds

    def test_list_sees_deletes_and_new_keys(self, backend: Backend) -> None:
        backend.write_if_absent("c/a", b"a")
        assert visible_keys(backend, "c") == {"c/a": 1}
        backend.delete("c/a")
        assert visible_keys(backend, "c") == {}
        backend.write_if_absent("c/b", b"bb")
        assert visible_keys(backend, "c") == {"c/b": 2}

    # --- refs: read_versioned / swap -----------------------------------------------
    def test_read_versioned_of_absent_key_is_none(self, backend: Backend) -> None:
        assert backend.read_versioned("refs/k/none") is None

    def test_swap_create_then_with_the_right_token(self, backend: Backend) -> None:
        first = backend.swap("refs/k/a", b"v1", None)
        current = backend.read_versioned("refs/k/a")
        assert current is not None
        assert (current.data, current.token) == (b"v1", first)
        second = backend.swap("refs/k/a", b"v2", first)
        assert second != first
        current = backend.read_versioned("refs/k/a")
        assert current is not None
        assert (current.data, current.token) == (b"v2", second)
        assert visible_keys(backend, "refs") == {"refs/k/a": 2}

    def test_swap_with_a_stale_token_conflicts_and_changes_nothing(self, backend: Backend) -> None:
        first = backend.swap("refs/k/b", b"v1", None)
        second = backend.swap("refs/k/b", b"v2", first)
        with pytest.raises(ConflictError, match="refs/k/b"):
            backend.swap("refs/k/b", b"v3", first)
        current = backend.read_versioned("refs/k/b")
        assert current is not None
        assert (current.data, current.token) == (b"v2", second)

    def test_swap_expecting_absent_on_an_existing_key_conflicts(self, backend: Backend) -> None:
        token = backend.swap("refs/k/c", b"v1", None)
        with pytest.raises(ConflictError):
            backend.swap("refs/k/c", b"v2", None)
        current = backend.read_versioned("refs/k/c")
        assert current is not None
        assert (current.data, current.token) == (b"v1", token)

    def test_swap_with_a_token_on_an_absent_key_conflicts(self, backend: Backend) -> None:
        token = backend.swap("refs/k/d", b"v1", None)
        with pytest.raises(ConflictError):
            backend.swap("refs/k/e", b"v1", token)
        assert backend.read_versioned("refs/k/e") is None

    def test_swap_tokens_differ_whenever_bytes_differ(self, backend: Backend) -> None:
        token = backend.swap("refs/k/f", b"v0", None)
        seen = {token}
        for i in range(1, 6):
            token = backend.swap("refs/k/f", f"v{i}".encode(), token)
            seen.add(token)
        assert len(seen) == 6
        current = backend.read_versioned("refs/k/f")
        assert current is not None
        assert (current.data, current.token) == (b"v5", token)

    def test_swap_of_identical_bytes_gives_a_token_that_works(self, backend: Backend) -> None:
        # The token may or may not change (see the module docstring); it must work.
        first = backend.swap("refs/k/g", b"same", None)
        second = backend.swap("refs/k/g", b"same", first)
        third = backend.swap("refs/k/g", b"other", second)
        current = backend.read_versioned("refs/k/g")
        assert current is not None
        assert (current.data, current.token) == (b"other", third)

    def test_swap_after_delete_creates_again(self, backend: Backend) -> None:
        token = backend.swap("refs/k/h", b"v1", None)
        backend.delete("refs/k/h")
        assert backend.read_versioned("refs/k/h") is None
        with pytest.raises(ConflictError):
            backend.swap("refs/k/h", b"v2", token)
        backend.swap("refs/k/h", b"v3", None)
        current = backend.read_versioned("refs/k/h")
        assert current is not None
        assert current.data == b"v3"

    # --- delete_all -------------------------------------------------------------------
    def test_delete_all_empties_and_the_backend_stays_usable(self, backend: Backend) -> None:
        backend.write_if_absent("gradpipe.json", b"{}")
        backend.write_if_absent("blocks/aa/bb", b"block")
        backend.swap("refs/k/i", b"ref", None)
        backend.write_if_absent("deep/a/b/c/d", b"d")
        backend.delete_all()
        assert visible_keys(backend, "") == {}
        assert backend.read_versioned("refs/k/i") is None
        with pytest.raises(NotFoundError):
            backend.read("blocks/aa/bb")
        assert backend.write_if_absent("blocks/aa/bb", b"new") is True
        assert backend.swap("refs/k/i", b"ref2", None)
        assert visible_keys(backend, "") == {"blocks/aa/bb": 3, "refs/k/i": 4}

    # --- odd keys -----------------------------------------------------------------------
    @pytest.mark.parametrize("key", ODD_KEYS)
    def test_odd_but_legal_keys_round_trip(self, backend: Backend, key: str) -> None:
        assert backend.write_if_absent(key, b"odd") is True
        assert backend.write_if_absent(key, b"again") is False
        assert backend.read(key) == b"odd"
        assert backend.mtimes([key]) != [None]
        assert visible_keys(backend, "odd") == {key: 3}
        backend.touch(key)
        backend.delete(key)
        assert backend.mtimes([key]) == [None]
        assert visible_keys(backend, "odd") == {}

    @pytest.mark.parametrize("key", ODD_KEYS[:3])
    def test_odd_but_legal_keys_as_refs(self, backend: Backend, key: str) -> None:
        token = backend.swap(key, b"1", None)
        token = backend.swap(key, b"2", token)
        current = backend.read_versioned(key)
        assert current is not None
        assert (current.data, current.token) == (b"2", token)

    # --- against a model -------------------------------------------------------------
    def test_random_operations_match_a_dict(self, backend: Backend) -> None:
        """Any sequence of primitives leaves the backend like a dict would be."""
        from hypothesis import settings
        from hypothesis import strategies as st
        from hypothesis.stateful import RuleBasedStateMachine, rule, run_state_machine_as_test

        keys = st.sampled_from(["a/1", "a/2", "a/b/3", "ab/4", "refs/k/x"])
        values = st.binary(max_size=6)

        class Model(RuleBasedStateMachine):
            def __init__(self) -> None:
                super().__init__()
                backend.delete_all()
                self.model: dict[str, bytes] = {}

            @rule(key=keys, data=values)
            def write_if_absent(self, key: str, data: bytes) -> None:
                assert backend.write_if_absent(key, data) is (key not in self.model)
                self.model.setdefault(key, data)

            @rule(items=st.lists(st.tuples(keys, values), max_size=3, unique_by=lambda i: i[0]))
            def write_many_if_absent(self, items: list[tuple[str, bytes]]) -> None:
                want = [key not in self.model for key, _ in items]
                assert backend.write_many_if_absent(list(items)) == want
                for key, data in items:
                    self.model.setdefault(key, data)

            @rule(key=keys)
            def read(self, key: str) -> None:
                if key in self.model:
                    assert backend.read(key) == self.model[key]
                else:
                    with pytest.raises(NotFoundError):
                        backend.read(key)

            @rule(key=keys, data=values, fresh=st.booleans())
            def swap(self, key: str, data: bytes, fresh: bool) -> None:
                current = backend.read_versioned(key)
                assert (current.data if current else None) == self.model.get(key)
                if fresh or current is None:
                    backend.swap(key, data, current.token if current else None)
                    self.model[key] = data
                else:
                    with pytest.raises(ConflictError):
                        backend.swap(key, data, None)

            @rule(key=keys)
            def delete(self, key: str) -> None:
                backend.delete(key)
                self.model.pop(key, None)

            @rule(batch=st.lists(keys, max_size=3))
            def delete_many(self, batch: list[str]) -> None:
                backend.delete_many(batch)
                for key in batch:
                    self.model.pop(key, None)

            @rule(batch=st.lists(keys, max_size=3))
            def mtimes(self, batch: list[str]) -> None:
                got = backend.mtimes(batch)
                assert [m is not None for m in got] == [k in self.model for k in batch]

            @rule(prefix=st.sampled_from(["", "a", "a/b", "ab", "refs"]))
            def list(self, prefix: str) -> None:
                under = f"{prefix}/" if prefix else ""
                want = {k: len(v) for k, v in self.model.items() if k.startswith(under)}
                assert visible_keys(backend, prefix) == want

        run_state_machine_as_test(
            Model,
            settings=settings(
                max_examples=self.model_examples,
                stateful_step_count=15,
                deadline=None,
                database=None,
            ),
        )

    # --- concurrency ----------------------------------------------------------------
    def test_racing_creates_of_one_key_exactly_one_wins(self, backend: Backend) -> None:
        results = race(lambda i: backend.write_if_absent("race/block", f"writer {i}".encode()))
        _no_errors(results)
        assert results.count(True) == 1
        assert backend.read("race/block") == f"writer {results.index(True)}".encode()

    def test_racing_swaps_from_one_token_exactly_one_wins(self, backend: Backend) -> None:
        start = backend.swap("refs/race/r", b"start", None)
        results = race(lambda i: backend.swap("refs/race/r", f"writer {i}".encode(), start))
        tokens = [r for r in results if isinstance(r, str)]
        assert len(tokens) == 1, results
        others = [r for r in results if not isinstance(r, str)]
        assert all(isinstance(r, ConflictError) for r in others), others
        winner = next(i for i, r in enumerate(results) if isinstance(r, str))
        current = backend.read_versioned("refs/race/r")
        assert current is not None
        assert (current.data, current.token) == (f"writer {winner}".encode(), tokens[0])

    def test_racing_creates_of_a_ref_exactly_one_wins(self, backend: Backend) -> None:
        results = race(lambda i: backend.swap("refs/race/new", f"writer {i}".encode(), None))
        tokens = [r for r in results if isinstance(r, str)]
        assert len(tokens) == 1, results
        assert all(isinstance(r, ConflictError) for r in results if not isinstance(r, str))


def _no_errors(results: Sequence[object]) -> None:
    errors = [r for r in results if isinstance(r, Exception)]
    assert not errors, errors
