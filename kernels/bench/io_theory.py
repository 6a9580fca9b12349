"""Chapter 10's bench: FlashAttention-1's loop order against FlashAttention-2's, with the
HBM traffic each one's closed form predicts.

At B = 1, H = 16, d = 64, fp32, N = 1024 and 4096 (``--quick``: 1024; the simulator: a
tiny shape): ``kv_outer_attention`` (Algorithm 1: K/V outer, O, l and m through HBM every
step; one block a head) and chapter 4's query-tile rung 2 (``query_tile_attention``,
the same thread layout in FlashAttention-2's order: one block a query tile), both at
Br = Bc = 64, and chapter 4's production kernel for scale. ``model_bytes`` is each
order's closed form (``kernels.kv_outer_forward.hbm_elements``, 4 bytes an element, B H
heads), so ``gbps`` is the traffic the algorithm asks of memory a second, whatever the L2
serves; Nsight Compute's DRAM bytes (``python -m kernels.bench.ncu``) say what reached HBM.
Then the M < d^2 algorithm (``kernels.small_cache_attention``, after Saha and Ye) at d = 256
and 128, fp32, N = 4096, beside chapter 4's kernel at d = 128.
"""

from __future__ import annotations

import numpy as np

import kernels  # noqa: F401  (GPU or simulator first)
from kernels.bench.harness import Result
from kernels.flash_forward import flash_attention, query_tile_attention
from kernels.kv_outer_forward import hbm_elements, kv_outer_attention
from kernels.small_cache_attention import small_cache_rows

CHAPTER = 10
TITLE = "IO theory: the two loop orders"


def _shapes(ctx):
    if ctx.simulator:
        return [(1, 1, 12, 8)], (4, 4)
    return [(1, 16, n, 64) for n in ((1024,) if ctx.quick else (1024, 4096))], (64, 64)


def run(ctx) -> list[Result]:
    from numba import cuda

    results: list[Result] = []
    shapes, (Br, Bc) = _shapes(ctx)
    for b, h, n, d in shapes:
        rng = np.random.default_rng(n)
        sets = [tuple(cuda.to_device(rng.standard_normal((b, h, n, d)).astype(np.float32)) for _ in range(3))
                for _ in range(1 if ctx.simulator else 2)]
        config = f"B={b} H={h} N={n} d={d} fp32 Br={Br} Bc={Bc}"
        flops = 4.0 * b * h * n * n * d
        for label, order, fn in (
                ("Algorithm 1 order (kv-outer)", "kv-outer",
                 lambda q, k, v: kv_outer_attention(q, k, v, tiles=(Br, Bc))),
                ("FlashAttention-2 order (ch 4 rung 2)", "q-outer",
                 lambda q, k, v: query_tile_attention(q, k, v, tiles=(Br, Bc)))):
            count = hbm_elements(n, n, d, Br, Bc, order)
            model = 4.0 * b * h * (count["read"] + count["written"])
            results.append(ctx.measure(CHAPTER, label, config, fn, sets, flops=flops, model_bytes=model,
                                       peak_memory=False,
                                       note=f"closed-form HBM traffic {model / 1e6:.1f} MB (launcher)",
                                       extra={"N": n, "order": order, "elements_read": count["read"],
                                              "elements_written": count["written"]}))
        results.append(ctx.measure(CHAPTER, "chapter 4 production kernel", config.rsplit(" Br=", 1)[0],
                                   lambda q, k, v: flash_attention(q, k, v, products="fma"), sets, flops=flops,
                                   model_bytes=4.0 * b * h * 4 * n * d, peak_memory=False,
                                   note="flash_attention() with its default tiles: compulsory bytes",
                                   extra={"N": n, "order": "q-outer"}))
    results.extend(small_cache_rows(ctx))          # the M < d^2 algorithm at d = 256 and 128
    results.extend(_dropout_rows(ctx))
    return results


def _dropout_rows(ctx) -> list[Result]:
    """Dropout's cost: the forward and backward at p = 0.1 against p = 0 (the same kernels,
    every element kept), and chapter 4's and 5's query-tile rungs (the kernels they extend)."""
    from numba import cuda

    from kernels.dropout import dropout_attention, dropout_attention_backward
    from kernels.flash_backward import shared_tile_backward

    b, h, n, d = (1, 1, 12, 8) if ctx.simulator else (1, 16, 4096, 64)
    rng = np.random.default_rng(7)
    q, k, v, do = (cuda.to_device(rng.standard_normal((b, h, n, d)).astype(np.float32)) for _ in range(4))
    o, lse = dropout_attention(q, k, v, p=0.0, seed=1)
    config = f"B={b} H={h} N={n} d={d} fp32"
    fwd, bwd = 4.0 * b * h * n * n * d, 10.0 * b * h * n * n * d
    out = [ctx.measure(CHAPTER, "chapter 4 rung 2 forward (no dropout)", config,
                       lambda: query_tile_attention(q, k, v), [()], flops=fwd, model_bytes=0.0, peak_memory=False,
                       extra={"N": n, "p": 0.0}),
           ctx.measure(CHAPTER, "chapter 5 rung 2 backward (no dropout)", config,
                       lambda: shared_tile_backward(q, k, v, o, lse, do), [()], flops=bwd, model_bytes=0.0,
                       peak_memory=False, extra={"N": n, "p": 0.0})]
    for p in (0.0, 0.1):
        out.append(ctx.measure(CHAPTER, f"dropout forward p={p}", config,
                               lambda p=p: dropout_attention(q, k, v, p=p, seed=1), [()], flops=fwd,
                               model_bytes=0.0, peak_memory=False, note="Philox regenerated, no mask stored",
                               extra={"N": n, "p": p}))
        out.append(ctx.measure(CHAPTER, f"dropout backward p={p}", config,
                               lambda p=p: dropout_attention_backward(q, k, v, o, lse, do, p=p, seed=1), [()],
                               flops=bwd, model_bytes=0.0, peak_memory=False,
                               note="the forward's mask regenerated from the same seed", extra={"N": n, "p": p}))
    return out
