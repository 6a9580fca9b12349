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
def _copy_kernel(ROWS, D, THREADS, itemsize, marked=False):
    """``marked``: the copy with ``in_turn=_mark`` (test_in_turn_takes_what_the_column_way_does_not)."""
    dtype = uint16 if itemsize == 2 else float32
    stage = make_async_tile_copy(ROWS, D, THREADS, itemsize, dtype if itemsize == 4 else None,
                                 in_turn=inlined(_mark) if marked else None)
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


MARK = -5.0


def _mark(src, dst, rows, r0, d, tid, aligned):
    """An ``in_turn`` that copies nothing: it only writes MARK at the tile's corner."""
    if tid == 0:
        dst[0, 0] = float32(MARK)


@pytest.mark.parametrize("D, aligned, by_column", [(32, 1, True), (32, 0, False), (24, 1, False)])
def test_in_turn_takes_what_the_column_way_does_not(D, aligned, by_column):
    """``in_turn`` (chapter 11's forward passes its own loop) runs exactly where the column way
    does not: unaligned, or a row's chunks not dividing the threads (6 of 32); aligned rows by
    column never reach it."""
    ROWS, THREADS = 16, 32
    assert _by_column(ROWS, D, THREADS, 4) == (D == 32)
    src = np.random.default_rng(0).standard_normal((ROWS, D)).astype(np.float32)
    out = np.zeros((ROWS, D + PAD), np.float32)
    _copy_kernel(ROWS, D, THREADS, 4, marked=True)[1, THREADS](src, out, ROWS, 0, D, aligned)
    expected = np.full((ROWS, D + PAD), SENTINEL, np.float32)
    if by_column:
        expected[:, :D] = src
    else:
        expected[0, 0] = MARK
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
