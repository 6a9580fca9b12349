"""Chapter 12's bench: the backward on tensor cores (fp16/bf16) against PyTorch's backwards.

On a GPU (``--quick``: d = 64, N = 1k and 4k), H = 16, d = 64 and 128, causal and not, at
a fixed number of tokens B N = 16k (B = 16k / N), N = 1024 .. 16384, fp16; at N = 4096
bf16 too. Each configuration's O and L come from chapter 8's forward
(``flash_attention_tc``) on the same inputs; then, in one run:

* our backward as a bare launch (``launch_backward``: the D/L2 kernel and the dK/dV/dQ
  kernel on preallocated D, L2, dQ, dK, dV), and through its launcher
  (``flash_attention_backward_tc``) with PyTorch tensors, as a PyTorch user calls it (it
  checks its arguments and allocates the gradients each call);
* peers on the same inputs, the backward alone: SDPA's flash, memory-efficient and cuDNN
  backends and plain PyTorch (``softmax(q k^T scale) v``, in the input type), each timed
  as ``torch.autograd.grad(out, (q, k, v), do, retain_graph=True)`` after one forward
  built outside the timed region;
* at N = 4096 (fp16) chapter 5's fp32 backward (``flash_attention_backward``, FMA units)
  on float32 copies of the same inputs: the course's own yardstick before tensor cores.

A peer that fails (a backend not built, out of memory at large N) is reported and skipped.
Each bare row carries the max error of head (0, 0)'s dQ, dK, dV against the exact
gradients (float64) and as a multiple of the error of a float32 backward that rounds P and
dS to the input type as the kernel does (the tests' yardstick, ``rounded_backward_numpy``);
a relative error past ``REL_GUARD`` stops the chapter (a broken run, not a slow one).

FLOPs 10 B H N^2 d (five products of 2 N^2 d a head; halved for causal) for every row.
``model_bytes``: the compulsory traffic (q, k, v, dO 16-bit, O and L float32 read once;
dQ, dK, dV float32 written once), the same for every row: an effective GB/s.
In the simulator: 16 tokens, H = 1, N = 8 and 16, d = 16, one input set, one timed run a
row (a simulated launch of the backward takes seconds), the launcher once (N = 16, fp16,
not causal), no PyTorch; head (0, 0) checked with NumPy (the float64 oracle).

``python -m kernels.bench.tensor_core_backward --tiles``: the tile sweep alone, not part of
the tour. The bare launch at B = 4, H = 16, N = 4096, fp16, d = 64 and 128, causal and not,
with each candidate of ``TILE_CANDIDATES`` (Br query rows, W warps = Bc / 16 keys, CP, CC:
``launch_backward``'s ``tiles``), SDPA flash's backward on the same inputs in the same run;
each row's head (0, 0) checked as above. Writes ``tensor_core_backward_tiles.csv`` (in the
simulator: B = H = 1, N = 16, d = 16, two candidates, into ``bench-out/``).

``python -m kernels.bench.tensor_core_backward --once D [--causal]``: one call shape for a
profiler (chapter 8's forward, then the launcher's backward once at B = 4, H = 16,
N = 4096, fp16, head dim D), the target of ``.ci/gpu-check sources``
(``kernels.bench.ncu_source``).
"""

from __future__ import annotations

import gc
import math

import numpy as np

import kernels  # noqa: F401  (GPU or simulator first)
from kernels import reference as ref
from kernels.bench.harness import Result, token_sweep, torch_or_none
from kernels.flash_tensor_cores import flash_attention_tc
from kernels.tensor_core_backward import (
    flash_attention_backward_tc,
    launch_backward,
    rounded_backward_numpy,
    tc_backward_tiles,
)

CHAPTER = 12
TITLE = "the backward on tensor cores"

K = 1024
BARE = "flash bwd tensor cores (bare)"
LAUNCHER = "flash_attention_backward_tc()"            # device arrays (no PyTorch)
LAUNCHER_TORCH = "flash_attention_backward_tc(), torch"
FMA = "chapter 5 fp32 backward (FMA)"
PEERS = ("SDPA flash", "SDPA memory-efficient", "SDPA cuDNN", "plain PyTorch")   # "peer: <name> bwd"
REL_GUARD = {"fp16": 1e-2, "bf16": 3e-2}   # max |error| / max |exact|: ~2e-4 (fp16), ~2e-3 (bf16) expected
NUMPY_CHECK_MAX_N = 4096                   # without PyTorch, head (0, 0) is checked on the CPU up to this N


def _inputs(size, count, bf16, seed=1200):
    """``count`` flat (q, k, v, dO) sets of ``size`` 16-bit values on the device (fp16, or
    bf16 bits as uint16), N(0, 1). Reshaped to (B, H, N, d) for each N."""
    from numba import cuda

    from kernels.base.mma import bf16_bits

    sets = []
    for i in range(count):
        rng = np.random.default_rng(seed + i)
        xs = [rng.standard_normal(size).astype(np.float32) for _ in range(4)]
        bits = [bf16_bits(x).astype(np.uint16) if bf16 else x.astype(np.float16) for x in xs]
        sets.append(tuple(cuda.to_device(x) for x in bits))
    return sets


def _model_bytes(b, h, n, d):
    """Compulsory HBM traffic: q, k, v, dO (16-bit) and O (float32), L read once; dQ, dK, dV
    (float32) written once."""
    return 2.0 * b * h * n * d * 4 + 4.0 * b * h * n * d + 4.0 * b * h * n + 4.0 * b * h * n * d * 3


def config_name(tokens, h, n, d, kind, causal):
    """The row's config. B = tokens / N is written as such, so that a configuration's rows
    differ only in N across the sweep (the tour's plot draws one line a kernel over N);
    the row's B is in ``extra``."""
    count = f"{tokens // K}k" if tokens % K == 0 else str(tokens)
    return f"B={count}/N H={h} N={n} d={d} {kind} causal={causal}"


# --------------------------------------------------------------------------- the check

def _as_float(x, bf16):
    """16-bit patterns on the host (fp16 or bf16 bits, as uint16) as float64 values."""
    x = np.asarray(x).view(np.uint16)
    if bf16:
        return (x.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return x.view(np.float16).astype(np.float64)


def _references_numpy(head, o, lse, causal, bf16):
    """(exact, yardstick) gradients of head (0, 0) on the CPU: the float64 oracle (its own
    forward), and the float32 backward that rounds P and dS as the kernel does (from the
    forward's O and L, as the kernel)."""
    q, k, v, do = (x[None, None] for x in head)
    o_exact, l_exact = ref.attention(q, k, v, causal=causal)
    exact = ref.attention_backward(q, k, v, o_exact, l_exact, do, causal=causal)
    yard = rounded_backward_numpy(q, k, v, o[None, None], lse[None, None], do, causal=causal, bf16=bf16)
    return [x[0, 0] for x in exact], [np.asarray(x[0, 0], np.float64) for x in yard]


def _references_torch(torch, head, o, lse, causal, bf16):
    """The same on the GPU with PyTorch (float64 for the exact gradients, float32 with TF32
    off and P, dS rounded to the input type for the yardstick): cheap at every N."""
    q, k, v, do = (torch.as_tensor(x, device="cuda") for x in head)          # float64 (n, d)
    o, lse = torch.as_tensor(o, device="cuda"), torch.as_tensor(lse, device="cuda")
    n, d = q.shape
    scale = 1.0 / math.sqrt(d)
    keep = torch.ones(n, n, dtype=torch.bool, device="cuda").tril_() if causal else None
    s = (q @ k.T).mul_(scale)
    if keep is not None:
        s.masked_fill_(~keep, -math.inf)
    p = torch.softmax(s, dim=-1)
    del s
    big_d = (do * (p @ v)).sum(-1, keepdim=True)
    dv = p.T @ do
    ds = (do @ v.T).sub_(big_d).mul_(p)
    del p
    exact = [(ds @ k).mul_(scale), (ds.T @ q).mul_(scale), dv]
    del ds
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        q, k, v, do = (x.float() for x in (q, k, v, do))
        kind = torch.bfloat16 if bf16 else torch.float16
        p = (q @ k.T).mul_(scale).sub_(lse[:, None]).exp_()
        if keep is not None:
            p.masked_fill_(~keep, 0.0)
        big_d = (do * o).sum(-1, keepdim=True)
        ds = (do @ v.T).sub_(big_d).mul_(p)
        p = p.to(kind).float()
        dv = p.T @ do
        del p
        ds = ds.to(kind).float()
        yard = [(ds @ k).mul_(scale), (ds.T @ q).mul_(scale), dv]
        del ds
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    out = [x.double().cpu().numpy() for x in exact], [x.double().cpu().numpy() for x in yard]
    del exact, yard, keep
    torch.cuda.empty_cache()
    return out


def check_head(torch, inputs, grads, causal, bf16, progress=print):
    """Head (0, 0) of our gradients against the exact ones: {"dq": (max error, max |exact|,
    that error over the yardstick's), ...}, or None where no reference is cheap (no PyTorch
    and N > NUMPY_CHECK_MAX_N) or the reference itself failed (out of memory: reported
    with ``progress``). ``inputs`` (q, k, v, o, lse, dO) as the bare launch takes them (B H
    first); ``grads`` (dQ, dK, dV) float32 (B H, N, d). Asserts the relative error is under
    ``REL_GUARD``: a guard against a broken run (the tests hold the kernel to the
    tolerance rule)."""
    q, k, v, o, lse, do = inputs
    n = q.shape[1]
    if torch is None and n > NUMPY_CHECK_MAX_N:
        return None
    head = [_as_float(x[0].copy_to_host(), bf16) for x in (q, k, v, do)]
    o0, lse0 = o[0].copy_to_host(), lse[0].copy_to_host()
    try:
        if torch is not None:
            exact, yard = _references_torch(torch, head, o0, lse0, causal, bf16)
        else:
            exact, yard = _references_numpy(head, o0, lse0, causal, bf16)
    except Exception as exc:            # the reference, not our kernel: never lose the chapter to it
        progress(f"  head (0,0) unchecked, its reference failed: {type(exc).__name__}: {str(exc)[:160]}")
        return None
    kind = "bf16" if bf16 else "fp16"
    out = {}
    for name, g, e, y in zip(("dq", "dk", "dv"), grads, exact, yard):
        got = g[0].copy_to_host().astype(np.float64)
        err = float(np.max(np.abs(got - e)))
        top = float(np.max(np.abs(e)))
        yard_err = float(np.max(np.abs(y - e)))
        assert np.isfinite(err) and err <= REL_GUARD[kind] * top, (
            f"tensor-core backward: {name} of head (0, 0) differs from the exact gradient by {err:.3g} "
            f"(max |{name}| {top:.3g}; the guard allows {REL_GUARD[kind]:g} of it)")
        out[name] = (err, top, err / yard_err if yard_err > 0 else math.nan)
    return out


def _with_errors(r, errors, kind):
    """``r`` with head (0, 0)'s errors in its note and extra."""
    if errors is None:
        r.note += "; head (0,0) unchecked (no reference at this N)"
        return r
    r.note += ("; head (0,0) max error " + ", ".join(f"{g} {e:.1e}" for g, (e, _, _) in errors.items())
               + " (" + "/".join(f"{t:.2f}" for _, _, t in errors.values())
               + f"x a float32 backward with P, dS rounded to {kind})")
    for g, (e, top, t) in errors.items():
        r.extra[f"{g}_max_error"] = e
        r.extra[f"{g}_rel_error"] = e / top if top > 0 else math.nan
        r.extra[f"{g}_error_vs_rounded"] = t
    r.extra["max_error"] = max(e for e, _, _ in errors.values())
    return r


def _forward_sets(shaped, causal, bf16):
    """Each (q, k, v, dO) set (B, H, N, d) with its O and L from chapter 8's forward, as a
    training step would have them, and the same as the bare launch takes them (B H first,
    16-bit inputs as uint16 bits): (full, bare)."""
    full = []
    for q, k, v, do in shaped:
        o, lse = flash_attention_tc(q, k, v, causal=causal, bf16=bf16)
        full.append((q, k, v, o, lse, do))
    b, h, n, d = shaped[0][0].shape
    bits = lambda x: x.view(np.uint16).reshape(b * h, n, d)        # noqa: E731
    bare = [(bits(q), bits(k), bits(v), o.reshape(b * h, n, d), lse.reshape(b * h, n), bits(do))
            for q, k, v, o, lse, do in full]
    return full, bare


def _torch_sets(torch, full, bf16):
    """The sets as PyTorch CUDA tensors, the 16-bit ones in their PyTorch type."""
    dtype = torch.bfloat16 if bf16 else torch.float16
    tsets = [tuple(torch.as_tensor(x, device="cuda") for x in s) for s in full]
    return [(q.view(dtype), k.view(dtype), v.view(dtype), o, lse, do.view(dtype)) for q, k, v, o, lse, do in tsets]


# --------------------------------------------------------------------------- the run

def run(ctx) -> list[Result]:
    from numba import cuda

    torch = torch_or_none()
    results: list[Result] = []
    tokens, h, sweep, n_ref, dims = token_sweep(ctx)
    once = dict(repeat=1, warmup=0) if ctx.simulator else {}      # a simulated backward takes seconds
    for d in dims:
        Br, W, _ = tc_backward_tiles(d)
        scale = 1.0 / math.sqrt(d)
        size = tokens * h * d
        flat = [cuda.device_array(tokens * h, np.float32) for _ in range(2)] + \
            [cuda.device_array(size, np.float32) for _ in range(3)]          # D, L2, dQ, dK, dV
        for bf16 in (False, True):
            kind = "bf16" if bf16 else "fp16"
            sets = _inputs(size, 1 if ctx.simulator else 2, bf16)
            for n in (sweep if not bf16 else (n_ref,)):
                b = tokens // n
                at_ref = n == n_ref
                shaped = [tuple(x.reshape(b, h, n, d) for x in s) for s in sets]
                delta, l2 = (x.reshape(b * h, n) for x in flat[:2])
                dq, dk, dv = (x.reshape(b * h, n, d) for x in flat[2:])
                for causal in (False, True):
                    config = config_name(tokens, h, n, d, kind, causal)
                    flops = 10.0 * b * h * n * n * d / (2 if causal else 1)
                    extra = {"N": n, "B": b, "H": h, "d": d, "causal": causal, "dtype": kind}

                    def measure(kernel, fn, sets_, **kw):
                        r = ctx.measure(CHAPTER, kernel, config, fn, sets_, flops=flops,
                                        model_bytes=_model_bytes(b, h, n, d), extra=dict(extra), **once, **kw)
                        results.append(r)
                        return r

                    full, bare_sets = _forward_sets(shaped, causal, bf16)   # O and L from chapter 8's forward

                    def bare(q, k, v, o, lse, do, c=causal, out=(delta, l2, dq, dk, dv)):
                        launch_backward(q, k, v, o, lse, do, *out, scale, c, bf16)

                    r = measure(BARE, bare, bare_sets, peak_memory=False,
                                note=f"bare launch_backward: the D kernel and the dK/dV/dQ kernel on preallocated "
                                     f"buffers, Br={Br} Bc={16 * W}")
                    if len(bare_sets) > 1:
                        bare(*bare_sets[0])                      # the gradients of set 0 (one set: they are there)
                    _with_errors(r, check_head(torch, bare_sets[0], (dq, dk, dv), causal, bf16, ctx.progress), kind)

                    if torch is not None:
                        dtype = torch.bfloat16 if bf16 else torch.float16
                        tsets = _torch_sets(torch, full, bf16)
                        measure(LAUNCHER_TORCH,
                                lambda q, k, v, o, lse, do, c=causal: flash_attention_backward_tc(
                                    q, k, v, o, lse, do, causal=c, bf16=bf16), tsets,
                                note=f"launcher, {dtype} tensors in: checks arguments, allocates dQ, dK, dV, D, L2 "
                                     "each call")
                    elif not ctx.simulator or (at_ref and not bf16 and not causal):
                        measure(LAUNCHER,
                                lambda q, k, v, o, lse, do, c=causal: flash_attention_backward_tc(
                                    q, k, v, o, lse, do, causal=c, bf16=bf16), full,
                                note="launcher, Numba device arrays in: checks arguments, allocates dQ, dK, dV, D, "
                                     "L2 each call")
                    if at_ref and not bf16:
                        _chapter_5(ctx, measure, torch, full, causal)
                    if torch is not None:
                        _torch_peers(ctx, measure, torch, tsets, causal)
                        del tsets
                    del full, bare_sets
                    gc.collect()
                    if torch is not None:
                        torch.cuda.empty_cache()
                del shaped
            del sets
        del flat
    return results


# (Br, W) or (Br, W, CP, CC): the launcher's choice first. Four warps (Bc = 64) let two blocks
# share an SM (registers and shared memory both fit twice), at twice the dQ adds per key.
TILE_CANDIDATES = {64: [(128, 8), (128, 4), (64, 8), (64, 4), (128, 8, 0, 1)],
                   128: [(64, 8), (64, 4), (32, 8), (32, 4), (64, 8, 0, 1)]}


def tile_sweep(ctx, dims=(64, 128), candidates=None) -> list[Result]:
    """The bare launch with each candidate tile configuration (``--tiles``; see the module's
    docstring), SDPA flash's backward on the same inputs in the same run."""
    from numba import cuda

    torch = torch_or_none()
    b, h, n = (1, 1, 16) if ctx.simulator else (4, 16, 4 * K)
    dims = (16,) if ctx.simulator else dims
    once = dict(repeat=1, warmup=0) if ctx.simulator else {}
    results = []
    for d in dims:
        tried = candidates or ([tc_backward_tiles(d)[:2], (32, 1)] if ctx.simulator else TILE_CANDIDATES[d])
        size = b * h * n * d
        sets = _inputs(size, 1 if ctx.simulator else 2, False)
        shaped = [tuple(x.reshape(b, h, n, d) for x in s) for s in sets]
        outs = [cuda.device_array((b * h, n), np.float32) for _ in range(2)] + \
            [cuda.device_array((b * h, n, d), np.float32) for _ in range(3)]       # D, L2, dQ, dK, dV
        scale = 1.0 / math.sqrt(d)
        for causal in (False, True):
            config = f"B={b} H={h} N={n} d={d} fp16 causal={causal}"
            flops = 10.0 * b * h * n * n * d / (2 if causal else 1)
            full, bare_sets = _forward_sets(shaped, causal, False)
            for tiles in tried:
                def bare(q, k, v, o, lse, do, c=causal, t=tuple(tiles)):
                    launch_backward(q, k, v, o, lse, do, *outs, scale, c, False, tiles=t)

                extra = {"N": n, "B": b, "H": h, "d": d, "causal": causal, "dtype": "fp16",
                         "tiles": "x".join(map(str, tiles)), "part": "tile sweep"}
                try:
                    r = ctx.measure(CHAPTER, f"bare, tiles {tuple(tiles)}", config, bare, bare_sets, flops=flops,
                                    model_bytes=_model_bytes(b, h, n, d), peak_memory=False, extra=extra, **once,
                                    note="bare launch_backward; tiles (Br, W[, CP, CC]): Bc = 16 W")
                except Exception as exc:     # a candidate the device cannot run: report, keep sweeping
                    ctx.progress(f"  tiles {tuple(tiles)} failed: {type(exc).__name__}: {str(exc)[:160]}")
                    continue
                bare(*bare_sets[0])                       # the gradients of set 0
                results.append(_with_errors(r, check_head(torch, bare_sets[0], outs[2:], causal, False,
                                                          ctx.progress), "fp16"))
            if torch is not None:
                tsets = _torch_sets(torch, full, False)

                def measure(kernel, fn, sets_, **kw):
                    r = ctx.measure(CHAPTER, kernel, config, fn, sets_, flops=flops,
                                    model_bytes=_model_bytes(b, h, n, d),
                                    extra={"N": n, "B": b, "H": h, "d": d, "causal": causal, "dtype": "fp16",
                                           "part": "tile sweep"}, **kw)
                    results.append(r)
                    return r

                _torch_peers(ctx, measure, torch, tsets, causal, peers=("SDPA flash",))
                del tsets
            del full, bare_sets
            gc.collect()
        del sets, shaped, outs
    return results


def main(argv=None) -> int:
    import argparse
    import sys

    from kernels.bench import harness

    parser = argparse.ArgumentParser(prog="python -m kernels.bench.tensor_core_backward",
                                     description="chapter 12's tile sweep, or one call for a profiler "
                                                 "(the tour runs the rest)")
    parser.add_argument("--tiles", action="store_true", help="the tile sweep -> tensor_core_backward_tiles.csv")
    parser.add_argument("--once", type=int, metavar="D", default=None,
                        help="chapter 8's forward, then the backward once, at B=4 H=16 N=4096 fp16 and head dim D "
                             "(B=H=1, N=16 in the simulator): a target for a profiler (kernels.bench.ncu_source)")
    parser.add_argument("--causal", action="store_true", help="with --once: the causal mask")
    parser.add_argument("--d", type=int, nargs="+", default=[64, 128], help="head dims (default: 64 128)")
    parser.add_argument("--out", default=None, help="results folder (default: workbook/results on a GPU, "
                                                    "bench-out in the simulator)")
    args = parser.parse_args(argv)
    if args.once is not None:
        once(args.once, args.causal)
        return 0
    if not args.tiles:
        parser.print_help(sys.stderr)
        return 2
    ctx = harness.Context(quick=False, warmup=3, repeat=20)
    out = harness.results_folder(args.out)
    results = tile_sweep(ctx, dims=tuple(args.d))
    harness.write_csv(out / "tensor_core_backward_tiles.csv", results, harness.environment())
    print(harness.format_table(results, simulator=ctx.simulator))
    return 0


def once(d: int, causal: bool = False) -> None:
    """One call shape for a profiler: chapter 8's forward for O and L, then the public
    launcher's backward once (its first launch of the dK/dV/dQ kernel is the one ``gpu-check
    sources`` profiles; compiling happens on the host, before it), on device arrays, at the
    bench's reference size (tiny in the simulator)."""
    from numba import cuda

    from kernels.base.runtime import on_simulator

    b, h, n = (1, 1, 16) if on_simulator() else (4, 16, 4 * K)
    q, k, v, do = (x.reshape(b, h, n, d) for x in _inputs(b * h * n * d, 1, False)[0])
    o, lse = flash_attention_tc(q, k, v, causal=causal)
    flash_attention_backward_tc(q, k, v, o, lse, do, causal=causal)
    cuda.synchronize()
    print(f"ran: chapter 12's backward, B={b} H={h} N={n} d={d} fp16 causal={causal}")


def _chapter_5(ctx, measure, torch, full, causal):
    """Chapter 5's fp32 backward (its launcher) on float32 copies of the same inputs."""
    from numba import cuda

    from kernels.flash_backward import flash_attention_backward

    try:
        sets = []
        for q, k, v, o, lse, do in full:
            if torch is not None:
                q, k, v, do = (torch.as_tensor(x, device="cuda").float() for x in (q, k, v, do))
                o, lse = torch.as_tensor(o, device="cuda"), torch.as_tensor(lse, device="cuda")
            else:
                q, k, v, do = (cuda.to_device(x.copy_to_host().astype(np.float32)) for x in (q, k, v, do))
            sets.append((q, k, v, o, lse, do))
        measure(FMA, lambda q, k, v, o, lse, do: flash_attention_backward(q, k, v, o, lse, do, causal=causal,
                                                                                    products="fma"),
                sets, note="flash_attention_backward(): float32 copies of the inputs, fp32 math on the FMA units, "
                           "atomic dQ")
    except Exception as exc:          # never lose the chapter to its yardstick
        ctx.progress(f"  skipped chapter 5's backward: {type(exc).__name__}: {str(exc)[:160]}")


def _torch_peers(ctx, measure, torch, tsets, causal, peers=PEERS):
    """SDPA's flash, memory-efficient and cuDNN backends and plain PyTorch (or those of them
    in ``peers``): one forward with requires_grad outside the timed region, then the
    backward alone."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    n = tsets[0][0].shape[-2]
    backends = {"SDPA flash": SDPBackend.FLASH_ATTENTION, "SDPA memory-efficient": SDPBackend.EFFICIENT_ATTENTION,
                "SDPA cuDNN": SDPBackend.CUDNN_ATTENTION}

    def forward(label, q, k, v):
        if label in backends:
            with sdpa_kernel(backends[label]):
                return sdpa(q, k, v, is_causal=causal)
        s = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5)
        if causal:
            keep = torch.ones(n, n, dtype=torch.bool, device=q.device).tril_()
            s = s.masked_fill(~keep, -math.inf)
        return torch.softmax(s, dim=-1) @ v

    def backward(out, q, k, v, do):
        return torch.autograd.grad(out, (q, k, v), do, retain_graph=True)

    notes = {"SDPA flash": "FlashAttention-2's backward (tensor cores)",
             "SDPA memory-efficient": "CUTLASS (xFormers) backward",
             "SDPA cuDNN": "cuDNN's fused backward",
             "plain PyTorch": "softmax(q k^T scale) v in the input type: P (N x N) saved by autograd"}
    for label in peers:
        graphs = []
        try:
            for q, k, v, _, _, do in tsets:
                q, k, v = (x.detach().requires_grad_(True) for x in (q, k, v))
                graphs.append((forward(label, q, k, v), q, k, v, do))
            measure(f"peer: {label} bwd", backward, graphs, is_peer=True,
                    note=notes[label] + "; the backward alone (autograd.grad, forward outside the timed region)")
        except Exception as exc:      # a backend not built, or out of memory at large N
            ctx.progress(f"  skipped {label}: {type(exc).__name__}: {str(exc)[:160]}")
        finally:
            del graphs
            gc.collect()
            torch.cuda.empty_cache()


if __name__ == "__main__":
    import sys

    sys.exit(main())
