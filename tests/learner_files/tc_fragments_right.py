"""A learner's answer to chapter 8's two fragment exercises: Q's A fragment read element by
element by the PTX mapping (no ldmatrix), and P's accumulator tiles packed as P V's A."""
CHAPTER = "flash_tensor_cores"

from numba import cuda, uint32  # noqa: E402

from kernels.base.mma import pack_bf16, pack_f16  # noqa: E402


def make_load_a_fragment():
    @cuda.jit(device=True, inline=True)
    def load_a_fragment(s, row0, col0, lane):
        r = row0 + lane // 4                  # row group; group + 8 below it
        c = col0 + 2 * (lane % 4)             # col 2t; 2t + 8 to the right
        a0 = uint32(s[r, c]) | (uint32(s[r, c + 1]) << uint32(16))
        a1 = uint32(s[r + 8, c]) | (uint32(s[r + 8, c + 1]) << uint32(16))
        a2 = uint32(s[r, c + 8]) | (uint32(s[r, c + 9]) << uint32(16))
        a3 = uint32(s[r + 8, c + 8]) | (uint32(s[r + 8, c + 9]) << uint32(16))
        return a0, a1, a2, a3

    return load_a_fragment


def make_p_to_a(bf16=False):
    pack = pack_bf16 if bf16 else pack_f16

    @cuda.jit(device=True, inline=True)
    def p_to_a(c0, c1):
        return pack(c0[0], c0[1]), pack(c0[2], c0[3]), pack(c1[0], c1[1]), pack(c1[2], c1[3])

    return p_to_a
