"""A learner's answer to chapter 8's P-repacking exercise with a mistake: the two accumulator
tiles in the wrong order (a0, a1 from tile 2 kp + 1), so keys 0-7 weigh V's rows 8-15."""
CHAPTER = "flash_tensor_cores"

from numba import cuda  # noqa: E402

from kernels.base.mma import pack_bf16, pack_f16  # noqa: E402


def make_p_to_a(bf16=False):
    pack = pack_bf16 if bf16 else pack_f16

    @cuda.jit(device=True, inline=True)
    def p_to_a(c0, c1):
        return pack(c1[0], c1[1]), pack(c1[2], c1[3]), pack(c0[0], c0[1]), pack(c0[2], c0[3])

    return p_to_a
