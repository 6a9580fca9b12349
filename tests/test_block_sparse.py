"""Chapter 6: block-sparse attention, forward and backward, against the float64 oracle.

The oracle expands the block mask to one flag per score (``ref.attention(...,
block_mask=...)``); the kernels walk compact lists of kept tiles. Drawn: shapes (ragged,
Nq != Nk), causal, scale, logit magnitude, the mask's block size, its layout (shared,
per head, per batch and head), its density or pattern, and the kernel tiles.
"""

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from kernels import reference as ref
from kernels import sparsity_patterns as sp
from kernels.block_sparse import block_sparse_attention, block_sparse_attention_backward, tile_lists
from kernels.block_sparse_backward import DQ_MODES
from kernels.base.runtime import on_simulator
from kernels.base.testing import MAX_BH, MAX_D, assert_close, forward_floor_scales, gradient_floor_scales, random_array

# Sequence lengths: the simulator runs every thread in Python, keep them small there.
MAX_N = 40 if on_simulator() else 512
BLOCKS = (4, 8, 16) if on_simulator() else (16, 64, 128)
# Explicit kernel tiles (block_m, block_n) the tests draw, besides the launcher's choice.
# Each distinct tile configuration is a compile on the GPU: keep the set small there.
TILE_CHOICES = (4, 8, 16) if on_simulator() else (16,)
PATTERN_NAMES = ["random", "sliding window", "global + local", "strided", "butterfly", "dense", "empty"]


def make_mask(kind, layout, nq, nk, bq, bk, b, h, density, seed):
    """A BlockMask of the given kind with flags (Tq, Tk), (H, Tq, Tk) or (B, H, Tq, Tk)."""
    tq, tk = -(-nq // bq), -(-nk // bk)
    shape = {"shared": (tq, tk), "head": (h, tq, tk), "batch-head": (b, h, tq, tk)}[layout]
    if kind == "random":
        flags = np.random.default_rng(seed).random(shape) < density
    elif kind == "dense":
        flags = np.ones(shape, bool)
    elif kind == "empty":
        flags = np.zeros(shape, bool)
    else:  # a named pattern (square blocks): shared by every head
        flags = np.broadcast_to(sp.PATTERNS[kind](nq, nk, bq).flags, shape).copy()
    return ref.BlockMask(flags, bq, bk)


@st.composite
def sparse_cases(draw, max_n=MAX_N, max_d=MAX_D):
    b = draw(st.integers(1, MAX_BH))
    h = draw(st.integers(1, MAX_BH))
    nq = draw(st.integers(0, max_n))
    nk = draw(st.integers(0, max_n))
    d = draw(st.integers(1, max_d))
    causal = draw(st.booleans())
    scale = draw(st.one_of(st.none(), st.floats(0.05, 2.0)))
    magnitude = draw(st.sampled_from((0.3, 1.0, 3.0)))
    kind = draw(st.sampled_from(PATTERN_NAMES))
    bq = draw(st.sampled_from(BLOCKS))
    bk = bq if kind not in ("random", "dense", "empty") else draw(st.sampled_from(BLOCKS))
    layout = draw(st.sampled_from(("shared", "head", "batch-head")))
    density = draw(st.floats(0.0, 1.0))
    seed = draw(st.integers(0, 2**32 - 1))
    # kernel tiles: the launcher's choice, or an explicit divisor of the mask block
    bm = draw(st.one_of(st.none(), st.sampled_from([t for t in TILE_CHOICES if bq % t == 0])))
    bn = draw(st.one_of(st.none(), st.sampled_from([t for t in TILE_CHOICES if bk % t == 0])))
    dq_mode = draw(st.sampled_from(DQ_MODES))
    return dict(b=b, h=h, nq=nq, nk=nk, d=d, causal=causal, scale=scale, magnitude=magnitude, kind=kind,
                bq=bq, bk=bk, layout=layout, density=density, seed=seed, block_m=bm, block_n=bn, dq_mode=dq_mode)


def build(c):
    rng = np.random.default_rng(c["seed"])
    q = random_array(rng, (c["b"], c["h"], c["nq"], c["d"]), c["magnitude"])
    k = random_array(rng, (c["b"], c["h"], c["nk"], c["d"]), c["magnitude"])
    v = random_array(rng, (c["b"], c["h"], c["nk"], c["d"]))
    mask = make_mask(c["kind"], c["layout"], c["nq"], c["nk"], c["bq"], c["bk"], c["b"], c["h"],
                     c["density"], c["seed"])
    return q, k, v, mask


def case(b=1, h=1, nq=8, nk=8, d=4, causal=False, scale=None, magnitude=1.0, kind="random", bq=4, bk=4,
         layout="shared", density=0.5, seed=0, block_m=None, block_n=None, dq_mode="atomic"):
    return dict(b=b, h=h, nq=nq, nk=nk, d=d, causal=causal, scale=scale, magnitude=magnitude, kind=kind,
                bq=bq, bk=bk, layout=layout, density=density, seed=seed, block_m=block_m, block_n=block_n,
                dq_mode=dq_mode)


def check_forward(c):
    q, k, v, mask = build(c)
    kw = dict(causal=c["causal"], scale=c["scale"], block_mask=mask)
    o, lse = block_sparse_attention(q, k, v, mask, causal=c["causal"], scale=c["scale"],
                                    block_m=c["block_m"], block_n=c["block_n"])
    exact_o, exact_lse = ref.attention(q, k, v, **kw)
    base_o, base_lse = ref.attention(q, k, v, dtype=np.float32, **kw)
    assert o.dtype == np.float32 and lse.dtype == np.float32
    # Floors: O and L are as accurate as the exponents scale * S are (kernels.base.testing.exponent_scale).
    fs_o, fs_l = forward_floor_scales(q, k, v, c["scale"])
    assert_close(o, exact_o, base_o, name="O", floor_scale=fs_o)
    assert_close(lse, exact_lse, base_lse, name="L", floor_scale=fs_l)


# --------------------------------------------------------------------------- forward

@given(sparse_cases())
@example(case(nq=1, nk=1, d=1, density=1.0))
@example(case(nq=9, nk=8, d=3, causal=True, bq=8, bk=8, density=1.0))           # one past a tile
@example(case(nq=20, nk=7, d=5, causal=True, kind="random", layout="head", h=2))  # rows that see nothing
@example(case(nq=16, nk=16, d=8, kind="empty", layout="batch-head", b=2, h=2))
@example(case(nq=13, nk=16, d=3, magnitude=3.0, scale=1.5, bq=16, bk=8, block_m=8, block_n=4))
def test_forward_matches_oracle(c):
    check_forward(c)


@pytest.mark.parametrize("kind", ["sliding window", "global + local", "strided", "butterfly"])
def test_forward_patterns(kind):
    check_forward(case(b=1, h=2, nq=24, nk=20, d=5, causal=kind == "butterfly", kind=kind, bq=4, bk=4))


def test_logits_around_1e4():
    check_forward(case(nq=12, nk=12, d=2, magnitude=80.0, scale=1.0, causal=True, density=0.7, seed=3))


def test_dense_mask_equals_dense_attention():
    """Every tile kept: both this kernel and chapter 4's dense one pass the tolerance rule
    against the oracle, and they agree with each other more closely than that.

    Agreement bound: the two kernels compute the same raw dot products S (the same
    sequential sum over the head dim) and the same online softmax; they differ in how the
    exponent of P is rounded (both use the fast exp2, from differently rounded arguments)
    and, if their key tiles differ, in where the running sums are rescaled. An exponent
    error of a few ulps of |scale S| is a relative error of P of that size, so O may differ
    by that much times max|V|, and L = scale m + log l by that much: 16 ulps of
    (1 + max|scale S|) covers both kernels' roundings with room to spare.
    """
    from kernels.flash_forward import flash_attention

    rng = np.random.default_rng(7)
    q = random_array(rng, (1, 2, 19, 6))
    k = random_array(rng, (1, 2, 23, 6))
    v = random_array(rng, (1, 2, 23, 6))
    scale = 1.0 / np.sqrt(6)
    max_s = float(np.max(np.abs(scale * (q.astype(np.float64) @ np.swapaxes(k, -1, -2)))))
    ulps = 16 * float(np.finfo(np.float32).eps) * (1.0 + max_s)
    for causal in (False, True):
        mask = sp.dense(19, 23, block=8)
        o, lse = block_sparse_attention(q, k, v, mask, causal=causal)
        want_o, want_lse = flash_attention(q, k, v, causal=causal)
        exact_o, exact_lse = ref.attention(q, k, v, causal=causal)
        base_o, base_lse = ref.attention(q, k, v, causal=causal, dtype=np.float32)
        for got, name in ((o, "O"), (want_o, "O (chapter 4)")):
            assert_close(got, exact_o, base_o, name=name)
        for got, name in ((lse, "L"), (want_lse, "L (chapter 4)")):
            assert_close(got, exact_lse, base_lse, name=name)
        assert np.max(np.abs(o - want_o)) <= ulps * float(np.max(np.abs(v))), "O: the two kernels disagree"
        assert np.max(np.abs(lse - want_lse)) <= ulps, "L: the two kernels disagree"


def test_empty_mask_gives_zero_and_minus_inf():
    rng = np.random.default_rng(1)
    q, k, v = (random_array(rng, (2, 1, 10, 3)) for _ in range(3))
    mask = ref.BlockMask(np.zeros((3, 3), bool), 4, 4)
    o, lse = block_sparse_attention(q, k, v, mask)
    assert np.array_equal(o, np.zeros_like(o)) and np.all(lse == -np.inf)


def test_lists_are_compact_and_drop_tiles_above_the_diagonal():
    mask = sp.dense(16, 16, block=4)
    lists = tile_lists(mask, 16, 16, Br=4, Bc=4, causal=True)
    assert lists.row_ptr.tolist() == [0, 1, 3, 6, 10]
    assert lists.col_idx.tolist() == [0, 0, 1, 0, 1, 2, 0, 1, 2, 3]
    assert lists.col_ptr.tolist() == [0, 4, 7, 9, 10]
    assert lists.row_idx.tolist() == [0, 1, 2, 3, 1, 2, 3, 2, 3, 3]
    assert lists.kept_fraction == pytest.approx(10 / 16)
    # a 2 x 2-tile mask block seen by 2 x 4 kernel tiles
    flags = np.array([[True, False], [False, True]])
    lists = tile_lists(ref.BlockMask(flags, 4, 4), 8, 8, Br=2, Bc=4)
    assert lists.row_ptr.tolist() == [0, 1, 2, 3, 4] and lists.col_idx.tolist() == [0, 0, 1, 1]


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


# --------------------------------------------------------------------------- bad input

def _inputs(nq=8, nk=8, d=4):
    rng = np.random.default_rng(0)
    return (random_array(rng, (1, 2, nq, d)), random_array(rng, (1, 2, nk, d)), random_array(rng, (1, 2, nk, d)))


def test_bad_mask_shape_names_block_mask():
    q, k, v = _inputs(nq=9)
    with pytest.raises(ValueError, match="block_mask"):
        block_sparse_attention(q, k, v, ref.BlockMask(np.ones((2, 2), bool), 4, 4))  # needs 3 x 2
    with pytest.raises(ValueError, match="block_mask"):
        block_sparse_attention(q, k, v, ref.BlockMask(np.ones((3, 3, 2), bool), 4, 4))  # H = 2, not 3
    with pytest.raises(TypeError, match="block_mask"):
        block_sparse_attention(q, k, v, np.ones((3, 2), bool))


def test_incompatible_tiles_name_block_mask():
    q, k, v = _inputs()
    mask = ref.BlockMask(np.ones((2, 2), bool), 4, 4)
    with pytest.raises(ValueError, match="block_mask"):
        block_sparse_attention(q, k, v, mask, block_m=8)
    with pytest.raises(ValueError, match="block_mask"):
        block_sparse_attention(q, k, v, ref.BlockMask(np.ones((3, 3), bool), 3, 3), block_n=2)
    with pytest.raises(ValueError, match="block_m"):
        block_sparse_attention(q, k, v, mask, block_m=3)


def test_bad_arrays_name_the_argument():
    q, k, v = _inputs()
    mask = ref.BlockMask(np.ones((2, 2), bool), 4, 4)
    with pytest.raises(TypeError, match="q"):
        block_sparse_attention(q.astype(np.float64), k, v, mask)
    with pytest.raises(ValueError, match="v"):
        block_sparse_attention(q, k, v[:, :, :5], mask)
    with pytest.raises(TypeError, match="causal"):
        block_sparse_attention(q, k, v, mask, causal=1)
    with pytest.raises(ValueError, match="scale"):
        block_sparse_attention(q, k, v, mask, scale=-1.0)
    with pytest.raises(TypeError, match="flags"):
        ref.BlockMask(np.ones((2, 2), np.int32), 4, 4)


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


def test_precomputed_lists_are_reused_and_checked():
    q, k, v = _inputs(nq=12, nk=12)
    mask = sp.random_blocks(12, 12, block=4, density=0.5, seed=4)
    lists = tile_lists(mask, 12, 12, Br=4, Bc=4, causal=True, batch=1, heads=2)
    assert sorted(lists.row_order.tolist()) == [0, 1, 2] and sorted(lists.col_order.tolist()) == [0, 1, 2]
    counts = np.diff(lists.row_ptr)
    assert list(counts[lists.row_order]) == sorted(counts, reverse=True)   # longest first
    got = block_sparse_attention(q, k, v, mask, causal=True, block_m=4, block_n=4, lists=lists)
    want = block_sparse_attention(q, k, v, mask, causal=True, block_m=4, block_n=4)
    assert all(np.array_equal(a, b) for a, b in zip(got, want))
    with pytest.raises(ValueError, match="lists"):
        block_sparse_attention(q, k, v, mask, causal=False, block_m=4, block_n=4, lists=lists)
    with pytest.raises(TypeError, match="lists"):
        block_sparse_attention(q, k, v, mask, lists=[1, 2])
