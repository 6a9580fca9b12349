"""Chapter 11's second bench: the fp32 backward on tensor cores (3xTF32) against PyTorch's.

On a GPU (``--quick``: d = 64, N = 1k and 4k), H = 16, d = 64 and 128, causal and not, at
a fixed number of tokens B N = 16k, N = 1024 .. 16384, float32 inputs; O and L from
chapter 11's forward (``flash_attention_tf32``) on the same inputs; then, in one run:

* our backward as a bare launch (``launch_backward``: chapter 5's D kernel and the dK/dV/dQ
  kernel on preallocated D, dQ, dK, dV), and through chapter 5's launcher
  (``flash_attention_backward``, whose default on a GPU with TF32 tensor cores is this
  kernel) with PyTorch tensors, as a PyTorch user calls it;
* peers on the same inputs, the backward alone, fp32 with TF32 off (PyTorch's default):
  SDPA's memory-efficient backend (CUTLASS, 3xTF32 itself) and plain PyTorch
  (``softmax(q k^T scale) v``: autograd saves P), each as ``torch.autograd.grad`` after one
  forward built outside the timed region (chapter 12's ``_torch_peers``);
* at N = 4096 chapter 5's FMA backward (``products="fma"``, with its errors on the same
  inputs) and plain TF32 (``passes=1``).

Each bare row carries the max error of head (0, 0)'s dQ, dK, dV against the exact
gradients (float64, from the float64 forward), and as a multiple of a float32 backward's
(from a float32 forward; the tests' yardstick is float32 NumPy, this is the same arithmetic
in PyTorch on the GPU, TF32 off). FLOPs 10 B H N^2 d (halved for causal).
In the simulator: 16 tokens, H = 1, N = 16, d = 16, 3xTF32 alone, one timed run a row, no
PyTorch.

``python -m kernels.bench.tf32_backward --variants``: the kernel's variants that the launchers
do not use yet (``VARIANTS``: how a fragment load's split leaves lo, S^T's products round by
round), bare launches taking turns in ``ROUNDS`` rounds at the chapter 13 floor's fp32 cells
(B*H = 512, N = 256 and 1024, d = 128) and at B=4 H=16 N=4096 (d = 64, 128); each variant's
gradients of head (0, 0) checked as above; SDPA memory-efficient and plain PyTorch's backward
in the same run. Writes ``tf32_backward_variants.csv``.
"""

from __future__ import annotations

import gc
import math

import numpy as np

import kernels  # noqa: F401  (GPU or simulator first)
from kernels.bench.harness import Result, token_sweep, torch_or_none
from kernels.bench.tensor_core_backward import _torch_peers, config_name
from kernels.flash_backward import flash_attention_backward
from kernels.flash_tf32 import flash_attention_tf32
from kernels.tf32_backward import launch_backward, tf32_backward_tiles

CHAPTER = 11
TITLE = "the fp32 backward on tensor cores (3xTF32)"

BARE = "flash bwd 3xTF32 (bare)"
BARE_1X = "flash bwd plain TF32, passes=1 (bare)"
LAUNCHER_TORCH = "flash_attention_backward(), torch"
FMA = "chapter 5 fp32 backward (FMA), torch"
PEERS = ("SDPA memory-efficient", "plain PyTorch")
REL_GUARD = {3: 1e-4, 1: 1e-2}        # max |error| / max |exact| a pass count: ~1e-6 and ~1e-3 expected


def _model_bytes(b, h, n, d):
    """Compulsory HBM traffic, float32: q, k, v, O, dO and L read once; dQ, dK, dV written once."""
    return 4.0 * b * h * n * (5 * d + 1) + 4.0 * b * h * n * d * 3


def _measurer(ctx, results, config, flops, shape, extra, **fixed):
    """measure(kernel, fn, sets, **kw): ``ctx.measure`` at this cell (B, H, N, d = ``shape``),
    its Result added to ``results`` and returned; ``fixed``: keywords for every call."""
    def measure(kernel, fn, sets_, **kw):
        r = ctx.measure(CHAPTER, kernel, config, fn, sets_, flops=flops, model_bytes=_model_bytes(*shape),
                        extra=dict(extra), **fixed, **kw)
        results.append(r)
        return r
    return measure


def _gradients(torch, q, k, v, do, causal, dtype):
    """Head (0, 0)'s (dq, dk, dv) in closed form at ``dtype`` (its own forward), on the GPU."""
    q, k, v, do = (x.to(dtype) for x in (q, k, v, do))
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = scale * (q @ k.T)
    if causal:
        n_q, n_k = s.shape
        keep = torch.ones(n_q, n_k, dtype=torch.bool, device=s.device).tril(n_k - n_q)
        s = s.masked_fill(~keep, -math.inf)
    p = torch.softmax(s, dim=-1)
    o = p @ v
    dv = p.T @ do
    dp = do @ v.T
    ds = p * (dp - (do * o).sum(-1, keepdim=True))
    return scale * (ds @ k), scale * (ds.T @ q), dv


def _errors(torch, head, got, causal, passes):
    """{name: (max |error|, that over the float32 backward's)} for dQ, dK, dV of head (0, 0)."""
    exact = _gradients(torch, *head, causal, torch.float64)
    base = _gradients(torch, *head, causal, torch.float32)         # (run() turned TF32 off)
    out = {}
    for name, g, e, b in zip(("dQ", "dK", "dV"), got, exact, base):
        err = float((g.double() - e).abs().max())
        yard = float((b.double() - e).abs().max())
        rel = err / max(float(e.abs().max()), 1e-30)
        if rel > REL_GUARD[passes]:
            raise RuntimeError(f"{name}: relative error {rel:.1e} past {REL_GUARD[passes]:.0e}: a broken run")
        out[name] = (err, err / yard if yard > 0 else float("nan"))
    return out


def run(ctx) -> list[Result]:
    from numba import cuda

    torch = torch_or_none()
    if torch is not None:
        torch.backends.cuda.matmul.allow_tf32 = False          # fp32 peers in fp32 (PyTorch's default)
        torch.backends.cudnn.allow_tf32 = False
    once = dict(repeat=1, warmup=0) if ctx.simulator else {}
    results: list[Result] = []
    tokens, h, sweep, n_ref, dims = token_sweep(ctx)
    if ctx.simulator:                                 # a simulated backward takes seconds: N = 16 alone
        sweep = (n_ref,)
    rng = np.random.default_rng(1150)
    for d in dims:
        Br, W, _ = tf32_backward_tiles(d)
        scale = 1.0 / math.sqrt(d)
        size = tokens * h * d
        sets = [tuple(cuda.to_device(rng.standard_normal(size, dtype=np.float32)) for _ in range(4))
                for _ in range(1 if ctx.simulator else 2)]
        flat = [cuda.device_array(tokens * h, np.float32)] + [cuda.device_array(size, np.float32) for _ in range(3)]
        for n in sweep:
            b = tokens // n
            at_ref = n == n_ref
            shaped = [tuple(x.reshape(b, h, n, d) for x in s) for s in sets]
            delta = flat[0].reshape(b * h, n)
            dq, dk, dv = (x.reshape(b * h, n, d) for x in flat[1:])
            for causal in (False, True):
                config = config_name(tokens, h, n, d, "fp32", causal)
                flops = 10.0 * b * h * n * n * d / (2 if causal else 1)
                extra = {"N": n, "B": b, "H": h, "d": d, "causal": causal, "dtype": "fp32"}

                measure = _measurer(ctx, results, config, flops, (b, h, n, d), extra, **once)

                full = []                                 # O and L from chapter 11's forward
                for q, k, v, do in shaped:
                    o, lse = flash_attention_tf32(q, k, v, causal=causal)
                    full.append((q, k, v, o, lse, do))
                flat_sets = [tuple(x.reshape(b * h, n, -1) if x.ndim == 4 else x.reshape(b * h, n) for x in s)
                             for s in full]
                for passes, label in ((3, BARE), (1, BARE_1X)) if at_ref and not ctx.simulator else ((3, BARE),):
                    def bare(q, k, v, o, lse, do, c=causal, p=passes, out=(delta, dq, dk, dv)):
                        launch_backward(q, k, v, o, lse, do, *out, scale, c, p)

                    r = measure(label, bare, flat_sets, peak_memory=False,
                                note=f"bare launch_backward: the D kernel and the dK/dV/dQ kernel on preallocated "
                                     f"buffers, Br={Br} Bc={16 * W}")
                    if torch is not None:
                        bare(*flat_sets[0])               # the gradients of set 0
                        got = tuple(torch.as_tensor(x, device="cuda")[0] for x in (dq, dk, dv))
                        head = tuple(torch.as_tensor(x, device="cuda")[0, 0] for x in
                                     (shaped[0][0], shaped[0][1], shaped[0][2], shaped[0][3]))
                        errors = _errors(torch, head, got, causal, passes)
                        r.note += "; head (0,0) max error " + ", ".join(
                            f"{k_} {e:.1e} ({t:.2f}x fp32's)" for k_, (e, t) in errors.items())
                        for k_, (e, t) in errors.items():
                            r.extra.update({f"max_error_{k_}": e, f"error_vs_float32_{k_}": t})
                if torch is not None:
                    tsets = [tuple(torch.as_tensor(x, device="cuda") for x in s) for s in full]
                    measure(LAUNCHER_TORCH,
                            lambda q, k, v, o, lse, do, c=causal: flash_attention_backward(q, k, v, o, lse, do,
                                                                                           causal=c), tsets,
                            note="chapter 5's launcher, products='auto' (3xTF32 here), float32 tensors in: checks "
                                 "arguments, allocates dQ, dK, dV each call")
                    if at_ref:
                        fma = measure(FMA, lambda q, k, v, o, lse, do, c=causal: flash_attention_backward(
                                          q, k, v, o, lse, do, causal=c, products="fma"), tsets,
                                      note="the course's fp32 backward on the FMA units, atomic dQ")
                        got = flash_attention_backward(*tsets[0], causal=causal, products="fma")
                        errors = _errors(torch, tuple(x[0, 0] for x in (tsets[0][0], tsets[0][1], tsets[0][2],
                                                                        tsets[0][5])),
                                         tuple(x[0, 0] for x in got), causal, 3)
                        fma.note += "; head (0,0) max error " + ", ".join(
                            f"{k_} {e:.1e} ({t:.2f}x fp32's)" for k_, (e, t) in errors.items())
                        for k_, (e, t) in errors.items():
                            fma.extra.update({f"max_error_{k_}": e, f"error_vs_float32_{k_}": t})
                    _torch_peers(ctx, measure, torch, tsets, causal, peers=PEERS)
                    del tsets
                del full, flat_sets
                gc.collect()
                if torch is not None:
                    torch.cuda.empty_cache()
            del shaped
        del sets, flat
    return results


# --------------------------------------------------------------------------- the variants
# (label, launch_backward's keywords); the launchers' own first
VARIANTS = (("lo rounded", dict(lo="rounded", rounds=False)),
            ("lo truncated", dict(lo="truncated", rounds=False)),
            ("lo truncated, products round by round", dict(lo="truncated", rounds=True)))
VARIANT_CELLS = ((32, 16, 256, 128, False), (32, 16, 1024, 128, False), (4, 16, 4096, 128, False),
                 (4, 16, 4096, 128, True), (4, 16, 4096, 64, False))
ROUNDS = 9
TARGET_MS = 100.0             # a round's run of back-to-back calls of one variant


def variant_sweep(ctx, cells=None) -> list[Result]:
    """Each of ``VARIANTS`` as a bare launch at each cell (B, H, N, d, causal): ``ROUNDS``
    rounds taking turns (which goes first alternates; CUDA events around ``TARGET_MS`` of
    back-to-back calls), so that a slow stretch of the GPU falls on every variant. A row's
    median is its variant's median round, p10 and p90 the second fastest and second slowest;
    its speed-up is the median over rounds of the first variant's time over its own, in the
    same round. Each variant's gradients of head (0, 0) against float64 (a broken one stops
    the run). Peers: SDPA memory-efficient and plain PyTorch's backward, timed after."""
    from numba import cuda

    from kernels.bench.turns import take_turns, turn_summary, variant_row

    torch = torch_or_none()
    if torch is not None:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        check_torch, to_tensor = torch, (lambda a: torch.as_tensor(a, device="cuda"))
    else:                                             # the simulator: the errors on the host
        import torch as check_torch
        to_tensor = lambda a: check_torch.as_tensor(a.copy_to_host())     # noqa: E731
    cells = cells or (((1, 1, 16, 16, False), (1, 1, 16, 16, True)) if ctx.simulator else VARIANT_CELLS)
    first_label = VARIANTS[0][0]
    rng = np.random.default_rng(1151)
    results: list[Result] = []
    for b, h, n, d, causal in cells:
        config = f"B={b} H={h} N={n} d={d} fp32 causal={causal}"
        flops = 10.0 * b * h * n * n * d / (2 if causal else 1)
        extra = {"N": n, "B": b, "H": h, "d": d, "causal": causal, "dtype": "fp32", "part": "variants"}
        Br, W, _ = tf32_backward_tiles(d)
        full = []                                     # (q, k, v, o, lse, do) as (B*H, N[, d]) views
        for _ in range(1 if ctx.simulator else 2):
            q, k, v, do = (cuda.to_device(rng.standard_normal((b, h, n, d), dtype=np.float32)) for _ in range(4))
            o, lse = flash_attention_tf32(q, k, v, causal=causal)
            full.append(tuple(x.reshape(b * h, n, d) for x in (q, k, v, o)) + (lse.reshape(b * h, n),
                                                                              do.reshape(b * h, n, d)))
        outs = (cuda.device_array((b * h, n), np.float32),) + tuple(
            cuda.device_array((b * h, n, d), np.float32) for _ in range(3))     # D, dQ, dK, dV
        scale = 1.0 / math.sqrt(d)
        calls = {}
        for label, kw in VARIANTS:
            def bare(q, k, v, o, lse, do, kw=kw):
                launch_backward(q, k, v, o, lse, do, *outs, scale, causal, 3, **kw)
            calls[label] = bare
        ctx.progress(f"  ch{CHAPTER} {len(VARIANTS)} variants, taking turns: {config}")
        samples = take_turns(calls, full, ctx.simulator, ROUNDS, TARGET_MS)
        for label, kw in VARIANTS:
            t, turns = turn_summary(samples, label, first_label, ctx.simulator)
            calls[label](*full[0])                      # the gradients of set 0, checked
            head = tuple(to_tensor(x)[0] for x in (full[0][0], full[0][1], full[0][2], full[0][5]))
            errors = _errors(check_torch, head, tuple(to_tensor(x)[0] for x in outs[1:]), causal, 3)
            args = ", ".join(f"{k_}={v_!r}" for k_, v_ in kw.items())
            checked = {f"{what}_{k_}": x for k_, (e, r_) in errors.items()
                       for what, x in (("max_error", e), ("error_vs_float32", r_))}
            results.append(variant_row(
                CHAPTER, label, config, t, turns, flops, _model_bytes(b, h, n, d),
                f"bare launch_backward({args}), Br={Br} Bc={16 * W}, {t.runs} rounds taking turns; head (0,0) "
                f"max error " + ", ".join(f"{k_} {e:.1e} ({r_:.2f}x fp32's)" for k_, (e, r_) in errors.items()),
                dict(extra, **kw, **checked)))
            ctx.progress(f"      {label}: {t.median_ms:.4g} ms, {turns[f'speedup over {first_label}']:.3f}x "
                         f"(rounds {turns['round ratios p10']:.3f}-{turns['round ratios p90']:.3f})")
        if torch is not None:
            tsets = [tuple(torch.as_tensor(x, device="cuda").reshape(b, h, n, -1) for x in s) for s in full]
            tsets = [(q, k, v, o, lse.reshape(b, h, n), do) for q, k, v, o, lse, do in tsets]
            _torch_peers(ctx, _measurer(ctx, results, config, flops, (b, h, n, d), extra), torch, tsets, causal,
                         peers=PEERS)
            del tsets
        del full, outs
        gc.collect()
        if torch is not None:
            torch.cuda.empty_cache()
    return results


def main(argv=None) -> int:
    from kernels.bench.turns import variants_main

    return variants_main(argv, prog="python -m kernels.bench.tf32_backward",
                         description="chapter 11's backward variants (the tour runs the rest)",
                         sweep=variant_sweep, csv_name="tf32_backward_variants.csv")


if __name__ == "__main__":
    import sys

    sys.exit(main())
