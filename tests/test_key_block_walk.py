"""The walk of a key block in the tensor-core backwards (kernels/base/key_block_walk.py).

A block of keys k0 .. k0 + Bc - 1 visits every (query head of its KV head's group, query
tile) pair that can see them, in order: heads bkv * group .. + group - 1, each from the
first tile that sees key k0 (causal, bottom-right aligned: query i sees key j when
j <= i + Nk - Nq) to the last. A block (or a split of the walk) finds its first pair by
division (``pair_at``) and steps to each next one by a comparison (``next_pair``); both must
give the pairs a plain Python loop gives.
"""

import functools

import numpy as np
from hypothesis import example, given, settings, strategies as st
from numba import cuda, int32

from kernels.base.testing import gpu_examples
from kernels.base.key_block_walk import next_pair, pair_at, query_pairs
from kernels.base.runtime import on_simulator

SIM = on_simulator()


@functools.lru_cache(maxsize=None)
def _walk_kernel(Br):
    @cuda.jit
    def walk(k0, diag, causal, n_q, group, bkv, start, out):
        # one thread: the pairs from step `start` on, as the kernels take them
        first, n_tiles, steps = query_pairs(k0, diag, causal, n_q, Br, group)
        out[0, 0] = steps
        bh, q0 = int32(0), int32(0)
        if steps > start:
            bh, q0 = pair_at(start, bkv, group, first, n_tiles, Br)
        for i in range(steps - start):
            out[1 + i, 0] = bh
            out[1 + i, 1] = q0
            bh, q0 = next_pair(bh, q0, first, n_tiles, Br)

    return walk


def _expected(k0, diag, causal, n_q, Br, group, bkv):
    pairs = []
    for h in range(group):
        for q0 in range(0, n_q, Br):
            if not causal or k0 <= q0 + Br - 1 + diag:        # the tile's last query sees key k0
                pairs.append((bkv * group + h, q0))
    return pairs


@given(Br=st.sampled_from([16, 64, 128]), n_q=st.integers(1, 600), n_k=st.integers(1, 600),
       key_block=st.integers(0, 9), causal=st.booleans(), group=st.integers(1, 4), bkv=st.integers(0, 3),
       start=st.integers(0, 12))
@settings(max_examples=20 if SIM else gpu_examples(200))
@example(Br=64, n_q=256, n_k=256, key_block=1, causal=True, group=2, bkv=1, start=3)   # a split mid-head
def test_the_walk_visits_the_pairs_in_order(Br, n_q, n_k, key_block, causal, group, bkv, start):
    k0 = min(key_block * 64, n_k - 1)
    diag = n_k - n_q
    pairs = _expected(k0, diag, causal, n_q, Br, group, bkv)
    start = min(start, len(pairs))
    out = np.full((2 + len(pairs), 2), -7, np.int32)
    _walk_kernel(Br)[1, 1](k0, diag, int(causal), n_q, group, bkv, start, out)
    assert out[0, 0] == len(pairs), (out[0, 0], len(pairs))
    got = [tuple(int(x) for x in row) for row in out[1:1 + len(pairs) - start]]
    assert got == pairs[start:]
    assert (out[1 + len(pairs) - start:] == -7).all()
