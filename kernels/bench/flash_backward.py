"""Chapter 5's bench: the recomputing backward, alone and after chapter 4's forward.

Reference configuration: B=4, H=16, N=4096, d=64, fp32 (``kernels.base.io_model``). In one run:

* the backward alone (bare launches on preallocated buffers), causal and not, with dQ by
  float32 atomics (the default) and from the separate deterministic kernel (what
  determinism costs, measured);
* ``flash_attention_backward()`` as a user calls it (it allocates dQ, dK, dV, D: the
  peak memory figure);
* forward + backward: chapter 4's ``flash_attention`` then the backward;
* peers, backward through autograd (the graph built outside the timed region): plain
  PyTorch fp32 (q @ k^T * scale -> softmax -> @ v, TF32 off: it saves the N x N P),
  SDPA's math backend and memory-efficient backend (``torch.nn.attention.sdpa_kernel``);
  and the same peers forward + backward;
* the N sweep 512 .. 16384 at B*N = 16384 tokens, H=16 (``--quick``: 1024, 4096, 16384);
* the tile sweep at the reference configuration: dK/dV-kernel candidates (dQ kernel at
  its default) and dQ-kernel candidates (dK/dV kernel at its default), with the
  registers and local memory a thread of each kernel uses.

FLOPs: 2.5 x 4 B H N^2 d for the backward, 3.5 x for forward + backward (halved when
causal); our kernels do 14 N^2 d a head with the separate dQ kernel (S and dP are
recomputed twice), 10 N^2 d with atomics. ``model_bytes``: the fused backward's IO model
(``kernels.flash_backward.io_model_bytes``); peers get the same figure (effective GB/s).
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda

from kernels import reference as ref
from kernels.bench.harness import Result, torch_or_none
from kernels.base.backward_tiles import check_tiles, head_dim_bucket, shared_bytes
from kernels.flash_backward import (
    DKDV_SIG,
    DQ_SIG,
    BackwardTiles,
    allocate_outputs,
    default_tiles,
    io_model_bytes,
    launch,
    make_dkdv,
    make_dq,
    row_per_thread_backward,
    shared_tile_backward,
    standard_backward_bytes,
)

from kernels.flash_backward import flash_attention_backward as _flash_attention_backward

try:
    from kernels.flash_forward import flash_attention as _flash_attention
except ImportError:  # chapter 4 not present: the forward + backward rows are skipped
    _flash_attention = None


def flash_attention_backward(q, k, v, o, lse, do, **options):
    """Chapter 5's launcher on chapter 5's kernels (products="fma"): on a GPU with TF32
    tensor cores, its default is chapter 11's 3xTF32 backward."""
    return _flash_attention_backward(q, k, v, o, lse, do, products="fma", **options)


def _fma_forward(q, k, v, **options):
    """Chapter 4's launcher on chapter 4's kernel (products="fma")."""
    return _flash_attention(q, k, v, products="fma", **options)


flash_attention = None if _flash_attention is None else _fma_forward

CHAPTER = 5
TITLE = "recomputing backward"

# Tile candidates at d = 64: BackwardTiles(Br, Bc, threads, dq_Br, dq_Bc, dq_threads, merged).
# dK/dV candidates (Br, Bc, threads, merged); shared memory includes the running sums of the
# two-level dV/dK (dQ) sums.
DKDV_SWEEP = (
    (64, 128, 256, True),    # default: 199 KB (P and dS share a buffer), 8 x 4 micro-tiles
    (16, 64, 128, None),     # the earlier default: 83 KB
    (32, 64, 128, None),     # 100 KB
    (64, 64, 256, None),     # 134 KB
    (32, 128, 256, None),    # 182 KB
    (64, 64, 128, None),     # 134 KB, 8 x 4 S micro-tiles but local memory at 128 threads
    (16, 64, 64, None),      # 8 x 8 dK/dV micro-tiles: local memory
)
DQ_SWEEP = (                 # dQ candidates (dq_Br, dq_Bc, dq_threads)
    (64, 16, 128),           # 64 KB
    (64, 32, 128),           # 76 KB
    (64, 64, 256),           # 101 KB
    (128, 32, 256),          # 136 KB
    (128, 64, 256),          # default: 169 KB
)
QUICK_SWEEP = 3              # --quick: the first candidates of each list


def _dims(ctx):
    if ctx.simulator:
        return dict(ref=(1, 1, 16, 8), sweep=[(1, 1, 16, 8)])
    ns = (1024, 4096, 16384) if ctx.quick else (512, 1024, 2048, 4096, 8192, 16384)
    return dict(ref=(4, 16, 4096, 64), sweep=[(max(1, 16384 // n), 16, n, 64) for n in ns])


def _inputs(b, h, n, d, count, seed=300):
    """``count`` sets of (q, k, v, do) float32 N(0, 1) device arrays, and the forward's (o, lse)."""
    sets = []
    for i in range(count):
        rng = np.random.default_rng(seed + i)
        q, k, v, do = (cuda.to_device(rng.standard_normal((b, h, n, d)).astype(np.float32)) for _ in range(4))
        sets.append([q, k, v, do])
    return sets


def _forward(q, k, v, causal):
    """(o, lse) as device arrays: chapter 4's kernel, or the oracle head by head if it is absent."""
    if flash_attention is not None:
        return flash_attention(q, k, v, causal=causal)
    o, lse = ref.attention(q.copy_to_host(), k.copy_to_host(), v.copy_to_host(), causal=causal)
    return cuda.to_device(o.astype(np.float32)), cuda.to_device(lse.astype(np.float32))


# The bench's spot check is a guard against gross errors (a wrong tile, a race), not the
# test contract: the tests hold every gradient to the tolerance rule (kernels/base/testing.py).
# Float32 arithmetic lands near 1e-6 relative error here; a bug lands far above 1e-4.
REL_ERROR_GUARD = 1e-4


def _check_head(grads, q, k, v, o, lse, do, causal):
    """Head (0, 0) against the float64 oracle: relative error ||got - exact|| / ||exact|| of
    each gradient must stay under REL_ERROR_GUARD. Returns, for the CSV, each gradient's
    relative error and its max error over float32 NumPy's (the tolerance rule's ratio, <= 2
    where the rule holds)."""
    host = [np.asarray(x.copy_to_host())[0:1, 0:1] for x in (q, k, v, o, lse, do)]
    exact = ref.attention_backward(*host, causal=causal)
    baseline = ref.attention_backward(*host, causal=causal, dtype=np.float32)
    out = {}
    for name, g, e, bl in zip(("dq", "dk", "dv"), grads, exact, baseline):
        got = np.asarray(g.copy_to_host())[0:1, 0:1].astype(np.float64)
        assert np.isfinite(got).all(), f"bench {name}: non-finite values"
        rel = float(np.linalg.norm(got - e) / max(np.linalg.norm(e), 1e-30))
        assert rel < REL_ERROR_GUARD, f"bench {name}: relative error {rel:.2e} >= {REL_ERROR_GUARD:g}"
        err_f32 = float(np.max(np.abs(bl - e)))
        out[f"{name}_rel_err"] = rel
        out[f"{name}_err_over_f32"] = float(np.max(np.abs(got - e))) / err_f32 if err_f32 > 0 else float("nan")
    return out


def _kernel_resources(tiles, D, dq_mode):
    """Registers and local memory a thread, shared memory a block, of the compiled kernels."""
    out = {}
    dkdv_b, dq_b = shared_bytes(tiles, D)
    try:
        kd = make_dkdv(tiles.Br, tiles.Bc, D, tiles.threads, dkdv_b > 48 * 1024,
                       dq_mode == "atomic", tiles.merged_at(D)).compile(DKDV_SIG)
        out.update(dkdv_regs=kd.regs_per_thread, dkdv_local=kd.local_mem_per_thread, dkdv_smem=dkdv_b)
        if dq_mode != "atomic":
            kq = make_dq(tiles.dq_Br, tiles.dq_Bc, D, tiles.dq_threads, dq_b > 48 * 1024).compile(DQ_SIG)
            out.update(dq_regs=kq.regs_per_thread, dq_local=kq.local_mem_per_thread, dq_smem=dq_b)
    except Exception as exc:  # resources are a note, never a failure
        out["resources"] = f"n/a ({type(exc).__name__})"
    return out


LADDER = (1, 16, 4096, 64)              # B, H, N, d of the ladder's rows


def ladder_rows(ctx, results):
    """The ladder through its public launchers at one configuration, causal and not: rung 1
    (one thread a key row for dK, dV, one a query row for dQ), rung 2 (blocks sharing tiles
    through shared memory), rung 3 (``flash_attention_backward``, atomic dQ)."""
    b, h, n, d = (1, 1, 16, 8) if ctx.simulator else LADDER
    sets = _inputs(b, h, n, d, 2, seed=500)
    rungs = (("rung 1: one thread a row", row_per_thread_backward, "every operand from global memory"),
             ("rung 2: shared tiles", shared_tile_backward, "query tiles and K/V tiles shared by a block"),
             ("rung 3: flash_attention_backward()", flash_attention_backward, "production: micro-tiles"))
    for causal in (False, True):
        full = []
        for q, k, v, do in sets:
            o, lse = _forward(q, k, v, causal)
            full.append((q, k, v, o, lse, do))
        fwd_flops = 4.0 * b * h * n * n * d / (2.0 if causal else 1.0)
        for label, launcher, note in rungs:
            results.append(ctx.measure(
                CHAPTER, label, f"B={b} H={h} N={n} d={d} fp32 causal={causal}",
                lambda q, k, v, o, lse, do, f=launcher, c=causal: f(q, k, v, o, lse, do, causal=c), full,
                flops=2.5 * fwd_flops, model_bytes=io_model_bytes(b, h, n, n, d, causal=causal),
                peak_memory=False, repeat=None if ctx.simulator else 5, warmup=None if ctx.simulator else 1,
                note=f"launcher; {note}", extra={"N": n, "causal": causal, "part": "ladder"}))
        del full


def run(ctx) -> list[Result]:
    torch = torch_or_none()
    dims = _dims(ctx)
    results = []
    ladder_rows(ctx, results)

    # ------------------------------------------------------------- reference config
    b, h, n, d = dims["ref"]
    D = head_dim_bucket(d)
    bh = b * h
    sets = _inputs(b, h, n, d, 2)
    for causal in (False, True):
        config = f"B={b} H={h} N={n} d={d} fp32 causal={causal}"
        div = 2.0 if causal else 1.0
        fwd_flops = 4.0 * bh * n * n * d / div
        extra = {"N": n, "causal": causal}
        full = []
        for q, k, v, do in sets:
            o, lse = _forward(q, k, v, causal)
            full.append((q, k, v, do, o, lse))
        views = [tuple(x.reshape(bh, n, d) for x in (q, k, v)) + (o.reshape(bh, n, d), lse.reshape(bh, n),
                                                                   do.reshape(bh, n, d))
                 for q, k, v, do, o, lse in full]
        scale = 1.0 / math.sqrt(d)
        tiles = default_tiles(d)
        for dq_mode in ("atomic", "separate"):
            out = allocate_outputs(bh, n, n, d)

            def bwd(q3, k3, v3, o3, l2, do3, dq_mode=dq_mode, out=out):
                return launch(q3, k3, v3, o3, l2, do3, n, n, D, causal, scale, tiles, dq_mode, out=out)

            grads = bwd(*views[0])
            q, k, v, do, o, lse = full[0]
            accuracy = _check_head([g.reshape(b, h, n, d) for g in grads], q, k, v, o, lse, do, causal)
            note = ("dQ by a second Q-tile-outer kernel: deterministic, 14 N^2 d FLOPs a head"
                    if dq_mode == "separate" else
                    "dQ by float32 atomics from the dK/dV kernel (the default): 10 N^2 d FLOPs, "
                    "order-dependent")
            results.append(ctx.measure(
                CHAPTER, f"flash backward ({dq_mode} dQ)", config, bwd, views, flops=2.5 * fwd_flops,
                model_bytes=io_model_bytes(b, h, n, n, d, tiles, dq_mode, causal), peak_memory=False,
                note=f"{note}; bare launches; {tiles}",
                extra=dict(extra, dq_mode=dq_mode, **accuracy, **_kernel_resources(tiles, D, dq_mode))))
            del out
        launcher_sets = [(q, k, v, o, lse, do) for q, k, v, do, o, lse in full]
        results.append(ctx.measure(
            CHAPTER, "flash_attention_backward() launcher", config,
            lambda q, k, v, o, lse, do: flash_attention_backward(q, k, v, o, lse, do, causal=causal),
            launcher_sets, flops=2.5 * fwd_flops, model_bytes=io_model_bytes(b, h, n, n, d, tiles, "atomic", causal),
            note="default (atomic dQ); checks arguments, allocates dQ, dK, dV, D "
                 "(peak memory: 3 B H N d + B H N floats)",
            extra=dict(extra), repeat=None if ctx.simulator else max(5, ctx.repeat // 2)))
        if flash_attention is not None:
            def fwd_bwd(q, k, v, do):
                o, lse = flash_attention(q, k, v, causal=causal)
                return flash_attention_backward(q, k, v, o, lse, do, causal=causal)

            fb_model = io_model_bytes(b, h, n, n, d, tiles, "atomic", causal) + 4.0 * bh * (4 * n * d + n)
            results.append(ctx.measure(
                CHAPTER, "flash forward + backward (ch 4 + ch 5)", config, fwd_bwd, [tuple(s) for s in sets],
                flops=3.5 * fwd_flops, model_bytes=fb_model,
                note="chapter 4's flash_attention then flash_attention_backward (launchers, allocating)",
                extra=dict(extra), repeat=None if ctx.simulator else max(5, ctx.repeat // 2)))
        if torch is not None:
            results += _torch_peers(ctx, torch, sets, b, h, n, d, causal, fwd_flops, extra,
                                    io_model_bytes(b, h, n, n, d, tiles, "atomic", causal))
        del full, views, launcher_sets

    # ------------------------------------------------------------- tile sweep
    config = f"B={b} H={h} N={n} d={d} fp32 causal=False"
    fwd_flops = 4.0 * bh * n * n * d
    q, k, v, do = sets[0]
    o, lse = _forward(q, k, v, False)
    view = [tuple(x.reshape(bh, n, d) for x in (q, k, v)) + (o.reshape(bh, n, d), lse.reshape(bh, n),
                                                              do.reshape(bh, n, d))]
    base = default_tiles(d)
    candidates = []
    sweep_dkdv = DKDV_SWEEP[:QUICK_SWEEP] if ctx.quick else DKDV_SWEEP
    sweep_dq = DQ_SWEEP[:QUICK_SWEEP] if ctx.quick else DQ_SWEEP
    if ctx.simulator:
        sweep_dkdv, sweep_dq = ((8, 16, 16, True),), ((16, 8, 16),)
    for br, bc, nt, merged in sweep_dkdv:
        candidates.append(("dkdv", BackwardTiles(br, bc, nt, base.dq_Br, base.dq_Bc, base.dq_threads, merged)))
    for br, bc, nt in sweep_dq:
        candidates.append(("dq", BackwardTiles(base.Br, base.Bc, base.threads, br, bc, nt, base.merged)))
    for what, tiles in candidates:
        mode = "atomic" if what == "dkdv" else "separate"
        try:
            check_tiles(tiles, D, mode)
        except ValueError as exc:
            ctx.progress(f"  skipped {tiles}: {exc}")
            continue
        out = allocate_outputs(bh, n, n, d)

        def bwd(q3, k3, v3, o3, l2, do3, tiles=tiles, out=out, mode=mode):
            return launch(q3, k3, v3, o3, l2, do3, n, n, D, False, 1.0 / math.sqrt(d), tiles, mode, out=out)

        try:
            grads = bwd(*view[0])
            accuracy = _check_head([g.reshape(b, h, n, d) for g in grads], q, k, v, o, lse, do, False)
            results.append(ctx.measure(
                CHAPTER, f"tile sweep: {what} kernel", config + " | " + str(tiles), bwd, view,
                flops=2.5 * fwd_flops, model_bytes=io_model_bytes(b, h, n, n, d, tiles, mode),
                peak_memory=False, note=f"sweeps the {what} kernel; the other at its default",
                extra=dict(sweep=what, tiles=str(tiles), dq_mode=mode, **accuracy,
                           **_kernel_resources(tiles, D, mode))))
        except Exception as exc:  # a candidate that fails to launch is reported, not fatal
            ctx.progress(f"  candidate {tiles} failed: {type(exc).__name__}: {exc}")
        del out
    del sets, view

    # ------------------------------------------------------------- N sweep
    for b, h, n, d in dims["sweep"]:
        config = f"B={b} H={h} N={n} d={d} fp32 causal=False"
        bh = b * h
        fwd_flops = 4.0 * bh * n * n * d
        sets = _inputs(b, h, n, d, 2, seed=400)
        full = []
        for q, k, v, do in sets:
            o, lse = _forward(q, k, v, False)
            full.append((q, k, v, o, lse, do))
        model = io_model_bytes(b, h, n, n, d)
        extra = {"N": n, "sweep": "N", "standard_bwd_model_bytes": standard_backward_bytes(b, h, n, d)}
        results.append(ctx.measure(
            CHAPTER, "flash_attention_backward() launcher", config,
            lambda q, k, v, o, lse, do: flash_attention_backward(q, k, v, o, lse, do),
            full, flops=2.5 * fwd_flops, model_bytes=model, note="N sweep at B*N = 16384 tokens; atomic dQ",
            extra=dict(extra, dq_mode="atomic")))
        results.append(ctx.measure(
            CHAPTER, "flash_attention_backward() separate dQ", config,
            lambda q, k, v, o, lse, do: flash_attention_backward(q, k, v, o, lse, do, dq_mode="separate"),
            full, flops=2.5 * fwd_flops, model_bytes=io_model_bytes(b, h, n, n, d, dq_mode="separate"),
            note="N sweep; dQ by the deterministic second kernel", peak_memory=False,
            extra=dict(extra, dq_mode="separate")))
        if torch is not None:
            results += _torch_peers(ctx, torch, sets, b, h, n, d, False, fwd_flops, extra, model,
                                    with_forward=False)
        del sets, full
    return results


def _torch_peers(ctx, torch, sets, b, h, n, d, causal, fwd_flops, extra, model, with_forward=True):
    """Backward (and forward + backward) of the PyTorch peers, fp32, TF32 off."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    out = []
    config = f"B={b} H={h} N={n} d={d} fp32 causal={causal}"
    scale = 1.0 / math.sqrt(d)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    mask = None
    if causal:
        mask = torch.ones(n, n, dtype=torch.bool, device="cuda").tril()

    def plain(q, k, v):
        s = (q @ k.transpose(-2, -1)) * scale
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        return torch.softmax(s, dim=-1) @ v

    def sdpa_with(backend):
        def fn(q, k, v):
            with sdpa_kernel(backend):
                return sdpa(q, k, v, is_causal=causal, scale=scale)
        return fn

    peers = (("plain PyTorch fp32", plain, "q @ k^T * scale -> softmax -> @ v (saves the N x N P); autograd"),
             ("SDPA math fp32", sdpa_with(SDPBackend.MATH), "unfused, S and P materialised"),
             ("SDPA efficient fp32", sdpa_with(SDPBackend.EFFICIENT_ATTENTION),
              "fused, recomputing backward (this chapter's idea, in CUTLASS)"))
    try:
        tsets = [tuple(torch.as_tensor(x, device="cuda").detach().clone().requires_grad_(i < 3)
                       for i, x in enumerate(s)) for s in sets]
        for label, fwd, note in peers:
            graphs = None
            try:
                graphs = []
                for q, k, v, do in tsets:
                    o = fwd(q, k, v)
                    graphs.append((o, q, k, v, do))

                def bwd(o, q, k, v, do):
                    return torch.autograd.grad(o, (q, k, v), do, retain_graph=True)

                out.append(ctx.measure(CHAPTER, f"peer: {label} backward", config, bwd, graphs,
                                       flops=2.5 * fwd_flops, model_bytes=model, is_peer=True,
                                       note=note + "; graph built outside the timed region",
                                       extra=dict(extra)))
                del graphs
                if with_forward:
                    def fwd_bwd(q, k, v, do, fwd=fwd):
                        o = fwd(q, k, v)
                        return torch.autograd.grad(o, (q, k, v), do)

                    out.append(ctx.measure(CHAPTER, f"peer: {label} forward + backward", config, fwd_bwd, tsets,
                                           flops=3.5 * fwd_flops, model_bytes=model, is_peer=True, note=note,
                                           extra=dict(extra)))
            except RuntimeError as exc:  # out of memory at large N, or backend unavailable
                ctx.progress(f"  skipped {label} at {config}: {str(exc)[:120]}")
                graphs = None
                torch.cuda.empty_cache()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    del tsets
    torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    """``python -m kernels.bench.flash_backward --ladder [--out DIR]``: the ladder's rows
    alone, written to <out>/flash_backward_ladder.csv (the tour runs them with the rest)."""
    import argparse

    from kernels.bench import harness

    parser = argparse.ArgumentParser(prog="python -m kernels.bench.flash_backward")
    parser.add_argument("--ladder", action="store_true", required=True)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    ctx = harness.Context(quick=False, warmup=3, repeat=20)
    out = harness.results_folder(args.out)
    results = []
    ladder_rows(ctx, results)
    harness.write_csv(out / "flash_backward_ladder.csv", results, harness.environment())
    print(harness.format_table(results))
    return 0



# --------------------------------------------------------------------------- plot

# The N sweep's series, as the plot names them (ours solid, peers dashed).
_SERIES = (("flash_attention_backward() launcher", "ours, atomic dQ (default)", "#1f77b4", "-", "o"),
           ("flash_attention_backward() separate dQ", "ours, separate dQ", "#6baed6", "-", "o"),
           ("peer: SDPA efficient fp32 backward", "SDPA memory-efficient", "0.2", "--", "s"),
           ("peer: SDPA math fp32 backward", "SDPA math", "0.45", "--", "^"),
           ("peer: plain PyTorch fp32 backward", "plain PyTorch", "0.65", "--", "v"))


def plot(results, path, *, title, simulator, ceiling=math.nan, judged_by=None):
    """Two questions, three panels: how the backward's time grows with N next to PyTorch's
    backends (and as a ratio to the best of them), and what causal masking saves at the
    reference size. The tile sweep stays in the CSV. In the simulator (one tiny size),
    the tour's generic plot."""
    from kernels.bench.tour import plot_results

    sweep = [r for r in results if str(r.extra.get("sweep")) == "N"]
    if simulator or len({float(r.extra["N"]) for r in sweep}) < 2:
        return plot_results(results, path, title=title, simulator=simulator, ceiling=ceiling, judged_by=judged_by)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    times = {}                                    # (kernel, N) -> ms
    for r in sweep:
        times[(r.kernel, int(float(r.extra["N"])))] = r.median_ms
    ns = sorted({n for _, n in times})
    peers = [k for k, *_ in _SERIES if k.startswith("peer")]
    best = {n: min(times[(k, n)] for k in peers if (k, n) in times) for n in ns
            if any((k, n) in times for k in peers)}
    best_by = {min((times[(k, n)], k) for k in peers if (k, n) in times)[1] for n in best}
    best_name = dict((k, label) for k, label, *_ in _SERIES)[best_by.pop()] if len(best_by) == 1 else "at each N"
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 5.4), gridspec_kw={"width_ratios": [1.15, 1, 1.05]})

    # (a) time against N
    for kernel, label, color, style, marker in _SERIES:
        pts = [(n, times[(kernel, n)]) for n in ns if (kernel, n) in times]
        if pts:
            missing = [str(n) for n in ns if (kernel, n) not in times]
            label += f" (no row at N = {', '.join(missing)})" if missing else ""
            a.plot(*zip(*pts), linestyle=style, marker=marker, color=color, label=label, lw=2.2 if style == "-" else 1.6)
    a.set_xscale("log", base=2)
    a.set_yscale("log")
    a.set_xticks(ns, [str(n) for n in ns])
    a.set_xlabel("N (B·N = 16384 tokens, H = 16, d = 64, fp32)")
    a.set_ylabel("backward time (ms, lower is better)")
    a.set_title("Backward time against N\n(fixed tokens: the N² work grows like N)", fontsize=12)
    a.grid(True, which="both", alpha=0.3)
    a.legend(fontsize=9.5, loc="upper left")

    # (b) time over the best peer's, at each N
    worst = 1.0
    for kernel, label, color, style, marker in _SERIES:
        pts = [(n, times[(kernel, n)] / best[n]) for n in ns if (kernel, n) in times and n in best]
        if pts and not all(v == 1.0 for _, v in pts):
            b.plot(*zip(*pts), linestyle=style, marker=marker, color=color, label=label, lw=2.2 if style == "-" else 1.6)
            worst = max(worst, max(v for _, v in pts))
            if kernel == _SERIES[0][0]:
                for n, v in pts:
                    b.annotate(f"{v:.2f}×", (n, v), textcoords="offset points", xytext=(0, 8), ha="center",
                               fontsize=10, color=color)
    b.axhline(1.0, color="0.2", linestyle="--", lw=1.2)
    b.text(ns[0], 0.97, "best PyTorch backend at that N", va="top", fontsize=9.5, color="0.3")
    b.set_xscale("log", base=2)
    b.set_xticks(ns, [str(n) for n in ns])
    b.set_xlim(ns[0] / 1.35, ns[-1] * 1.35)
    b.set_ylim(0.85, worst * 1.1)
    b.set_xlabel("N")
    b.set_ylabel("time ÷ the best peer's time")
    ours = [times[(_SERIES[0][0], n)] / best[n] for n in ns if (_SERIES[0][0], n) in times and n in best]
    b.set_title(f"Ours (atomic dQ) takes {min(ours):.2f}–{max(ours):.2f}× the best\n"
                f"PyTorch backend's time ({best_name})", fontsize=12)
    b.grid(True, which="both", alpha=0.3)
    b.legend(fontsize=10, loc="upper right")

    # (c) the reference size, causal or not
    bars = (("flash_attention_backward() launcher", "ours,\natomic dQ", "#1f77b4"),
            ("peer: SDPA efficient fp32 backward", "SDPA memory-\nefficient", "0.2"),
            ("peer: SDPA math fp32 backward", "SDPA\nmath", "0.45"),
            ("peer: plain PyTorch fp32 backward", "plain\nPyTorch", "0.65"))
    ref = {(r.kernel, str(r.extra.get("causal"))): r for r in results
           if "sweep" not in r.extra and "causal" in r.extra}
    config = next((_without(r.config, "causal") for r in ref.values()), "")
    width = 0.38
    for k, causal in enumerate(("False", "True")):
        xs, ys = [], []
        for x, (kernel, _, color) in enumerate(bars):
            if (kernel, causal) in ref:
                xs.append(x + (k - 0.5) * width)
                ys.append(ref[(kernel, causal)].median_ms)
        rects = c.bar(xs, ys, width, color=[bars[round(x - (k - 0.5) * width)][2] for x in xs],
                      hatch=None if causal == "False" else "//", edgecolor="white" if causal == "True" else "black",
                      lw=0.6, label="non-causal" if causal == "False" else "causal (hatched)")
        for rect, y in zip(rects, ys):
            c.text(rect.get_x() + rect.get_width() / 2, y, f"{y:.1f}", ha="center", va="bottom", fontsize=9.5)
    c.set_xticks(range(len(bars)), [label for _, label, _ in bars], fontsize=10.5)
    c.set_ylabel("backward time (ms, lower is better)")
    c.set_xlabel(config)
    c.legend(fontsize=10, loc="upper left")
    c.grid(True, axis="y", alpha=0.3)
    saved = [ref[(kernel, "True")].median_ms / ref[(kernel, "False")].median_ms for kernel, _, _ in bars[:1] + bars[3:]
             if (kernel, "True") in ref and (kernel, "False") in ref]
    if len(saved) == 2:
        c.set_title(f"Causal: ours takes {saved[0]:.2f}× its non-causal time\n"
                    f"(skipped tiles); plain PyTorch {saved[1]:.2f}×", fontsize=12)
    fig.suptitle(title + "\nours: flash_attention_backward() as a user calls it; peers: autograd.grad on a "
                 "graph built outside the timed region", fontsize=12)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def _without(config, key):
    """``config`` without its ``key=...`` item."""
    return " ".join(item for item in config.split() if not item.startswith(f"{key}="))


if __name__ == "__main__":
    import sys

    sys.exit(main())
