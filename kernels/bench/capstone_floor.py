"""Chapter 13's floor: is the drop-in attention ever slower than plain PyTorch?

A library that is fast at one size and slow at another is a trap: a user swaps it in and a
small model gets slower. This bench sweeps what models call, through ``attention()`` as a
model calls it (PyTorch tensors in, autograd for the backward), against plain PyTorch in
the same precision (``softmax(q k^T * scale) v``, the causal mask a cached buffer as nanoGPT
keeps it; fp32 matmuls in fp32, PyTorch's default), in the same run:

    B*H   1 (B=1 H=1), 8 (B=1 H=8), 64 (B=4 H=16), 512 (B=32 H=16)
    N     64, 256, 1024, 4096, 16384
    d     32, 64, 96, 128
    causal or not; forward alone (no_grad) and forward + backward; fp32 and bf16

Each cell is the time a call adds when calls follow one another, as in a model's step (CUDA
events around a run of back-to-back calls; the host's work, validation and launches, counts
where it is longer than the GPU's), the median of 9 such runs a side, ours and plain
PyTorch taking turns; the 9 rounds' own ratios give the cell's spread. Where plain PyTorch
runs out of memory (its N x N scores) the cell records that, and ours runs once (no
warm-up) to show it fits. ``--quick``: B*H in (1, 64), N in (64, 1024, 4096), d in (64,
128). In the simulator: B*H = 1, N = 16, d = 16, fp32.

The figure: one heat map a (precision, pass), the speed-up plain / ours of every cell; below
1 the floor is broken there.
"""

from __future__ import annotations

import math

import numpy as np

import kernels  # noqa: F401  (GPU or simulator first)
from kernels.base.runtime import Timing, on_simulator, time_fn
from kernels.bench.harness import Result

CHAPTER = 13
TITLE = "the drop-in attention against plain PyTorch, every size a model uses"

OURS = "attention() (ours)"
PLAIN = "plain PyTorch"
HEADS = {1: (1, 1), 8: (1, 8), 64: (4, 16), 512: (32, 16)}      # B*H -> (B, H)
TARGET_MS = 20.0                                                # time a cell's repeats add up to, about


def sweep(ctx):
    """(B*H values, N values, d values, precisions) of this run."""
    if ctx.simulator:
        return (1,), (16,), (16,), ("fp32",)
    if ctx.quick:
        return (1, 64), (64, 1024, 4096), (64, 128), ("fp32", "bf16")
    return (1, 8, 64, 512), (64, 256, 1024, 4096, 16384), (32, 64, 96, 128), ("fp32", "bf16")


class PlainAttention:
    """softmax(q k^T * scale) v in the inputs' precision, as a model written without a fused
    kernel computes it (autograd saves the N x N probabilities for the backward)."""

    def __init__(self, torch):
        self.torch, self._masks = torch, {}

    def __call__(self, q, k, v, causal):
        torch = self.torch
        s = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5)
        if causal:
            n = s.shape[-1]
            key = (n, s.device)
            if key not in self._masks:                       # built once per length, as a model's buffer
                self._masks[key] = ~torch.ones(n, n, dtype=torch.bool, device=s.device).tril_()
            s = s.masked_fill(self._masks[key], -math.inf)
        return torch.softmax(s, dim=-1) @ v


ROUNDS = 9                                                      # timed runs of each side, alternating


def _back_to_back(fn, inputs, calls):
    """ms a call over ``calls`` back-to-back calls, CUDA events around them."""
    from numba import cuda

    start, stop = cuda.event(), cuda.event()
    cuda.synchronize()
    start.record()
    for i in range(calls):
        fn(*inputs[i % len(inputs)])
    stop.record()
    stop.synchronize()
    return cuda.event_elapsed_time(start, stop) / calls


def _time_pair(ctx, plain_fn, ours_fn, inputs, once):
    """(plain's Timing, ours, the rounds' ratios plain / ours, sorted) of a cell, in ms a call,
    after ``once``: each side's first call (compiling, binding), then one timed. Where either
    took over half a second: those times. Otherwise ``ROUNDS`` rounds, each a run of
    back-to-back calls of one side and one of the other (which goes first alternates; CUDA
    events around ``TARGET_MS`` worth of calls, divided by their number): how long a call
    holds up a model whose calls follow one another, the host's work overlapping the GPU's.
    The two take turns so that a slow stretch of the host (at the smallest sizes a side's runs
    differ by tens of percent within a cell) falls on both; a round's ratio compares the two
    in the same stretch. A Timing's median is its side's median run, p10 and p90 its second
    fastest and second slowest."""
    if ctx.simulator or max(t.median_ms for t in once) > 500:
        return once[0], once[1], [once[0].median_ms / once[1].median_ms]
    calls = [max(1, min(200, int(TARGET_MS / max(t.median_ms, 1e-3)))) for t in once]
    samples = ([], [])
    for r in range(ROUNDS):
        for side in ((0, 1) if r % 2 == 0 else (1, 0)):
            samples[side].append(_back_to_back((plain_fn, ours_fn)[side], inputs, calls[side]))
    ratios = sorted(p / o for p, o in zip(*samples))
    timings = []
    for side in (0, 1):
        x = sorted(samples[side])
        timings.append(Timing(x[ROUNDS // 2], x[1], x[-2], ROUNDS * calls[side],
                              f"cuda events, {calls[side]} back-to-back calls, {ROUNDS} runs alternating"))
    return timings[0], timings[1], ratios


def run(ctx, precisions=None, bhs=None) -> list[Result]:
    """The sweep's results (``precisions``: some of ("fp32", "bf16"), by default both;
    ``bhs``: some of the sweep's B*H values, by default all: a part of the sweep a call, so
    that a run cut short keeps the parts done)."""
    import torch

    from kernels.torch_attention import attention

    torch.backends.cuda.matmul.allow_tf32 = False          # fp32 peers in fp32 (PyTorch's default)
    if not on_simulator() and not torch.cuda.is_available():
        ctx.progress("  PyTorch sees no GPU: the floor's bench needs one (or the simulator)")
        return []
    device = "cpu" if ctx.simulator else "cuda"
    plain = PlainAttention(torch)
    every_bh, ns, ds, every_precision = sweep(ctx)
    precisions = every_precision if precisions is None else precisions
    bhs = every_bh if bhs is None else bhs
    results: list[Result] = []
    gen = torch.Generator(device=device).manual_seed(1313)
    for precision in precisions:
        dtype = torch.float32 if precision == "fp32" else torch.bfloat16
        for bh in bhs:
            b, h = HEADS[bh]
            for n in ns:
                for d in ds:
                    nbytes = 4 * b * h * n * d * dtype.itemsize
                    sets = 1 if nbytes > (1 << 30) or ctx.simulator else 2
                    inputs = [tuple(torch.randn(b, h, n, d, device=device, generator=gen, dtype=dtype)
                                    .requires_grad_(i < 3) for i in range(4)) for _ in range(sets)]
                    for causal in (False, True):
                        for pass_ in ("fwd", "fwd+bwd"):
                            _cell(ctx, torch, results, attention, plain, inputs, precision, b, h, n, d, causal, pass_)
                    del inputs
                    if not ctx.simulator:
                        torch.cuda.empty_cache()
    return results


def _cell(ctx, torch, results, attention, plain, inputs, precision, b, h, n, d, causal, pass_):
    config = f"B*H={b * h} N={n} d={d} {precision} causal={causal} {pass_}"
    flops = 4.0 * b * h * n * n * d * (0.5 if causal else 1.0) * (3.5 if pass_ == "fwd+bwd" else 1.0)
    extra = {"BH": b * h, "B": b, "H": h, "N": n, "d": d, "dtype": precision, "causal": causal, "pass": pass_}

    def as_call(attend):
        if pass_ == "fwd":
            def forward(q, k, v, do):
                with torch.no_grad():
                    return attend(q, k, v)
            return forward

        def forward_backward(q, k, v, do):
            return torch.autograd.grad(attend(q, k, v), (q, k, v), do)
        return forward_backward

    plain_fn = as_call(lambda q, k, v: plain(q, k, v, causal))
    ours_fn = as_call(lambda q, k, v: attention(q, k, v, causal=causal))
    ctx.progress(f"  ch{CHAPTER} {PLAIN} and {OURS}, taking turns: {config}")
    warmup = 0 if ctx.simulator else 1
    nan = float("nan")
    timings, notes, ratios = {PLAIN: None, OURS: None}, {PLAIN: "", OURS: ""}, []
    try:
        first = time_fn(plain_fn, inputs, warmup=warmup, repeat=1)
    except torch.OutOfMemoryError:
        first, notes[PLAIN] = None, "out of memory"
        torch.cuda.empty_cache()
    try:
        if first is None:                            # the peer could not run: ours once, to show it fits
            timings[OURS] = time_fn(ours_fn, inputs, warmup=0, repeat=1)
            notes[OURS] = "one run (plain PyTorch ran out of memory)"
        else:
            once = (first, time_fn(ours_fn, inputs, warmup=warmup, repeat=1))
            timings[PLAIN], timings[OURS], ratios = _time_pair(ctx, plain_fn, ours_fn, inputs, once)
    except torch.OutOfMemoryError:
        timings[OURS], notes[OURS] = None, "out of memory"
        torch.cuda.empty_cache()
    rows = {}
    for name in (PLAIN, OURS):
        t = timings[name]
        median, p10, p90 = (t.median_ms, t.p10_ms, t.p90_ms) if t is not None else (nan, nan, nan)
        rows[name] = Result(CHAPTER, name, config, median, p10, p90, flops, nan,
                            flops / median / 1e9 if median == median else nan, nan, nan, nan, name == PLAIN,
                            notes[name], dict(extra))
    if timings[PLAIN] is None:
        rows[OURS].extra["speedup over plain"] = "plain out of memory"
    elif timings[OURS] is not None:
        rows[OURS].extra["speedup over plain"] = round(timings[PLAIN].median_ms / timings[OURS].median_ms, 4)
        if len(ratios) > 2:          # (one ratio, no spread: the simulator, or a call over half a second)
            rows[OURS].extra["round ratios p10"] = round(ratios[1], 4)
            rows[OURS].extra["round ratios p90"] = round(ratios[-2], 4)
    results.extend((rows[OURS], rows[PLAIN]))


# --------------------------------------------------------------------------- the figure

def cells(results):
    """{(precision, pass): {(B*H, d, N, causal): speed-up or None (plain out of memory)}} from
    results (or the CSV's rows, whose extras are strings)."""
    out: dict = {}
    by_config = {}
    for r in results:
        by_config.setdefault(r.config, {})[r.kernel] = r
    for pair in by_config.values():
        if OURS not in pair or PLAIN not in pair:
            continue
        e = pair[OURS].extra
        key = (int(e["BH"]), int(e["d"]), int(e["N"]), str(e["causal"]) == "True")
        ours, peer = float(pair[OURS].median_ms), float(pair[PLAIN].median_ms)
        out.setdefault((str(e["dtype"]), str(e["pass"])), {})[key] = peer / ours if peer == peer else None
    return out


def plot(results, path, *, title, simulator, ceiling=math.nan, judged_by=None):
    """A heat map per (precision, pass): rows B*H and d, columns N (non-causal | causal);
    each cell plain PyTorch's time over ours (above 1: ours faster; "OOM": plain PyTorch
    ran out of memory). In the simulator, the tour's generic plot."""
    from kernels.bench.tour import plot_results

    grid = cells(results)
    if simulator or not grid:
        return plot_results(results, path, title=title, simulator=simulator, ceiling=ceiling, judged_by=judged_by)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    panels = [p for p in (("fp32", "fwd"), ("fp32", "fwd+bwd"), ("bf16", "fwd"), ("bf16", "fwd+bwd")) if p in grid]
    rows = sorted({(bh, d) for g in grid.values() for bh, d, _, _ in g})
    cols = sorted({(c, n) for g in grid.values() for _, _, n, c in g})
    ncols = 2 if len(panels) > 1 else 1
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(7.5 * ncols + 1.5, (0.3 * len(rows) + 1.6) * nrows),
                             squeeze=False)
    norm = LogNorm(vmin=1 / 8, vmax=8)
    for at, panel in enumerate(panels):
        ax = axes[at // ncols, at % ncols]
        g = grid[panel]
        m = np.full((len(rows), len(cols)), np.nan)
        for i, (bh, d) in enumerate(rows):
            for j, (c, n) in enumerate(cols):
                s = g.get((bh, d, n, c), np.nan)
                m[i, j] = np.nan if s is None else s
                label = "OOM" if s is None else ("" if s != s else f"{s:.1f}")
                ax.text(j, i, label, ha="center", va="center", fontsize=6.5,
                        color="white" if s is not None and s == s and s < 0.5 else "black")
        image = ax.imshow(m, cmap="RdYlGn", norm=norm, aspect="auto")
        finite = m[np.isfinite(m)]
        worst = f"lowest {finite.min():.2f}x, {int((finite < 1).sum())} of {finite.size} below 1" if finite.size else ""
        ax.set_title(f"{panel[0]} {panel[1]}: {worst}", fontsize=10)
        ax.set_xticks(range(len(cols)), [f"{n}{' c' if c else ''}" for c, n in cols], rotation=90, fontsize=8)
        ax.set_yticks(range(len(rows)), [f"B*H={bh} d={d}" if at % ncols == 0 else "" for bh, d in rows], fontsize=8)
        ax.set_xlabel("N (c: causal); OOM: plain PyTorch out of memory")
    for at in range(len(panels), nrows * ncols):
        axes[at // ncols, at % ncols].axis("off")
    fig.subplots_adjust(hspace=0.3)
    fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.6, label="plain PyTorch's time / ours (above 1: ours faster)")
    fig.suptitle(title, fontsize=11)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
