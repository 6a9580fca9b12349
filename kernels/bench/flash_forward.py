"""Chapter 4's bench: the fused FlashAttention forward against plain and fused PyTorch.

On a GPU (``--quick``: fewer points):

* reference configuration B=4 H=16 N=4096 d=64 fp32, non-causal and causal: the kernel
  (bare launch on preallocated outputs, default tiles) and the ``flash_attention()``
  launcher; peers in the same run: plain PyTorch fp32 (Q K^T -> softmax -> P V, TF32 off),
  SDPA math and SDPA memory-efficient (fp32);
* the tile sweep at the reference configuration (``SWEEP_D64``: Br, Bc, TM, TX);
* N = 512 .. 16384 for d = 64 and d = 128, causal and not, with SDPA memory-efficient fp32
  (and plain PyTorch while its N x N matrices stay small) as peers;
* float16 inputs at the reference configuration (ours still computes in fp32 on the FMA
  units), with SDPA memory-efficient, flash and cuDNN fp16 as context (tensor cores).

FLOPs 4 B H Nq Nk d (halved for causal). ``model_bytes``: the fused IO model of ``kernels.base.io_model``
(``kernels.flash_forward.io_model_bytes``: Q read once, O and L written once, K and V read
once per query tile); peers are given the same figure, so their GB/s is "effective".

Extra entry points for the GPU run (``python -m kernels.bench.flash_forward ...``):

    --memory      B=H=1, N=131072, d=64 fp32: the fused kernel runs (peak memory reported),
                  the naive path would need 64 GiB for S alone; writes
                  workbook/results/flash_forward_memory.csv
    --sweep       the tile sweep alone (more candidates, also at d=128); writes
                  workbook/results/flash_forward_sweep.csv
    --ladder      the ladder's three rungs alone (``ladder_rows``); writes
                  workbook/results/flash_forward_ladder.csv
    --ncu TILES   one warm-up launch, then one launch at the reference configuration with
                  the given tiles ("256,64,8,8" = Br,Bc,TM,TX), for
                  ncu --metrics dram__bytes_read.sum,dram__bytes_write.sum -k regex:flash_forward
                     --launch-skip 1 --launch-count 1 python -m kernels.bench.flash_forward --ncu 256,64,8,8
                  (prints the IO model's bytes for that Br to compare with).
    --dram F...   reads the ``ncu --csv`` outputs of such runs and writes
                  workbook/results/flash_forward_dram.csv (measured DRAM bytes next to the
                  IO model for each Br), which notebook 04 shows.
"""

from __future__ import annotations

import argparse
import math
import sys

import numpy as np

import kernels  # noqa: F401  (GPU or simulator first)
from kernels import reference as ref
from kernels.bench.harness import Result, cupy_or_none, torch_or_none
from kernels.flash_forward import (
    SWEEP_D64,
    SWEEP_D128,
    Tiles,
    default_tiles,
    io_model_bytes,
    make_flash_forward,
    query_tile_attention,
    row_per_thread_attention,
    shared_bytes,
)
from kernels.flash_forward import flash_attention as _flash_attention


def flash_attention(q, k, v, **options):
    """Chapter 4's launcher on chapter 4's kernel (products="fma"): for float32 inputs on a
    GPU with TF32 tensor cores, its default is chapter 11's 3xTF32 kernel."""
    return _flash_attention(q, k, v, products="fma", **options)
from kernels.base.fused import padded_head_dim
from kernels.base.runtime import cdiv, on_simulator
from kernels.base.shared_memory import allow_dynamic_shared_memory

CHAPTER = 4
TITLE = "fused forward"

REFERENCE = (4, 16, 4096, 64)          # B, H, N, d


# --------------------------------------------------------------------------- helpers

def _input_sets(b, h, n, d, count, dtype=np.float32, seed=400):
    """``count`` (q, k, v) sets of N(0, 1) Numba device arrays (never zeros)."""
    from numba import cuda

    cp = cupy_or_none()
    sets = []
    for i in range(count):
        if cp is not None:
            cp.random.seed(seed + i)
            qkv = tuple(cuda.as_cuda_array(cp.random.standard_normal((b, h, n, d), dtype=cp.float32).astype(dtype))
                        for _ in range(3))
        else:
            rng = np.random.default_rng(seed + i)
            qkv = tuple(cuda.to_device(rng.standard_normal((b, h, n, d)).astype(dtype)) for _ in range(3))
        sets.append(qkv)
    return sets


def bare_launch(tiles: Tiles, b, h, n_q, n_k, d, *, causal=False, scale=None, prefetch=False):
    """A function (q, k, v) -> None that launches the kernel on preallocated O and L: what
    the timings measure (no argument checks, no allocation). Returns (fn, o, lse).
    ``prefetch``: the variant that loads the next K/V tile while computing the current one."""
    from numba import cuda

    D = padded_head_dim(d, tiles.TX)
    kernel = make_flash_forward(tiles.Br, tiles.Bc, D, tiles.TM, tiles.TX, prefetch=prefetch)
    nbytes = shared_bytes(tiles, D)
    bh = b * h
    o = cuda.device_array((bh, n_q, d), np.float32)
    lse = cuda.device_array((bh, n_q), np.float32)
    grid = (cdiv(n_q, tiles.Br), bh)
    scale32 = np.float32(1.0 / math.sqrt(d) if scale is None else scale)
    d32, causal32 = np.int32(d), np.int32(causal)
    raised = []

    def fn(q, k, v):
        args = (q.reshape(bh, n_q, d), k.reshape(bh, n_k, d), v.reshape(bh, n_k, d), o, lse, d32, scale32, causal32)
        if not raised:
            allow_dynamic_shared_memory(kernel, args, nbytes)
            raised.append(True)
        kernel[grid, tiles.threads, 0, nbytes](*args)

    return fn, o, lse


def _check_head(o, q, k, v, causal, tol=1e-4):
    """Head (0, 0) against the float64 oracle (the tests check properly; this catches a broken run)."""
    q0, k0, v0 = (x[0:1, 0:1].copy_to_host().astype(np.float32) for x in (q, k, v))
    exact, _ = ref.attention(q0, k0, v0, causal=causal)
    got = o[0:1].copy_to_host()
    err = float(np.max(np.abs(got - exact[0])))
    assert err < tol, f"flash forward differs from the oracle by {err:.3g} on head (0, 0)"


def _flops(b, h, n_q, n_k, d, causal):
    f = 4.0 * b * h * n_q * n_k * d
    return f / 2 if causal else f


def _config(b, h, n, d, dtype, causal):
    return f"B={b} H={h} N={n} d={d} {np.dtype(dtype).name.replace('float', 'fp')} causal={causal}"


# --------------------------------------------------------------------------- peers

def _torch_peers(ctx, results, torch, sets, config, flops, model, extra, *, causal, dtype, plain=True,
                 backends=("math", "efficient")):
    """Plain PyTorch and SDPA backends on the same inputs (TF32 off: plain fp32 FMA like ours)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    tsets = [tuple(torch.as_tensor(x, device="cuda") for x in qkv) for qkv in sets]
    n = tsets[0][0].shape[2]
    d = tsets[0][0].shape[3]
    scale = 1.0 / math.sqrt(d)
    fp = "fp16" if np.dtype(dtype) == np.float16 else "fp32"
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        if plain:
            mask = torch.ones(n, n, dtype=torch.bool, device="cuda").tril() if causal else None

            def torch_plain(q, k, v):
                s = (q @ k.transpose(-2, -1)) * scale
                if mask is not None:
                    s = s.masked_fill(~mask, float("-inf"))
                return torch.softmax(s, dim=-1) @ v

            results.append(ctx.measure(CHAPTER, f"peer: plain PyTorch {fp}", config, torch_plain, tsets,
                                       flops=flops, model_bytes=model, is_peer=True,
                                       note="S and P through HBM; TF32 off", extra=dict(extra)))
        table = {"math": (SDPBackend.MATH, "SDPA math", "unfused"),
                 "efficient": (SDPBackend.EFFICIENT_ATTENTION, "SDPA efficient", "fused, fp32 capable"),
                 "flash": (SDPBackend.FLASH_ATTENTION, "SDPA flash", "fused, tensor cores"),
                 "cudnn": (SDPBackend.CUDNN_ATTENTION, "SDPA cuDNN", "fused, tensor cores")}
        for name in backends:
            backend, label, note = table[name]

            def fn(q, k, v, backend=backend):
                with sdpa_kernel(backend):
                    return sdpa(q, k, v, is_causal=causal, scale=scale)
            try:
                results.append(ctx.measure(CHAPTER, f"peer: {label} {fp}", config, fn, tsets, flops=flops,
                                           model_bytes=model, is_peer=True, note=note, extra=dict(extra)))
            except RuntimeError as exc:   # backend unavailable for this dtype/shape
                ctx.progress(f"  skipped {label} {fp}: {str(exc)[:120]}")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    del tsets
    torch.cuda.empty_cache()


# --------------------------------------------------------------------------- parts of the run

def measure_kernel(ctx, tiles, b, h, n, d, *, causal=False, dtype=np.float32, sets=None, label=None,
                   check=True, extra=None, prefetch=False):
    """One bare-launch measurement of the kernel with ``tiles``."""
    sets = sets or _input_sets(b, h, n, d, 2, dtype)
    fn, o, _ = bare_launch(tiles, b, h, n, n, d, causal=causal, prefetch=prefetch)
    fn(*sets[0])
    if check and n <= 4096:
        _check_head(o, *sets[0], causal, tol=1e-4 if dtype == np.float32 else 1e-3)
    in_bytes = np.dtype(dtype).itemsize
    D = padded_head_dim(d, tiles.TX)
    info = {"N": n, "d": d, "causal": causal, "Br": tiles.Br, "Bc": tiles.Bc, "TM": tiles.TM, "TX": tiles.TX,
            "threads": tiles.threads, "smem_bytes": shared_bytes(tiles, D), "prefetch": prefetch}
    info.update(extra or {})
    return ctx.measure(CHAPTER, label or f"flash fwd {tiles}", _config(b, h, n, d, dtype, causal), fn, sets,
                       flops=_flops(b, h, n, n, d, causal),
                       model_bytes=io_model_bytes(b, h, n, n, d, Br=tiles.Br, Bc=tiles.Bc, causal=causal,
                                                  in_bytes=in_bytes),
                       peak_memory=False, note=f"bare launch, {tiles}, {shared_bytes(tiles, D)} B smem",
                       extra=info)


def reference_rows(ctx, results, torch):
    b, h, n, d = (1, 1, 16, 8) if ctx.simulator else REFERENCE
    sets = _input_sets(b, h, n, d, 2)
    tiles = default_tiles(d)
    for causal in (False, True):
        config = _config(b, h, n, d, np.float32, causal)
        flops = _flops(b, h, n, n, d, causal)
        model = io_model_bytes(b, h, n, n, d, Br=tiles.Br, Bc=tiles.Bc, causal=causal)
        results.append(measure_kernel(ctx, tiles, b, h, n, d, causal=causal, sets=sets,
                                      label="flash fwd (default tiles)", extra={"part": "reference"}))
        results.append(ctx.measure(CHAPTER, "flash_attention() launcher", config,
                                   lambda q, k, v, c=causal: flash_attention(q, k, v, causal=c), sets,
                                   flops=flops, model_bytes=model,
                                   note="checks arguments, allocates O and L each call",
                                   extra={"N": n, "d": d, "causal": causal, "part": "reference"}))
        if torch is not None:
            _torch_peers(ctx, results, torch, sets, config, flops, model,
                         {"N": n, "d": d, "causal": causal, "part": "reference"}, causal=causal, dtype=np.float32)


def tile_sweep(ctx, candidates=None, *, d=None, causal=False):
    """The kernel at the reference configuration with each candidate tile configuration."""
    b, h, n, d0 = (1, 1, 16, 8) if ctx.simulator else REFERENCE
    d = d or d0
    if candidates is None:
        candidates = [default_tiles(d), Tiles(16, 8, 4, 4)] if ctx.simulator else \
            list(SWEEP_D64 if d <= 64 else SWEEP_D128)
    sets = _input_sets(b, h, n, d, 2)
    out = []
    # each candidate, then the default tiles loading the next K/V tile ahead (prefetch)
    for tiles, prefetch in [(t, False) for t in candidates] + [(candidates[0], True)]:
        try:
            out.append(measure_kernel(ctx, tiles, b, h, n, d, causal=causal, sets=sets, prefetch=prefetch,
                                      label=f"{'fwd+prefetch' if prefetch else 'flash fwd'} {tiles}",
                                      extra={"part": "tile sweep"}))
        except Exception as exc:   # a candidate the device cannot run: report, keep sweeping
            ctx.progress(f"  tile sweep: {tiles} failed: {type(exc).__name__}: {str(exc)[:160]}")
    return out


def n_sweep(ctx, results, torch):
    if ctx.simulator:
        points = [(16, 8)]
        b, h = 1, 1
    else:
        ns = (1024, 4096, 16384) if ctx.quick else (512, 1024, 2048, 4096, 8192, 16384)
        points = [(n, d) for d in (64, 128) for n in ns]
        b, h = 4, 16
    for n, d in points:
        sets = _input_sets(b, h, n, d, 2)
        tiles = default_tiles(d)
        for causal in (False, True):
            config = _config(b, h, n, d, np.float32, causal)
            flops = _flops(b, h, n, n, d, causal)
            model = io_model_bytes(b, h, n, n, d, Br=tiles.Br, Bc=tiles.Bc, causal=causal)
            extra = {"N": n, "d": d, "causal": causal, "part": "N sweep"}
            results.append(measure_kernel(ctx, tiles, b, h, n, d, causal=causal, sets=sets,
                                          label=f"flash fwd d={d}{' causal' if causal else ''}", extra=extra))
            if torch is not None:
                # plain PyTorch materialises B H N^2 floats twice: keep it to N <= 4096 (4 GiB each)
                _torch_peers(ctx, results, torch, sets, config, flops, model, extra, causal=causal,
                             dtype=np.float32, plain=n <= 4096, backends=("efficient",))
        del sets


def fp16_rows(ctx, results, torch):
    b, h, n, d = (1, 1, 16, 8) if ctx.simulator else REFERENCE
    sets = _input_sets(b, h, n, d, 2, np.float16)
    tiles = default_tiles(d)
    for causal in (False, True):
        config = _config(b, h, n, d, np.float16, causal)
        flops = _flops(b, h, n, n, d, causal)
        model = io_model_bytes(b, h, n, n, d, Br=tiles.Br, Bc=tiles.Bc, causal=causal, in_bytes=2)
        extra = {"N": n, "d": d, "causal": causal, "part": "fp16"}
        results.append(measure_kernel(ctx, tiles, b, h, n, d, causal=causal, dtype=np.float16, sets=sets,
                                      label="flash fwd fp16 in (fp32 math)", extra=extra))
        if torch is not None:
            _torch_peers(ctx, results, torch, sets, config, flops, model, extra, causal=causal,
                         dtype=np.float16, plain=True, backends=("efficient", "flash", "cudnn"))


LADDER = (1, 16, 4096, 64)              # B, H, N, d of the ladder's rows


def ladder_rows(ctx, results):
    """The ladder through its public launchers, one configuration: rung 1 (one thread a
    query row), rung 2 (a block a query tile, K/V tiles in shared memory), rung 3 (the
    production kernel), causal and not."""
    b, h, n, d = (1, 1, 16, 8) if ctx.simulator else LADDER
    sets = _input_sets(b, h, n, d, 2)
    rungs = (("rung 1: one thread a row", row_per_thread_attention, "K, V from global memory by every row"),
             ("rung 2: query tile, K/V in shared", query_tile_attention, "K/V tiles shared by a block's rows"),
             ("rung 3: flash_attention()", flash_attention, "production: micro-tiles, registers"))
    for causal in (False, True):
        for label, launcher, note in rungs:
            results.append(ctx.measure(
                CHAPTER, label, _config(b, h, n, d, np.float32, causal),
                lambda q, k, v, f=launcher, c=causal: f(q, k, v, causal=c), sets,
                flops=_flops(b, h, n, n, d, causal),
                model_bytes=io_model_bytes(b, h, n, n, d, Br=default_tiles(d).Br, causal=causal),
                peak_memory=False, repeat=None if ctx.simulator else 5, warmup=None if ctx.simulator else 1,
                note=f"launcher; {note}", extra={"N": n, "d": d, "causal": causal, "part": "ladder"}))


def run(ctx) -> list[Result]:
    torch = torch_or_none()
    results: list[Result] = []
    ladder_rows(ctx, results)
    reference_rows(ctx, results, torch)
    results.extend(tile_sweep(ctx))
    if not ctx.simulator and not ctx.quick:
        results.extend(tile_sweep(ctx, d=128))
    n_sweep(ctx, results, torch)
    fp16_rows(ctx, results, torch)
    return results


# --------------------------------------------------------------------------- the memory demonstration

def memory_demo(ctx, n=131072, d=64):
    """B = H = 1, one long sequence: the fused kernel needs O(N d) memory, the naive path
    B H N^2 floats for S (and again for P): at N = 131072, 64 GiB each."""
    from numba import cuda

    from kernels.bench.harness import measure_peak_memory_mb

    if ctx.simulator:
        n, d = 64, 16
    b = h = 1
    tiles = default_tiles(d)
    sets = _input_sets(b, h, n, d, 1)
    s_bytes = b * h * n * n * 4
    results = []
    config = _config(b, h, n, d, np.float32, False)
    flops = _flops(b, h, n, n, d, False)
    model = io_model_bytes(b, h, n, n, d, Br=tiles.Br, Bc=tiles.Bc)
    peak = float("nan") if ctx.simulator else measure_peak_memory_mb(
        lambda q, k, v: flash_attention(q, k, v), sets[0])
    r = ctx.measure(CHAPTER, "flash_attention() launcher", config, lambda q, k, v: flash_attention(q, k, v), sets,
                    flops=flops, model_bytes=model, peak_memory=False, repeat=3, warmup=1,
                    note=f"peak memory of the call: O and L only; the naive S alone would be {s_bytes / 2**30:.0f} GiB",
                    extra={"N": n, "d": d, "part": "memory", "naive_S_GiB": round(s_bytes / 2**30, 2),
                           "inputs_MB": round(3 * n * d * 4 / 1e6, 1)})
    r.peak_mem_mb = peak
    results.append(r)
    # The naive path: the allocation of S fails on an 80 GB card (reported, not raised).
    if not ctx.simulator:
        try:
            from kernels.naive_attention import naive_attention

            naive_attention(*sets[0])
            cuda.synchronize()
            ctx.progress("  naive attention ran (the device had room for S and P)")
            note = "ran"
        except Exception as exc:
            note = f"failed: {type(exc).__name__}: {str(exc)[:100]}"
            ctx.progress(f"  naive attention at N={n}: {note}")
        import gc

        gc.collect()                                   # give back whatever the attempt held
        cuda.current_context().deallocations.clear()
        results.append(Result(CHAPTER, "naive_attention() (chapter 1)", config, float("nan"), float("nan"),
                              float("nan"), flops, float(4 * (4 * n * d + 4 * n * n + n)), float("nan"),
                              float("nan"), float("nan"), float(2 * s_bytes / 1e6), False,
                              f"needs S and P: 2 x {s_bytes / 2**30:.0f} GiB; {note}",
                              {"N": n, "d": d, "part": "memory"}))
        torch = torch_or_none()
        if torch is not None:
            _torch_peers(ctx, results, torch, sets, config, flops, model, {"N": n, "d": d, "part": "memory"},
                         causal=False, dtype=np.float32, plain=False, backends=("efficient",))
    return results


# --------------------------------------------------------------------------- command line

def _ncu_once(spec: str):
    from numba import cuda

    tiles = Tiles(*(int(x) for x in spec.split(",")))
    b, h, n, d = REFERENCE
    sets = _input_sets(b, h, n, d, 1)
    fn, _, _ = bare_launch(tiles, b, h, n, n, d)
    fn(*sets[0])              # compile and warm up (ncu: --launch-skip 1)
    cuda.synchronize()
    fn(*sets[0])              # the launch to profile
    cuda.synchronize()
    for causal in (False,):
        print(f"{tiles}: IO model {io_model_bytes(b, h, n, n, d, Br=tiles.Br, Bc=tiles.Bc, causal=causal) / 1e6:.1f} MB "
              f"(compulsory {b * h * (4 * n * d + n) * 4 / 1e6:.1f} MB)")


def dram_from_ncu(paths, *, shape=REFERENCE, ctx=None) -> list[Result]:
    """Rows of measured memory traffic from Nsight Compute CSV output (``ncu --csv`` of the
    ``--ncu`` runs above), next to the IO model for the Br each kernel ran with (read off
    its grid: Tr = ceil(N / Br) blocks along x).

    Two levels are read when present: DRAM bytes (``dram__bytes_read/write.sum``, what
    reaches HBM) and the bytes the SMs read from L2 (``lts__t_sectors_srcunit_tex_op_read.sum``
    x 32 B). The IO model assumes nothing between the SM's shared memory and HBM, so it
    predicts the second; L2 (50 MB) keeps most K/V re-reads away from HBM. With ``ctx`` and
    file names ending in the tile spec (``..._128,64,8,8.csv``) each row also gets the time
    of the same tiles measured without the profiler."""
    import re
    from pathlib import Path

    from kernels.bench.harness import read_ncu

    b, h, n, d = shape
    results = []
    for path in paths:
        spec = re.search(r"(\d+,\d+,\d+,\d+)\.csv$", Path(path).name)
        timed = None
        if ctx is not None and spec:
            tiles = Tiles(*(int(x) for x in spec.group(1).split(",")))
            timed = measure_kernel(ctx, tiles, b, h, n, d, label=f"flash fwd {tiles}", extra={})
        for launch in read_ncu(path):
            if "flash_forward" not in launch["kernel"]:
                continue
            metrics, block = launch["metrics"], launch["block"]
            tr = int(launch["grid"].strip("()").split(",")[0])
            br = -(-n // tr)
            read = metrics.get("dram__bytes_read.sum", float("nan"))
            write = metrics.get("dram__bytes_write.sum", float("nan"))
            l2_read = metrics.get("lts__t_sectors_srcunit_tex_op_read.sum", float("nan"))
            model = io_model_bytes(b, h, n, n, d, Br=br)
            note = (f"DRAM {(read + write) / 1e9:.3f} GB = {(read + write) / model:.2f} x the IO model; "
                    f"SM reads from L2 {l2_read / 1e9:.2f} GB = {(l2_read + write) / model:.2f} x it "
                    f"(with the writes); block {block}")
            ms = timed.median_ms if timed else float("nan")
            tflops = timed.tflops if timed else float("nan")
            results.append(Result(CHAPTER, f"flash fwd Br={br} (Nsight Compute)", _config(b, h, n, d, np.float32, False),
                                  ms, float("nan"), float("nan"), _flops(b, h, n, n, d, False), model,
                                  tflops, float("nan"), float("nan"), float("nan"), False, note,
                                  {"Br": br, "tiles": spec.group(1) if spec else "", "dram_read_bytes": read,
                                   "dram_write_bytes": write, "dram_total_bytes": read + write,
                                   "l2_read_bytes": l2_read, "model_bytes": model,
                                   "compulsory_bytes": b * h * (4 * n * d + n) * 4, "part": "ncu", "source": str(path)}))
    return sorted(results, key=lambda r: r.extra["Br"])


def main(argv=None) -> int:
    from kernels.bench import harness

    parser = argparse.ArgumentParser(prog="python -m kernels.bench.flash_forward")
    parser.add_argument("--memory", action="store_true")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--ladder", action="store_true", help="the ladder's rows alone -> flash_forward_ladder.csv")
    parser.add_argument("--ncu", metavar="Br,Bc,TM,TX")
    parser.add_argument("--dram", nargs="+", metavar="NCU_CSV",
                        help="ncu --csv outputs of --ncu runs -> flash_forward_dram.csv")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.ncu:
        _ncu_once(args.ncu)
        return 0
    ctx = harness.Context(quick=args.quick, warmup=3, repeat=10 if args.quick else 20)
    out = harness.results_folder(args.out)
    env = harness.environment()
    if args.sweep:
        results = tile_sweep(ctx) + (tile_sweep(ctx, d=128) if not ctx.simulator else [])
        harness.write_csv(out / "flash_forward_sweep.csv", results, env)
        print(harness.format_table(results))
    if args.ladder:
        results = []
        ladder_rows(ctx, results)
        harness.write_csv(out / "flash_forward_ladder.csv", results, env)
        print(harness.format_table(results))
    if args.dram:
        results = dram_from_ncu(args.dram, ctx=None if on_simulator() else ctx)
        harness.write_csv(out / "flash_forward_dram.csv", results, env)
        for r in results:
            print(r.kernel, r.note)
    if args.memory:
        results = memory_demo(ctx)
        harness.write_csv(out / "flash_forward_memory.csv", results, env)
        print(harness.format_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
