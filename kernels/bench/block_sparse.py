"""Chapter 6's bench: block-sparse attention, time against the kept fraction.

On a GPU (``--quick``: fewer points):

* N = 4096, B=4 H=16 d=64 fp32 and N = 16384, B=1 H=8 d=64 (quick: N = 4096 only); mask
  blocks 128 x 128 (FlexAttention's default block), random flags shared by the heads with
  the diagonal kept, at densities 1, 1/2, 1/4, 1/8, 1/16 (quick: 1, 1/4, 1/8), non-causal;
  and the causal sliding window as a pattern row;
* forward: the block-sparse kernel (bare launch on preallocated O, L, lists built once);
  in the same run the dense fused forward of chapter 4 (``flash_attention``), PyTorch
  FlexAttention fp32 (``torch.compile(flex_attention)`` with ``create_block_mask`` from the
  same flags) and SDPA memory-efficient fp32 (dense) as peers;
* backward: ``block_sparse_attention_backward`` (lists built once; atomic dQ, and the
  deterministic separate-dQ variant at density 1 and for the pattern) against chapter 5's dense
  ``flash_attention_backward``, FlexAttention's and SDPA memory-efficient's backward
  (``torch.autograd.grad`` of a forward kept alive).

FLOPs are the work actually done: 4 B H N^2 d times the kept fraction rho of kernel tiles
(2.5x that for the backward); ``extra`` has rho, the mask density and the dense-equivalent
TFLOP/s. ``model_bytes``: the IO models of ``kernels.block_sparse.io_model_bytes`` (``kernels.base.io_model``:
2Nd + N + 2Nd ceil(N/Br) rho per head) and ``kernels.block_sparse_backward.io_model_bytes``.
The result that matters: time tracks rho, and at rho = 1/8 the forward is >= 5x faster than
the dense fused forward.
"""

from __future__ import annotations

import math

import numpy as np

import kernels  # noqa: F401  (GPU or simulator first)
from kernels import reference as ref
from kernels import sparsity_patterns as sp
from kernels.bench.harness import Result, cupy_or_none, torch_or_none
from kernels.base.fused import Tiles, padded_head_dim
from kernels.block_sparse import forward_tiles, io_model_bytes, make_block_sparse_forward, tile_lists
from kernels.flash_forward import shared_bytes
from kernels.block_sparse_backward import backward_lists, backward_tiles, block_sparse_attention_backward
from kernels.block_sparse_backward import io_model_bytes as io_model_bytes_backward
from kernels.base.runtime import cdiv
from kernels.base.shared_memory import allow_dynamic_shared_memory

CHAPTER = 6
TITLE = "block-sparse attention"

BLOCK = 128


def _dims(ctx):
    """(B, H, N, d) points and densities."""
    if ctx.simulator:
        return [(1, 1, 32, 8)], (1.0, 0.25), 8
    points = [(4, 16, 4096, 64)] + ([] if ctx.quick else [(1, 8, 16384, 64)])
    densities = (1.0, 0.25, 0.125) if ctx.quick else (1.0, 0.5, 0.25, 0.125, 0.0625)
    return points, densities, BLOCK


def _inputs(b, h, n, d, count, seed=600):
    from numba import cuda

    cp = cupy_or_none()
    sets = []
    for i in range(count):
        if cp is not None:
            cp.random.seed(seed + i)
            sets.append(tuple(cuda.as_cuda_array(cp.random.standard_normal((b, h, n, d), dtype=cp.float32))
                              for _ in range(3)))
        else:
            rng = np.random.default_rng(seed + i)
            sets.append(tuple(cuda.to_device(rng.standard_normal((b, h, n, d)).astype(np.float32))
                              for _ in range(3)))
    return sets


def _mask(n, block, density, seed=0):
    if density >= 1.0:
        return sp.dense(n, n, block=block)
    # keep the diagonal, and draw the rest so that the whole mask keeps `density` of the tiles
    t = cdiv(n, block)
    rest = max(0.0, (density * t * t - t) / (t * t - t)) if t > 1 else 1.0
    return sp.random_blocks(n, n, block=block, density=rest, seed=seed, keep_diagonal=True)


def forward_fn(b, h, n, d, mask, causal, tiles=None, prefetch=False):
    """(fn(q, k, v), rho, tiles): a bare launch of the block-sparse forward on preallocated O, L
    (``tiles``: chapter 4's Tiles to try instead of the launcher's; ``prefetch``: the next
    K/V tile loaded into registers during the current one, or when it is needed, the
    launcher's choice, as in chapter 4)."""
    from numba import cuda

    tiles, D = forward_tiles(d, mask, tiles)
    lists = tile_lists(mask, n, n, Br=tiles.Br, Bc=tiles.Bc, causal=causal, batch=b, heads=h)
    dev = lists.device()
    kernel = make_block_sparse_forward(tiles.Br, tiles.Bc, D, tiles.TM, tiles.TX, prefetch)
    bh = b * h
    o = cuda.device_array((bh, n, d), np.float32)
    lse = cuda.device_array((bh, n), np.float32)
    grid = (cdiv(n, tiles.Br), bh)
    nbytes = shared_bytes(tiles, D)
    tail = (dev.row_ptr, dev.col_idx, dev.row_order, np.int32(lists.groups), np.int32(d),
            np.float32(1 / math.sqrt(d)), np.int32(causal))
    raised = []

    def fn(q, k, v):
        args = (q.reshape(bh, n, d), k.reshape(bh, n, d), v.reshape(bh, n, d), o, lse) + tail
        if not raised:
            allow_dynamic_shared_memory(kernel, args, nbytes)
            raised.append(True)
        kernel[grid, tiles.threads, 0, nbytes](*args)

    fn.outputs = (o, lse)
    return fn, lists.kept_fraction, tiles


def _check_head(fn, sets, mask, causal):
    """Head (0, 0) against the oracle: catches a broken run (the tests check properly)."""
    q, k, v = sets[0]
    fn(q, k, v)
    o, _ = fn.outputs
    n = q.shape[2]
    if n > 4096:
        return
    q0, k0, v0 = (x[0:1, 0:1].copy_to_host() for x in (q, k, v))
    flags = mask.flags if mask.flags.ndim == 2 else mask.flags.reshape(-1, *mask.flags.shape[-2:])[0]
    exact, _ = ref.attention(q0, k0, v0, causal=causal, block_mask=ref.BlockMask(flags, mask.block_q, mask.block_k))
    err = float(np.max(np.abs(o[0:1].copy_to_host() - exact[0])))
    assert err < 1e-4, f"block-sparse forward differs from the oracle by {err:.3g} on head (0, 0)"


def _config(b, h, n, d, causal, label):
    return f"B={b} H={h} N={n} d={d} fp32 causal={causal} {label}"


# --------------------------------------------------------------------------- peers

def _flex(torch, flags, n, block, causal):
    """torch.compile(flex_attention) and the BlockMask made from the same flags, or None."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    keep = torch.as_tensor(flags, device="cuda")

    def mask_mod(b, h, q_idx, kv_idx):
        allowed = keep[q_idx // block, kv_idx // block]
        return allowed & (kv_idx <= q_idx) if causal else allowed

    block_mask = create_block_mask(mask_mod, None, None, n, n, device="cuda", BLOCK_SIZE=block)
    return _compiled_flex(torch, flex_attention), block_mask


_COMPILED_FLEX = []


def _compiled_flex(torch, flex_attention):
    """One torch.compile(flex_attention) for the whole run, with static shapes. Left to its
    defaults, torch.compile recompiles per shape with dynamic shapes after the first change
    (slower kernels) and, past its recompile limit, silently falls back to the unfused
    eager path: at N = 16384 that measured FlexAttention at ~1 TFLOP/s instead of its real rate.
    Its compiled backward also donates buffers, which forbids the retain_graph=True that
    repeated timing of one graph needs."""
    if not _COMPILED_FLEX:
        dynamo = torch._dynamo.config
        for limit in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                      "accumulated_cache_size_limit"):
            if hasattr(dynamo, limit):
                setattr(dynamo, limit, max(getattr(dynamo, limit), 256))
        try:
            import torch._functorch.config as functorch
            functorch.donated_buffer = False
        except (ImportError, AttributeError):
            pass
        _COMPILED_FLEX.append(torch.compile(flex_attention, dynamic=False))
    return _COMPILED_FLEX[0]


def _torch_forward_peers(ctx, results, torch, sets, flags, n, d, block, causal, config, flops, model, extra,
                         dense_flops):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    tsets = [tuple(torch.as_tensor(x, device="cuda") for x in qkv) for qkv in sets]
    scale = 1.0 / math.sqrt(d)
    try:
        flex = _flex(torch, flags, n, block, causal)
        if flex is not None:
            compiled, bmask = flex
            results.append(ctx.measure(CHAPTER, "peer: FlexAttention fp32", config,
                                       lambda q, k, v: compiled(q, k, v, block_mask=bmask, scale=scale), tsets,
                                       flops=flops, model_bytes=model, is_peer=True,
                                       note="torch.compile(flex_attention), same block mask", extra=dict(extra)))
    except Exception as exc:  # no Triton, a compile failure: report and go on
        ctx.progress(f"  skipped FlexAttention: {type(exc).__name__}: {str(exc)[:160]}")
    if extra.get("density") == 1.0 or extra.get("pattern"):
        def dense(q, k, v):
            with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                return sdpa(q, k, v, is_causal=causal, scale=scale)
        try:
            results.append(ctx.measure(CHAPTER, "peer: SDPA efficient fp32 (dense)", config, dense, tsets,
                                       flops=dense_flops, model_bytes=model, is_peer=True,
                                       note="dense attention, no mask", extra=dict(extra)))
        except RuntimeError as exc:
            ctx.progress(f"  skipped SDPA efficient: {str(exc)[:120]}")
    del tsets
    torch.cuda.empty_cache()


def _torch_backward_peers(ctx, results, torch, sets, flags, n, d, block, causal, config, flops, model, extra):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    scale = 1.0 / math.sqrt(d)
    tsets = []
    for q, k, v in sets:
        tq, tk, tv = (torch.as_tensor(x, device="cuda").clone().requires_grad_(True) for x in (q, k, v))
        tsets.append((tq, tk, tv, torch.randn_like(tq)))

    def backward_of(forward):
        kept = [(forward(q, k, v), q, k, v, do) for q, k, v, do in tsets]

        def bwd(out, q, k, v, do):
            return torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
        return bwd, kept

    try:
        flex = _flex(torch, flags, n, block, causal)
        if flex is not None:
            compiled, bmask = flex
            bwd, kept = backward_of(lambda q, k, v: compiled(q, k, v, block_mask=bmask, scale=scale))
            results.append(ctx.measure(CHAPTER, "peer: FlexAttention fp32 backward", config, bwd, kept,
                                       flops=flops, model_bytes=model, is_peer=True, peak_memory=False,
                                       note="autograd.grad of torch.compile(flex_attention)", extra=dict(extra)))
            del kept
    except Exception as exc:
        ctx.progress(f"  skipped FlexAttention backward: {type(exc).__name__}: {str(exc)[:160]}")
    if extra.get("density") == 1.0:
        def dense(q, k, v):
            with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                return sdpa(q, k, v, is_causal=causal, scale=scale)
        try:
            bwd, kept = backward_of(dense)
            results.append(ctx.measure(CHAPTER, "peer: SDPA efficient fp32 backward (dense)", config, bwd, kept,
                                       flops=flops, model_bytes=model, is_peer=True, peak_memory=False,
                                       note="autograd.grad, dense", extra=dict(extra)))
            del kept
        except RuntimeError as exc:
            ctx.progress(f"  skipped SDPA efficient backward: {str(exc)[:120]}")
    del tsets
    torch.cuda.empty_cache()


def _dense_chapter4(ctx, results, sets, config, flops, model, extra, causal):
    """Chapter 4's dense fused forward: its bare launch (as our kernel is timed) when its
    bench offers one, else its launcher."""
    try:
        from kernels.flash_forward import flash_attention
    except ImportError:
        return
    b, h, n, d = sets[0][0].shape
    try:
        from kernels.bench.flash_forward import bare_launch
        from kernels.flash_forward import default_tiles

        fn, _, _ = bare_launch(default_tiles(d), b, h, n, n, d, causal=causal)
        note = f"bare launch, {default_tiles(d)}, every tile"
    except Exception:  # its bench changed shape: time the launcher
        fn = lambda q, k, v: flash_attention(q, k, v, causal=causal, products="fma")  # noqa: E731
        note = "flash_attention() launcher, every tile"
    results.append(ctx.measure(CHAPTER, "dense fused forward (chapter 4)", config, fn, sets,
                               flops=flops, model_bytes=model, peak_memory=False, note=note, extra=dict(extra)))


def _dense_chapter5(ctx, results, grads, config, flops, model, extra, causal):
    try:
        from kernels.flash_backward import flash_attention_backward
    except ImportError:
        return
    results.append(ctx.measure(CHAPTER, "dense backward (chapter 5)", config,
                               lambda q, k, v, o, lse, do: flash_attention_backward(q, k, v, o, lse, do,
                                                                                    causal=causal, products="fma"),
                               grads, flops=flops, model_bytes=model, peak_memory=False,
                               note="flash_attention_backward() launcher, every tile", extra=dict(extra)))


# --------------------------------------------------------------------------- the run

def _one_mask(ctx, results, torch, b, h, n, d, mask, causal, label, extra0):
    from numba import cuda

    sets = _inputs(b, h, n, d, 2)
    fn, rho, cfg = forward_fn(b, h, n, d, mask, causal)   # cfg: the launcher's Tiles
    _check_head(fn, sets, mask, causal)
    dense_flops = 4.0 * b * h * n * n * d
    flops = dense_flops * rho
    extra = dict(extra0, N=n, rho=round(rho, 4), density=round(mask.density, 4), Br=cfg.Br, Bc=cfg.Bc)
    config = _config(b, h, n, d, causal, label)
    model = io_model_bytes(b, h, n, n, d, Br=cfg.Br, rho=rho)
    r = ctx.measure(CHAPTER, "block-sparse forward", config, fn, sets, flops=flops, model_bytes=model,
                    peak_memory=False, note=f"bare launch, Br={cfg.Br} Bc={cfg.Bc}, lists built once",
                    extra=dict(extra, part="forward"))
    r.extra["dense_equiv_tflops"] = round(dense_flops / (r.median_ms / 1e3) / 1e12, 2)
    results.append(r)
    if extra0.get("density") == 0.125 or extra0.get("pattern"):   # the first version: slow, two points
        from kernels.block_sparse import first_block_sparse_attention

        results.append(ctx.measure(
            CHAPTER, "first block-sparse forward (one thread a row)", config,
            lambda q, k, v: first_block_sparse_attention(q, k, v, mask, causal=causal), sets, flops=flops,
            model_bytes=4.0 * b * h * n * (2 * d + 1 + 2 * n * d * rho), peak_memory=False,
            repeat=None if ctx.simulator else 3, warmup=None if ctx.simulator else 1,
            note="launcher (the notebook's exercise 4): Q, K, V and the running O in HBM, no tiles",
            extra=dict(extra, part="forward")))
    if extra0.get("density") == 1.0 or extra0.get("pattern"):
        _dense_chapter4(ctx, results, sets, config, dense_flops / (2 if causal else 1),
                        io_model_bytes(b, h, n, n, d, Br=cfg.Br, rho=1.0), dict(extra, part="forward", rho=1.0),
                        causal)
    if torch is not None:
        _torch_forward_peers(ctx, results, torch, sets, mask.flags, n, d, mask.block_q, causal, config, flops,
                             model, dict(extra, part="forward"), dense_flops / (2 if causal else 1))

    # backward: the launcher with the lists built once (it allocates dQ, dK, dV and D)
    bcfg = backward_tiles(d, mask)          # chapter 5's tiles, fitted to the mask: both kernels' lists
    blists = backward_lists(mask, None, b, h, n, n, causal, bcfg, "separate")
    brho = blists[0].kept_fraction
    grads = []
    for q, k, v in sets:
        fn(q, k, v)
        o, lse = (x.copy_to_host() for x in fn.outputs)
        do = cuda.to_device(np.random.default_rng(7).standard_normal((b, h, n, d)).astype(np.float32))
        grads.append((q, k, v, cuda.to_device(o.reshape(b, h, n, d)), cuda.to_device(lse.reshape(b, h, n)), do))
    bflops = 2.5 * dense_flops * brho
    bmodel = io_model_bytes_backward(b, h, n, n, d, Br=bcfg.dq_Br, Bc=bcfg.Bc, rho=brho)
    bextra = dict(extra, rho=round(brho, 4), Br=bcfg.Br, Bc=bcfg.Bc, part="backward")
    # the default (atomic dQ) at every point; the deterministic two-pass variant where the
    # dense peers run too, to show what determinism costs
    modes = ("atomic", "separate") if extra0.get("density") == 1.0 or extra0.get("pattern") else ("atomic",)
    for mode in modes:
        results.append(ctx.measure(
            CHAPTER, "block-sparse backward" + ("" if mode == "atomic" else " (separate dQ)"), config,
            lambda q, k, v, o, lse, do, mode=mode: block_sparse_attention_backward(
                q, k, v, o, lse, do, mask, causal=causal, lists=blists if mode == "separate" else blists[0],
                dq_mode=mode),
            grads, flops=bflops, peak_memory=False,
            model_bytes=io_model_bytes_backward(b, h, n, n, d, Br=bcfg.dq_Br, Bc=bcfg.Bc, rho=brho, dq_mode=mode),
            note=f"launcher, {bcfg}, lists built once; chapter 5's kernels walking them: " + (
                "D pre-pass + dK/dV kernel adding dQ atomically" if mode == "atomic" else
                "D pre-pass + dK/dV kernel + dQ kernel, deterministic"), extra=dict(bextra, dq_mode=mode)))
    if extra0.get("density") == 1.0 or extra0.get("pattern"):
        _dense_chapter5(ctx, results, grads, config, 2.5 * dense_flops / (2 if causal else 1),
                        io_model_bytes_backward(b, h, n, n, d, Br=bcfg.dq_Br, Bc=bcfg.Bc, rho=1.0),
                        dict(bextra, rho=1.0), causal)
    if torch is not None:
        _torch_backward_peers(ctx, results, torch, sets, mask.flags, n, d, mask.block_q, causal, config, bflops,
                              bmodel, bextra)
    del sets, grads


# Tile configurations (Br, Bc, TM, TX) the sweep tries at d = 64 (all divide 128 x 128 blocks).
# The last field: the next K/V tile prefetched into registers, or loaded when needed (the
# launcher's choice, as in chapter 4).
SWEEP = [(128, 64, 8, 8, False), (128, 64, 8, 8, True), (128, 64, 8, 16, False), (128, 32, 8, 8, False),
         (64, 64, 4, 8, False), (64, 32, 4, 8, False)]


def tile_sweep(ctx, results):
    """The forward at N = 4096, densities 1 and 1/8, with each candidate tile configuration."""
    if ctx.simulator:
        b, h, n, d, block, sweep = 1, 1, 32, 8, 8, [(8, 8, 2, 4, False), (8, 4, 2, 4, True)]
    else:
        b, h, n, d, block, sweep = 4, 16, 4096, 64, BLOCK, SWEEP
    sets = _inputs(b, h, n, d, 2)
    for density in (1.0, 0.125):
        mask = _mask(n, block, density)
        for Br, Bc, TM, TX, pf in sweep:
            try:
                tiles = Tiles(Br, Bc, TM, TX)
                fn, rho, _ = forward_fn(b, h, n, d, mask, False, tiles, prefetch=pf)
                _check_head(fn, sets, mask, False)
                results.append(ctx.measure(
                    CHAPTER, f"block-sparse forward {tiles}" + (" prefetch" if pf else ""),
                    _config(b, h, n, d, False, f"random {density:g} (tile sweep)"), fn, sets,
                    flops=4.0 * b * h * n * n * d * rho, model_bytes=io_model_bytes(b, h, n, n, d, Br=Br, rho=rho),
                    peak_memory=False, note="tile sweep, bare launch",
                    extra={"part": "tile sweep", "rho": round(rho, 4), "threads": tiles.threads, "prefetch": pf,
                           "smem_bytes": shared_bytes(tiles, padded_head_dim(d, TX))}))
            except Exception as exc:  # a candidate the device cannot run: report, keep sweeping
                ctx.progress(f"  tile sweep: {(Br, Bc, TM, TX, pf)} failed: {type(exc).__name__}: {str(exc)[:160]}")
    del sets


def run(ctx) -> list[Result]:
    torch = torch_or_none()
    results: list[Result] = []
    points, densities, block = _dims(ctx)
    for b, h, n, d in points:
        for density in densities:
            mask = _mask(n, block, density)
            _one_mask(ctx, results, torch, b, h, n, d, mask, False, f"random {density:g}",
                      {"density": density})
        # a pattern: the causal sliding window (one tile either side of the diagonal)
        mask = sp.sliding_window(n, n, block=block, window=1)
        _one_mask(ctx, results, torch, b, h, n, d, mask, True, "causal sliding window",
                  {"pattern": "causal sliding window"})
    if not ctx.quick:
        tile_sweep(ctx, results)
    return results


# --------------------------------------------------------------------------- plot

def plot(results, path, *, title, simulator, ceiling=math.nan, judged_by=None):
    """Two questions: does the time track the kept fraction rho (forward and backward,
    against chapter 4's and 5's dense kernels and FlexAttention), and what the causal sliding
    window costs each of them. The tile sweep stays in the CSV. In the simulator (tiny
    sizes), the tour's generic plot."""
    from kernels.bench.tour import plot_results

    rows = [r for r in results if "tile sweep" not in r.config and "N" in r.extra]
    masks = [r for r in rows if "pattern" not in r.extra and r.kernel.startswith("block-sparse")]
    if simulator or len({str(r.extra.get("density")) for r in masks}) < 3:
        return plot_results(results, path, title=title, simulator=simulator, ceiling=ceiling, judged_by=judged_by)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = sorted({int(float(r.extra["N"])) for r in rows})
    shades = dict(zip(ns, ("#1f77b4", "#08306b", "#6baed6")))
    peer_shades = dict(zip(ns, ("0.55", "0.2", "0.75")))
    fig, axes = plt.subplots(1, 3, figsize=(15, 5.6), gridspec_kw={"width_ratios": [1, 1, 1.1]})
    names = {"forward": ("block-sparse forward", "peer: FlexAttention fp32", "dense fused forward (chapter 4)", 4),
             "backward": ("block-sparse backward", "peer: FlexAttention fp32 backward", "dense backward (chapter 5)", 5)}
    for ax, part in zip(axes, ("forward", "backward")):
        ours_name, flex_name, dense_name, chapter = names[part]
        gains = []
        for n in ns:
            def series(kernel):
                pts = sorted((float(r.extra["rho"]), r.median_ms) for r in rows
                             if r.kernel == kernel and "pattern" not in r.extra and int(float(r.extra["N"])) == n
                             and r.extra.get("dq_mode", "atomic") == "atomic")
                return pts
            ours, flex = series(ours_name), series(flex_name)
            dense = [r.median_ms for r in rows if r.kernel == dense_name and "pattern" not in r.extra
                     and int(float(r.extra["N"])) == n]
            if ours:
                ax.plot(*zip(*ours), "-o", color=shades[n], lw=2.2, label=f"ours, N = {n}")
            if flex:
                ax.plot(*zip(*flex), "--s", color=peer_shades[n], lw=1.5, label=f"FlexAttention, N = {n}")
            if dense and ours:
                xs = [x for x, _ in ours]
                ax.plot(xs, [dense[0] * x for x in xs], ":", color=shades[n], lw=1.2,
                        label=f"dense (ch. 4 / 5) × rho, N = {n}")
                near = min(ours, key=lambda p: abs(math.log2(p[0] / 0.125)))
                gains.append((n, near[0], dense[0] / near[1]))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("kept fraction of the tiles, rho (random 128 × 128 masks)")
        ax.set_ylabel(f"{part} time (ms, lower is better)")
        ax.grid(True, which="both", alpha=0.3)
        if gains:
            ax.set_title(f"{part.capitalize()}: time falls with rho; at rho ≈ 1/8\n"
                         + ", ".join(f"{g:.1f}× (N = {n})" for n, _, g in gains)
                         + f"\nfaster than chapter {chapter}'s dense kernel", fontsize=11.5)

    # the causal sliding window: each kernel's time, forward and backward, per N
    ax = axes[2]
    kinds = (("block-sparse", "ours", "#1f77b4", None),
             ("dense", "ch. 4 / 5 dense (causal)", "#9ecae1", None),
             ("peer: FlexAttention", "FlexAttention", "0.35", "//"),
             ("peer: SDPA efficient", "SDPA (dense, causal)", "0.7", "//"))
    window = [r for r in rows if r.extra.get("pattern") and r.extra.get("dq_mode", "atomic") == "atomic"]
    groups = [(part, n) for part in ("forward", "backward") for n in ns]
    width = 0.8 / len(kinds)
    for k, (prefix, label, color, hatch) in enumerate(kinds):
        xs, ys = [], []
        for g, (part, n) in enumerate(groups):
            hit = [r for r in window if r.kernel.startswith(prefix) and r.extra.get("part") == part
                   and int(float(r.extra["N"])) == n]
            if hit:
                xs.append(g + (k - (len(kinds) - 1) / 2) * width)
                ys.append(hit[0].median_ms)
        ax.bar(xs, ys, width, color=color, hatch=hatch, edgecolor="white" if hatch else "black", lw=0.5, label=label)
        for x, y in zip(xs, ys):
            ax.text(x, y * 1.05, f"{y:.3g}", ha="center", va="bottom", fontsize=8.5, rotation=90)
    ax.set_yscale("log")
    ax.set_xticks(range(len(groups)), [f"{part}\nN = {n}" for part, n in groups], fontsize=10.5)
    ax.set_ylabel("time (ms, log scale)")
    ax.set_ylim(top=ax.get_ylim()[1] * 12)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=9, loc="upper left", ncol=2, columnspacing=0.8)
    rho = next((float(r.extra["rho"]) for r in window if r.kernel == "block-sparse forward"), math.nan)
    ax.set_title(f"Causal sliding window (rho = {rho:.3f}):\nours skips the tiles that the\n"
                 "dense causal kernels compute", fontsize=11.5)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=10, bbox_to_anchor=(0.36, -0.1))
    fig.suptitle(f"{title}\nd = 64, fp32, 128 × 128 mask blocks; ours and chapters 4/5: kernel launches; "
                 f"FlexAttention: torch.compile, the same block mask", fontsize=12)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
