"""Chapter 6: block-sparse attention, forward, against the float64 oracle.

The oracle expands the block mask to one flag per score (``ref.attention(...,
block_mask=...)``); the kernel walks compact lists of kept tiles. Cases are drawn by
``tests/sparse_cases.py``. The first versions (the notebook's kernel exercises: the lists
built on the GPU, a one-thread-a-row forward) are graded here too.
"""

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from numba import cuda

from kernels import reference as ref
from kernels import sparsity_patterns as sp
from kernels.base.fused import Tiles
from kernels.base.runtime import on_simulator
from kernels.base.testing import assert_close, attention_floors, forward_floor_scales, random_array
from kernels.block_sparse import (block_sparse_attention, first_block_sparse_attention, first_threads,
                                  first_tile_lists, tile_lists)
from kernels.flash_forward import default_tiles, flash_attention
from sparse_cases import MAX_N, build, case, sparse_cases


def explicit_tiles(c):
    """The drawn kernel tile (Br = block_m, Bc = block_n, either may be None: the launcher's
    choice), with chapter 4's micro-tiles shrunk to fit; None when neither is drawn."""
    if c["block_m"] is None and c["block_n"] is None:
        return None
    t = default_tiles(c["d"])
    Br, Bc = c["block_m"] or min(t.Br, c["bq"] & -c["bq"]), c["block_n"] or min(t.Bc, c["bk"] & -c["bk"])
    TM, TX = min(t.TM, Br), min(t.TX, Bc)
    while not on_simulator() and (Br // TM) * TX < 32 and TM > 1:
        TM //= 2
    return Tiles(Br, Bc, TM, TX)


def check_forward(c):
    q, k, v, mask = build(c)
    kw = dict(causal=c["causal"], scale=c["scale"], block_mask=mask)
    o, lse = block_sparse_attention(q, k, v, mask, causal=c["causal"], scale=c["scale"], tiles=explicit_tiles(c))
    exact_o, exact_lse = ref.attention(q, k, v, **kw)
    base_o, base_lse = ref.attention(q, k, v, dtype=np.float32, **kw)
    assert o.dtype == np.float32 and lse.dtype == np.float32
    # Floors: O and L are as accurate as the exponents scale * S are (kernels.base.testing.exponent_scale).
    fs_o, fs_l = forward_floor_scales(q, k, v, c["scale"], causal=c["causal"], block_mask=mask)
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


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_dense_mask_is_chapter_4_bit_for_bit(causal, dtype):
    """Every tile kept, the same tiles: this kernel is chapter 4's, by construction (the same
    device function over a list that holds every tile), so O and L are bitwise equal; both
    also pass the tolerance rule against the oracle."""
    sim = on_simulator()
    tiles, block, nq, nk, d = (Tiles(8, 8, 2, 4), 8, 19, 23, 6) if sim else (Tiles(64, 32, 4, 8), 64, 200, 150, 40)
    rng = np.random.default_rng(7)
    q, k, v = (random_array(rng, (1, 2, n, d)).astype(dtype) for n in (nq, nk, nk))
    mask = sp.dense(nq, nk, block=block)
    o, lse = block_sparse_attention(q, k, v, mask, causal=causal, tiles=tiles)
    want_o, want_lse = flash_attention(q, k, v, causal=causal, tiles=tiles)
    assert np.array_equal(o, want_o) and np.array_equal(lse, want_lse), "not chapter 4's kernel at density 1"
    exact_o, exact_lse = ref.attention(q, k, v, causal=causal)
    base_o, base_lse = ref.attention(q, k, v, causal=causal, dtype=np.float32)
    fs_o, fs_l = forward_floor_scales(q, k, v, causal=causal, block_mask=mask)
    assert_close(o, exact_o, base_o, name="O", floor_scale=fs_o)
    assert_close(lse, exact_lse, base_lse, name="L", floor_scale=fs_l)


@given(st.data())
def test_nan_or_inf_in_a_query_row_reaches_that_row_only(data):
    """A NaN or Inf in one query row: that row of O and L is not finite (it is NaN or Inf
    exactly where the oracle's is), every other row is unaffected and within the tolerance."""
    c = data.draw(sparse_cases(max_n=min(MAX_N, 24)).filter(lambda c: c["nq"] > 0 and c["nk"] > 0))
    q, k, v, mask = build(c)
    b, h, i, e = (data.draw(st.integers(0, n - 1)) for n in q.shape)
    q[b, h, i, e] = data.draw(st.sampled_from([np.nan, np.inf, -np.inf]))
    o, lse = block_sparse_attention(q, k, v, mask, causal=c["causal"], scale=c["scale"], tiles=explicit_tiles(c))
    kw = dict(causal=c["causal"], scale=c["scale"], block_mask=mask)
    with np.errstate(invalid="ignore", over="ignore"):
        exact_o, exact_lse = ref.attention(q, k, v, **kw)
        base_o, base_lse = ref.attention(q, k, v, dtype=np.float32, **kw)
    assert np.array_equal(np.isfinite(o), np.isfinite(exact_o)), "O: not finite in other places than the oracle"
    assert np.array_equal(np.isfinite(lse), np.isfinite(exact_lse)), "L: not finite in other places than the oracle"
    rows = np.isfinite(exact_o).all(axis=-1)                                 # rows the bad value did not reach
    q[b, h, i, e] = 0.0                                                      # (for the floors: the finite inputs)
    fs_o, fs_l = forward_floor_scales(q, k, v, c["scale"], causal=c["causal"], block_mask=mask)
    fs_o, fs_l = fs_o[rows], fs_l[rows]
    assert_close(o[rows], exact_o[rows], base_o[rows], name="O", floor_scale=fs_o)
    assert_close(lse[rows], exact_lse[rows], base_lse[rows], name="L", floor_scale=fs_l)


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


# --------------------------------------------------------------------------- the first versions
# The notebook's kernel exercises (a learner's versions replace them through
# kernels.base.learner): the kept-tile lists built on the GPU, one thread a query tile,
# against the host's ``tile_lists``; the one-thread-a-row forward against the oracle with
# the chapter's tolerance rule. Outputs are poisoned first (-1, NaN): an element never
# written shows, and each message names the block and thread that own it.

def _owner(t):
    """Grid thread t of a first version's launch, as 'block b, thread x'."""
    return f"block {t // first_threads()}, thread {t % first_threads()}"


@given(sparse_cases(max_n=MAX_N))
@example(case(nq=16, nk=16, d=1, causal=True, kind="dense", bq=4, bk=4))               # the causal staircase
@example(case(nq=20, nk=7, d=1, causal=True, kind="random", layout="head", h=2))       # Nq > Nk: empty rows
@example(case(nq=9, nk=30, d=1, causal=True, bq=16, bk=8, block_m=4, block_n=4, density=0.8))  # Nq < Nk, small tiles
@example(case(nq=13, nk=0, d=1, bq=8, bk=8))                                             # no keys: every count 0
def test_first_tile_lists_match_the_host_lists(c):
    _, _, _, mask = build(c)
    Br, Bc = c["block_m"] or c["bq"], c["block_n"] or c["bk"]
    kw = dict(Br=Br, Bc=Bc, causal=c["causal"], batch=c["b"], heads=c["h"])
    want = tile_lists(mask, c["nq"], c["nk"], **kw)
    g, tr, tc = want.kept.shape
    out = cuda.to_device(np.full((g, tr, tc), -1, np.int32))       # -1: an entry never written shows
    count_out = cuda.to_device(np.full((g, tr), -1, np.int32))
    first_tile_lists(mask, c["nq"], c["nk"], out=out, count_out=count_out, **kw)
    col_idx, count = out.copy_to_host(), count_out.copy_to_host()
    for gr in range(g * tr):
        gg, r = divmod(gr, tr)
        lo, hi = want.row_ptr[gr], want.row_ptr[gr + 1]
        where = f"query tile r={r} of mask group g={gg} (grid thread {gr} = g*Tr + r: {_owner(gr)})"
        assert count[gg, r] == hi - lo, (
            f"count[{gg}, {r}] = {count[gg, r]}, expected {hi - lo}: {where}; its kept key tiles are "
            f"{want.col_idx[lo:hi].tolist()} (Br={Br}, Bc={Bc}, causal={c['causal']}, Nq={c['nq']}, Nk={c['nk']})")
        got = col_idx[gg, r, :hi - lo]
        assert np.array_equal(got, want.col_idx[lo:hi]), (
            f"col_idx[{gg}, {r}, :{hi - lo}] = {got.tolist()}, expected {want.col_idx[lo:hi].tolist()}: {where}")


@given(sparse_cases(max_n=MAX_N, max_d=16))
@example(case(nq=1, nk=1, d=1, density=1.0))                                           # N = 1
@example(case(nq=20, nk=7, d=5, causal=True, kind="random", layout="head", h=2))       # rows that see nothing
@example(case(nq=12, nk=12, d=3, kind="empty", layout="batch-head", b=2, h=2))         # every row sees nothing
@example(case(nq=12, nk=12, d=2, magnitude=80.0, scale=1.0, causal=True, density=0.7, seed=3))  # logits ~ 1e4
@example(case(nq=9, nk=17, d=3, causal=True, bq=8, bk=4, density=0.6, seed=5))           # ragged, Nq < Nk
@example(case(nq=5, nk=0, d=2))                                                          # no keys
def test_first_forward_matches_the_oracle(c):
    q, k, v, mask = build(c)
    kw = dict(causal=c["causal"], scale=c["scale"], block_mask=mask)
    out = cuda.to_device(np.full(q.shape, np.nan, np.float32))       # NaN: an element never written shows
    lse_out = cuda.to_device(np.full(q.shape[:3], np.nan, np.float32))
    first_block_sparse_attention(q, k, v, mask, causal=c["causal"], scale=c["scale"], out=out, lse_out=lse_out)
    o, lse = out.copy_to_host(), lse_out.copy_to_host()
    exact_o, exact_lse = ref.attention(q, k, v, **kw)
    base_o, base_lse = ref.attention(q, k, v, dtype=np.float32, **kw)
    floors = attention_floors(q, k, v, **kw)
    tpb = first_threads()
    owner = f"row [b, h, i] is grid thread t = (b*H + h)*Nq + i's: block t // {tpb}, thread t % {tpb}"
    assert_close(o, exact_o, base_o, name=f"O ({owner})", floor=floors.o)
    assert_close(lse, exact_lse, base_lse, name=f"L ({owner})", floor=floors.lse)


def test_bad_input_to_the_first_versions_names_the_argument():
    q, k, v = _inputs()
    mask = ref.BlockMask(np.ones((2, 2), bool), 4, 4)
    with pytest.raises(TypeError, match="q"):
        first_block_sparse_attention(q.astype(np.float16), k, v, mask)
    with pytest.raises(ValueError, match="block_mask"):
        first_block_sparse_attention(q, k, v, ref.BlockMask(np.ones((3, 2), bool), 4, 4))
    with pytest.raises(TypeError, match="out"):
        first_block_sparse_attention(q, k, v, mask, out=np.zeros(q.shape, np.float32))
    with pytest.raises(ValueError, match="lse_out"):
        first_block_sparse_attention(q, k, v, mask, lse_out=cuda.to_device(np.zeros((1, 2, 7), np.float32)))
    with pytest.raises(ValueError, match="block_mask"):
        first_tile_lists(mask, 8, 8, Br=8, Bc=4)                           # Br = 8 does not divide 4
    with pytest.raises(TypeError, match="count_out"):
        first_tile_lists(mask, 8, 8, Br=4, Bc=4, count_out=cuda.to_device(np.zeros((1, 2), np.float32)))
    with pytest.raises(ValueError, match="out"):
        first_tile_lists(mask, 8, 8, Br=4, Bc=4, out=cuda.to_device(np.zeros((1, 2, 3), np.int32)))
    with pytest.raises(ValueError, match="nq"):
        first_tile_lists(mask, -1, 8, Br=4, Bc=4)


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
        block_sparse_attention(q, k, v, mask, tiles=Tiles(8, 4, 2, 4))       # Br = 8 does not divide 4
    with pytest.raises(ValueError, match="block_mask"):
        block_sparse_attention(q, k, v, ref.BlockMask(np.ones((3, 3), bool), 3, 3), tiles=Tiles(2, 2, 1, 2))
    with pytest.raises(TypeError, match="tiles"):
        block_sparse_attention(q, k, v, mask, tiles=(4, 4, 2, 4))
    with pytest.raises(ValueError, match="tiles"):
        block_sparse_attention(q, k, v, mask, tiles=Tiles(4, 4, 3, 4))       # TM does not divide Br


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


def test_precomputed_lists_are_reused_and_checked():
    q, k, v = _inputs(nq=12, nk=12)
    mask = sp.random_blocks(12, 12, block=4, density=0.5, seed=4)
    lists = tile_lists(mask, 12, 12, Br=4, Bc=4, causal=True, batch=1, heads=2)
    assert sorted(lists.row_order.tolist()) == [0, 1, 2] and sorted(lists.col_order.tolist()) == [0, 1, 2]
    counts = np.diff(lists.row_ptr)
    assert list(counts[lists.row_order]) == sorted(counts, reverse=True)   # longest first
    got = block_sparse_attention(q, k, v, mask, causal=True, tiles=Tiles(4, 4, 2, 4), lists=lists)
    want = block_sparse_attention(q, k, v, mask, causal=True, tiles=Tiles(4, 4, 2, 4))
    assert all(np.array_equal(a, b) for a, b in zip(got, want))
    with pytest.raises(ValueError, match="lists"):
        block_sparse_attention(q, k, v, mask, causal=False, tiles=Tiles(4, 4, 2, 4), lists=lists)
    with pytest.raises(TypeError, match="lists"):
        block_sparse_attention(q, k, v, mask, lists=[1, 2])
