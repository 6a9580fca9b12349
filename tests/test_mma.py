"""The tensor-core building blocks (kernels/base/mma.py): fragments, mma, packing, ldmatrix, cp.async.

On the GPU the hardware is the judge: fragments laid out by the module's position
functions go through the real mma.sync, and the product must be A B + C of the inputs as
rounded to the operand type. In the simulator the same kernels run the emulation. The
layout table itself is checked against entries of the PTX ISA's fragment figures, and a
fragment laid out wrongly must fail.
"""

import numpy as np
import pytest
from hypothesis import given, strategies as st
from numba import cuda, uint32, uint64

from kernels.base import mma

KINDS = ["f16", "bf16", "tf32"]
SHAPES = {"f16": ((16, 16), (16, 8)), "bf16": ((16, 16), (16, 8)), "tf32": ((16, 8), (8, 8))}


# --------------------------------------------------------------------------- the layout table

@pytest.mark.parametrize("position, count, shape", [
    (mma.a_position, 8, (16, 16)), (mma.b_position, 4, (16, 8)), (mma.c_position, 4, (16, 8)),
    (mma.a_position_tf32, 4, (16, 8)), (mma.b_position_tf32, 2, (8, 8))])
def test_every_element_is_held_by_exactly_one_lane(position, count, shape):
    held = [position(lane, i) for lane in range(32) for i in range(count)]
    assert sorted(held) == sorted(np.ndindex(*shape))


def test_positions_match_the_ptx_isa_figures():
    # "Matrix Fragments for mma.m16n8k16 with floating point type" and "... m16n8k8" (tf32)
    assert [mma.a_position(0, i) for i in range(8)] == [(0, 0), (0, 1), (8, 0), (8, 1), (0, 8), (0, 9), (8, 8), (8, 9)]
    assert [mma.a_position(5, i) for i in range(8)] == [(1, 2), (1, 3), (9, 2), (9, 3), (1, 10), (1, 11), (9, 10), (9, 11)]
    assert [mma.b_position(6, i) for i in range(4)] == [(4, 1), (5, 1), (12, 1), (13, 1)]
    assert [mma.c_position(31, i) for i in range(4)] == [(7, 6), (7, 7), (15, 6), (15, 7)]
    assert [mma.a_position_tf32(9, i) for i in range(4)] == [(2, 1), (10, 1), (2, 5), (10, 5)]
    assert [mma.b_position_tf32(9, i) for i in range(2)] == [(1, 2), (5, 2)]


# --------------------------------------------------------------------------- mma on fragments

@cuda.jit
def _mma_kernel(fa, fb, fc, out, kind):
    lane = cuda.threadIdx.x
    a = (fa[lane, 0], fa[lane, 1], fa[lane, 2], fa[lane, 3])
    b = (fb[lane, 0], fb[lane, 1])
    c = (fc[lane, 0], fc[lane, 1], fc[lane, 2], fc[lane, 3])
    if kind == 0:
        d = mma.mma_f16(a, b, c)
    elif kind == 1:
        d = mma.mma_bf16(a, b, c)
    else:
        d = mma.mma_tf32(a, b, c)
    for i in range(4):
        out[lane, i] = d[i]


@cuda.jit
def _split_kernel(x, out):
    i = cuda.grid(1)
    if i < x.shape[0]:
        hi, lo = mma.split_tf32(x[i])
        out[i, 0] = hi
        out[i, 1] = lo
        hi, lo = mma.split_tf32_unrounded(x[i])
        out[i, 2] = hi
        out[i, 3] = lo


def _split_inputs(seed):
    """65 float32 values for a split: normal ones, +-0, the tie 1 + 2^-12, a subnormal."""
    rng = np.random.default_rng(seed)
    return np.concatenate([rng.standard_normal(61), [0.0, -0.0, 1.0 + 2.0**-12, 3.0e-39]]).astype(np.float32)


def test_split_tf32_is_hi_and_the_rounded_rest():
    """hi = x rounded to tf32 (cvt.rn, ties to even, on sm_90; cvt.rna before), lo = (x - hi)
    rounded: hi + lo is x to 2^-22 of |x|. 1 + 2^-12 is a tie: the two roundings differ there.
    split_tf32_unrounded: the same hi, lo = x - hi exactly, its float32 bits as they are."""
    x = _split_inputs(7)
    out = np.zeros((len(x), 4), np.uint32)
    _split_kernel[1, 96](x, out)
    ties = mma.split_ties()
    hi = mma.tf32_bits(x, ties)
    rest = (x - hi.view(np.float32)).astype(np.float32)
    np.testing.assert_array_equal(out[:, 0], hi)
    np.testing.assert_array_equal(out[:, 1], mma.tf32_bits(rest, ties))
    np.testing.assert_array_equal(out[:, 2], hi)
    np.testing.assert_array_equal(out[:, 3], rest.view(np.uint32))
    assert np.any(out[:, 3] & ~np.uint32(mma.TF32_MASK)), "lo keeps bits below tf32's"
    both = out[:, 0].view(np.float32).astype(np.float64) + out[:, 1].view(np.float32).astype(np.float64)
    # subnormals (the last input) keep fewer bits: tf32's spacing there is 2^-136
    assert np.all(np.abs(both - x) <= 2.0**-22 * np.abs(x) + 2.0**-136)


@cuda.jit
def _split_at_kernel(x, out):
    i = cuda.threadIdx.x
    s = cuda.shared.array((1, 96), np.float32)
    if i < x.shape[0]:
        s[0, i] = x[i]
    cuda.syncthreads()
    if i < x.shape[0]:
        addr = mma.shared_address(s, 0, 0) + uint32(4 * i)
        hi, lo = mma.split_tf32_at(addr)
        rhi, rlo = mma.split_tf32_at_rounded(addr)
        out[i, 0] = hi
        out[i, 1] = lo
        out[i, 2] = rhi
        out[i, 3] = rlo


def test_split_tf32_at_leaves_lo_for_the_mma_to_truncate():
    """split_tf32_at: hi as split_tf32's, lo = x - hi exactly, its float32 bits as they are
    (the mma reads a tf32 operand's top 19 bits: it truncates lo itself); hi + lo is x.
    split_tf32_at_rounded: split_tf32's hi and lo."""
    x = _split_inputs(8)
    out = np.zeros((len(x), 4), np.uint32)
    _split_at_kernel[1, 96](x, out)
    ties = mma.split_ties()
    hi = mma.tf32_bits(x, ties)
    rest = (x - hi.view(np.float32)).astype(np.float32)
    np.testing.assert_array_equal(out[:, 0], hi)
    np.testing.assert_array_equal(out[:, 1], rest.view(np.uint32))
    np.testing.assert_array_equal(out[:, 2], hi)
    np.testing.assert_array_equal(out[:, 3], mma.tf32_bits(rest, ties))
    assert np.all(out[:, 0].view(np.float32).astype(np.float64) + out[:, 1].view(np.float32) == x)
    assert np.any(out[:, 1] & ~np.uint32(mma.TF32_MASK)), "lo keeps bits below tf32's"


def _raw_fragments(a, b):
    """A's and B's fragments holding the float32 values' bits as they are (not rounded to tf32)."""
    fa = np.array([[a[mma.a_position_tf32(l, i)] for i in range(4)] for l in range(32)], np.float32)
    fb = np.array([[b[mma.b_position_tf32(l, i)] for i in range(2)] for l in range(32)], np.float32)
    return fa.view(np.uint32), fb.view(np.uint32)


def test_the_mma_truncates_a_tf32_operands_low_bits():
    """Registers holding float32 values with bits below tf32's: the tf32 mma multiplies the
    values truncated to tf32 (the 13 low bits dropped), neither rounded nor whole. On the GPU
    the hardware decides this; the simulator's emulation must do the same (split_tf32_at
    relies on it)."""
    rng = np.random.default_rng(11)
    for _ in range(4):
        a = rng.standard_normal((16, 8)).astype(np.float32)
        b = rng.standard_normal((8, 8)).astype(np.float32)
        c = np.zeros((16, 8), np.float32)
        got = _run_mma(*_raw_fragments(a, b), mma.fragment_c(c), "tf32")

        def truncated(x):
            return (x.view(np.uint32) & np.uint32(mma.TF32_MASK)).view(np.float32).astype(np.float64)

        tol = 8 * np.finfo(np.float32).eps * (np.abs(truncated(a)) @ np.abs(truncated(b))) + 1e-30
        assert np.all(np.abs(got - truncated(a) @ truncated(b)) <= tol)
        assert np.any(np.abs(got - _rounded(a, "tf32") @ _rounded(b, "tf32")) > 100 * tol), "rounded operands"
        assert np.any(np.abs(got - a.astype(np.float64) @ b.astype(np.float64)) > 100 * tol), "whole operands"


def _run_mma(fa, fb, fc, kind):
    out = np.zeros((32, 4), np.float32)
    _mma_kernel[1, 32](fa, fb, fc, out, KINDS.index(kind))
    return mma.matrix_from_c(out)


def _rounded(x, kind):
    """The values the tensor core multiplies: x rounded to the operand type, as float64."""
    x = np.asarray(x, np.float32)
    if kind == "f16":
        return x.astype(np.float16).astype(np.float64)
    bits = mma.bf16_bits(x) << 16 if kind == "bf16" else mma.tf32_bits(x)
    return np.asarray(bits, np.uint32).view(np.float32).astype(np.float64)


def _exact(a, b, c, kind):
    return _rounded(a, kind) @ _rounded(b, kind) + np.asarray(c, np.float64)


def _tolerance(a, b, c, kind):
    # products of the rounded inputs are exact in fp32; the sums are fp32 (a few roundings
    # of at most the size of |A||B| + |C|)
    size = np.abs(_rounded(a, kind)) @ np.abs(_rounded(b, kind)) + np.abs(np.asarray(c, np.float64))
    return 8 * np.finfo(np.float32).eps * size + 1e-30


matrices = st.tuples(st.integers(0, 2**32 - 1), st.sampled_from([1e-3, 1.0, 30.0]))


@pytest.mark.parametrize("kind", KINDS)
@given(case=matrices)
def test_mma_computes_a_b_plus_c(kind, case):
    seed, magnitude = case
    rng = np.random.default_rng(seed)
    (ma, ka), (kb, nb) = SHAPES[kind]
    a = rng.standard_normal((ma, ka)).astype(np.float32) * magnitude
    b = rng.standard_normal((kb, nb)).astype(np.float32)
    c = rng.standard_normal((16, 8)).astype(np.float32) * magnitude
    got = _run_mma(mma.fragment_a(a, kind), mma.fragment_b(b, kind), mma.fragment_c(c), kind)
    err = np.abs(got - _exact(a, b, c, kind))
    assert np.all(err <= _tolerance(a, b, c, kind)), (kind, err.max())


@pytest.mark.parametrize("kind", ["f16", "tf32"])
def test_a_mis_mapped_fragment_fails(kind):
    # Swap the two row halves a lane holds of A (rows group and group + 8): a plausible
    # mistake that this comparison must catch.
    rng = np.random.default_rng(7)
    (ma, ka), (kb, nb) = SHAPES[kind]
    a = rng.standard_normal((ma, ka)).astype(np.float32)
    b = rng.standard_normal((kb, nb)).astype(np.float32)
    c = np.zeros((16, 8), np.float32)
    wrong = a.copy()
    wrong[:8], wrong[8:] = a[8:], a[:8]
    fa = mma.fragment_a(wrong, kind)
    got = _run_mma(fa, mma.fragment_b(b, kind), mma.fragment_c(c), kind)
    assert np.any(np.abs(got - _exact(a, b, c, kind)) > 100 * _tolerance(a, b, c, kind))


# --------------------------------------------------------------------------- packing

@cuda.jit
def _pack_kernel(x, out):
    i = cuda.threadIdx.x
    out[i, 0] = mma.pack_f16(x[2 * i], x[2 * i + 1])
    out[i, 1] = mma.pack_bf16(x[2 * i], x[2 * i + 1])
    out[i, 2] = mma.to_tf32(x[2 * i])


finite = st.floats(-6e4, 6e4, width=32, allow_subnormal=False)


@given(st.lists(finite | st.sampled_from([0.0, -0.0, 1.0 + 2**-11, 1.0 + 3 * 2**-11, 3e38, 1e-6]),
                min_size=64, max_size=64))
def test_packing_rounds_like_numpy(values):
    x = np.asarray(values, np.float32)
    out = np.zeros((32, 3), np.uint32)
    _pack_kernel[1, 32](x, out)
    lo, hi = x[0::2], x[1::2]
    np.testing.assert_array_equal(out[:, 0], mma.half_bits(lo) | (mma.half_bits(hi) << 16))
    np.testing.assert_array_equal(out[:, 1], mma.bf16_bits(lo) | (mma.bf16_bits(hi) << 16))
    np.testing.assert_array_equal(out[:, 2], mma.tf32_bits(lo))


@cuda.jit
def _unpack_kernel(words, out):
    """out[i] = unpack_f16(words[i]), then unpack_bf16(words[i])."""
    i = cuda.threadIdx.x
    lo, hi = mma.unpack_f16(words[i])
    out[i, 0] = lo
    out[i, 1] = hi
    lo, hi = mma.unpack_bf16(words[i])
    out[i, 2] = lo
    out[i, 3] = hi


words_32 = st.lists(st.integers(0, 2**32 - 1), min_size=32, max_size=32)


@given(words_32)
def test_unpack_gives_both_halves(words):
    w = np.asarray(words, np.uint32)
    out = np.zeros((32, 4), np.float32)
    _unpack_kernel[1, 32](w, out)
    np.testing.assert_array_equal(out[:, :2], mma.words_to_halves(w).astype(np.float32))


@given(words_32)
def test_unpack_bf16_gives_both_halves_bit_for_bit(words):
    w = np.asarray(words, np.uint32)
    out = np.zeros((32, 4), np.float32)
    _unpack_kernel[1, 32](w, out)
    want = np.stack([(w & 0xFFFF) << 16, w & 0xFFFF0000], axis=1).astype(np.uint32)
    np.testing.assert_array_equal(out[:, 2:].view(np.uint32), want)


def test_tf32_rounds_ties_away_from_zero():
    # 1 + 2^-11 is halfway between two tf32 values (10 mantissa bits): away from zero
    x = np.float32([1 + 2**-11, -(1 + 2**-11), 1 + 2**-12])
    got = mma.tf32_bits(x).view(np.float32)
    np.testing.assert_array_equal(got, np.float32([1 + 2**-10, -(1 + 2**-10), 1.0]))


# --------------------------------------------------------------------------- ldmatrix, cp.async, wide words

@cuda.jit
def _ldmatrix_kernel(src, out, trans):
    lane = cuda.threadIdx.x
    s = cuda.shared.array((16, 16), np.float16)
    for e in range(lane, 256, 32):
        s[e // 16, e % 16] = src[e // 16, e % 16]
    cuda.syncthreads()
    j = lane // 8                     # lane 8 j + r: the address of row r of matrix j
    row = (j % 2) * 8 + lane % 8      # matrices: rows 0-7 / 8-15 (j even / odd) ...
    col = (j // 2) * 8                # ... of columns 0-7 / 8-15 (j < 2 / j >= 2)
    if trans:
        r = mma.ldmatrix_trans(s, row, col)
    else:
        r = mma.ldmatrix(s, row, col)
    for i in range(4):
        out[lane, i] = r[i]


@pytest.mark.parametrize("trans", [False, True])
def test_ldmatrix_gives_the_mma_fragments(trans):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((16, 16)).astype(np.float16)
    out = np.zeros((32, 4), np.uint32)
    _ldmatrix_kernel[1, 32](x, out, trans)
    if trans:    # B operands (k x n) of two n8 tiles, from a row-major (k, n) matrix
        expect = np.concatenate([mma.fragment_b(x[:, :8].astype(np.float32)),
                                 mma.fragment_b(x[:, 8:].astype(np.float32))], axis=1)
    else:        # the A operand, from a row-major 16x16 matrix
        expect = mma.fragment_a(x.astype(np.float32))
    np.testing.assert_array_equal(out, expect)


@cuda.jit
def _ldmatrix_at_kernel(src, out):
    lane = cuda.threadIdx.x
    s = cuda.shared.array((24, 40), np.float16)
    for e in range(lane, 24 * 40, 32):
        s[e // 40, e % 40] = src[e // 40, e % 40]
    cuda.syncthreads()
    j = lane // 8
    row, col = 8 + (j % 2) * 8 + lane % 8, 16 + (j // 2) * 8        # the 16 x 16 block at (8, 16)
    base = mma.shared_address(s, 0, 0)
    a = mma.ldmatrix(s, row, col)
    b = mma.ldmatrix_at(base + (row * 40 + col) * 2)                   # bytes from s[0, 0]
    c = mma.ldmatrix_trans(s, row, col)
    d = mma.ldmatrix_trans_at(mma.shared_address(s, row, 0) + col * 2)
    for i in range(4):
        out[lane, i] = a[i]
        out[lane, 4 + i] = b[i]
        out[lane, 8 + i] = c[i]
        out[lane, 12 + i] = d[i]


def test_ldmatrix_at_a_shared_address_reads_what_ldmatrix_reads():
    x = np.random.default_rng(5).standard_normal((24, 40)).astype(np.float16)
    out = np.zeros((32, 16), np.uint32)
    _ldmatrix_at_kernel[1, 32](x, out)
    np.testing.assert_array_equal(out[:, 4:8], out[:, 0:4])
    np.testing.assert_array_equal(out[:, 12:16], out[:, 8:12])
    np.testing.assert_array_equal(out[:, 0:4], mma.fragment_a(x[8:24, 16:32].astype(np.float32)))


@cuda.jit
def _copy_kernel(src, out):
    t = cuda.threadIdx.x
    s = cuda.shared.array((4, 64), np.float16)
    mma.cp_async(s, t // 8, (t % 8) * 8, src, t // 8, (t % 8) * 8)
    mma.cp_async_commit()
    mma.cp_async_wait_prior()
    mma.cp_async_wait_prior2()
    mma.cp_async_wait_all()
    cuda.syncthreads()
    w = mma.load_words(src, t // 8, (t % 8) * 8)
    for e in range(8):
        out[t // 8, (t % 8) * 8 + e] = s[t // 8, (t % 8) * 8 + e]
    for i in range(4):
        out[4 + t // 8, (t % 8) * 4 + i] = w[i] & 0xFFFF
        out[4 + t // 8, 32 + (t % 8) * 4 + i] = w[i] >> 16
    # cp_async_at: row r of s2 from src's row 3 - r, by addresses; each row's last chunk copies
    # 0 bytes and must leave zeros over the sentinel
    r, c = t // 8, (t % 8) * 8
    s2 = cuda.shared.array((4, 64), np.float16)
    for e in range(8):
        s2[r, c + e] = 7.0
    cuda.syncthreads()
    g = mma.global_address(src, 0, 0) + uint64((3 - r) * src.strides[0] + c * 2)
    mma.cp_async_at(mma.shared_address(s2, r, 0) + uint32(c * 2), g, uint32(0 if t % 8 == 7 else 16))
    mma.cp_async_commit()
    mma.cp_async_wait_all()
    cuda.syncthreads()
    for e in range(8):
        out[8 + r, c + e] = s2[r, c + e]


def test_cp_async_and_wide_words_copy_rows():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, 64)).astype(np.float16)
    out = np.zeros((12, 64), np.float32)
    _copy_kernel[1, 32](x, out)
    expected = x[::-1].astype(np.float32)
    expected[:, 56:] = 0.0
    np.testing.assert_array_equal(out[8:], expected)           # cp_async_at: by address, 0 bytes = zeros
    np.testing.assert_array_equal(out[:4], x.astype(np.float32))
    words = x.view(np.uint32)                             # (4, 32): 2 halves a word
    np.testing.assert_array_equal(out[4:8, :32].reshape(4, 8, 4), (words & 0xFFFF).reshape(4, 8, 4))
    np.testing.assert_array_equal(out[4:8, 32:].reshape(4, 8, 4), (words >> 16).reshape(4, 8, 4))


@cuda.jit
def _word_copy_kernel(src, out):
    # cp_async_word_at: word t of a shared row from src[1, 31 - t]; odd lanes copy 0 bytes and
    # must leave a zero over the sentinel
    t = cuda.threadIdx.x
    s = cuda.shared.array((1, 32), np.float32)
    s[0, t] = 7.0
    cuda.syncthreads()
    live = t % 2 == 0
    g = mma.global_address(src, 1, 31 - t) if live else mma.global_address(src, 0, 0)
    mma.cp_async_word_at(mma.shared_address(s, 0, t), g, uint32(4 if live else 0))
    mma.cp_async_commit()
    mma.cp_async_wait_all()
    cuda.syncthreads()
    out[t] = s[0, t]


def test_cp_async_word_copies_one_word_or_a_zero():
    x = np.random.default_rng(6).standard_normal((2, 32)).astype(np.float32)
    out = np.full(32, np.nan, np.float32)
    _word_copy_kernel[1, 32](x, out)
    expected = x[1, ::-1].copy()
    expected[1::2] = 0.0
    np.testing.assert_array_equal(out, expected)


# --------------------------------------------------------------------------- the PTX

def test_each_function_emits_its_instruction():
    import os
    import subprocess
    import sys

    script = (
        "from kernels.base.ptx_check import answer_sm_90_without_a_driver; answer_sm_90_without_a_driver()\n"
        "import tests.test_mma as t\nfrom numba import cuda\n"
        "ptx = ''\n"
        "for f, sig in [(t._mma_kernel, 'void(uint32[:, ::1], uint32[:, ::1], float32[:, ::1], float32[:, ::1], int64)'),\n"
        "               (t._pack_kernel, 'void(float32[::1], uint32[:, ::1])'),\n"
        "               (t._ldmatrix_kernel, 'void(float16[:, ::1], uint32[:, ::1], boolean)'),\n"
        "               (t._copy_kernel, 'void(float16[:, ::1], float32[:, ::1])'),\n"
        "               (t._word_copy_kernel, 'void(float32[:, ::1], float32[::1])'),\n"
        "               (t._split_kernel, 'void(float32[::1], uint32[:, ::1])'),\n"
        "               (t._split_at_kernel, 'void(float32[::1], uint32[:, ::1])')]:\n"
        "    ptx += cuda.compile_ptx(f.py_func, sig, cc=(9, 0))[0]\n"
        "print(ptx)\n")
    env = dict(os.environ, WORKBOOK_DEVICE="gpu")
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=root, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name, instruction in mma.PTX.items():
        assert instruction in proc.stdout, f"{name}: {instruction} not in the PTX"
