"""The squared L2 norm of arrays spread over ranks, exactly rounded whatever the spread.

A gradient's global norm is a sum of squares over pieces that each layout cuts differently (dp
replica 0 holds whole tensors under plain data parallelism, every dp rank a contiguous flat
range under ZeRO, tp ranks slabs). Floating-point sums depend on that cut and on the order, so
two layouts that compute bitwise the same gradients would clip them by factors 1 ulp apart;
Adam turns such last-bit differences on gradients that are analytically zero (rounding noise,
e.g. an attention key bias) into 1e-13..1e-12 weight differences within a few steps.

``sumsq_digits(arrays)`` returns the exact sum of the (rounded, elementwise) squares as a fixed
number of float64 "digits" in base 2**32: every digit is an integer below 2**32, so a plain
float64 sum of digits over up to 2**21 ranks (one all-reduce, in any order) is still exact.
``digits_value(digits)`` turns the summed digits into the correctly rounded float. The result
is the same on one process and on any layout: the rounded sum of the squares of every element.
"""

from __future__ import annotations

from typing import Any

import numpy as np

BASE_BITS = 32
_SHIFT = 1074  # a square is an integer mantissa times 2**(biased exponent - 1075) >= 2**-1074
_BITS = 2048 + 53 + 64  # the largest finite square's scaled value, summed over up to 2**64 elements
DIGITS = -(-_BITS // BASE_BITS)
_CHUNK = 1 << 15  # elements per pass (cache-sized work arrays)
_FLUSH = 1 << 25  # per-exponent float sums of values < 2**27 stay exact up to 2**26 of them


def sumsq_digits(arrays: list[Any]) -> np.ndarray:
    """Exact sum of squares of every element of ``arrays`` (finite values) as base-2**32 digits."""
    total = 0
    hi_acc, lo_acc = np.zeros(2048), np.zeros(2048)
    pending = 0
    sq, w = np.empty(_CHUNK), np.empty(_CHUNK)
    exp, mant = np.empty(_CHUNK, np.int64), np.empty(_CHUNK, np.int64)

    def flush() -> int:
        out = 0
        for s in np.flatnonzero(hi_acc + lo_acc):
            out += ((int(hi_acc[s]) << 26) + int(lo_acc[s])) << int(s - 1)
        hi_acc.fill(0)
        lo_acc.fill(0)
        return out

    for a in arrays:
        g = np.asarray(a.get() if hasattr(a, "get") else a).astype(np.float64, copy=False).ravel()
        for start in range(0, g.size, _CHUNK):
            part = g[start : start + _CHUNK]
            n = part.size
            if pending + n > _FLUSH:
                total += flush()
                pending = 0
            pending += n
            with np.errstate(over="ignore"):  # an infinite square sums to inf, as it should
                np.multiply(part, part, out=sq[:n])
            bits = sq[:n].view(np.int64)  # squares are >= 0: the sign bit is clear
            e, m = exp[:n], mant[:n]
            np.right_shift(bits, 52, out=e)
            np.bitwise_and(bits, (1 << 52) - 1, out=m)
            m[e > 0] |= 1 << 52  # a normal number's implicit leading bit
            np.maximum(e, 1, out=e)  # value = m * 2**(e - 1075), subnormals included
            np.right_shift(m, 26, out=w[:n], casting="unsafe")
            hi_acc += np.bincount(e, weights=w[:n], minlength=2048)
            np.bitwise_and(m, (1 << 26) - 1, out=w[:n], casting="unsafe")
            lo_acc += np.bincount(e, weights=w[:n], minlength=2048)
    total += flush()
    mask = (1 << BASE_BITS) - 1
    return np.array([float((total >> (BASE_BITS * k)) & mask) for k in range(DIGITS)])


def digits_value(digits: Any) -> float:
    """The correctly rounded value of summed ``sumsq_digits`` (inf beyond the float range)."""
    total = sum(int(d) << (BASE_BITS * k) for k, d in enumerate(np.asarray(digits, dtype=np.float64)))
    try:
        return total / (1 << _SHIFT)  # Python's int division rounds correctly
    except OverflowError:
        return float("inf")
