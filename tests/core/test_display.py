"""``printable`` and ``printable_text``: what reaches a terminal is printable and short."""

from __future__ import annotations

import ast
import doctest
import unicodedata

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from gradpipe.core import display
from gradpipe.core.display import (
    ELLIPSIS,
    MIN_LIMIT,
    NAME_LIMIT,
    printable,
    printable_error,
    printable_text,
)

#: Any text, surrogates and unassigned code points included.
any_text = st.text(st.characters(codec=None, categories=None), max_size=400)
limits = st.integers(MIN_LIMIT, 300)


@given(any_text, limits)
def test_printable_is_printable_and_bounded(text: str, limit: int) -> None:
    shown = printable(text, limit=limit)
    assert shown.isprintable(), shown
    assert len(shown) <= limit


@given(any_text)
def test_printable_of_text_that_fits_is_its_repr(text: str) -> None:
    shown = printable(text, limit=10_000)
    assert shown == repr(text)
    # Injective: the shown text reads back as the name, so two names never look alike.
    assert ast.literal_eval(shown) == text


@given(any_text, any_text)
def test_distinct_names_that_fit_are_shown_apart(a: str, b: str) -> None:
    if a != b:
        assert printable(a, limit=10_000) != printable(b, limit=10_000)


@given(any_text, limits)
@example("0" * 19 + ELLIPSIS + "0" * 24, 45)  # found by hypothesis: the ellipsis in the text
def test_shortened_text_notes_its_length_and_keeps_its_ends(text: str, limit: int) -> None:
    shown = printable(text, limit=limit)
    if shown == repr(text):
        return
    quote = shown[0]
    body, closing, note = shown[1:].rpartition(f"{quote} (")
    assert closing
    assert note == f"{len(text)} characters)"
    # Each end is the escaped form of a run of the text's own first or last characters. The
    # text may hold the ellipsis itself: one of its places in the body must be the cut.
    cuts = [i for i in range(len(body)) if body.startswith(ELLIPSIS, i)]
    assert any(
        text.startswith(ast.literal_eval(quote + body[:i] + quote))
        and text.endswith(ast.literal_eval(quote + body[i + len(ELLIPSIS) :] + quote))
        for i in cuts
    )


def test_the_characters_that_act_on_a_terminal_are_escaped() -> None:
    controls = "\n\r\t\x1b\x07\x00\x7f\x85\u2028\u2029\u200e\u200f\u061c\ufeff"
    bidi = "".join(map(chr, [*range(0x202A, 0x202F), *range(0x2066, 0x206A)]))
    for char in controls + bidi + "\ue000\ud800\U000e0001\u00a0\u3000":
        shown = printable(f"a{char}b")
        assert char not in shown, (char, unicodedata.name(char, "?"))
        assert shown.isascii()
    assert printable("evil\n\u202eexe") == r"'evil\n\u202eexe'"


def test_a_long_name_is_cut_in_the_middle_with_its_length() -> None:
    name = "a" * 5_000 + "MIDDLE" + "z" * 4_994
    shown = printable(name)
    assert len(shown) <= NAME_LIMIT
    assert shown.startswith("'aaaa")
    assert shown.endswith("zzz' (10000 characters)")
    assert "MIDDLE" not in shown
    assert ELLIPSIS in shown
    # Escapes are never cut in half.
    shown = printable("\x1b" * 1_000)
    assert shown.startswith("'\\x1b\\x1b")
    assert "\\x1b" + ELLIPSIS + "\\x1b" in shown


def test_quotes_and_other_values() -> None:
    assert printable("it's") == '"it\'s"'
    assert printable("both ' and \"") == repr("both ' and \"")
    assert printable(7) == "7"
    assert printable(None) == "None"
    assert printable(["\n" * 100]).endswith("(204 characters)")

    class Odd:
        def __repr__(self) -> str:
            return "odd\x1b[2J\u202e"

    assert printable(Odd()) == "odd\\x1b[2J\\u202e"
    with pytest.raises(ValueError, match="at least"):
        printable("x", limit=MIN_LIMIT - 1)


@given(any_text)
def test_printable_text_escapes_without_quoting(text: str) -> None:
    shown = printable_text(text)
    assert shown.isprintable()
    if text.isprintable():
        assert shown == text  # already safe text, backslashes included, is left alone
    assert len(printable_text(text, limit=MIN_LIMIT)) <= MIN_LIMIT


def test_printable_text_keeps_an_escaped_name_as_it_is() -> None:
    message = f"invalid run name {printable('a' * 300)}: use letters"
    assert printable_text(message) == message
    assert printable_text("a\x1b[2Jb\u202ec") == "a\\x1b[2Jb\\u202ec"


def test_examples_in_the_docstrings_hold() -> None:
    failures, tried = doctest.testmod(display, raise_on_error=False)
    assert tried >= 4
    assert failures == 0


@given(any_text)
def test_the_escaping_of_long_text_is_reprs(text: str) -> None:
    # Text that fits is shown by repr itself; a shortened one is escaped character by
    # character, which must agree with repr so that both ends read back.
    quote = '"' if "'" in text and '"' not in text else "'"
    assert display._fit(text, quote, None) == repr(text)


def test_printable_error_names_the_type_and_bounds_the_text() -> None:
    shown = printable_error(ValueError("bad\n\x1b[2J" + "v" * 10_000), limit=100)
    assert shown.startswith("ValueError: bad\\n\\x1b[2J")
    assert shown.endswith("(10020 characters)")  # "ValueError: " and the 10,008 of the text
    assert len(shown) <= 100
    assert shown.isprintable()


def test_a_huge_value_is_shown_without_writing_its_whole_repr() -> None:
    # A list of many shared long strings (what a YAML alias makes) has a repr of gigabytes;
    # printable writes only what it shows, so it counts the items it looks at.
    seen: list[int] = []

    class Counted:
        def __repr__(self) -> str:
            seen.append(1)
            return "c" * 100

    shown = printable([Counted()] * 100_000 + ["x" * 10_000_000], limit=80)
    assert len(shown) <= 80
    assert shown.startswith("[ccc")
    assert shown.endswith("(shortened)")
    assert len(seen) <= 10
    nested = printable({"k": [[["y" * 1_000_000] * 1000] * 1000]}, limit=80)
    assert nested.startswith("{'k': [[['yyy")
    assert len(nested) <= 80


def test_short_values_are_shown_as_repr_writes_them() -> None:
    for value in ({"b": 1, "a": [1.5, None, True]}, (1,), {3, 1, 2}, [], {}, -7, ["..."]):
        assert printable(value, limit=200) == repr(value)
