"""A learner's answer to chapter 8's P-repacking exercise with a mistake: each register packs
its two keys the wrong way round (pack(hi, lo)), so key 2t + 1's weight multiplies V's row 2t."""
CHAPTER = "flash_tensor_cores"

from numba import cuda  # noqa: E402

from kernels.base.mma import pack_bf16, pack_f16  # noqa: E402


def make_p_to_a(bf16=False):
    pack = pack_bf16 if bf16 else pack_f16

    @cuda.jit(device=True, inline=True)
    def p_to_a(c0, c1):
        return pack(c0[1], c0[0]), pack(c0[3], c0[2]), pack(c1[1], c1[0]), pack(c1[3], c1[2])

    return p_to_a
