"""Names and messages as they are safe to show on a terminal or in a text report.

Names reach gradpipe from users and from files: a run name typed on the
command line, a peer name cut out of a file name, a tensor name read from a
dump, a path. Any of them may be ten thousand characters long or hold a
newline, an escape sequence or a bidirectional-control character that
reorders what a terminal shows. Every name formatted into a message goes
through :func:`printable`: quoted as Python writes a string literal, every
character that is not safely printable escaped (``\\n``, ``\\x1b``,
``\\u202e``), and long text cut in the middle with the full length noted.
:func:`printable_text` is the last line of defence where whole messages reach
a terminal (the command line's output and errors): it escapes what is left,
without quoting, so a name some message forgot cannot act on the terminal.

JSON output keeps exact names (JSON escapes them itself); HTML is escaped by
:mod:`gradpipe.core.html`. These helpers are for human-readable text only.
"""

from __future__ import annotations

import reprlib
from collections.abc import Iterable
from typing import Any, Final

__all__ = [
    "ELLIPSIS",
    "MIN_LIMIT",
    "NAME_LIMIT",
    "PATH_LIMIT",
    "printable",
    "printable_error",
    "printable_names",
    "printable_text",
]

#: The longest a name is shown in a message, quotes and length note included.
NAME_LIMIT: Final = 80
#: The longest a path or URL is shown: real ones are longer than names.
PATH_LIMIT: Final = 200
#: The smallest ``limit`` the helpers take: room for quotes, an ellipsis, the
#: length note and a few characters of either end.
MIN_LIMIT: Final = 32
#: What stands for the characters left out of a shortened text.
ELLIPSIS: Final = "\N{HORIZONTAL ELLIPSIS}"


def printable(value: object, *, limit: int = NAME_LIMIT) -> str:
    r"""``value`` as it is safe to show in a message: quoted, escaped, at most ``limit`` long.

    A string is written as Python's ``repr`` writes it, so every character
    that :meth:`str.isprintable` refuses (controls, format characters such as
    the bidirectional controls U+202A-U+202E and U+2066-U+2069, line and
    paragraph separators, private-use, surrogate and unassigned code points,
    whitespace other than the space) is escaped, and two strings that fit are
    never shown alike. A longer one keeps its first and last characters
    around an ellipsis, with its length in characters noted after the
    closing quote. Anything else is shown by its ``repr``, escaped and
    shortened the same way but not quoted again; the ``repr`` is made within
    a budget of a few times ``limit`` (:mod:`reprlib`), so a list of a
    million long strings costs no more to show than a short one, and its
    shortened form says "shortened" rather than a length it never measured.

    Parameters
    ----------
    value : object
        The name (usually a ``str``) to show.
    limit : int
        The most characters the result has (at least :data:`MIN_LIMIT`);
        met for any text shorter than a billion characters.

    Examples
    --------
    >>> printable("run-7")
    "'run-7'"
    >>> print(printable("evil\n\u202eexe"))
    'evil\n\u202eexe'
    >>> print(printable("x" * 10_000, limit=40))
    'xxxxxxxxxxxxxx…xxxx' (10000 characters)
    """
    _check_limit(limit)
    if isinstance(value, str):
        if len(value) + 2 <= limit:  # escapes never shrink text: it may fit as it is
            shown = repr(value)  # Python's own escaping, at C speed (messages are hot in loops)
            if len(shown) <= limit:
                return shown
        # repr's choice of quote: the one the text does not hold, else ' escaped.
        quote = '"' if "'" in value and '"' not in value else "'"
        return _fit(value, quote, limit)
    shown, whole = _bounded_repr(value, 4 * limit)
    return _fit(shown, "", limit, None if whole else " (shortened)")


def printable_text(text: str, *, limit: int | None = None) -> str:
    r"""``text`` with every character that is not safely printable escaped, not quoted.

    For whole messages at the point where they reach a terminal: names in
    them should already have gone through :func:`printable`; this makes sure
    nothing else can move the cursor, clear the screen or reorder the line.
    Backslashes are left alone (escaped names already hold them), so unlike
    :func:`printable` two texts may be shown alike. With ``limit``, a longer
    text keeps its ends around an ellipsis, its full length noted.

    >>> print(printable_text("line\x1b[2Jcleared"))
    line\x1b[2Jcleared
    """
    if limit is not None:
        _check_limit(limit)
    if text.isprintable() and (limit is None or len(text) <= limit):
        return text  # the common case, checked at C speed
    return _fit(text, "", limit)


def printable_error(exc: BaseException, *, limit: int = PATH_LIMIT) -> str:
    r"""An exception's type and text, escaped and at most ``limit`` long.

    For an error raised by code that read stored or given content (a JSON
    parser, a codec, a dataclass built from a file), whose text may quote
    that content at any length.

    >>> print(printable_error(ValueError("bad\x1b[2J")))
    ValueError: bad\x1b[2J
    """
    return printable_text(f"{type(exc).__name__}: {exc}", limit=limit)


class _BoundedRepr(reprlib.Repr):
    """:mod:`reprlib` that stops after about ``room`` characters, whatever the nesting.

    reprlib's own limits are per container and per level, so their product
    is still unbounded; this spends one budget across the whole value and
    writes one ``...`` for everything after it runs out. Dicts keep their
    order (reprlib sorts them), so what fits reads as ``repr`` writes it.
    """

    def __init__(self, room: int) -> None:
        super().__init__()
        self.room = room
        self.maxlevel = 20
        self.maxstring = self.maxother = self.maxlong = room
        self.maxtuple = self.maxlist = self.maxarray = self.maxdict = room
        self.maxset = self.maxfrozenset = self.maxdeque = room

    def repr1(self, x: Any, level: int) -> str:
        if self.room <= 0:
            return "..."
        shown = super().repr1(x, level)
        self.room -= len(shown)
        return shown

    def repr_list(self, x: Any, level: int) -> str:
        return self._items(x, level, "[", "]")

    def repr_tuple(self, x: Any, level: int) -> str:
        return self._items(x, level, "(", ",)" if len(x) == 1 else ")")

    def repr_dict(self, x: Any, level: int) -> str:
        return self._items(x.items(), level, "{", "}") if x else "{}"

    def _items(self, items: Iterable[Any], level: int, left: str, right: str) -> str:
        """The items between ``left`` and ``right``, up to the first one past the budget."""
        pieces: list[str] = []
        for item in items:
            if level <= 0 or self.room <= 0:
                pieces.append("...")  # one for all the rest, not one per item left
                break
            if isinstance(item, tuple) and left == "{":  # a dict's (key, value)
                key, value = item
                pieces.append(f"{self.repr1(key, level - 1)}: {self.repr1(value, level - 1)}")
            else:
                pieces.append(self.repr1(item, level - 1))
        return left + ", ".join(pieces) + right


def _bounded_repr(value: object, room: int) -> tuple[str, bool]:
    """``repr(value)`` if it is short, else a shortened one; and whether it is whole."""
    shown = _BoundedRepr(room).repr(value)
    if "..." in shown:  # something was cut (or the value writes "..." itself: shown as cut)
        return shown, False
    # Nothing was cut, so the full repr is about as long: take it, for repr's own order of sets.
    return repr(value), True


def _check_limit(limit: int) -> None:
    if limit < MIN_LIMIT:
        raise ValueError(f"limit must be at least {MIN_LIMIT}, got {limit}")


def _escape(char: str, quote: str) -> str:
    """One character as it is shown between ``quote`` (none: bare text)."""
    if quote and char in ("\\", quote):
        return "\\" + char
    if char.isprintable():
        return char
    return repr(char)[1:-1]  # \n, \x1b, \u202e, \U000e0001, \ud800: never a quote


def _take(chars: Iterable[str], quote: str, room: int) -> list[str]:
    """Escaped characters from the start of ``chars`` while they fit in ``room``."""
    out: list[str] = []
    for char in chars:
        piece = _escape(char, quote)
        room -= len(piece)
        if room < 0:
            break
        out.append(piece)
    return out


def _fit(text: str, quote: str, limit: int | None, note: str | None = None) -> str:
    if limit is None or len(text) + 2 * len(quote) <= limit:
        whole = quote + "".join(_escape(c, quote) for c in text) + quote
        if limit is None or len(whole) <= limit:
            return whole
    if note is None:
        note = f" ({len(text)} characters)"
    room = max(limit - len(note) - 2 * len(quote) - len(ELLIPSIS), 0)
    # Most of the room to the start, which tells names apart more often; the
    # end keeps a suffix such as a file extension or a step number.
    head = _take(text, quote, room - room // 4)
    tail = _take(reversed(text), quote, room - sum(map(len, head)))
    return f"{quote}{''.join(head)}{ELLIPSIS}{''.join(reversed(tail))}{quote}{note}"


def printable_names(names: Iterable[object], *, most: int = 10) -> str:
    """The first ``most`` of ``names``, each :func:`printable`, then how many more there are.

    For messages that list what a store or a file holds: the list is as
    bounded as each name in it.

    >>> printable_names(["a", "b\\n"])
    "'a', 'b\\\\n'"
    >>> printable_names(map(str, range(12)), most=2)
    "'0', '1' and 10 more"
    """
    shown: list[str] = []
    more = 0
    for name in names:
        if len(shown) < most:
            shown.append(printable(name))
        else:
            more += 1
    return ", ".join(shown) + (f" and {more} more" if more else "")
