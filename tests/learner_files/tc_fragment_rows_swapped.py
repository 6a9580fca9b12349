"""A learner's answer to chapter 8's Q-fragment exercise with a mistake: registers a0 and a2
read row group + 8, a1 and a3 row group (the rows of the mapping swapped), so query row i
of a warp is scored with Q's row i + 8 (or i - 8)."""
CHAPTER = "flash_tensor_cores"

from numba import cuda, uint32  # noqa: E402


def make_load_a_fragment():
    @cuda.jit(device=True, inline=True)
    def load_a_fragment(s, row0, col0, lane):
        r = row0 + lane // 4 + 8
        c = col0 + 2 * (lane % 4)
        a0 = uint32(s[r, c]) | (uint32(s[r, c + 1]) << uint32(16))
        a1 = uint32(s[r - 8, c]) | (uint32(s[r - 8, c + 1]) << uint32(16))
        a2 = uint32(s[r, c + 8]) | (uint32(s[r, c + 9]) << uint32(16))
        a3 = uint32(s[r - 8, c + 8]) | (uint32(s[r - 8, c + 9]) << uint32(16))
        return a0, a1, a2, a3

    return load_a_fragment
