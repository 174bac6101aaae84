"""Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011) in NumPy:
the counter-based generator dropout draws from on both devices.

Word ``i`` of a stream is word ``i % 4`` of Philox(counter = (i // 4 low 32 bits, high 32 bits,
0, 0), key = (seed low 32 bits, high 32 bits)): any element's word is computed from its index
alone, so the GPU kernel (``hpctrain.nn.cuda_src``'s ``philox_word``) draws exactly these words in
any order and the CPU and GPU runs drop the same elements.
"""

from __future__ import annotations

import numpy as np

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
_LO = np.uint64(0xFFFFFFFF)
_32 = np.uint64(32)


def philox4x32(counters: np.ndarray, key: tuple[int, int], rounds: int = 10) -> np.ndarray:
    """Philox4x32 of ``counters`` (``(n, 4)`` uint32) under ``key`` (two 32-bit ints): ``(n, 4)`` uint32."""
    c = [counters[:, i].astype(np.uint64) for i in range(4)]
    k0, k1 = int(key[0]) & 0xFFFFFFFF, int(key[1]) & 0xFFFFFFFF
    for _ in range(rounds):
        p0, p1 = _M0 * c[0], _M1 * c[2]
        c = [(p1 >> _32) ^ c[1] ^ np.uint64(k0), p1 & _LO, (p0 >> _32) ^ c[3] ^ np.uint64(k1), p0 & _LO]
        k0, k1 = (k0 + _W0) & 0xFFFFFFFF, (k1 + _W1) & 0xFFFFFFFF
    return np.stack(c, axis=1).astype(np.uint32)


def words(seed: int, n: int) -> np.ndarray:
    """Words ``0 .. n-1`` of the stream of ``seed`` (a 64-bit int): uint32 ``(n,)``."""
    q = np.arange(-(-n // 4), dtype=np.uint64)
    counters = np.zeros((q.size, 4), dtype=np.uint32)
    counters[:, 0] = (q & _LO).astype(np.uint32)
    counters[:, 1] = (q >> _32).astype(np.uint32)
    return philox4x32(counters, (seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF)).reshape(-1)[:n]


def keep_threshold(p: float) -> int:
    """Elements whose word's top 24 bits are ``>=`` this are kept: probability ``1 - p`` to 2^-24."""
    return int(np.ceil(p * (1 << 24)))


def keep_mask(seed: int, shape: tuple[int, ...], p: float) -> np.ndarray:
    """Dropout's keep mask of ``shape`` (bool), element ``i`` in C order drawn from word ``i``."""
    n = int(np.prod(shape))
    return ((words(seed, n) >> np.uint32(8)) >= keep_threshold(p)).reshape(shape)
