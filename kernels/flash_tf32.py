"""fp32 attention on tensor cores: the FlashAttention-2 forward with 3xTF32 products.

Chapter 8's kernel takes fp16 or bf16. For float32 inputs the tensor cores offer TF32
(``mma.sync.m16n8k8.tf32``, 8 exponent bits and 10 of mantissa): one TF32 product errs by
about 2^-11 of |a||b|, far beyond fp32's 2^-24. Splitting each operand in two,

    a = a_hi + a_lo,   a_hi = tf32(a),   a_lo = tf32(a - a_hi)            (``split_tf32``)
    a b ~ a_lo b_hi + a_hi b_lo + a_hi b_hi                                (three mma, small first)

keeps about 22 bits: the dropped a_lo b_lo is ~2^-22 of |a||b| (chapter 11, section 2),
and three TF32 products still run faster than the FMA units' fp32 (chapter 0).

The kernel is chapter 8's loop with the m16n8k8 layout (``kernels.base.mma``):

    one block          Br = 16 W query rows, W warps; Q_i's A fragments split once, their hi
                       and lo parts kept in shared memory, each lane's in 16 bytes a part (at
                       D = 128, where one block fills an SM; elsewhere kept raw and split at
                       each use: ``tf32_query_parts``)
    for each K/V tile (Bc keys):
        K_j lands      raw fp32 rows, by cp.async, in shared memory; the block splits each
                       element once into hi and lo and lays the parts out as the k-steps read
                       them: a lane's B fragment, hi and lo, is one 16-byte load (``k_parts``)
        S    = Q_i K_j^T        Bc/8 accumulator tiles of 16 x 8, D/8 k-steps of 3 mma,
                                each k-step from zero and added in fp32 (see ``product``);
                                V_j lands meanwhile
        the online softmax on the accumulator fragments, as in chapter 8
        V_j's parts    laid out by key pairs (``v_parts``); K_{j+1} lands during P V_j
        O   += P V_j            P's accumulator tile is an m16n8k8 A operand once the 8 keys
                                are renumbered: the lane holding keys 2t and 2t + 1 takes
                                them as k = t and t + 4, and reads V's rows in the same order
                                (no shuffle, no shared memory)
    O / l and L = m + log l.

Every block splits the keys it reads: a split costs three instructions an element, against
the D / 8 x 3 mma a key row feeds in each of the block's 8 warps.

``passes=1`` runs the hi-hi product only (plain TF32): the course keeps it to show what it
loses. Scores are in base 2 (scale log2 e folded in), as in chapters 4 and 8; a row that
sees no key gets O = 0 and L = -inf.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda, float32, int32, uint32

from kernels.base.fragment_softmax import make_fragment_softmax
from kernels.base.fused import LOG2E, MASKED, MAX_GRID_Y
from kernels.base.inlined import inlined
from kernels.base.tf32_product import PASSES, make_tf32_product, make_tf32_products
from kernels.base.wgmma_product import SCHEDULES, make_wgmma_product
from kernels.base.key_split import add_combine, choose_splits, multiprocessors, output_names, partial_views, \
    partials
from kernels.base.runtime import ArrayKind, BoundLaunches, LaunchCache, cdiv, check_flag, check_qkv, check_scale, \
    fill, given_out, is_device_array, launch_stream, on_simulator, run_bound, to_device

__all__ = ["flash_attention_tf32", "make_flash_forward_tf32", "launch_forward", "forward_kernel", "tf32_tiles",
           "tf32_min_blocks", "tf32_query_parts", "SHORT_QUERIES", "DEFAULT_LO", "k_stride", "v_stride", "shared_words", "PASSES", "ptx_targets",
           "fragment_strides", "check_fragment_strides", "check_fragment_strides_case", "KERNEL_HEAD_DIMS",
           "make_split_kv", "part_shapes", "split_blocks", "tf32_paired", "PAIRED_MIN_KEYS", "tf32_wgmma", "WGMMA_MODES",
           "WGMMA_INFLIGHT", "WGMMA_CHAIN"]


def tf32_tiles(d: int, n_q: int | None = None) -> tuple[int, int, int]:
    """(Br, Bc, D), D = d rounded up to a multiple of 8 (an m16n8k8 k-step). On a GPU 128
    query rows (8 warps) and 64 keys a tile at D <= 64, 32 at D = 128 (``shared_words``: 86 KB
    and 83 KB, dynamic shared memory; at D = 128 with Q's parts, ``tf32_query_parts``, 211 KB);
    where a head has at most ``SHORT_QUERIES`` query rows
    (``n_q``), 64 rows (4 warps): of 128, half the warps would have no row to compute. In the
    simulator 16 or 32 rows and 8 or 16 keys."""
    D = 8 * cdiv(max(int(d), 1), 8)
    if on_simulator():
        return (16 if D <= 16 else 32), (8 if D <= 16 else 16), D
    Br = 64 if n_q is not None and n_q <= SHORT_QUERIES else 128
    return Br, (64 if D <= 64 else 32), D


SHORT_QUERIES = 64      # heads this short take 64-row query tiles (``tf32_tiles``)
DEFAULT_LO = "rounded"  # the splits' lo in the launchers' kernels (the GPU has not yet timed "truncated")
DEFAULT_PRESPLIT = False  # whether the launchers split K and V once first (``make_split_kv``; not yet timed)
PAIRED_MIN_KEYS = 1024    # keys a block walks from which K_j and V_j land together at D = 128 (``tf32_paired``)


def tf32_min_blocks(D: int, Br: int = 128) -> int:
    """Blocks an SM holds at once (the kernel's launch bounds): 2 at D <= 64 (ptxas then keeps
    a thread to 128 registers), 1 above (up to 255), and 2 for 64-row tiles (4 warps: 255
    registers a thread still fit twice). Measured on the H200, B*H = 64, N = 4096, d = 64,
    bare launches: two blocks of (128, 64) tiles 6.59 ms, one 7.28 (through the launcher),
    one of (128, 32) tiles 8.06 (``workbook/results/flash_tf32_forward_ab.csv``); B*H = 512,
    N = 64, through ``attention()``: 64-row tiles two an SM 0.067 ms at d = 96 and 0.088 at
    d = 128, against 0.114 and 0.138 with 128 rows (``workbook/results/flash_tf32_short_heads_ab.csv``)."""
    return 2 if D <= 64 or Br <= 64 else 1


# (wgmma) the k-steps' schedule: groups issued a round, k-steps a group (``make_flash_forward_tf32``);
# four groups of two measured fastest of the four schedules at d = 64 and 128, errors unchanged
# (H100, taking turns: ``workbook/results/flash_tf32_wgmma_schedule_ab.csv``)
WGMMA_INFLIGHT, WGMMA_CHAIN = 4, 2
WGMMA_MODES = ("s", "s+pv")   # what the forward may put on wgmma: S alone, or S and P V (``tf32_wgmma``)


def tf32_wgmma(Br: int, D: int) -> str | None:
    """The products the launchers put on Hopper's wgmma (``make_flash_forward_tf32``'s ``wgmma``):
    on an sm_90 GPU with 128-row tiles (two warpgroups), S at every D and P V too at D <= 64; else
    none (the simulator's tiles are smaller than a warpgroup's 64 rows; other GPUs have no wgmma;
    the short heads' 64-row tiles were not measured with it). Measured on the H100 (bare launches
    taking turns, ``workbook/results/flash_tf32_wgmma_ab.csv``)."""
    from kernels.base.wgmma import has_wgmma

    if Br != 128 or not has_wgmma():
        return None
    return "s+pv" if D <= 64 else "s"


def k_stride(D: int) -> int:
    """Words a key row of K_j's parts: 2 D (hi and lo), padded to 16 mod 32, so that the 8 lanes
    of a 16-byte load's phase (keys g and g + 1, t = 0..3) hit 32 distinct banks."""
    return 2 * D + (16 - 2 * D) % 32


def v_stride(D: int) -> int:
    """Words a key pair's row of V_j's parts: 4 D (two keys, hi and lo), plus 8 (8 mod 32: the
    phase's 4 key pairs and 2 columns hit distinct banks)."""
    return 4 * D + 8


def shared_words(Bc: int, D: int, Br: int = 0, query_parts: bool = False, presplit: bool = False,
                 paired: bool = False) -> int:
    """32-bit words of shared memory a block: K_j's parts (Bc rows of ``k_stride``), V_j's (Bc / 2
    key pairs of ``v_stride``) and the rows a tile lands in (Bc of D + 4; ``paired``: two such,
    K_j's and V_j's); with ``query_parts``, Q_i's hi and lo parts too (Br x D words each).
    ``presplit``: the parts land ready-made, two tiles' worth (the next lands while this one is
    used), and no raw rows."""
    if presplit:
        return 2 * (Bc * k_stride(D) + Bc // 2 * v_stride(D)) + (2 * Br * D if query_parts else 0)
    return Bc * k_stride(D) + Bc // 2 * v_stride(D) + (2 if paired else 1) * Bc * (D + 4) \
        + (2 * Br * D if query_parts else 0)


def tf32_query_parts(Br: int, D: int) -> bool:
    """Whether Q_i's A fragments are split once and kept in shared memory (hi and lo, 2 Br D
    words: 128 KB at D = 128) rather than kept raw and split at every k-step of every key tile:
    at D = 128 with 128 rows, where one block has the SM to itself (``tf32_min_blocks`` = 1), so
    the extra shared memory costs no second block. Each k-step of S then loads its A parts (two
    16-byte loads) instead of splitting them (eight cvt and four subtractions): S's loop went
    from 4.1 to 3.0 instructions an mma (SASS for sm_90). Measured on the H100, bare launches
    (``workbook/results/flash_tf32_query_parts_ab.csv``): at D = 128 1.08x faster at B*H = 512,
    N = 256, 1.03x at N = 1024, level (0.999-1.011x) at N = 4096 and 16384; at D = 96 0.977x at
    N = 4096, so not there."""
    return D == 128 and tf32_min_blocks(D, Br) == 1


def tf32_paired(Br: int, D: int, keys: int) -> bool:
    """Whether K_j and V_j land together, each in rows of its own (two barriers a key tile
    instead of four; ``make_flash_forward_tf32``'s ``paired``): wherever Q_i's parts are not
    kept in shared memory (``tf32_query_parts``), and at D = 128 where a block walks at least
    ``PAIRED_MIN_KEYS`` keys: the second tile's rows leave no room for Q's parts there, and
    with few key tiles their splits cost more than the barriers saved. Measured on the H100,
    bare launches taking turns (``workbook/results/flash_tf32_paired_ab.csv``): d = 64 1.06x
    (B*H = 64, N = 4096, causal or not; B*H = 512, N = 1024); d = 128 1.11x at B*H = 64, N = 4096
    (causal 1.09x), 1.07x at B*H = 512, N = 1024, but 0.95x at N = 256, where Q's parts stay;
    against the kernel without Q's parts 1.06-1.10x at every N, so also at the head dims that
    keep none (d = 96 and the like, not timed themselves). Short heads' 64-row tiles (two blocks
    an SM) land in turn: not timed."""
    return Br == 128 and (not tf32_query_parts(Br, D) or keys >= PAIRED_MIN_KEYS)


def part_shapes(BHkv: int, n_k: int, D: int) -> tuple[tuple, tuple]:
    """The ready-made parts' shapes (``make_split_kv``): K's (B*Hkv, Nk, 2 D) words, a key row
    as ``k_parts`` lays it out (unpadded); V's (B*Hkv, ceil(Nk / 2), 4 D), a key pair's row as
    ``v_parts`` does."""
    return (BHkv, n_k, 2 * D), (BHkv, (n_k + 1) // 2, 4 * D)


SPLIT_THREADS = 256


@functools.lru_cache(maxsize=None)
def make_split_kv(D: int, lo: str = "rounded"):
    """The kernel that splits K and V into their TF32 parts once, for every block that reads
    them (``presplit``): kp[h, r] holds key r's parts as ``k_parts`` lays them out, vp[h, p] key
    pair p's as ``v_parts`` does, zeros past d and past the last key. One thread an item (8
    columns of a key, or 4 of a key pair). Launch: grid (``split_blocks``, B*Hkv),
    ``SPLIT_THREADS`` threads; k, v (B*Hkv, Nk, d) float32, kp and vp ``part_shapes`` (the words
    in float32 arrays: every allocator has those)."""
    from kernels.base.mma import splits_for, store_words

    split_tf32, _ = splits_for(lo)
    KS, CH = D // 8, D // 4

    @cuda.jit(fastmath=True)
    def split_kv(k, v, kp, vp):
        h = int32(cuda.blockIdx.y)
        i = int32(cuda.blockIdx.x) * int32(cuda.blockDim.x) + int32(cuda.threadIdx.x)
        n_k, d = int32(k.shape[1]), int32(k.shape[2])
        if i < n_k * KS:                         # key r, k-step columns c .. c + 7
            r = i // KS
            c = (i % KS) * 8
            for t in range(4):
                x0 = k[h, r, c + t] if c + t < d else float32(0.0)
                x1 = k[h, r, c + t + 4] if c + t + 4 < d else float32(0.0)
                h0, l0 = split_tf32(x0)
                h1, l1 = split_tf32(x1)
                store_words(kp[h], r, 2 * c + 4 * t, h0, h1, l0, l1)
        if i < int32(vp.shape[1]) * CH:          # key pair p, columns c .. c + 3
            p = i // CH
            c = (i % CH) * 4
            for e in range(4):
                y0 = v[h, 2 * p, c + e] if c + e < d else float32(0.0)
                y1 = v[h, 2 * p + 1, c + e] if c + e < d and 2 * p + 1 < n_k else float32(0.0)
                h0, l0 = split_tf32(y0)
                h1, l1 = split_tf32(y1)
                store_words(vp[h], p, 4 * (c + e), h0, h1, l0, l1)

    return split_kv


def split_blocks(n_k: int, D: int) -> int:
    """Blocks a head row of ``make_split_kv``'s grid: one thread an item."""
    return cdiv(max(n_k * (D // 8), (n_k + 1) // 2 * (D // 4)), SPLIT_THREADS)


@functools.lru_cache(maxsize=None)
def make_flash_forward_tf32(Br: int, Bc: int, D: int, passes: int = 3, dynamic: bool = False,
                            max_registers: int | None = None, split: bool = False, grouped: bool = False,
                            min_blocks: int = 1, query_parts: bool = False, lo: str = "rounded",
                            presplit: bool = False, paired: bool = False, wgmma: str | None = None,
                            inflight: int = WGMMA_INFLIGHT, chain: int = WGMMA_CHAIN,
                            pv_schedule: tuple | None = None):
    """The forward kernel for Br query rows (Br / 16 warps), Bc keys a tile, head dim D (a
    multiple of 8), ``passes`` TF32 products a product (3 or 1); ``dynamic``: its shared
    memory (``shared_words``) is dynamic, for more than 48 KB; ``max_registers``: a cap on
    the registers a thread (None: the compiler's choice); ``min_blocks``: the blocks an SM
    must hold at once, told to the compiler with the block's size (launch bounds). Told
    nothing, ptxas keeps registers low by issuing each product's three dependent mma one
    after another, waiting on each; told that one block of 2 Br threads is all an SM
    holds, it spends up to 255 registers to keep several products in flight. ``query_parts``:
    Q_i's split parts kept in shared memory (``tf32_query_parts``). ``lo``: how every split
    (K_j's and V_j's parts, Q_i's, P's) leaves lo = x - hi: "rounded" to tf32, or "truncated":
    its float32 bits, which the mma truncates (``split_tf32_unrounded``: one instruction less
    a split, the same |x - hi - lo|; chapter 11's backward takes it at its fragment loads).
    ``presplit``: K and V come split already (``make_split_kv``), so the block splits nothing:
    k and v are the parts (``part_shapes``), each tile's land by cp.async in one of two
    stages while the other's are used, one barrier a tile instead of four. ``paired``: K_j and V_j
    land together, each in rows of its own, while tile j - 1 is computed; both split after one
    barrier, two barriers a tile instead of four. ``wgmma`` (``WGMMA_MODES``; Hopper only):
    "s" takes S = Q_i K_j^T on the warpgroup instruction (``kernels.base.wgmma``), "s+pv" O += P V_j
    too: K_j's parts (V_j^T's) are split into a hi and a lo plane laid out as the tensor cores read B
    from shared memory, and each warpgroup (64 query rows) takes a k-step as three wgmma m64nNk8,
    its warps' A parts (Q's, P's) in registers. ``chain`` k-steps (1 or 2) go to the tensor cores as one
    group, from zero on one accumulator, and each group's sum is added in fp32 while the groups
    after it run, ``inflight`` groups (2 or 4) issued a round (``WGMMA_INFLIGHT``, ``WGMMA_CHAIN``:
    four groups of two, measured 1.14-1.25x faster than two of one, with the same errors; a whole
    tile's k-steps chained on one accumulator erred 2-3.5x float32 NumPy's, past the fp32 rule).
    ``pv_schedule`` (inflight, chain, cols): P V's own schedule, each group covering ``cols`` of O's
    D columns (D or D / 2: two products of half the accumulators each); None: (inflight, chain, D).

    Launch: grid (ceil(Nq / Br), B*H), 2 Br threads. Arguments: q (B*H, Nq, d), k, v (B*Hkv,
    Nk, d) float32; o (B*H, Nq, d) and lse (B*H, Nq) float32; scale (float32), causal (int32
    0/1), kv_group (int32: H / Hkv; query head row bh reads KV row bh // kv_group, grouped-query
    attention with no copy; read only by the ``grouped`` kernel, which the launchers take where
    Hkv < H, so that the MHA kernel's code is the one measured before), aligned (int32: rows
    16-byte aligned and d % 4 == 0, so whole 16-byte chunks go by cp.async). ``split``: the
    keys split among gridDim.z blocks (``kernels.base.key_split``), each writing its partial
    O and L to row blockIdx.z * B*H + bh of o (S*B*H, Nq, d) and lse (S*B*H, Nq)."""
    from kernels.base.key_split import split_range
    from kernels.base.mma import cp_async, cp_async_commit, cp_async_wait_all, float_of_word, load_words, \
        splits_for, store_words, word_of_float
    from kernels.base.shared_memory import shared_view
    from kernels.base.tile_copy import make_async_tile_copy

    if passes not in PASSES:
        raise ValueError(f"passes: expected one of {PASSES}, got {passes!r}")
    split_tf32, _ = splits_for(lo)
    if D % 8 or Bc % 8 or Br % 16 or Br < 16:
        raise ValueError(f"tiles: expected D and Bc multiples of 8, Br of 16; got {Br}, {Bc}, {D}")
    W = Br // 16
    THREADS = 32 * W
    KS, NS, ND = D // 8, Bc // 8, D // 8
    KW, VW, RW = k_stride(D), v_stride(D), D + 4  # row strides (words) of K's parts, V's parts, landed rows
    CH = D // 4                                   # 16-byte chunks a row
    QPARTS = bool(query_parts)
    PRE = bool(presplit)
    PAIRED = bool(paired) and not PRE
    if wgmma not in (None, False) + WGMMA_MODES:
        raise ValueError(f"wgmma: expected one of {WGMMA_MODES} or None, got {wgmma!r}")
    WG = wgmma in WGMMA_MODES
    if WG and (PRE or Br % 64 or Bc > 256):
        raise ValueError(f"wgmma: expected Br a multiple of 64 (warpgroups of 4 warps), Bc <= 256 and K, V "
                         f"not presplit; got Br={Br}, Bc={Bc}, presplit={presplit}")
    WG_PV = wgmma == "s+pv"                       # O += P V_j on wgmma too
    if (inflight, chain) not in SCHEDULES:
        raise ValueError(f"inflight, chain: expected one of {SCHEDULES} (groups a round, k-steps a group); "
                         f"got {inflight}, {chain}")
    PV_FLY, PV_CHAIN, PV_COLS = (inflight, chain, D) if pv_schedule is None else pv_schedule
    if (PV_FLY, PV_CHAIN) not in SCHEDULES or PV_COLS not in (D, D // 2) or PV_COLS % 8:
        raise ValueError(f"pv_schedule: expected (inflight, chain) of {SCHEDULES} and cols D or D / 2 (a multiple "
                         f"of 8); got {pv_schedule}")
    PV_HALVES = D // PV_COLS                      # P V's products, each over PV_COLS of O's columns
    if WG:
        from kernels.base.mma import shared_address
        from kernels.base.wgmma import async_fence, canonical_strides, desc_add, wgmma_desc
        LBO, SBO = canonical_strides(D)           # K_j's planes: D columns a key
        KLO = 4 * Bc * D                          # bytes from K_j's hi plane to its lo plane
    if WG_PV:
        VLBO, VSBO = canonical_strides(Bc)        # V_j^T's planes: Bc keys a column
        VLO = 4 * D * Bc                          # bytes from V_j^T's hi plane to its lo plane
    SHARED = 0 if dynamic else shared_words(Bc, D, Br, QPARTS, PRE, PAIRED)
    QROWS = W * KS * 32 if QPARTS else 1          # rows of 4 words of each of Q_i's part planes
    QAT = shared_words(Bc, D, presplit=PRE, paired=PAIRED)    # where they start
    STAGES = 2 if PRE else 1                      # tiles of parts in shared memory at once
    KC = D // 2                                   # 16-byte chunks a key row of parts (presplit)
    GROUPED = bool(grouped)
    U = int if on_simulator() else uint32         # unsigned loop indices: the compiler unrolls or folds them
    split4, _, _ = make_tf32_product(passes, lo)  # 3xTF32 (or plain TF32) k-steps
    DG = max(x for x in (4, 3, 2, 1) if ND % x == 0)          # O's tiles a P V round
    s_products = make_tf32_products(passes, NS)               # S's NS tiles' products, interleaved
    o_products = make_tf32_products(passes, DG)               # DG of O's tiles' products, interleaved
    scale_and_mask, online_softmax, write_rows = make_fragment_softmax(NS, ND, THREADS)

    # K_j's or V_j's rows src[r0 + r, :d] -> R[r, :D] as float32 bits, zeros past rows and d:
    # where the block's threads cover whole rows of chunks and the rows are aligned, by column
    # (addresses made once, a constant added a chunk), else chunk by chunk
    land = make_async_tile_copy(Bc, D, THREADS, 4, float32, store_as=word_of_float)

    @inlined
    def land_parts(kph, vph, Kp, Vp, st, k0, n_k, tid):
        """(presplit) tile j's parts -> stage st's rows of Kp and Vp by cp.async, 16 bytes at a
        time; zeros past the last key (V's must be: P's zeros times garbage could make NaN)."""
        zero = uint32(0)
        for ch in range(tid, Bc * KC, THREADS):
            r = ch // KC
            c = (ch % KC) * 4
            if k0 + r < n_k:
                cp_async(Kp, st * Bc + r, c, kph, k0 + r, c)
            else:
                store_words(Kp, st * Bc + r, c, zero, zero, zero, zero)
        p0 = k0 // 2
        for ch in range(tid, Bc // 2 * D, THREADS):
            p = ch // D
            c = (ch % D) * 4
            if p0 + p < vph.shape[0]:
                cp_async(Vp, st * (Bc // 2) + p, c, vph, p0 + p, c)
            else:
                store_words(Vp, st * (Bc // 2) + p, c, zero, zero, zero, zero)

    @inlined
    def parts(w, e):
        return split_tf32(float_of_word(w[e]))

    @inlined
    def k_parts(R, Kp, tid):
        """K_j's landed rows -> their TF32 parts, laid out as S's k-steps read them: key r's
        k-step s at words 16 s + 4 t holds (hi, hi, lo, lo) of columns 8 s + t and 8 s + t + 4,
        the B fragment (b0, b1) of lane t, hi and lo, in one 16-byte load."""
        for item in range(tid, Bc * KS, THREADS):
            r = item // KS
            c = (item % KS) * 8
            w = load_words(R, r, c)
            u = load_words(R, r, c + 4)
            for t in range(4):
                h0, l0 = parts(w, t)
                h1, l1 = parts(u, t)
                store_words(Kp, r, 2 * c + 4 * t, h0, h1, l0, l1)

    @inlined
    def k_planes(R, Kw, tid):
        """(wgmma) K_j's landed rows -> a hi plane and a lo plane of Bc x D words each, K-major as
        the tensor cores read B (``kernels.base.wgmma.canonical_word``): 4 columns of a key are 16
        contiguous bytes, one store a plane; consecutive threads take consecutive keys (the 8 rows
        of a core matrix, 128 contiguous bytes: no bank conflict)."""
        for item in range(tid, Bc * CH, THREADS):
            r = item % Bc
            c = (item // Bc) * 4
            w = load_words(R, r, c)
            h0, l0 = parts(w, 0)
            h1, l1 = parts(w, 1)
            h2, l2 = parts(w, 2)
            h3, l3 = parts(w, 3)
            row = 8 * ((r // 8) * (D // 4) + c // 4) + r % 8        # canonical_word(r, c, D) / 4
            store_words(Kw, row, 0, h0, h1, h2, h3)
            store_words(Kw, row + Bc * D // 4, 0, l0, l1, l2, l3)
        async_fence()                              # the tensor cores read them through the async proxy

    @inlined
    def v_planes(R, Vw, tid):
        """(wgmma P V) V_j's landed rows -> V_j^T's hi and lo planes, D x Bc words each, K-major
        over the keys (``canonical_word(n, kk, Bc)``), the keys of each k-step renumbered as P's A
        fragment takes them: key 8 kp + 2 i + h at kk = 8 kp + 4 h + i. A thread takes one column n
        and the 4 keys of one kk // 4 (4 loads, one 16-byte store a plane); consecutive threads
        consecutive columns (distinct banks both ways)."""
        for item in range(tid, D * (Bc // 4), THREADS):
            n = item % D
            q4 = item // D                        # kk // 4: k-step q4 // 2, keys of parity q4 % 2
            r0 = 8 * (q4 // 2) + q4 % 2
            h0, l0 = split_tf32(float_of_word(R[r0, n]))
            h1, l1 = split_tf32(float_of_word(R[r0 + 2, n]))
            h2, l2 = split_tf32(float_of_word(R[r0 + 4, n]))
            h3, l3 = split_tf32(float_of_word(R[r0 + 6, n]))
            row = 8 * ((n // 8) * (Bc // 4) + q4) + n % 8       # canonical_word(n, 4 q4, Bc) / 4
            store_words(Vw, row, 0, h0, h1, h2, h3)
            store_words(Vw, row + D * Bc // 4, 0, l0, l1, l2, l3)
        async_fence()

    @inlined
    def v_parts(R, Vp, tid):
        """V_j's landed rows -> their TF32 parts, as P V's k-steps read them: key pair p's
        column c at words 4 c holds (hi, hi, lo, lo) of keys 2 p and 2 p + 1, the B fragment
        (b0, b1) of the lane that holds those two keys of P, in one 16-byte load."""
        for item in range(tid, Bc // 2 * CH, THREADS):
            p = item // CH
            c = (item % CH) * 4
            w = load_words(R, 2 * p, c)
            u = load_words(R, 2 * p + 1, c)
            for e in range(4):
                h0, l0 = parts(w, e)
                h1, l1 = parts(u, e)
                store_words(Vp, p, 4 * (c + e), h0, h1, l0, l1)

    @inlined
    def q_parts(Qh, Ql, qrow, qf, s_):
        """Q_i's A fragment of k-step s, hi and lo: loaded where kept (QPARTS), else split here."""
        if QPARTS:
            return load_words(Qh, qrow + U(32) * s_, 0), load_words(Ql, qrow + U(32) * s_, 0)
        return split4(qf[s_, 0], qf[s_, 1], qf[s_, 2], qf[s_, 3])

    @inlined
    def p_parts(pv, kp):
        """P's accumulator tile kp as P V's A fragment, hi and lo: the lane's keys 2t and 2t + 1
        renumbered as k = t and t + 4 (c0, c2, c1, c3)."""
        return split4(pv[kp, 0], pv[kp, 2], pv[kp, 1], pv[kp, 3])

    if WG:
        @inlined
        def q_of(src, s_):
            """(wgmma) Q_i's A fragment of k-step s, hi and lo; src = (Qh, Ql, qrow, qf)."""
            Qh, Ql, qrow, qf = src
            return q_parts(Qh, Ql, qrow, qf, s_)

        s_wgmma = make_wgmma_product(Bc, KS, passes, q_of, inflight, chain)      # S += Q_i K_j^T
        if WG_PV:
            pv_wgmma = make_wgmma_product(PV_COLS, NS, passes, p_parts, PV_FLY, PV_CHAIN)   # O += P V_j
            if PV_HALVES == 2:                                                          # (its columns D / 2 on)
                pv_wgmma2 = make_wgmma_product(PV_COLS, NS, passes, p_parts, PV_FLY, PV_CHAIN, PV_COLS // 8)

    caps = {} if on_simulator() else {"launch_bounds": (THREADS, int(min_blocks))}
    if max_registers and not on_simulator():
        caps["max_registers"] = max_registers

    @cuda.jit(fastmath=True, **caps)
    def flash_forward_tf32(q, k, v, o, lse, scale, causal, kv_group, aligned):
        bh = int32(cuda.blockIdx.y)
        tid = int32(cuda.threadIdx.x)
        warp = tid // 32
        lane = tid % 32
        g = lane // 4                                # the fragment's row group
        t = lane % 4
        ug, ut = U(g), U(t)
        q0 = (int32(cuda.gridDim.x) - 1 - int32(cuda.blockIdx.x)) * Br     # heaviest causal tiles first
        n_q, n_k, d = int32(q.shape[1]), int32(k.shape[1]), int32(q.shape[2])
        smem = cuda.shared.array(SHARED, uint32, alignment=16)
        Kp = shared_view(smem, 0, (STAGES * Bc, KW))                    # K_j's parts
        Kw = shared_view(smem, 0, (Bc * KW // 4, 4))                    # (wgmma) the same words as hi, lo planes
        Vw = shared_view(smem, Bc * KW, (Bc // 2 * VW // 4, 4))         # (wgmma P V) V_j^T's planes
        Vp = shared_view(smem, STAGES * Bc * KW, (STAGES * Bc // 2, VW))  # V_j's parts
        R = shared_view(smem, 0 if PRE else Bc * KW + Bc // 2 * VW, (Bc, RW))  # where K_j, then V_j, lands
        RV = shared_view(smem, Bc * KW + Bc // 2 * VW + Bc * RW if PAIRED else 0, (Bc, RW))  # (paired) V_j's
        Qh = shared_view(smem, QAT if QPARTS else 0, (QROWS, 4))        # Q_i's parts: lane's k-step s at row
        Ql = shared_view(smem, QAT + QROWS * 4 if QPARTS else 0, (QROWS, 4))    # (warp KS + s) 32 + lane
        kvh = bh
        if GROUPED:                                  # its KV head (a 32-bit division: // on int32 is 64-bit)
            kvh = int32(uint32(bh) // uint32(kv_group))
        kh, vh = k[kvh], v[kvh]
        wrow0 = q0 + warp * 16                       # this warp's first query row

        # ---- Q_i's A fragments, straight from HBM (each element once), kept as fp32 or (QPARTS) split
        # once, each part to the lane's own 16 bytes of shared memory (only this lane reads them):
        # a0 = Q[g, 8s + t], a1 = Q[g + 8, 8s + t], a2 = Q[g, 8s + t + 4], a3 = Q[g + 8, 8s + t + 4]
        qf = cuda.local.array((KS, 4), float32)
        qrow = U(warp * KS * 32 + lane) if QPARTS else U(0)
        for s_ in range(KS):
            for e in range(4):
                row = wrow0 + g + 8 * (e % 2)
                col = 8 * s_ + t + 4 * (e // 2)
                qf[s_, e] = q[bh, row, col] if row < n_q and col < d else float32(0.0)
            if QPARTS:
                hi, lo = split4(qf[s_, 0], qf[s_, 1], qf[s_, 2], qf[s_, 3])
                store_words(Qh, qrow + U(32 * s_), 0, hi[0], hi[1], hi[2], hi[3])
                store_words(Ql, qrow + U(32 * s_), 0, lo[0], lo[1], lo[2], lo[3])

        m = cuda.local.array(2, float32)             # running max (base 2), rows g, g + 8
        l = cuda.local.array(2, float32)             # this lane's share of the running sums
        acc = cuda.local.array((ND, 4), float32)     # O: ND accumulator tiles of 16 x 8
        sc = cuda.local.array((NS, 4), float32)      # S, then P: NS accumulator tiles
        # P again, for P V: sc stays in registers only if every index into it is known when
        # compiling, and the loop over key steps in P V is too long to unroll; a copy in
        # local memory (NS x 4 stores and loads a tile) keeps sc out of it
        pv = cuda.local.array((NS, 4), float32)
        bs = cuda.local.array((NS, 4), uint32)       # a k-step's B fragments (hi, hi, lo, lo) and products
        cs = cuda.local.array((NS, 4), float32)
        bo = cuda.local.array((DG, 4), uint32)
        co = cuda.local.array((DG, 4), float32)
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

        if end > first:
            if PRE:
                land_parts(kh, vh, Kp, Vp, 0, first * Bc, n_k, tid)
            else:
                land(kh, R, n_k, first * Bc, d, tid, aligned)
                if PAIRED:
                    land(vh, RV, n_k, first * Bc, d, tid, aligned)
        cp_async_commit()
        for jt in range(first, end):
            k0 = jt * Bc
            st = 0                                   # the stage tile j's parts are in
            if PRE:
                st = (jt - first) % 2
                cp_async_wait_all()                  # tile j's parts have landed (this thread's chunks) ...
                cuda.syncthreads()                   # ... every thread's; every warp is done with tile j - 1's
                if jt + 1 < end:
                    land_parts(kh, vh, Kp, Vp, 1 - st, k0 + Bc, n_k, tid)   # tile j + 1's, meanwhile
                cp_async_commit()
            else:                                    # (paired: K_j and V_j, both landed during tile j - 1)
                cp_async_wait_all()                  # K_j has landed (this thread's chunks) ...
                cuda.syncthreads()                   # ... every thread's; every warp is done with S_{j-1} (P V_{j-1})
                if WG:
                    k_planes(R, Kw, tid)
                else:
                    k_parts(R, Kp, tid)
                if PAIRED:
                    if WG_PV:
                        v_planes(RV, Vw, tid)
                    else:
                        v_parts(RV, Vp, tid)
                cuda.syncthreads()                   # K_j's parts are in (V_j's); R is free (RV)
                if not PAIRED:
                    land(vh, R, n_k, k0, d, tid, aligned)     # V_j lands while S_j is computed
                elif jt + 1 < end:                   # K_{j+1} and V_{j+1} land during S_j and P V_j
                    land(kh, R, n_k, k0 + Bc, d, tid, aligned)
                    land(vh, RV, n_k, k0 + Bc, d, tid, aligned)
                cp_async_commit()
            krow = U(st * Bc) + ug                   # this lane's key row of K_j's parts
            prow = U(st * (Bc // 2)) + ut            # this lane's first key pair row of V_j's

            # ---- S = Q_i K_j^T: B = K_j^T, b0 = K[key g, 8s + t], b1 = K[key g, 8s + t + 4]
            for nt in range(NS):
                for e in range(4):
                    sc[nt, e] = float32(0.0)
            if WG:                                   # a warpgroup's 64 rows, k-steps scheduled as
                dh = wgmma_desc(shared_address(Kw, 0, 0), LBO, SBO)      # ``make_wgmma_product`` says;
                dl = desc_add(dh, KLO)                                   # K_j's hi plane and lo plane, k-step 0
                s_wgmma(sc, (Qh, Ql, qrow, qf), dh, dl)
            s_ = U(KS) if WG else U(0)
            while s_ < U(KS):                        # (unsigned: its addresses fold into the loads)
                a_hi, a_lo = q_parts(Qh, Ql, qrow, qf, s_)
                for nt in range(NS):
                    b = load_words(Kp, krow + U(nt * 8), U(16) * s_ + U(4) * ut)
                    for e in range(4):
                        bs[nt, e] = b[e]
                s_products(a_hi, a_lo, bs, cs)
                for nt in range(NS):
                    for e in range(4):
                        sc[nt, e] += cs[nt, e]
                s_ += U(1)
            scale_and_mask(sc, k0, wrow0, g, t, n_k, diag, causal, scale2)
            online_softmax(sc, acc, m, l)           # P in sc; O and l rescaled
            for kp in range(NS):
                for e in range(4):
                    pv[kp, e] = sc[kp, e]

            if not PRE and not PAIRED:
                cp_async_wait_all()                  # V_j has landed ...
                cuda.syncthreads()                   # ... every thread's; every warp is done with P V_{j-1}
                if WG_PV:
                    v_planes(R, Vw, tid)
                else:
                    v_parts(R, Vp, tid)
                cuda.syncthreads()                   # V_j's parts are in; R is free
                if jt + 1 < end:
                    land(kh, R, n_k, k0 + Bc, d, tid, aligned)    # K_{j+1} lands during P V_j
                cp_async_commit()

            # ---- O += P V_j, 8 keys a step, renumbered: key 2t -> k = t, key 2t + 1 -> k = t + 4.
            # A = (P[g, 2t], P[g + 8, 2t], P[g, 2t + 1], P[g + 8, 2t + 1]) = (c0, c2, c1, c3);
            # B: b0 = V[key 2t, 8 dt + g], b1 = V[key 2t + 1, 8 dt + g]: key pair 4 kp + t
            if WG_PV:                                # a warpgroup's 64 rows x D, as S's k-steps
                dvh = wgmma_desc(shared_address(Vw, 0, 0), VLBO, VSBO)   # V_j^T's hi plane, k-step 0
                dvl = desc_add(dvh, VLO)                                 # its lo plane
                pv_wgmma(acc, pv, dvh, dvl)
                if PV_HALVES == 2:                   # O's columns D / 2 on: V_j^T's rows (PV_COLS / 8) x SBO on
                    pv_wgmma2(acc, pv, desc_add(dvh, PV_COLS // 8 * VSBO), desc_add(dvl, PV_COLS // 8 * VSBO))
            kp = U(NS) if WG_PV else U(0)
            while kp < U(NS):
                a_hi, a_lo = p_parts(pv, kp)
                pair = U(4) * kp + prow
                for dg in range(ND // DG):
                    for j in range(DG):
                        b = load_words(Vp, pair, U(32 * (dg * DG + j)) + U(4) * ug)
                        for e in range(4):
                            bo[j, e] = b[e]
                    o_products(a_hi, a_lo, bo, co)
                    for j in range(DG):
                        for e in range(4):
                            acc[dg * DG + j, e] += co[j, e]
                kp += U(1)

        cp_async_wait_all()                          # (the last, empty, group)

        write_rows(acc, m, l, o, lse, out, wrow0, g, t, n_q, d)    # O / l and L

    flash_forward_tf32.threads = THREADS
    return flash_forward_tf32


def forward_kernel(BH: int, BHkv: int, n_q: int, d: int, passes: int, split: bool = False, tiles=None,
                   max_registers=None, min_blocks=None, query_parts=None, lo=None, presplit=False, paired=None,
                   keys: int = 0, wgmma=None, inflight=None, chain=None, pv_schedule=None):
    """(kernel, Br, dynamic shared bytes or 0) for this call shape: the tiles ``tf32_tiles``
    chooses (or ``tiles`` (Br, Bc)), the launch bounds ``tf32_min_blocks`` (or ``min_blocks``),
    the grouped kernel where Hkv < H, and a raised shared-memory limit where the tiles need
    more than 48 KB (the caller passes the args to ``allow_dynamic_shared_memory``); Q_i's parts
    in shared memory as ``tf32_query_parts`` says (or ``query_parts``); the splits' lo
    ``DEFAULT_LO`` (or ``lo``); K_j and V_j landed together as ``tf32_paired`` says for a block
    that walks ``keys`` keys (or ``paired``); the products on wgmma as ``tf32_wgmma`` says (or
    ``wgmma``: a mode of ``WGMMA_MODES``, or False), one block an SM where it takes P V (told two,
    ptxas spills at 128 registers)."""
    from kernels.base.shared_memory import STATIC_LIMIT_BYTES

    Br, Bc, D = tf32_tiles(d, n_q)
    if tiles is not None:
        Br, Bc = tiles
    if wgmma is None:
        wgmma = None if presplit else tf32_wgmma(Br, D)
    wgmma = wgmma or None
    if min_blocks is None:
        min_blocks = 1 if wgmma == "s+pv" else tf32_min_blocks(D, Br)
    if paired is None:                       # (Q's parts asked for where they fill the SM's shared memory: no room)
        paired = tf32_paired(Br, D, keys) and not presplit and not (query_parts and tf32_query_parts(Br, D))
    paired = bool(paired)
    if query_parts is None:                  # (presplit, paired: two tiles' rows leave no room for Q's)
        query_parts = tf32_query_parts(Br, D) and not presplit and not paired
    query_parts = bool(query_parts)
    nbytes = 4 * shared_words(Bc, D, Br, query_parts, bool(presplit), paired)
    dynamic = nbytes > STATIC_LIMIT_BYTES and not on_simulator()
    kernel = make_flash_forward_tf32(Br, Bc, D, int(passes), dynamic, max_registers, split=split,
                                     grouped=BH > BHkv, min_blocks=min_blocks, query_parts=query_parts,
                                     lo=DEFAULT_LO if lo is None else lo, presplit=bool(presplit), paired=paired,
                                     wgmma=wgmma, inflight=WGMMA_INFLIGHT if inflight is None else int(inflight),
                                     chain=WGMMA_CHAIN if chain is None else int(chain),
                                     pv_schedule=None if pv_schedule is None else tuple(int(x) for x in pv_schedule))
    return kernel, Br, nbytes if dynamic else 0


def launch_forward(qd, kd, vd, o, lse, scale, causal, passes, tiles=None, max_registers=None, min_blocks=None,
                   query_parts=None, lo=None, presplit=False, parts=None, paired=None, wgmma=None, inflight=None,
                   chain=None, pv_schedule=None):
    """The forward on device views: qd (B*H, Nq, d), kd and vd (B*Hkv, Nk, d) float32, Hkv
    dividing H, into o (B*H, Nq, d) and lse (B*H, Nq); ``tiles`` (Br, Bc), by default
    ``tf32_tiles``; ``lo``: the splits' lo, by default ``DEFAULT_LO``; ``presplit``: K and V
    split first by ``make_split_kv`` into ``parts`` (kp, vp: ``part_shapes``, 32-bit words in
    float32 arrays; None: allocated here); ``paired``: K_j and V_j land together (None:
    ``tf32_paired``); ``inflight``, ``chain``: the wgmma k-steps' schedule (None:
    ``WGMMA_INFLIGHT``, ``WGMMA_CHAIN``); ``pv_schedule``: P V's (``make_flash_forward_tf32``)."""
    from kernels.base.shared_memory import allow_dynamic_shared_memory

    BH, n_q, d = qd.shape
    kernel, Br, nbytes = forward_kernel(BH, kd.shape[0], n_q, d, passes, tiles=tiles, max_registers=max_registers,
                                        min_blocks=min_blocks, query_parts=query_parts, lo=lo, presplit=presplit,
                                        paired=paired, keys=kd.shape[1], wgmma=wgmma, inflight=inflight, chain=chain,
                                        pv_schedule=pv_schedule)
    aligned = int(d % 4 == 0 and all(x.__cuda_array_interface__["data"][0] % 16 == 0 for x in (qd, kd, vd))) \
        if not on_simulator() else int(d % 4 == 0)
    if presplit:
        BHkv, n_k = kd.shape[0], kd.shape[1]
        D = 8 * cdiv(d, 8)
        if parts is None:
            parts = tuple(cuda.device_array(shape, np.float32) for shape in part_shapes(BHkv, n_k, D))
        if BHkv and n_k:
            make_split_kv(D, DEFAULT_LO if lo is None else lo)[(split_blocks(n_k, D), BHkv), SPLIT_THREADS,
                                                               launch_stream()](kd, vd, *parts)
        kd, vd = parts
    args = (qd, kd, vd, o, lse, np.float32(scale), np.int32(causal), np.int32(BH // kd.shape[0]), np.int32(aligned))
    if nbytes:
        allow_dynamic_shared_memory(kernel, args, nbytes)
    kernel[(cdiv(n_q, Br), BH), kernel.threads, launch_stream(), nbytes](*args)


def flash_attention_tf32(q, k, v, *, causal=False, scale=None, passes=3):
    """Attention forward on tensor cores for float32 inputs. q (B, H, Nq, d), k and v
    (B, Hkv, Nk, d) float32 with H a multiple of Hkv (grouped-query attention: query head h
    reads KV head h // (H / Hkv), with no copy), d <= 128; ``passes`` = 3 (3xTF32, about fp32's accuracy) or 1
    (plain TF32, ~2^-11 relative). Returns (o, lse) like chapter 4's ``flash_attention``:
    o (B, H, Nq, d) and lse (B, H, Nq) float32 (natural log; -inf for a row that sees no
    key). NumPy in, NumPy out; device arrays (and PyTorch tensors) in, device arrays out."""
    if isinstance(passes, bool) or passes not in PASSES:
        raise ValueError(f"passes: expected 3 (3xTF32) or 1 (plain TF32), got {passes!r}")
    B, H, n_q, n_k, d, _ = check_qkv(q, k, v, dtypes=(np.float32,), max_head_dim=128, grouped=True)
    causal = check_flag(causal, "causal")
    scale = check_scale(scale, d)
    BH = B * H
    if BH > MAX_GRID_Y:
        raise ValueError(f"q: expected B*H <= {MAX_GRID_Y} (one grid row a head), got B={B}, H={H}")
    kind = ArrayKind(q)
    inputs = {name: x if is_device_array(x) or not (BH and n_q and n_k) else to_device(x, name)
              for name, x in zip("qkv", (q, k, v))}
    o, lse = forward_checked(kind, inputs["q"], inputs["k"], inputs["v"], causal=causal, scale=scale, passes=passes)
    return kind.result(o), kind.result(lse)


def forward_checked(kind, q, k, v, *, causal, scale, passes=3, splits=None, o=None, lse=None, query_parts=None,
                    presplit=None, paired=None, wgmma=None):
    """What ``flash_attention_tf32`` runs once its checks pass, for callers that made them
    (chapter 13's drop-in checks its tensors once): q (B, H, Nq, d), k, v (B, Hkv, Nk, d), H a
    multiple of Hkv, C-contiguous float32 device arrays, ``scale`` a float. (o, lse) from ``kind``'s
    allocator (an ``ArrayKind``), or the ``o`` (like q) and ``lse`` (B, H, Nq) float32 given.
    ``splits``: the keys split among that many blocks a query tile, their partials merged after
    (``kernels.base.key_split``); None: split only where the grid would not fill the GPU.
    ``query_parts``: Q_i's split parts in shared memory or not (None: ``tf32_query_parts``).
    ``presplit``: K and V split once first (``make_split_kv``), into two arrays from ``kind``'s
    allocator (None: ``DEFAULT_PRESPLIT``). ``paired``: K_j and V_j land together (None:
    ``tf32_paired``). ``wgmma``: the products on Hopper's wgmma (None: ``tf32_wgmma``; False: none)."""
    B, H, n_q, d = q.shape
    hkv, n_k = k.shape[1], k.shape[2]
    o = kind.new((B, H, n_q, d), np.float32) if o is None else given_out(o, (B, H, n_q, d), "o")
    lse = kind.new((B, H, n_q), np.float32) if lse is None else given_out(lse, (B, H, n_q), "lse")
    if B * H and n_q and n_k:
        Br, Bc, D = tf32_tiles(d, n_q)
        presplit = DEFAULT_PRESPLIT if presplit is None else bool(presplit)
        on_wgmma = (None if presplit else tf32_wgmma(Br, D)) if wgmma is None else wgmma
        blocks = 1 if on_wgmma == "s+pv" else tf32_min_blocks(D, Br)
        held = multiprocessors() * blocks                       # the blocks the GPU holds at once
        splits = choose_splits(cdiv(n_q, Br) * B * H, n_k, Bc, sms=held, whole_waves=True) if splits is None \
            else int(splits)
        arrays = dict(q=q, k=k, v=v)
        arrays.update(partials(kind, splits, B * H, n_q, d))
        if presplit:
            arrays.update(zip(("kp", "vp"), (kind.new(shape, np.float32) for shape in part_shapes(B * hkv, n_k, D))))
        run_bound(_launches, (B, H, hkv, n_q, n_k, d, causal, scale, int(passes), splits, query_parts, presplit,
                              paired, wgmma),
                  dict(arrays, o=o, lse=lse), lambda a: _views(a, B * H, B * hkv, n_q, n_k, d),
                  lambda views, aligned: _bind_forward(views, causal, scale, passes, aligned, splits, query_parts,
                                                       presplit, paired, wgmma),
                  aligned_names=("q", "k", "v"), aligned_d=d % 4 == 0)
    elif B * H and n_q:          # nothing to attend to: O = 0, L = -inf (the kernel's answer, no launch)
        fill(o, 0.0)
        fill(lse, -np.inf)
    return o, lse


_launches = LaunchCache()          # the launcher's bound launches, by call shape


def _views(arrays, BH, BHkv, n_q, n_k, d):
    """The kernels' views: (B*H, Nq, d) for q and o, (B*Hkv, Nk, d) for k and v, (B*H, Nq)
    for lse."""
    rows = dict(q=(BH, n_q), o=(BH, n_q), k=(BHkv, n_k), v=(BHkv, n_k))
    views = {name: to_device(arrays[name], name).reshape(*rows[name], d) for name in rows}
    views["lse"] = to_device(arrays["lse"], "lse").reshape(BH, n_q)
    views.update(partial_views(arrays))
    views.update({name: to_device(arrays[name], name) for name in ("kp", "vp") if name in arrays})
    return views


def _bind_forward(views, causal, scale, passes, aligned, splits=1, query_parts=None, presplit=False, paired=None,
                  wgmma=None):
    """The launch, bound; with ``splits`` > 1 the forward writes the splits' partials and one
    more launch merges them; with ``presplit`` one launch before splits K and V."""
    from kernels.base.shared_memory import allow_dynamic_shared_memory

    BH, n_q, d = views["q"].shape
    BHkv, n_k = views["k"].shape[:2]
    kernel, Br, nbytes = forward_kernel(BH, BHkv, n_q, d, passes, split=splits > 1, query_parts=query_parts,
                                        presplit=presplit, paired=paired, keys=cdiv(n_k, splits), wgmma=wgmma)
    names = ("q", "kp", "vp", *output_names(splits)) if presplit else ("q", "k", "v", *output_names(splits))
    args = tuple(views[n] for n in names) + (np.float32(scale), np.int32(causal), np.int32(BH // views["k"].shape[0]),
                                             np.int32(aligned))
    if nbytes:
        allow_dynamic_shared_memory(kernel, args, nbytes)
    launches = [(kernel, (cdiv(n_q, Br), BH, splits), kernel.threads, args, nbytes)]
    slots = [{name: i for i, name in enumerate(names)}]
    if presplit:
        D = 8 * cdiv(d, 8)
        launches.insert(0, (make_split_kv(D, DEFAULT_LO), (split_blocks(n_k, D), BHkv), SPLIT_THREADS,
                            tuple(views[n] for n in ("k", "v", "kp", "vp")), 0))
        slots.insert(0, {name: i for i, name in enumerate(("k", "v", "kp", "vp"))})
    add_combine(launches, slots, views, splits)
    return BoundLaunches(launches, slots)


def ptx_targets(every_shape: bool = False):
    """The kernel at the GPU tiles, d = 64 and 128, 3xTF32 (``every_shape``: plain TF32 too), K_j
    and V_j landed as ``tf32_paired`` says (at d = 128 both ways: few keys a block, and many),
    its grouped-query form at d = 128 (``every_shape``: at 64 too), the short heads' 64-row
    tiles at d = 128, and the products on wgmma as ``tf32_wgmma`` puts them on a Hopper GPU."""
    sig = ("void(float32[:, :, ::1], float32[:, :, ::1], float32[:, :, ::1], float32[:, :, ::1], "
           "float32[:, ::1], float32, int32, int32, int32)")
    out = []
    for D, Bc in ((64, 64), (128, 32)):
        Br = 128
        qp = tf32_query_parts(Br, D)
        for paired in ((True,) if tf32_paired(Br, D, 0) else (False, True)):  # (D = 128: few keys, then many)
            dynamic = 4 * shared_words(Bc, D, Br, qp and not paired, paired=paired) > 48 * 1024
            for passes in (3, 1) if every_shape else (3,):
                out.append((f"flash fwd 3xTF32 passes={passes} Br={Br} Bc={Bc} D={D}"
                            f"{' K, V together' if paired else ''}",
                            make_flash_forward_tf32(Br, Bc, D, passes, dynamic, min_blocks=tf32_min_blocks(D),
                                                    query_parts=qp and not paired, paired=paired), sig))
        if D == 128 or every_shape:
            out.append((f"flash fwd 3xTF32 grouped-query Br={Br} Bc={Bc} D={D}",
                        make_flash_forward_tf32(Br, Bc, D, 3, 4 * shared_words(Bc, D, Br, qp) > 48 * 1024, grouped=True,
                                                min_blocks=tf32_min_blocks(D), query_parts=qp), sig))
    paired = tf32_paired(64, 128, 0)                                # short heads: 64-row tiles (tf32_tiles)
    dynamic = 4 * shared_words(32, 128, paired=paired) > 48 * 1024
    out.append((f"flash fwd 3xTF32 short queries Br=64 Bc=32 D=128{' K, V together' if paired else ''}",
                make_flash_forward_tf32(64, 32, 128, 3, dynamic, min_blocks=tf32_min_blocks(128, 64), paired=paired),
                sig))
    qp = tf32_query_parts(128, 128)                                 # lo left for the mma (DEFAULT_LO's other way)
    out.append(("flash fwd 3xTF32 lo truncated Br=128 Bc=32 D=128",
                make_flash_forward_tf32(128, 32, 128, 3, 4 * shared_words(32, 128, 128, qp) > 48 * 1024,
                                        min_blocks=tf32_min_blocks(128), query_parts=qp,
                                        lo="rounded" if DEFAULT_LO == "truncated" else "truncated"), sig))
    for D, Bc, mode in ((64, 64, "s+pv"), (128, 32, "s")):          # Hopper's wgmma (``tf32_wgmma``)
        for paired in (True, False) if D == 128 else (True,):
            qp = tf32_query_parts(128, D) and not paired
            out.append((f"flash fwd 3xTF32 on wgmma ({mode}) Br=128 Bc={Bc} D={D}{' K, V together' if paired else ''}",
                        make_flash_forward_tf32(128, Bc, D, 3, 4 * shared_words(Bc, D, 128, qp, paired=paired) > 48 * 1024,
                                                min_blocks=1, query_parts=qp, paired=paired, wgmma=mode), sig))
    if every_shape:
        out.append(("flash fwd 3xTF32 raw queries Br=128 Bc=32 D=128 (before Q's parts)",
                    make_flash_forward_tf32(128, 32, 128, 3, True, min_blocks=1), sig))
    return out


# --------------------------------------------------------------------------- the exercise
# k_parts and v_parts put a lane's B fragment, hi and lo, in 16 consecutive bytes, read by one
# load. Shared memory has 32 banks of 4 bytes, so 8 groups of 16 bytes; a warp's 16-byte loads
# are served 8 lanes at a time (lanes 8i .. 8i + 7: g = 2i, 2i + 1 and t = 0..3), in one pass
# only if those 8 loads fall in 8 distinct groups. The exercise asks for the row strides that
# make it so, checked on the host (no GPU, no simulator).

KERNEL_HEAD_DIMS = tuple(range(8, 129, 8))     # the D a kernel is built for (d rounded up to 8)


def fragment_strides(D: int) -> tuple[int, int]:
    """The course's answer: words a row of K's parts and of V's parts (``k_stride``, ``v_stride``)."""
    return k_stride(D), v_stride(D)


def check_fragment_strides_case(fn, D):
    """The property: (KW, VW) = fn(D) are ints; a row holds its parts (KW >= 2 D, VW >= 4 D) with
    fewer than 32 words of padding; rows start 16-byte aligned (multiples of 4 words); and in
    every phase of 8 lanes, S's loads (lane (g, t): key row g, words 16 s + 4 t) and P V's
    (key pair t, words 4 (8 dt + g)) each hit 8 distinct 16-byte bank groups."""
    out = fn(D)
    assert isinstance(out, tuple) and len(out) == 2, f"expected a pair (k_stride, v_stride), got {out!r}"
    KW, VW = out
    assert all(isinstance(x, (int, np.integer)) for x in out), f"expected two ints, got {out!r}"
    assert 2 * D <= KW < 2 * D + 32, f"D = {D}: a row of K's parts is 2 D = {2 * D} words, at most 31 more; got {KW}"
    assert 4 * D <= VW < 4 * D + 32, f"D = {D}: a row of V's parts is 4 D = {4 * D} words, at most 31 more; got {VW}"
    assert KW % 4 == 0 and VW % 4 == 0, f"D = {D}: rows must start 16-byte aligned (strides multiples of 4 words); " \
                                        f"got {KW}, {VW}"
    for phase in range(4):
        lanes = [(lane // 4, lane % 4) for lane in range(8 * phase, 8 * phase + 8)]
        for step in range(D // 8):
            for what, words in (("S's K fragments", [g * KW + 16 * step + 4 * t for g, t in lanes]),
                                ("P V's V fragments", [t * VW + 4 * (8 * step + g) for g, t in lanes])):
                groups = [w // 4 % 8 for w in words]
                assert len(set(groups)) == 8, (f"D = {D}, k-step {step}: {what}, lanes {8 * phase}..{8 * phase + 7} "
                                               f"hit bank groups {groups}: {8 - len(set(groups))} of the 8 loads wait for "
                                               f"another pass")


def check_fragment_strides(fn, max_examples=None):
    """Exercise: write ``fn(D) -> (k_stride, v_stride)``. Prints "passed" or the smallest failing D."""
    from hypothesis import strategies as st

    from kernels.base.testing import check_exercise

    return check_exercise(lambda D: check_fragment_strides_case(fn, D), st.sampled_from(KERNEL_HEAD_DIMS), host=True,
                          max_examples=max_examples)
