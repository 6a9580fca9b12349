"""fp32 attention on tensor cores: the FlashAttention-2 forward with 3xTF32 products.

Chapter 8's kernel takes fp16 or bf16. For float32 inputs the tensor cores offer TF32
(``mma.sync.m16n8k8.tf32``, 8 exponent bits and 10 of mantissa): one TF32 product errs by
about 2^-11 of |a||b|, far beyond fp32's 2^-24. Splitting each operand in two,

    a = a_hi + a_lo,   a_hi = tf32(a),   a_lo = tf32(a - a_hi)            (``split_tf32``)
    a b ~ a_lo b_hi + a_hi b_lo + a_hi b_hi                                (three mma, small first)

keeps about 22 bits: the dropped a_lo b_lo is ~2^-22 of |a||b| (chapter 11, section 2),
and three TF32 products still run faster than the FMA units' fp32 (chapter 0).

The kernel is chapter 8's loop with the m16n8k8 layout (``kernels.base.mma``):

    before             K and V split once into hi and lo parts (``make_split``, one launch): every block
                       reads every key, and a split costs three instructions. Where the
                       queries are few (Nq <= 2 Br: each key read by one or two blocks) each
                       block splits K_j and V_j in shared memory as they land instead
                       (``raw_kv``): a launch and four buffers saved (``split_before``)
    one block          Br = 16 W query rows, W warps; Q_i's A fragments stay in registers (raw
                       fp32, split at each use)
    for each K/V tile (Bc keys, hi and lo, in shared memory, rows padded by 4 words so the
    fragment loads hit 32 distinct banks; K_j copied during P V_{j-1}, V_j during S_j):
        S    = Q_i K_j^T        Bc/8 accumulator tiles of 16 x 8, D/8 k-steps of 3 mma,
                                each k-step from zero and added in fp32 (see ``product``)
        the online softmax on the accumulator fragments, as in chapter 8
        O   += P V_j            P's accumulator tile is an m16n8k8 A operand once the 8 keys
                                are renumbered: the lane holding keys 2t and 2t + 1 takes
                                them as k = t and t + 4, and reads V's rows in the same order
                                (no shuffle, no shared memory)
    O / l and L = m + log l.

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
from kernels.base.tf32_product import PASSES, make_tf32_product
from kernels.base.key_split import add_combine, choose_splits, output_names, partial_views, partials
from kernels.base.runtime import ArrayKind, BoundLaunches, LaunchCache, cdiv, check_flag, check_qkv, check_scale, \
    fill, given_out, is_device_array, launch_stream, on_simulator, run_bound, to_device

__all__ = ["flash_attention_tf32", "make_flash_forward_tf32", "make_split", "split_kv", "launch_forward",
           "tf32_tiles", "shared_words", "PASSES", "ptx_targets"]

def tf32_tiles(d: int) -> tuple[int, int, int]:
    """(Br, Bc, D), D = d rounded up to a multiple of 8 (an m16n8k8 k-step). On a GPU 128
    query rows (8 warps) and 64 keys a tile at D <= 64, 32 at D = 128: K_j and V_j as tf32
    hi and lo parts, 4 Bc (D + 4) words of shared memory (70 KB and 68 KB: dynamic shared
    memory). Measured on the H100, B=4 H=16 N=4096 (workbook/results/flash_tf32_tiles.csv):
    d = 64, 10.3 ms against 13.3 at (64, 32); d = 128, 21.7 against 23.4. In the simulator
    16 or 32 rows and 8 or 16 keys."""
    D = 8 * cdiv(max(int(d), 1), 8)
    if on_simulator():
        return (16 if D <= 16 else 32), (8 if D <= 16 else 16), D
    return 128, (64 if D <= 64 else 32), D


def shared_words(Bc: int, D: int) -> int:
    """32-bit words of shared memory a block: K_j and V_j, hi and lo, rows padded by 4."""
    return 4 * Bc * (D + 4)


@functools.lru_cache(maxsize=None)
def make_split():
    """Kernel (k, v, k_hi, k_lo, v_hi, v_lo) on 1-D arrays of one length: k_hi[i], k_lo[i] =
    split_tf32(k[i]), and the same for v (a grid-stride loop; K and V in one launch). K and
    V are split once a call, not once a query tile: every block reads the same keys."""
    from kernels.base.mma import split_tf32

    @cuda.jit
    def split(k, v, k_hi, k_lo, v_hi, v_lo):
        for i in range(cuda.grid(1), k.shape[0], cuda.gridsize(1)):
            h, l_ = split_tf32(k[i])
            k_hi[i] = h
            k_lo[i] = l_
            h, l_ = split_tf32(v[i])
            v_hi[i] = h
            v_lo[i] = l_

    return split


def split_blocks(n: int) -> int:
    """The split's grid for n elements a tensor: 256 threads a block, at most 4096 blocks."""
    return min(cdiv(n, 256), 4096)


@functools.lru_cache(maxsize=None)
def make_flash_forward_tf32(Br: int, Bc: int, D: int, passes: int = 3, dynamic: bool = False,
                            max_registers: int | None = None, split: bool = False, raw_kv: bool = False,
                            grouped: bool = False):
    """The forward kernel for Br query rows (Br / 16 warps), Bc keys a tile, head dim D (a
    multiple of 8), ``passes`` TF32 products a product (3 or 1); ``dynamic``: its shared
    memory (``shared_words``) is dynamic, for more than 48 KB; ``max_registers``: a cap on
    the registers a thread (None: the compiler's choice).

    Launch: grid (ceil(Nq / Br), B*H), 2 Br threads. Arguments: q (B*H, Nq, d) float32;
    k_hi, k_lo, v_hi, v_lo (B*Hkv, Nk, d) uint32, K and V split by ``make_split``; o (B*H, Nq,
    d) and lse (B*H, Nq) float32; scale (float32), causal (int32 0/1), kv_group (int32: H /
    Hkv; query head row bh reads KV row bh // kv_group, grouped-query attention with no
    copy; read only by the ``grouped`` kernel, which the launchers take where Hkv < H, so that
    the MHA kernel's code is the one measured before), aligned (int32: rows 16-byte aligned and d % 4 == 0, so whole 16-byte chunks go by
    cp.async). ``split``: the
    keys split among gridDim.z blocks (``kernels.base.key_split``), each writing its partial
    O and L to row blockIdx.z * B*H + bh of o (S*B*H, Nq, d) and lse (S*B*H, Nq).
    ``raw_kv``: the arguments are q, k, v (float32, not split), o, lse, ...: each block splits
    K_j and V_j in shared memory as they land (``stage_in``, ``split_landed``): where every
    key is read by one or two blocks, splitting where it is read costs less than a launch
    and four buffers (``split_before``)."""
    from kernels.base.key_split import split_range
    from kernels.base.mma import cp_async, cp_async_commit, cp_async_wait_all, cp_async_wait_prior, shared_address, \
        split_tf32, split_tf32_at
    from kernels.base.shared_memory import shared_view

    if passes not in PASSES:
        raise ValueError(f"passes: expected one of {PASSES}, got {passes!r}")
    if D % 8 or Bc % 8 or Br % 16 or Br < 16:
        raise ValueError(f"tiles: expected D and Bc multiples of 8, Br of 16; got {Br}, {Bc}, {D}")
    W = Br // 16
    THREADS = 32 * W
    KS, NS, ND = D // 8, Bc // 8, D // 8
    SD = D + 4                                    # row stride (words): fragment loads in 32 distinct banks
    CH = D // 4                                   # 16-byte chunks a row
    TILE = Bc * SD
    SHARED = 0 if dynamic else 4 * TILE
    THREE = passes == 3
    RAW = bool(raw_kv)
    GROUPED = bool(grouped)
    split4, _, product = make_tf32_product(passes)      # 3xTF32 (or plain TF32) k-steps
    scale_and_mask, online_softmax, write_rows = make_fragment_softmax(NS, ND, THREADS)

    @cuda.jit(device=True, inline=True)
    def stage_in(src, dst, dst_lo, rows, r0, d, tid, aligned):
        """src[r0 + r, :d] -> dst[r, :D] (zeros past rows and d), whole 16-byte chunks by
        cp.async. With ``raw_kv`` src is float32 K or V: a chunk cp.async brings is split once
        landed (``split_landed``), the rest split here, hi into dst and lo into dst_lo;
        without, src is a part already split and dst_lo is not used."""
        for ch in range(tid, Bc * CH, THREADS):
            r = ch // CH
            c = (ch % CH) * 4
            row = r0 + r
            if aligned != 0 and row < rows and c + 4 <= d:
                cp_async(dst, r, c, src, row, c)
            elif RAW:
                for e in range(4):
                    x = float32(0.0)
                    if row < rows and c + e < d:
                        x = src[row, c + e]
                    hi, lo = split_tf32(x)
                    dst[r, c + e] = hi
                    if THREE:
                        dst_lo[r, c + e] = lo
            else:
                for e in range(4):
                    w = uint32(0)
                    if row < rows and c + e < d:
                        w = src[row, c + e]
                    dst[r, c + e] = w

    @cuda.jit(device=True, inline=True)
    def split_landed(dst_hi, dst_lo, rows, r0, d, tid, aligned):
        """The chunks this thread's cp.async put in dst_hi (``stage_in``), once landed, split
        in place: hi to dst_hi, lo to dst_lo (the same loop: a thread splits its own chunks,
        so only its own wait comes first, and the block's barrier after)."""
        for ch in range(tid, Bc * CH, THREADS):
            r = ch // CH
            c = (ch % CH) * 4
            if aligned != 0 and r0 + r < rows and c + 4 <= d:
                for e in range(4):
                    hi, lo = split_tf32_at(shared_address(dst_hi, r, c + e))
                    dst_hi[r, c + e] = hi
                    if THREE:
                        dst_lo[r, c + e] = lo

    caps = {"max_registers": max_registers} if max_registers and not on_simulator() else {}

    @cuda.jit(device=True, inline=True)
    def attend(q, k_hi, k_lo, v_hi, v_lo, o, lse, scale, causal, kv_group, aligned):
        """The kernel's body: with ``raw_kv``, k_hi and v_hi are K and V in float32 (k_lo
        and v_lo unused)."""
        bh = int32(cuda.blockIdx.y)
        tid = int32(cuda.threadIdx.x)
        warp = tid // 32
        lane = tid % 32
        g = lane // 4                                # the fragment's row group
        t = lane % 4
        q0 = (int32(cuda.gridDim.x) - 1 - int32(cuda.blockIdx.x)) * Br     # heaviest causal tiles first
        n_q, n_k, d = int32(q.shape[1]), int32(k_hi.shape[1]), int32(q.shape[2])
        smem = cuda.shared.array(SHARED, uint32, alignment=16)
        Kh = shared_view(smem, 0, (Bc, SD))          # K_j's hi and lo parts, then V_j's
        Kl = shared_view(smem, TILE, (Bc, SD))
        Vh = shared_view(smem, 2 * TILE, (Bc, SD))
        Vl = shared_view(smem, 3 * TILE, (Bc, SD))
        kvh = bh
        if GROUPED:                                  # its KV head (a 32-bit division: // on int32 is 64-bit)
            kvh = int32(uint32(bh) // uint32(kv_group))
        khh, klh, vhh, vlh = k_hi[kvh], k_lo[kvh], v_hi[kvh], v_lo[kvh]
        wrow0 = q0 + warp * 16                       # this warp's first query row

        # ---- Q_i's A fragments, straight from HBM (each element once), kept as fp32:
        # a0 = Q[g, 8s + t], a1 = Q[g + 8, 8s + t], a2 = Q[g, 8s + t + 4], a3 = Q[g + 8, 8s + t + 4]
        qf = cuda.local.array((KS, 4), float32)
        for s_ in range(KS):
            for e in range(4):
                row = wrow0 + g + 8 * (e % 2)
                col = 8 * s_ + t + 4 * (e // 2)
                qf[s_, e] = q[bh, row, col] if row < n_q and col < d else float32(0.0)

        m = cuda.local.array(2, float32)             # running max (base 2), rows g, g + 8
        l = cuda.local.array(2, float32)             # this lane's share of the running sums
        acc = cuda.local.array((ND, 4), float32)     # O: ND accumulator tiles of 16 x 8
        sc = cuda.local.array((NS, 4), float32)      # S, then P: NS accumulator tiles
        # P again, for P V: sc stays in registers only if every index into it is known when
        # compiling, and the loop over key steps in P V is too long to unroll; a copy in
        # local memory (NS x 4 stores and loads a tile) keeps sc out of it
        pv = cuda.local.array((NS, 4), float32)
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
            stage_in(khh, Kh, Kl, n_k, first * Bc, d, tid, aligned)
            if THREE and not RAW:
                stage_in(klh, Kl, Kl, n_k, first * Bc, d, tid, aligned)
        cp_async_commit()
        for jt in range(first, end):
            k0 = jt * Bc
            cuda.syncthreads()                       # every warp is done with V_{j-1}
            stage_in(vhh, Vh, Vl, n_k, k0, d, tid, aligned)
            if THREE and not RAW:
                stage_in(vlh, Vl, Vl, n_k, k0, d, tid, aligned)
            cp_async_commit()
            cp_async_wait_prior()                    # K_j has landed (V_j may still fly)
            if RAW:
                split_landed(Kh, Kl, n_k, k0, d, tid, aligned)
            cuda.syncthreads()

            # ---- S = Q_i K_j^T: B = K_j^T, b0 = K[key g, 8s + t], b1 = K[key g, 8s + t + 4]
            for nt in range(NS):
                for e in range(4):
                    sc[nt, e] = float32(0.0)
            for s_ in range(KS):
                a_hi, a_lo = split4(qf[s_, 0], qf[s_, 1], qf[s_, 2], qf[s_, 3])
                for nt in range(NS):
                    r, c0 = nt * 8 + g, 8 * s_ + t
                    c = product(a_hi, a_lo, (Kh[r, c0], Kh[r, c0 + 4]), (Kl[r, c0], Kl[r, c0 + 4]))
                    for e in range(4):
                        sc[nt, e] += c[e]
            scale_and_mask(sc, k0, wrow0, g, t, n_k, diag, causal, scale2)
            online_softmax(sc, acc, m, l)           # P in sc; O and l rescaled
            for kp in range(NS):
                for e in range(4):
                    pv[kp, e] = sc[kp, e]

            cp_async_wait_all()                      # V_j has landed ...
            if RAW:
                split_landed(Vh, Vl, n_k, k0, d, tid, aligned)
            cuda.syncthreads()                       # ... and every warp is done with K_j
            if jt + 1 < end:
                stage_in(khh, Kh, Kl, n_k, k0 + Bc, d, tid, aligned)
                if THREE and not RAW:
                    stage_in(klh, Kl, Kl, n_k, k0 + Bc, d, tid, aligned)
            cp_async_commit()

            # ---- O += P V_j, 8 keys a step, renumbered: key 2t -> k = t, key 2t + 1 -> k = t + 4.
            # A = (P[g, 2t], P[g + 8, 2t], P[g, 2t + 1], P[g + 8, 2t + 1]) = (c0, c2, c1, c3);
            # B: b0 = V[key 2t, 8 dt + g], b1 = V[key 2t + 1, 8 dt + g].
            for kp in range(NS):
                a_hi, a_lo = split4(pv[kp, 0], pv[kp, 2], pv[kp, 1], pv[kp, 3])
                r = kp * 8 + 2 * t
                for dt in range(ND):
                    c0 = 8 * dt + g
                    c = product(a_hi, a_lo, (Vh[r, c0], Vh[r + 1, c0]), (Vl[r, c0], Vl[r + 1, c0]))
                    for e in range(4):
                        acc[dt, e] += c[e]

        cp_async_wait_all()                          # (the last, empty, group)

        write_rows(acc, m, l, o, lse, out, wrow0, g, t, n_q, d)    # O / l and L

    if raw_kv:
        @cuda.jit(fastmath=True, **caps)
        def flash_forward_tf32(q, k, v, o, lse, scale, causal, kv_group, aligned):
            attend(q, k, k, v, v, o, lse, scale, causal, kv_group, aligned)
    else:
        @cuda.jit(fastmath=True, **caps)
        def flash_forward_tf32(q, k_hi, k_lo, v_hi, v_lo, o, lse, scale, causal, kv_group, aligned):
            attend(q, k_hi, k_lo, v_hi, v_lo, o, lse, scale, causal, kv_group, aligned)

    flash_forward_tf32.threads = THREADS
    return flash_forward_tf32


def split_kv(k, v, BH, n_k, d, kind):
    """(k_hi, k_lo, v_hi, v_lo): K and V split once (``make_split``), (B*H, Nk, d) uint32
    (B*Hkv heads for grouped-query K and V), from the caller's allocator where it has one."""
    parts = [kind.empty((BH, n_k, d), np.uint32) for _ in range(4)]
    n = BH * n_k * d
    if n:
        make_split()[split_blocks(n), 256, launch_stream()](*(x.reshape(n) for x in (k, v, *parts)))
    return parts


def launch_forward(qd, parts, o, lse, scale, causal, passes, tiles=None, max_registers=None):
    """The forward on device views: qd (B*H, Nq, d) float32, ``parts`` from ``split_kv``
    ((B*Hkv, Nk, d), Hkv dividing H), into o (B*H, Nq, d) and lse (B*H, Nq); ``tiles`` (Br, Bc),
    by default ``tf32_tiles``."""
    from kernels.base.shared_memory import allow_dynamic_shared_memory, STATIC_LIMIT_BYTES

    BH, n_q, d = qd.shape
    Br, Bc, D = tf32_tiles(d)
    if tiles is not None:
        Br, Bc = tiles
    nbytes = 4 * shared_words(Bc, D)
    dynamic = nbytes > STATIC_LIMIT_BYTES and not on_simulator()
    kv_group = BH // parts[0].shape[0]
    kernel = make_flash_forward_tf32(Br, Bc, D, int(passes), dynamic, max_registers, grouped=kv_group > 1)
    aligned = int(d % 4 == 0 and all(x.__cuda_array_interface__["data"][0] % 16 == 0 for x in (qd, *parts))) \
        if not on_simulator() else int(d % 4 == 0)
    args = (qd, *parts, o, lse, np.float32(scale), np.int32(causal), np.int32(kv_group), np.int32(aligned))
    if dynamic:
        allow_dynamic_shared_memory(kernel, args, nbytes)
    kernel[(cdiv(n_q, Br), BH), kernel.threads, launch_stream(), nbytes if dynamic else 0](*args)


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


def split_before(n_q: int, Br: int) -> bool:
    """Whether K and V are split by a launch of their own before the forward (into four
    buffers), or by each block as it reads them (``raw_kv``): before, where a key is read
    by more than two blocks of query rows (Nq > 2 Br); where it is read by one or two, the
    launch and the buffers cost more than the split they save."""
    return n_q > 2 * Br


def forward_checked(kind, q, k, v, *, causal, scale, passes=3, splits=None, before=None, o=None, lse=None):
    """What ``flash_attention_tf32`` runs once its checks pass, for callers that made them
    (chapter 13's drop-in checks its tensors once): q (B, H, Nq, d), k, v (B, Hkv, Nk, d), H a
    multiple of Hkv, C-contiguous float32 device arrays, ``scale`` a float. (o, lse) from ``kind``'s
    allocator (an ``ArrayKind``), or the ``o`` (like q) and ``lse`` (B, H, Nq) float32 given;
    K and V are split into their TF32 parts each call, before
    the forward or in it (``before``; None: ``split_before``). ``splits``: the keys split
    among that many blocks a query tile, their partials merged after
    (``kernels.base.key_split``); None: split only where the grid would not fill the GPU."""
    B, H, n_q, d = q.shape
    hkv, n_k = k.shape[1], k.shape[2]
    o = kind.new((B, H, n_q, d), np.float32) if o is None else given_out(o, (B, H, n_q, d), "o")
    lse = kind.new((B, H, n_q), np.float32) if lse is None else given_out(lse, (B, H, n_q), "lse")
    if B * H and n_q and n_k:
        Br, Bc, _ = tf32_tiles(d)
        splits = choose_splits(cdiv(n_q, Br) * B * H, n_k, Bc) if splits is None else int(splits)
        before = split_before(n_q, Br) if before is None else bool(before)
        arrays = dict(q=q, k=k, v=v)
        if before:
            arrays.update(zip(SPLIT, kind.new_parts(4, (B, hkv, n_k, d), np.uint32)))   # K, V split once a call
            arrays.update((name + "_flat", arrays[name]) for name in ("k", "v", *SPLIT))  # the split's 1-D views
        arrays.update(partials(kind, splits, B * H, n_q, d))
        run_bound(_launches, (B, H, hkv, n_q, n_k, d, causal, scale, int(passes), splits, before),
                  dict(arrays, o=o, lse=lse), lambda a: _views(a, B * H, B * hkv, n_q, n_k, d),
                  lambda views, aligned: _bind_forward(views, causal, scale, passes, aligned, splits, before),
                  aligned_names=("q", *(SPLIT if before else ("k", "v"))), aligned_d=d % 4 == 0)
    elif B * H and n_q:          # nothing to attend to: O = 0, L = -inf (the kernel's answer, no launch)
        fill(o, 0.0)
        fill(lse, -np.inf)
    return o, lse


SPLIT = ("k_hi", "k_lo", "v_hi", "v_lo")
_launches = LaunchCache()          # the launcher's bound launches, by call shape


def _views(arrays, BH, BHkv, n_q, n_k, d):
    """The kernels' views: (B*H, Nq, d) for q and o, (B*Hkv, Nk, d) for k, v and the split
    parts; (B*H, Nq) for lse; 1-D for the split kernel's ``*_flat``."""
    rows = dict(q=(BH, n_q), o=(BH, n_q), k=(BHkv, n_k), v=(BHkv, n_k),
                **{name: (BHkv, n_k) for name in SPLIT if name in arrays})
    views = {name: to_device(arrays[name], name).reshape(*rows[name], d) for name in rows}
    views["lse"] = to_device(arrays["lse"], "lse").reshape(BH, n_q)
    views.update((name + "_flat", views[name].reshape(BHkv * n_k * d)) for name in ("k", "v", *SPLIT)
                 if name in rows)
    views.update(partial_views(arrays))
    return views


def _bind_forward(views, causal, scale, passes, aligned, splits=1, before=True):
    """The launches, bound: with ``before``, the split of K and V (``make_split``) and the
    forward on their parts; else the forward alone, splitting as it reads (``raw_kv``). With
    ``splits`` > 1 the forward writes the splits' partials and one more launch merges them."""
    from kernels.base.shared_memory import allow_dynamic_shared_memory, STATIC_LIMIT_BYTES

    BH, n_q, d = views["q"].shape
    Br, Bc, D = tf32_tiles(d)
    nbytes = 4 * shared_words(Bc, D)
    dynamic = nbytes > STATIC_LIMIT_BYTES and not on_simulator()
    kv_group = BH // views["k"].shape[0]
    kernel = make_flash_forward_tf32(Br, Bc, D, int(passes), dynamic, split=splits > 1, raw_kv=not before,
                                     grouped=kv_group > 1)
    names = ("q", *(SPLIT if before else ("k", "v")), *output_names(splits))
    args = tuple(views[n] for n in names) + (np.float32(scale), np.int32(causal), np.int32(kv_group),
                                             np.int32(aligned))
    if dynamic:
        allow_dynamic_shared_memory(kernel, args, nbytes)
    launches, slots = [], []
    if before:
        flat = tuple(f"{x}_flat" for x in ("k", "v", *SPLIT))
        launches.append((make_split(), split_blocks(views["k_flat"].shape[0]), 256, tuple(views[f] for f in flat), 0))
        slots.append({f: i for i, f in enumerate(flat)})
    launches.append((kernel, (cdiv(n_q, Br), BH, splits), kernel.threads, args, nbytes if dynamic else 0))
    slots.append({name: i for i, name in enumerate(names)})
    add_combine(launches, slots, views, splits)
    return BoundLaunches(launches, slots)


def ptx_targets(every_shape: bool = False):
    """The kernel at the GPU tiles, d = 64 and 128, 3xTF32 (``every_shape``: plain TF32 too),
    its grouped-query form at d = 128 (``every_shape``: at 64 too), and the split."""
    sig = ("void(float32[:, :, ::1], uint32[:, :, ::1], uint32[:, :, ::1], uint32[:, :, ::1], uint32[:, :, ::1], "
           "float32[:, :, ::1], float32[:, ::1], float32, int32, int32, int32)")
    raw_sig = ("void(float32[:, :, ::1], float32[:, :, ::1], float32[:, :, ::1], float32[:, :, ::1], "
               "float32[:, ::1], float32, int32, int32, int32)")
    out = [("split K and V into tf32 hi and lo", make_split(),
            "void(float32[::1], float32[::1], uint32[::1], uint32[::1], uint32[::1], uint32[::1])")]
    for D, Bc in ((64, 64), (128, 32)):
        Br = 128
        dynamic = 4 * shared_words(Bc, D) > 48 * 1024
        for passes in (3, 1) if every_shape else (3,):
            out.append((f"flash fwd 3xTF32 passes={passes} Br={Br} Bc={Bc} D={D}",
                        make_flash_forward_tf32(Br, Bc, D, passes, dynamic), sig))
        if every_shape:                                # K and V split as they land (short queries)
            out.append((f"flash fwd 3xTF32 raw K V Br={Br} Bc={Bc} D={D}",
                        make_flash_forward_tf32(Br, Bc, D, 3, dynamic, raw_kv=True), raw_sig))
        if D == 128 or every_shape:
            out.append((f"flash fwd 3xTF32 grouped-query Br={Br} Bc={Bc} D={D}",
                        make_flash_forward_tf32(Br, Bc, D, 3, dynamic, grouped=True), sig))
    return out
