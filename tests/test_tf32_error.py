"""Chapter 11's NumPy model of TF32 products (kernels/tf32_error.py), against float64.

tf32 rounding against an independent float64 construction (frexp); the split's bound
|x - hi - lo| <= 2^-23 |x| derived in the module and shown tight (an input attains it);
the 3xTF32 product within its derived bound and 1xTF32 (and 2x) far above that bound on
ordinary inputs, so the bound bites; attention through 3xTF32 meets the course's
tolerance rule and through 1xTF32 misses it; the exercise checker passes two right answers
and catches six planted mistakes.
"""

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from kernels import tf32_error as te
from kernels.base.testing import attention_cases, case_with


def tf32_by_frexp(x):
    """Nearest tf32 (11 significant bits, float32's exponent range, ties away from zero),
    built from x's exponent in float64: spacing 2^(e - 11) for x = m 2^e, m in [0.5, 1),
    never finer than the subnormal spacing 2^-136."""
    x = np.asarray(x, np.float64)
    _, e = np.frexp(x)
    spacing = np.exp2(np.maximum(e, -125) - 11.0)
    y = x / spacing
    return np.sign(y) * np.floor(np.abs(y) + 0.5) * spacing


def bit_patterns(seed, n=2000):
    """n finite float32 values from random bit patterns (every exponent, subnormals too),
    half of them with their low 13 bits at the edges (ties, one either side)."""
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    edge = rng.random(n) < 0.5
    bits = np.where(edge, (bits & ~np.uint32(0x1FFF)) | rng.choice(te.EDGE_LOW_BITS, n), bits).astype(np.uint32)
    x = bits.view(np.float32)
    return x[np.isfinite(x)]


# --------------------------------------------------------------------------- rounding

@given(st.integers(0, 2**32 - 1))
def test_to_tf32_is_the_nearest_tf32_ties_away(seed):
    x = bit_patterns(seed)
    hi = te.to_tf32(x)
    assert hi.dtype == np.float32 and hi.shape == x.shape
    assert not np.any(hi.view(np.uint32) & 0x1FFF), "low 13 bits must be zero"
    finite = np.isfinite(hi)                       # beyond (2 - 2^-11) 2^127 it rounds to inf
    np.testing.assert_array_equal(hi[finite].astype(np.float64), tf32_by_frexp(x[finite]))
    assert np.all(np.abs(x[~finite]) >= np.float32((2 - 2.0 ** -11) * 2.0 ** 127))


def test_to_tf32_edges():
    one = np.float32(1.0)
    ulp = np.float32(2.0 ** -23)
    tie, below, above = one + 4096 * ulp, one + 4095 * ulp, one + 4097 * ulp
    got = te.to_tf32(np.array([tie, below, above, -tie, 0.0, -0.0, np.inf, -np.inf, np.nan,
                               np.finfo(np.float32).max], np.float32))
    expect = [1 + 2.0 ** -10, 1.0, 1 + 2.0 ** -10, -(1 + 2.0 ** -10), 0.0, -0.0, np.inf, -np.inf]
    np.testing.assert_array_equal(got[:8], np.array(expect, np.float32))
    assert np.signbit(got[5]) and np.isnan(got[8]) and got[9] == np.inf
    assert te.to_tf32(np.float32(1.5)).shape == ()


# --------------------------------------------------------------------------- the split

# 1 + 2049 ulps: x - hi = 2049 ulps has 12 significant bits, odd: a tie for lo, which misses
# by one ulp = 2^-23 (x just above 1): the bound is attained.
TIGHT = np.array([1 + 2049 * 2.0 ** -23], np.float32)


@given(te.split_cases())
@example(te.SplitCase(TIGHT))
def test_split_represents_x_to_2_to_minus_23(case):
    x = case.x
    hi, lo = te.split_tf32(x)
    assert hi.dtype == lo.dtype == np.float32
    assert not np.any((hi.view(np.uint32) | lo.view(np.uint32)) & 0x1FFF)
    x64 = x.astype(np.float64)
    assert np.all(np.abs(x64 - hi - lo) <= 2.0 ** -23 * np.abs(x64))
    assert np.all(np.abs(x64 - hi) <= 2.0 ** -11 * np.abs(x64))          # |lo| and 1xTF32's loss
    assert np.all(np.abs(lo.astype(np.float64)) <= 2.0 ** -11 * np.abs(x64))


@given(te.split_cases())
@example(te.SplitCase(TIGHT))
def test_a_truncated_lo_misses_x_by_what_a_rounded_one_does(case):
    """x - x_hi has at most 12 significant bits (13 only at 2^12 ulps, a power of two), so
    tf32 drops at most its last bit, and one dropped bit is 0 or a tie: rounding lo and
    truncating it (what the mma does to a register left as x - x_hi) leave the same |x - hi -
    lo|, element by element. TIGHT is such a tie: both miss by one ulp."""
    x64 = case.x.astype(np.float64)
    hi, rounded = te.split_tf32(case.x)
    hi_t, truncated = te.split_tf32(case.x, lo="truncated")
    np.testing.assert_array_equal(hi, hi_t)
    assert not np.any(truncated.view(np.uint32) & 0x1FFF)
    np.testing.assert_array_equal(np.abs(x64 - hi - truncated), np.abs(x64 - hi - rounded))


def test_truncating_lo_differs_from_rounding_it():
    """(So that the test above compares two different splits.) At TIGHT the rounded lo goes
    up to the even neighbour, the truncated one down."""
    _, rounded = te.split_tf32(TIGHT)
    _, truncated = te.split_tf32(TIGHT, lo="truncated")
    assert rounded[0] != truncated[0]
    with pytest.raises(ValueError, match=r"^lo: expected one of"):
        te.split_tf32(TIGHT, lo="even")


def test_split_bound_is_attained():
    hi, lo = te.split_tf32(TIGHT)
    err = abs(float(TIGHT[0]) - float(hi[0]) - float(lo[0]))
    assert err == 2.0 ** -23 and err > 2.0 ** -23 * 0.99 * abs(float(TIGHT[0]))


# --------------------------------------------------------------------------- products

@st.composite
def matrices(draw, max_mn=6, max_k=130):
    m, n, k = draw(st.integers(1, max_mn)), draw(st.integers(1, max_mn)), draw(st.integers(1, max_k))
    scale = draw(st.sampled_from([1.0, 1e-20, 1e20]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    a = (rng.standard_normal((m, k)) * scale).astype(np.float32)
    b = (rng.standard_normal((k, n)) / scale).astype(np.float32)
    if draw(st.booleans()):                        # positive terms: no cancellation in the sum
        a, b = np.abs(a), np.abs(b)
    return a, b


@given(matrices())
@example((np.ones((1, 1), np.float32), np.ones((1, 1), np.float32)))
@example((np.full((2, 128), 1 + 2049 * 2.0 ** -23, np.float32), np.full((128, 2), 1 + 2049 * 2.0 ** -23, np.float32)))
def test_products_within_their_derived_bounds(ab):
    a, b = ab
    exact = a.astype(np.float64) @ b.astype(np.float64)
    for passes, acc in [(p, "rn") for p in te.PASSES] + [(3, "rz")]:
        got = te.product(a, b, passes, accumulate=acc)
        assert got.dtype == np.float32 and got.shape == exact.shape
        bound = te.product_bound(a, b, passes, accumulate=acc)
        err = np.abs(got - exact)
        i = np.unravel_index(np.argmax(err - bound), err.shape)
        assert np.all(err <= bound), f"passes={passes} {acc}: error {err[i]:.3g} > bound {bound[i]:.3g} at {i}"


def test_rounding_toward_zero_is_one_sided():
    """Toward zero, the accumulator of a sum of positive terms only ever falls short."""
    rng = np.random.default_rng(1)
    a, b = np.abs(rng.standard_normal((8, 64))).astype(np.float32), np.abs(rng.standard_normal((64, 8))).astype(np.float32)
    a, b = te.to_tf32(a), te.to_tf32(b)                       # exact products: only the sums round
    exact = a.astype(np.float64) @ b.astype(np.float64)
    rz, rn = te.product(a, b, 1, accumulate="rz"), te.product(a, b, 1)
    assert np.all(rz <= exact) and np.any(rz < exact) and np.any(rn > exact)
    with pytest.raises(ValueError, match="accumulate: expected"):
        te.product(a, b, 1, accumulate="rd")


@given(st.integers(1, 128), st.integers(0, 2**32 - 1))
@example(1, 0)
@example(128, 0)
def test_one_and_two_tf32_passes_break_the_3x_bound(k, seed):
    """On ordinary inputs (normal, 8 x 8 outputs) 1xTF32 and 2xTF32 miss 3xTF32's bound by
    a wide margin (the bound bites); 3xTF32 stays within it, and near fp32's error."""
    rng = np.random.default_rng(seed)
    a, b = rng.standard_normal((8, k)).astype(np.float32), rng.standard_normal((k, 8)).astype(np.float32)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    bound = te.product_bound(a, b, 3)
    ratio = {p: float(np.max(np.abs(te.product(a, b, p) - exact) / bound)) for p in te.PASSES}
    assert ratio[3] <= 1.0
    assert ratio[1] > 4.0 and ratio[2] > 4.0, ratio


def test_product_model_matches_the_mma_emulation_on_one_step():
    """One k-step of 8, one pass: hi @ hi rounded once (the simulator's mma emulation)."""
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((16, 8)).astype(np.float32), rng.standard_normal((8, 8)).astype(np.float32)
    ah, bh = te.to_tf32(a).astype(np.float64), te.to_tf32(b).astype(np.float64)
    np.testing.assert_array_equal(te.product(a, b, 1), (ah @ bh).astype(np.float32))


def test_error_terms_sizes():
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal(5000).astype(np.float32), rng.standard_normal(5000).astype(np.float32)
    t = te.error_terms(a, b)
    assert np.all(np.abs(t["a_hi b_hi"] - 1) <= 2.0 ** -10 + 2.0 ** -22)
    for name in ("a_hi b_lo", "a_lo b_hi"):
        assert t[name].max() <= 2.0 ** -11 * (1 + 2.0 ** -11)
    assert t["a_lo b_lo"].max() <= 2.0 ** -22
    assert t["split residual"].max() <= 2.0 ** -22 + 2.0 ** -46          # da b + (a - da) db


# --------------------------------------------------------------------------- attention

@given(attention_cases(max_n=24, max_d=24, allow_empty=False))
@example(case_with((1, 1, 1, 4), (1, 1, 1, 4)))                              # one key: O = V
@example(case_with((1, 1, 20, 64), (1, 1, 24, 64), logit_std=3.0))
@example(case_with((1, 1, 12, 16), (1, 1, 12, 16), magnitude=30.0, causal=True))
def test_attention_3x_meets_the_rule_1x_misses_it(case):
    kw = dict(causal=case.causal, scale=case.scale)
    o3, l3 = te.attention_check(case.q, case.k, case.v, 3, **kw)
    assert o3.passed and l3.passed, f"{o3}\n{l3}"
    o1, l1 = te.attention_check(case.q, case.k, case.v, 1, **kw)
    assert not o1.passed and o1.ratio > 4.0, f"1xTF32 passed the rule: {o1}"


# --------------------------------------------------------------------------- the exercise

def split_by_frexp(x):
    """A right answer written differently: the nearest-tf32 construction of this file."""
    hi = tf32_by_frexp(x).astype(np.float32)
    lo = tf32_by_frexp((x - hi).astype(np.float64)).astype(np.float32)
    return hi, lo


def truncate(x):
    return (np.asarray(x, np.float32).view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)


def ties_to_even(x):
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0xFFF + ((bits >> 13) & 1)) & 0xFFFFE000).astype(np.uint32).view(np.float32)


MISTAKES = {
    "lo not re-rounded": lambda x: (te.to_tf32(x), x - te.to_tf32(x)),
    "hi truncated": lambda x: (truncate(x), te.to_tf32(x - truncate(x))),
    "ties to even": lambda x: (ties_to_even(x), te.to_tf32(x - ties_to_even(x))),
    "lo with the wrong sign": lambda x: (te.to_tf32(x), te.to_tf32(te.to_tf32(x) - x)),
    "no lo": lambda x: (te.to_tf32(x), np.zeros_like(x)),
    "fp16 in place of tf32": lambda x: (x.astype(np.float16).astype(np.float32),
                                        te.to_tf32(x - x.astype(np.float16).astype(np.float32))),
}


def test_exercise_checker_passes_right_answers(capsys):
    assert te.check_split_tf32(te.split_tf32, max_examples=100)
    assert te.check_split_tf32(split_by_frexp, max_examples=100)


@pytest.mark.parametrize("name", sorted(MISTAKES))
def test_exercise_checker_catches_mistakes(name, capsys):
    with np.errstate(all="ignore"):
        assert not te.check_split_tf32(MISTAKES[name], max_examples=100)
    assert "not yet" in capsys.readouterr().out


# --------------------------------------------------------------------------- bad input

def test_bad_input_names_the_argument():
    f32 = np.ones((2, 3), np.float32)
    with pytest.raises(TypeError, match="x: expected float32"):
        te.to_tf32(np.ones(3))
    with pytest.raises(TypeError, match="x: expected float32"):
        te.split_tf32([1.0, 2.0])
    with pytest.raises(TypeError, match="b: expected float32"):
        te.product(f32, np.ones((3, 2)))
    with pytest.raises(ValueError, match="b: expected 3 rows"):
        te.product(f32, f32)
    with pytest.raises(ValueError, match="a: expected a matrix"):
        te.product(np.ones(3, np.float32), f32)
    for bad in (0, 4, True, "tf32"):
        with pytest.raises(ValueError, match="passes: expected"):
            te.product(f32, f32.T.copy(), bad)
    with pytest.raises(ValueError, match="b: expected the shape of a"):
        te.error_terms(f32, f32.T.copy())
    q = np.ones((1, 1, 4, 8), np.float32)
    with pytest.raises(ValueError, match="q: expected shape"):
        te.attention_tf32(q[0], q, q)
    with pytest.raises(ValueError, match="k: expected shape"):
        te.attention_tf32(q, q[..., :4], q)
    with pytest.raises(ValueError, match="v: expected the shape of k"):
        te.attention_tf32(q, q, q[:, :, :3])
