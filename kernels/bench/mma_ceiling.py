"""The mma.sync ceiling: how many TFLOP/s this GPU gives ``mma.sync.m16n8k16`` (fp16 or bf16
in, fp32 accumulate) when nothing else runs, measured in the same run as the kernels
that are held against it (chapter 8's bench).

Each warp keeps CHAINS independent accumulators in registers and feeds them the same A
and B fragments, ``steps`` times:

    for s in range(steps):
        C_j = A B + C_j          j = 0 .. CHAINS - 1     (CHAINS mma in flight a warp)

No memory is touched inside the loop; at the end each lane writes the sum of its chains
(so that no chain is dead code). With CHAINS = 8 and BLOCKS_PER_SM blocks of THREADS
threads on every SM (32 warps an SM, all resident at 46 registers a thread), the tensor
cores never wait for a dependency. FLOPs: 2 * 16 * 8 * 16 = 4096 an mma.

Chain j starts at C = j (a constant a chain: identical chains would be merged by the
compiler), so after ``steps`` steps a lane's written sum is sum_j j + CHAINS * steps * A B
at its C positions: exact in float32 for small integer A and B (``expected``).
"""

from __future__ import annotations

import functools

import numpy as np

import kernels  # noqa: F401  (GPU or simulator first)
from numba import cuda, float32  # noqa: E402

from kernels.base.mma import fragment_a, fragment_b, fragment_c
from kernels.base.runtime import on_simulator

CHAINS = 8
THREADS = 256
BLOCKS_PER_SM = 4
STEPS = 8192                    # ~2 ms on an H100 at ~600 TFLOP/s
FLOPS_PER_MMA = 2 * 16 * 8 * 16


@functools.lru_cache(maxsize=None)
def make_mma_loop(bf16: bool = False):
    """The kernel: ``mma_loop[grid, threads](a, b, out, steps)``; a (32, 4) and b (32, 2)
    uint32 (every lane's A and B registers), out (grid * threads, 4) float32."""
    from kernels.base.mma import mma_bf16, mma_f16

    mma = mma_bf16 if bf16 else mma_f16

    @cuda.jit
    def mma_loop(a_words, b_words, out, steps):
        lane = cuda.threadIdx.x % 32
        a = (a_words[lane, 0], a_words[lane, 1], a_words[lane, 2], a_words[lane, 3])
        b = (b_words[lane, 0], b_words[lane, 1])
        c0 = (float32(0), float32(0), float32(0), float32(0))
        c1 = (float32(1), float32(1), float32(1), float32(1))
        c2 = (float32(2), float32(2), float32(2), float32(2))
        c3 = (float32(3), float32(3), float32(3), float32(3))
        c4 = (float32(4), float32(4), float32(4), float32(4))
        c5 = (float32(5), float32(5), float32(5), float32(5))
        c6 = (float32(6), float32(6), float32(6), float32(6))
        c7 = (float32(7), float32(7), float32(7), float32(7))
        for _ in range(steps):
            c0 = mma(a, b, c0)
            c1 = mma(a, b, c1)
            c2 = mma(a, b, c2)
            c3 = mma(a, b, c3)
            c4 = mma(a, b, c4)
            c5 = mma(a, b, c5)
            c6 = mma(a, b, c6)
            c7 = mma(a, b, c7)
        t = cuda.grid(1)
        for i in range(4):
            out[t, i] = c0[i] + c1[i] + c2[i] + c3[i] + c4[i] + c5[i] + c6[i] + c7[i]

    return mma_loop


def operands(seed: int = 0, bf16: bool = False):
    """A (16x16) and B (16x8) with small integer entries (exact in fp16 and bf16, and their
    products' sums exact in float32), and every lane's registers for them."""
    rng = np.random.default_rng(seed)
    a = rng.integers(-2, 3, size=(16, 16)).astype(np.float32)
    b = rng.integers(-2, 3, size=(16, 8)).astype(np.float32)
    kind = "bf16" if bf16 else "f16"
    return a, b, fragment_a(a, kind), fragment_b(b, kind)


def expected(a, b, steps: int) -> np.ndarray:
    """The 16x8 matrix each warp's lanes write: sum_j j + CHAINS * steps * A B."""
    return CHAINS * (CHAINS - 1) / 2 + CHAINS * steps * (a.astype(np.float64) @ b.astype(np.float64))


def launch_shape(simulator: bool | None = None) -> tuple[int, int, int]:
    """(blocks, threads, steps): BLOCKS_PER_SM blocks on every SM, STEPS steps; in the
    simulator one warp, two steps (it only shows that the code runs)."""
    simulator = on_simulator() if simulator is None else simulator
    if simulator:
        return 1, 32, 2
    return BLOCKS_PER_SM * cuda.get_current_device().MULTIPROCESSOR_COUNT, THREADS, STEPS


def ceiling_inputs(bf16: bool = False):
    """(launch, a, b, out, flops, shape): ``launch(a, b, out)`` runs the loop once on device
    arrays a, b, out; ``flops`` is what one launch computes; ``shape`` (blocks, threads, steps)."""
    blocks, threads, steps = shape = launch_shape()
    kernel = make_mma_loop(bool(bf16))
    _, _, fa, fb = operands(bf16=bf16)
    a, b = cuda.to_device(fa), cuda.to_device(fb)
    out = cuda.device_array((blocks * threads, 4), np.float32)

    def launch(a, b, out):
        kernel[blocks, threads](a, b, out, np.int32(steps))

    flops = float(blocks * (threads // 32) * steps * CHAINS * FLOPS_PER_MMA)
    return launch, a, b, out, flops, shape


def check_output(out, bf16: bool = False, steps: int | None = None) -> float:
    """Max |error| of every warp's written sums against ``expected`` (0 when right)."""
    steps = launch_shape()[2] if steps is None else steps
    a, b, _, _ = operands(bf16=bf16)
    want = fragment_c(expected(a, b, steps)).astype(np.float64)           # (32, 4): each lane's share
    out = np.asarray(out.copy_to_host() if hasattr(out, "copy_to_host") else out, np.float64)
    return float(np.max(np.abs(out.reshape(-1, 32, 4) - want)))


def ptx_targets(every_shape: bool = False):
    sig = "void(uint32[:, ::1], uint32[:, ::1], float32[:, ::1], int32)"
    return [(f"mma.sync ceiling loop {'bf16' if bf16 else 'fp16'}", make_mma_loop(bf16), sig)
            for bf16 in ((False, True) if every_shape else (False,))]
