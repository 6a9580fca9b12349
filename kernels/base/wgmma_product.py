"""A 3xTF32 product on Hopper's wgmma, k-step by k-step: C (64 x N a warpgroup) += A B^T.

``kernels.base.wgmma`` gives the instruction; this is how chapter 11's forward uses it for
both of its products (S = Q_i K_j^T and O += P V_j). One k-step (8 columns of A, 8 of B) is
three wgmma m64nNk8 on one accumulator, the small terms first (``kernels.base.tf32_product``):

    x = A_lo B_hi,   x += A_hi B_lo,   x += A_hi B_hi

B's hi and lo planes are in shared memory (two descriptors, k-step s at 256 s bytes on); A's
parts come from the caller's ``a_parts(src, s) -> (a_hi, a_lo)``, ``src`` being whatever it
needs (a tuple of its arrays). The tensor cores add in a precision below fp32, so the sum of
a k-step is added to C in fp32 by the threads (as ``product`` adds mma.sync's), and long
chains on one accumulator are not taken: ``chain`` k-steps (1 or 2) a commit group, from zero.

The schedule hides the wait: a ROUND issues ``inflight`` groups (4 or 2) before waiting on the
first, then adds each group's sum while the later ones run (``wait_group 3, 2, 1, 0``: each
wait returns its own group's accumulators, so no read moves above it). No group stays in
flight past its round: its registers would be copied, and ptxas would then serialize every
wgmma. The k-steps a whole round does not cover run one a group.
"""

from __future__ import annotations

from numba import uint32

from kernels.base.inlined import inlined
from kernels.base.runtime import on_simulator

__all__ = ["make_wgmma_product", "SCHEDULES"]

SCHEDULES = ((2, 1), (4, 1), (2, 2), (4, 2), (1, 2))    # (inflight, chain) pairs a kernel may take


def make_wgmma_product(n_cols: int, steps: int, passes: int, a_parts, inflight: int, chain: int,
                       first_tile: int = 0):
    """``add_product(c, src, d_hi, d_lo)``: c (first_tile + n_cols / 8, 4) float32, a warp's
    accumulator tiles of the warpgroup's C, whose tiles first_tile.. (columns 8 first_tile on,
    n_cols of them) += the product over ``steps`` k-steps of A (``a_parts(src,
    s)``: this thread's 4 tf32 registers of k-step s, hi and lo) and B (``d_hi``, ``d_lo``: the
    ``wgmma_desc`` of its hi and lo planes at k-step 0, K-major). ``passes`` 3 (3xTF32) or 1
    (hi times hi only); ``inflight``, ``chain``: the schedule (``SCHEDULES``; one group in flight
    waits on each group as soon as it is issued: for accumulators too wide for two)."""
    from kernels.base.wgmma import desc_add, make_wgmma_tf32, make_wgmma_wait, make_zeros, wgmma_commit, \
        wgmma_fence

    if (inflight, chain) not in SCHEDULES:
        raise ValueError(f"inflight, chain: expected one of {SCHEDULES} (groups a round, k-steps a group); "
                         f"got {inflight}, {chain}")
    if passes not in (1, 3):
        raise ValueError(f"passes: expected 3 or 1, got {passes!r}")
    n = n_cols // 2                                   # accumulators a thread
    T = n_cols // 8                                   # its 16 x 8 tiles
    FLY, CHAIN, STEPS, THREE, J0 = int(inflight), int(chain), int(steps), passes == 3, int(first_tile)
    mma, zeros = make_wgmma_tf32(n_cols), make_zeros(n)
    wait0, wait1, wait2, wait3 = (make_wgmma_wait(n, p) for p in range(4))
    U = int if on_simulator() else uint32             # unsigned: the descriptor's offsets fold

    @inlined
    def first(src, s, dh, dl):
        """k-step s from zero (the first of a group)."""
        a_hi, a_lo = a_parts(src, s)
        at = U(256) * s                               # the k-step's 8 columns, 256 bytes on
        if THREE:
            x = mma(a_lo, desc_add(dh, at), zeros(), 0)
            x = mma(a_hi, desc_add(dl, at), x, 1)
            return mma(a_hi, desc_add(dh, at), x, 1)
        return mma(a_hi, desc_add(dh, at), zeros(), 0)

    @inlined
    def more(x, src, s, dh, dl):
        """k-step s added on the tensor cores to x (the second of a group of two)."""
        a_hi, a_lo = a_parts(src, s)
        at = U(256) * s
        if THREE:
            x = mma(a_lo, desc_add(dh, at), x, 1)
            x = mma(a_hi, desc_add(dl, at), x, 1)
        return mma(a_hi, desc_add(dh, at), x, 1)

    @inlined
    def issue(src, s, dh, dl):
        """CHAIN k-steps from s on, one group; its accumulators, not ready until waited on."""
        x = first(src, s, dh, dl)
        if CHAIN == 2:
            x = more(x, src, s + U(1), dh, dl)
        wgmma_commit()
        return x

    @inlined
    def issue1(src, s, dh, dl):
        """k-step s alone, one group (the k-steps left over)."""
        x = first(src, s, dh, dl)
        wgmma_commit()
        return x

    @inlined
    def add(c, x):
        """a group's sum, waited on, added to C in fp32."""
        for j in range(T):
            for e in range(4):
                c[J0 + j, e] += x[4 * j + e]

    @inlined
    def add_product(c, src, dh, dl):
        wgmma_fence()                                 # C and A's registers are written before wgmma reads
        s = U(0)
        if FLY == 4:                                  # four groups a round
            while s + U(4 * CHAIN - 1) < U(STEPS):
                x = issue(src, s, dh, dl)
                y = issue(src, s + U(CHAIN), dh, dl)
                z = issue(src, s + U(2 * CHAIN), dh, dl)
                w = issue(src, s + U(3 * CHAIN), dh, dl)
                add(c, wait3(x))
                add(c, wait2(y))
                add(c, wait1(z))
                add(c, wait0(w))
                s += U(4 * CHAIN)
        if FLY >= 2:
            while s + U(2 * CHAIN - 1) < U(STEPS):    # two groups a round
                x = issue(src, s, dh, dl)
                y = issue(src, s + U(CHAIN), dh, dl)
                add(c, wait1(x))
                add(c, wait0(y))
                s += U(2 * CHAIN)
        else:
            while s + U(CHAIN - 1) < U(STEPS):        # one group a round
                add(c, wait0(issue(src, s, dh, dl)))
                s += U(CHAIN)
        while s < U(STEPS):                           # the k-steps left over, one a group
            add(c, wait0(issue1(src, s, dh, dl)))
            s += U(1)

    return add_product
