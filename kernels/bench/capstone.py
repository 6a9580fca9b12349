"""Chapter 13's bench: the kernels as a PyTorch attention, and a small GPT trained with them.

On a GPU, in one run:

* the call's cost at the reference size B=4 H=16 N=4096 d=64 (fp32 and bf16, causal): the
  forward kernel bare (chapter 11's split and forward for fp32, chapter 8's for bf16, on
  preallocated outputs), the chapter's launcher with PyTorch tensors, and the autograd
  function ``attention()`` (forward only, and forward + backward); peers forward + backward
  in the same precision: SDPA (flash for bf16, memory-efficient for fp32) and plain PyTorch;
* training ``kernels.tiny_gpt`` (4 layers, 8 heads of d = 64, context 256, batch 32, bf16
  autocast, 600 steps) from seeds 0, 1 and 2: with ``attention``, with SDPA, and with SDPA
  once more from the same seed (its rerun is the run-to-run spread the curves are judged
  by): ms a step, tokens/s, peak memory, final and validation loss; the loss curves go to
  ``capstone_losses.csv`` / ``.png`` beside the results; then every parameter's gradient of
  the trained model with each attention against float64 attention;
* a long context, N = 16384 (batch 4, 8 heads, 4 layers): a few steps with ``attention``, with
  SDPA's flash backend, and with SDPA's math backend (the unfused path, N x N scores saved
  for the backward), which runs out of memory there.

In the simulator: the call's rows at B=1 H=1 N=16 d=16 fp32 (ours alone) and three training
steps of a one-layer model with context 16.
"""

from __future__ import annotations

import gc
import math
from pathlib import Path

import numpy as np

import kernels  # noqa: F401  (GPU or simulator first)
from kernels.base.runtime import on_simulator
from kernels.bench.harness import Result

CHAPTER = 13
TITLE = "the kernels as a PyTorch attention; a small GPT trained with them"

OURS = "attention() (ours)"
LOSSES = "capstone_losses"


def _torch():
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False          # fp32 peers in fp32 (PyTorch's default)
    torch.backends.cudnn.allow_tf32 = False
    return torch


def _plain(torch, q, k, v, causal):
    """softmax(q k^T scale) v in the input type (autograd saves P: N x N a head)."""
    s = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5)
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=s.device).tril_(), -math.inf)
    return torch.softmax(s, dim=-1) @ v


def _call_rows(ctx, torch, results):
    """The reference size: bare kernel, launcher, autograd function; fwd + bwd against peers."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from kernels.flash_forward import flash_attention
    from kernels.flash_tensor_cores import flash_attention_tc, make_flash_forward_mma, tc_tiles
    from kernels.flash_tf32 import launch_forward
    from kernels.base.runtime import ArrayKind, Bf16Bits, cdiv, cuda_view
    from kernels.torch_attention import attention

    sim = ctx.simulator
    b, h, n, d = (1, 1, 16, 16) if sim else (4, 16, 4096, 64)
    causal = True
    once = dict(repeat=1, warmup=0) if sim else {}
    device = "cpu" if sim else "cuda"
    for dtype_name in ("fp32",) if sim else ("fp32", "bf16"):
        dtype = torch.float32 if dtype_name == "fp32" else torch.bfloat16
        config = f"B={b} H={h} N={n} d={d} {dtype_name} causal={causal}"
        fwd_flops = 4.0 * b * h * n * n * d / 2
        extra = {"B": b, "H": h, "N": n, "d": d, "dtype": dtype_name, "causal": causal}
        gen = torch.Generator(device=device).manual_seed(1300)
        sets = [tuple(torch.randn(b, h, n, d, device=device, generator=gen).to(dtype) for _ in range(4))
                for _ in range(1 if sim else 2)]

        def measure(kernel, fn, sets_, flops, **kw):
            results.append(ctx.measure(CHAPTER, kernel, config, fn, sets_, flops=flops, model_bytes=float("nan"),
                                       extra=dict(extra), **once, **kw))

        if not sim:                                   # the bare forward on preallocated outputs
            kind = ArrayKind(sets[0][0])
            o = kind.empty((b * h, n, d), np.float32)
            lse = kind.empty((b * h, n), np.float32)
            if dtype_name == "fp32":
                views = [tuple(cuda_view(x).reshape(b * h, n, d) for x in s[:3]) for s in sets]

                def bare(q, k, v):
                    launch_forward(q, k, v, o, lse, 1.0 / math.sqrt(d), causal, 3)
                note = "chapter 11: launch_forward on preallocated O, L"
            else:
                views = [tuple(cuda_view(Bf16Bits(x)).reshape(b * h, n, d) for x in s[:3]) for s in sets]
                Br, Bc, D = tc_tiles(d)
                kernel = make_flash_forward_mma(Br, Bc, D, True)

                def bare(q, k, v):
                    kernel[(cdiv(n, Br), b * h), kernel.threads](q, k, v, o, lse, np.float32(1.0 / math.sqrt(d)),
                                                                  np.int32(causal), np.int32(1), np.int32(1))
                note = "chapter 8: the mma.sync forward kernel on preallocated O, L"
            measure("forward kernel (bare)", bare, views, fwd_flops, peak_memory=False, note=note)

        def launcher(q, k, v, *_):
            if sim:                                   # CPU tensors: the launchers take NumPy
                q, k, v = (x.numpy() for x in (q, k, v))
            if dtype_name == "fp32":
                return flash_attention(q, k, v, causal=causal)
            return flash_attention_tc(q, k, v, causal=causal, bf16=True)
        measure("chapter launcher, torch tensors", launcher, sets, fwd_flops,
                note="flash_attention (fp32: 3xTF32) / flash_attention_tc (bf16); O float32")

        def ours_forward(q, k, v, *_):
            with torch.no_grad():
                return attention(q, k, v, causal=causal)
        measure(f"{OURS} forward", ours_forward, sets, fwd_flops, note="the autograd function, O in the input type")

        grads = [tuple(x.detach().requires_grad_(True) for x in s[:3]) + (s[3],) for s in sets]

        def fwd_bwd(call):
            def fn(q, k, v, do):
                out = call(q, k, v)
                return torch.autograd.grad(out, (q, k, v), do)
            return fn

        measure(f"{OURS} fwd+bwd", fwd_bwd(lambda q, k, v: attention(q, k, v, causal=causal)), grads,
                3.5 * fwd_flops, note="forward + backward through autograd")
        if sim:
            continue
        backend = SDPBackend.FLASH_ATTENTION if dtype_name == "bf16" else SDPBackend.EFFICIENT_ATTENTION
        label = "SDPA flash" if dtype_name == "bf16" else "SDPA memory-efficient"

        def sdpa_call(q, k, v):
            with sdpa_kernel(backend):
                return sdpa(q, k, v, is_causal=causal)
        for name, call in ((label, sdpa_call), ("plain PyTorch", lambda q, k, v: _plain(torch, q, k, v, causal))):
            try:
                measure(f"peer: {name} fwd+bwd", fwd_bwd(call), grads, 3.5 * fwd_flops, is_peer=True)
            except Exception as exc:          # out of memory, or a backend not built
                ctx.progress(f"  skipped {name}: {type(exc).__name__}: {str(exc)[:160]}")
        del sets, grads
        gc.collect()
    if not sim:                                      # a small call: the host's cost a call shows
        config = "B=1 H=1 N=128 d=64 bf16 causal=True"
        x = [tuple(torch.randn(1, 1, 128, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3)) + (torch.randn(1, 1, 128, 64, device="cuda", dtype=torch.bfloat16),)]
        small = {"B": 1, "H": 1, "N": 128, "d": 64, "dtype": "bf16", "causal": True}
        calls = ((f"{OURS} forward", lambda q, k, v, do: attention(q.detach(), k.detach(), v.detach(), causal=True),
                  False),
                 ("peer: SDPA forward", lambda q, k, v, do: sdpa(q.detach(), k.detach(), v.detach(), is_causal=True),
                  True),
                 (f"{OURS} fwd+bwd", lambda q, k, v, do: torch.autograd.grad(attention(q, k, v, causal=True),
                                                                              (q, k, v), do), False),
                 ("peer: SDPA fwd+bwd", lambda q, k, v, do: torch.autograd.grad(sdpa(q, k, v, is_causal=True),
                                                                                (q, k, v), do), True))
        for label, fn, peer in calls:
            results.append(ctx.measure(CHAPTER, label, config, fn, x, flops=float("nan"), model_bytes=float("nan"),
                                       is_peer=peer, peak_memory=False, extra=dict(small),
                                       note="a small call: mostly the host's time a call"))


def _train_row(ctx, torch, results, label, attn, config, *, steps, batch, seed, dtype, is_peer, note, curves=None,
               text=None, keep=False):
    """One training run as a Result: ms a step (the mean over the run's steps after the
    first, from tokens/s), tokens/s and peak memory in ``extra``; the losses into ``curves``;
    ``keep``: return the run (its model) instead of True."""
    from kernels.tiny_gpt import train

    ctx.progress(f"  ch{CHAPTER} train {label:<30} T={config.block_size} steps={steps}")
    device = "cpu" if ctx.simulator else "cuda"
    try:
        run = train(config, attn, steps=steps, batch=batch, seed=seed, device=device, dtype=dtype, log_every=0,
                    lr=1e-3, text=text)
    except torch.OutOfMemoryError as exc:
        ctx.progress(f"  {label}: out of memory at T={config.block_size}")
        results.append(Result(CHAPTER, f"train: {label}", _config_name(config, batch, dtype), float("nan"),
                              float("nan"), float("nan"), float("nan"), float("nan"), float("nan"), float("nan"),
                              float("nan"), float("nan"), is_peer, f"out of memory: {str(exc)[:120]}",
                              {"T": config.block_size, "oom": True}))
        gc.collect()
        torch.cuda.empty_cache()
        return None
    tokens = batch * config.block_size
    ms = 1e3 * tokens / run["tokens_per_s"] if run["tokens_per_s"] else float("nan")
    peak = run["peak_memory_bytes"] / 2**20 if run["peak_memory_bytes"] is not None else float("nan")
    extra = {"T": config.block_size, "tokens_per_s": round(run["tokens_per_s"] or float("nan"), 1),
             "final_loss": round(run["losses"][-1], 4), "val_loss": round(run["val_loss"], 4), "seed": seed}
    results.append(Result(CHAPTER, f"train: {label}", _config_name(config, batch, dtype), ms, ms, ms,
                          float("nan"), float("nan"), float("nan"), float("nan"), float("nan"), peak, is_peer, note,
                          extra))
    if curves is not None:
        curves[label] = run["losses"]
    if keep:
        return run
    del run
    gc.collect()
    if not ctx.simulator:
        torch.cuda.empty_cache()
    return True


def _gradient_rows(ctx, torch, results, run, ours, sdpa):
    """Every parameter's gradient of the trained model (SDPA's seed-0 run) on one batch, with
    each attention under bf16 autocast, against the same model with float64 attention and
    float32 elsewhere: ||g - g_ref|| / ||g_ref||, one row each."""
    from kernels.tiny_gpt import batches, corpus_text

    model, tokens = run["model"], run["tokens"]
    data = tokens.encode(corpus_text())
    x, y = next(batches(data, batch=32, block=model.config.block_size, generator=torch.Generator().manual_seed(5),
                        device="cuda"))

    def exact(q, k, v, is_causal=True, enable_gqa=False):
        q, k, v = q.double(), k.double(), v.double()
        s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        n = s.shape[-1]
        s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=s.device).tril_(), -math.inf)
        return (torch.softmax(s, -1) @ v).float()

    def gradient(attn, autocast):
        for m in model.modules():
            if hasattr(m, "attention"):
                m.attention = attn
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            _, loss = model(x, y)
        loss.backward()
        return loss.item(), torch.cat([p.grad.flatten().double() for p in model.parameters()])

    _, g_ref = gradient(exact, False)
    config = f"trained TinyGPT (600 steps), one batch of {x.shape[0]}x{x.shape[1]}, bf16 autocast"
    for label, attn, peer in ((OURS, ours, False), ("SDPA", sdpa, True)):
        loss, g = gradient(attn, True)
        err = float((g - g_ref).norm() / g_ref.norm())
        ctx.progress(f"  ch{CHAPTER} gradient {label}: relative error {err:.3e}")
        results.append(Result(CHAPTER, f"gradients: {label}", config, float("nan"), float("nan"), float("nan"),
                              float("nan"), float("nan"), float("nan"), float("nan"), float("nan"), float("nan"),
                              peer, "||g - g_ref|| / ||g_ref|| over every parameter; g_ref: float64 attention, "
                              "float32 elsewhere", {"grad_rel_err": round(err, 6), "loss": round(loss, 5)}))


def _config_name(config, batch, dtype):
    dt = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}[str(dtype)]
    return (f"GPT L={config.n_layer} H={config.n_head} d={config.head_dim} T={config.block_size} "
            f"batch={batch} {dt}")


def _training_rows(ctx, torch, results):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from kernels.tiny_gpt import CharTokens, GPTConfig, corpus_text
    from kernels.torch_attention import scaled_dot_product_attention as ours

    vocab = CharTokens(corpus_text()).vocab_size
    curves = {}
    if ctx.simulator:
        config = GPTConfig(vocab, block_size=16, n_layer=1, n_head=2, n_embd=16)
        _train_row(ctx, torch, results, OURS, ours, config, steps=3, batch=2, seed=0, dtype=torch.float32,
                   is_peer=False, note="simulator", curves=curves)
        _train_row(ctx, torch, results, "SDPA", sdpa, config, steps=3, batch=2, seed=0, dtype=torch.float32,
                   is_peer=True, note="PyTorch on the CPU", curves=curves)
        return curves
    bf16 = torch.bfloat16
    steps = 150 if ctx.quick else 600
    config = GPTConfig(vocab, block_size=256, n_layer=4, n_head=8, n_embd=512)
    note = "AdamW lr 1e-3, bf16 autocast, same seed and batches"
    # Same seed, same batches: ours against SDPA; then what "run-to-run noise" is: SDPA again
    # from the same seed (its backward's atomic adds differ run to run, and training amplifies
    # any difference), and both from a second seed.
    runs = [(OURS, ours, 0, False), ("SDPA", sdpa, 0, True), ("SDPA again", sdpa, 0, True)]
    for seed in (1, 2):
        runs += [(f"{OURS} seed {seed}", ours, seed, False), (f"SDPA seed {seed}", sdpa, seed, True),
                 (f"SDPA again seed {seed}", sdpa, seed, True)]
    for label, attn, seed, peer in runs:
        run = _train_row(ctx, torch, results, label, attn, config, steps=steps, batch=32, seed=seed, dtype=bf16,
                         is_peer=peer, note=note + ("" if not peer else " (SDPA's default backend: flash)"),
                         curves=curves, keep=label == "SDPA")
        if label == "SDPA":                  # its trained model, checked at once and let go (peak memory)
            _gradient_rows(ctx, torch, results, run, ours, sdpa)
            del run
            gc.collect()
            torch.cuda.empty_cache()

    def math_sdpa(*args, **kw):
        with sdpa_kernel(SDPBackend.MATH):
            return sdpa(*args, **kw)

    def flash_sdpa(*args, **kw):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return sdpa(*args, **kw)

    long = GPTConfig(vocab, block_size=16384, n_layer=4, n_head=8, n_embd=512)
    for label, attn, peer in ((OURS, ours, False), ("SDPA flash", flash_sdpa, True),
                              ("SDPA math (unfused)", math_sdpa, True)):
        _train_row(ctx, torch, results, label + " long", attn, long, steps=4, batch=4, seed=0, dtype=bf16,
                   is_peer=peer, note="a long context: does it train at all, and in how much memory")
    return curves


def write_losses(curves: dict, folder: Path):
    """``capstone_losses.csv`` (step, one column a run) and its plot, in ``folder``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(curves)
    steps = max(len(c) for c in curves.values())
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"{LOSSES}.csv", "w") as f:
        f.write("step," + ",".join(names) + "\n")
        for i in range(steps):
            f.write(f"{i}," + ",".join(f"{curves[n][i]:.5f}" if i < len(curves[n]) else "" for n in names) + "\n")
    fig, ax = plt.subplots(figsize=(8, 4.5))
    window = 20
    for n in names:
        seed = int(n.rsplit("seed ", 1)[1]) if "seed " in n else 0
        style = "-" if n.startswith(OURS) else ":" if "again" in n else "--"
        c = np.asarray(curves[n])
        smooth = np.convolve(c, np.ones(window) / window, mode="valid") if len(c) >= window else c
        ax.plot(np.arange(len(smooth)) + (len(c) - len(smooth)), smooth, style, color=f"C{seed}", lw=1.0, label=n)
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss (nats a character, mean of {window} steps)")
    ax.set_title("TinyGPT on the course's text: ours (solid), SDPA (dashed), SDPA rerun (dotted); colour: seed",
                 fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(folder / f"{LOSSES}.png", dpi=110)
    plt.close(fig)


def read_losses(folder: Path) -> dict:
    """The curves ``write_losses`` wrote: {run: [loss a step]}."""
    lines = (Path(folder) / f"{LOSSES}.csv").read_text().splitlines()
    names = lines[0].split(",")[1:]
    cols = list(zip(*(line.split(",")[1:] for line in lines[1:])))
    return {n: [float(x) for x in col if x] for n, col in zip(names, cols)}


def run(ctx) -> list[Result]:
    torch = _torch()
    if not on_simulator() and not torch.cuda.is_available():
        ctx.progress("  PyTorch sees no GPU: the capstone's bench needs one (or the simulator)")
        return []
    results: list[Result] = []
    _call_rows(ctx, torch, results)
    curves = _training_rows(ctx, torch, results)
    if curves and not ctx.simulator and not ctx.quick:
        from kernels.bench.harness import RESULTS_DIR

        write_losses(curves, ctx.out or RESULTS_DIR)    # beside the run's CSV (--out), else the committed results
    return results
