"""Chapter 1: naive attention (S, P through HBM) against the float64 oracle.

Every intermediate is checked, not only O: S = scale * Q K^T with -inf where the causal
mask forbids, P = softmax(S) with zero rows where nothing may be attended to, the
logsumexp L, and O = P V. Tolerance: ``assert_close`` (twice the float32 NumPy error plus
the element-by-element floors of ``attention_floors``: tight enough that a kernel whose
error grows 4x fails, see tests/test_planted_bugs.py). A NaN or Inf planted in an input
reaches exactly the outputs the oracle's arithmetic reaches.
"""

import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st
from numba import cuda

from kernels import reference as ref
from kernels.naive_attention import (
    PRODUCTION_TILES,
    Tiles,
    first_row_softmax,
    first_scores,
    io_model_bytes,
    io_model_elements,
    naive_attention,
    row_softmax,
    scores,
    weighted_sum,
)
from kernels.base.runtime import on_simulator, to_device
from kernels.base.testing import (
    MAX_N,
    assert_close,
    attention_cases,
    attention_floors,
    case_with,
    counting_launches,
    softmax_floors,
)

# Tiles the tests draw: small ones in the simulator (ragged N crosses several tiles),
# the production ones and a few others on the GPU. Rows longer than
# softmax_threads * softmax_regs take the softmax kernel's three-sweep path: each set of
# tiles leaves both paths reachable.
if on_simulator():
    TILE_CHOICES = [
        Tiles(br=32, bc=32, bd=32, bk=16, tm=4, tn=4, softmax_threads=8, softmax_regs=4),
        Tiles(br=16, bc=8, bd=8, bk=4, tm=2, tn=2, softmax_threads=4, softmax_regs=2),
        Tiles(br=8, bc=16, bd=16, bk=8, tm=1, tn=2, softmax_threads=16, softmax_regs=1),
    ]
    SIM_N = 40  # keeps the module well within a minute in the simulator
else:
    TILE_CHOICES = [
        PRODUCTION_TILES,
        Tiles(br=32, bc=64, bd=32, bk=16, tm=2, tn=4, softmax_threads=256, softmax_regs=1),
        Tiles(br=64, bc=32, bd=128, bk=8, tm=4, tn=8, softmax_threads=32, softmax_regs=4),
        Tiles(br=128, bc=128, bd=64, bk=32, tm=8, tn=8),  # the bench's other tiles
    ]
    SIM_N = MAX_N
tile_choices = st.sampled_from(TILE_CHOICES)


def oracle_scores(q, k, causal, scale, dtype=np.float64):
    """S = scale * Q K^T, -inf where masked, computed in ``dtype`` (the oracle's way)."""
    q, k = np.asarray(q, dtype), np.asarray(k, dtype)
    d = q.shape[-1]
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    s = np.asarray(scale, dtype=dtype) * ref.matmul(q, np.swapaxes(k, -1, -2), dtype=dtype)
    mask = ref.attention_mask(q.shape[-2], k.shape[-2], causal=causal)
    return s if mask is None else np.where(mask, s, -np.inf)


# --------------------------------------------------------------------------- the three steps

@given(case=attention_cases(max_n=SIM_N), tiles=tile_choices)
@example(case=case_with((1, 1, 1, 1), (1, 1, 1, 1)), tiles=TILE_CHOICES[0])                   # N = 1, d = 1
@example(case=case_with((1, 2, 33, 7), (1, 2, 17, 7), causal=True), tiles=TILE_CHOICES[0])     # one past a tile, Nq > Nk: masked rows
@example(case=case_with((2, 1, 9, 5), (2, 1, 40, 5), causal=True, scale=0.7), tiles=TILE_CHOICES[1])  # Nq < Nk causal, odd d
@example(case=case_with((1, 1, 20, 16), (1, 1, 20, 16), logit_std=100.0), tiles=TILE_CHOICES[0])  # exp(300) overflows
@example(case=case_with((1, 1, 20, 16), (1, 1, 20, 16), magnitude=30.0, scale=2.0), tiles=TILE_CHOICES[1])  # logits ~ 1e4
@example(case=case_with((1, 1, 12, 3), (1, 1, 12, 3), magnitude=30.0, causal=True, scale=1.9, seed=3),
         tiles=TILE_CHOICES[2])
@example(case=case_with((1, 1, 40, 4), (1, 1, 40, 4), causal=True), tiles=TILE_CHOICES[1])  # tiles above the diagonal
def test_each_step_matches_the_oracle(case, tiles):
    q, k, v, causal, scale = case.q, case.k, case.v, case.causal, case.scale
    floors = attention_floors(q, k, v, causal=causal, scale=scale)
    s = scores(q, k, causal=causal, scale=scale, tiles=tiles)
    s_exact = oracle_scores(q, k, causal, scale)
    s_f32 = oracle_scores(q, k, causal, scale, np.float32)
    assert_close(s, s_exact, s_f32, name="S", floor=floors.s)

    # The softmax is checked on the kernel's own S, so that its error is its own.
    p, lse = row_softmax(s, tiles=tiles)
    floor_p, floor_l = softmax_floors(s)
    assert_close(p, ref.softmax(s), ref.softmax(s, dtype=np.float32), name="P", floor=floor_p)
    assert_close(lse, ref.logsumexp(s), ref.logsumexp(s, dtype=np.float32), name="L", floor=floor_l)

    # The chain against the oracle from the inputs.
    assert_close(p, ref.softmax(s_exact), ref.softmax(s_f32, dtype=np.float32), name="P (from Q, K)",
                 floor=floors.p)
    o = weighted_sum(p, v, causal=causal, tiles=tiles)
    o_exact, lse_exact = ref.attention(q, k, v, causal=causal, scale=scale)
    o_f32, lse_f32 = ref.attention(q, k, v, causal=causal, scale=scale, dtype=np.float32)
    assert_close(o, o_exact, o_f32, name="O", floor=floors.o)
    assert_close(lse, lse_exact, lse_f32, name="L (from Q, K)", floor=floors.lse)


# --------------------------------------------------------------------------- the first versions
# One thread an element of S, one thread a row of the softmax (the notebook's kernel
# exercises; a learner's versions replace them through kernels.base.learner): the same
# oracle and floors as the tiled kernels.

@given(case=attention_cases(max_n=SIM_N))
@example(case=case_with((1, 1, 1, 1), (1, 1, 1, 1)))                                 # N = 1, d = 1
@example(case=case_with((1, 2, 20, 7), (1, 2, 17, 7), causal=True))                # Nq > Nk: masked rows
@example(case=case_with((2, 1, 9, 5), (2, 1, 19, 5), causal=True, scale=0.7))       # Nq < Nk, causal
def test_first_scores_match_the_oracle(case):
    q, k, causal, scale = case.q, case.k, case.causal, case.scale
    shape = q.shape[:3] + (k.shape[2],)
    out = cuda.to_device(np.full(shape, np.nan, np.float32))      # NaN: an element never written shows
    first_scores(q, k, causal=causal, scale=scale, out=out)
    s = out.copy_to_host()
    assert_close(s, oracle_scores(q, k, causal, scale), oracle_scores(q, k, causal, scale, np.float32),
                 name="S (element [b, h, i, j] is block (j // 16, i // 16, b*H + h)'s)",
                 floor=attention_floors(q, k, case.v, causal=causal, scale=scale).s)


@given(case=attention_cases(max_n=SIM_N))
@example(case=case_with((1, 1, 20, 16), (1, 1, 20, 16), logit_std=100.0))           # exp(300) overflows
@example(case=case_with((1, 2, 20, 7), (1, 2, 17, 7), causal=True))                # rows with nothing to attend
def test_first_row_softmax_matches_the_oracle(case):
    s = oracle_scores(case.q, case.k, case.causal, case.scale, np.float32)     # float32 S, -inf where masked
    p_out = cuda.to_device(np.full(s.shape, np.nan, np.float32))  # NaN: an element never written shows
    l_out = cuda.to_device(np.full(s.shape[:3], np.nan, np.float32))
    first_row_softmax(s, out=p_out, lse_out=l_out)
    p, lse = p_out.copy_to_host(), l_out.copy_to_host()
    floor_p, floor_l = softmax_floors(s)
    assert_close(p, ref.softmax(s), ref.softmax(s, dtype=np.float32), name="P (row [b, h, i] is thread (b*H + h)*Nq + i's)",
                 floor=floor_p)
    assert_close(lse, ref.logsumexp(s), ref.logsumexp(s, dtype=np.float32), name="L", floor=floor_l)


# --------------------------------------------------------------------------- the launcher

@given(case=attention_cases(max_n=SIM_N), tiles=tile_choices)
@example(case=case_with((1, 1, 0, 4), (1, 1, 5, 4)), tiles=TILE_CHOICES[0])        # Nq = 0
@example(case=case_with((1, 2, 6, 4), (1, 2, 0, 4)), tiles=TILE_CHOICES[0])        # Nk = 0: O = 0, L = -inf
@example(case=case_with((2, 1, 19, 3), (2, 1, 4, 3), causal=True, magnitude=3.0), tiles=TILE_CHOICES[1])
def test_naive_attention_matches_the_oracle(case, tiles):
    q, k, v, causal, scale = case.q, case.k, case.v, case.causal, case.scale
    o, lse = naive_attention(q, k, v, causal=causal, scale=scale, return_lse=True, tiles=tiles)
    assert isinstance(o, np.ndarray) and o.dtype == np.float32 and o.shape == q.shape
    o_exact, lse_exact = ref.attention(q, k, v, causal=causal, scale=scale)
    o_f32, lse_f32 = ref.attention(q, k, v, causal=causal, scale=scale, dtype=np.float32)
    floors = attention_floors(q, k, v, causal=causal, scale=scale)
    assert_close(o, o_exact, o_f32, name="O", floor=floors.o)
    assert_close(lse, lse_exact, lse_f32, name="L", floor=floors.lse)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")     # inf - inf in simulated threads
@settings(max_examples=6)
@given(case=attention_cases(max_n=24, max_d=8, allow_empty=False), tiles=tile_choices, data=st.data())
@example(case=case_with((1, 2, 9, 3), (1, 2, 5, 3), causal=True, seed=4), tiles=TILE_CHOICES[1], data=None)
def test_nan_or_inf_reaches_the_rows_it_touches(case, tiles, data):
    """A NaN or Inf in one element of Q, K or V: the outputs are NaN exactly where the
    oracle's are (a query row: that row only; a key row: the rows that may attend it, where
    a +inf score makes the row NaN and a -inf score is a masked key), infinities match, and
    everything else meets the tolerance. V gets a NaN without causal masking: P V multiplies
    masked (zero) probabilities by V in the oracle, and 0 * NaN is NaN there, while the
    kernel skips key tiles past the diagonal."""
    if data is None:                                  # the pinned case: NaN in a query row, causal
        which, bad, index = "q", np.nan, (0, 1, 6, 2)
    else:
        which = data.draw(st.sampled_from(["q", "k", "v"]), label="which")
        bad = np.nan if which == "v" else data.draw(st.sampled_from([np.nan, np.inf, -np.inf]), label="value")
        index = tuple(data.draw(st.integers(0, n - 1)) for n in getattr(case, which).shape)
    causal = case.causal and which != "v"
    arrays = {"q": case.q.copy(), "k": case.k.copy(), "v": case.v.copy()}
    arrays[which][index] = bad
    q, k, v = arrays["q"], arrays["k"], arrays["v"]
    o, lse = naive_attention(q, k, v, causal=causal, scale=case.scale, return_lse=True, tiles=tiles)
    with np.errstate(invalid="ignore", over="ignore"):
        o_exact, lse_exact = ref.attention(q, k, v, causal=causal, scale=case.scale)
        o_f32, lse_f32 = ref.attention(q, k, v, causal=causal, scale=case.scale, dtype=np.float32)
    assert np.array_equal(np.isnan(o), np.isnan(o_exact)), "O: NaN in other places than the oracle's"
    assert np.array_equal(np.isnan(lse), np.isnan(lse_exact)), "L: NaN in other places than the oracle's"
    if which == "q" and np.isnan(bad):                # a NaN query row reaches that row only
        rows = np.isnan(o).any(axis=-1)
        assert rows[index[:3]] and rows.sum() == 1
    arrays[which][index] = 0.0                        # the floors: from the finite inputs
    floors = attention_floors(arrays["q"], arrays["k"], arrays["v"], causal=causal, scale=case.scale)
    assert_close(o, o_exact, o_f32, name="O", floor=floors.o)
    assert_close(lse, lse_exact, lse_f32, name="L", floor=floors.lse)


def test_fully_masked_rows_give_zero_not_nan():
    # Nq > Nk with causal: the first Nq - Nk queries may attend to nothing.
    case = case_with((1, 1, 10, 3), (1, 1, 4, 3), causal=True, magnitude=30.0, seed=5)
    o, lse = naive_attention(case.q, case.k, case.v, causal=True, return_lse=True)
    assert not np.isnan(o).any()
    assert np.all(o[0, 0, :6] == 0) and np.all(lse[0, 0, :6] == -np.inf)
    assert np.all(np.abs(o[0, 0, 6:]).sum(axis=-1) > 0) and np.isfinite(lse[0, 0, 6:]).all()


def test_device_arrays_in_device_arrays_out_and_out_buffers():
    case = case_with((1, 2, 11, 5), (1, 2, 13, 5), causal=True, seed=2)
    dq, dk, dv = (to_device(x, name) for x, name in ((case.q, "q"), (case.k, "k"), (case.v, "v")))
    o = naive_attention(dq, dk, dv, causal=True)
    assert not isinstance(o, np.ndarray) and hasattr(o, "copy_to_host")
    o_exact, _ = ref.attention(case.q, case.k, case.v, causal=True)
    o_f32, _ = ref.attention(case.q, case.k, case.v, causal=True, dtype=np.float32)
    floor_o = attention_floors(case.q, case.k, case.v, causal=True).o
    assert_close(o.copy_to_host(), o_exact, o_f32, name="O (device)", floor=floor_o)

    # The three steps writing into buffers the caller owns (what the bench does).
    from numba import cuda

    s_buf = cuda.device_array((1, 2, 11, 13), np.float32)
    p_buf = cuda.device_array((1, 2, 11, 13), np.float32)
    l_buf = cuda.device_array((1, 2, 11), np.float32)
    o_buf = cuda.device_array((1, 2, 11, 5), np.float32)
    assert scores(dq, dk, causal=True, out=s_buf) is s_buf
    p_got, l_got = row_softmax(s_buf, out=p_buf, lse_out=l_buf)
    assert p_got is p_buf and l_got is l_buf
    assert weighted_sum(p_buf, dv, causal=True, out=o_buf) is o_buf
    assert_close(o_buf.copy_to_host(), o_exact, o_f32, name="O (out buffers)", floor=floor_o)


# --------------------------------------------------------------------------- bad input

def _qkv(nq=4, nk=4, d=8, b=1, h=2, dtype=np.float32):
    rng = np.random.default_rng(0)
    return (rng.standard_normal((b, h, nq, d)).astype(dtype), rng.standard_normal((b, h, nk, d)).astype(dtype),
            rng.standard_normal((b, h, nk, d)).astype(dtype))


@pytest.mark.parametrize("mutate, error, words", [
    (lambda q, k, v: (q[0], k, v), ValueError, "q: expected 4 dimensions"),
    (lambda q, k, v: (q, k[..., None], v), ValueError, "k: expected 4 dimensions"),
    (lambda q, k, v: (q, k, v[:, :, :3]), ValueError, "v: expected the shape of k"),
    (lambda q, k, v: (q, k[:, :1], v[:, :1]), ValueError, "k: expected batch and heads"),
    (lambda q, k, v: (q, k[..., :4], v[..., :4]), ValueError, "k: expected head dim"),
    (lambda q, k, v: (q.astype(np.float64), k, v), TypeError, "q: expected dtype float32"),
    (lambda q, k, v: (q, k.astype(np.int32), v), TypeError, "k: expected dtype float32"),
    (lambda q, k, v: (q, k, v.astype(np.float16)), TypeError, "v: expected dtype float32"),
    (lambda q, k, v: (q.tolist(), k, v), TypeError, "q: expected a NumPy array"),
    (lambda q, k, v: (q[..., :0], k[..., :0], v[..., :0]), ValueError, "q: expected head dim d in 1..128"),
])
def test_bad_arrays_name_the_argument(mutate, error, words):
    q, k, v = mutate(*_qkv())
    with pytest.raises(error, match=words):
        naive_attention(q, k, v)


def test_more_heads_than_a_grid_dimension_is_refused():
    q = np.ones((256, 257, 1, 1), np.float32)  # B*H = 65792 > 65535; a few hundred KB
    with pytest.raises(ValueError, match=r"q: expected B\*H <= 65535"):
        naive_attention(q, q, q)
    with pytest.raises(ValueError, match=r"s: expected B\*H <= 65535"):
        row_softmax(q)


def test_head_dim_over_128_is_refused():
    q, k, v = _qkv(nq=2, nk=2, d=129)
    with pytest.raises(ValueError, match="q: expected head dim d in 1..128"):
        naive_attention(q, k, v)


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(scale=0.0), ValueError, "scale"),
    (dict(scale=-1.0), ValueError, "scale"),
    (dict(scale=float("nan")), ValueError, "scale"),
    (dict(scale=float("inf")), ValueError, "scale"),
    (dict(scale="0.5"), TypeError, "scale"),
    (dict(scale=True), TypeError, "scale"),
    (dict(causal=1), TypeError, "causal"),
    (dict(causal="yes"), TypeError, "causal"),
    (dict(causal=None), TypeError, "causal"),
    (dict(return_lse=0), TypeError, "return_lse"),
    (dict(tiles=(64, 64)), TypeError, "tiles"),
    (dict(tiles=Tiles(br=30, tm=4)), ValueError, "tiles"),
    (dict(tiles=Tiles(softmax_threads=48)), ValueError, "tiles.softmax_threads"),
    (dict(tiles=Tiles(softmax_regs=3)), ValueError, "tiles.softmax_regs"),
    (dict(tiles=Tiles(br=128, bc=128, tm=2, tn=2)), ValueError, "threads"),
    (dict(tiles=Tiles(br=128, bc=128, bk=64, tm=8, tn=8)), ValueError, "shared memory"),
])
def test_bad_options_name_the_argument(kwargs, error, words):
    with pytest.raises(error, match=words):
        naive_attention(*_qkv(), **kwargs)


def test_step_helpers_check_their_arguments():
    q, k, v = _qkv()
    s = np.ones((1, 2, 4, 4), np.float32)
    with pytest.raises(ValueError, match="s: expected 4 dimensions"):
        row_softmax(s[0])
    with pytest.raises(TypeError, match="s: expected dtype float32"):
        row_softmax(s.astype(np.float64))
    with pytest.raises(ValueError, match="v: expected Nk = 4"):
        weighted_sum(s, v[:, :, :3])
    with pytest.raises(ValueError, match="v: expected batch and heads"):
        weighted_sum(s, v[:, :1])
    with pytest.raises(TypeError, match="p: expected dtype float32"):
        weighted_sum(s.astype(np.float64), v)
    with pytest.raises(TypeError, match="out: expected a device array"):
        scores(q, k, out=np.empty((1, 2, 4, 4), np.float32))
    from numba import cuda

    with pytest.raises(ValueError, match=r"out: expected shape \(1, 2, 4, 4\)"):
        scores(q, k, out=cuda.device_array((1, 2, 4, 5), np.float32))
    with pytest.raises(ValueError, match="lse_out: expected shape"):
        row_softmax(s, lse_out=cuda.device_array((1, 2, 5), np.float32))


def test_long_rows_take_the_three_sweep_path_and_agree():
    # Nk = 13: more than softmax_threads * softmax_regs = 8 (three sweeps), less than 16
    # (the row is held in registers).
    case = case_with((1, 1, 5, 3), (1, 1, 13, 3), magnitude=3.0, seed=7)
    s = oracle_scores(case.q, case.k, False, None, np.float32)
    for tiles in (Tiles(softmax_threads=4, softmax_regs=2), Tiles(softmax_threads=4, softmax_regs=4)):
        p, lse = row_softmax(s, tiles=tiles)
        floor_p, floor_l = softmax_floors(s)
        assert_close(p, ref.softmax(s), ref.softmax(s, dtype=np.float32), name="P", floor=floor_p)
        assert_close(lse, ref.logsumexp(s), ref.logsumexp(s, dtype=np.float32), name="L", floor=floor_l)


# --------------------------------------------------------------------------- the IO model

@pytest.mark.skipif(not on_simulator(), reason="counts element accesses in the simulator")
@settings(max_examples=5)
@given(b=st.integers(1, 2), h=st.integers(1, 2), nq=st.integers(1, 12), nk=st.integers(1, 12),
       d=st.integers(1, 6), causal=st.booleans(), tiles=tile_choices)
@example(b=1, h=2, nq=9, nk=5, d=3, causal=False, tiles=TILE_CHOICES[1])
@example(b=1, h=1, nq=12, nk=12, d=4, causal=True, tiles=TILE_CHOICES[1])
def test_io_model_counts_the_elements_the_launches_touch(b, h, nq, nk, d, causal, tiles):
    """The IO model (4Nd + 4N^2 a head, plus L) against the kernels themselves: every
    element each launch reads and writes in global memory, counted in the simulator. Each
    input is read at least once and each output written, so without causal masking the
    distinct elements touched are exactly the model's; with causal masking the scores and
    weighted-sum kernels skip tiles past the diagonal and touch at most that."""
    import kernels.naive_attention as chapter

    case = case_with((b, h, nq, d), (b, h, nk, d), causal=causal, seed=nq * 13 + nk)
    with counting_launches(chapter, "make_scores", "make_row_softmax", "make_weighted_sum") as launches:
        naive_attention(case.q, case.k, case.v, causal=causal, return_lse=True, tiles=tiles)
    touched = {launch.factory: launch.elements() for launch in launches}
    assert list(touched) == ["make_scores", "make_row_softmax", "make_weighted_sum"]
    model = {"make_" + name: n * b * h for name, n in io_model_elements(nq, nk, d).items()}
    for factory, n in model.items():
        if causal and factory != "make_row_softmax":
            assert touched[factory] <= n, f"{factory}: touched {touched[factory]} elements, the model counts {n}"
        else:
            assert touched[factory] == n, f"{factory}: touched {touched[factory]} elements, the model counts {n}"
    assert io_model_bytes(b, h, nq, nk, d)["total"] == 4 * sum(model.values())
