"""Chapter 4: the fused FlashAttention forward against the float64 oracle.

O and the row logsumexp L, for drawn shapes (ragged N, Nq != Nk, odd d, N = 0 and 1),
causal or not, drawn scales and logit magnitudes (up to about 1e4), float32 and float16
inputs, drawn tile configurations; device arrays in and out; the launcher's validation.
"""

import math

import numpy as np
import pytest
from numba import cuda
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kernels import reference as ref
from kernels.flash_forward import (
    ROW_THREADS,
    SWEEP_D64,
    SWEEP_D128,
    Tiles,
    check_tile_update,
    default_tiles,
    flash_forward_numpy,
    io_model_bytes,
    make_flash_forward,
    query_tile_attention,
    row_per_thread_attention,
    shared_bytes,
    tile_update,
    tile_update_cases,
)
from kernels.flash_forward import flash_attention as _flash_attention
from kernels.base.fused import padded_head_dim
from kernels.base.runtime import is_device_array, on_simulator
from kernels.base.shared_memory import STATIC_LIMIT_BYTES, allow_dynamic_shared_memory
from kernels.base.testing import gpu_examples, assert_close, attention_cases, case_with, forward_floor_scales


def flash_attention(q, k, v, **options):
    """Chapter 4's launcher on chapter 4's kernel, the kernel these tests are for
    (products="fma": for float32 on a GPU with TF32 tensor cores its default is chapter 11's)."""
    return _flash_attention(q, k, v, products="fma", **options)


SIM = on_simulator()
BOTH_DTYPES = (np.float32, np.float16)


def check(case, tiles=None):
    """Run the kernel on ``case`` and compare O and L with the oracle (the tolerance rule)."""
    o, lse = flash_attention(case.q, case.k, case.v, causal=case.causal, scale=case.scale, tiles=tiles)
    exact_o, exact_l = ref.attention(case.q, case.k, case.v, causal=case.causal, scale=case.scale)
    base_o, base_l = ref.attention(case.q, case.k, case.v, causal=case.causal, scale=case.scale,
                                   dtype=np.float32)
    assert o.dtype == np.float32 and lse.dtype == np.float32
    # Floors: O and L are as accurate as the exponents scale * S are (kernels.base.testing.exponent_scale).
    fs_o, fs_l = forward_floor_scales(case.q, case.k, case.v, case.scale, causal=case.causal)
    assert_close(o, exact_o, base_o, name="O", floor_scale=fs_o)
    assert_close(lse, exact_l, base_l, name="L", floor_scale=fs_l)
    return o, lse


# --------------------------------------------------------------------------- the oracle

# One past a query tile of the default configuration (simulator Br = 8; GPU Br = 256).
ONE_PAST = default_tiles(16).Br + 1


@given(attention_cases(dtypes=BOTH_DTYPES))
@example(case_with((1, 1, 1, 4), (1, 1, 1, 4)))                               # N = 1
@example(case_with((1, 2, 5, 3), (1, 2, 11, 3)))                              # Nq < Nk, odd d
@example(case_with((2, 1, 11, 7), (2, 1, 5, 7), causal=True))                 # Nq > Nk: empty rows
@example(case_with((1, 1, ONE_PAST, 16), (1, 1, ONE_PAST, 16), causal=True))  # one past a tile
@example(case_with((1, 1, 12, 16), (1, 1, 12, 16), magnitude=100.0))          # logits ~ +-1e4
@example(case_with((1, 1, 12, 16), (1, 1, 12, 16), magnitude=100.0, causal=True, scale=1.0))
@example(case_with((1, 1, 10, 8), (1, 1, 13, 8), dtype=np.float16, causal=True))
@example(case_with((1, 1, 0, 8), (1, 1, 5, 8)))                               # Nq = 0
@example(case_with((1, 1, 6, 8), (1, 1, 0, 8), causal=True))                  # Nk = 0: all rows empty
def test_matches_oracle(case):
    check(case)


@given(st.data())
@settings(deadline=None)
def test_nan_or_inf_reaches_the_rows_it_touches(data):
    """A NaN or Inf in one element of an input: the outputs are not finite exactly where the
    oracle's are (a query row: that row only; a key or value row: every row that attends to
    it), and every other row meets the tolerance rule. Keys and values are planted without
    causal masking: the oracle multiplies masked probabilities (exact zeros) by V, and
    0 * NaN is NaN there, while the kernel never reads a tile above the diagonal."""
    case = data.draw(attention_cases(dtypes=BOTH_DTYPES).filter(lambda c: c.q.shape[2] > 0 and c.k.shape[2] > 0))
    which = data.draw(st.sampled_from(["q", "k", "v"]))
    causal = case.causal and which == "q"
    arrays = {"q": case.q.copy(), "k": case.k.copy(), "v": case.v.copy()}
    index = tuple(data.draw(st.integers(0, n - 1)) for n in arrays[which].shape)
    arrays[which][index] = data.draw(st.sampled_from([np.nan, np.inf, -np.inf]))
    q, k, v = arrays["q"], arrays["k"], arrays["v"]
    o, lse = flash_attention(q, k, v, causal=causal, scale=case.scale)
    with np.errstate(invalid="ignore", over="ignore"):
        exact_o, exact_l = ref.attention(q, k, v, causal=causal, scale=case.scale)
        base_o, base_l = ref.attention(q, k, v, causal=causal, scale=case.scale, dtype=np.float32)
    assert np.array_equal(np.isfinite(o), np.isfinite(exact_o)), "O: not finite in other places than the oracle"
    assert np.array_equal(np.isfinite(lse), np.isfinite(exact_l)), "L: not finite in other places than the oracle"
    rows = np.isfinite(exact_o).all(axis=-1)
    arrays[which][index] = 0.0
    fs_o, fs_l = forward_floor_scales(arrays["q"], arrays["k"], arrays["v"], case.scale, causal=causal)
    fs_o, fs_l = fs_o[rows], fs_l[rows]
    assert_close(o[rows], exact_o[rows], base_o[rows], name="O", floor_scale=fs_o)
    assert_close(lse[rows], exact_l[rows], base_l[rows], name="L", floor_scale=fs_l)


# Tile configurations drawn on a GPU: every kernel is compiled per (tiles, D, dtype), so the
# set is small and fixed: the bench's candidates plus a few unusual shapes.
GPU_TILES = SWEEP_D64 + SWEEP_D128 + (Tiles(32, 32, 2, 8), Tiles(64, 16, 2, 4), Tiles(16, 32, 1, 32))


def tile_configs():
    """Tile configurations the kernel must handle: tiny random ones in the simulator (every
    thread is a Python thread there), the fixed GPU_TILES on a GPU."""
    if not SIM:
        return st.sampled_from(GPU_TILES)

    @st.composite
    def draw(draw):
        tx = draw(st.sampled_from([1, 2, 4, 8]))
        tm = draw(st.sampled_from([1, 2, 4]))
        rows = draw(st.sampled_from([1, 2, 4]))        # threads along the rows
        bc = tx * draw(st.sampled_from([1, 2, 3]))
        tiles = Tiles(Br=tm * rows, Bc=bc, TM=tm, TX=tx)
        return tiles if tiles.threads <= 32 else Tiles(Br=8, Bc=8, TM=2, TX=4)
    return draw()


@settings(max_examples=6 if SIM else gpu_examples(300))
@given(case=attention_cases(max_n=24 if SIM else 300, max_d=16 if SIM else 128,
                            dtypes=BOTH_DTYPES if SIM else (np.float32,)),
       tiles=tile_configs())
@example(case=case_with((1, 1, 7, 5), (1, 1, 9, 5), causal=True), tiles=Tiles(Br=1, Bc=1, TM=1, TX=1))
@example(case=case_with((1, 1, 9, 3), (1, 1, 20, 3), causal=True), tiles=Tiles(Br=4, Bc=8, TM=1, TX=8))
@example(case=case_with((1, 1, 17, 6), (1, 1, 6, 6), causal=True), tiles=Tiles(Br=2, Bc=3, TM=2, TX=1))
@example(case=case_with((1, 1, 9, 1), (1, 1, 7, 1), causal=True), tiles=Tiles(Br=4, Bc=2, TM=1, TX=2))  # a copy pass
# of 4 rows is longer than the 2-row K/V tile
def test_drawn_tiles(case, tiles):
    if SIM and tiles.threads > 32:
        tiles = default_tiles(case.q.shape[-1])
    if not SIM and tiles.threads % 32:       # the tiny pinned examples: a small GPU configuration
        tiles = Tiles(32, 32, 2, 8)
    d = case.q.shape[-1]
    if not SIM and shared_bytes(tiles, padded_head_dim(d, tiles.TX)) > 227 * 1024:
        tiles = default_tiles(d)             # a d=64 candidate asked for d > 64: too big a block
    check(case, tiles)


def test_gpu_tiles_fit_every_head_dim():
    """The d=64 candidates up to d=64, the others (and the defaults) at every head dim."""
    for tiles, dims in [(t, (1, 16, 33, 64)) for t in SWEEP_D64] + [(t, (1, 16, 33, 64, 100, 128))
                                                                    for t in GPU_TILES if t not in SWEEP_D64]:
        for d in dims:
            D = max(padded_head_dim(d, tiles.TX), 16)
            assert D % tiles.TX == 0 and tiles.Bc % tiles.TX == 0 and tiles.Br % tiles.TM == 0
            assert tiles.threads % 32 == 0 and shared_bytes(tiles, D) <= 227 * 1024, (tiles, d)


def test_fully_masked_rows_are_zero_with_minus_inf_lse():
    """Causal with Nq > Nk: query i sees nothing when i + (Nk - Nq) < 0: O = 0, L = -inf."""
    case = case_with((1, 2, 13, 4), (1, 2, 5, 4), causal=True, seed=3)
    o, lse = check(case)
    empty = np.arange(13) + (5 - 13) < 0
    assert np.all(o[:, :, empty] == 0)
    assert np.all(np.isneginf(lse[:, :, empty]))
    assert np.all(np.isfinite(lse[:, :, ~empty]))


@pytest.mark.parametrize("nq,nk", [(0, 0), (0, 3), (4, 0)])
def test_empty_sequences(nq, nk):
    case = case_with((2, 1, nq, 6), (2, 1, nk, 6))
    o, lse = flash_attention(case.q, case.k, case.v)
    assert o.shape == (2, 1, nq, 6) and lse.shape == (2, 1, nq)
    assert np.all(o == 0) and np.all(np.isneginf(lse))


def test_float16_inputs_use_the_rounded_values():
    """float16 in: the result is the attention of the float16 values, computed in float32."""
    case = case_with((1, 2, 10, 8), (1, 2, 14, 8), dtype=np.float16, causal=True, seed=5)
    o, lse = check(case)
    assert o.dtype == np.float32


@pytest.mark.parametrize("causal", [False, True])
def test_prefetching_variant_gives_the_same_result(causal):
    """make_flash_forward(..., prefetch=True) loads K/V tile j + 1 while computing tile j:
    the same arithmetic in the same order, so the same bits."""
    from numba import cuda

    case = case_with((1, 2, 19, 8), (1, 2, 37, 8), causal=causal)
    tiles = default_tiles(8) if SIM else Tiles(128, 32, 4, 8)
    D = padded_head_dim(8, tiles.TX)
    outs = []
    for prefetch in (False, True):
        kernel = make_flash_forward(tiles.Br, tiles.Bc, D, tiles.TM, tiles.TX, prefetch=prefetch)
        o = cuda.device_array((2, 19, 8), np.float32)
        lse = cuda.device_array((2, 19), np.float32)
        args = (cuda.to_device(case.q.reshape(2, 19, 8)), cuda.to_device(case.k.reshape(2, 37, 8)),
                cuda.to_device(case.v.reshape(2, 37, 8)), o, lse, np.int32(8), np.float32(1 / math.sqrt(8)),
                np.int32(causal))
        allow_dynamic_shared_memory(kernel, args, shared_bytes(tiles, D))
        kernel[(math.ceil(19 / tiles.Br), 2), tiles.threads, 0, shared_bytes(tiles, D)](*args)
        outs.append((o.copy_to_host(), lse.copy_to_host()))
    np.testing.assert_array_equal(outs[0][0], outs[1][0])
    np.testing.assert_array_equal(outs[0][1], outs[1][1])
    exact_o, _ = ref.attention(case.q, case.k, case.v, causal=causal)
    base_o, _ = ref.attention(case.q, case.k, case.v, causal=causal, dtype=np.float32)
    assert_close(outs[1][0].reshape(1, 2, 19, 8), exact_o, base_o, name="O",
                 floor_scale=forward_floor_scales(case.q, case.k, case.v, causal=causal)[0])


def test_lse_rebuilds_the_probabilities():
    """What chapter 5 relies on: P = exp(scale * S - L) has rows summing to 1."""
    case = case_with((1, 1, 9, 8), (1, 1, 12, 8), causal=True, seed=7)
    _, lse = flash_attention(case.q, case.k, case.v, causal=True)
    scale = 1 / math.sqrt(8)
    s = scale * (case.q.astype(np.float64) @ np.swapaxes(case.k.astype(np.float64), -1, -2))
    s = np.where(ref.causal_mask(9, 12), s, -np.inf)
    p = np.exp(s - lse[..., None].astype(np.float64))
    np.testing.assert_allclose(p.sum(-1), 1.0, rtol=1e-5)


def test_device_arrays_in_device_arrays_out():
    from numba import cuda

    case = case_with((1, 2, 10, 8), (1, 2, 7, 8), causal=True, seed=11)
    dq, dk, dv = (cuda.to_device(x) for x in (case.q, case.k, case.v))
    o, lse = flash_attention(dq, dk, dv, causal=True)
    assert is_device_array(o) and is_device_array(lse)
    o_host, lse_host = flash_attention(case.q, case.k, case.v, causal=True)
    np.testing.assert_array_equal(o.copy_to_host(), o_host)
    np.testing.assert_array_equal(lse.copy_to_host(), lse_host)


# --------------------------------------------------------------------------- tiles, shared memory

def test_shared_memory_budget():
    """Qt D x (Br+4), Kt D x (Bc+4), V Bc x (D+8), Pt Bc x (Br+4), float32."""
    t = Tiles(Br=128, Bc=64, TM=8, TX=8)
    assert shared_bytes(t, 64) == 4 * (64 * 132 + 64 * 68 + 64 * 72 + 64 * 132)
    assert shared_bytes(Tiles(Br=64, Bc=32, TM=4, TX=8), 128) == 4 * (128 * 68 + 128 * 36 + 32 * 136 + 32 * 68)
    for tiles, d in [(t, 64) for t in SWEEP_D64] + [(t, 128) for t in SWEEP_D128]:
        assert shared_bytes(tiles, d) <= 227 * 1024
        assert tiles.threads % 32 == 0 and tiles.threads <= 1024


def test_padded_head_dim():
    assert padded_head_dim(64, 8) == 64 and padded_head_dim(65, 8) == 128 and padded_head_dim(3, 8) == max(8, 1 if SIM else 16)


@pytest.mark.skipif(SIM, reason="needs a GPU: the limit is a driver attribute")
def test_dynamic_shared_memory_above_48kb_launches():
    tiles = Tiles(Br=128, Bc=64, TM=8, TX=8)
    assert shared_bytes(tiles, 64) > STATIC_LIMIT_BYTES
    check(case_with((1, 2, 300, 64), (1, 2, 257, 64), causal=True), tiles)
    with pytest.raises(ValueError, match="shared memory"):
        allow_dynamic_shared_memory(object(), (), 10**7)


# --------------------------------------------------------------------------- validation

GOOD = case_with((1, 2, 4, 8), (1, 2, 5, 8))


@pytest.mark.parametrize("change,exc,name", [
    (dict(q=GOOD.q[0]), ValueError, "q"),                                     # rank
    (dict(k=GOOD.k[..., :4]), ValueError, "k"),                               # head dim differs
    (dict(v=GOOD.v[:, :, :3]), ValueError, "v"),                              # v shape != k shape
    (dict(k=np.concatenate([GOOD.k, GOOD.k], axis=1)), ValueError, "k"),      # heads differ
    (dict(q=GOOD.q.astype(np.float64), k=GOOD.k.astype(np.float64), v=GOOD.v.astype(np.float64)),
     TypeError, "q"),                                                         # dtype
    (dict(q=GOOD.q.astype(np.int32)), TypeError, "q"),
    (dict(q=GOOD.q.astype(np.float16)), TypeError, "q, k, v"),                # mixed dtypes
    (dict(q=np.ones((1, 1, 2, 129), np.float32), k=np.ones((1, 1, 2, 129), np.float32),
          v=np.ones((1, 1, 2, 129), np.float32)), ValueError, "head dim"),    # d > 128
    (dict(q=[[[[1.0]]]]), TypeError, "q"),                                    # not an array
    (dict(scale=0.0), ValueError, "scale"),
    (dict(scale=-1.0), ValueError, "scale"),
    (dict(scale=float("nan")), ValueError, "scale"),
    (dict(scale="0.5"), TypeError, "scale"),
    (dict(causal=1), TypeError, "causal"),
    (dict(causal="yes"), TypeError, "causal"),
    (dict(tiles=(64, 64, 4, 8)), TypeError, "tiles"),
    (dict(tiles=Tiles(Br=8, Bc=8, TM=3, TX=4)), ValueError, "tiles"),         # TM does not divide Br
    (dict(tiles=Tiles(Br=8, Bc=6, TM=2, TX=4)), ValueError, "tiles"),         # TX does not divide Bc
    (dict(tiles=Tiles(Br=8, Bc=8, TM=2, TX=3)), ValueError, "tiles"),         # TX not a power of two
    (dict(tiles=Tiles(Br=8, Bc=64, TM=1, TX=64)), ValueError, "tiles"),       # TX > 32
    (dict(tiles=Tiles(Br=0, Bc=8, TM=1, TX=4)), ValueError, "tiles"),
    (dict(tiles=Tiles(Br=2048, Bc=8, TM=1, TX=4)), ValueError, "tiles"),      # too many threads
])
def test_bad_inputs_name_the_argument(change, exc, name):
    args = dict(q=GOOD.q, k=GOOD.k, v=GOOD.v, causal=False, scale=None)
    args.update(change)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    with pytest.raises(exc, match=name):
        flash_attention(q, k, v, **args)


# --------------------------------------------------------------------------- the ladder's first rungs
# The notebook's kernel exercises: one thread a query row (rung 1), then a block a query
# tile with K/V tiles in shared memory (rung 2). A learner's factories replace the course's
# through kernels.base.learner, and these tests grade them. The outputs start as NaN, so a
# row never written shows; the message says whose row it is.

RUNG_MAX_N = 24 if SIM else 300
RUNG_MAX_D = 8 if SIM else 128
QUERY_TILES = [(8, 4), (3, 5), (1, 1)] if SIM else [(64, 32), (128, 32), (32, 16), (17, 8)]   # all fit D = 128


def check_rung(case, launch, owner, **options):
    q = case.q
    out = cuda.to_device(np.full(q.shape, np.nan, np.float32))
    lse_out = cuda.to_device(np.full(q.shape[:3], np.nan, np.float32))
    launch(case.q, case.k, case.v, causal=case.causal, scale=case.scale, out=out, lse_out=lse_out, **options)
    o, lse = out.copy_to_host(), lse_out.copy_to_host()
    exact_o, exact_l = ref.attention(case.q, case.k, case.v, causal=case.causal, scale=case.scale)
    base_o, base_l = ref.attention(case.q, case.k, case.v, causal=case.causal, scale=case.scale, dtype=np.float32)
    fs_o, fs_l = forward_floor_scales(case.q, case.k, case.v, case.scale, causal=case.causal)
    assert_close(o, exact_o, base_o, name=f"O (row [b, h, i] is {owner})", floor_scale=fs_o)
    assert_close(lse, exact_l, base_l, name=f"L (element [b, h, i] is {owner})", floor_scale=fs_l)


RUNG_EXAMPLES = [
    case_with((1, 1, 1, 4), (1, 1, 1, 4)),                                  # N = 1
    case_with((2, 1, 11, 7), (2, 1, 5, 7), causal=True),                    # Nq > Nk: rows that see no key
    case_with((1, 1, 9, 16), (1, 1, 9, 16), magnitude=100.0),               # logits ~ +-1e4
    case_with((1, 1, 0, 8), (1, 1, 5, 8)),                                  # Nq = 0
    case_with((1, 2, 6, 8), (1, 2, 0, 8), causal=True),                     # Nk = 0: O = 0, L = -inf
    case_with((1, 1, 10, 8), (1, 1, 13, 8), dtype=np.float16, causal=True),
]


def rung_examples(**extra):
    """The pinned examples above, as a decorator (``extra``: the test's other arguments)."""
    def decorate(test):
        for case in RUNG_EXAMPLES:
            test = example(case=case, **extra)(test)
        return test
    return decorate


@given(case=attention_cases(max_n=RUNG_MAX_N, max_d=RUNG_MAX_D, dtypes=BOTH_DTYPES))
@settings(max_examples=10 if SIM else gpu_examples(150))
@rung_examples()
def test_row_per_thread_rung_matches_oracle(case):
    threads = 32 if SIM else ROW_THREADS
    check_rung(case, row_per_thread_attention, f"thread i % {threads} of block (i // {threads}, b*H + h)")


@given(case=attention_cases(max_n=RUNG_MAX_N, max_d=RUNG_MAX_D, dtypes=BOTH_DTYPES), tiles=st.sampled_from(QUERY_TILES))
@settings(max_examples=10 if SIM else gpu_examples(150))
@rung_examples(tiles=QUERY_TILES[0])
def test_query_tile_rung_matches_oracle(case, tiles):
    Br = tiles[0]
    check_rung(case, query_tile_attention, f"thread i % {Br} of block (i // {Br}, b*H + h)", tiles=tiles)


@pytest.mark.parametrize("launch", [row_per_thread_attention, query_tile_attention])
@pytest.mark.parametrize("change, exc, name", [
    (dict(q=np.zeros((1, 1, 4, 8), np.float64)), TypeError, "q"),
    (dict(out=np.zeros((1, 1, 4, 8), np.float32)), TypeError, "out"),              # a host array
    (dict(lse_out=lambda: cuda.to_device(np.zeros((1, 1, 3), np.float32))), ValueError, "lse_out"),  # shape
])
def test_rung_bad_inputs_name_the_argument(launch, change, exc, name):
    args = dict(q=GOOD.q, k=GOOD.k, v=GOOD.v)
    args.update({key: value() if callable(value) else value for key, value in change.items()})
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    with pytest.raises(exc, match=name):
        launch(q, k, v, **args)


@pytest.mark.parametrize("tiles", [(0, 4), (8, 0), (2048, 4), (8, 1000), (8.0, 4), [8, 4]])
def test_query_tile_rung_checks_its_tiles(tiles):
    with pytest.raises((TypeError, ValueError), match="tiles"):
        query_tile_attention(GOOD.q, GOOD.k, GOOD.v, tiles=tiles)


# --------------------------------------------------------------------------- the NumPy version

@given(tile_update_cases())
def test_tile_update_property(case):
    check_tile_update(tile_update, case)


@given(attention_cases(max_n=40, max_d=8), st.integers(1, 9), st.integers(1, 9))
def test_numpy_tiles_match_the_oracle(case, br, bc):
    o, lse = flash_forward_numpy(case.q[0, 0], case.k[0, 0], case.v[0, 0], causal=case.causal,
                                 scale=case.scale, Br=br, Bc=bc)
    exact_o, exact_l = ref.attention(case.q[0, 0], case.k[0, 0], case.v[0, 0], causal=case.causal,
                                     scale=case.scale)
    np.testing.assert_allclose(o, exact_o, rtol=1e-9, atol=1e-9)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(exact_l))
    np.testing.assert_allclose(lse[np.isfinite(lse)], exact_l[np.isfinite(exact_l)], rtol=1e-12, atol=1e-9)


def test_io_model():
    n, d = 4096, 64
    assert io_model_bytes(1, 1, n, n, d, Br=128) == 4 * (2 * n * d + n + 2 * n * d * math.ceil(n / 128))
    # causal reads about half the K/V tiles; float16 inputs halve the input bytes
    assert 0.5 < io_model_bytes(1, 1, n, n, d, Br=128, causal=True) / io_model_bytes(1, 1, n, n, d, Br=128) < 0.6
    assert io_model_bytes(2, 3, 100, 50, 8, Br=16, in_bytes=2) == 6 * (100 * 8 * 2 + 100 * 8 * 4 + 100 * 4
                                                                         + 2 * 50 * 8 * 2 * math.ceil(100 / 16))
