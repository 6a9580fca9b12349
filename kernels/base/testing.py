"""What the tests (and the notebooks' exercise checkers) share: the tolerance rule,
the Hypothesis strategies for attention inputs, and the checker that reports the smallest
failing case of a learner's function.

The tolerance rule, as FlashAttention's own tests state it: a kernel's error against the
float64 oracle must be at most twice the error that a plain float32 NumPy computation of
the same thing makes, plus a small floor (for the cases where float32 NumPy happens to be
exact). A fixed ``atol=1e-2`` would hide real bugs.

Strategies: shapes, magnitudes and seeds are drawn by Hypothesis (so failures shrink to
the smallest shape); the array values come from a NumPy generator seeded by the drawn
seed, which is far faster than drawing every element and still never zeros.
"""

from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st

from kernels.base.runtime import on_simulator

FLOAT32_EPS = float(np.finfo(np.float32).eps)

def assert_close(got, exact, baseline, *, name="output", factor=2.0, floor_ulps=8.0, floor_scale=None):
    """Check ``got`` against ``exact`` (float64 oracle) with the float32 ``baseline``'s error as yardstick.

    Non-finite entries (e.g. L = -inf on fully masked rows) must match exactly.

    The floor is ``floor_ulps`` float32 ulps of ``floor_scale``: by default the largest exact
    value (at least 1). Where an output is a difference of much larger terms (dS = P (dP - D)
    when P is nearly one-hot, say) rounding error scales with those terms, not with the small
    result, and the float32 baseline can be exact by luck on tiny shapes; pass the magnitude
    of the terms that cancel as ``floor_scale`` there, and say why at the call.
    """
    got = np.asarray(got, dtype=np.float64)
    exact = np.asarray(exact, dtype=np.float64)
    baseline = np.asarray(baseline, dtype=np.float64)
    assert got.shape == exact.shape, f"{name}: shape {got.shape}, expected {exact.shape}"
    assert not np.isnan(got).any(), f"{name}: {int(np.isnan(got).sum())} NaN entries"
    finite = np.isfinite(exact)
    mismatch = ~finite & (got != exact)
    assert not mismatch.any(), (
        f"{name}: non-finite entries differ at {np.argwhere(mismatch)[:5].tolist()}: "
        f"got {got[mismatch][:5]}, expected {exact[mismatch][:5]}"
    )
    assert np.isfinite(got[finite]).all(), f"{name}: non-finite values where the oracle is finite"
    if not finite.any():
        return
    err = np.max(np.abs(got[finite] - exact[finite]))
    err_f32 = np.max(np.abs(baseline[finite] - exact[finite]))
    scale = max(1.0, float(np.max(np.abs(exact[finite])))) if floor_scale is None else float(floor_scale)
    bound = factor * err_f32 + floor_ulps * FLOAT32_EPS * scale
    with np.errstate(invalid="ignore"):
        worst = np.unravel_index(np.argmax(np.where(finite, np.abs(got - exact), -1)), got.shape)
    assert err <= bound, (
        f"{name}: max error {err:.3e} > bound {bound:.3e} (float32 NumPy error {err_f32:.3e}); "
        f"worst at {tuple(int(i) for i in worst)}: got {got[worst]!r}, expected {exact[worst]!r}"
    )



# --------------------------------------------------------------------------- floors for attention

def exponent_scale(q, k, scale=None) -> float:
    """1 + max|scale * Q K^T|: how large the exponents of softmax get.

    Any float32 computation of S = scale Q K^T carries an absolute error of a few ulps of
    |S|, and a fast exp2 adds the rounding of its argument; both become a relative error of
    P = exp(S - m) of that size. NumPy's float32 baseline makes the same kind of error but
    can be luckier per element, so the attention tests put their floor at a few ulps of this
    scale (times the size of what P weights), not of 1.
    """
    q = np.asarray(q, np.float64)
    k = np.asarray(k, np.float64)
    if q.shape[-2] == 0 or k.shape[-2] == 0 or q.shape[-1] == 0:
        return 1.0
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    return 1.0 + float(np.max(np.abs(scale * (q @ np.swapaxes(k, -1, -2)))))


def forward_floor_scales(q, k, v, scale=None):
    """Floor scales for (O, L) of attention: O = P V errs by (relative error of P) x max|V|;
    L = m + log l errs by the exponent error itself."""
    e = exponent_scale(q, k, scale)
    vmax = float(np.max(np.abs(v))) if np.size(v) else 0.0
    return e * max(1.0, vmax), e


def gradient_floor_scales(q, k, v, o, lse, do, *, causal=False, scale=None, block_mask=None):
    """Floor scales for (dQ, dK, dV) of attention.

    dS = P (dP - D) with D = rowsum(dO O) = sum_j P_j dP_j: where a row's softmax is nearly
    one-hot (large logits), dP - D is a small difference of float32 sums of size |dP| + |D|,
    and any float32 computation of it keeps an absolute error of a few ulps of those terms,
    not of the small result (the float32 baseline can be exact by luck on tiny shapes), and
    a float32 dot product errs by ulps of the sum of its absolute products; P itself is only
    accurate to ulps of the exponent scale e (see ``exponent_scale``). To first order dS errs
    by P (e |dP - D| + |dO| |V|^T + rowsum|dO O|) ulps, and dQ = scale dS K, dK = scale dS^T Q
    carry that summed over a row (column) against |K| (resp. |Q|). dV = P^T dO errs by
    e P^T |dO| ulps.
    """
    from kernels import reference as ref

    q, k, v, o, lse, do = (np.asarray(x, np.float64) for x in (q, k, v, o, lse, do))
    d = q.shape[-1]
    scale = 1.0 / np.sqrt(max(d, 1)) if scale is None else scale
    if q.shape[-2] == 0 or k.shape[-2] == 0:
        return 1.0, 1.0, 1.0
    e = exponent_scale(q, k, scale)
    allowed = ref.attention_mask(q.shape[-2], k.shape[-2], causal=causal, block_mask=block_mask)
    allowed = np.ones((1, 1), bool) if allowed is None else allowed
    s = scale * (q @ np.swapaxes(k, -1, -2))
    live = np.isfinite(lse)[..., None]
    p = np.where(allowed & live, np.exp(np.minimum(s - np.where(live, lse[..., None], 0.0), 0.0)), 0.0)
    # First-order error of dS = P (dP - D): dP (P's relative error, e ulps) (dP - D), plus
    # P d(dP - D), where a float32 dot product errs by ulps of the sum of its absolute
    # products (not of |the result|): dP = dO V^T and D = rowsum(dO O) are such sums.
    dp = do @ np.swapaxes(v, -1, -2)
    big_d = np.sum(do * o, axis=-1, keepdims=True)
    sums = np.abs(do) @ np.swapaxes(np.abs(v), -1, -2) + np.sum(np.abs(do * o), axis=-1, keepdims=True)
    terms = p * (e * np.abs(dp - big_d) + sums)
    dq_scale = scale * float(np.max(terms @ np.abs(k), initial=0.0))
    dk_scale = scale * float(np.max(np.swapaxes(terms, -1, -2) @ np.abs(q), initial=0.0))
    dv_scale = e * float(np.max(np.swapaxes(p, -1, -2) @ np.abs(do), initial=0.0))
    return max(1.0, dq_scale), max(1.0, dk_scale), max(1.0, dv_scale)

# The simulator runs every thread in Python: keep sizes small there.
MAX_N = 64 if on_simulator() else 512
MAX_D = 32 if on_simulator() else 128
MAX_BH = 2 if on_simulator() else 4


def random_array(rng, shape, magnitude=1.0, dtype=np.float32):
    """Normal(0, magnitude) values; never all zeros."""
    return (rng.standard_normal(shape) * magnitude).astype(dtype)


@dataclass
class AttentionCase:
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    causal: bool
    scale: float | None

    def __repr__(self):
        return (
            f"AttentionCase(q={self.q.shape}, k={self.k.shape}, dtype={self.q.dtype}, "
            f"causal={self.causal}, scale={self.scale}, |q|max={np.abs(self.q).max() if self.q.size else 0:.3g})"
        )


@st.composite
def attention_cases(draw, *, max_n=MAX_N, max_d=MAX_D, head_dims=None, dtypes=(np.float32,),
                    allow_causal=True, allow_empty=True, magnitudes=(0.1, 1.0, 3.0, 30.0)):
    """q (B, H, Nq, d), k and v (B, H, Nk, d), causal, scale: Nq != Nk, ragged N, odd d,
    and logits from small to very large."""
    b = draw(st.integers(1, MAX_BH))
    h = draw(st.integers(1, MAX_BH))
    lo = 0 if allow_empty else 1
    nq = draw(st.integers(lo, max_n))
    nk = draw(st.integers(lo, max_n))
    d = draw(st.sampled_from(head_dims) if head_dims else st.integers(1, max_d))
    dtype = draw(st.sampled_from(dtypes))
    causal = draw(st.booleans()) if allow_causal else False
    scale = draw(st.one_of(st.none(), st.floats(0.01, 2.0)))
    magnitude = draw(st.sampled_from(magnitudes))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    q = random_array(rng, (b, h, nq, d), magnitude, dtype)
    k = random_array(rng, (b, h, nk, d), magnitude, dtype)
    v = random_array(rng, (b, h, nk, d), 1.0, dtype)
    return AttentionCase(q, k, v, causal, scale)


def case_with(q_shape, k_shape, *, causal=False, scale=None, magnitude=1.0, seed=0, dtype=np.float32):
    """A fixed case for ``@example``: the awkward shapes every chapter pins."""
    rng = np.random.default_rng(seed)
    q = random_array(rng, q_shape, magnitude, dtype)
    k = random_array(rng, k_shape, magnitude, dtype)
    v = random_array(rng, k_shape, 1.0, dtype)
    return AttentionCase(q, k, v, causal, scale)


# --------------------------------------------------------------------------- exercise checker

def check_exercise(prop, strategy, *, max_examples=None):
    """Run ``prop(case)`` (which raises AssertionError on a wrong answer) on cases drawn from
    ``strategy``; print "passed" or the smallest failing case Hypothesis can shrink to.

    Returns True when every case passed. Used by the notebooks' exercise cells.
    """
    from hypothesis import HealthCheck, find, settings
    from hypothesis.errors import NoSuchExample

    def fails(case):
        try:
            prop(case)
        except Exception as exc:  # a wrong answer, or code that does not run yet
            fails.last_error = exc
            return True
        return False

    n = max_examples or (10 if on_simulator() else 100)
    try:
        smallest = find(strategy, fails, settings=settings(
            max_examples=n, deadline=None, database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]))
    except NoSuchExample:
        print(f"passed: {n} drawn cases agree with the oracle")
        return True
    fails(smallest)
    print(f"not yet: smallest failing case {smallest!r}")
    print(f"  {type(fails.last_error).__name__}: {str(fails.last_error)[:500]}")
    return False
