"""Chapter 10: attention dropout with the mask regenerated from Philox, never stored.

The generator against Random123's published known-answer vectors (device function and
NumPy twin, bit for bit); the kept fraction against a binomial bound; the float64 oracle's
backward against central differences; the kernels against the oracle under the tolerance
rule (floors derived as kernels.base.testing's, with the dropped and rescaled weights);
p = 0 gives chapter 4's and chapter 5's rung 2 bit for bit; a backward with another seed
than its forward, or without the 1 / (1 - p), is caught.
"""

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from numba import cuda

from kernels import reference as ref
from kernels import dropout as dr
from kernels.base import testing as tt
from kernels.base.runtime import on_simulator
from kernels.base.testing import gpu_examples, Floor, U, assert_close, attention_cases, case_with, random_array
from kernels.flash_backward import shared_tile_backward
from kernels.flash_forward import query_tile_attention
from test_reference import _finite_difference

SIM = on_simulator()
MAX_N = 16 if SIM else 200
MAX_D = 8 if SIM else 128
P_CHOICES = (0.0, 0.1, 0.5)
# (Br, Bc): ragged tiles and tiles of one row check that a thread's keys reach the Philox
# call of their group of four in order, across tile boundaries.
TILES = [None, (3, 5), (1, 1)] if SIM else [None, (32, 32), (17, 8)]

# Random123's known-answer vectors for Philox4x32-10 (its tests/kat_vectors; the same three
# are in TensorFlow's stateful_random_ops_test.py, citing Random123-Boost's test_philox.cpp):
# (counter, key, output). The third counter and key are the hex digits of pi.
PHILOX_KAT = [
    ((0x00000000, 0x00000000, 0x00000000, 0x00000000), (0x00000000, 0x00000000),
     (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF),
     (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@cuda.jit
def _philox_kernel(counters, keys, out):
    t = cuda.grid(1)
    if t < counters.shape[0]:
        x0, x1, x2, x3 = dr.philox4x32(counters[t, 0], counters[t, 1], counters[t, 2], counters[t, 3],
                                       keys[t, 0], keys[t, 1])
        out[t, 0], out[t, 1], out[t, 2], out[t, 3] = x0, x1, x2, x3


# --------------------------------------------------------------------------- the generator

def test_philox_known_answers_device_and_numpy():
    """The three published vectors, then 61 random (counter, key) pairs: the device function
    and the NumPy twin give the same bits."""
    rng = np.random.default_rng(0)
    counters = np.concatenate([np.array([c for c, _, _ in PHILOX_KAT], np.uint32),
                               rng.integers(0, 2**32, (61, 4), dtype=np.uint32)])
    keys = np.concatenate([np.array([k for _, k, _ in PHILOX_KAT], np.uint32),
                           rng.integers(0, 2**32, (61, 2), dtype=np.uint32)])
    want = np.array([w for _, _, w in PHILOX_KAT], np.uint32)
    twin = dr.philox4x32_numpy(counters, keys)
    np.testing.assert_array_equal(twin[:3], want, err_msg="NumPy twin against Random123's vectors")
    out = cuda.to_device(np.zeros((64, 4), np.uint32))
    _philox_kernel[2, 32](cuda.to_device(counters), cuda.to_device(keys), out)
    np.testing.assert_array_equal(out.copy_to_host(), twin, err_msg="device function against the NumPy twin")


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_kept_fraction_is_binomial(p):
    """Over 2^18 elements (4 heads of 256 x 256) the kept count is within 5 standard
    deviations of n (1 - p) (a false alarm about once in 3.5 million seeds; a threshold off
    by 1% of p is 13 to 24 sigma away), in every head, in each lane j mod 4 (counts over
    2^16), and the heads' masks differ."""
    z = dr.keep_mask(2, 2, 256, 256, p=p, seed=0x0123456789ABCDEF)
    for part, name in ((z, "all"), *((z[:, :, :, r::4], f"lane {r}") for r in range(4)),
                       *((z[b, h], f"head {b},{h}") for b in range(2) for h in range(2))):
        n = part.size
        sigma = np.sqrt(n * p * (1 - p))
        assert abs(part.sum() - n * (1 - p)) <= 5 * sigma, f"{name}: kept {part.sum()} of {n}, p = {p}"
    assert not np.array_equal(z[0, 0], z[0, 1]) and not np.array_equal(z[0, 0], z[1, 0])


def test_threshold_and_seed_checks():
    assert dr.keep_threshold(0.0) == 0 and dr.keep_threshold(0.5) == 2**31
    assert dr.keep_threshold(1 - 2.0**-32) == 2**32 - 1
    assert dr.seed_key(2**64 - 1) == (2**32 - 1, 2**32 - 1) and dr.seed_key(5 << 32 | 7) == (7, 5)
    q = np.zeros((1, 1, 2, 4), np.float32)
    for kw, err, word in ((dict(p=1.0, seed=0), ValueError, "p:"), (dict(p=-0.1, seed=0), ValueError, "p:"),
                          (dict(p="0.1", seed=0), TypeError, "p:"), (dict(p=float("nan"), seed=0), ValueError, "p:"),
                          (dict(p=0.1, seed=-1), ValueError, "seed:"), (dict(p=0.1, seed=2**64), ValueError, "seed:"),
                          (dict(p=0.1, seed=1.5), TypeError, "seed:"), (dict(p=0.1, seed=True), TypeError, "seed:")):
        with pytest.raises(err, match=word):
            dr.dropout_attention(q, q, q, **kw)
        with pytest.raises(err, match=word):
            dr.dropout_attention_backward(q, q, q, q, q[..., 0], q, **kw)


# --------------------------------------------------------------------------- the oracle
# (central differences: the oracle tests' own, tests/test_reference.py)

@pytest.mark.parametrize("causal,nq,nk,p", [(False, 4, 5, 0.5), (True, 5, 3, 0.3)])   # causal: rows see nothing
def test_oracle_backward_matches_finite_differences(causal, nq, nk, p):
    """For a fixed seed the mask is fixed, O is smooth in q, k, v: the closed form is its
    gradient (the loss sum(O dO))."""
    rng = np.random.default_rng(7)
    q, k, v = rng.standard_normal((1, 2, nq, 3)), rng.standard_normal((1, 2, nk, 3)), rng.standard_normal((1, 2, nk, 3))
    do = rng.standard_normal((1, 2, nq, 3))
    kw = dict(p=p, seed=12345, causal=causal)
    o, lse = dr.dropout_attention_oracle(q, k, v, **kw)
    assert 0 < dr.keep_mask(1, 2, nq, nk, p=p, seed=12345).mean() < 1      # some kept, some dropped
    grads = dr.dropout_attention_backward_oracle(q, k, v, o, lse, do, **kw)
    for name, x, g in zip(("dq", "dk", "dv"), (q, k, v), grads):
        numeric = _finite_difference(lambda: float(np.sum(dr.dropout_attention_oracle(q, k, v, **kw)[0] * do)), x)
        np.testing.assert_allclose(g, numeric, rtol=1e-6, atol=1e-7, err_msg=name)


def test_p_zero_is_attention():
    """p = 0: the oracle is kernels.reference's attention exactly, and the kernels are
    chapter 4's and chapter 5's rung 2 bit for bit (same tiles)."""
    case = case_with((2, 1, 9, 5), (2, 1, 11, 5), causal=True)
    o, lse = dr.dropout_attention_oracle(case.q, case.k, case.v, p=0.0, seed=3, causal=True)
    want_o, want_l = ref.attention(case.q, case.k, case.v, causal=True)
    np.testing.assert_array_equal(o, want_o)
    np.testing.assert_array_equal(lse, want_l)
    got = dr.dropout_attention(case.q, case.k, case.v, p=0.0, seed=3, causal=True)
    for g, w in zip(got, query_tile_attention(case.q, case.k, case.v, causal=True)):
        np.testing.assert_array_equal(g, w)
    o32, l32, do = o.astype(np.float32), lse.astype(np.float32), random_array(np.random.default_rng(1), o.shape)
    got = dr.dropout_attention_backward(case.q, case.k, case.v, o32, l32, do, p=0.0, seed=3, causal=True)
    for g, w in zip(got, shared_tile_backward(case.q, case.k, case.v, o32, l32, do, causal=True)):
        np.testing.assert_array_equal(g, w)


# --------------------------------------------------------------------------- floors
# kernels.base.testing's first-order model (the notes above its C_EXP), with P's weights in
# O and in dV replaced by W = P o Z / (1 - p), and dP by (dO V^T) o Z / (1 - p).

def _relative_p(q, k, scale, causal):
    """(scores, P, P's relative error in U, the row's error) as testing's attention floors."""
    s, scale, _ = dr._scores(np.asarray(q, np.float64), np.asarray(k, np.float64), scale, causal, np.float64)
    s_err = tt.C_SERIAL * scale * tt._nan0(tt.serial_sum_spread(q, k))
    p, pr, row = tt._softmax_model(s, s_err)
    return scale, p, pr, row


def forward_floors(q, k, v, *, p, seed, causal, scale):
    """(Floor of O, Floor of L): O = W V moves by sum_j W_j rel_j V_j - O sum_j P_j rel_j (in
    quadrature), the products' rounding (C_NORM U |O|) and the sum's (C_DOT U W |V|); L is
    attention's L (kernels.base.testing.attention_floors)."""
    B, H, nq, _ = q.shape
    nk = k.shape[-2]
    _, P, pr, row = _relative_p(q, k, scale, causal)
    w = np.where(dr.keep_mask(B, H, nq, nk, p=p, seed=seed), 1.0 / (1.0 - p), 0.0)
    v = tt._nan0(v)
    o = (P * w) @ v
    f_o = U * (np.sqrt(((pr * w) ** 2) @ (v * v)) + (row + tt.C_NORM + 1) * np.abs(o) + tt.C_DOT * ((P * w) @ np.abs(v)))
    f_l = tt.attention_floors(q, k, v, causal=causal, scale=scale).lse
    return Floor(f_o, "dropout O floor: W's errors, normalisation, U sum W|V|"), f_l


def gradient_floors(q, k, v, o, lse, do, *, p, seed, causal, scale):
    """Floors of (dQ, dK, dV), as kernels.base.testing.attention_gradient_floors with the
    dropped weights: dS = P (dP o Z/(1-p) - D) errs by P (rel |dP' - D| + C_DOT Z/(1-p) |dO||V|^T)
    plus D's C_DOT U rowsum|dO O|; dV = W^T dO by W's errors in quadrature plus U W^T |dO|."""
    q, k, v, o, lse, do = (tt._nan0(x) if x is not lse else np.asarray(x, np.float64) for x in (q, k, v, o, lse, do))
    B, H, nq, _ = q.shape
    nk = k.shape[-2]
    if nq == 0 or nk == 0:
        return tuple(Floor(np.zeros(x.shape), "empty") for x in (q, k, v))
    scale = (1.0 / np.sqrt(q.shape[-1])) if scale is None else scale
    s, _, mask = dr._scores(q, k, scale, causal, np.float64)
    live = np.isfinite(lse)[..., None] & (np.ones((1, 1), bool) if mask is None else mask)
    x = np.where(live, s - np.where(live, np.nan_to_num(lse[..., None], neginf=0.0), 0.0), 0.0)
    P = np.where(live, np.exp(np.minimum(x, 0.0)), 0.0)
    rel = np.where(live, tt.C_EXP + tt.C_ARG * np.abs(x) + tt.C_SERIAL * scale * tt.serial_sum_spread(q, k), 0.0)
    w = np.where(dr.keep_mask(B, H, nq, nk, p=p, seed=seed), 1.0 / (1.0 - p), 0.0)
    t = lambda a: np.swapaxes(a, -1, -2)
    dpw = (do @ t(v)) * w
    big_d = np.sum(do * o, axis=-1, keepdims=True)
    abs_d = tt.C_DOT * np.sum(np.abs(do * o), axis=-1, keepdims=True)
    ds = P * (dpw - big_d)
    err_ds = P * (rel * np.abs(dpw - big_d) + tt.C_DOT * w * (np.abs(do) @ t(np.abs(v))))
    f_dv = U * (np.sqrt(t(P * w * rel) ** 2 @ (do * do)) + t(P * w) @ np.abs(do))
    f_dq = U * scale * (np.sqrt(err_ds ** 2 @ (k * k)) + abs_d * np.abs(P @ k) + np.abs(ds) @ np.abs(k))
    f_dk = U * scale * (np.sqrt(t(err_ds) ** 2 @ (q * q) + t(P * abs_d) ** 2 @ (q * q)) + t(np.abs(ds)) @ np.abs(q))
    why = "dropout gradient floor: P's, dP's and D's errors through dS, W's in dV"
    return tuple(Floor(f, f"{n} {why}") for n, f in (("dQ", f_dq), ("dK", f_dk), ("dV", f_dv)))


# --------------------------------------------------------------------------- the kernels against the oracle

def check_forward(case, p, seed, tiles=None):
    kw = dict(p=p, seed=seed, causal=case.causal, scale=case.scale)
    o, lse = dr.dropout_attention(case.q, case.k, case.v, tiles=tiles, **kw)
    exact = dr.dropout_attention_oracle(case.q, case.k, case.v, **kw)
    base = dr.dropout_attention_oracle(case.q, case.k, case.v, dtype=np.float32, **kw)
    f_o, f_l = forward_floors(case.q, case.k, case.v, **kw)
    assert o.dtype == np.float32 and lse.dtype == np.float32
    assert_close(o, exact[0], base[0], name="O", floor=f_o)
    assert_close(lse, exact[1], base[1], name="L", floor=f_l)
    return o, lse


def backward_inputs(case, p, seed, grad_seed=1):
    """The forward's (o, lse) from the oracle in float32, and a random upstream gradient."""
    o, lse = dr.dropout_attention_oracle(case.q, case.k, case.v, p=p, seed=seed, causal=case.causal, scale=case.scale)
    return o.astype(np.float32), lse.astype(np.float32), random_array(np.random.default_rng(grad_seed), o.shape)


def check_backward(case, p, seed, got, o, lse, do):
    kw = dict(p=p, seed=seed, causal=case.causal, scale=case.scale)
    with np.errstate(invalid="ignore", over="ignore"):
        exact = dr.dropout_attention_backward_oracle(case.q, case.k, case.v, o, lse, do, **kw)
        base = dr.dropout_attention_backward_oracle(case.q, case.k, case.v, o, lse, do, dtype=np.float32, **kw)
        floors = gradient_floors(case.q, case.k, case.v, o, lse, do, **kw)
    for name, g, e, b, f in zip(("dQ", "dK", "dV"), got, exact, base, floors):
        assert g.dtype == np.float32
        assert_close(g, e, b, name=name, floor=f)


@settings(max_examples=5 if SIM else gpu_examples(200))
@given(case=attention_cases(max_n=MAX_N, max_d=MAX_D, dtypes=(np.float32, np.float16)), p=st.sampled_from(P_CHOICES),
       seed=st.integers(0, 2**64 - 1), tiles=st.sampled_from(TILES))
@example(case=case_with((1, 2, 9, 5), (1, 2, 13, 5), causal=True), p=0.5, seed=1, tiles=None)      # Nq < Nk, ragged
@example(case=case_with((2, 1, 11, 3), (2, 1, 6, 3), causal=True), p=0.1, seed=2**64 - 1,
         tiles=TILES[1])                                                                       # rows see nothing
@example(case=case_with((1, 1, 10, 8), (1, 1, 13, 8), causal=True, dtype=np.float16), p=0.3, seed=5,
         tiles=None)                                                                           # fp16 inputs
def test_forward_matches_oracle(case, p, seed, tiles):
    check_forward(case, p, seed, tiles)


@settings(max_examples=5 if SIM else gpu_examples(200))
@given(case=attention_cases(max_n=MAX_N, max_d=MAX_D), p=st.sampled_from(P_CHOICES), seed=st.integers(0, 2**64 - 1),
       tiles=st.sampled_from(TILES))
@example(case=case_with((1, 2, 9, 5), (1, 2, 13, 5), causal=True), p=0.5, seed=1, tiles=None)
@example(case=case_with((2, 1, 11, 3), (2, 1, 6, 3), causal=True), p=0.1, seed=2**64 - 1, tiles=TILES[1])
def test_backward_matches_oracle(case, p, seed, tiles):
    o, lse, do = backward_inputs(case, p, seed)
    got = dr.dropout_attention_backward(case.q, case.k, case.v, o, lse, do, p=p, seed=seed,
                                        causal=case.causal, scale=case.scale, tiles=tiles)
    check_backward(case, p, seed, got, o, lse, do)


CASE = case_with((1, 2, 12, 6), (1, 2, 10, 6), causal=True, logit_std=1.0)


def test_kernel_forward_into_kernel_backward():
    """Training's path: the kernel's own o and lse into the kernel's backward, one seed; the
    same seed twice gives the same bits, another seed another O."""
    o, lse = check_forward(CASE, 0.3, 99)
    o2, _ = dr.dropout_attention(CASE.q, CASE.k, CASE.v, p=0.3, seed=99, causal=True)
    np.testing.assert_array_equal(o, o2)
    o3, _ = dr.dropout_attention(CASE.q, CASE.k, CASE.v, p=0.3, seed=100, causal=True)
    assert not np.allclose(o, o3)
    do = random_array(np.random.default_rng(5), o.shape)
    got = dr.dropout_attention_backward(CASE.q, CASE.k, CASE.v, o, lse, do, p=0.3, seed=99, causal=True)
    check_backward(CASE, 0.3, 99, got, o, lse, do)


def test_backward_with_another_seed_is_caught():
    """The backward must regenerate the forward's Z: one seed off, the check fails."""
    o, lse, do = backward_inputs(CASE, 0.3, 99)
    got = dr.dropout_attention_backward(CASE.q, CASE.k, CASE.v, o, lse, do, p=0.3, seed=98, causal=True)
    with pytest.raises(AssertionError):
        check_backward(CASE, 0.3, 99, got, o, lse, do)


def test_forgotten_rescale_in_the_backward_is_caught(monkeypatch):
    """A planted bug: the backward's kernels get 1 in place of 1 / (1 - p)."""
    real = dr._dropout_args
    monkeypatch.setattr(dr, "_dropout_args", lambda p, seed: (*real(p, seed)[:3], np.float32(1.0)))
    o, lse, do = backward_inputs(CASE, 0.1, 7)
    got = dr.dropout_attention_backward(CASE.q, CASE.k, CASE.v, o, lse, do, p=0.1, seed=7, causal=True)
    with pytest.raises(AssertionError):
        check_backward(CASE, 0.1, 7, got, o, lse, do)


def test_dropout_before_normalisation_is_caught():
    """A planted bug: O normalised over the kept elements only (l summing Z e, not e) fails
    the forward's check, at p = 0.1 as at 0.5."""
    case = case_with((1, 1, 8, 4), (1, 1, 9, 4), logit_std=1.0)
    s, _, _ = dr._scores(np.asarray(case.q, np.float64), np.asarray(case.k, np.float64), None, False, np.float64)
    for p in (0.1, 0.5):
        kw = dict(p=p, seed=4, causal=False, scale=None)
        z = dr.keep_mask(1, 1, 8, 9, p=p, seed=4)
        wrong = (ref.softmax(np.where(z, s, -np.inf)) @ np.asarray(case.v, np.float64)).astype(np.float32)
        exact = dr.dropout_attention_oracle(case.q, case.k, case.v, **kw)[0]
        base = dr.dropout_attention_oracle(case.q, case.k, case.v, dtype=np.float32, **kw)[0]
        with pytest.raises(AssertionError):
            assert_close(wrong, exact, base, name="O", floor=forward_floors(case.q, case.k, case.v, **kw)[0])
