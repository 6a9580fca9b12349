"""Chapter 9's bench: P shards of the KV cache as P devices on one GPU, their partials
reduced as a tree and flat, against the decode chapter's time.

On a GPU (``--quick``: N = 128k only): the decode chapter's reference shape for grouped
heads, B = 1, Hq = 32, Hkv = 8, Nq = 1, d = 128, fp16 cache (q fp16 too), N = 128k (and
16k, 512k), through plans made once (``prepare_decode``, ``prepare_tree_decode``: the
launches alone, as a serving loop runs a step):

* the baseline: the decode chapter's best launch, ``prepare_decode`` stream-K (and split-K
  with its own split count);
* for P = 1, 8, 16, 32, 64 devices: the P partials alone (split-K's first kernel with P
  splits: every block a device), partials + flat reduction (the decode chapter's
  combine: one chain of P - 1 merges a row tile), partials + tree reduction
  (``make_tree_reduce``: ceil(log2 P) levels);
* each reduction alone on those partials: one launch (what a step pays: launch and
  kernel), and 20 launches back to back (per launch: the kernel's own time, the launch
  overlapped).

``extra`` has P (``shards``), the reduction's share of the baseline decode time in percent
(``share_pct``; the issue's goal: <= 5% for the tree of 8-64 shards at 128k) and, for the
whole steps, the time added over the partials alone (``added_ms``). Before timing, the
tree's and the flat reduction's outputs are checked against the decode chapter's and,
for KV head 0, against the float64 oracle.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

import kernels  # noqa: F401  (GPU or simulator first)
from kernels import reference as ref
from kernels.base.runtime import on_simulator
from kernels.bench.harness import Result, torch_or_none
from kernels.decode import io_model_bytes, prepare_decode
from kernels.tree_attention import partial_bytes, prepare_tree_decode

CHAPTER = 9
TITLE = "tree attention"

K = 1024
SHARDS = (1, 8, 16, 32, 64)
BACK_TO_BACK = 20


def _points(ctx):
    """(B, Hq, Hkv, N, d, shards)."""
    if ctx.simulator:
        return [(1, 2, 1, 8, 8, (1, 2))]
    ns = (128 * K,) if ctx.quick else (16 * K, 128 * K, 512 * K)
    return [(1, 32, 8, n, 128, SHARDS) for n in ns]


def _inputs(torch, b, hq, hkv, n, d, seed):
    shapes = ((b, hq, 1, d), (b, hkv, n, d), (b, hkv, n, d))
    if torch is None:
        from numba import cuda

        rng = np.random.default_rng(seed)
        dtype = np.float32 if on_simulator() else np.float16
        return tuple(cuda.to_device(rng.standard_normal(s).astype(dtype)) for s in shapes)
    g = torch.Generator(device="cuda").manual_seed(seed)
    return tuple(torch.randn(s, device="cuda", dtype=torch.float16, generator=g) for s in shapes)


def _host(x):
    return x.cpu().numpy() if hasattr(x, "cpu") else x.copy_to_host()


class _Checker:
    """Checks a step's (o, lse) against the decode chapter's (every head) and, where the
    cache is at most 128k keys, the float64 oracle on KV head 0's group (computed once)."""

    def __init__(self, base_o, base_lse, q, k, v, hq, hkv):
        self.base = tuple(np.asarray(_host(x), np.float64) for x in (base_o, base_lse))
        self.g = hq // hkv
        self.exact = None
        if k.shape[2] <= 128 * K:
            q0 = _host(q[:1, :self.g]).astype(np.float64)
            k0, v0 = (_host(x[:1, :1]).astype(np.float64) for x in (k, v))
            self.exact = ref.decode_attention(q0, k0, v0)

    def __call__(self, o, lse, label):
        o, lse = (np.asarray(_host(x), np.float64) for x in (o, lse))
        for name, got, base in (("O", o, self.base[0]), ("L", lse, self.base[1])):
            err = float(np.max(np.abs(got - base)))
            assert err < 2e-3, f"{label}: {name} differs from decode_attention's by {err:.3g}"
        if self.exact is not None:
            g = self.g
            err = max(float(np.max(np.abs(o[:1, :g] - self.exact[0]))),
                      float(np.max(np.abs(lse[:1, :g] - self.exact[1]))))
            assert err < 2e-3, f"{label}: differs from the float64 oracle by {err:.3g} on KV head 0"


def _per_launch(r: Result, n: int) -> Result:
    """A measurement of n launches back to back, as a time a launch."""
    return dataclasses.replace(r, median_ms=r.median_ms / n, p10_ms=r.p10_ms / n, p90_ms=r.p90_ms / n,
                               tflops=r.tflops * n, gbps=r.gbps * n, extra=dict(r.extra))


def run(ctx) -> list[Result]:
    torch = torch_or_none()
    results: list[Result] = []
    for b, hq, hkv, n, d, shard_counts in _points(ctx):
        kv = "fp32" if ctx.simulator else "fp16"
        size = f"{n // K}k" if n % K == 0 else str(n)
        config = f"B={b} Hq={hq} Hkv={hkv} N={size} d={d} {kv} KV"
        q, k, v = _inputs(torch, b, hq, hkv, n, d, seed=900)
        itemsize = 4 if ctx.simulator else 2
        model = float(io_model_bytes(b, hq, hkv, 1, n, d, kv_itemsize=itemsize, q_itemsize=itemsize))
        flops = 4.0 * hq * d * n * b
        extra = dict(N=n, batch=b, heads=hq, kv_heads=hkv, kv=kv)
        sets = [()]

        # ---- the baseline: the decode chapter's best launch (and split-K), planned once
        base = {}
        for schedule in ("stream-k",) if ctx.simulator else ("stream-k", "split-k"):
            prepared = prepare_decode(q, k, v, schedule=schedule)
            o, lse = prepared()
            chosen = dict(splits=prepared.splits) if schedule == "split-k" else dict(blocks=prepared.blocks)
            res = ctx.measure(CHAPTER, f"decode: prepare_decode {schedule}", config, lambda r=prepared: r(), sets,
                              flops=flops, model_bytes=model, extra=dict(extra, **chosen), peak_memory=False,
                              note="the decode chapter's launch (the baseline)")
            results.append(res)
            base[schedule] = res.median_ms, (o, lse)
            del prepared
        decode_ms, (base_o, base_lse) = base["stream-k"]
        check = _Checker(base_o, base_lse, q, k, v, hq, hkv)

        # ---- P devices: the partials, then each reduction
        for P in shard_counts:
            run_ = prepare_tree_decode(q, k, v, shards=P)
            step = dict(extra, shards=P)
            named = lambda what: (f"P={P}: {what}", dict(step, step=what))   # noqa: E731
            red_bytes = float(partial_bytes(b, hq, 1, d, P)) / 2 + b * hq * (d + 1) * 4   # read P partials, write O, L
            red_flops = 4.0 * P * b * hq * d
            run_.run_partials()
            for reduce in ("tree", "flat"):
                run_.run_reduction(reduce)
                check(*run_.result(), f"P = {P} {reduce}")
            name, ex = named("partials alone")
            parts = ctx.measure(CHAPTER, name, config, run_.run_partials, sets, flops=flops,
                                model_bytes=model + partial_bytes(b, hq, 1, d, P) / 2, extra=ex,
                                peak_memory=False, note="split-K's first kernel with P splits: a block a device")
            parts.extra["share_pct"] = 100.0 * parts.median_ms / decode_ms
            results.append(parts)
            if P == 1:                                # one device: its partial is the answer
                del run_
                continue
            for reduce in ("tree", "flat"):
                def whole(r=run_, reduce=reduce):
                    r.run_partials()
                    r.run_reduction(reduce)
                name, ex = named(f"partials + {reduce}")
                res = ctx.measure(CHAPTER, name, config, whole, sets, flops=flops,
                                  model_bytes=model + partial_bytes(b, hq, 1, d, P), extra=ex,
                                  peak_memory=False)
                res.extra["added_ms"] = res.median_ms - parts.median_ms
                res.extra["share_pct"] = 100.0 * (res.median_ms - parts.median_ms) / decode_ms
                results.append(res)
            run_.run_partials()
            for reduce in ("tree", "flat"):
                name, ex = named(f"{reduce} reduction alone")
                one = ctx.measure(CHAPTER, name, config,
                                  lambda r=run_, reduce=reduce: r.run_reduction(reduce), sets, flops=red_flops,
                                  model_bytes=red_bytes, extra=ex, peak_memory=False,
                                  note="one launch: launch and kernel")
                one.extra["share_pct"] = 100.0 * one.median_ms / decode_ms
                results.append(one)
                if ctx.simulator:
                    continue

                def many(r=run_, reduce=reduce):
                    for _ in range(BACK_TO_BACK):
                        r.run_reduction(reduce)
                name, ex = named(f"{reduce} reduction, x{BACK_TO_BACK} (per launch)")
                each = _per_launch(ctx.measure(CHAPTER, name, config,
                                               many, sets, flops=red_flops * BACK_TO_BACK,
                                               model_bytes=red_bytes * BACK_TO_BACK, extra=ex,
                                               peak_memory=False,
                                               note=f"{BACK_TO_BACK} launches back to back, a launch's share"),
                                   BACK_TO_BACK)
                each.extra["share_pct"] = 100.0 * each.median_ms / decode_ms
                results.append(each)
            del run_
        del q, k, v
        if torch is not None:
            torch.cuda.empty_cache()
    return results


# --------------------------------------------------------------------------- plot

def plot(results, path, *, title, simulator, ceiling=math.nan, judged_by=None):
    """The reduction's cost against P, one panel an N: each reduction alone (one launch, and
    a launch's share of 20 back to back) and what it adds to the partials, as a percentage
    of the decode chapter's time; the 5% goal dashed. In the simulator: the tour's plot."""
    from kernels.bench.tour import plot_results

    ns = sorted({int(r.extra["N"]) for r in results if "shards" in r.extra and "share_pct" in r.extra})
    if simulator or not ns:
        return plot_results(results, path, title=title, simulator=simulator, ceiling=ceiling, judged_by=judged_by)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = (("tree reduction alone", "tree, one launch", "#1f77b4", "-", "o"),
              (f"tree reduction, x{BACK_TO_BACK} (per launch)", "tree, per launch of 20", "#1f77b4", ":", "."),
              ("partials + tree", "tree, added to the partials", "#1f77b4", "--", "x"),
              ("flat reduction alone", "flat, one launch", "#ff7f0e", "-", "o"),
              (f"flat reduction, x{BACK_TO_BACK} (per launch)", "flat, per launch of 20", "#ff7f0e", ":", "."),
              ("partials + flat", "flat, added to the partials", "#ff7f0e", "--", "x"))
    fig, axes = plt.subplots(1, len(ns), figsize=(6 * len(ns), 4.5), squeeze=False)
    for ax, n in zip(axes[0], ns):
        rows = [r for r in results if int(r.extra.get("N", -1)) == n]
        for step, label, color, style, marker in series:
            pts = sorted((int(r.extra["shards"]), float(r.extra["share_pct"])) for r in rows
                         if r.extra.get("step") == step)
            if pts:
                ax.plot([p for p, _ in pts], [s for _, s in pts], style, marker=marker, color=color, label=label)
        ax.axhline(5.0, color="red", linestyle="--", linewidth=1)
        ax.annotate("the goal: 5%", xy=(0.99, 5.0), xycoords=("axes fraction", "data"), ha="right", va="bottom",
                    fontsize=8, color="red")
        base = next((r.median_ms for r in rows if r.kernel == "decode: prepare_decode stream-k"), math.nan)
        ax.set_title(f"N = {n // K}k: % of decode's {base * 1e3:.0f} µs", fontsize=9)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("P (shards = devices)")
        ax.set_ylabel("% of the decode step")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
