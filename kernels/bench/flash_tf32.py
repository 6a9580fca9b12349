"""Chapter 11's bench: fp32 attention on tensor cores (3xTF32) against PyTorch's fp32 paths.

On a GPU (``--quick``: d = 64, N = 1k and 4k), H = 16, d = 64 and 128, causal and not, at
a fixed number of tokens B N = 16k, N = 1024 .. 16384, float32 inputs:

* our 3xTF32 kernel as a bare launch (the kernel on preallocated outputs), and through its
  launcher
  (``flash_attention_tf32``) with PyTorch tensors, as a PyTorch user calls it;
* SDPA's memory-efficient backend (CUTLASS, 3xTF32 itself) and its math backend, and
  plain PyTorch (``softmax(q k^T scale) v``), all in fp32 with TF32 off
  (``torch.backends.cuda.matmul.allow_tf32 = False``: PyTorch's default);
* at N = 4096 also plain TF32 (``passes=1``), the kernel with every product on ``mma.sync``
  (``wgmma=False``: where the launchers put S, or S and P V, on Hopper's wgmma) and chapter 4's
  FMA kernel (its launcher).

Each of our rows, and SDPA memory-efficient's, carries the max error of head (0, 0)'s first
512 rows against the float64 oracle, also as a multiple of float32 NumPy's error on the same
rows (the tests' yardstick: the rule allows 2x plus a floor). FLOPs 4 B H N^2 d (halved for
causal). In the simulator: 16 tokens, H = 1, N = 8 and 16, d = 16, no PyTorch.

``python -m kernels.bench.flash_tf32 --variants``: the kernel's variants that the launchers do
not use yet (``VARIANTS``: how every split leaves lo), bare launches taking turns in ``ROUNDS``
rounds (``kernels.bench.turns``) at the chapter 13 floor's fp32 cells (B*H = 512, N = 256 and
1024, d = 128) and at B=4 H=16 N=4096 (d = 64, 128); each variant's O of head (0, 0) checked
as above; SDPA memory-efficient and plain PyTorch in the same run. Writes
``flash_tf32_variants.csv``.
"""

from __future__ import annotations

import numpy as np

import kernels  # noqa: F401  (GPU or simulator first)
from kernels import reference as ref
from kernels.bench.harness import Result, token_sweep, torch_or_none
from kernels.flash_tf32 import flash_attention_tf32, launch_forward, tf32_tiles, tf32_wgmma

CHAPTER = 11
TITLE = "fp32 on tensor cores (3xTF32)"

BARE = "flash fwd 3xTF32 (bare)"
BARE_1X = "flash fwd plain TF32, passes=1 (bare)"
BARE_MMA = "flash fwd 3xTF32 on mma.sync, wgmma=False (bare)"
LAUNCHER_TORCH = "flash_attention_tf32() launcher, PyTorch tensors"
FMA = "chapter 4 flash_attention (fp32 FMA), PyTorch tensors"
CHECK_ROWS = 512
VARIANTS = (("lo rounded", dict(lo="rounded")), ("lo truncated", dict(lo="truncated")))
VARIANT_CELLS = ((32, 16, 256, 128, False), (32, 16, 1024, 128, False), (4, 16, 4096, 128, False),
                 (4, 16, 4096, 128, True), (4, 16, 4096, 64, False))
ROUNDS = 9
TARGET_MS = 100.0             # a round's run of back-to-back calls of one variant


def bare_launch(b, h, n, d, passes, o, lse, **kw):
    """The kernel on device arrays (b, h, n, d) into preallocated o, lse views: the launcher's
    work without its checks and allocations (no split of the keys among blocks); ``kw`` to
    ``launch_forward`` (``wgmma=False``: every product on mma.sync)."""
    Br, Bc, D = tf32_tiles(d)
    scale = np.float32(1.0 / np.sqrt(d))

    def launch(q, k, v, causal):
        launch_forward(*(x.reshape(b * h, n, d) for x in (q, k, v)), o, lse, scale, causal, passes, **kw)

    launch.tiles = (Br, Bc)
    launch.wgmma = (tf32_wgmma(Br, D) if kw.get("wgmma") is None else kw["wgmma"]) or "none"
    return launch


def _error(o_head, head, causal):
    """(max |O - oracle|, that over float32 NumPy's max error) on head (0, 0)'s first rows:
    ``o_head`` (rows, d) as computed, ``head`` = (q rows, k, v) float32 on the host."""
    q, k, v = head
    if causal:                       # the first rows of Nq = Nk see only the first keys
        k, v = k[:len(q)], v[:len(q)]
    exact, _ = ref.attention(q[None, None], k[None, None], v[None, None], causal=causal)
    base, _ = ref.attention(q[None, None], k[None, None], v[None, None], causal=causal, dtype=np.float32)
    err = float(np.max(np.abs(o_head - exact[0, 0])))
    yard = float(np.max(np.abs(base[0, 0] - exact[0, 0])))
    return err, err / yard if yard > 0 else float("nan")


def run(ctx) -> list[Result]:
    from numba import cuda

    torch = torch_or_none()
    if torch is not None:
        torch.backends.cuda.matmul.allow_tf32 = False          # fp32 peers in fp32 (PyTorch's default)
        torch.backends.cudnn.allow_tf32 = False
    results: list[Result] = []
    tokens, h, sweep, n_ref, dims = token_sweep(ctx)
    rng = np.random.default_rng(1100)
    for d in dims:
        size = tokens * h * d
        host = [tuple(rng.standard_normal(size, dtype=np.float32) for _ in range(3))
                for _ in range(1 if ctx.simulator else 2)]
        sets = [tuple(cuda.to_device(x) for x in s) for s in host]
        o_flat = cuda.device_array(size, np.float32)
        lse_flat = cuda.device_array(tokens * h, np.float32)
        for n in sweep:
            b = tokens // n
            at_ref = n == n_ref
            shaped = [tuple(x.reshape(b, h, n, d) for x in s) for s in sets]
            head = tuple(x.reshape(b, h, n, d)[0, 0] for x in host[0])
            rows = min(CHECK_ROWS, n)
            head = (head[0][:rows], head[1], head[2])
            o, lse = o_flat.reshape(b * h, n, d), lse_flat.reshape(b * h, n)
            tsets = [tuple(torch.as_tensor(x, device="cuda") for x in s) for s in shaped] if torch else []
            for causal in (False, True):
                config = f"B={b} H={h} N={n} d={d} fp32 causal={causal}"
                flops = 4.0 * b * h * n * n * d / (2 if causal else 1)
                model = 4.0 * b * h * n * (4 * d + 1)
                extra = {"N": n, "B": b, "d": d, "causal": causal, "dtype": "fp32"}

                def measure(kernel, fn, sets_, **kw):
                    r = ctx.measure(CHAPTER, kernel, config, fn, sets_, flops=flops, model_bytes=model,
                                    peak_memory=False, extra=dict(extra), **kw)
                    results.append(r)
                    return r

                bare = ((3, BARE, {}), (3, BARE_MMA, {"wgmma": False}), (1, BARE_1X, {})) if at_ref else ((3, BARE, {}),)
                for passes, label, kw in bare:
                    launch = bare_launch(b, h, n, d, passes, o, lse, **kw)
                    r = measure(label, lambda q, k, v, c=causal, f=launch: f(q, k, v, c), shaped)
                    launch(*shaped[0], causal)
                    err, times = _error(o[0, :rows].copy_to_host(), head, causal)
                    r.note = f"bare launch, Br={launch.tiles[0]} Bc={launch.tiles[1]}, on wgmma: {launch.wgmma}; " \
                             f"head (0,0) max error {err:.1e} ({times:.2f}x float32 NumPy's)"
                    r.extra.update({"max_error": err, "error_vs_float32": times, "passes": passes,
                                    "wgmma": launch.wgmma})
                if torch is None:
                    continue
                measure(LAUNCHER_TORCH, lambda q, k, v, c=causal: flash_attention_tf32(q, k, v, causal=c), tsets,
                        note="float32 tensors in, O and L from PyTorch's allocator")
                if at_ref:
                    from kernels.flash_forward import flash_attention

                    measure(FMA, lambda q, k, v, c=causal: flash_attention(q, k, v, causal=c, products="fma"), tsets,
                            note="the course's fp32 kernel on the FMA units")
                _torch_peers(ctx, measure, torch, tsets, causal, head, rows)
            del shaped, o, lse, tsets
            if torch is not None:
                torch.cuda.empty_cache()
        del sets, o_flat, lse_flat
    return results


def _torch_peers(ctx, measure, torch, tsets, causal, head, rows, labels=None):
    """SDPA memory-efficient and math, and plain PyTorch, in fp32 (TF32 off); ``labels``: some of them."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    def plain(q, k, v):
        s = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5)
        if causal:
            n_q, n_k = s.shape[-2], s.shape[-1]
            mask = torch.ones(n_q, n_k, dtype=torch.bool, device=s.device).tril(n_k - n_q)
            s = s.masked_fill(~mask, float("-inf"))
        return torch.softmax(s, dim=-1) @ v

    peers = [(SDPBackend.EFFICIENT_ATTENTION, "SDPA memory-efficient"), (SDPBackend.MATH, "SDPA math"),
             (None, "plain PyTorch")]
    for backend, label in peers:
        if labels is not None and label not in labels:
            continue
        def fn(q, k, v, backend=backend):
            if backend is None:
                return plain(q, k, v)
            with sdpa_kernel(backend):
                return sdpa(q, k, v, is_causal=causal)
        try:
            r = measure(f"peer: {label} fp32", fn, tsets, is_peer=True,
                        note="CUTLASS, 3xTF32 on tensor cores" if backend == SDPBackend.EFFICIENT_ATTENTION
                        else "fp32 matmuls, TF32 off")
            out = fn(*tsets[0])[0, 0, :rows].float().cpu().numpy()
            err, times = _error(out, head, causal)
            r.note += f"; head (0,0) max error {err:.1e} ({times:.2f}x float32 NumPy's)"
            r.extra.update({"max_error": err, "error_vs_float32": times})
        except Exception as exc:           # a backend not built, or out of memory at large N
            ctx.progress(f"  skipped {label}: {type(exc).__name__}: {str(exc)[:120]}")
            torch.cuda.empty_cache()


def variant_sweep(ctx, cells=None) -> list[Result]:
    """Each of ``VARIANTS`` as a bare ``launch_forward`` at each cell (B, H, N, d, causal),
    taking turns (``kernels.bench.turns``); each variant's O of head (0, 0) against float64.
    Peers: SDPA memory-efficient and plain PyTorch, timed after."""
    from numba import cuda

    from kernels.bench.turns import take_turns, turn_summary, variant_row

    torch = torch_or_none()
    if torch is not None:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    cells = cells or (((1, 1, 16, 16, False), (1, 1, 16, 16, True)) if ctx.simulator else VARIANT_CELLS)
    first_label = VARIANTS[0][0]
    rng = np.random.default_rng(1101)
    results: list[Result] = []
    for b, h, n, d, causal in cells:
        config = f"B={b} H={h} N={n} d={d} fp32 causal={causal}"
        flops = 4.0 * b * h * n * n * d / (2 if causal else 1)
        model = 4.0 * b * h * n * (4 * d + 1)
        extra = {"N": n, "B": b, "H": h, "d": d, "causal": causal, "dtype": "fp32", "part": "variants"}
        host = [tuple(rng.standard_normal((b * h, n, d), dtype=np.float32) for _ in range(3))
                for _ in range(1 if ctx.simulator else 2)]
        sets = [tuple(cuda.to_device(x) for x in s) for s in host]
        o, lse = cuda.device_array((b * h, n, d), np.float32), cuda.device_array((b * h, n), np.float32)
        scale = np.float32(1.0 / np.sqrt(d))
        calls = {label: (lambda q, k, v, kw=kw: launch_forward(q, k, v, o, lse, scale, causal, 3, **kw))
                 for label, kw in VARIANTS}
        ctx.progress(f"  ch{CHAPTER} {len(VARIANTS)} variants, taking turns: {config}")
        samples = take_turns(calls, sets, ctx.simulator, ROUNDS, TARGET_MS)
        rows = min(CHECK_ROWS, n)
        head = (host[0][0][0, :rows], host[0][1][0], host[0][2][0])
        Br, Bc, _ = tf32_tiles(d, n)
        for label, kw in VARIANTS:
            t, turns = turn_summary(samples, label, first_label, ctx.simulator)
            calls[label](*sets[0])
            err, times = _error(o[0, :rows].copy_to_host(), head, causal)
            args = ", ".join(f"{k_}={v_!r}" for k_, v_ in kw.items())
            results.append(variant_row(
                CHAPTER, label, config, t, turns, flops, model,
                f"bare launch_forward({args}), Br={Br} Bc={Bc}, {t.runs} rounds taking turns; "
                f"head (0,0) max error {err:.1e} ({times:.2f}x float32 NumPy's)",
                dict(extra, **kw, max_error=err, error_vs_float32=times)))
            ctx.progress(f"      {label}: {t.median_ms:.4g} ms, {turns[f'speedup over {first_label}']:.3f}x "
                         f"(rounds {turns['round ratios p10']:.3f}-{turns['round ratios p90']:.3f})")
        if torch is not None:
            tsets = [tuple(torch.as_tensor(x, device="cuda").reshape(b, h, n, d) for x in s) for s in sets]

            def measure(kernel, fn, sets_, **kw):
                r = ctx.measure(CHAPTER, kernel, config, fn, sets_, flops=flops, model_bytes=model,
                                peak_memory=False, extra=dict(extra), **kw)
                results.append(r)
                return r

            _torch_peers(ctx, measure, torch, tsets, causal, head, rows,
                         labels=("SDPA memory-efficient", "plain PyTorch"))
            del tsets
            torch.cuda.empty_cache()
        del sets, o, lse
    return results


def main(argv=None) -> int:
    from kernels.bench.turns import variants_main

    return variants_main(argv, prog="python -m kernels.bench.flash_tf32",
                         description="chapter 11's forward variants (the tour runs the rest)",
                         sweep=variant_sweep, csv_name="flash_tf32_variants.csv")


if __name__ == "__main__":
    import sys

    sys.exit(main())
