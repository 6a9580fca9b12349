"""Rows of a tile from global to shared memory by cp.async, as the tensor-core kernels stage them.

Chapter 8's forward (K_j, V_j and Q_i) and chapter 12's backward (K_j, V_j, Q_i and dO_i)
copy 16-bit tiles the same way (chapter 11's fp32 backward, 32-bit ones), in 16-byte
chunks that land later, after the kernel's commit and wait (``kernels.base.mma``), with
zeros past the last row and past the head dim d, so that padded rows and the columns from d
to D add nothing to the products. Two ways:

- by column, where the block's threads are a multiple of a row's chunks and the rows are
  aligned: a thread's chunks lie in one column, a fixed number of rows apart, so it makes
  its shared and global addresses once and adds a constant a chunk (``cp_async_at``); a
  chunk past the rows or d copies 0 bytes and cp.async fills its 16 with zeros;
- otherwise, chunk by chunk in turn: a chunk wholly inside the array by ``cp_async``, one
  that crosses the last row or d element by element.

A row of 4-byte words (a query tile's L and D in chapter 12's backward) goes by
``make_async_word_copy``: one cp.async of 4 bytes a word, zeros past the last element.

(Chapter 11's forward lands fp32 rows in a tile of 32-bit words: ``store_as`` converts each
element the element-by-element copy stores, ``word_of_float`` there.)
"""

from __future__ import annotations

from numba import uint16, uint32, uint64

from kernels.base.inlined import inlined

__all__ = ["make_async_tile_copy", "make_async_word_copy"]


def make_async_tile_copy(ROWS: int, D: int, THREADS: int, itemsize: int = 2, dtype=None, store_as=None):
    """Device function ``stage_in(src, dst, rows, r0, d, tid, aligned)``: src[r0 + r, :d] ->
    dst[r, :D] for r < ROWS (zeros past ``rows`` and d), 16 bytes a step, by the block's
    THREADS threads (``tid``: the caller's thread); ``dtype``: the arrays' element type (by
    default 16- or 32-bit unsigned words, as ``itemsize`` says). ``aligned`` (0/1): the rows are 16-byte
    aligned and d a multiple of 16 / itemsize, so that whole chunks may go by cp.async.

    Where THREADS is a multiple of a row's chunks (D / E) and the tile's chunks a multiple of
    THREADS, a thread's chunks lie in one column, THREADS / (D / E) rows apart: an aligned
    tile then goes by addresses made once, a constant added a chunk (``cp_async_at``), and the
    chunks past ``rows`` or d copy 0 bytes and fill zeros (cp.async's source size): no test
    and no 64-bit index arithmetic a chunk, where indexing the arrays costs some fifty
    instructions a chunk (signed 64-bit arithmetic with Python's negative-index wraparound).
    Otherwise (and unaligned) the chunks go in turn, as the kernels first had it (``D // E``
    and all: a variant with the chunk count precomputed compiles chapter 8's kernel to 8%
    more PTX). ``store_as``: a device function applied to each element that copy stores,
    where the tile holds another type than the source (``dtype`` is then the source's); the
    16-byte chunks move bits as they are."""
    from kernels.base.mma import cp_async, cp_async_at, global_address, shared_address

    E = 16 // itemsize                   # elements a chunk
    zero = dtype if dtype is not None else uint16 if itemsize == 2 else uint32
    if D % E:
        raise ValueError(f"D: expected a multiple of {E} (16-byte chunks of {itemsize}-byte words), got {D}")
    CPR = D // E                         # chunks a row
    COLUMN = THREADS % CPR == 0 and (ROWS * CPR) % THREADS == 0
    RS = THREADS // CPR                  # rows between a thread's chunks
    PER = ROWS * CPR // THREADS          # a thread's chunks

    @inlined
    def stage_in(src, dst, rows, r0, d, tid, aligned):
        if COLUMN and aligned != 0:
            r = tid // CPR
            c = (tid % CPR) * E
            sa = shared_address(dst, r, c)
            sstep = uint32(RS * dst.strides[0])
            ga = global_address(src, r0 + r, c)       # a number until a chunk's row is below rows
            g0 = global_address(src, 0, 0)            # a valid address for the chunks that copy 0 bytes
            gstep = uint64(RS * src.strides[0])
            for k in range(PER):
                live = c < d and r0 + r + k * RS < rows
                cp_async_at(sa + uint32(k) * sstep, ga + uint64(k) * gstep if live else g0, uint32(16 if live else 0))
        else:
            for ch in range(tid, ROWS * (D // E), THREADS):
                r = ch // (D // E)
                c = (ch % (D // E)) * E
                row = r0 + r
                if aligned != 0 and row < rows and c + E <= d:
                    cp_async(dst, r, c, src, row, c)
                else:
                    for e in range(E):
                        x = zero(0)
                        if row < rows and c + e < d:
                            x = src[row, c + e]
                        if store_as is None:
                            dst[r, c + e] = x
                        else:
                            dst[r, c + e] = store_as(x)

    return stage_in


def make_async_word_copy(ROWS: int, THREADS: int):
    """Device function ``stage_words(src, i, dst, j, n, r0, tid)``: src[i, r0 + r] -> dst[j, r]
    for r < ROWS, 4-byte words (float32), one cp.async each by the block's first ROWS threads
    (of THREADS), a zero where r0 + r >= n. Like the tiles, the words land after the kernel's
    commit and wait: a thread that loads them itself waits for global memory right there
    (chapter 12's backward measured that wait, and the barrier the other warps then wait at)."""
    from kernels.base.mma import cp_async_word_at, global_address, shared_address

    @inlined
    def stage_words(src, i, dst, j, n, r0, tid):
        g0 = global_address(src, i, 0)                # a valid address for the words that copy 0 bytes
        for r in range(tid, ROWS, THREADS):
            live = r0 + r < n
            cp_async_word_at(shared_address(dst, j, r), global_address(src, i, r0 + r) if live else g0,
                             uint32(4 if live else 0))

    return stage_words
