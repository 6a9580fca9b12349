"""Attention when the on-chip memory is smaller than d^2: the unfused algorithm of [5].

FlashAttention's tiles come from M, the elements a block holds on chip: Bc ~ M / 4d keys
a tile. Once M < d^2 (d = 256 in fp32 on an H100: d^2 = 65,536 > 58,112 floats of shared
memory a block) a tile of fewer than d / 4 keys makes the N^2 d^2 / M of Theorem 2 [1]
larger than writing the whole N x N score matrix. Saha and Ye [5] show the optimum there
is Theta(N^2 d / sqrt(M)), the IO of the matrix products themselves (Hong and Kung), and
reach it without fusion, as chapter 1 did, but with each product tiled for M:

    (a) S = scale Q K^T   b x b output blocks; the sum over d in chunks of b: a block of Q
                          (b x b) and one of K (b x b) in shared memory, the S block (b x b)
                          too; S (N x N a head) goes to an HBM workspace
    (b) P = softmax(S), L chapter 3's row softmax, in place: S read once, P written over it,
                          L = m + log l of each row
    (c) O = P V           b x b output blocks; the sum over N in chunks of b: a block of P
                          and one of V in shared memory, the O block too

b is the largest side with 3 b^2 + b <= M (``io_theory.small_cache_tile``): on the H100,
M = 58,112 gives b = 139. Writing S costs N^2 accesses, which is at most
N^2 d / sqrt(M) exactly when sqrt(M) <= d: the point of the algorithm is that in this
regime materialising S is cheaper than the passes a fused kernel would make.

HBM elements a head, counted in the simulator (``hbm_elements``), with T = ceil(N/b),
Td = ceil(d/b), non-causal, Nq = Nk = N:

    (a) reads 2 N d T (Q and K, once per block of the other), writes N^2
    (b) reads N^2, writes N^2 (P over S) + N (L)
    (c) reads N^2 Td (P) + N d T (V), writes N d

``io_theory.small_cache_accesses`` counts the same algorithm with an L-only pass (b) and
exp(S - L) formed in (c): against it, this kernel writes P (+ N^2) and never reads L in
(c) (- N Td). Causal: an S block above the diagonal is written -inf without loading Q or
K; (c) stops its N sum at the last key a row of the block sees; a row that sees no key
gets P = 0, L = -inf, O = 0 (bottom-right aligned, as the course).

A teaching kernel: one b x b output block a thread block, each thread a strided set of
its elements, the accumulator in shared memory (so that the block holds 3 b^2 elements
of M, as in the count); no register micro-tiles.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda, float32, int32

from kernels.base.fused import MINUS_INF
from kernels.base.runtime import ArrayKind, cdiv, check_flag, check_qkv, check_scale, device_empty, on_simulator, \
    to_device
from kernels.base.shared_memory import STATIC_LIMIT_BYTES, launch_with_shared, max_dynamic_shared_bytes, shared_view
from kernels.io_theory import small_cache_tile
from kernels.online_softmax import default_tiles as softmax_tiles
from kernels.online_softmax import make_row_softmax

__all__ = ["small_cache_attention", "make_block_product", "hbm_elements", "default_tile", "SIM_M", "THREADS_GPU",
           "THREADS_SIM", "MAX_HEAD_DIM", "small_cache_rows", "ptx_targets"]

SIM_M = 3 * 8 * 8 + 8         # the simulator's "shared memory": b = 8
THREADS_GPU = 1024            # one block a SM at 227 KB: all its warps hide the latency
THREADS_SIM = 64
MAX_HEAD_DIM = 256
MAX_GRID_Z = 65535


def default_tile() -> int:
    """b for the device: the largest b with 3 b^2 + b <= M, M = a block's shared memory in
    fp32 elements (58,112 on an H100: b = 139); ``SIM_M`` in the simulator (b = 8)."""
    M = SIM_M if on_simulator() else max_dynamic_shared_bytes() // 4
    return small_cache_tile(M)


def hbm_elements(n_q: int, n_k: int, d: int, b: int) -> dict:
    """HBM elements read and written by the three launches, one head, no mask, exactly
    (the softmax row on chip: n_k <= its threads x registers, 16,384 on a GPU).
    Returns {"read", "written"} and each launch's ("scores", "softmax", "pv")."""
    T_q, T_k, T_d = cdiv(n_q, b), cdiv(n_k, b), cdiv(d, b)
    scores = (n_q * d * T_k + n_k * d * T_q, n_q * n_k)
    soft = (n_q * n_k, n_q * n_k + n_q)
    pv = (n_q * n_k * T_d + n_k * d * T_q, n_q * d)
    return {"read": scores[0] + soft[0] + pv[0], "written": scores[1] + soft[1] + pv[1],
            "scores": scores, "softmax": soft, "pv": pv}


@functools.lru_cache(maxsize=None)
def make_block_product(b: int, threads: int, scores: bool, dynamic: bool = False):
    """Kernel (a, bm, c, scale, causal, offset) on (Z, rows, ...) arrays, grid
    (cdiv(cols, b), cdiv(rows, b), Z), ``threads`` threads: one b x b block of c a block.

    scores=True:  c = scale a bm^T  (a: Q (Z, Nq, d), bm: K (Z, Nk, d), c: S (Z, Nq, Nk));
                  causal: S[i, j] = -inf for j > i + offset (offset = Nk - Nq).
    scores=False: c = a bm          (a: P (Z, Nq, Nk), bm: V (Z, Nk, d), c: O (Z, Nq, d));
                  causal: the sum stops at key last_row + offset (P is 0 beyond it).
    The inner dimension is summed in chunks of b. ``dynamic``: the three b x b tiles in
    dynamic shared memory (3 b^2 floats, above 48 KB), launched by ``launch_with_shared``."""
    B = b
    BB = b * b
    NT = threads
    SHARED = 0 if dynamic else 3 * BB
    # at most 65,536 / threads registers a thread, or a 1,024-thread launch fails (64 without a cap)
    caps = {} if on_simulator() else {"max_registers": min(255, 65536 // threads)}

    @cuda.jit(**caps)
    def block_product(a, bm, c, scale, causal, offset):
        smem = cuda.shared.array(SHARED, float32)
        As = shared_view(smem, 0, (B, B))               # a chunk of Q (or P): rows i, columns k
        Bs = shared_view(smem, BB, (B, B))              # a chunk of K^T (or V): rows k, columns j
        Cs = shared_view(smem, 2 * BB, (B, B))          # the output block, summed over the chunks
        z = cuda.blockIdx.z
        i0 = int32(cuda.blockIdx.y) * B
        j0 = int32(cuda.blockIdx.x) * B
        t = int32(cuda.threadIdx.x)
        n_rows, n_cols, n_inner = int32(c.shape[1]), int32(c.shape[2]), int32(a.shape[2])
        last_row = min(i0 + B, n_rows) - 1
        k_end = n_inner
        if scores and causal != 0 and j0 > last_row + offset:
            # ---- a block of S above the diagonal: -inf, nothing loaded
            for e in range(t, BB, NT):
                i, j = i0 + e // B, j0 + e % B
                if i < n_rows and j < n_cols:
                    c[z, i, j] = MINUS_INF
            return
        if not scores and causal != 0:
            k_end = max(int32(0), min(n_inner, last_row + offset + 1))   # P = 0 beyond: not read
        for e in range(t, BB, NT):
            Cs[e // B, e % B] = float32(0.0)
        for k0 in range(0, k_end, B):                 # ---- the inner sum, a chunk of b at a time
            kb = min(B, k_end - k0)
            cuda.syncthreads()                        # every thread is done with the last chunk
            for e in range(t, BB, NT):
                r, q = e // B, e % B
                As[r, q] = a[z, i0 + r, k0 + q] if i0 + r < n_rows and q < kb else float32(0.0)
                if scores:                            # K rows j0 + r, columns k0 + q, stored transposed
                    Bs[q, r] = bm[z, j0 + r, k0 + q] if j0 + r < n_cols and q < kb else float32(0.0)
                else:                                 # V rows k0 + r, columns j0 + q
                    Bs[r, q] = bm[z, k0 + r, j0 + q] if r < kb and j0 + q < n_cols else float32(0.0)
            cuda.syncthreads()
            for e in range(t, BB, NT):                # C_block += A_chunk B_chunk
                i, j = e // B, e % B
                acc = float32(0.0)
                for kk in range(kb):
                    acc += As[i, kk] * Bs[kk, j]
                Cs[i, j] += acc
        for e in range(t, BB, NT):                    # ---- the block to HBM (each thread its own elements)
            i, j = e // B, e % B
            if i0 + i < n_rows and j0 + j < n_cols:
                if scores:
                    masked = causal != 0 and j0 + j > i0 + i + offset
                    c[z, i0 + i, j0 + j] = MINUS_INF if masked else scale * Cs[i, j]
                else:
                    c[z, i0 + i, j0 + j] = Cs[i, j]

    return block_product


def _check_tile(tile):
    if tile is None:
        return default_tile()
    if isinstance(tile, bool) or not isinstance(tile, (int, np.integer)):
        raise TypeError(f"tile: expected an int b (the side of the square blocks) or None, got {type(tile).__name__}")
    tile = int(tile)
    limit = max_dynamic_shared_bytes()
    if tile < 1 or 3 * tile * tile * 4 > limit:
        raise ValueError(f"tile: expected 1 <= b with 3 b^2 fp32 elements in {limit} bytes of shared memory, "
                         f"got {tile}")
    return tile


def _product(b, scores, grid, args):
    threads = min(THREADS_SIM if on_simulator() else THREADS_GPU, b * b)
    nbytes = 3 * b * b * 4
    launch_with_shared(lambda dynamic: make_block_product(b, threads, scores, dynamic), nbytes, grid, threads, args)


def small_cache_attention(q, k, v, *, causal=False, scale=None, tile=None):
    """Attention forward by the unfused algorithm of [5] for M < d^2: S = scale Q K^T to an
    HBM workspace (Nq x Nk a head), chapter 3's row softmax in place (P and L), O = P V;
    both products tiled in b x b blocks. q (B, H, Nq, d), k and v (B, H, Nk, d) float32,
    d <= 256. Returns (o, lse) like chapter 4's ``flash_attention``: o (B, H, Nq, d), lse
    (B, H, Nq) float32 (natural log; a row that sees no key: O = 0, L = -inf). ``tile``:
    b, by default ``default_tile()``. NumPy in, NumPy out; device arrays in, device out."""
    B, H, n_q, n_k, d, _ = check_qkv(q, k, v, dtypes=(np.float32,), max_head_dim=MAX_HEAD_DIM)
    causal = check_flag(causal, "causal")
    scale = check_scale(scale, d)
    b = _check_tile(tile)
    BH = B * H
    if BH > MAX_GRID_Z:
        raise ValueError(f"q: expected B*H <= {MAX_GRID_Z}, got B={B}, H={H}")
    kind = ArrayKind(q)
    o = device_empty((BH, n_q, d))
    lse = device_empty((BH, n_q))
    if BH and n_q:
        qv, kv, vv = (to_device(x, name).reshape(BH, x.shape[2], d) for x, name in ((q, "q"), (k, "k"), (v, "v")))
        s = device_empty((BH, n_q, n_k))              # the workspace: S, then P over it
        flags = (np.int32(causal), np.int32(n_k - n_q))
        if n_k:
            _product(b, True, (cdiv(n_k, b), cdiv(n_q, b), BH), (qv, kv, s, np.float32(scale), *flags))
        tpr, rpb, kr = softmax_tiles(n_k)
        rows = s.reshape(BH * n_q, n_k)
        make_row_softmax(tpr, rpb, kr)[cdiv(BH * n_q, rpb), tpr * rpb](rows, rows, lse.reshape(BH * n_q))
        _product(b, False, (cdiv(d, b), cdiv(n_q, b), BH), (s, vv, o, np.float32(1.0), *flags))
    return kind.give_back(o.reshape(B, H, n_q, d)), kind.give_back(lse.reshape(B, H, n_q))


def small_cache_rows(ctx, chapter: int = 10) -> list:
    """Bench rows (``kernels.bench.harness.Result``) for chapter 10: this algorithm at
    B = 1, H = 16, N = 4096, fp32, d = 256 (M < d^2 on an H100) and d = 128 (M > d^2),
    with b = ``default_tile()``, beside chapter 4's ``flash_attention`` at d = 128 (it takes
    d <= 128). ``model_bytes``: 4 bytes times ``hbm_elements`` for this kernel, chapter 4's
    IO model (2Nd + N + 2Nd Tr) for the fused one; ``extra`` holds io_theory's count
    (``small_cache_accesses``) and the two orders, N^2 d / sqrt(M) and N^2 d^2 / M, all
    for B H heads in elements. Simulator: one tiny shape. The launcher allocates its
    N x N workspace each call (1 GB at this shape): part of the time measured."""
    from kernels import io_theory
    from kernels.base import io_model
    from kernels.flash_forward import default_tiles as flash_tiles
    from kernels.flash_forward import flash_attention

    sim = on_simulator()
    shapes = [(1, 1, 12, 16)] if sim else [(1, 16, 4096, 256), (1, 16, 4096, 128)]
    M = SIM_M if sim else max_dynamic_shared_bytes() // 4
    b = small_cache_tile(M)
    out = []
    for B, H, n, d in shapes:
        rng = np.random.default_rng(n + d)
        sets = [tuple(cuda.to_device(rng.standard_normal((B, H, n, d)).astype(np.float32)) for _ in range(3))
                for _ in range(1 if sim else 2)]
        config = f"B={B} H={H} N={n} d={d} fp32"
        flops = 4.0 * B * H * n * n * d
        count = hbm_elements(n, n, d, b)
        heads = B * H
        extra = {"N": n, "d": d, "M": M, "b": b, "regime": io_theory.regime(d, M),
                 "elements_read": heads * count["read"], "elements_written": heads * count["written"],
                 "io_theory_elements": heads * io_theory.small_cache_accesses(n, d, M)["total"],
                 "order_small_cache": heads * io_theory.small_cache_order(n, d, M),
                 "order_theorem2": heads * io_theory.theorem2_order(n, d, M)}
        out.append(ctx.measure(chapter, "small-cache (S in HBM, b x b products)", f"{config} b={b}",
                               lambda q, k, v: small_cache_attention(q, k, v), sets, flops=flops,
                               model_bytes=4.0 * heads * (count["read"] + count["written"]), peak_memory=False,
                               note=f"M = {M} fp32 elements a block, b = {b}: {io_theory.regime(d, M)}",
                               extra=extra))
        if d <= 128:
            t = flash_tiles(d)
            fused = io_model.fused_forward_elements(n, n, d, Br=t.Br, Bc=t.Bc)
            out.append(ctx.measure(chapter, "chapter 4 flash_attention (fused)", config,
                                   lambda q, k, v: flash_attention(q, k, v, products="fma"), sets, flops=flops,
                                   model_bytes=4.0 * heads * fused, peak_memory=False,
                                   note=f"FlashAttention-2 order, Br={t.Br} Bc={t.Bc}: 2Nd + N + 2Nd Tr a head",
                                   extra={"N": n, "d": d, "M": M, "regime": io_theory.regime(d, M),
                                          "order_small_cache": heads * io_theory.small_cache_order(n, d, M),
                                          "order_theorem2": heads * io_theory.theorem2_order(n, d, M)}))
    return out


def ptx_targets(every_shape: bool = False):
    """Both products at the H100's tile (b = 139 from M = 58,112: 3 b^2 floats of dynamic
    shared memory) and at a tile that fits static shared memory (b = 64). The softmax is
    chapter 3's kernel (its own targets)."""
    sig = "void(float32[:, :, ::1], float32[:, :, ::1], float32[:, :, ::1], float32, int32, int32)"
    b_h100 = small_cache_tile(227 * 1024 // 4)
    out = []
    for b in (b_h100, 64):
        dynamic = 3 * b * b * 4 > STATIC_LIMIT_BYTES
        threads = min(THREADS_GPU, b * b)
        for scores, name in ((True, "S = scale Q K^T"), (False, "O = P V")):
            out.append((f"small-cache {name} b={b} threads={threads}{' dynamic' if dynamic else ''}",
                        make_block_product(b, threads, scores, dynamic), sig))
    return out
