"""The fp32 backward on tensor cores (3xTF32) against the float64 oracle, under the fp32 rule.

The kernel takes float32 inputs, so it is held to chapter 5's rule (``_check_gradients``
there): each gradient within 2x the error of plain float32 NumPy
(``ref.attention_backward(..., dtype=np.float32)``) of the float64 oracle, plus the
gradient floors (``gradient_floor_scales``), not a looser rule. For grouped-query
attention the oracle and the yardstick see K and V repeated over each group of query heads,
and dK, dV (and their floors) are summed back over the group, the yardstick's sums in
float32. The o and lse given to the backward are the oracle forward's, rounded to float32.
Plain TF32 (``passes=1``) must fail the rule where 3xTF32 meets it. Drawn: causal, scale,
ragged Nq != Nk (N = 0 too), d not a multiple of 8 (padded to D; dQ then takes the scalar
atomic adds), GQA groups of 1 and 2, logit spreads. Pinned: N = 1, rows that see no key,
GQA with causal, big logits, one past a query tile and a key tile, empty sequences. Also
the routing of chapters 4 and 5's ``products=`` to the tensor-core kernels, and the
chapter's exercise checker (P^T's accumulator tile as an A operand) against planted mistakes.
"""

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kernels import reference as ref
from kernels.base.backward_tiles import BackwardTiles
from kernels.base.runtime import ArrayKind, check_products, on_simulator
from kernels.base.testing import (gpu_examples, Floor, assert_close, case_with, gradient_floor_scales,
                                  grouped_attention_cases, magnitude_for_logits, over_group)
from kernels.flash_backward import flash_attention_backward
from kernels.flash_forward import flash_attention
from kernels.flash_tf32 import flash_attention_tf32
from kernels.tf32_backward import (accumulator_as_a, backward_checked, check_accumulator_as_a,
                                   check_accumulator_as_a_case, flash_attention_backward_tf32, tf32_backward_tiles)

SIM = on_simulator()
# The simulator runs each of a block's 32 W threads in Python: one or two tiles of queries
# and keys there, B * H <= 2.
MAX_N = 18 if SIM else 300
HEAD_DIMS = [3, 8, 13] if SIM else [8, 20, 64, 100, 128]       # 3, 13, 20, 100: d % 8 != 0
BR, W, _ = tf32_backward_tiles(16)
BC = 16 * W                                                    # keys a block
WHERE = {"dQ": "(row [b, h, i]: the atomic adds of every key block)",
         "dK": f"(row [b, hkv, j]: warp (j % {BC}) // 16 of block (j // {BC}, b*Hkv + hkv))"}
WHERE["dV"] = WHERE["dK"]


def tf32_backward_cases():
    """The drawn cases at this file's sizes (``kernels.base.testing.grouped_attention_cases``)."""
    return grouped_attention_cases(max_n=MAX_N, head_dims=HEAD_DIMS, small=SIM, dtype=np.float32)


def pinned(q_shape, k_shape, *, causal=False, scale=None, magnitude=1.0, seed=0):
    return case_with(q_shape, k_shape, causal=causal, scale=scale, magnitude=magnitude, seed=seed, dtype=np.float32)


class Inputs:
    """A case as the kernel takes it (float32), with dO drawn and o, lse from the float64
    forward, rounded to float32."""

    def __init__(self, case, seed=1):
        self.case = case
        self.group = case.q.shape[1] // case.k.shape[1]
        self.q, self.k, self.v = case.q, case.k, case.v
        self.do = np.random.default_rng(seed).standard_normal(case.q.shape).astype(np.float32)
        o, lse = ref.attention(self.q, *self.repeated(self.k, self.v), causal=case.causal, scale=case.scale)
        self.o, self.lse = o.astype(np.float32), lse.astype(np.float32)

    def repeated(self, *xs):
        return (np.repeat(x, self.group, axis=1) for x in xs)

    def run(self, passes=3, splits=None):
        c = self.case
        if splits is None:
            return flash_attention_backward_tf32(self.q, self.k, self.v, self.o, self.lse, self.do, causal=c.causal,
                                                 scale=c.scale, passes=passes)
        # the checked entry, the query tiles split among ``splits`` blocks a key tile
        scale = c.scale if c.scale is not None else 1 / np.sqrt(c.q.shape[-1])
        return backward_checked(ArrayKind(self.q), *(np.ascontiguousarray(x, np.float32) for x in
                                                     (self.q, self.k, self.v, self.o, self.lse, self.do)),
                                causal=c.causal, scale=scale, passes=passes, splits=splits)

    def check(self, got, floors_from=None, names=("dQ", "dK", "dV")):
        """Each gradient of ``names`` under the fp32 rule; NaN exactly where the oracle's is
        (assert_close). ``floors_from``: finite (q, k, v, o, lse, do) to take the floors from."""
        c, hkv = self.case, self.k.shape[1]
        kw = dict(causal=c.causal, scale=c.scale)
        kr, vr = self.repeated(self.k, self.v)
        args = (self.q, kr, vr, self.o, self.lse, self.do)
        with np.errstate(invalid="ignore", over="ignore"):
            dq, dk, dv = ref.attention_backward(*args, **kw)
            exact = (dq, over_group(dk, hkv), over_group(dv, hkv))
            bq, bk, bv = ref.attention_backward(*args, dtype=np.float32, **kw)
            baseline = (bq, over_group(bk, hkv), over_group(bv, hkv))
        fq, fk, fv = gradient_floor_scales(*(floors_from or args), **kw)
        floors = (fq, Floor(over_group(fk.value, hkv), fk.why), Floor(over_group(fv.value, hkv), fv.why))
        for name, g, e, b, f in zip(("dQ", "dK", "dV"), got, exact, baseline, floors):
            if name not in names:
                continue
            assert g.dtype == np.float32, f"{name}: dtype {g.dtype}"
            assert g.shape == e.shape, f"{name}: shape {g.shape}, expected {e.shape}"
            assert_close(g, e, b, name=f"{name} {WHERE[name]}", floor_scale=f)


ONE_PAST_Q, ONE_PAST_K = BR + 1, BC + 1
BIG_LOGITS = dict(q_shape=(1, 1, 11, 8), k_shape=(1, 1, 13, 8), scale=0.37, magnitude=12.0)


@given(case=tf32_backward_cases(), seed=st.integers(0, 2**16))
@settings(max_examples=3 if SIM else gpu_examples(150))
@example(case=pinned((1, 1, 1, 8), (1, 1, 1, 8)), seed=0)                                         # N = 1
@example(case=pinned((1, 1, 13, 13), (1, 1, 5, 13), causal=True), seed=1)                         # Nq > Nk
@example(case=pinned((1, 2, 12, 8), (1, 1, 14, 8), causal=True), seed=2)                          # GQA, causal
@example(case=pinned(**BIG_LOGITS), seed=3)                                                       # big logits
@example(case=pinned((1, 1, ONE_PAST_Q, 13), (1, 1, ONE_PAST_K, 13), causal=True), seed=4)        # one past
@example(case=pinned((1, 2, 6, 8), (1, 1, 0, 8), causal=True), seed=5)                            # Nk = 0
@example(case=pinned((1, 2, 0, 8), (1, 2, 7, 8)), seed=6)                                         # Nq = 0
def test_gradients_match_the_oracle(case, seed):
    """Pinned: N = 1 (dS = 0 up to rounding: the floors decide); Nq > Nk causal (rows 0..7
    see no key: L = -inf, zero dQ rows); GQA group 2, causal, d = 8 (whole 16-byte copies,
    dQ's paired adds); logits of several hundred (P nearly one-hot: dS = P (dP - D)
    cancels); one past a query tile (the next tile's copies) and a key tile (a second block,
    skipping the first query tile), d = 13 (scalar copies and adds); empty sequences (zeros
    of the right shapes, no launch)."""
    x = Inputs(case, seed)
    got = x.run()
    x.check(got)
    if case.causal and case.q.shape[2] > case.k.shape[2]:
        dead = case.q.shape[2] - case.k.shape[2]
        assert np.isneginf(x.lse[..., :dead]).all() and (got[0][..., :dead, :] == 0).all(), "rows that see no key"
    if 0 in (case.q.shape[2], case.k.shape[2]):
        assert all((g == 0).all() for g in got), "empty sequences: zero gradients"


@given(case=tf32_backward_cases(), seed=st.integers(0, 2**16), splits=st.integers(2, 5))
@settings(max_examples=3 if SIM else gpu_examples(100))
@example(case=pinned((1, 2, 3 * BR + 1, 8), (1, 1, ONE_PAST_K, 8), causal=True), seed=7, splits=3)  # GQA, causal
@example(case=pinned((1, 1, 13, 13), (1, 1, 5, 13), causal=True), seed=1, splits=4)     # rows that see no key
def test_queries_split_among_blocks_meet_the_same_rule(case, seed, splits):
    """The split backward (``kernels.base.query_split``): S blocks a key tile, each a share
    of the (query head, query tile) pairs, adding dK_j and dV_j into zeroed gradients. Pinned:
    more splits than some blocks have pairs (causal: the last key tile sees one query tile
    a head; shares of GQA's two heads), and empty shares."""
    x = Inputs(case, seed)
    x.check(x.run(splits=splits))


# (chunk, Br): every chunk the query tiles allow; on a GPU at the launcher's W = 8 warps
CHUNKS = [(1, 16), (2, 16), (4, 32)] if SIM else [(1, 64), (2, 64), (4, 64), (4, 32), (2, 32)]


@pytest.mark.parametrize("chunk, br", CHUNKS)
def test_chunks_of_query_tiles_meet_the_same_rule(chunk, br):
    """K_w's and V_w's fragments split once a k-step for ``chunk`` tiles of 8 queries
    (``tf32_backward_chunk``): each chunk the tiles allow gives gradients under the same rule;
    ragged query tiles, causal, two query heads on one KV head, d padded."""
    w = 1 if SIM else W
    case = pinned((1, 2, br + 5, 13), (1, 1, 16 * w + 3, 13), causal=True, seed=chunk)
    x = Inputs(case, seed=2)
    x.check(_bare_backward(case, x, tiles=(br, w), chunk=chunk))


def _bare_backward(case, x, **launch):
    """(dQ, dK, dV) of ``launch_backward`` on ``x``'s arrays as device views (B*H, N, d), with the
    launch arguments the chapter's launcher does not pass (``tiles``, ``chunk``, ``tile_adds``)."""
    from numba import cuda

    from kernels.tf32_backward import launch_backward

    (b, h, n_q, d), (_, hkv, n_k, _) = case.q.shape, case.k.shape
    dev = [cuda.to_device(np.ascontiguousarray(a, np.float32).reshape(rows, n, d))
           for a, rows, n in ((x.q, b * h, n_q), (x.k, b * hkv, n_k), (x.v, b * hkv, n_k), (x.o, b * h, n_q),
                              (x.do, b * h, n_q))]
    lse = cuda.to_device(np.ascontiguousarray(x.lse, np.float32).reshape(b * h, n_q))
    delta = cuda.device_array((b * h, n_q), np.float32)
    dq, dk, dv = (cuda.device_array(a.shape, np.float32) for a in (dev[0], dev[1], dev[2]))
    qd, kd, vd, od, dod = dev
    launch_backward(qd, kd, vd, od, lse, dod, delta, dq, dk, dv, 1 / np.sqrt(d), int(case.causal), **launch)
    return (dq.copy_to_host().reshape(case.q.shape), dk.copy_to_host().reshape(case.k.shape),
            dv.copy_to_host().reshape(case.k.shape))


@pytest.mark.parametrize("d", [16, 13], ids=["d16-aligned", "d13-checked"])
def test_dq_added_a_tile_at_a_time_meets_the_rule(d):
    """dQ added a warp's tiles at a time under one bounds test (``tf32_backward_tile_adds``:
    the default at D > 64, which the simulator's tiles do not reach; the pair-at-a-time adds
    are every other test's at D <= 64) gives gradients under the rule. Nq = Br + 5 with two
    row groups of 16 a query tile: the whole tile takes the unchecked adds where d fills the
    tiles (d = 16), the ragged last one the checked adds, and d = 13 (rows not 16-byte
    aligned) the checked adds everywhere."""
    w, br = (1, 32) if SIM else (W, 32)
    case = pinned((1, 1, br + 5, d), (1, 1, 16 * w, d), causal=False, seed=d)
    x = Inputs(case, seed=4)
    x.check(_bare_backward(case, x, tiles=(br, w), tile_adds=True))


@given(seed=st.integers(0, 2**16), causal=st.booleans(), d=st.sampled_from([8, 13] if SIM else [13, 64, 128]))
@settings(max_examples=1 if SIM else gpu_examples(20))
@pytest.mark.parametrize("lo", ["rounded", "truncated"])
def test_lo_truncated_by_the_mma_or_rounded_meets_the_same_rule(lo, seed, causal, d):
    """A fragment load's split rounds lo = x - hi to tf32 (``split_tf32_at_rounded``) or
    leaves its float32 bits for the mma to truncate (``split_tf32_at``, the launchers'
    default): both give gradients under the fp32 rule, on ragged query and key tiles, two
    query heads on one KV head."""
    w, br = (1, 16) if SIM else (W, tf32_backward_tiles(d)[0])
    case = pinned((1, 2, br + 5, d), (1, 1, 16 * w + 3, d), causal=causal, seed=seed)
    x = Inputs(case, seed=seed + 1)
    x.check(_bare_backward(case, x, tiles=(br, w), lo=lo))


@given(seed=st.integers(0, 2**16), causal=st.booleans(), d=st.sampled_from([8, 13] if SIM else [13, 64, 128]))
@settings(max_examples=1 if SIM else gpu_examples(20))
def test_products_round_by_round_are_the_same_products(seed, causal, d):
    """S^T's and dP^T's products of a k-step issued round by round (``rounds=True``) are the
    same mma in the same order a product: dK and dV bit for bit those of the products one by
    one, dQ (atomic adds in any order) under the rule; ragged tiles, two query heads a KV head."""
    w, br = (1, 16) if SIM else (W, tf32_backward_tiles(d)[0])
    case = pinned((1, 2, br + 5, d), (1, 1, 16 * w + 3, d), causal=causal, seed=seed)
    x = Inputs(case, seed=seed + 1)
    got = _bare_backward(case, x, tiles=(br, w), rounds=True)
    _, dk, dv = _bare_backward(case, x, tiles=(br, w), rounds=False)
    np.testing.assert_array_equal(got[1], dk, err_msg="dK")
    np.testing.assert_array_equal(got[2], dv, err_msg="dV")
    x.check(got)


def test_an_unknown_lo_is_named():
    from kernels.tf32_backward import make_backward_tf32

    with pytest.raises(ValueError, match=r"^lo: expected one of \('rounded', 'truncated'\), got 'even'"):
        make_backward_tf32(16, 1, 8, lo="even")


def test_a_chunk_that_does_not_divide_the_tile_is_named():
    from kernels.tf32_backward import make_backward_tf32

    with pytest.raises(ValueError, match=r"^chunk: expected a divisor of Br / 8 = 2, got 4"):
        make_backward_tf32(16, 1, 8, chunk=4)


def test_big_logits_are_pinned():
    """The example above has logits of several hundred (so that it tests what it says)."""
    c = pinned(**BIG_LOGITS)
    assert np.abs(c.scale * c.q[0, 0].astype(np.float64) @ c.k[0, 0].T).max() > 200


def test_plain_tf32_fails_the_fp32_rule():
    """One TF32 product errs by ~2^-11 of |a||b|: far outside the rule that 3xTF32 meets on
    the same case (each gradient of plain TF32 some hundreds of times its bound in the
    simulator). This is the rule biting, and why the launcher's default is three products."""
    x = Inputs(pinned((1, 1, 16, 16), (1, 1, 16, 16), magnitude=magnitude_for_logits(1.0, 16), seed=3), seed=3)
    x.check(x.run(passes=3))
    plain = x.run(passes=1)
    for name in ("dQ", "dK", "dV"):
        with pytest.raises(AssertionError, match=rf"^{name} "):
            x.check(plain, names=(name,))


# --------------------------------------------------------------------------- NaN

# A NaN in one row of dO reaches the gradients that row touches: its row of dQ, and the
# rows of dK and dV of the keys it sees; everything else stays finite and within the rule.
# The products that sum over queries (dV = P^T dO) take 0 x NaN = NaN for a key the row
# does not see, as the oracle's dense formulas do, so under causal masking the planted row
# is the last one (it sees every key).
NAN_CASES = [
    ("do", False, 6),                  # non-causal: a middle row
    ("do", True, 16),                  # causal: the last row (sees every key)
    ("lse", True, 6),                  # L = NaN is not a dead row (-inf): its P is NaN
]


@pytest.mark.parametrize("where, causal, row", NAN_CASES, ids=["do", "do-causal-last-row", "lse"])
def test_nan_reaches_what_its_row_touches(where, causal, row):
    nq, nk = 17, 11                    # two query tiles; causal: rows 0..5 see no key
    x = Inputs(pinned((1, 1, nq, 13), (1, 1, nk, 13), causal=causal, seed=8), seed=9)
    clean = (x.q, x.k, x.v, x.o, x.lse.copy(), x.do.copy())
    if where == "do":
        x.do = x.do.copy()
        x.do[0, 0, row, 2] = np.nan
    else:
        x.lse = x.lse.copy()
        x.lse[0, 0, row] = np.nan
    dq, dk, dv = got = x.run()
    seen = np.arange(nk) <= row + (nk - nq) if causal else np.ones(nk, bool)   # the keys the row sees
    assert np.isnan(dq[0, 0]).any(axis=-1).tolist() == [r == row for r in range(nq)], "dQ: rows with a NaN"
    for name, g in (("dK", dk), ("dV", dv)):
        assert np.isnan(g[0, 0]).any(axis=-1).tolist() == seen.tolist(), f"{name}: rows with a NaN"
    x.check(got, floors_from=clean)


# --------------------------------------------------------------------------- bad input

def _good():
    h = np.zeros((1, 2, 4, 8), np.float32)
    return dict(q=h, k=h[:, :1, :3].copy(), v=h[:, :1, :3].copy(), o=h, lse=np.zeros((1, 2, 4), np.float32), do=h)


def _f32(*shape):
    return np.zeros(shape, np.float32)


@pytest.mark.parametrize("change, error, name", [
    (dict(q=np.zeros((1, 2, 4, 8), np.float16)), TypeError, "q"),               # float32 only
    (dict(q=np.zeros((1, 2, 4, 8), np.float64)), TypeError, "q"),
    (dict(q=_f32(2, 4, 8)), ValueError, "q"),                                     # wrong ndim
    (dict(k=_f32(1, 3, 8), v=_f32(1, 3, 8)), ValueError, "k"),
    (dict(k=np.zeros((1, 1, 3, 8), np.float16), v=np.zeros((1, 1, 3, 8), np.float16)), TypeError, "k"),
    (dict(v=_f32(1, 1, 5, 8)), ValueError, "v"),                                  # v's shape is not k's
    (dict(k=_f32(1, 1, 3, 7), v=_f32(1, 1, 3, 7)), ValueError, "k"),              # k's d is not q's
    (dict(k=_f32(2, 1, 3, 8), v=_f32(2, 1, 3, 8)), ValueError, "k"),              # k's B is not q's
    (dict(q=_f32(1, 3, 4, 8), o=_f32(1, 3, 4, 8), lse=_f32(1, 3, 4), do=_f32(1, 3, 4, 8),
          k=_f32(1, 2, 3, 8), v=_f32(1, 2, 3, 8)), ValueError, "k"),              # H = 3, Hkv = 2
    (dict(q=_f32(1, 2, 4, 136), k=_f32(1, 1, 3, 136), v=_f32(1, 1, 3, 136), o=_f32(1, 2, 4, 136),
          do=_f32(1, 2, 4, 136)), ValueError, "q"),                               # d > 128
    (dict(o=_f32(1, 2, 5, 8)), ValueError, "o"),
    (dict(o=np.zeros((1, 2, 4, 8), np.float64)), TypeError, "o"),
    (dict(lse=_f32(1, 2, 3)), ValueError, "lse"),
    (dict(lse=_f32(1, 2, 4, 1)), ValueError, "lse"),
    (dict(lse=np.zeros((1, 2, 4), np.float64)), TypeError, "lse"),
    (dict(do=_f32(1, 2, 3, 8)), ValueError, "do"),
    (dict(do=np.zeros((1, 2, 4, 8), np.float16)), TypeError, "do"),
    (dict(causal="yes"), TypeError, "causal"),
    (dict(scale=-1.0), ValueError, "scale"),
    (dict(passes=2), ValueError, "passes"),
    (dict(passes=True), ValueError, "passes"),
])
def test_bad_inputs_name_the_argument(change, error, name):
    args = _good()
    args.update(change)
    options = {key: args.pop(key) for key in ("causal", "scale", "passes") if key in args}
    with pytest.raises(error, match=rf"^{name}\b"):
        flash_attention_backward_tf32(args["q"], args["k"], args["v"], args["o"], args["lse"], args["do"], **options)


# --------------------------------------------------------------------------- products= in chapters 4 and 5

def test_chapter_5_routes_3xtf32_here():
    """flash_attention_backward(..., products="3xtf32") is this kernel: the same dK and dV
    bit for bit (each written once by one warp, its sums in a fixed order) and dQ (atomic
    adds, whose order may vary) under the rule."""
    x = Inputs(pinned((1, 1, 9, 8), (1, 1, 11, 8), causal=True, seed=21), seed=21)
    routed = flash_attention_backward(x.q, x.k, x.v, x.o, x.lse, x.do, causal=True, products="3xtf32")
    x.check(routed)
    here = x.run()
    np.testing.assert_array_equal(routed[1], here[1])
    np.testing.assert_array_equal(routed[2], here[2])


@pytest.mark.parametrize("options, name", [
    (dict(products="bogus"), "products"),
    (dict(products=3), "products"),
    (dict(products="3xtf32", dq_mode="separate"), "dq_mode"),
    (dict(products="3xtf32", tiles=BackwardTiles(8, 4, 8, 8, 4, 8)), "tiles"),
])
def test_chapter_5_products_errors_name_the_argument(options, name):
    a = _good()
    a["k"], a["v"] = _f32(1, 2, 3, 8), _f32(1, 2, 3, 8)          # chapter 5: K and V with q's heads
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        flash_attention_backward(a["q"], a["k"], a["v"], a["o"], a["lse"], a["do"], **options)


def test_chapter_4_routes_3xtf32_to_chapter_11():
    case = pinned((1, 1, 7, 8), (1, 1, 9, 8), causal=True, seed=22)
    o, lse = flash_attention(case.q, case.k, case.v, causal=True, products="3xtf32")
    o11, lse11 = flash_attention_tf32(case.q, case.k, case.v, causal=True)
    np.testing.assert_array_equal(o, o11)
    np.testing.assert_array_equal(lse, lse11)


@pytest.mark.parametrize("dtype, options, error, name", [
    (np.float16, dict(products="3xtf32"), TypeError, "q"),
    (np.float32, dict(products="bogus"), ValueError, "products"),
    (np.float32, dict(products="3xtf32", tiles=object()), ValueError, "tiles"),
])
def test_chapter_4_products_errors_name_the_argument(dtype, options, error, name):
    x = np.zeros((1, 1, 4, 8), dtype)
    with pytest.raises(error, match=rf"^{name}\b"):
        flash_attention(x, x, x, **options)


def test_auto_products():
    """"auto" takes the FMA kernels wherever 3xTF32 is not asked for or cannot run: fp16
    inputs, an FMA-only argument, the simulator (which has no tensor cores)."""
    assert check_products("auto", float32=False) == "fma"
    assert check_products("auto", float32=True, fma_only="tiles") == "fma"
    assert check_products("fma", float32=True) == "fma"
    assert check_products("3xtf32", float32=True) == "3xtf32"
    if SIM:
        assert check_products("auto", float32=True) == "fma"


@pytest.mark.skipif(SIM, reason="the simulator has no tensor cores: auto is fma there")
def test_auto_is_3xtf32_for_float32_on_a_gpu():
    assert check_products("auto", float32=True) == "3xtf32"


# --------------------------------------------------------------------------- GPU sizes

@pytest.mark.skipif(SIM, reason="N = 2048 is for the GPU")
@pytest.mark.parametrize("d, causal, hkv", [(64, False, 2), (64, True, 1), (128, False, 1), (128, True, 2)])
def test_long_sequence_meets_the_rule(d, causal, hkv):
    """N = 2048, two query heads (hkv = 1: one group of 2): N / Bc key blocks, each walking
    up to N / Br query tiles of each head of its group; dQ summed by N / Bc blocks' atomic
    adds."""
    case = pinned((1, 2, 2048, d), (1, hkv, 2048, d), causal=causal, seed=d + causal)
    x = Inputs(case, seed=10)
    x.check(x.run())


# --------------------------------------------------------------------------- the exercise

def test_the_exercise_answer_passes_its_checker():
    for seed in range(5):
        check_accumulator_as_a_case(accumulator_as_a, seed)
    assert check_accumulator_as_a(accumulator_as_a, max_examples=20)


_T = np.arange(32) % 4
PLANTED = {
    "accumulator as it is": lambda c: (c, np.stack([2 * _T, 2 * _T + 1], axis=1)),
    "keys 2t, 2t + 1 read as rows t, t + 4": lambda c: (c[:, [0, 2, 1, 3]], np.stack([_T, _T + 4], axis=1)),
    "rows swapped": lambda c: (c[:, [0, 2, 1, 3]], np.stack([2 * _T + 1, 2 * _T], axis=1)),
    "a2, a3 swapped with a1": lambda c: (c[:, [0, 1, 2, 3]], np.stack([2 * _T, 2 * _T + 1], axis=1)),
}


@pytest.mark.parametrize("name", list(PLANTED))
def test_the_exercise_checker_catches_planted_mistakes(name):
    with pytest.raises(AssertionError):
        check_accumulator_as_a_case(PLANTED[name], 7)
