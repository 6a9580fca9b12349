"""The walk of a key block in the tensor-core backwards (chapters 11 and 12).

K/V tiles outer (FlashAttention-2's backward): a block holds the keys k0 .. k0 + Bc - 1 of
one KV head and visits, in order, every (query head of its group, query tile) pair that can
see them: with the causal mask (query i sees key j when j <= i + diag, diag = Nk - Nq) the
query tiles before ``first`` see none of its keys and are skipped.

A block finds its first pair by division (``pair_at``: a split of the walk starts anywhere)
and steps to each next one by a comparison (``next_pair``): every warp of the block computes
the pair right after the barrier that starts a step, all at once, so a division's chain of
dependent instructions (some twenty, with a reciprocal) there is time no warp can hide.
"""

from __future__ import annotations

from numba import int32, uint32

from kernels.base.inlined import inlined

__all__ = ["query_pairs", "pair_at", "next_pair"]


@inlined
def query_pairs(k0, diag, causal, n_q, Br, group):
    """(first, n_tiles, steps): the first query tile that sees key k0, the query tiles from
    it on, and the pairs to visit (``group`` query heads, ``n_tiles`` tiles each)."""
    first = max(k0 - diag, 0) // Br if causal != 0 else 0
    n_tiles = max((n_q + Br - 1) // Br - first, 0)
    return first, n_tiles, group * n_tiles


@inlined
def pair_at(step, bkv, group, first, n_tiles, Br):
    """(bh, q0): the query head (of B*H) and first query row of the walk's ``step``-th pair.
    Both counts are non-negative: a 32-bit unsigned division (Python's // on Numba's int64 is
    a call to a signed 64-bit division, about a hundred instructions a query tile)."""
    s, n = uint32(step), uint32(n_tiles)
    return int32(bkv * group) + int32(s // n), (int32(first) + int32(s % n)) * int32(Br)


@inlined
def next_pair(bh, q0, first, n_tiles, Br):
    """The pair after (bh, q0) in the walk: the next query tile of the head, or, after its
    last, the next query head's tile ``first``. int32 in, int32 out."""
    nq0 = int32(q0 + Br)
    if nq0 >= int32((first + n_tiles) * Br):
        return int32(bh + 1), int32(first * Br)
    return int32(bh), nq0
