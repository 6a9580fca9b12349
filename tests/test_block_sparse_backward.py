"""Chapter 6: block-sparse attention, backward, against the float64 oracle.

Cases are drawn by ``tests/sparse_cases.py``; the forward's outputs come from the oracle,
rounded to float32, so that only the backward is judged here. The kernels are chapter 5's
walking lists of kept tiles: with every tile kept they must give chapter 5's gradients.
"""

import numpy as np
import pytest
from hypothesis import example, given

from kernels import reference as ref
from kernels import sparsity_patterns as sp
from kernels.base.backward_tiles import fits, head_dim_bucket
from kernels.base.runtime import on_simulator
from kernels.base.testing import assert_close, case_with, gradient_floor_scales, random_array
from kernels.block_sparse import tile_lists
from kernels.block_sparse_backward import backward_tiles, block_sparse_attention_backward
from kernels.flash_backward import BackwardTiles, flash_attention_backward
from sparse_cases import DQ_MODES, MAX_N, build, case, sparse_cases

SIM = on_simulator()


def explicit_tiles(c, mask):
    """The drawn kernel tiles (Br = block_m, Bc = block_n for both kernels; either may be
    None: the launcher's fit), with the most threads (of chapter 5's) they split over; None
    when neither is drawn."""
    if c.get("block_m") is None and c.get("block_n") is None:
        return None
    t = backward_tiles(c["d"], mask, dq_mode=c["dq_mode"])
    Br, Bc = c["block_m"] or t.Br, c["block_n"] or t.Bc
    for threads in (16, 8, 4, 2, 1) if SIM else (256, 128, 64, 32, 16, 8, 4, 2, 1):
        tiles = BackwardTiles(Br, Bc, threads, Br, Bc, threads)
        if all(fits(tiles, head_dim_bucket(c["d"]), kernel, c["dq_mode"]) for kernel in ("dK/dV", "dQ")):
            return tiles
    raise AssertionError(f"no thread count fits tiles {Br} x {Bc}")


def _oracle_check(q, k, v, o, lse, do, mask, causal, scale, got):
    kw = dict(causal=causal, scale=scale, block_mask=mask)
    exact = ref.attention_backward(q, k, v, o, lse, do, **kw)
    base = ref.attention_backward(q, k, v, o, lse, do, dtype=np.float32, **kw)
    floors = gradient_floor_scales(q, k, v, o, lse, do, **kw)
    for g, e, bl, fs, name in zip(got, exact, base, floors, ("dQ", "dK", "dV")):
        assert g.dtype == np.float32
        assert_close(g, e, bl, name=name, floor_scale=fs)


def check_backward(c):
    q, k, v, mask = build(c)
    do = random_array(np.random.default_rng(c["seed"] + 1), q.shape)
    o64, lse64 = ref.attention(q, k, v, causal=c["causal"], scale=c["scale"], block_mask=mask)
    o, lse = o64.astype(np.float32), lse64.astype(np.float32)   # the forward's outputs, rounded
    got = block_sparse_attention_backward(q, k, v, o, lse, do, mask, causal=c["causal"], scale=c["scale"],
                                          tiles=explicit_tiles(c, mask), dq_mode=c["dq_mode"])
    # exact: the float64 gradients for the float32 (O, L) the kernel is given
    _oracle_check(q, k, v, o, lse, do, mask, c["causal"], c["scale"], got)
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
@example(case(nq=24, nk=24, d=4, bq=12, bk=12, density=0.7, dq_mode="separate"))        # 12: tiles of 4
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
    o, lse = ref.attention(q, k, v, block_mask=mask)
    for g in block_sparse_attention_backward(q, k, v, o.astype(np.float32), lse.astype(np.float32), do, mask,
                                             dq_mode=dq_mode):
        assert np.array_equal(g, np.zeros_like(g))


@pytest.mark.parametrize("dq_mode", DQ_MODES)
def test_every_tile_kept_is_chapter_5(dq_mode):
    """Every tile kept, the same tiles: chapter 5's kernels walking the full lists, in chapter
    5's order, so dK and dV (and the separate dQ) are chapter 5's bit for bit; the atomic dQ
    sums in an order the blocks decide, within the tolerance rule. (Chapter 5's FMA kernels:
    on a GPU its launcher's default is chapter 11's 3xTF32 backward.)"""
    rng = np.random.default_rng(8)
    b, h, nq, nk, d, block = (1, 2, 19, 23, 6, 8) if SIM else (2, 3, 300, 260, 64, 128)
    tiles = BackwardTiles(8, 8, 16, 8, 8, 16) if SIM else None
    q, do = random_array(rng, (b, h, nq, d)), random_array(rng, (b, h, nq, d))
    k, v = random_array(rng, (b, h, nk, d)), random_array(rng, (b, h, nk, d))
    mask = sp.dense(nq, nk, block=block)
    o, lse = (x.astype(np.float32) for x in ref.attention(q, k, v))
    got = block_sparse_attention_backward(q, k, v, o, lse, do, mask, tiles=tiles, dq_mode=dq_mode)
    want = flash_attention_backward(q, k, v, o, lse, do, tiles=tiles, dq_mode=dq_mode, products="fma")
    for g, w in zip(got[1:] if dq_mode == "atomic" else got, want[1:] if dq_mode == "atomic" else want):
        assert np.array_equal(g, w)
    _oracle_check(q, k, v, o, lse, do, mask, False, None, got)


def test_dense_causal_mask_meets_the_rule():
    """Every tile kept, causal: the lists drop the tiles above the diagonal, as chapter 5's
    walks skip them; both meet the tolerance rule given the same (O, L)."""
    rng = np.random.default_rng(9)
    q, do = random_array(rng, (1, 2, 13, 5)), random_array(rng, (1, 2, 13, 5))
    k, v = random_array(rng, (1, 2, 10, 5)), random_array(rng, (1, 2, 10, 5))
    mask = sp.dense(13, 10, block=8)
    o, lse = (x.astype(np.float32) for x in ref.attention(q, k, v, causal=True))
    for dq_mode in DQ_MODES:
        got = block_sparse_attention_backward(q, k, v, o, lse, do, mask, causal=True, dq_mode=dq_mode)
        _oracle_check(q, k, v, o, lse, do, mask, True, None, got)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("dq_mode", DQ_MODES)
def test_nan_reaches_what_it_touches(dq_mode):
    """A NaN in one row of v (every kept tile of its key column) and a +inf in one row of do:
    NaN exactly where the oracle has it. Every tile of the touched rows and columns kept (the
    oracle's 0 * NaN in a masked tile is absent from a kernel that skips the tile)."""
    c = case(b=1, h=1, nq=12, nk=12, d=4, bq=4, bk=4, kind="dense", seed=3, dq_mode=dq_mode)
    q, k, v, mask = build(c)
    do = random_array(np.random.default_rng(4), q.shape)
    v[0, 0, 5, 1], do[0, 0, 2, 3] = np.nan, np.inf
    with np.errstate(invalid="ignore", over="ignore"):
        o, lse = (x.astype(np.float32) for x in ref.attention(q, k, v, block_mask=mask))
        got = block_sparse_attention_backward(q, k, v, o, lse, do, mask, dq_mode=dq_mode)
        exact = ref.attention_backward(q, k, v, o, lse, do, block_mask=mask)
    for g, e in zip(got, exact):
        assert np.array_equal(np.isnan(g), np.isnan(e)) and np.array_equal(g[np.isinf(e)], e[np.isinf(e)])


@pytest.mark.skipif(SIM, reason="N = 4096 is for the GPU")
@pytest.mark.parametrize("dq_mode", DQ_MODES)
def test_long_causal_sequence(dq_mode):
    """Causal N = 4096 with a random 128 x 128 block mask (the diagonal kept): the first keys'
    dV is a long sum over the kept rows that never cancels; the two-level sums must meet the
    tolerance rule here as in chapter 5."""
    n, d, block = 4096, 64, 128
    c = case_with((1, 1, n, d), (1, 1, n, d), causal=True, seed=16)
    flags = np.random.default_rng(17).random((n // block, n // block)) < 0.5
    mask = ref.BlockMask(flags | np.eye(n // block, dtype=bool), block, block)
    o, lse = (x.astype(np.float32) for x in ref.attention(c.q, c.k, c.v, causal=True, block_mask=mask))
    do = random_array(np.random.default_rng(18), o.shape)
    got = block_sparse_attention_backward(c.q, c.k, c.v, o, lse, do, mask, causal=True, dq_mode=dq_mode)
    _oracle_check(c.q, c.k, c.v, o, lse, do, mask, True, None, got)


# --------------------------------------------------------------------------- bad input

def _inputs(nq=8, nk=8, d=4):
    rng = np.random.default_rng(0)
    q, k, v = (random_array(rng, (1, 2, n, d)) for n in (nq, nk, nk))
    o, lse = (x.astype(np.float32) for x in ref.attention(q, k, v))
    return q, k, v, o, lse


def test_backward_bad_input_names_the_argument():
    q, k, v, o, lse = _inputs()
    mask = ref.BlockMask(np.ones((2, 2), bool), 4, 4)
    with pytest.raises(ValueError, match="^do"):
        block_sparse_attention_backward(q, k, v, o, lse, o[:, :, :3], mask)
    with pytest.raises(ValueError, match="^lse"):
        block_sparse_attention_backward(q, k, v, o, lse[:, :1], o, mask)
    with pytest.raises(TypeError, match="^o"):
        block_sparse_attention_backward(q, k, v, o.astype(np.float64), lse, o, mask)
    with pytest.raises(TypeError, match="^block_mask"):
        block_sparse_attention_backward(q, k, v, o, lse, o, np.ones((2, 2), bool))
    with pytest.raises(ValueError, match="^block_mask"):
        block_sparse_attention_backward(q, k, v, o, lse, o, ref.BlockMask(np.ones((3, 2), bool), 4, 4))
    with pytest.raises(ValueError, match="^block_mask.*tiles"):     # tiles that do not divide the mask's blocks
        block_sparse_attention_backward(q, k, v, o, lse, o, mask, tiles=BackwardTiles(4, 8, 16, 4, 8, 16))
    with pytest.raises(ValueError, match="^block_mask.*tiles"):     # the separate dQ kernel's tiles too
        block_sparse_attention_backward(q, k, v, o, lse, o, mask, tiles=BackwardTiles(4, 4, 16, 8, 4, 16),
                                        dq_mode="separate")
    with pytest.raises(TypeError, match="^tiles"):
        block_sparse_attention_backward(q, k, v, o, lse, o, mask, tiles=(4, 4))
    with pytest.raises(ValueError, match="^lists"):                 # lists built for other tiles
        block_sparse_attention_backward(q, k, v, o, lse, o, mask, tiles=BackwardTiles(4, 4, 16, 4, 4, 16),
                                        lists=tile_lists(mask, 8, 8, Br=2, Bc=2, batch=1, heads=2))
    with pytest.raises(ValueError, match="^dq_mode"):
        block_sparse_attention_backward(q, k, v, o, lse, o, mask, dq_mode="sorted")


def test_lists_built_once_are_reused():
    q, k, v, o, lse = _inputs()
    mask = ref.BlockMask(np.array([[1, 0], [1, 1]], bool), 4, 4)
    do = random_array(np.random.default_rng(1), q.shape)
    tiles = BackwardTiles(4, 4, 16, 4, 4, 16)
    lists = tile_lists(mask, 8, 8, Br=4, Bc=4, batch=1, heads=2)
    for dq_mode in DQ_MODES:
        again = block_sparse_attention_backward(q, k, v, o, lse, do, mask, tiles=tiles, lists=lists, dq_mode=dq_mode)
        fresh = block_sparse_attention_backward(q, k, v, o, lse, do, mask, tiles=tiles, dq_mode=dq_mode)
        assert all(np.array_equal(a, b) for a, b in zip(again[1:], fresh[1:]))
