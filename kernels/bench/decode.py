"""Chapter 7's bench: decode (Nq = 1) against the HBM read bandwidth and the peers.

On a GPU (``--quick``: fewer points), H = 32 query heads (MHA, and GQA with 8 KV heads),
d = 128, float32 and float16 KV caches, through the public launcher with PyTorch CUDA
tensors in (what a PyTorch user runs):

* uniform batches B x context: 1 x {4k, 16k, 64k, 128k, 512k}, 4 x 128k, 16 x 64k, 64 x 16k
  (fp32: where it fits), both schedules (split-K, stream-K); H = 40 at 1 x 128k (heads that
  do not divide the SMs: where stream-K should win);
* a ragged batch of cache lengths {128k, 8k, 8k, 8k} (GQA 32/8): ours on the cached bytes,
  SDPA on the batch padded to 128k (what a PyTorch user runs);
* fp16 caches with grouped rows (GQA) run on tensor cores; the same plan on the FMA units
  (``tensor_cores=False``) is measured beside it;
* peers in the same run: the measured read bandwidth (a sum over 4 GiB), SDPA flash (fp16),
  SDPA memory-efficient and math (fp32), plain PyTorch (Q K^T, softmax, P V, GQA by
  reshaping the group's queries into rows), and chapter 4's ``flash_attention`` (fp32, a
  few points: its grid starves at Nq = 1).

``model_bytes`` is ``kernels.decode.io_model_bytes`` (K and V once, of the cached keys), so
``gbps`` is the bandwidth of the bytes that had to be read; ``extra`` has the context N,
the fraction of the measured read bandwidth, and the split count or stream-K grid.
"""

from __future__ import annotations

import math

import numpy as np

import kernels  # noqa: F401  (GPU or simulator first)
from kernels import reference as ref
from kernels.base.runtime import cdiv
from kernels.bench.harness import Result, torch_or_none
from kernels.decode import decode_attention, io_model_bytes, prepare_decode

CHAPTER = 7
TITLE = "decode: split-K and stream-K"
JUDGED_BY = "GB/s"        # decode is bound by bandwidth: its plots show bytes a second, not FLOPs

K = 1024


def _points(ctx):
    """(B, Hq, Hkv, lengths or N, label) configurations."""
    if ctx.simulator:
        return [(2, 4, 2, 24, "uniform")]
    uniform = [(1, 32, 32, 4 * K), (1, 32, 32, 16 * K), (1, 32, 32, 64 * K), (1, 32, 32, 128 * K),
               (1, 32, 32, 512 * K), (4, 32, 32, 128 * K), (16, 32, 32, 64 * K), (64, 32, 32, 16 * K),
               (1, 32, 8, 128 * K), (16, 32, 8, 64 * K), (1, 40, 40, 128 * K)]
    if ctx.quick:
        uniform = [(1, 32, 32, 4 * K), (1, 32, 32, 128 * K), (16, 32, 8, 64 * K)]
    points = [(b, hq, hkv, n, "uniform") for b, hq, hkv, n in uniform]
    points.append((4, 32, 8, (128 * K, 8 * K, 8 * K, 8 * K), "ragged"))
    return points


def _fits(b, hkv, n_max, d, itemsize):
    """Leave room on an 80 GB card: K and V and the peers' padded copies."""
    return 2 * b * hkv * n_max * d * itemsize <= 36e9


def _inputs(torch, b, hq, hkv, n_max, d, dtype, seed):
    if torch is None:
        from numba import cuda

        rng = np.random.default_rng(seed)
        return tuple(cuda.to_device(rng.standard_normal(s).astype(dtype))
                     for s in ((b, hq, 1, d), (b, hkv, n_max, d), (b, hkv, n_max, d)))
    g = torch.Generator(device="cuda").manual_seed(seed)
    tdt = torch.float32 if dtype == np.float32 else torch.float16
    return tuple(torch.randn(s, device="cuda", dtype=tdt, generator=g)
                 for s in ((b, hq, 1, d), (b, hkv, n_max, d), (b, hkv, n_max, d)))


def _read_bandwidth(ctx, torch):
    """The read bandwidth the card gives a simple kernel: a sum over 4 GiB (TB/s)."""
    if torch is None:
        return float("nan"), None
    x = torch.ones(2**30, device="cuda", dtype=torch.float32)
    r = ctx.measure(CHAPTER, "peer: read bandwidth (sum of 4 GiB)", "4 GiB fp32", lambda x: x.sum(), [(x,)],
                    flops=float(x.numel()), model_bytes=4.0 * x.numel(), is_peer=True,
                    note="torch.sum over 4 GiB: the bytes a read-only kernel can stream", peak_memory=False)
    del x
    torch.cuda.empty_cache()
    return r.gbps / 1e3, r


def _check(o, lse, q, k, v, lengths, hq):
    """Head 0 of sequence 0 against the oracle (the tests check properly)."""
    n = int(lengths[0])
    if n > 16 * K:
        return
    host = lambda x: x.cpu().numpy() if hasattr(x, "cpu") else x.copy_to_host()  # noqa: E731
    q0 = host(q[:1, :1]).astype(np.float64)
    k0, v0 = (host(x[:1, :1, :n]).astype(np.float64) for x in (k, v))
    exact, _ = ref.attention(q0, k0, v0)
    err = float(np.max(np.abs(host(o[:1, :1]) - exact)))
    assert err < 1e-3, f"decode differs from the oracle by {err:.3g} on head (0, 0)"


def run(ctx) -> list[Result]:
    torch = torch_or_none()
    results: list[Result] = []
    read_tbps, r = _read_bandwidth(ctx, torch)
    if r is not None:
        results.append(r)
    d = 8 if ctx.simulator else 128
    for b, hq, hkv, n, label in _points(ctx):
        lengths = np.full(b, n) if np.isscalar(n) else np.asarray(n)
        n_max = int(lengths.max())
        for dtype in (np.float32,) if ctx.simulator else (np.float32, np.float16):
            itemsize = np.dtype(dtype).itemsize
            if not _fits(b, hkv, n_max, d, itemsize):
                continue
            name = "fp32" if dtype == np.float32 else "fp16"
            sizes = [n_max] if label == "uniform" else [int(x) for x in lengths]
            size = "+".join(f"{x // K}k" if x % K == 0 else str(x) for x in sizes)
            config = f"B={b} Hq={hq} Hkv={hkv} N={size} d={d} {name} KV"
            q, k, v = _inputs(torch, b, hq, hkv, n_max, d, dtype, seed=700)
            cached = [int(x) for x in lengths]
            model = float(io_model_bytes(b, hq, hkv, 1, cached, d, kv_itemsize=itemsize, q_itemsize=itemsize))
            flops = 4.0 * hq * d * sum(cached)
            floor_ms = model / (read_tbps * 1e12) * 1e3 if read_tbps == read_tbps else float("nan")
            extra = dict(N=n_max, batch=b, heads=hq, kv_heads=hkv, kv=name, shape=label, read_tbps=read_tbps,
                         floor_ms=floor_ms)
            opts = {} if label == "uniform" else {"cache_lengths": lengths.astype(np.int32)}
            sets = [(q, k, v)]
            for schedule in ("split-k", "stream-k"):
                # one call as a user makes it (plan and launches), and a plan made once and run
                # again (prepare_decode: the launches alone, as a serving loop runs a step)
                prepared = prepare_decode(q, k, v, schedule=schedule, **opts)
                chosen = dict(splits=prepared.splits) if schedule == "split-k" else dict(blocks=prepared.blocks)
                for label_, fn in ((f"decode_attention {schedule}",
                                    lambda q, k, v, s=schedule: decode_attention(q, k, v, schedule=s, **opts)),
                                   (f"prepare_decode {schedule} (run)", lambda q, k, v, r=prepared: r())):
                    o, lse = fn(q, k, v)
                    _check(o, lse, q, k, v, lengths, hq)
                    res = ctx.measure(CHAPTER, label_, config, fn, sets, flops=flops, model_bytes=model,
                                      extra=dict(extra, **chosen), peak_memory=False)
                    res.extra["pct_read_bw"] = (100.0 * res.gbps / 1e3 / read_tbps if read_tbps == read_tbps
                                                else float("nan"))
                    results.append(res)
                del prepared
            if dtype == np.float16 and hkv < hq:
                # grouped rows of an fp16 cache run on tensor cores; the FMA kernel beside them
                fma = prepare_decode(q, k, v, schedule="stream-k", tensor_cores=False, **opts)
                res = ctx.measure(CHAPTER, "prepare_decode stream-k, FMA units (run)", config,
                                  lambda q, k, v, r=fma: r(), sets, flops=flops, model_bytes=model,
                                  extra=dict(extra, blocks=fma.blocks), peak_memory=False,
                                  note="tensor_cores=False: the group's rows on the FMA units")
                res.extra["pct_read_bw"] = (100.0 * res.gbps / 1e3 / read_tbps if read_tbps == read_tbps
                                            else float("nan"))
                results.append(res)
                del fma
            if torch is not None:
                _torch_peers(ctx, results, torch, q, k, v, lengths, hq, hkv, d, dtype, config, flops, model,
                             extra, label)
            if torch is not None and dtype == np.float32 and hq == hkv and label == "uniform" \
                    and (b, n_max) in ((1, 4 * K), (1, 128 * K), (16, 64 * K)):
                from kernels.flash_forward import flash_attention
                results.append(ctx.measure(CHAPTER, "chapter 4: flash_attention", config,
                                           lambda q, k, v: flash_attention(q, k, v, products="fma"), sets, flops=flops,
                                           model_bytes=model, is_peer=True, extra=dict(extra), peak_memory=False,
                                           note="chapter 4's grid: one block a (query tile, head)"))
            del q, k, v, sets
            if torch is not None:
                torch.cuda.empty_cache()
    return results


def _torch_peers(ctx, results, torch, q, k, v, lengths, hq, hkv, d, dtype, config, flops, model, extra, label):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    group = hq // hkv
    b = q.shape[0]
    note = "" if label == "uniform" else f"on the batch padded to {k.shape[2]} keys (no cache lengths in SDPA)"
    if label != "uniform":          # SDPA has no cache lengths: mask the padding, as a PyTorch user would
        pos = torch.arange(k.shape[2], device="cuda")
        keep = pos[None, :] < torch.as_tensor(lengths, device="cuda")[:, None]
        mask = keep[:, None, None, :].expand(b, hq, 1, k.shape[2])
    else:
        mask = None
    backends = [("flash", SDPBackend.FLASH_ATTENTION)] if dtype == np.float16 else \
        [("efficient", SDPBackend.EFFICIENT_ATTENTION), ("math", SDPBackend.MATH)]
    for name, backend in backends:
        def peer(q, k, v, backend=backend):
            with sdpa_kernel(backend):
                return sdpa(q, k, v, attn_mask=mask, enable_gqa=group > 1)
        try:
            peer(q, k, v)
            results.append(ctx.measure(CHAPTER, f"peer: SDPA {name}", config, peer, [(q, k, v)], flops=flops,
                                       model_bytes=model, is_peer=True, note=note, extra=dict(extra),
                                       peak_memory=False))
        except RuntimeError as exc:
            ctx.progress(f"  SDPA {name} cannot run this case: {str(exc).splitlines()[0][:120]}")

    def plain(q, k, v):
        # the group's query heads as rows of one KV head: (B, Hkv, g, d) @ (B, Hkv, d, N)
        qg = q.reshape(b, hkv, group, d)
        s = (qg @ k.transpose(-1, -2)) * (1.0 / math.sqrt(d))
        if mask is not None:
            s = s.masked_fill(~keep[:, None, None, :], float("-inf"))
        return (torch.softmax(s.float(), dim=-1).to(v.dtype) @ v).reshape(b, hq, 1, d)
    try:
        results.append(ctx.measure(CHAPTER, "peer: plain PyTorch", config, plain, [(q, k, v)], flops=flops,
                                   model_bytes=model, is_peer=True, note=note, extra=dict(extra), peak_memory=False))
    except RuntimeError as exc:
        ctx.progress(f"  plain PyTorch cannot run this case: {str(exc).splitlines()[0][:120]}")


# --------------------------------------------------------------------------- plot

_OURS = (("prepare_decode split-k (run)", "split-K, prepared", "#1f77b4", "-", "o"),
         ("prepare_decode stream-k (run)", "stream-K, prepared", "#ff7f0e", "-", "o"),
         ("decode_attention split-k", "split-K, one call", "#9ecae1", "-", "."))
_PEERS = (("peer: SDPA flash", "SDPA flash", "0.15", "--", "s"),
          ("peer: SDPA efficient", "SDPA mem.-efficient", "0.3", "--", "s"),
          ("peer: SDPA math", "SDPA math", "0.5", "--", "^"),
          ("peer: plain PyTorch", "plain PyTorch", "0.65", "--", "v"),
          ("chapter 4: flash_attention", "chapter 4 flash_attention", "#d62728", ":", "x"))


def plot(results, path, *, title, simulator, ceiling=math.nan, judged_by=None):
    """Two questions, one row each, fp32 and fp16 caches side by side: how close to the
    read bandwidth each kernel gets as one sequence's context grows (B = 1, 32 heads), and
    which schedule wins on each batch shape (uniform, GQA, 40 heads, ragged). TB/s of the
    compulsory bytes (K and V once). In the simulator (tiny sizes), the tour's generic plot."""
    from kernels.bench.tour import plot_results

    def key(r):
        return tuple(str(r.extra.get(k)) for k in ("batch", "heads", "kv_heads", "shape"))   # (CSV: strings)

    sweep = [r for r in results if key(r) == ("1", "32", "32", "uniform")]
    if simulator or len({r.extra.get("N") for r in sweep}) < 3:
        return plot_results(results, path, title=title, simulator=simulator, ceiling=ceiling, judged_by=judged_by)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    read = next((r.gbps / 1e3 for r in results if r.kernel.startswith("peer: read bandwidth")), math.nan)
    fig, axes = plt.subplots(2, 2, figsize=(15, 11), gridspec_kw={"height_ratios": [1, 1.35]})
    for col, kv in enumerate(("fp32", "fp16")):
        # (1) B = 1, 32 heads: TB/s against the context length
        ax = axes[0, col]
        rows = [r for r in sweep if r.extra.get("kv") == kv]
        ns = sorted({int(r.extra["N"]) for r in rows})
        for kernel, label, color, style, marker in _OURS + _PEERS:
            pts = sorted((int(r.extra["N"]), r.gbps / 1e3) for r in rows if r.kernel == kernel)
            if pts:
                ax.plot(*zip(*pts), linestyle=style, marker=marker, color=color, label=label,
                        lw=2.2 if style == "-" and not label.endswith("one call") else 1.4)
        if math.isfinite(read):
            ax.axhline(read, color="0.4", linestyle=":", lw=1.5)
            ax.text(ns[0], read * 1.02, f"read bandwidth {read:.2f} TB/s", fontsize=10, color="0.3", va="bottom")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns, [f"{n // 1024}k" for n in ns])
        ax.set_ylim(0, max(read if math.isfinite(read) else 0, max(r.gbps for r in rows) / 1e3) * 1.6)
        ax.set_xlabel("keys in the cache (B = 1, 32 heads, d = 128)")
        ax.set_ylabel("TB/s of K and V read (higher is better)")
        best = max((r.gbps / 1e3, int(r.extra["N"])) for r in rows if r.kernel == _OURS[0][0] or r.kernel == _OURS[1][0])
        ax.set_title(f"{kv} cache, B = 1: prepared decode reaches {best[0] / read:.0%} of the\n"
                     f"read bandwidth measured in the same run (at {best[1] // 1024}k keys)", fontsize=12)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=9, loc="upper right", ncol=2, columnspacing=1.0)

        # (2) every batch shape at its largest size: split-K, stream-K and the best peer
        ax = axes[1, col]
        shapes = []
        for r in results:
            if r.extra.get("kv") == kv and r.kernel == _OURS[0][0] and key(r) != ("1", "32", "32", "uniform") \
                    or r.extra.get("kv") == kv and r.kernel == _OURS[0][0] and r.config.startswith("B=1 Hq=32 Hkv=32 N=128k"):
                shapes.append(r.config)
        ys, labels = [], []
        for g, config in enumerate(shapes):
            here = [r for r in results if r.config == config]
            peers = [r for r in here if r.is_peer and not r.kernel.startswith("peer: read")]
            bars = [(r.gbps / 1e3, label, color, None) for kernel, label, color, *_ in _OURS[:2]
                    for r in here if r.kernel == kernel]
            if peers:
                p = max(peers, key=lambda r: r.gbps)
                bars.append((p.gbps / 1e3, "best PyTorch: " + p.kernel.replace("peer: ", ""), "0.55", "//"))
            for b, (value, label, color, hatch) in enumerate(bars):
                y = g * 4 + b
                ax.barh(y, value, color=color, hatch=hatch, edgecolor="white" if hatch else "black", lw=0.5,
                        label=label if g == 0 and not label.startswith("best") else None)
                ax.text(value, y, f" {value:.2f}" + (f"  {label[14:]}" if label.startswith("best") else ""),
                        va="center", fontsize=9)
            ys.append(g * 4 + 1)
            labels.append(config.replace(f" d=128 {kv} KV", "").replace("Hq=", "H=").replace(" Hkv=", "/")
                          .replace("N=128k+8k+8k+8k", "ragged 128k+3×8k"))
        if math.isfinite(read):
            ax.axvline(read, color="0.4", linestyle=":", lw=1.5)
        ax.set_yticks(ys, labels, fontsize=10.5)
        ax.invert_yaxis()
        ax.set_xlim(0, (read if math.isfinite(read) else 3) * 1.3)
        ax.set_xlabel("TB/s of K and V read (dotted: the read bandwidth)")
        ragged = {r.kernel: r.gbps for r in results if r.extra.get("kv") == kv and r.extra.get("shape") == "ragged"}
        point = ""
        if _OURS[0][0] in ragged and _OURS[1][0] in ragged:
            point = f":\non the ragged batch stream-K reads {ragged[_OURS[1][0]] / ragged[_OURS[0][0]]:.1f}× as fast as split-K"
        ax.set_title(f"{kv} cache, every batch shape (B, query / KV heads, keys){point}", fontsize=12)
        ax.grid(True, axis="x", alpha=0.3)
        handles, names = ax.get_legend_handles_labels()
        handles.append(Patch(facecolor="0.55", hatch="//", edgecolor="white", label="best PyTorch backend"))
        ax.legend(handles=handles, fontsize=10, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=3)
    fig.suptitle(f"{title}\none new token a sequence, d = 128; \"prepared\": prepare_decode's plan run again, "
                 "\"one call\": decode_attention with its plan cached", fontsize=12.5)
    fig.tight_layout()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
