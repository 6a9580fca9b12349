"""The oracle's own tests: everything else is tested against it, so it is tested first."""

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kernels import reference as ref


def _random_case(seed, b, h, nq, nk, d, magnitude=1.0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, h, nq, d)) * magnitude
    k = rng.standard_normal((b, h, nk, d)) * magnitude
    v = rng.standard_normal((b, h, nk, d))
    return q, k, v


def _loss(q, k, v, do, **kw):
    o, _ = ref.attention(q, k, v, **kw)
    return float(np.sum(o * do))


def _finite_difference(f, x, eps=1e-6):
    """Central differences of scalar f with respect to every entry of x."""
    grad = np.zeros_like(x)
    it = np.nditer(x, flags=["multi_index"])
    for _ in it:
        i = it.multi_index
        old = x[i]
        x[i] = old + eps
        up = f()
        x[i] = old - eps
        down = f()
        x[i] = old
        grad[i] = (up - down) / (2 * eps)
    return grad


@settings(max_examples=15)
@given(
    seed=st.integers(0, 2**32 - 1),
    nq=st.integers(1, 5),
    nk=st.integers(1, 5),
    d=st.integers(1, 4),
    causal=st.booleans(),
    use_block_mask=st.booleans(),
    scale=st.one_of(st.none(), st.floats(0.1, 2.0)),
)
@example(seed=1, nq=3, nk=5, d=2, causal=True, use_block_mask=False, scale=None)
@example(seed=2, nq=5, nk=2, d=3, causal=True, use_block_mask=False, scale=None)  # rows 0..2 see nothing
def test_backward_matches_finite_differences(seed, nq, nk, d, causal, use_block_mask, scale):
    q, k, v = _random_case(seed, 1, 2, nq, nk, d)
    do = np.random.default_rng(seed + 1).standard_normal((1, 2, nq, d))
    block_mask = None
    if use_block_mask:
        flags = np.random.default_rng(seed + 2).random((2, -(-nq // 2), -(-nk // 2))) < 0.6
        block_mask = ref.BlockMask(flags, 2, 2)
    kw = dict(causal=causal, scale=scale, block_mask=block_mask)
    o, lse = ref.attention(q, k, v, **kw)
    dq, dk, dv = ref.attention_backward(q, k, v, o, lse, do, **kw)
    for name, x, analytic in (("dq", q, dq), ("dk", k, dk), ("dv", v, dv)):
        numeric = _finite_difference(lambda: _loss(q, k, v, do, **kw), x)
        np.testing.assert_allclose(analytic, numeric, rtol=1e-6, atol=1e-7, err_msg=name)


def test_attention_matches_softmax_definition():
    q, k, v = _random_case(0, 2, 3, 7, 9, 5)
    s = (q @ np.swapaxes(k, -1, -2)) / np.sqrt(5)
    p = np.exp(s) / np.exp(s).sum(-1, keepdims=True)
    o, lse = ref.attention(q, k, v)
    np.testing.assert_allclose(o, p @ v, rtol=1e-12)
    np.testing.assert_allclose(lse, np.log(np.exp(s).sum(-1)), rtol=1e-12)


@pytest.mark.parametrize("nq,nk", [(5, 5), (4, 7), (7, 4), (1, 1), (6, 1)])
def test_causal_is_bottom_right_aligned(nq, nk):
    mask = ref.causal_mask(nq, nk)
    for i in range(nq):
        for j in range(nk):
            assert mask[i, j] == (j <= i + nk - nq)
    if nq == nk:
        np.testing.assert_array_equal(mask, np.tril(np.ones((nq, nk), bool)))


def test_fully_masked_rows_give_zero_output_minus_inf_lse_zero_grads():
    # Nq > Nk with causal: the first Nq - Nk query rows see no key at all.
    q, k, v = _random_case(3, 1, 2, 6, 2, 3, magnitude=5.0)
    o, lse = ref.attention(q, k, v, causal=True)
    assert not np.isnan(o).any() and not np.isnan(lse).any()
    assert np.all(o[:, :, :4] == 0) and np.all(lse[:, :, :4] == -np.inf)
    assert np.all(np.isfinite(lse[:, :, 4:]))
    do = np.random.default_rng(4).standard_normal(o.shape)
    dq, dk, dv = ref.attention_backward(q, k, v, o, lse, do, causal=True)
    assert not any(np.isnan(g).any() for g in (dq, dk, dv))
    assert np.all(dq[:, :, :4] == 0)


def test_empty_block_mask_gives_zeros():
    q, k, v = _random_case(5, 1, 1, 8, 8, 4)
    bm = ref.BlockMask(np.zeros((2, 2), bool), 4, 4)
    o, lse = ref.attention(q, k, v, block_mask=bm)
    assert np.all(o == 0) and np.all(lse == -np.inf)


def test_block_mask_expansion():
    flags = np.array([[True, False, True], [False, True, False]])
    bm = ref.BlockMask(flags, 3, 2)
    full = ref.expand_block_mask(bm, 5, 6)  # ragged: the last query tile has 2 rows
    assert full.shape == (5, 6)
    for i in range(5):
        for j in range(6):
            assert full[i, j] == flags[i // 3, j // 2]
    with pytest.raises(ValueError, match="block_mask"):
        ref.expand_block_mask(bm, 7, 6)


def test_large_logits_do_not_overflow():
    q, k, v = _random_case(6, 1, 1, 4, 4, 2, magnitude=1e4)
    o, lse = ref.attention(q, k, v)
    assert np.all(np.isfinite(o)) and np.all(np.isfinite(lse))
    # with huge logits the softmax is one-hot on the row max
    s = (q @ np.swapaxes(k, -1, -2)) / np.sqrt(2)
    np.testing.assert_allclose(o[0, 0], v[0, 0][np.argmax(s[0, 0], axis=-1)], rtol=1e-12)


def test_float32_mode_computes_in_float32():
    q, k, v = _random_case(7, 1, 1, 3, 3, 2)
    o, lse = ref.attention(q, k, v, dtype=np.float32)
    assert o.dtype == np.float32 and lse.dtype == np.float32


def test_softmax_rows_sum_to_one_and_all_masked_row_is_zero():
    x = np.random.default_rng(8).standard_normal((4, 6)) * 50
    x[2] = -np.inf
    p = ref.softmax(x)
    np.testing.assert_allclose(p[[0, 1, 3]].sum(-1), 1.0, rtol=1e-12)
    assert np.all(p[2] == 0)
    assert ref.logsumexp(x)[2] == -np.inf


@pytest.mark.parametrize("nq,nk", [(0, 3), (3, 0), (0, 0)])
def test_empty_sequences(nq, nk):
    q, k, v = _random_case(9, 2, 1, nq, nk, 3)
    o, lse = ref.attention(q, k, v, causal=True)
    assert o.shape == (2, 1, nq, 3) and lse.shape == (2, 1, nq)
    assert np.all(o == 0) and np.all(lse == -np.inf)
    do = np.ones_like(o)
    dq, dk, dv = ref.attention_backward(q, k, v, o, lse, do, causal=True)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert not np.isnan(dq).any() and np.all(dk == 0) and np.all(dv == 0)


@given(rows=st.integers(1, 4), n=st.integers(1, 9), bad=st.sampled_from([np.nan, np.inf, -np.inf]),
       seed=st.integers(0, 2**32 - 1), dtype=st.sampled_from([np.float64, np.float32]))
def test_nan_or_inf_in_a_row_reaches_that_row_only(rows, n, bad, seed, dtype):
    """softmax and logsumexp: a NaN or +inf makes its row NaN throughout (as PyTorch's
    softmax does), other rows are untouched; -inf is a masked entry, not an error."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, n)) * 3
    clean_p, clean_l = ref.softmax(x, dtype=dtype), ref.logsumexp(x, dtype=dtype)
    r, j = rng.integers(rows), rng.integers(n)
    x[r, j] = bad
    p, lse = ref.softmax(x, dtype=dtype), ref.logsumexp(x, dtype=dtype)
    others = np.arange(rows) != r
    assert np.array_equal(p[others], clean_p[others]) and np.array_equal(lse[others], clean_l[others])
    if np.isneginf(bad):
        assert p[r, j] == 0 and np.isfinite(p[r]).all()
        assert np.isfinite(lse[r]) or n == 1 and lse[r] == -np.inf
    else:
        assert np.isnan(p[r]).all() and np.isnan(lse[r])
