"""One fp32 product on tensor cores as three TF32 products (3xTF32), or as one (plain TF32).

A float32 x splits into two TF32 parts, x = hi + lo (``split_tf32`` in ``kernels.base.mma``:
hi = x rounded to 10 mantissa bits, lo = the rest rounded again), and

    a b ~ a_lo b_hi + a_hi b_lo + a_hi b_hi          (the dropped a_lo b_lo: ~2^-22 |a||b|)

Chapter 11's forward and its backward both take their products so, on m16n8k8 fragments:
an A fragment is 4 floats, a B fragment 2, and a k-step's 16 x 8 result starts from zero
(the caller adds it into its fp32 accumulator: see ``product``).
"""

from __future__ import annotations

import functools

from numba import float32

from kernels.base.inlined import inlined

__all__ = ["make_tf32_product", "make_tf32_products", "make_tf32_product_pairs", "PASSES"]

PASSES = (1, 3)                 # TF32 products a fp32 product: 1 (plain TF32) or 3 (3xTF32)


@functools.lru_cache(maxsize=None)
def make_tf32_product(passes: int = 3, lo: str = "rounded"):
    """Device functions (split4, split2, product) for ``passes`` TF32 products a product:
    split4(a0, a1, a2, a3) -> (hi registers, lo registers) of an A fragment; split2(b0, b1)
    the same for a B fragment; product(a_hi, a_lo, b_hi, b_lo) -> one k-step's 16 x 8 tile
    of A B from zero, 4 floats. ``lo``: the splits' lo = x - hi "rounded" to tf32
    (``split_tf32``) or "truncated": its float32 bits, which the mma truncates
    (``split_tf32_unrounded``: one instruction less; the same |x - hi - lo| either way)."""
    from kernels.base.mma import mma_tf32, splits_for

    if passes not in PASSES:
        raise ValueError(f"passes: expected one of {PASSES}, got {passes!r}")
    THREE = passes == 3
    split_tf32, _ = splits_for(lo)

    @inlined
    def split4(a0, a1, a2, a3):
        h0, l0 = split_tf32(a0)
        h1, l1 = split_tf32(a1)
        h2, l2 = split_tf32(a2)
        h3, l3 = split_tf32(a3)
        return (h0, h1, h2, h3), (l0, l1, l2, l3)

    @inlined
    def split2(b0, b1):
        h0, l0 = split_tf32(b0)
        h1, l1 = split_tf32(b1)
        return (h0, h1), (l0, l1)

    @inlined
    def product(a_hi, a_lo, b_hi, b_lo):
        """One k-step's 16 x 8 tile of A B, from zero: the small terms first, the large last
        (or the hi-hi product alone). Each k-step starts a fresh accumulator, which the caller
        adds in fp32: the tensor core's fp32 sums may round toward zero, and a chain of them
        across all of N would add up a bias (measured on the H100: O's error grew with N)."""
        c = (float32(0.0), float32(0.0), float32(0.0), float32(0.0))
        if THREE:
            c = mma_tf32(a_lo, b_hi, c)
            c = mma_tf32(a_hi, b_lo, c)
        return mma_tf32(a_hi, b_hi, c)

    return split4, split2, product


@functools.lru_cache(maxsize=None)
def make_tf32_products(passes: int, n: int):
    """products(a_hi, a_lo, b, c): c[j, :] = one k-step's 16 x 8 tile of A B_j from zero, for the
    n B fragments b[j, :] = (b0 hi, b1 hi, b0 lo, b1 lo), as ``product`` computes each, but with
    the mma issued round by round: the n small-term products first, then the n other small
    ones, then the n large ones. A product's three mma depend on each other; so ordered, each
    waits for the one before it only every n mma, and the tensor core has n in flight (one
    product after another stalls on each result). b and c are (n, 4) local arrays indexed by
    constants: registers."""
    from kernels.base.mma import mma_tf32

    if passes not in PASSES:
        raise ValueError(f"passes: expected one of {PASSES}, got {passes!r}")
    THREE = passes == 3

    @inlined
    def products(a_hi, a_lo, b, c):
        zero = (float32(0.0), float32(0.0), float32(0.0), float32(0.0))
        if THREE:
            for j in range(n):
                x = mma_tf32(a_lo, (b[j, 0], b[j, 1]), zero)
                for e in range(4):
                    c[j, e] = x[e]
            for j in range(n):
                x = mma_tf32(a_hi, (b[j, 2], b[j, 3]), (c[j, 0], c[j, 1], c[j, 2], c[j, 3]))
                for e in range(4):
                    c[j, e] = x[e]
            for j in range(n):
                x = mma_tf32(a_hi, (b[j, 0], b[j, 1]), (c[j, 0], c[j, 1], c[j, 2], c[j, 3]))
                for e in range(4):
                    c[j, e] = x[e]
        else:
            for j in range(n):
                x = mma_tf32(a_hi, (b[j, 0], b[j, 1]), zero)
                for e in range(4):
                    c[j, e] = x[e]

    return products


@functools.lru_cache(maxsize=None)
def make_tf32_product_pairs(passes: int, n: int):
    """pairs(a_hi, a_lo, b, c, e_hi, e_lo, f, g): ``make_tf32_products``' n products of A with
    the B fragments b[j, :] into c[j, :] and n of another A, E, with f[j, :] into g[j, :],
    issued round by round across both sets: 2 n mma between one and the one that waits for
    it. Each result is ``product``'s bit for bit (the same mma in the same order)."""
    from kernels.base.mma import mma_tf32

    if passes not in PASSES:
        raise ValueError(f"passes: expected one of {PASSES}, got {passes!r}")
    THREE = passes == 3

    @inlined
    def pairs(a_hi, a_lo, b, c, e_hi, e_lo, f, g):
        zero = (float32(0.0), float32(0.0), float32(0.0), float32(0.0))
        if THREE:
            for j in range(n):
                x = mma_tf32(a_lo, (b[j, 0], b[j, 1]), zero)
                y = mma_tf32(e_lo, (f[j, 0], f[j, 1]), zero)
                for i in range(4):
                    c[j, i] = x[i]
                    g[j, i] = y[i]
            for j in range(n):
                x = mma_tf32(a_hi, (b[j, 2], b[j, 3]), (c[j, 0], c[j, 1], c[j, 2], c[j, 3]))
                y = mma_tf32(e_hi, (f[j, 2], f[j, 3]), (g[j, 0], g[j, 1], g[j, 2], g[j, 3]))
                for i in range(4):
                    c[j, i] = x[i]
                    g[j, i] = y[i]
            for j in range(n):
                x = mma_tf32(a_hi, (b[j, 0], b[j, 1]), (c[j, 0], c[j, 1], c[j, 2], c[j, 3]))
                y = mma_tf32(e_hi, (f[j, 0], f[j, 1]), (g[j, 0], g[j, 1], g[j, 2], g[j, 3]))
                for i in range(4):
                    c[j, i] = x[i]
                    g[j, i] = y[i]
        else:
            for j in range(n):
                x = mma_tf32(a_hi, (b[j, 0], b[j, 1]), zero)
                y = mma_tf32(e_hi, (f[j, 0], f[j, 1]), zero)
                for i in range(4):
                    c[j, i] = x[i]
                    g[j, i] = y[i]

    return pairs
