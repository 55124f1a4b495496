"""The canonical-forest reduction of :mod:`gradpipe.aggregation.reduce`, run in cache-sized blocks.

:mod:`gradpipe.aggregation.reduce` defines the weighted sum of a chunk over peers
by one tree of float64 additions (its module docstring). Run as written, one
whole-chunk array per step, that costs a fresh float64 array per peer (the
term ``c_i * x_i``) and per sibling merge, each written to and read back from
memory: at 4 MiB float32 chunks, three to four times the memory traffic of
the reading itself.

Here the same operations are run on one block of :data:`BLOCK` elements at a
time, for every peer, before moving to the next block: the terms and the
partial sums of a block stay in the core's cache, and only the inputs and the
results cross memory. The reduction is element-wise and every element sees
the same float64 operations in the same order (a product ``fl64(c_i * x_i)``,
the sibling additions ``left + right``, the left-to-right fold, the division,
the noise, the one rounding), so the bits are those of the whole-chunk
version for every block size.

The work is planned once per call as a short program (:class:`Program`) of
ufunc calls on numbered buffers, then run block by block; a buffer is a
reused scratch array of one block, or the block's slice of a result array,
so that the leftmost term of a result block is computed straight into its
place and merges add into it in place.

Inputs are never written: a block handed in (a partial from another task)
is read, and a merge whose left side is such a block writes elsewhere.

Where the compiled kernels were built (:mod:`gradpipe.core.kernels`), the
same program runs there, every block of the chunk in one call without the
GIL, for float32 and float64 peers and results; the numpy version below
runs the rest (float16, bfloat16) and raises every error: a block the
compiled run finds non-finite, or not fitting the output, is run again here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np

from gradpipe.aggregation.result_range import round_result
from gradpipe.core.kernels import native

__all__ = ["BLOCK", "Item", "NotFiniteError", "Program", "forest_shape"]

#: Elements per block: 256 KiB per float64 buffer, so the few buffers a
#: program uses (one per level of the forest, plus a result) and the inputs'
#: slices stay within a core's L2 cache.
BLOCK: Final = 1 << 15


@dataclass(frozen=True)
class Item:
    """One input of a reduction, in peer order: a peer's term to compute, or a sum given.

    A term (``coefficient`` set) is ``fl64(coefficient * values)``, a block of
    one peer, then times ``2**exponent`` when ``exponent`` is not 0 (a
    coefficient below float64's normal range, kept as a normal mantissa and
    an exponent so it loses no bits); a given block (``coefficient`` None) is
    the float64 sum of the aligned dyadic peer block ``[lo, lo + size)``.
    ``values`` is flat.
    """

    lo: int
    size: int
    weight: float
    values: np.ndarray
    coefficient: float | None = None
    exponent: int = 0


def forest_shape(items: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The ``(lo, size)`` blocks left after pushing ``items`` and merging siblings."""
    stack: list[tuple[int, int]] = []
    for lo, size in items:
        stack.append((lo, size))
        while len(stack) >= 2 and _siblings(stack[-2], stack[-1]):
            right = stack.pop()
            left = stack.pop()
            stack.append((left[0], left[1] + right[1]))
    return stack


def _siblings(left: tuple[int, int], right: tuple[int, int]) -> bool:
    return left[1] == right[1] and left[0] % (2 * left[1]) == 0 and left[0] + left[1] == right[0]


# Operands of the program's operations: ("in", k) is item k's values, ("buf", b) buffer b.
_Operand = tuple[str, int]
# What finishing adds to a run: the output, the divisor, the noise and the exponent.
_Finish = tuple[np.ndarray, float | None, np.ndarray | None, int]

# The compiled kernel's names for the operations, and the dtypes it reads and writes.
_NATIVE_OPS: Final = {"term": 0, "copy": 1, "add": 2}
_NATIVE_KINDS: Final = {np.dtype("<f4"): "f", np.dtype("<f8"): "d"}


@dataclass
class _Entry:
    """A forest block while the program is planned: where its sum lives."""

    lo: int
    size: int
    weight: float
    where: _Operand


class Program:
    """The reduction of ``items`` (in peer order) as ufunc calls on blocks.

    ``outputs``: the result forest's blocks, ``(lo, size, weight)``;
    :meth:`partials` fills one float64 array per block, :meth:`finish` folds
    them into one rounded array.
    """

    def __init__(self, items: Sequence[Item]) -> None:
        self.items = list(items)
        self.size = self.items[0].values.size
        shape = forest_shape([(it.lo, it.size) for it in self.items])
        self._starts = {lo: j for j, (lo, _) in enumerate(shape)}
        self._ops: list[tuple[str, _Operand, _Operand, _Operand | None, float, int]] = []
        # Buffer b < len(shape) holds result block b; the others are scratch.
        self._result_count = len(shape)
        self._buffers = len(shape)
        self._free: list[int] = []
        stack: list[_Entry] = []
        for k, item in enumerate(self.items):
            stack.append(self._leaf(k, item, shape))
            while len(stack) >= 2 and _siblings(
                (stack[-2].lo, stack[-2].size), (stack[-1].lo, stack[-1].size)
            ):
                right = stack.pop()
                left = stack.pop()
                stack.append(self._merge(left, right))
        self.outputs = [(e.lo, e.size, e.weight) for e in stack]
        self._final = [e.where for e in stack]

    # --- planning -------------------------------------------------------------------
    def _scratch(self) -> int:
        if self._free:
            return self._free.pop()
        self._buffers += 1
        return self._buffers - 1

    def _release(self, where: _Operand) -> None:
        kind, b = where
        if kind == "buf" and b >= self._result_count:
            self._free.append(b)

    def _leaf(self, k: int, item: Item, shape: list[tuple[int, int]]) -> _Entry:
        result = self._starts.get(item.lo)
        if item.coefficient is None:
            # A given block: read in place, unless it starts a larger result block,
            # which is then built in that block's result array.
            if result is not None and shape[result][1] != item.size:
                self._ops.append(("copy", ("buf", result), ("in", k), None, 0.0, 0))
                return _Entry(item.lo, item.size, item.weight, ("buf", result))
            return _Entry(item.lo, item.size, item.weight, ("in", k))
        target = result if result is not None else self._scratch()
        self._ops.append(
            ("term", ("buf", target), ("in", k), None, item.coefficient, item.exponent)
        )
        return _Entry(item.lo, item.size, item.weight, ("buf", target))

    def _merge(self, left: _Entry, right: _Entry) -> _Entry:
        # ``left + right`` into a buffer this program owns: left's if it is one,
        # else right's, else a fresh scratch buffer (inputs are never written).
        if left.where[0] == "buf":
            out = left.where
            self._release(right.where)
        elif right.where[0] == "buf" and right.where[1] >= self._result_count:
            out = right.where
        else:
            out = ("buf", self._scratch())
        self._ops.append(("add", out, left.where, right.where, 0.0, 0))
        return _Entry(left.lo, left.size + right.size, left.weight + right.weight, out)

    # --- running --------------------------------------------------------------------
    @property
    def weight(self) -> float:
        """The total weight, folded left to right over the result blocks."""
        total = self.outputs[0][2]
        for _, _, weight in self.outputs[1:]:
            total += weight
        return total

    def partials(self, *, check: bool = True) -> list[np.ndarray]:
        """One float64 array per result block (a given block alone is passed through).

        With ``check``, raises :class:`NotFiniteError` if a result holds NaN or infinity.
        """
        arrays = [
            self.items[w[1]].values if w[0] == "in" else np.empty(self.size, dtype=np.float64)
            for w in self._final
        ]
        if any(w[0] == "buf" for w in self._final):
            self._run(arrays, None, check)
        return arrays

    def finish(
        self,
        out: np.ndarray,
        *,
        divisor: float | None,
        noise: np.ndarray | None = None,
        check: bool = True,
        exponent: int = 0,
    ) -> np.ndarray:
        """Fold the result blocks, divide (or scale by ``2**exponent``), add ``noise``, round.

        The blocks are folded left to right and the result rounded into ``out``.

        ``out`` and ``noise`` are flat, of the items' size; ``out`` has the
        result's dtype. With ``check``, raises :class:`NotFiniteError` if the
        sum (before the noise) holds NaN or infinity. A result that does not
        fit ``out``'s dtype is always refused (:func:`round_result`).
        """
        self._run(None, (out, divisor, noise, exponent), check)
        return out

    def _run(
        self,
        arrays: list[np.ndarray] | None,
        final: _Finish | None,
        check: bool,
    ) -> None:
        if self._run_native(arrays, final, check):
            return
        # A NaN or an infinity in an input is reported by the check, not as a warning.
        with np.errstate(over="ignore", invalid="ignore"):
            self._run_blocks(arrays, final, check)

    def _run_native(
        self,
        arrays: list[np.ndarray] | None,
        final: _Finish | None,
        check: bool,
    ) -> bool:
        """Run the program compiled; False where numpy must run it (or raise its error)."""
        forest = getattr(native, "forest", None)  # None: not built, or built before forest
        if forest is None:
            return False
        kinds = [_native_kind(item.values) for item in self.items]
        if any(
            k is None or (k == "f" and item.coefficient is None)
            for k, item in zip(kinds, self.items, strict=True)
        ):
            return False  # float16 or bfloat16 peers, or a float32 sum handed in
        finish = None
        if final is not None:
            out, divisor, noise, exponent = final
            out_kind = _native_kind(out)
            if out_kind is None or (noise is not None and _native_kind(noise) != "d"):
                return False
            finish = (out, out_kind, divisor, exponent, noise)
        results = tuple(
            array if w[0] == "buf" else None
            for w, array in zip(self._final, arrays or (), strict=False)
        )
        failed = forest(
            self._native_ops(),
            tuple(item.values for item in self.items),
            "".join(k or "" for k in kinds),
            self.size,
            self._buffers,
            results,
            tuple(_native_operand(w) for w in self._final),
            finish,
            check,
        )
        return failed is None

    def _native_ops(self) -> tuple[tuple[int, int, int, int, float, int], ...]:
        return tuple(
            (
                _NATIVE_OPS[op],
                _native_operand(out),
                _native_operand(a),
                0 if b is None else _native_operand(b),
                float(coefficient),
                exponent,
            )
            for op, out, a, b, coefficient, exponent in self._ops
        )

    def _run_blocks(
        self,
        arrays: list[np.ndarray] | None,
        final: _Finish | None,
        check: bool,
    ) -> None:
        step = min(BLOCK, max(self.size, 1))
        owned = 0 if arrays is None else len(arrays)
        scratch = [np.empty(step, dtype=np.float64) for _ in range(owned, self._buffers + 1)]
        values = [it.values for it in self.items]
        for start in range(0, self.size, step):
            stop = min(self.size, start + step)
            n = stop - start
            bufs = [a[start:stop] for a in arrays or ()] + [s[:n] for s in scratch]
            ins = [v[start:stop] for v in values]
            self._block(bufs, ins)
            results = [ins[w[1]] if w[0] == "in" else bufs[w[1]] for w in self._final]
            if final is None:
                if check:
                    for w, result in zip(self._final, results, strict=True):
                        if w[0] == "buf":
                            _check(result, start)
                continue
            out, divisor, noise, exponent = final
            acc = bufs[-1]  # the spare scratch buffer, used by no operation
            total = results[0]
            if len(results) > 1:
                total = np.add(results[0], results[1], out=acc)
                for result in results[2:]:
                    np.add(total, result, out=acc)
            if check:
                _check(total, start)
            if divisor is not None:
                total = np.divide(total, divisor, out=acc)
            if exponent:
                total = np.ldexp(total, exponent, out=acc)
            if noise is not None:
                total = np.add(total, noise[start:stop], out=acc)
            round_result(total, out=out[start:stop], offset=start)

    def _block(self, bufs: list[np.ndarray], ins: list[np.ndarray]) -> None:
        for op, out, a, b, coefficient, exponent in self._ops:
            target = bufs[out[1]]
            first = ins[a[1]] if a[0] == "in" else bufs[a[1]]
            if op == "term":
                np.multiply(first, coefficient, out=target, dtype=np.float64)
                if exponent:
                    np.ldexp(target, exponent, out=target)
            elif op == "copy":
                np.copyto(target, first)
            else:
                assert b is not None  # an add has two operands
                second = ins[b[1]] if b[0] == "in" else bufs[b[1]]
                np.add(first, second, out=target)


def _native_operand(where: _Operand) -> int:
    """The compiled kernel's number for an operand: buffer b is b, input k is -(k + 1)."""
    kind, index = where
    return index if kind == "buf" else -(index + 1)


def _native_kind(array: np.ndarray) -> str | None:
    """'f' or 'd' for a flat, contiguous, aligned float32 or float64 array, else None."""
    if array.ndim != 1 or not (array.flags.c_contiguous and array.flags.aligned):
        return None
    return _NATIVE_KINDS.get(array.dtype)


class NotFiniteError(ArithmeticError):
    """A block of a reduction holds NaN or infinity (``start``: its first element)."""

    def __init__(self, start: int) -> None:
        super().__init__(f"NaN or infinity at or after element {start}")
        self.start = start


def _check(total: np.ndarray, start: int) -> None:
    # A NaN or an infinity anywhere makes the sum non-finite; a non-finite sum of
    # finite values (float64 inputs near the overflow) is told apart elementwise.
    if not np.isfinite(np.add.reduce(total)) and not np.isfinite(total).all():
        raise NotFiniteError(start)
