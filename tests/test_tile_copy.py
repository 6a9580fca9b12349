"""The tile copy the tensor-core kernels share (kernels/base/tile_copy.py), on its own.

One block stages rows r0 .. r0 + ROWS - 1 of a (rows, d) array into a shared tile of ROWS x
D (a row padded by 8 words, as the kernels pad theirs) filled first with a sentinel, and
writes the tile out. Wherever the row lies below ``rows`` and the column below d the tile
must hold the array's bits; past them, up to D, zeros; the padding keeps the sentinel.
Both ways are drawn: by column (THREADS a multiple of a row's 16-byte chunks, the tile's
chunks a multiple of THREADS, aligned) and chunk by chunk. The word copy (a query tile's L
and D in chapter 12) likewise: row i's words r0 .. r0 + ROWS - 1, zeros past n.
"""

import functools

import numpy as np
import pytest
from hypothesis import assume, example, given, settings, strategies as st
from numba import cuda, float32, uint16

from kernels.base.testing import gpu_examples
from kernels.base import mma
from kernels.base.inlined import inlined
from kernels.base.runtime import cdiv, on_simulator
from kernels.base.tile_copy import make_async_tile_copy, make_async_word_copy

SIM = on_simulator()
PAD = 8
SENTINEL = 77


@functools.lru_cache(maxsize=None)
def _copy_kernel(ROWS, D, THREADS, itemsize, shifted=False):
    """``shifted``: the copy with ``store_as=_shift`` (test_store_as_converts_only_what_goes_element_by_element)."""
    dtype = uint16 if itemsize == 2 else float32
    stage = make_async_tile_copy(ROWS, D, THREADS, itemsize, dtype if itemsize == 4 else None,
                                 store_as=inlined(_shift) if shifted else None)
    SD = D + PAD

    @cuda.jit
    def copy(src, out, rows, r0, d, aligned):
        tid = cuda.threadIdx.x
        tile = cuda.shared.array((ROWS, SD), dtype)
        for i in range(tid, ROWS * SD, THREADS):
            tile[i // SD, i % SD] = SENTINEL
        cuda.syncthreads()
        stage(src, tile, rows, r0, d, tid, aligned)
        mma.cp_async_commit()
        mma.cp_async_wait_all()
        cuda.syncthreads()
        for i in range(tid, ROWS * SD, THREADS):
            out[i // SD, i % SD] = tile[i // SD, i % SD]

    return copy


def _by_column(ROWS, D, THREADS, itemsize):
    per_row = D // (16 // itemsize)
    return THREADS % per_row == 0 and (ROWS * per_row) % THREADS == 0


@st.composite
def copy_cases(draw):
    itemsize = draw(st.sampled_from([2, 4]))
    E = 16 // itemsize
    d = draw(st.integers(1, 128))
    D = E * cdiv(d, E) + E * draw(st.integers(0, 1))          # D >= d, a multiple of the chunk
    ROWS = draw(st.sampled_from([16, 32, 64] if SIM else [16, 32, 64, 128]))
    THREADS = draw(st.sampled_from([32, 64] if SIM else [64, 128, 256]))
    rows = draw(st.integers(1, 3 * ROWS))
    r0 = ROWS * draw(st.integers(0, (rows - 1) // ROWS))       # a tile that starts inside the array
    aligned = draw(st.booleans()) and d % E == 0
    return itemsize, d, D, ROWS, THREADS, rows, r0, aligned


def _check(itemsize, d, D, ROWS, THREADS, rows, r0, aligned, seed=0):
    rng = np.random.default_rng(seed)
    dtype = np.uint16 if itemsize == 2 else np.float32
    src = (rng.integers(1, 2**16, (rows, d)).astype(np.uint16) if itemsize == 2
           else rng.standard_normal((rows, d)).astype(np.float32))
    out = np.zeros((ROWS, D + PAD), dtype)
    _copy_kernel(ROWS, D, THREADS, itemsize)[1, THREADS](src, out, rows, r0, d, int(aligned))
    expected = np.zeros((ROWS, D + PAD), dtype)
    live = min(ROWS, rows - r0)
    expected[:live, :d] = src[r0:r0 + live]
    expected[:, D:] = SENTINEL
    np.testing.assert_array_equal(out.view(np.uint32 if itemsize == 4 else np.uint16),
                                  expected.view(np.uint32 if itemsize == 4 else np.uint16),
                                  err_msg=f"ROWS={ROWS} D={D} THREADS={THREADS} itemsize={itemsize} rows={rows} "
                                          f"r0={r0} d={d} aligned={aligned} by column="
                                          f"{aligned and _by_column(ROWS, D, THREADS, itemsize)}")


@given(case=copy_cases(), seed=st.integers(0, 2**16))
@settings(max_examples=6 if SIM else gpu_examples(100))
@example(case=(2, 24, 32, 32, 64, 45, 32, True), seed=0)       # by column: 2 chunks a thread, the 4th of a row past d
@example(case=(2, 64, 64, 16, 32, 9, 0, True), seed=1)         # by column, rows past the array's end
@example(case=(4, 20, 24, 16, 32, 40, 32, True), seed=2)       # 32-bit words, chunk by chunk (6 a row)
@example(case=(2, 13, 16, 32, 64, 50, 32, False), seed=3)      # unaligned: element by element at the edges
def test_the_tile_holds_the_rows_and_zeros_past_them(case, seed):
    """Pinned: the by-column way with a chunk past d (d = 24 of D = 32) and with rows past the
    array's end (9 rows into a 16-row tile); 32-bit words chunk by chunk; an unaligned d."""
    itemsize, d, D, ROWS, THREADS, rows, r0, aligned = case
    assume(ROWS * (D + PAD) >= THREADS)
    _check(itemsize, d, D, ROWS, THREADS, rows, r0, aligned, seed)


def test_both_ways_are_pinned():
    """The pinned cases above take both ways of the copy (so neither goes untested)."""
    assert _by_column(32, 32, 64, 2) and _by_column(16, 64, 32, 2)
    assert not _by_column(16, 24, 32, 4)


SHIFT = 1000.0


def _shift(x):
    """A ``store_as`` that shows where it ran: the element plus SHIFT."""
    return x + float32(SHIFT)


@pytest.mark.parametrize("D, aligned", [(32, 1), (32, 0), (24, 1)])
def test_store_as_converts_only_what_goes_element_by_element(D, aligned):
    """``store_as`` (chapter 11's forward stores fp32 elements as 32-bit words) converts each
    element the copy stores one by one, and nothing that goes by 16-byte chunks: aligned rows
    by column move their bits and cp.async zero-fills the rows past the array (D = 32); the
    chunks in turn (6 a row on 32 threads, D = 24) move whole chunks as bits and store the
    rows past the array one by one; unaligned, every element goes one by one."""
    ROWS, THREADS, rows = 16, 32, 10
    by_column = _by_column(ROWS, D, THREADS, 4) and aligned
    assert _by_column(ROWS, D, THREADS, 4) == (D == 32)
    src = np.random.default_rng(0).standard_normal((rows, D)).astype(np.float32)
    out = np.zeros((ROWS, D + PAD), np.float32)
    _copy_kernel(ROWS, D, THREADS, 4, shifted=True)[1, THREADS](src, out, rows, 0, D, aligned)
    expected = np.full((ROWS, D + PAD), SENTINEL, np.float32)
    expected[:rows, :D] = src if aligned else src + np.float32(SHIFT)
    expected[rows:, :D] = 0 if by_column else SHIFT
    np.testing.assert_array_equal(out, expected)


@functools.lru_cache(maxsize=None)
def _word_kernel(ROWS, THREADS):
    stage = make_async_word_copy(ROWS, THREADS)

    @cuda.jit
    def copy(src, i, out, n, r0):
        tid = cuda.threadIdx.x
        row = cuda.shared.array((2, ROWS), float32)
        for r in range(tid, ROWS, THREADS):
            row[0, r] = SENTINEL
            row[1, r] = SENTINEL
        cuda.syncthreads()
        stage(src, i, row, 1, n, r0, tid)
        mma.cp_async_commit()
        mma.cp_async_wait_all()
        cuda.syncthreads()
        for r in range(tid, ROWS, THREADS):
            out[0, r] = row[0, r]
            out[1, r] = row[1, r]

    return copy


@given(ROWS=st.sampled_from([16, 64, 128]), THREADS=st.sampled_from([32, 64, 256]),
       n=st.integers(1, 300), tile=st.integers(0, 4), seed=st.integers(0, 2**16))
@settings(max_examples=6 if SIM else gpu_examples(60))
@example(ROWS=64, THREADS=256, n=70, tile=1, seed=0)           # 6 words live, 58 zeros
def test_the_word_copy_holds_the_row_and_zeros_past_n(ROWS, THREADS, n, tile, seed):
    r0 = ROWS * min(tile, (n - 1) // ROWS)                      # a tile that starts inside the row
    src = np.random.default_rng(seed).standard_normal((3, n)).astype(np.float32)
    src[2, :] = np.nan                                            # the row after must not leak in
    out = np.zeros((2, ROWS), np.float32)
    _word_kernel(ROWS, THREADS)[1, THREADS](src, 1, out, n, r0)
    expected = np.zeros(ROWS, np.float32)
    live = min(ROWS, n - r0)
    expected[:live] = src[1, r0:r0 + live]
    np.testing.assert_array_equal(out[0], np.full(ROWS, SENTINEL, np.float32))    # the other buffer untouched
    np.testing.assert_array_equal(out[1].view(np.uint32), expected.view(np.uint32))
