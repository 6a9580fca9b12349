"""A learner's answer to chapter 6's kept-tile lists with a mistake: causal drops a tile
when its first key is past the diagonal of the tile's FIRST query row, not its last, so a
tile that the later rows of the query tile may partly see is lost (when Br != Bc, or when
Nk - Nq is not a multiple of the tiles)."""
CHAPTER = "block_sparse"

from numba import cuda  # noqa: E402


def make_first_tile_lists():
    @cuda.jit
    def first_tile_lists_kernel(flags, col_idx, count, Br, Bc, block_q, block_k, nq, nk, causal):
        t = cuda.grid(1)
        groups, tr, tc = col_idx.shape
        if t >= groups * tr:
            return
        g, r = t // tr, t % tr
        first_q = r * Br
        n = 0
        for c in range(tc):
            if causal and c * Bc > first_q + nk - nq:
                break
            if flags[g, r * Br // block_q, c * Bc // block_k]:
                col_idx[g, r, n] = c
                n += 1
        count[g, r] = n
    return first_tile_lists_kernel
