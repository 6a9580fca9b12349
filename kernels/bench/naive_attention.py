"""Chapter 1's bench: the three naive kernels, their sum, and plain attention elsewhere.

Reference configuration: B=4, H=16, d=64, fp32, non-causal, N = 1024, 2048, 4096
(``--quick``: N = 1024 and 4096). Every N measures, in the same run:

* ``S kernel``      S = scale * Q K^T        model bytes 4 (2Nd + N^2) a head
* ``softmax kernel`` P = softmax(S), L      model bytes 4 (2N^2 + N) a head
* ``PV kernel``     O = P V                  model bytes 4 (N^2 + 2Nd) a head
* ``S kernel, first version`` and ``softmax kernel, first version``: one thread an element
  of S, one thread a row (the notebook's kernel exercises), same model bytes;
* ``naive attention (3 kernels)``: the three launches on preallocated S, P, L, O:
  4 (4Nd + 4N^2 + N) a head, the standard forward of ``kernels.base.io_model``;
* ``naive_attention()``: the launcher as a user calls it (it allocates S and P each
  call: its peak memory is the 2 B H N^2 floats the chapter is about);
* peers: plain PyTorch (q @ k^T * scale -> softmax -> @ v, fp32, TF32 off), the same
  in CuPy, and PyTorch SDPA's math backend; SDPA's memory-efficient backend (fused, what
  chapter 4 builds) as the yardstick of what not writing S and P buys.

``model_bytes`` is the IO model's count for the three-kernel path (peers get the same
figure, so their GB/s is "effective": the extra passes they make are not counted), so
GB/s shows how close each kernel runs to the copy bandwidth (about 3 TB/s on the H100:
``kernels.base.io_model.ceilings()``, from workbook/results/gpu_basics.csv). The S and PV
kernels also do 2 N^2 d FLOPs a head: at d = 64 that is 32 FLOP a byte of S, above the
H100's fp32 ridge (~17, ``ridge_point()``), so on the FMA units they are bound by arithmetic, the softmax by
HBM. The kernels are timed as bare launches on prebuilt views (no argument checks).
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda

from kernels import reference as ref
from kernels.bench.harness import Result, cupy_or_none, torch_or_none
from kernels.naive_attention import (
    FIRST_THREADS,
    Tiles,
    default_tiles,
    io_model_bytes,
    make_first_row_softmax,
    make_first_scores,
    make_row_softmax,
    make_scores,
    make_weighted_sum,
    naive_attention,
    softmax_regs,
)
from kernels.base.runtime import cdiv

CHAPTER = 1
TITLE = "naive attention"

# Bigger register tiles for the two matrix products (8 x 8 a thread), measured next to the
# defaults in a full GPU run: fewer shared-memory loads per FMA, fewer blocks.
ALT_TILES = Tiles(br=128, bc=128, bd=64, bk=32, tm=8, tn=8)


def _sizes(ctx):
    """(B, H, N, d) to measure."""
    if ctx.simulator:
        return [(1, 1, 16, 8)] if ctx.quick else [(1, 1, 16, 8), (1, 2, 32, 16)]
    ns = (1024, 4096) if ctx.quick else (1024, 2048, 4096)
    return [(4, 16, n, 64) for n in ns]


def _input_sets(b, h, n, d, count, cp):
    """``count`` (q, k, v) sets of float32 N(0, 1) device arrays (never zeros)."""
    sets = []
    for i in range(count):
        if cp is not None:
            cp.random.seed(200 + i)
            qkv = tuple(cuda.as_cuda_array(cp.random.standard_normal((b, h, n, d), dtype=cp.float32))
                        for _ in range(3))
        else:
            rng = np.random.default_rng(200 + i)
            qkv = tuple(cuda.to_device(rng.standard_normal((b, h, n, d)).astype(np.float32)) for _ in range(3))
        sets.append(qkv)
    return sets


def _check_head(o, q, k, v, scale):
    """Head (0, 0) of the result against the float64 oracle (the tests check it properly)."""
    q0, k0, v0 = (x[0:1, 0:1].copy_to_host() for x in (q, k, v))
    exact, _ = ref.attention(q0, k0, v0, scale=scale)
    got = o[0:1, 0:1].copy_to_host()
    err = float(np.max(np.abs(got - exact)))
    assert err < 1e-4, f"naive attention differs from the oracle by {err:.3g} on head (0, 0)"


def run(ctx) -> list[Result]:
    cp = cupy_or_none()
    torch = torch_or_none()
    tiles = default_tiles()
    results = []
    for b, h, n, d in _sizes(ctx):
        config = f"B={b} H={h} N={n} d={d} fp32 causal=False"
        bh = b * h
        scale = 1.0 / math.sqrt(d)
        scale32 = np.float32(scale)
        flops_matmul = 2.0 * bh * n * n * d
        flops = 2 * flops_matmul                             # 4 B H N^2 d
        model = io_model_bytes(b, h, n, n, d)
        extra = {"N": n}
        sets = _input_sets(b, h, n, d, 2, cp)

        # Preallocated intermediates and output, and (B*H, N, X) views for bare launches.
        s = cuda.device_array((b, h, n, n), np.float32)
        p = cuda.device_array((b, h, n, n), np.float32)
        lse = cuda.device_array((b, h, n), np.float32)
        o = cuda.device_array((b, h, n, d), np.float32)
        s3, p3, l2, o3 = s.reshape(bh, n, n), p.reshape(bh, n, n), lse.reshape(bh, n), o.reshape(bh, n, d)
        views = [tuple(x.reshape(bh, n, d) for x in qkv) for qkv in sets]

        k_s = make_scores(tiles.br, tiles.bc, tiles.bk, tiles.tm, tiles.tn)
        g_s, t_s = (cdiv(n, tiles.bc), cdiv(n, tiles.br), bh), tiles.scores_threads
        regs = softmax_regs(n, tiles)
        k_p = make_row_softmax(tiles.softmax_threads, regs)
        g_p, t_p = (n, bh), tiles.softmax_threads
        k_o = make_weighted_sum(tiles.br, tiles.bd, tiles.bk, tiles.tm, tiles.tn)
        g_o, t_o = (cdiv(d, tiles.bd), cdiv(n, tiles.br), bh), tiles.weighted_sum_threads

        def step_s(q3, k3, v3):
            k_s[g_s, t_s](q3, k3, s3, scale32, False)

        def step_p(q3, k3, v3):
            k_p[g_p, t_p](s3, p3, l2)

        def step_o(q3, k3, v3):
            k_o[g_o, t_o](p3, v3, o3, False)

        def three(q3, k3, v3):
            step_s(q3, k3, v3)
            step_p(q3, k3, v3)
            step_o(q3, k3, v3)

        three(*views[0])
        _check_head(o, *sets[0], scale)

        tile_note = (f"Br={tiles.br} Bc={tiles.bc} Bd={tiles.bd} Bk={tiles.bk} {tiles.tm}x{tiles.tn} a thread; "
                     f"softmax {tiles.softmax_threads} threads a row, {regs} a thread in registers")
        results.append(ctx.measure(CHAPTER, "S kernel (S = scale Q K^T)", config, step_s, views,
                                   flops=flops_matmul, model_bytes=model["scores"], peak_memory=False,
                                   note="writes the N x N S; " + tile_note, extra=dict(extra)))
        results.append(ctx.measure(CHAPTER, "softmax kernel (P = softmax S)", config, step_p, views,
                                   flops=0, model_bytes=model["row_softmax"], peak_memory=False,
                                   note="reads S, writes P and L: pure HBM traffic", extra=dict(extra)))
        results.append(ctx.measure(CHAPTER, "PV kernel (O = P V)", config, step_o, views,
                                   flops=flops_matmul, model_bytes=model["weighted_sum"], peak_memory=False,
                                   note="reads the N x N P", extra=dict(extra)))
        results.append(ctx.measure(CHAPTER, "naive attention (3 kernels)", config, three, views,
                                   flops=flops, model_bytes=model["total"], peak_memory=False,
                                   note="S, P, L, O preallocated; IO model 4Nd + 4N^2 + N a head",
                                   extra=dict(extra)))
        # The first versions (the notebook's kernel exercises): one thread an element of S,
        # one thread a row of the softmax, on the same buffers.
        k_s1, k_p1 = make_first_scores(), make_first_row_softmax()
        g_s1 = (cdiv(n, FIRST_THREADS[0]), cdiv(n, FIRST_THREADS[1]), bh)
        rows_threads = 32 if ctx.simulator else 128
        g_p1 = cdiv(bh * n, rows_threads)
        results.append(ctx.measure(
            CHAPTER, "S kernel, first version", config,
            lambda q3, k3, v3: k_s1[g_s1, FIRST_THREADS](q3, k3, s3, scale32, False), views,
            flops=flops_matmul, model_bytes=model["scores"], peak_memory=False,
            note="one thread an element of S: 2d loads of Q and K from HBM (or L2) each", extra=dict(extra)))
        results.append(ctx.measure(
            CHAPTER, "softmax kernel, first version", config,
            lambda q3, k3, v3: k_p1[g_p1, rows_threads](s3, p3, l2), views,
            flops=0, model_bytes=model["row_softmax"], peak_memory=False,
            note="one thread a row, three sweeps: a warp's 32 rows are Nk floats apart (uncoalesced)",
            extra=dict(extra)))
        k_s1[g_s1, FIRST_THREADS](*views[0][:2], s3, scale32, False)
        k_p1[g_p1, rows_threads](s3, p3, l2)
        step_o(*views[0])
        _check_head(o, *sets[0], scale)
        if not (ctx.simulator or ctx.quick):
            a = ALT_TILES
            k_s2 = make_scores(a.br, a.bc, a.bk, a.tm, a.tn)
            g_s2 = (cdiv(n, a.bc), cdiv(n, a.br), bh)
            k_o2 = make_weighted_sum(a.br, a.bd, a.bk, a.tm, a.tn)
            g_o2 = (cdiv(d, a.bd), cdiv(n, a.br), bh)
            alt_note = f"other tiles: Br={a.br} Bc={a.bc} Bd={a.bd} Bk={a.bk} {a.tm}x{a.tn} a thread"
            results.append(ctx.measure(
                CHAPTER, "S kernel (other tiles)", config,
                lambda q3, k3, v3: k_s2[g_s2, a.scores_threads](q3, k3, s3, scale32, False), views,
                flops=flops_matmul, model_bytes=model["scores"], peak_memory=False, note=alt_note,
                extra=dict(extra)))
            results.append(ctx.measure(
                CHAPTER, "PV kernel (other tiles)", config,
                lambda q3, k3, v3: k_o2[g_o2, a.weighted_sum_threads](p3, v3, o3, False), views,
                flops=flops_matmul, model_bytes=model["weighted_sum"], peak_memory=False, note=alt_note,
                extra=dict(extra)))
            three(*views[0])
            _check_head(o, *sets[0], scale)
            k_s2[g_s2, a.scores_threads](*views[0][:2], s3, scale32, False)
            k_o2[g_o2, a.weighted_sum_threads](p3, views[0][2], o3, False)
            _check_head(o, *sets[0], scale)
        del s, p, lse, o, s3, p3, l2, o3
        results.append(ctx.measure(CHAPTER, "naive_attention() launcher", config,
                                   lambda q, k, v: naive_attention(q, k, v), sets, flops=flops,
                                   model_bytes=model["total"],
                                   note="allocates S and P (2 B H N^2 floats) each call; checks arguments",
                                   extra=dict(extra), repeat=None if ctx.simulator else max(5, ctx.repeat // 3)))

        peer_note = "model_bytes: the 3-kernel IO model (the peer's own extra passes are not counted)"
        if torch is not None:
            tsets = [tuple(torch.as_tensor(x, device="cuda") for x in qkv) for qkv in sets]
            tf32 = torch.backends.cuda.matmul.allow_tf32
            torch.backends.cuda.matmul.allow_tf32 = False            # plain fp32 FMA, like ours
            try:
                def torch_plain(q, k, v):
                    return torch.softmax((q @ k.transpose(-2, -1)) * scale, dim=-1) @ v

                results.append(ctx.measure(CHAPTER, "peer: plain PyTorch fp32", config, torch_plain, tsets,
                                           flops=flops, model_bytes=model["total"], is_peer=True,
                                           note="q @ k^T * scale -> softmax -> @ v, TF32 off; " + peer_note,
                                           extra=dict(extra)))
                from torch.nn.attention import SDPBackend, sdpa_kernel
                from torch.nn.functional import scaled_dot_product_attention as sdpa

                for backend, label, note in (
                        (SDPBackend.MATH, "peer: SDPA math fp32", "unfused, S and P materialised"),
                        (SDPBackend.EFFICIENT_ATTENTION, "peer: SDPA efficient fp32",
                         "fused (chapter 4's idea): no S or P in HBM")):
                    def fn(q, k, v, backend=backend):
                        with sdpa_kernel(backend):
                            return sdpa(q, k, v, scale=scale)
                    try:
                        results.append(ctx.measure(CHAPTER, label, config, fn, tsets, flops=flops,
                                                   model_bytes=model["total"], is_peer=True,
                                                   note=note + "; " + peer_note, extra=dict(extra)))
                    except RuntimeError as exc:  # backend unavailable for this shape/dtype
                        ctx.progress(f"  skipped {label}: {exc}")
            finally:
                torch.backends.cuda.matmul.allow_tf32 = tf32
            del tsets
            torch.cuda.empty_cache()
        if cp is not None:
            csets = [tuple(cp.asarray(x) for x in qkv) for qkv in sets]

            def cupy_plain(q, k, v):
                s = cp.matmul(q, k.swapaxes(-1, -2)) * scale
                s -= s.max(axis=-1, keepdims=True)
                e = cp.exp(s, out=s)
                e /= e.sum(axis=-1, keepdims=True)
                return cp.matmul(e, v)

            results.append(ctx.measure(CHAPTER, "peer: plain CuPy fp32", config, cupy_plain, csets,
                                       flops=flops, model_bytes=model["total"], is_peer=True, peak_memory=False,
                                       note="matmul (cuBLAS) -> in-place safe softmax -> matmul; " + peer_note,
                                       extra=dict(extra)))
            del csets
            cp.get_default_memory_pool().free_all_blocks()
        del sets, views
    return results
