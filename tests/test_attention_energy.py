"""Chapter 9's energy view (NumPy float64) and the napkin model of a decode step.

The derivatives are checked against central differences with a tolerance derived from the
step h (truncation h^2/6 |F'''| plus rounding eps |F| / h); planted bugs (a gradient without
the scale, a Hessian without its O O^T term, a merge that forms exp(F)) must fail it.
"""

import math

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from kernels import attention_energy as ae
from kernels import reference as ref
from kernels.online_softmax import merge as merge_state_numpy

H = 1e-5


def case(n, d, dv, *, scale=None, big=10.0, seed=0, cut=0, level=0.0):
    """A fixed EnergyCase (for @example): the largest logit |s q.k| = big."""
    rng = np.random.default_rng(seed)
    q, k, v = rng.standard_normal(d), rng.standard_normal((n, d)), rng.standard_normal((n, dv))
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if n:
        q = q * (big / np.abs(scale * (k @ q)).max())
    return ae.EnergyCase(q, k, v, scale, cut, level, seed)


PINNED = [case(0, 3, 2), case(1, 1, 1), case(40, 16, 16, big=80.0), case(7, 5, 3, scale=2.5, big=80.0),
          case(2, 1, 1, scale=0.3), case(12, 6, 4, big=2.0, scale=0.3), case(20, 8, 8, big=5.0, seed=3)]


def with_pins(test):
    for c in PINNED:
        test = example(c)(test)
    return test


# --------------------------------------------------------------------------- the energy is attention

@with_pins
@given(ae.energy_cases())
def test_energy_at_zero_is_attention(c):
    """F(0) is the oracle's logsumexp L and dF/dzeta(0) its output O."""
    o, lse = ref.attention(c.q[None, None, None], c.k[None, None], c.v[None, None], scale=c.scale)
    got_o, got_l = ae.attention_from_energy(c.q, c.k, c.v, c.scale)
    assert got_l == pytest.approx(float(lse[0, 0, 0]), rel=1e-13, abs=0) or got_l == lse[0, 0, 0] == -np.inf
    np.testing.assert_allclose(got_o, o[0, 0, 0], rtol=1e-12, atol=1e-13)


@with_pins
@given(ae.energy_cases())
def test_grad_zeta_is_central_difference(c):
    ae.check_grad_zeta_case(lambda q, k, v, s: ae.energy_grad_zeta(q, k, v, None, s), c, H)


def check_grad_q_case(fn, c, h=H):
    """fn(q, k, v, scale) against the central difference of F in q."""
    want = ae.central_difference(lambda x: ae.energy(x, c.k, c.v, None, c.scale), c.q, h)
    got = fn(c.q, c.k, c.v, c.scale)
    tol = ae.grad_q_tolerance(c.q, c.k, c.v, np.zeros(c.v.shape[1]), c.scale, h)
    assert np.abs(got - want).max() <= tol, f"dF/dq off by {np.abs(got - want).max():.3g} (tolerance {tol:.3g})"


@with_pins
@given(ae.energy_cases())
def test_grad_q_is_central_difference(c):
    check_grad_q_case(lambda q, k, v, s: ae.energy_grad_q(q, k, v, None, s), c)


@with_pins
@given(ae.energy_cases(max_d=8))
def test_hessian_is_central_difference_and_a_covariance(c):
    ae.check_hessian_zeta_case(lambda q, k, v, s: ae.energy_hessian_zeta(q, k, v, None, s), c, H)
    hess = ae.energy_hessian_zeta(c.q, c.k, c.v, None, c.scale)
    np.testing.assert_allclose(hess, hess.T, atol=1e-14)
    assert np.linalg.eigvalsh(hess).min() >= -1e-12 * (1 + np.abs(hess).max())   # a covariance: PSD


@given(ae.energy_cases(max_n=12, max_d=4), st.integers(0, 2**32 - 1))
def test_derivatives_away_from_zero(c, seed):
    """The identities hold at any zeta, not only at 0."""
    zeta = np.random.default_rng(seed).standard_normal(c.v.shape[1])
    g = ae.central_difference(lambda z: ae.energy(c.q, c.k, c.v, z, c.scale), zeta, H)
    tol = ae.grad_zeta_tolerance(c.q, c.k, c.v, zeta, c.scale, H)
    assert np.abs(g - ae.energy_grad_zeta(c.q, c.k, c.v, zeta, c.scale)).max() <= tol


# --------------------------------------------------------------------------- the tolerance bites

def grad_q_no_scale(q, k, v, s):
    return ae.energy_grad_q(q, k, v, None, s) / s


def hessian_no_outer(q, k, v, s):
    p = ae.energy_weights(q, k, v, None, s)
    return (v * p[:, None]).T @ v


def grad_zeta_no_scale(q, k, v, s):
    return ae.energy_grad_zeta(q, k, v, None, 1.0)


RIGHT = {"grad_q": lambda q, k, v, s: ae.energy_grad_q(q, k, v, None, s),
         "hessian": lambda q, k, v, s: ae.energy_hessian_zeta(q, k, v, None, s),
         "grad_zeta": lambda q, k, v, s: ae.energy_grad_zeta(q, k, v, None, s)}


@pytest.mark.parametrize("prop, bug, right", [
    (check_grad_q_case, grad_q_no_scale, "grad_q"),
    (ae.check_hessian_zeta_case, hessian_no_outer, "hessian"),
    (ae.check_grad_zeta_case, grad_zeta_no_scale, "grad_zeta"),
], ids=["grad_q without the scale", "Hessian without O O^T", "grad_zeta without the scale"])
def test_planted_bugs_fail_the_tolerance(prop, bug, right):
    """On each pinned case where the bug changes the answer by more than 1e-6, the check fails
    (and the right answer passes)."""
    caught = 0
    for c in PINNED:
        args = (c.q, c.k, c.v, c.scale)
        prop(RIGHT[right], c)
        if np.abs(bug(*args) - RIGHT[right](*args)).max() <= 1e-6:
            continue                                       # nothing to get wrong here
        with pytest.raises(AssertionError):
            prop(bug, c)
        caught += 1
    assert caught >= 2


def test_exercise_checkers_pass_answers_and_catch_mistakes(capsys):
    assert ae.check_grad_zeta(lambda q, k, v, s: ae.energy_grad_zeta(q, k, v, None, s), max_examples=60)
    assert not ae.check_grad_zeta(grad_zeta_no_scale, max_examples=60)
    assert ae.check_hessian_zeta(lambda q, k, v, s: ae.energy_hessian_zeta(q, k, v, None, s), max_examples=60)
    assert not ae.check_hessian_zeta(hessian_no_outer, max_examples=60)
    assert ae.check_merge(lambda a, b: float(np.logaddexp(a, b)), max_examples=60)
    assert ae.check_merge(lambda a, b: ae.merge_energies([a, b]), max_examples=60)
    assert not ae.check_merge(lambda a, b: math.log(math.exp(a) + math.exp(b)) if a > -np.inf or b > -np.inf
                              else -np.inf, max_examples=60)          # exp(1000) overflows
    assert not ae.check_merge(lambda a, b: max(a, b) + math.log1p(math.exp(-abs(a - b))), max_examples=60)  # -inf - -inf
    out = capsys.readouterr().out
    assert out.count("passed") == 4 and out.count("not yet") == 4


# --------------------------------------------------------------------------- shards merge into the whole

@st.composite
def sharded(draw):
    c = draw(ae.energy_cases())
    n = c.k.shape[0]
    cuts = sorted(draw(st.lists(st.integers(0, n), max_size=6)))     # repeated cuts: empty shards
    mask = draw(st.sampled_from([None, "some", "none seen"]))
    if mask == "some":
        mask = np.random.default_rng(c.seed).random(n) < 0.6
    elif mask == "none seen":
        mask = np.zeros(n, bool)
    return c, cuts, mask


@example((case(0, 2, 2), [0, 0], None))
@example((case(9, 4, 3, big=80.0), [0, 3, 3, 9], np.zeros(9, bool)))
@given(sharded())
def test_shards_merge_into_the_whole(arg):
    c, cuts, mask = arg
    n = c.k.shape[0]
    ranges = ae.cuts_to_ranges(cuts, n)
    f_s, o_s = ae.shard_energy(c.q, c.k, c.v, ranges, None, c.scale, mask=mask)
    f = ae.energy(c.q, c.k, c.v, None, c.scale, mask=mask)
    o = ae.energy_grad_zeta(c.q, c.k, c.v, None, c.scale, mask=mask)
    assert np.all(np.isfinite(o_s)) and not np.any(np.isnan(f_s))
    for order in ("tree", "flat"):
        got = ae.merge_energies(f_s, order=order)
        assert got == f == -np.inf or got == pytest.approx(f, rel=1e-14, abs=1e-14)
    assert ae.merge_energies(f_s) == pytest.approx(float(np.logaddexp.reduce(np.r_[f_s, -np.inf])), rel=1e-14) \
        or f == -np.inf
    got_o, got_f = ae.merge_shards(o_s, f_s)
    np.testing.assert_allclose(got_o, o, rtol=1e-12, atol=1e-14)
    assert got_f == f == -np.inf or got_f == pytest.approx(f, rel=1e-14, abs=1e-14)
    if f == -np.inf:                                   # nothing seen: O = 0, F = -inf, Hessian 0
        assert not o.any()
        assert not ae.energy_hessian_zeta(c.q, c.k, c.v, None, c.scale, mask=mask).any()


def test_chapter_3_merge_is_logaddexp():
    """(m, l) = (F_s, 1) merged by chapter 3's operator gives logaddexp; (-inf, 0) is the identity."""
    m, l = merge_state_numpy((3.0, 1.0), (5.0, 1.0))
    assert m + math.log(l) == pytest.approx(np.logaddexp(3.0, 5.0), rel=1e-15)
    assert ae.merge_energies([]) == -np.inf
    assert ae.merge_energies([-np.inf, 2.0, -np.inf]) == 2.0


def test_large_logits_stay_finite():
    rng = np.random.default_rng(1)
    k, v = rng.standard_normal((30, 8)), rng.standard_normal((30, 4))
    q = rng.standard_normal(8) * 1e4                    # logits around +-1e4: exp would overflow
    f = ae.energy(q, k, v, scale=1.0)
    x = k @ q
    assert f == pytest.approx(x.max() + math.log(np.exp(x - x.max()).sum()), rel=1e-15)
    o = ae.energy_grad_zeta(q, k, v, scale=1.0)
    assert np.all(np.isfinite(o)) and np.all(o <= v.max(0) + 1e-12) and np.all(o >= v.min(0) - 1e-12)


@pytest.mark.parametrize("kwargs, name", [
    (dict(q=np.zeros((1, 4)), k=np.zeros((3, 4)), v=np.zeros((3, 2))), "q"),
    (dict(q=np.zeros(4), k=np.zeros((3, 5)), v=np.zeros((3, 2))), "k"),
    (dict(q=np.zeros(4), k=np.zeros((3, 4)), v=np.zeros((2, 2))), "v"),
    (dict(q=np.zeros(4), k=np.zeros((3, 4)), v=np.zeros((3, 2)), zeta=np.zeros(3)), "zeta"),
    (dict(q=np.zeros(4), k=np.zeros((3, 4)), v=np.zeros((3, 2)), mask=np.ones(3)), "mask"),
])
def test_bad_inputs_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=f"^{name}:"):
        ae.energy(**kwargs)


def test_bad_cuts_and_order():
    with pytest.raises(ValueError, match="^cuts:"):
        ae.cuts_to_ranges([3, 1], 5)
    with pytest.raises(ValueError, match="^cuts:"):
        ae.cuts_to_ranges([6], 5)
    with pytest.raises(ValueError, match="^order:"):
        ae.merge_energies([0.0], order="ring")


# --------------------------------------------------------------------------- the napkin model

NS = [0, 1024, 131072, 1_048_576, 5_120_000]


@pytest.mark.parametrize("p", [1, 2, 8, 16, 128])
def test_model_monotone_in_n_and_tree_comm_independent_of_n(p):
    for shape in (ae.PAPER_SHAPE, ae.LLAMA_31_8B):
        tree = [ae.tree_step(shape, n, p) for n in NS]
        ring = [ae.ring_step(shape, n, p) for n in NS]
        assert all(a["total_s"] < b["total_s"] for a, b in zip(tree, tree[1:]))
        assert all(a["total_s"] < b["total_s"] for a, b in zip(ring, ring[1:]))
        assert len({t["comm_s"] for t in tree}) == 1 and len({t["bytes_sent_per_gpu"] for t in tree}) == 1
        assert (tree[0]["comm_s"] == 0) == (p == 1) == (ring[-1]["comm_s"] == 0)


@pytest.mark.parametrize("p", [2, 8, 128])
def test_model_bytes_are_the_formulas(p):
    s = ae.DecodeShape(batch=3, heads=16, head_dim=64, kv_heads=4, dtype_bytes=2)
    n = 1 << 20
    t = ae.tree_step(s, n, p)
    # the formula: 2 (p - 1)/p (b d + 2 b n_h) elements, d = n_h d_h
    assert t["elements_per_gpu"] == pytest.approx(2 * (p - 1) / p * (3 * 16 * 64 + 2 * 3 * 16))
    r = ae.ring_step(s, n, p)
    whole = 2 * 3 * n * 4 * 64                         # K and V elements of the whole cache
    assert r["elements_per_gpu"] == pytest.approx((p - 1) / p * whole)
    assert p * r["elements_per_gpu"] == pytest.approx(whole * (p - 1))   # the ring: 2 b N d p (p - 1)/p


def test_model_ratio_grows_with_p_and_overlap_helps_the_ring():
    s, n = ae.PAPER_SHAPE, 5_120_000
    ratios = [ae.decode_model(s, n, p)["ratio"] for p in (2, 8, 32, 128)]
    assert all(a < b for a, b in zip(ratios, ratios[1:]))
    for p in (2, 8, 128):
        assert ae.ring_step(s, n, p, overlap=True)["total_s"] <= ae.ring_step(s, n, p)["total_s"]
    # all-reduce latency: a tree log2 p steps, a ring 2 (p - 1)
    c = ae.H100_DGX
    assert ae.allreduce_time(0, 8, c, "tree") == pytest.approx(3 * c.nvlink.alpha_s)
    assert ae.allreduce_time(0, 128, c, "tree") == pytest.approx(3 * c.nvlink.alpha_s + 4 * c.network.alpha_s)
    assert ae.allreduce_time(0, 8, c, "ring") == pytest.approx(14 * c.nvlink.alpha_s)


def test_model_rejects_bad_arguments():
    with pytest.raises(ValueError, match="^p:"):
        ae.tree_step(ae.PAPER_SHAPE, 1000, 0)
    with pytest.raises(ValueError, match="^n:"):
        ae.ring_step(ae.PAPER_SHAPE, -1, 8)
    with pytest.raises(ValueError, match="^algorithm:"):
        ae.allreduce_time(100, 8, ae.H100_DGX, "star")


def test_fixed_cost_squeezes_the_ratio():
    m = ae.decode_model(ae.PAPER_SHAPE, 5_120_000, 128)
    c = ae.fixed_cost_for_ratio(m["tree"]["total_s"], m["ring"]["total_s"], 8.0)
    assert (m["ring"]["total_s"] + c) / (m["tree"]["total_s"] + c) == pytest.approx(8.0)
    with pytest.raises(ValueError, match="^ratio:"):
        ae.fixed_cost_for_ratio(1.0, 2.0, 1.0)
