"""The online softmax on mma accumulator fragments: what the tensor-core forwards share.

Chapter 8's kernel (fp16/bf16, m16n8k16) and chapter 11's (3xTF32, m16n8k8) keep S, P and O
in accumulator tiles of 16 x 8 with the same layout: lane 4 g + t holds rows g and g + 8,
columns 2t and 2t + 1 (``kernels.base.mma.c_position``). A warp owns 16 query rows; a row's
8 columns of a tile are spread over the 4 lanes of a quad. Between the two products of a
K/V tile both kernels do the same three things on those registers, written once here:

    scale_and_mask   S <- S scale log2 e; -inf (MASKED) past n_k and above the causal
                     diagonal, element by element only on a tile that crosses either
    online_softmax   m' = max(m, rowmax S) (over the quad), O and l rescaled by exp2(m - m'),
                     P = exp2(S - m'), l += rowsum P (a lane's share; the quad adds at the end)
    write_rows       O / l and L = (m + log2 l) ln 2 for rows < n_q; a row that saw no key:
                     O = 0, L = -inf. O as float32, or rounded to the inputs' fp16 or bf16
                     (``o_type``, ``kernels.base.mma.make_output_store``)

``sc`` is (NS, 4) (S, then P), ``acc`` (ND, 4) (O), ``m`` and ``l`` (2,) (rows g and g + 8).
"""

from __future__ import annotations

import functools
import math

from numba import float32

from kernels.base.fused import MASKED, MINUS_INF, make_row_reductions
from kernels.base.inlined import inlined

__all__ = ["make_fragment_softmax"]

LN2 = math.log(2.0)


@functools.lru_cache(maxsize=None)
def make_fragment_softmax(NS: int, ND: int, THREADS: int, o_type: str | None = None):
    """(scale_and_mask, online_softmax, write_rows) for NS tiles of S (Bc = 8 NS keys), ND
    tiles of O (D = 8 ND) and blocks of THREADS threads; write_rows writes O as float32, or
    ``o_type`` "f16" / "bf16" (16-bit patterns). NaN: max.f32 skips a NaN score, but its
    p = exp2(NaN - m) is NaN, and so are l and the row's O and L."""
    from kernels.base.mma import make_output_store

    Bc = 8 * NS
    store = make_output_store(o_type)
    row_max, row_sum = make_row_reductions(4, THREADS, propagate_nan=False)

    @inlined
    def scale_and_mask(sc, k0, wrow0, g, t, n_k, diag, causal, scale2):
        # only a tile that crosses n_k or this warp's causal diagonal is masked
        if k0 + Bc > n_k or (causal != 0 and k0 + Bc - 1 > wrow0 + diag):
            for nt in range(NS):
                for e in range(4):
                    key = k0 + nt * 8 + 2 * t + e % 2
                    row = wrow0 + g + 8 * (e // 2)
                    x = sc[nt, e] * scale2
                    if key >= n_k or (causal != 0 and key > row + diag):
                        x = MASKED
                    sc[nt, e] = x
        else:
            for nt in range(NS):
                for e in range(4):
                    sc[nt, e] *= scale2

    @inlined
    def online_softmax(sc, acc, m, l):
        for h in range(2):                           # rows g (h = 0) and g + 8 (h = 1)
            mx = m[h]
            for nt in range(NS):
                mx = max(mx, max(sc[nt, 2 * h], sc[nt, 2 * h + 1]))
            mx = row_max(mx)                         # the quad's 4 lanes hold the row
            alpha = math.exp2(m[h] - mx)
            m[h] = mx
            l[h] *= alpha
            for j in range(ND):
                acc[j, 2 * h] *= alpha
                acc[j, 2 * h + 1] *= alpha
            base = mx if mx > MASKED else float32(0.0)     # nothing seen yet: every p is 0
            for nt in range(NS):
                for e in range(2):
                    p = math.exp2(sc[nt, 2 * h + e] - base)
                    l[h] += p
                    sc[nt, 2 * h + e] = p

    @inlined
    def write_rows(acc, m, l, o, lse, bh, wrow0, g, t, n_q, d):
        for h in range(2):
            total = row_sum(l[h])                    # the quad's sums first
            row = wrow0 + g + 8 * h
            if row < n_q:
                if total > float32(0.0) or total != total:
                    inv = float32(1.0) / total
                    for j in range(ND):
                        for e in range(2):
                            col = j * 8 + 2 * t + e
                            if col < d:
                                store(o, bh, row, col, acc[j, 2 * h + e] * inv)
                    if t == 0:
                        lse[bh, row] = (m[h] + math.log2(total)) * float32(LN2)
                else:                                # saw no key
                    for j in range(ND):
                        for e in range(2):
                            col = j * 8 + 2 * t + e
                            if col < d:
                                store(o, bh, row, col, float32(0.0))
                    if t == 0:
                        lse[bh, row] = MINUS_INF

    return scale_and_mask, online_softmax, write_rows
