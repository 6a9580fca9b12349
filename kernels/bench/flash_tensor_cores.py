"""The tensor-core chapter's bench: the FlashAttention-2 forward on mma.sync, fp16 and bf16.

At B=4 H=16 N=4096, d = 64 and 128, causal and not (``--quick``: d = 64 only): our kernel
through its launcher (``flash_attention_tc``) and as a bare launch on preallocated outputs;
peers in the same run on the same inputs: PyTorch SDPA's flash, cuDNN and memory-efficient
backends (fp16 and bf16), and chapter 4's fp32-FMA kernel on the fp16 inputs. FLOPs
4 B H N^2 d (halved for causal).
"""

from __future__ import annotations

import math

import numpy as np

import kernels  # noqa: F401  (GPU or simulator first)
from kernels import reference as ref
from kernels.bench.harness import Result, torch_or_none
from kernels.flash_tensor_cores import flash_attention_tc, make_flash_forward_mma, tc_tiles
from kernels.base.runtime import cdiv

CHAPTER = 8
TITLE = "tensor cores"


def _inputs(b, h, n, d, count, bf16, seed=800):
    """``count`` (q, k, v) sets as 16-bit device arrays (fp16, or bf16 bits as uint16),
    N(0, 1) values, and the same values as float64 for the spot check."""
    from numba import cuda

    from kernels.base.mma import bf16_bits

    sets, values = [], []
    for i in range(count):
        rng = np.random.default_rng(seed + i)
        xs = [rng.standard_normal((b, h, n, d)).astype(np.float32) for _ in range(3)]
        if bf16:
            bits = [bf16_bits(x).astype(np.uint16) for x in xs]
            vals = [(x.astype(np.uint32) << 16).view(np.float32) for x in bits]
        else:
            bits = [x.astype(np.float16) for x in xs]
            vals = [x.astype(np.float32) for x in bits]
        sets.append(tuple(cuda.to_device(x) for x in bits))
        values.append(vals)
    return sets, values


def _check_head(o, vals, causal):
    """Head (0, 0) against the float64 oracle: a guard against a broken run (the tests
    hold the kernel to the tolerance rule)."""
    q, k, v = (x[0:1, 0:1].astype(np.float64) for x in vals)
    exact, _ = ref.attention(q, k, v, causal=causal)
    got = np.asarray(o[0:1, 0:1].copy_to_host() if hasattr(o, "copy_to_host") else o[0:1, 0:1])
    err = float(np.max(np.abs(got - exact)))
    assert err < 2e-2, f"tensor-core forward differs from the oracle by {err:.3g} on head (0, 0)"
    return err


def run(ctx) -> list[Result]:
    from numba import cuda

    torch = torch_or_none()
    results: list[Result] = []
    b, h, n = (1, 1, 16) if ctx.simulator else (4, 16, 4096)
    dims = (16,) if ctx.simulator else ((64,) if ctx.quick else (64, 128))
    for d in dims:
        for bf16 in (False, True):
            kind = "bf16" if bf16 else "fp16"
            sets, values = _inputs(b, h, n, d, 2, bf16)
            Br, Bc, D = tc_tiles(d)
            kernel = make_flash_forward_mma(Br, Bc, D, bf16)
            o = cuda.device_array((b * h, n, d), np.float32)
            lse = cuda.device_array((b * h, n), np.float32)
            for causal in (False, True):
                config = f"B={b} H={h} N={n} d={d} {kind} causal={causal}"
                flops = 4.0 * b * h * n * n * d / (2 if causal else 1)
                model = 2.0 * b * h * n * d * 3 + 4.0 * b * h * n * (d + 1)
                extra = {"N": n, "d": d, "causal": causal, "dtype": kind}

                def bare(q, k, v, causal=causal):
                    q, k, v = (x.view(np.uint16).reshape(b * h, n, d) for x in (q, k, v))   # the bits
                    kernel[(cdiv(n, Br), b * h), kernel.threads](
                        q, k, v, o, lse, np.float32(1 / math.sqrt(d)), np.int32(causal), np.int32(d % 8 == 0))

                bare(*sets[0])
                err = _check_head(o.copy_to_host().reshape(b, h, n, d), values[0], causal)
                results.append(ctx.measure(CHAPTER, "flash fwd tensor cores (bare)", config, bare, sets,
                                           flops=flops, model_bytes=model, peak_memory=False,
                                           note=f"bare launch, Br={Br} Bc={Bc}; head (0,0) max error {err:.1e}",
                                           extra=dict(extra)))
                results.append(ctx.measure(CHAPTER, "flash_attention_tc() launcher", config,
                                           lambda q, k, v, c=causal: flash_attention_tc(q, k, v, causal=c, bf16=bf16),
                                           sets, flops=flops, model_bytes=model, peak_memory=False,
                                           note="checks arguments, allocates O and L each call", extra=dict(extra)))
                if not bf16 and not ctx.simulator:
                    from kernels.flash_forward import flash_attention

                    results.append(ctx.measure(CHAPTER, "chapter 4 fp32 FMA kernel (fp16 in)", config,
                                               lambda q, k, v, c=causal: flash_attention(q, k, v, causal=c),
                                               sets, flops=flops, model_bytes=model, peak_memory=False,
                                               note="flash_attention(): fp16 inputs, fp32 math on the FMA units",
                                               extra=dict(extra)))
                if torch is not None:
                    _sdpa_peers(ctx, results, torch, sets, bf16, causal, config, flops, model, extra)
            del sets
    return results


def _sdpa_peers(ctx, results, torch, sets, bf16, causal, config, flops, model, extra):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    dtype = torch.bfloat16 if bf16 else torch.float16
    tsets = [tuple(torch.as_tensor(x, device="cuda").view(dtype) for x in s) for s in sets]
    for backend, label in ((SDPBackend.FLASH_ATTENTION, "SDPA flash"), (SDPBackend.CUDNN_ATTENTION, "SDPA cuDNN"),
                           (SDPBackend.EFFICIENT_ATTENTION, "SDPA memory-efficient")):
        def fn(q, k, v, backend=backend):
            with sdpa_kernel(backend):
                return sdpa(q, k, v, is_causal=causal)
        try:
            results.append(ctx.measure(CHAPTER, f"peer: {label}", config, fn, tsets, flops=flops,
                                       model_bytes=model, is_peer=True, peak_memory=False,
                                       note="tensor cores", extra=dict(extra)))
        except RuntimeError as exc:
            ctx.progress(f"  skipped {label}: {str(exc)[:120]}")
    del tsets
    torch.cuda.empty_cache()
