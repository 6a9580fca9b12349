"""Tensor cores: the FlashAttention-2 forward with its two products on mma.sync (fp16 or bf16 in).

Chapter 4's loops, the products moved from the FMA units to the tensor cores
(``kernels.base.mma``: mma.sync m16n8k16, fp16 or bf16 in, fp32 accumulate):

    one block          Br = 16 W query rows of one (batch, head), W warps (128 rows on a GPU)
    one warp           16 query rows: Q_i's A fragments stay in its registers
    for each K/V tile (Bc keys, staged in shared memory by cp.async: K_j is copied while
    the warps compute P V_{j-1}, V_j while they compute S_j, so copies hide behind mma):
        S    = Q_i K_j^T           Bc/8 accumulator tiles (16 x 8), D/16 mma each; K_j's B
                                   fragments by ldmatrix (K is row-major: B = K^T is "col")
        m'   = max(m, rowmax S)    a lane holds 2 scores a row a tile: the row's max is
                                   over the 4 lanes of a quad (2 shuffles)
        P    = exp2(S - m')        in the accumulator registers
        l, O rescaled by exp2(m - m'), l += rowsum P (per lane; the quad adds at the end)
        O   += P V_j               P's accumulator tiles sit exactly where an m16k16 A operand
                                   needs them: packed to fp16/bf16 in registers, no shared
                                   memory; V_j's B fragments by ldmatrix.trans
    O / l and L = m + log l, as in chapter 4.

Inputs are fp16, or bf16 (``bf16=True``: PyTorch bf16 tensors, or their 16-bit patterns
as uint16 arrays, since NumPy has no bf16); the kernel reads 16-bit patterns. The head dim
is padded to D, a multiple of 16 (zeros past d). Causal masking skips the K/V tiles past
the block's last row, and only a tile that crosses a warp's diagonal (or the end of K)
pays for the mask, element by element; a row that sees no key gets O = 0 and
L = -inf. Scores are in base 2 (scale log2 e folded in), as in chapter 4.

Precision: P is rounded to the input type before P V, as in FlashAttention-2; the tests
hold the error to 2x that of a float32 reference that rounds P the same way.

The kernel exercises (``EXERCISES``) are the kernel's two fragment steps, as hooks a
learner may fill: Q_i's A fragments (``make_load_a_fragment``) and P repacked as P V's A
operand (``make_p_to_a``); ``a_fragment_registers`` and ``p_to_a_registers`` run each on
one warp and return every lane's registers.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda, float32, int32, uint16, uint32

from kernels.base.fragment_softmax import make_fragment_softmax
from kernels.base.inlined import inlined
from kernels.base.tile_copy import make_async_tile_copy
from kernels.base.fused import LOG2E, MASKED, MAX_GRID_Y
from kernels.base.key_split import add_combine, choose_splits, output_names, partial_views, partials
from kernels.base.runtime import ArrayKind, Bf16Bits, BoundLaunches, array_dtype, LaunchCache, cdiv, check_flag, check_qkv, \
    check_scale, device_bits16, as_bits16, given_out, is_bf16_array, is_device_array, on_simulator, run_bound, to_device

__all__ = ["flash_attention_tc", "make_flash_forward_mma", "make_flash_forward_mma_from", "make_load_a_fragment",
           "make_p_to_a", "a_fragment_registers", "p_to_a_registers", "tc_tiles", "ptx_targets", "EXERCISES"]

def tc_tiles(d: int) -> tuple[int, int, int]:
    """(Br, Bc, D), D = d rounded up to a multiple of 16. On a GPU 128 query rows (8 warps)
    and 64 keys a tile: each K/V tile then serves twice the rows of Br = 64. Measured on the
    H100 at B=4 H=16 N=4096, fp16, bare launches (workbook/results/TUNING.md): d = 128,
    174 against 131 TFLOP/s; d = 64 (with 128 registers a thread, two blocks an SM), 162
    against 143. In the simulator 16 keys and 16 or 32 rows (both code paths)."""
    D = 16 * cdiv(max(int(d), 1), 16)
    if on_simulator():
        return (16 if D <= 16 else 32), 16, D
    return 128, 64, D


# --------------------------------------------------------------------------- the two fragment hooks
# The kernel's two steps where a lane must know which elements it holds (the notebook's
# kernel exercises, ``EXERCISES``): Q's A fragments, and P repacked as P V's A operand. A
# learner's factory of the same name replaces the course's (``kernels.base.learner``);
# ``make_flash_forward_mma`` looks both up when it is called.

def make_load_a_fragment():
    """Device function ``load_a_fragment(s, row0, col0, lane) -> (a0, a1, a2, a3)``: the
    A fragment (``kernels.base.mma.a_position``) of the 16 x 16 block A = s[row0:row0 + 16,
    col0:col0 + 16] of a shared uint16 array, as lane ``lane`` (= 4 group + t) holds it:
    a0 = A[group, 2t .. 2t+1], a1 = A[group + 8, 2t .. 2t+1], a2 = A[group, 2t+8 .. 2t+9],
    a3 = A[group + 8, 2t+8 .. 2t+9], the lower column in the low 16 bits. The kernel loads
    Q_i's fragments with it, one k-step (16 columns of d) at a time.

    The course's answer: one ``ldmatrix .x4``, whose four 8 x 8 matrices are a0 .. a3. Lane
    8 j + r gives the address of row r of matrix j, and each lane receives, of each matrix,
    row group, columns 2t and 2t + 1: the A mapping, done by the hardware."""
    from kernels.base.mma import ldmatrix

    @inlined
    def load_a_fragment(s, row0, col0, lane):
        # matrices j = 0..3 at (rows +0, cols +0), (+8, +0), (+0, +8), (+8, +8)
        return ldmatrix(s, row0 + (lane // 8) % 2 * 8 + lane % 8, col0 + (lane // 16) * 8)

    return load_a_fragment


def make_p_to_a(bf16: bool = False):
    """Device function ``p_to_a(c0, c1) -> (a0, a1, a2, a3)``: P's two accumulator tiles of
    16 x 8 (keys 0-7 and 8-15 of a 16-key step; a lane's 4 floats of each, c[i] = P[group +
    8 (i // 2), 2t + i % 2]) as the A fragment of P V's mma, packed to fp16 (bf16 if
    ``bf16``): a0 = P[group, 2t .. 2t+1] and a1 = P[group + 8, 2t .. 2t+1] from c0, a2 and
    a3 the same rows, keys 8 + 2t .. 8 + 2t + 1, from c1; the lower key in the low 16 bits.
    Every element is already in the lane that needs it: no shuffle, no shared memory."""
    from kernels.base.mma import pack_bf16, pack_f16

    pack = pack_bf16 if bf16 else pack_f16

    @inlined
    def p_to_a(c0, c1):
        return (pack(c0[0], c0[1]), pack(c0[2], c0[3]), pack(c1[0], c1[1]), pack(c1[2], c1[3]))

    return p_to_a


EXERCISES = {"make_load_a_fragment": "test_load_a_fragment or test_pinned_cases or test_bf16_pinned_causal_case",
             "make_p_to_a": "test_p_to_a or test_pinned_cases or test_bf16_pinned_causal_case"}


def make_flash_forward_mma(Br: int, Bc: int, D: int, bf16: bool = False, split: bool = False, o16: bool = False,
                           grouped: bool = False):
    """The forward kernel (``make_flash_forward_mma_from``) with the module's two fragment
    hooks as they are now: a learner's ``make_load_a_fragment`` or ``make_p_to_a`` put in
    their place gets its own kernel, never the course's cached one."""
    return make_flash_forward_mma_from(Br, Bc, D, bool(bf16), make_load_a_fragment, make_p_to_a, bool(split),
                                       bool(o16), bool(grouped))


@functools.lru_cache(maxsize=None)
def make_flash_forward_mma_from(Br: int, Bc: int, D: int, bf16: bool, a_fragment_factory, p_to_a_factory,
                                split: bool = False, o16: bool = False, grouped: bool = False):
    """The forward kernel for Br query rows (Br / 16 warps), Bc keys a tile, head dim D, Q's
    A fragments loaded by ``a_fragment_factory()`` and P repacked by ``p_to_a_factory(bf16)``.

    Launch: grid (ceil(Nq / Br), B*H), 2 Br threads (Br = Bc or 2 Bc: Q is staged through
    the K and V buffers). Arguments: q (B*H, Nq, d), k and v
    (B*Hkv, Nk, d) uint16 (fp16 or bf16 bits); o (B*H, Nq, d) and lse (B*H, Nq) float32;
    scale (float32), causal (int32 0/1), kv_group (int32: H / Hkv, query heads a KV head;
    query head row bh = b H + h reads KV row bh // kv_group = b Hkv + h // kv_group: grouped-query
    attention with no copy of K and V; read only by the ``grouped`` kernel, which the launcher
    takes where Hkv < H, so that the MHA kernel's code is the one measured before), aligned (int32: rows 16-byte aligned, d % 8 == 0,
    so whole 16-byte chunks go by cp.async). ``split``: the keys split among gridDim.z
    blocks (``kernels.base.key_split``), each writing its partial O and L to row
    blockIdx.z * B*H + bh of o (S*B*H, Nq, d) and lse (S*B*H, Nq). ``o16`` (unsplit): O
    written in the inputs' type, o (B*H, Nq, d) uint16, each value rounded once to nearest
    even (what a float32 O cast after would hold, without the cast)."""
    from kernels.base.key_split import split_range
    from kernels.base.mma import (cp_async_commit, cp_async_wait_all, cp_async_wait_prior, ldmatrix,
                                  ldmatrix_trans, mma_bf16, mma_f16)

    mma = mma_bf16 if bf16 else mma_f16
    load_a_fragment = a_fragment_factory()
    p_to_a = p_to_a_factory(bf16)
    W = Br // 16
    THREADS = 32 * W
    GROUPED = bool(grouped)
    KS, NS, KP, ND = D // 16, Bc // 8, Bc // 16, D // 8
    SD = D + 8                                    # shared row stride (halves): ldmatrix rows in distinct banks
    o_type = ("bf16" if bf16 else "f16") if o16 and not split else None
    scale_and_mask, online_softmax, write_rows = make_fragment_softmax(NS, ND, THREADS, o_type)
    if Br not in (Bc, 2 * Bc):
        raise ValueError("tiles: the Q tile is staged through the K and V buffers: Br must be Bc or 2 Bc")

    stage_in = make_async_tile_copy(Bc, D, THREADS)         # src[r0 + r, :d] -> dst[r, :D], r < Bc

    # At D <= 64 and 8 warps, 128 registers a thread (from 160, a few spilled) let two
    # blocks share an SM: measured 1.2x faster on the H100 (workbook/results/TUNING.md).
    registers = {"max_registers": 128} if D <= 64 and Br >= 128 and not on_simulator() else {}

    @cuda.jit(fastmath=True, **registers)
    def flash_forward_mma(q, k, v, o, lse, scale, causal, kv_group, aligned):
        bh = int32(cuda.blockIdx.y)
        tid = int32(cuda.threadIdx.x)
        warp = tid // 32
        lane = tid % 32
        group = lane // 4
        t = lane % 4
        q0 = (int32(cuda.gridDim.x) - 1 - int32(cuda.blockIdx.x)) * Br     # heaviest causal tiles first
        kvh = bh
        if GROUPED:      # this query head's KV head: a 32-bit unsigned division (// on Numba's int32
            kvh = int32(uint32(bh) // uint32(kv_group))     # is a signed 64-bit one, about 100 instructions)
        qh, kh, vh = q[bh], k[kvh], v[kvh]
        n_q, n_k, d = int32(q.shape[1]), int32(k.shape[1]), int32(q.shape[2])
        Ks = cuda.shared.array((Bc, SD), uint16, alignment=16)
        Vs = cuda.shared.array((Bc, SD), uint16, alignment=16)
        # ldmatrix .x4: lane 8 j + r names row r of 8x8 matrix j.
        ar = (lane // 8) % 2 * 8 + lane % 8          # A, and B by .trans: matrices rows +0/+8, then cols +0/+8
        ac = (lane // 16) * 8
        kr = (lane // 16) * 8 + lane % 8             # B = K^T from K's rows: keys +0/+8, dims +0/+8 first
        kc = (lane // 8) % 2 * 8

        # ---- Q_i: staged through Ks (and Vs, for Br = 2 Bc), then each warp's A fragments
        stage_in(qh, Ks, n_q, q0, d, tid, aligned)
        if Br > Bc:
            stage_in(qh, Vs, n_q, q0 + Bc, d, tid, aligned)
        cp_async_commit()
        cp_async_wait_all()
        cuda.syncthreads()
        qf = cuda.local.array((KS, 4), uint32)
        r0 = (warp * 16) % Bc
        for s_ in range(KS):
            if warp * 16 < Bc:
                x = load_a_fragment(Ks, r0, s_ * 16, lane)
            else:
                x = load_a_fragment(Vs, r0, s_ * 16, lane)
            for e in range(4):
                qf[s_, e] = x[e]

        m = cuda.local.array(2, float32)             # running max (base 2), rows group, group + 8
        l = cuda.local.array(2, float32)             # this lane's share of the running sums
        acc = cuda.local.array((ND, 4), float32)     # O: ND accumulator tiles of 16 x 8
        sc = cuda.local.array((NS, 4), float32)      # S, then P: NS accumulator tiles
        for h in range(2):
            m[h] = MASKED
            l[h] = float32(0.0)
        for j in range(ND):
            for e in range(4):
                acc[j, e] = float32(0.0)
        scale2 = float32(scale * LOG2E)
        diag = n_k - n_q
        kv_end = n_k                                 # causal: the keys the block's last row sees
        if causal != 0:
            kv_end = min(n_k, q0 + Br + diag)
        n_tiles = (max(kv_end, 0) + Bc - 1) // Bc
        first, end, out = 0, n_tiles, bh             # the key tiles walked, the row of O and L written
        if split:
            first, end, out = split_range(n_tiles, bh)
        wrow0 = q0 + warp * 16                       # this warp's first query row

        # ---- the copies overlap the products: K_j flies during P V_{j-1}, V_j during S_j
        cuda.syncthreads()                           # Q is in registers: Ks and Vs are free
        if end > first:
            stage_in(kh, Ks, n_k, first * Bc, d, tid, aligned)
        cp_async_commit()
        for jt in range(first, end):
            k0 = jt * Bc
            cuda.syncthreads()                       # every warp is done with V_{j-1}
            stage_in(vh, Vs, n_k, k0, d, tid, aligned)
            cp_async_commit()
            cp_async_wait_prior()                    # K_j has landed (V_j may still fly)
            cuda.syncthreads()

            # ---- S = Q_i K_j^T: NS tiles of 16 x 8, scaled to base 2, masked
            for nt2 in range(NS // 2):
                c0 = (float32(0.0), float32(0.0), float32(0.0), float32(0.0))
                c1 = (float32(0.0), float32(0.0), float32(0.0), float32(0.0))
                for s_ in range(KS):
                    x = ldmatrix(Ks, nt2 * 16 + kr, s_ * 16 + kc)
                    a = (qf[s_, 0], qf[s_, 1], qf[s_, 2], qf[s_, 3])
                    c0 = mma(a, (x[0], x[1]), c0)
                    c1 = mma(a, (x[2], x[3]), c1)
                for e in range(4):
                    sc[2 * nt2, e] = c0[e]
                    sc[2 * nt2 + 1, e] = c1[e]
            scale_and_mask(sc, k0, wrow0, group, t, n_k, diag, causal, scale2)
            online_softmax(sc, acc, m, l)           # P in sc; O and l rescaled

            cp_async_wait_all()                      # V_j has landed ...
            cuda.syncthreads()                       # ... and every warp is done with K_j
            if jt + 1 < end:
                stage_in(kh, Ks, n_k, k0 + Bc, d, tid, aligned)
            cp_async_commit()

            # ---- O += P V_j: P's tiles 2 kp, 2 kp + 1 are one A fragment (packed in registers)
            for kp in range(KP):
                a = p_to_a((sc[2 * kp, 0], sc[2 * kp, 1], sc[2 * kp, 2], sc[2 * kp, 3]),
                           (sc[2 * kp + 1, 0], sc[2 * kp + 1, 1], sc[2 * kp + 1, 2], sc[2 * kp + 1, 3]))
                for dt in range(ND // 2):
                    x = ldmatrix_trans(Vs, kp * 16 + ar, dt * 16 + ac)
                    c0 = mma(a, (x[0], x[1]), (acc[2 * dt, 0], acc[2 * dt, 1], acc[2 * dt, 2], acc[2 * dt, 3]))
                    c1 = mma(a, (x[2], x[3]),
                             (acc[2 * dt + 1, 0], acc[2 * dt + 1, 1], acc[2 * dt + 1, 2], acc[2 * dt + 1, 3]))
                    for e in range(4):
                        acc[2 * dt, e] = c0[e]
                        acc[2 * dt + 1, e] = c1[e]

        cp_async_wait_all()                          # (the last, empty, group)

        write_rows(acc, m, l, o, lse, out, wrow0, group, t, n_q, d)    # O / l and L

    flash_forward_mma.threads = THREADS
    return flash_forward_mma


# --------------------------------------------------------------------------- the hooks on their own
# One warp runs a hook on values you give it and returns every lane's registers: what the
# tests check against the PTX mapping (and a learner can print).

PROBE_TILE = (32, 40)                 # the probe's shared tile: the kernel's (Bc, D + 8) at Bc = D = 32


@functools.lru_cache(maxsize=None)
def _a_fragment_probe(a_fragment_factory):
    load_a_fragment = a_fragment_factory()
    R, C = PROBE_TILE

    @cuda.jit
    def probe(tile, row0, col0, out):
        lane = int32(cuda.threadIdx.x)
        s = cuda.shared.array(PROBE_TILE, uint16, alignment=16)
        for e in range(lane, R * C, 32):
            s[e // C, e % C] = tile[e // C, e % C]
        cuda.syncthreads()
        x = load_a_fragment(s, row0, col0, lane)
        for i in range(4):
            out[lane, i] = x[i]

    return probe


@functools.lru_cache(maxsize=None)
def _p_to_a_probe(p_to_a_factory, bf16):
    p_to_a = p_to_a_factory(bf16)

    @cuda.jit
    def probe(p, out):
        lane = int32(cuda.threadIdx.x)
        x = p_to_a((p[lane, 0], p[lane, 1], p[lane, 2], p[lane, 3]), (p[lane, 4], p[lane, 5], p[lane, 6], p[lane, 7]))
        for i in range(4):
            out[lane, i] = x[i]

    return probe


def a_fragment_registers(tile, row0: int, col0: int) -> np.ndarray:
    """Every lane's (a0, a1, a2, a3) from the module's ``make_load_a_fragment`` (as it is
    now) on the 16 x 16 block at (row0, col0) of ``tile``, a uint16 array of PROBE_TILE's
    shape staged in shared memory: (32, 4) uint32."""
    tile = np.ascontiguousarray(tile)
    if tile.dtype != np.uint16 or tile.shape != PROBE_TILE:
        raise ValueError(f"tile: expected a uint16 array of shape {PROBE_TILE}, got {tile.dtype} {tile.shape}")
    if not (0 <= row0 <= PROBE_TILE[0] - 16 and 0 <= col0 <= PROBE_TILE[1] - 16 and col0 % 8 == 0):
        raise ValueError(f"row0, col0: expected a 16 x 16 block inside the tile, col0 a multiple of 8; got {row0}, {col0}")
    out = cuda.to_device(np.zeros((32, 4), np.uint32))
    _a_fragment_probe(make_load_a_fragment)[1, 32](cuda.to_device(tile), np.int32(row0), np.int32(col0), out)
    return out.copy_to_host()


def p_to_a_registers(p, bf16: bool = False) -> np.ndarray:
    """Every lane's (a0, a1, a2, a3) from the module's ``make_p_to_a`` (as it is now): p
    (32, 8) float32, lane l's c[0..3] of the first accumulator tile then of the second.
    (32, 4) uint32."""
    p = np.ascontiguousarray(p, dtype=np.float32)
    if p.shape != (32, 8):
        raise ValueError(f"p: expected shape (32, 8) (a lane's 4 floats of each of two tiles), got {p.shape}")
    out = cuda.to_device(np.zeros((32, 4), np.uint32))
    _p_to_a_probe(make_p_to_a, check_flag(bf16, "bf16"))[1, 32](cuda.to_device(p), out)
    return out.copy_to_host()


# --------------------------------------------------------------------------- the launcher

def flash_attention_tc(q, k, v, *, causal=False, scale=None, bf16=False):
    """Attention forward on tensor cores. q (B, H, Nq, d), k and v (B, Hkv, Nk, d) with H a
    multiple of Hkv (grouped-query attention: query head h reads KV head h // (H / Hkv), with
    no copy), d <= 128: float16 arrays; with ``bf16=True``, bfloat16 device arrays (PyTorch bf16 CUDA tensors)
    or uint16 arrays of bf16 bit patterns (NumPy has no bf16). Returns
    (o, lse): o (B, H, Nq, d) float32 and lse (B, H, Nq) float32 (natural log; -inf for a
    row that sees no key). NumPy in, NumPy out; device arrays in, device arrays out."""
    bf16 = check_flag(bf16, "bf16")
    want = np.uint16 if bf16 else np.float16
    kind = ArrayKind(q)
    given = (q, k, v)
    for x, name in zip(given, "qkv"):
        if is_bf16_array(x) and not bf16:
            raise TypeError(f"{name}: a bfloat16 array: pass bf16=True (or fp16 inputs)")
    q, k, v = (Bf16Bits(x) if is_bf16_array(x) else x for x in given)     # bf16 tensors: their bits
    B, H, n_q, _, d, _ = check_qkv(q, k, v, dtypes=(want,), grouped=True)
    causal = check_flag(causal, "causal")
    scale = check_scale(scale, d)
    BH = B * H
    if BH > MAX_GRID_Y:
        raise ValueError(f"q: expected B*H <= {MAX_GRID_Y} (one grid row a head), got B={B}, H={H}")
    inputs = {name: x if is_device_array(x) or not (BH and n_q) else to_device(x, name)
              for name, x in zip("qkv", (q, k, v))}
    o, lse = forward_checked(kind, inputs["q"], inputs["k"], inputs["v"], causal=causal, scale=scale, bf16=bf16)
    return kind.result(o), kind.result(lse)


_launches = LaunchCache()          # the launcher's bound launches, by call shape


def forward_checked(kind, q, k, v, *, causal, scale, bf16, splits=None, o=None, lse=None):
    """What ``flash_attention_tc`` runs once its checks pass, for callers that made them
    (chapter 13's drop-in checks its tensors once): q (B, H, Nq, d), k, v (B, Hkv, Nk, d), H a
    multiple of Hkv, C-contiguous 16-bit device arrays (PyTorch fp16/bf16 tensors as they are), ``scale`` a
    float. (o, lse) float32 from ``kind``'s allocator (an ``ArrayKind``). ``splits``: the
    keys split among that many blocks a query tile, their partials merged after
    (``kernels.base.key_split``); None: split only where the grid would not fill the GPU.
    ``o``: a C-contiguous array like q, of q's 16-bit type, for O in that type (rounded
    once, in the kernel: no float32 O, no cast after); it is the o returned. ``lse``: a
    float32 array (B, H, Nq) to write L into, returned, instead of one from ``kind``."""
    B, H, n_q, d = q.shape
    hkv, n_k = k.shape[1], k.shape[2]
    o16 = o is not None
    if o16:
        if tuple(o.shape) != (B, H, n_q, d) or array_dtype(o).itemsize != 2:
            raise ValueError(f"o: expected a 16-bit array of q's shape {(B, H, n_q, d)}, got {array_dtype(o)} "
                             f"{tuple(o.shape)}")
    else:
        o = kind.new((B, H, n_q, d), np.float32)       # the caller's allocator where it has one
    lse = kind.new((B, H, n_q), np.float32) if lse is None else given_out(lse, (B, H, n_q), "lse")
    if B * H and n_q:
        Br, Bc, _ = tc_tiles(d)
        splits = choose_splits(cdiv(n_q, Br) * B * H, n_k, Bc) if splits is None else int(splits)
        arrays = dict(q=q, k=k, v=v, o=o, lse=lse)
        arrays.update(partials(kind, splits, B * H, n_q, d))
        run_bound(_launches, (B, H, hkv, n_q, n_k, d, bf16, causal, scale, splits, o16), arrays,
                  lambda arrays: _views(arrays, B * H, B * hkv, n_q, n_k, d),
                  lambda views, aligned: _bind_forward(views, d, bf16, causal, scale, aligned, splits, o16),
                  aligned_names="qkv", aligned_d=d % 8 == 0)
    return o, lse


def _views(arrays, BH, BHkv, n_q, n_k, d):
    """The kernel's views: q (B*H, Nq, d), k, v (B*Hkv, Nk, d) as 16-bit patterns, o, lse (and
    the splits' partials, as they are)."""
    rows = dict(q=(BH, n_q), k=(BHkv, n_k), v=(BHkv, n_k), o=(BH, n_q))
    views = {name: device_bits16(as_bits16(arrays[name]), name).reshape(*rows[name], d) for name in rows}
    views["lse"] = to_device(arrays["lse"], "lse").reshape(BH, n_q)
    views.update(partial_views(arrays))
    return views


def _bind_forward(views, d, bf16, causal, scale, aligned, splits=1, o16=False):
    """The forward's launch, bound (``kernels.base.runtime.BoundLaunches``); with ``splits``
    > 1, the split forward into the partials and then their merge (which writes O in the
    inputs' type with ``o16``)."""
    BH, n_q, _ = views["q"].shape
    kv_group = BH // views["k"].shape[0]
    Br, Bc, D = tc_tiles(d)
    kernel = make_flash_forward_mma(Br, Bc, D, bool(bf16), split=splits > 1, o16=o16 and splits == 1,
                                    grouped=kv_group > 1)
    names = ("q", "k", "v", *output_names(splits))
    args = tuple(views[n] for n in names) + (np.float32(scale), np.int32(causal), np.int32(kv_group),
                                             np.int32(aligned))
    launches = [(kernel, (cdiv(n_q, Br), BH, splits), kernel.threads, args, 0)]
    slots = [{n: i for i, n in enumerate(names)}]
    add_combine(launches, slots, views, splits, ("bf16" if bf16 else "f16") if o16 else None)
    return BoundLaunches(launches, slots)


# --------------------------------------------------------------------------- PTX check

def ptx_targets(every_shape: bool = False):
    """The kernel at the GPU tiles, d = 64 and 128, fp16 (``every_shape``: bf16 too; its code
    differs in the two instructions' names only), and the grouped-query kernel at d = 128
    (``every_shape``: at 64 too)."""
    sig = ("void(uint16[:, :, ::1], uint16[:, :, ::1], uint16[:, :, ::1], float32[:, :, ::1], float32[:, ::1], "
           "float32, int32, int32, int32)")
    out = []
    for D in (64, 128):
        for bf16 in (False, True) if every_shape else (False,):
            out.append((f"flash fwd tensor cores {'bf16' if bf16 else 'fp16'} Br=128 Bc=64 D={D}",
                        make_flash_forward_mma(128, 64, D, bf16), sig))    # tc_tiles on a GPU
        if D == 128 or every_shape:
            out.append((f"flash fwd tensor cores fp16 grouped-query Br=128 Bc=64 D={D}",
                        make_flash_forward_mma(128, 64, D, False, grouped=True), sig))
    return out
