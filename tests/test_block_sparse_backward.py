"""Chapter 6: block-sparse attention, backward, against the float64 oracle.

Cases are drawn by ``tests/sparse_cases.py``; the forward's outputs come from the oracle,
rounded to float32, so that only the backward is judged here.
"""

import numpy as np
import pytest
from hypothesis import example, given

from kernels import reference as ref
from kernels import sparsity_patterns as sp
from kernels.block_sparse import block_sparse_attention
from kernels.block_sparse_backward import block_sparse_attention_backward
from kernels.base.testing import assert_close, gradient_floor_scales, random_array
from sparse_cases import DQ_MODES, MAX_N, build, case, sparse_cases


# --------------------------------------------------------------------------- backward

def check_backward(c):
    q, k, v, mask = build(c)
    do = random_array(np.random.default_rng(c["seed"] + 1), q.shape)
    kw = dict(causal=c["causal"], scale=c["scale"], block_mask=mask)
    o64, lse64 = ref.attention(q, k, v, **kw)
    o, lse = o64.astype(np.float32), lse64.astype(np.float32)   # the forward's outputs, rounded
    got = block_sparse_attention_backward(q, k, v, o, lse, do, mask, causal=c["causal"], scale=c["scale"],
                                          block_m=c["block_m"], block_n=c["block_n"], dq_mode=c["dq_mode"])
    # exact: the float64 gradients for the float32 (O, L) the kernel is given
    exact = ref.attention_backward(q, k, v, o, lse, do, **kw)
    base = ref.attention_backward(q, k, v, o, lse, do, dtype=np.float32, **kw)
    floors = gradient_floor_scales(q, k, v, o, lse, do, **kw)
    for g, e, bl, fs, name in zip(got, exact, base, floors, ("dQ", "dK", "dV")):
        assert g.dtype == np.float32
        assert_close(g, e, bl, name=name, floor_scale=fs)
    return got


# Large logits (|q|, |k| ~ 3, scale up to 2) are drawn too: dQ and dK are then small
# differences of large terms, and their floor follows those terms (kernels.base.testing.gradient_floor_scales).
@given(sparse_cases(max_n=min(MAX_N, 32)))
@example(case(nq=1, nk=1, d=1, density=1.0))
@example(case(b=2, h=2, nq=1, nk=4, d=17, magnitude=3.0, kind="sliding window", bq=16, bk=16))
@example(case(nq=16, nk=16, d=8, magnitude=3.0, scale=2.0, causal=True, density=0.9, seed=11))
@example(case(nq=20, nk=7, d=5, causal=True, kind="random", layout="head", h=2, density=0.8))  # empty rows
@example(case(nq=20, nk=7, d=5, causal=True, kind="random", layout="head", h=2, density=0.8, dq_mode="separate"))
@example(case(nq=9, nk=17, d=3, bq=8, bk=16, block_m=4, block_n=8, layout="batch-head", b=2, h=1))
@example(case(nq=13, nk=9, d=6, bq=8, bk=4, block_m=8, block_n=4, dq_mode="separate"))   # Br > Bc
@example(case(nq=12, nk=12, d=4, kind="butterfly", causal=True, magnitude=3.0, scale=1.3))
def test_backward_matches_oracle(c):
    check_backward(c)


def test_separate_dq_is_deterministic_and_atomic_dq_stable_within_tolerance():
    """dq_mode="separate": bitwise the same from run to run. "atomic": dQ's additions land in
    whatever order the blocks reach them, so dQ may differ in its last bits, but every run
    meets the tolerance rule (check_backward) and dK, dV (no atomics) stay bitwise equal."""
    c = case(b=1, h=2, nq=14, nk=11, d=3, causal=True, density=0.6, seed=5, dq_mode="separate")
    first, again = check_backward(c), check_backward(c)
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    c = case(b=1, h=2, nq=30, nk=23, d=5, density=0.7, seed=6, bq=8, bk=8, dq_mode="atomic")
    runs = [check_backward(c) for _ in range(3)]
    for other in runs[1:]:
        assert np.array_equal(runs[0][1], other[1]) and np.array_equal(runs[0][2], other[2])
        assert np.allclose(runs[0][0], other[0], rtol=0, atol=1e-5 * np.abs(runs[0][0]).max())


@pytest.mark.parametrize("dq_mode", DQ_MODES)
def test_empty_mask_gives_zero_gradients(dq_mode):
    rng = np.random.default_rng(2)
    q, k, v, do = (random_array(rng, (1, 1, 10, 3)) for _ in range(4))
    mask = ref.BlockMask(np.zeros((3, 3), bool), 4, 4)
    o, lse = block_sparse_attention(q, k, v, mask)
    for g in block_sparse_attention_backward(q, k, v, o, lse, do, mask, dq_mode=dq_mode):
        assert np.array_equal(g, np.zeros_like(g))


def test_dense_mask_backward_equals_dense_backward():
    """Every tile kept: this backward and chapter 5's both pass the tolerance rule against
    the oracle, given the same (O, L). (They sum over different tiles in different orders,
    so their agreement is bounded by the sum of the two errors, which the rule checks.)"""
    from kernels.flash_backward import flash_attention_backward

    rng = np.random.default_rng(8)
    q, do = random_array(rng, (1, 2, 13, 5)), random_array(rng, (1, 2, 13, 5))
    k, v = random_array(rng, (1, 2, 10, 5)), random_array(rng, (1, 2, 10, 5))
    mask = sp.dense(13, 10, block=8)
    for causal in (False, True):
        o, lse = block_sparse_attention(q, k, v, mask, causal=causal)
        exact = ref.attention_backward(q, k, v, o, lse, do, causal=causal)
        base = ref.attention_backward(q, k, v, o, lse, do, causal=causal, dtype=np.float32)
        floors = gradient_floor_scales(q, k, v, o, lse, do, causal=causal, scale=None, block_mask=mask)
        for grads, who in ((block_sparse_attention_backward(q, k, v, o, lse, do, mask, causal=causal), ""),
                           (block_sparse_attention_backward(q, k, v, o, lse, do, mask, causal=causal,
                                                            dq_mode="separate"), " (separate dQ)"),
                           (flash_attention_backward(q, k, v, o, lse, do, causal=causal), " (chapter 5)")):
            for g, e, bl, fs, name in zip(grads, exact, base, floors, ("dQ", "dK", "dV")):
                assert_close(g, e, bl, name=name + who, floor_scale=fs)


def _inputs(nq=8, nk=8, d=4):
    rng = np.random.default_rng(0)
    return (random_array(rng, (1, 2, nq, d)), random_array(rng, (1, 2, nk, d)), random_array(rng, (1, 2, nk, d)))


def test_backward_bad_input_names_the_argument():
    q, k, v = _inputs()
    mask = ref.BlockMask(np.ones((2, 2), bool), 4, 4)
    o, lse = block_sparse_attention(q, k, v, mask)
    with pytest.raises(ValueError, match="do"):
        block_sparse_attention_backward(q, k, v, o, lse, o[:, :, :3], mask)
    with pytest.raises(ValueError, match="lse"):
        block_sparse_attention_backward(q, k, v, o, lse[:, :1], o, mask)
    with pytest.raises(TypeError, match="o"):
        block_sparse_attention_backward(q, k, v, o.astype(np.float64), lse, o, mask)
    with pytest.raises(ValueError, match="block_mask"):
        block_sparse_attention_backward(q, k, v, o, lse, o, ref.BlockMask(np.ones((3, 2), bool), 4, 4))
    with pytest.raises(ValueError, match="block_mask"):
        block_sparse_attention_backward(q, k, v, o, lse, o, mask, block_n=8)
    with pytest.raises(ValueError, match="dq_mode"):
        block_sparse_attention_backward(q, k, v, o, lse, o, mask, dq_mode="sorted")


