"""The tensor-core chapter's bench: the FlashAttention-2 forward on mma.sync, fp16 and bf16.

On a GPU (``--quick``: d = 64 and N = 1k, 4k, 16k only), H = 16, d = 64 and 128, causal
and not, at a fixed number of tokens B N = 16k (FlashAttention's own benchmark does the
same: B = 16k / N), so that every N does the same work per key:

* the N sweep, N = 512 .. 16384, fp16: our kernel as a bare launch on preallocated outputs
  and through its launcher (``flash_attention_tc``), SDPA's flash and cuDNN backends;
* at N = 4096 (B = 4), fp16 and bf16: the same, plus SDPA memory-efficient,
  FlexAttention (``torch.compile``d; causal by a block mask) and chapter 4's fp32-FMA
  kernel (fp16 inputs only);
* grouped-query heads at N = 4096 (B = 4, 16 query heads on 4 KV heads), fp16 and bf16,
  causal and not: the launcher reading each KV head in place, the same launcher on K and V
  repeated to 16 heads first (``repeat_interleave``: what a kernel without grouped heads
  needs), and SDPA flash with ``enable_gqa=True`` (in the simulator: 4 query heads on 2, the
  launcher alone);
* the mma.sync ceiling (``kernels.bench.mma_ceiling``: independent m16n8k16 per warp, no
  memory), fp16 and bf16, measured first; every attention row then carries its percentage
  of the ceiling of its input type (``extra["pct_mma_ceiling"]`` and the note).

Peers run in the same process on the same inputs; a peer that fails (a backend that is not
built, no compiler for FlexAttention) is reported and skipped. FLOPs 4 B H N^2 d (halved for
causal). In the simulator: tokens 16, H = 1, N = 8 and 16, d = 16, one input set, and the
ceiling loop on one warp (it shows that the code runs; no rate means anything there).
"""

from __future__ import annotations

import math
import time

import numpy as np

import kernels  # noqa: F401  (GPU or simulator first)
from kernels import reference as ref
from kernels.base.runtime import cdiv
from kernels.bench import mma_ceiling
from kernels.bench.harness import Result, torch_or_none
from kernels.flash_tensor_cores import flash_attention_tc, make_flash_forward_mma, tc_tiles

CHAPTER = 8
TITLE = "tensor cores"

K = 1024
BARE = "flash fwd tensor cores (bare)"
LAUNCHER = "flash_attention_tc() launcher"
LAUNCHER_TORCH = "flash_attention_tc() launcher, PyTorch tensors"
FMA = "chapter 4 fp32 FMA kernel (fp16 in)"
CEILING = "ceiling: mma.sync m16n8k16"          # + " fp16" / " bf16"
FLEX = "peer: FlexAttention (torch.compile)"
CHECK_ROWS = 512                                # query rows of head (0, 0) checked against the oracle
GQA_NATIVE = "flash_attention_tc() GQA, K and V in place"
GQA_REPEATED = "flash_attention_tc() GQA, K and V repeated first"


def _sizes(ctx):
    """(tokens B N, H, the sweep's N, the reference N, head dims)."""
    if ctx.simulator:
        return 16, 1, (8, 16), 16, (16,)
    if ctx.quick:
        return 16 * K, 16, (1 * K, 4 * K, 16 * K), 4 * K, (64,)
    return 16 * K, 16, (K // 2, 1 * K, 2 * K, 4 * K, 8 * K, 16 * K), 4 * K, (64, 128)


def _inputs(size, count, bf16, keep, seed=800):
    """``count`` flat (q, k, v) sets of ``size`` 16-bit values on the device (fp16, or bf16
    bits as uint16), N(0, 1), and set 0's first ``keep`` values as float32 (head (0, 0) at
    any shape (B, H, N, d) with N d <= keep). Reshaped to (B, H, N, d) for each N, a set is
    the same values as ``standard_normal((B, H, N, d))`` from the same seed."""
    from numba import cuda

    from kernels.base.mma import bf16_bits

    sets, head = [], None
    for i in range(count):
        rng = np.random.default_rng(seed + i)
        xs = [rng.standard_normal(size).astype(np.float32) for _ in range(3)]
        if bf16:
            bits = [bf16_bits(x).astype(np.uint16) for x in xs]
            vals = [(x[:keep].astype(np.uint32) << 16).view(np.float32) for x in bits]
        else:
            bits = [x.astype(np.float16) for x in xs]
            vals = [x[:keep].astype(np.float32) for x in bits]
        sets.append(tuple(cuda.to_device(x) for x in bits))
        head = vals if head is None else head
    return sets, head


def bare_launch(b, h, n, d, bf16, o, lse):
    """The kernel alone, on preallocated O (B H, N, d) and L (B H, N) float32: returns
    ``launch(q, k, v, causal)`` for q, k, v (B, H, N, d) fp16 or bf16-bit device arrays.
    The one place the bench knows the kernel's launch (grid, threads, arguments), as
    ``flash_attention_tc`` does it; ``kernels.flash_tensor_cores`` has no bare-launch
    function of its own."""
    Br, Bc, D = tc_tiles(d)
    kernel = make_flash_forward_mma(Br, Bc, D, bool(bf16))
    grid, threads = (cdiv(n, Br), b * h), kernel.threads
    scale, aligned = np.float32(1 / math.sqrt(d)), np.int32(d % 8 == 0)

    def launch(q, k, v, causal):
        q, k, v = (x.view(np.uint16).reshape(b * h, n, d) for x in (q, k, v))   # the bits
        kernel[grid, threads](q, k, v, o, lse, scale, np.int32(causal), np.int32(1), aligned)   # kv_group 1

    launch.tiles = (Br, Bc)
    return launch


def _check_head(o, head, n, d, causal, bf16=False):
    """The first CHECK_ROWS query rows of head (0, 0) against the float64 oracle: a guard
    against a broken run (the tests hold the kernel to the tolerance rule). Returns (the
    error, that of a float32 reference that rounds P to the input type as the kernel does:
    the tests' yardstick)."""
    rows = min(n, CHECK_ROWS)
    q, k, v = (x[:n * d].reshape(1, 1, n, d).astype(np.float64) for x in head)
    keys = rows if causal else n                 # causal rows < R see keys < R only
    q, k, v = q[0, 0, :rows], k[0, 0, :keys], v[0, 0, :keys]
    exact, _ = ref.attention(q[None, None], k[None, None], v[None, None], causal=causal)
    got = np.asarray(o[0, :rows].copy_to_host() if hasattr(o, "copy_to_host") else o[0, :rows])
    err = float(np.max(np.abs(got - exact[0, 0])))
    assert err < 2e-2, f"tensor-core forward differs from the oracle by {err:.3g} on head (0, 0)"
    s = (q.astype(np.float32) @ k.astype(np.float32).T) * np.float32(1 / math.sqrt(d))
    if causal:
        s = np.where(np.arange(keys)[None, :] > np.arange(rows)[:, None], -np.inf, s).astype(np.float32)
    p = np.exp(s - s.max(axis=1, keepdims=True))
    if bf16:
        from kernels.base.mma import bf16_bits

        p_rounded = (bf16_bits(p).astype(np.uint32) << 16).view(np.float32)
    else:
        p_rounded = p.astype(np.float16).astype(np.float32)
    yardstick = (p_rounded @ v.astype(np.float32)) / p.sum(axis=1, keepdims=True)
    return err, float(np.max(np.abs(yardstick - exact[0, 0])))


def _ceilings(ctx, results):
    """The mma.sync ceiling of fp16 and bf16 in this run: {"fp16": TFLOP/s, "bf16": ...}
    (NaN in the simulator, where the loop runs on one warp to show that it works)."""
    out = {}
    for bf16 in (False, True):
        kind = "bf16" if bf16 else "fp16"
        try:
            launch, a, b, o, flops, (blocks, threads, steps) = mma_ceiling.ceiling_inputs(bf16)
            r = ctx.measure(CHAPTER, f"{CEILING} {kind}", f"{blocks} blocks x {threads} threads, {steps} steps",
                            launch, [(a, b, o)], flops=flops, model_bytes=0.0, peak_memory=False,
                            note=f"{mma_ceiling.CHAINS} independent accumulators a warp, registers only; "
                                 "sums checked exactly",
                            extra={"dtype": kind, "ceiling": "mma.sync"})
            err = mma_ceiling.check_output(o, bf16)            # (every launch writes the same sums)
            assert err == 0, f"the mma.sync ceiling loop computed wrong sums (max error {err})"
        except Exception as exc:     # never lose the chapter to its yardstick
            ctx.progress(f"  skipped the mma.sync ceiling ({kind}): {type(exc).__name__}: {str(exc)[:160]}")
            out[kind] = math.nan
            continue
        results.append(r)
        out[kind] = math.nan if ctx.simulator else r.tflops
        if not ctx.simulator:
            ctx.progress(f"  mma.sync ceiling {kind}: {r.tflops:.1f} TFLOP/s")
    return out


def _with_ceiling(r, ceilings):
    """``r`` with its % of its input type's mma.sync ceiling (extra and note)."""
    ceiling = ceilings.get(r.extra.get("dtype"), math.nan)
    if math.isfinite(ceiling) and ceiling > 0 and math.isfinite(r.tflops):
        pct = 100.0 * r.tflops / ceiling
        r.extra["pct_mma_ceiling"] = f"{pct:.1f}"
        r.note = (r.note + "; " if r.note else "") + f"{pct:.0f}% of the mma.sync ceiling"
    return r


def run(ctx) -> list[Result]:
    from numba import cuda

    torch = torch_or_none()
    results: list[Result] = []
    ceilings = _ceilings(ctx, results)
    add = lambda r: results.append(_with_ceiling(r, ceilings))      # noqa: E731
    tokens, h, sweep, n_ref, dims = _sizes(ctx)
    flex = _Flex(ctx, torch)
    for d in dims:
        for bf16 in (False, True):
            kind = "bf16" if bf16 else "fp16"
            sets, head = _inputs(tokens * h * d, 1 if ctx.simulator else 2, bf16, keep=max(sweep) * d)
            o_flat = cuda.device_array(tokens * h * d, np.float32)
            lse_flat = cuda.device_array(tokens * h, np.float32)
            for n in (sweep if not bf16 else (n_ref,)):
                b = tokens // n
                at_ref = n == n_ref
                shaped = [tuple(x.reshape(b, h, n, d) for x in s) for s in sets]
                o, lse = o_flat.reshape(b * h, n, d), lse_flat.reshape(b * h, n)
                launch = bare_launch(b, h, n, d, bf16, o, lse)
                for causal in (False, True):
                    config = f"B={b} H={h} N={n} d={d} {kind} causal={causal}"
                    flops = 4.0 * b * h * n * n * d / (2 if causal else 1)
                    model = 2.0 * b * h * n * d * 3 + 4.0 * b * h * n * (d + 1)
                    extra = {"N": n, "B": b, "d": d, "causal": causal, "dtype": kind}
                    measure = lambda kernel, fn, sets_, **kw: add(ctx.measure(      # noqa: E731
                        CHAPTER, kernel, config, fn, sets_, flops=flops, model_bytes=model, peak_memory=False,
                        extra=dict(extra), **kw))

                    r = ctx.measure(CHAPTER, BARE, config, lambda q, k, v, c=causal: launch(q, k, v, c), shaped,
                                    flops=flops, model_bytes=model, peak_memory=False, extra=dict(extra))
                    if len(shaped) > 1:
                        launch(*shaped[0], causal)                 # O of set 0 (one set: it is there)
                    err, yardstick = _check_head(o, head, n, d, causal, bf16)
                    Br, Bc = launch.tiles
                    r.note = (f"bare launch, Br={Br} Bc={Bc}; head (0,0) max error {err:.1e} "
                              f"({err / yardstick:.2f}x a float32 reference with P rounded to {kind})")
                    add(r)
                    measure(LAUNCHER, lambda q, k, v, c=causal: flash_attention_tc(q, k, v, causal=c, bf16=bf16),
                            shaped, note="checks arguments, allocates O and L each call")
                    if at_ref and not bf16 and not ctx.simulator:
                        from kernels.flash_forward import flash_attention

                        try:
                            measure(FMA, lambda q, k, v, c=causal: flash_attention(q, k, v, causal=c), shaped,
                                    note="flash_attention(): fp16 inputs, fp32 math on the FMA units")
                        except Exception as exc:
                            ctx.progress(f"  skipped chapter 4's kernel: {type(exc).__name__}: {str(exc)[:120]}")
                    if torch is not None:
                        dtype = torch.bfloat16 if bf16 else torch.float16
                        tsets = [tuple(torch.as_tensor(x, device="cuda").view(dtype) for x in s) for s in shaped]
                        if at_ref:                     # as a PyTorch user calls it
                            measure(LAUNCHER_TORCH,
                                    lambda q, k, v, c=causal: flash_attention_tc(q, k, v, causal=c, bf16=bf16),
                                    tsets, note=f"{dtype} tensors in, O and L from PyTorch's allocator")
                        _sdpa_peers(ctx, measure, torch, tsets, causal, every=at_ref)
                        if at_ref:
                            flex.measure(measure, tsets, n, causal)
                        del tsets
                del shaped, o, lse, launch
            del sets, o_flat, lse_flat
            if torch is not None:
                torch.cuda.empty_cache()
    _grouped_query(ctx, add, torch, tokens, n_ref, dims[0])
    return results


def _grouped_query(ctx, add, torch, tokens, n, d):
    """Grouped-query heads at the reference N: H query heads on H / 4 KV heads (4 on 2 in the
    simulator), in place against repeated first, and SDPA flash's own grouped heads."""
    from numba import cuda

    h, hkv = (4, 2) if ctx.simulator else (16, 4)
    b = max(1, tokens // n)
    group = h // hkv
    for bf16 in (False, True):
        kind = "bf16" if bf16 else "fp16"
        rng = np.random.default_rng(880)
        xs = [rng.standard_normal((b, heads, n, d)).astype(np.float32) for heads in (h, hkv, hkv)]
        if bf16:
            from kernels.base.mma import bf16_bits

            host = [bf16_bits(x).astype(np.uint16) for x in xs]
        else:
            host = [x.astype(np.float16) for x in xs]
        o, _ = flash_attention_tc(*host, causal=True, bf16=bf16)            # checked once, against the oracle
        values = [(x.astype(np.uint32) << 16).view(np.float32) if bf16 else x.astype(np.float32) for x in host]
        exact, _ = ref.attention(values[0][:1, :1].astype(np.float64),
                                 *(x[:1, :1].astype(np.float64) for x in values[1:]), causal=True)
        err = float(np.max(np.abs(np.asarray(o)[:1, :1] - exact)))
        assert err < 2e-2, f"grouped-query forward differs from the oracle by {err:.3g} on head (0, 0)"
        for causal in (False, True):
            config = f"B={b} H={h} Hkv={hkv} N={n} d={d} {kind} causal={causal}"
            flops = 4.0 * b * h * n * n * d / (2 if causal else 1)
            model = 2.0 * b * (h + 2 * hkv) * n * d + 2.0 * b * h * n * d + 4.0 * b * h * n
            extra = {"N": n, "B": b, "H": h, "Hkv": hkv, "d": d, "causal": causal, "dtype": kind}

            def measure(kernel, fn, sets_, **kw):
                add(ctx.measure(CHAPTER, kernel, config, fn, sets_, flops=flops, model_bytes=model,
                                peak_memory=False, extra=dict(extra), **kw))

            call = lambda q, k, v, c=causal: flash_attention_tc(q, k, v, causal=c, bf16=bf16)   # noqa: E731
            if torch is None:
                measure(GQA_NATIVE, call, [tuple(cuda.to_device(x) for x in host)],
                        note=f"device arrays in; head (0,0) max error {err:.1e}")
                continue
            dtype = torch.bfloat16 if bf16 else torch.float16
            tsets = [tuple(torch.as_tensor(x, device="cuda").view(dtype) for x in host)]
            measure(GQA_NATIVE, call, tsets,
                    note=f"{dtype} tensors in, KV head h // {group} read in place; head (0,0) max error {err:.1e}")
            measure(GQA_REPEATED, lambda q, k, v, c=causal: call(q, k.repeat_interleave(group, 1),
                                                                 v.repeat_interleave(group, 1), c),
                    tsets, note="K and V copied to every query head (repeat_interleave), then the MHA kernel")
            from torch.nn.attention import SDPBackend, sdpa_kernel
            from torch.nn.functional import scaled_dot_product_attention as sdpa

            def flash(q, k, v, c=causal):
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    return sdpa(q, k, v, is_causal=c, enable_gqa=True)
            try:
                measure("peer: SDPA flash, enable_gqa", flash, tsets, is_peer=True, note="tensor cores")
            except Exception as exc:
                ctx.progress(f"  skipped SDPA flash with enable_gqa: {type(exc).__name__}: {str(exc)[:120]}")
            del tsets


def _sdpa_peers(ctx, measure, torch, tsets, causal, every):
    """SDPA flash and cuDNN; with ``every``, memory-efficient too."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    backends = [(SDPBackend.FLASH_ATTENTION, "SDPA flash"), (SDPBackend.CUDNN_ATTENTION, "SDPA cuDNN")]
    if every:
        backends.append((SDPBackend.EFFICIENT_ATTENTION, "SDPA memory-efficient"))
    for backend, label in backends:
        def fn(q, k, v, backend=backend):
            with sdpa_kernel(backend):
                return sdpa(q, k, v, is_causal=causal)
        try:
            measure(f"peer: {label}", fn, tsets, is_peer=True, note="tensor cores")
        except Exception as exc:
            ctx.progress(f"  skipped {label}: {type(exc).__name__}: {str(exc)[:120]}")


class _Flex:
    """FlexAttention, compiled once (``torch.compile``, static shapes: one graph a shape and
    mask, built by a first call outside the timed region); causal by a block mask of the
    causal ``mask_mod``, non-causal with none. The first failure (no Triton, no compiler)
    is reported once and FlexAttention is skipped for the rest of the run."""

    def __init__(self, ctx, torch):
        self.ctx, self.torch, self.compiled, self.failed = ctx, torch, None, torch is None
        self.masks = {}

    def _setup(self):
        torch = self.torch
        from torch.nn.attention.flex_attention import flex_attention

        dynamo = torch._dynamo.config
        for name in ("recompile_limit", "cache_size_limit"):     # one graph a (d, dtype, mask): 8 of them
            if hasattr(dynamo, name) and getattr(dynamo, name) < 64:
                setattr(dynamo, name, 64)
        self.compiled = torch.compile(flex_attention, dynamic=False)

    def _mask(self, n):
        if n not in self.masks:
            from torch.nn.attention.flex_attention import create_block_mask

            def causal(b, h, q_idx, kv_idx):
                return q_idx >= kv_idx

            self.masks[n] = create_block_mask(causal, B=None, H=None, Q_LEN=n, KV_LEN=n, device="cuda")
        return self.masks[n]

    def measure(self, measure, tsets, n, causal):
        if self.failed:
            return
        try:
            if self.compiled is None:
                self._setup()
            mask = self._mask(n) if causal else None
            compiled = self.compiled

            def fn(q, k, v):
                return compiled(q, k, v, block_mask=mask)

            t0 = time.perf_counter()
            fn(*tsets[0])                         # compiles this shape: outside the timed region
            self.torch.cuda.synchronize()
            self.ctx.progress(f"  FlexAttention compiled for {tuple(tsets[0][0].shape)} {tsets[0][0].dtype}"
                              f"{', causal' if causal else ''} in {time.perf_counter() - t0:.1f} s")
            measure(FLEX, fn, tsets, is_peer=True,
                    note="flex_attention under torch.compile" + ("; causal block mask" if causal else ""))
        except Exception as exc:
            self.failed = True
            self.ctx.progress(f"  skipped FlexAttention (from here on): {type(exc).__name__}: {str(exc)[:200]}")


# --------------------------------------------------------------------------- the plot

_LINES = ((BARE, "ours, bare launch", "#1f77b4", "-", "o", 2.2),
          (LAUNCHER, "ours, launcher", "#1f77b4", "--", ".", 1.2),
          ("peer: SDPA flash", "SDPA flash", "0.2", "--", "s", 1.5),
          ("peer: SDPA cuDNN", "SDPA cuDNN", "0.5", "--", "^", 1.5))
_POINTS = ((FMA, "chapter 4 (FMA units)", "#d62728", "v"),
           ("peer: SDPA memory-efficient", "SDPA mem.-efficient", "0.35", "x"),
           (FLEX, "FlexAttention", "#2ca02c", "D"))
_BARS = ((BARE, "ours, bare", "#1f77b4", None), (LAUNCHER, "ours, launcher", "#9ecae1", None),
         (LAUNCHER_TORCH, "ours, launcher (torch)", "#6baed6", None),
         (FMA, "chapter 4 (FMA)", "#d62728", None), ("peer: SDPA flash", "SDPA flash", "0.25", "//"),
         ("peer: SDPA cuDNN", "SDPA cuDNN", "0.45", "//"),
         ("peer: SDPA memory-efficient", "SDPA mem.-eff.", "0.65", "//"),
         (FLEX, "FlexAttention", "#2ca02c", "//"))


def _x(r, key):
    return str(r.extra.get(key))             # (read back from a CSV, extras are strings)


def plot(results, path, *, title, simulator, ceiling=math.nan, judged_by=None):
    """Top rows: TFLOP/s against N (B N = 16k, H = 16, fp16), one column a head dim, one row
    non-causal / causal: ours (bare and launcher), SDPA flash and cuDNN, the points measured
    at N = 4096 only, and the mma.sync ceiling measured in the same run. Bottom row: every
    kernel at N = 4096, fp16 and bf16, causal and not. In the simulator, the tour's generic
    plot (times)."""
    from kernels.bench.tour import plot_results

    sweep = [r for r in results if r.kernel == BARE and _x(r, "dtype") == "fp16"]
    if simulator or len({_x(r, "N") for r in sweep}) < 2:
        return plot_results(results, path, title=title, simulator=simulator, ceiling=ceiling, judged_by=judged_by)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ceil = {_x(r, "dtype"): r.tflops for r in results if r.kernel.startswith(CEILING)}
    dims = sorted({int(_x(r, "d")) for r in sweep})
    ns = sorted({int(_x(r, "N")) for r in sweep})
    n_ref = 4 * K if 4 * K in ns else ns[len(ns) // 2]
    top = max([r.tflops for r in results if "N" in r.extra and math.isfinite(r.tflops)] + list(ceil.values()))
    fig, axes = plt.subplots(3, len(dims), figsize=(7.5 * len(dims), 17), squeeze=False,
                             gridspec_kw={"height_ratios": [1, 1, 1.5]})
    for col, d in enumerate(dims):
        for row, causal in enumerate(("False", "True")):
            ax = axes[row, col]
            here = [r for r in results if _x(r, "d") == str(d) and _x(r, "causal") == causal
                    and _x(r, "dtype") == "fp16"]
            for kernel, label, color, style, marker, lw in _LINES:
                pts = sorted((int(_x(r, "N")), r.tflops) for r in here if r.kernel == kernel)
                if len(pts) >= 2:
                    ax.plot(*zip(*pts), linestyle=style, marker=marker, color=color, label=label, lw=lw)
            for kernel, label, color, marker in _POINTS:
                pts = [(int(_x(r, "N")), r.tflops) for r in here if r.kernel == kernel]
                if pts:
                    ax.plot(*zip(*pts), linestyle="none", marker=marker, ms=8, color=color,
                            label=f"{label} (N = {n_ref // K}k only)")
            if math.isfinite(ceil.get("fp16", math.nan)):
                ax.axhline(ceil["fp16"], color="red", linestyle=":", lw=1.6)
                ax.text(ns[0], ceil["fp16"] * 1.01, f"mma.sync ceiling (fp16, this run) {ceil['fp16']:.0f} TFLOP/s",
                        color="red", fontsize=9, va="bottom")
            ax.set_xscale("log", base=2)
            ax.set_xticks(ns, [f"{n / K:g}k" for n in ns])
            ax.set_ylim(0, top * 1.12)
            ax.set_xlabel("N (B = 16k / N, H = 16)")
            ax.set_ylabel("TFLOP/s (higher is better)")
            ours = [(r.tflops, int(_x(r, "N"))) for r in here if r.kernel == BARE]
            point = ""
            if ours and math.isfinite(ceil.get("fp16", math.nan)):
                best = max(ours)
                point = (f":\nours reaches {100 * best[0] / ceil['fp16']:.0f}% of the mma.sync ceiling "
                         f"(at N = {best[1] / K:g}k)")
            ax.set_title(f"fp16, d = {d}, {'causal' if causal == 'True' else 'not causal'}{point}", fontsize=11)
            ax.grid(True, which="both", alpha=0.3)

        # N = 4096: every kernel, fp16 and bf16, causal and not
        ax = axes[2, col]
        ys, labels, y = [], [], 0
        for kind in ("fp16", "bf16"):
            for causal in ("False", "True"):
                here = [r for r in results if _x(r, "d") == str(d) and _x(r, "causal") == causal
                        and _x(r, "dtype") == kind and _x(r, "N") == str(n_ref)]
                if not here:
                    continue
                start = y
                for kernel, label, color, hatch in _BARS:
                    for r in (r for r in here if r.kernel == kernel):
                        ax.barh(y, r.tflops, color=color, hatch=hatch, edgecolor="black", lw=0.4)
                        pct = r.extra.get("pct_mma_ceiling")
                        share = f" ({float(pct):.0f}%)" if pct else ""
                        ax.text(r.tflops, y, f" {r.tflops:.0f}{share}  {label}", va="center", fontsize=8)
                        y += 1
                ys.append((start + y - 1) / 2)
                labels.append(f"{kind}\n{'causal' if causal == 'True' else 'not causal'}")
                y += 1
        for kind, style in (("fp16", ":"), ("bf16", "-.")):
            if math.isfinite(ceil.get(kind, math.nan)):
                ax.axvline(ceil[kind], color="red", linestyle=style, lw=1.2,
                           label=f"mma.sync ceiling {kind} {ceil[kind]:.0f}")
        ax.set_yticks(ys, labels, fontsize=10)
        ax.invert_yaxis()
        ax.set_xlim(0, top * 1.45)
        ax.set_xlabel("TFLOP/s  (in brackets: % of the mma.sync ceiling of the input type)")
        ax.set_title(f"d = {d}, N = {n_ref // K}k (B = {16 * K // n_ref}, H = 16): every kernel", fontsize=11)
        ax.grid(True, axis="x", alpha=0.3)
        if ceil:
            ax.legend(fontsize=8, loc="lower right")
    handles, names = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, names, loc="upper center", ncol=4, fontsize=10, bbox_to_anchor=(0.5, 0.975))
    fig.suptitle(title, fontsize=12, y=0.995)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
