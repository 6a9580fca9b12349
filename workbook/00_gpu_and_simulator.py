# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 0. The GPU and the simulator
#
# FlashAttention is an answer to one question: *where do the bytes live, and how often do
# they move?* Before we write attention, this chapter builds the picture the rest of the
# course relies on:
#
# 1. the memory hierarchy of a GPU (HBM, L2, shared memory, registers) and how fast each is;
# 2. threads, warps, blocks, barriers, shared memory and occupancy, through two small kernels;
# 3. how to run every chapter with a GPU or without one (the Numba CUDA simulator), and
#    what the simulator cannot tell you;
# 4. how the course times kernels and counts their FLOPs and bytes, and the roofline that
#    turns those counts into an expectation.
#
# The kernels of this chapter live in `kernels/gpu_basics.py`; the tests in
# `tests/test_gpu_basics.py`.
#
# **Sources** (numbered as in the README's list): [15] the roofline model (Williams,
# Waterman and Patterson 2009); [1] FlashAttention, Section 2.1 (the GPU memory
# hierarchy).

# %%
import inspect
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

import kernels  # chooses the GPU or the simulator, before Numba is imported
from kernels import gpu_basics
from kernels.base.runtime import device_name, on_simulator, time_fn
from kernels.base.testing import assert_close, check_exercise, random_array
from numba import cuda

print(f"running on: {device_name()}  (simulator: {on_simulator()})")

# %% tags=["parameters"]
# Tiny sizes in the simulator (every GPU thread is a Python thread there), real ones on a GPU.
N_COPY = 2**12 if on_simulator() else 2**26
REPEAT = 3 if on_simulator() else 30

# %% [markdown]
# ## 1. Where the bytes live
#
# A GPU is many small processors (the H100 has 132 *streaming multiprocessors*, SMs) in
# front of one large, comparatively slow memory. Every level closer to the arithmetic units
# is smaller and faster:
#
# | level | size on the H100 | bandwidth | who sees it |
# |---|---|---|---|
# | HBM3 (global memory) | 80 GB | **2.95 TB/s** device copy (cudaMemcpy), measured on an H100 by this chapter's bench | every thread of every block |
# | L2 cache | 50 MB | several TB/s (not measured here) | every SM |
# | shared memory / L1 | 256 KB a SM, up to 227 KB shared memory a block | about 33 TB/s over all SMs (128 B per clock per SM; derived from the architecture, not measured) | the threads of one block |
# | registers | 64K 32-bit registers a SM (256 KB), up to 255 a thread | the operands of every instruction | one thread |
#
# The fp32 arithmetic side: cuBLAS reaches **50.9 TFLOP/s** on an fp32 8192³ matmul with
# TF32 off, measured on the same H100 (the datasheet says 66.9). Dividing the two measured
# ceilings: the GPU can do about 50.9e12 / 2.95e12 ≈ **17 FLOPs for every byte** it reads
# from HBM. A kernel that does fewer FLOPs per byte than that waits for memory. Both figures
# are this chapter's committed results (`workbook/results/gpu_basics.csv`);
# `kernels.base.io_model.ceilings()` reads them, and `kernels/base/io_model.py` is where
# the course writes down its IO models.
#
# Standard attention writes the N×N score matrix S and the probabilities P to HBM and
# reads them back; FlashAttention keeps them in shared memory and registers. Same FLOPs,
# far fewer bytes: that is the whole course in one sentence.

# %%
import matplotlib.pyplot as plt
from matplotlib.patches import FancyBboxPatch


def draw_memory_hierarchy(ax):
    levels = [  # name, size, bandwidth, scope, colour
        ("registers", "64K x 32-bit a SM (256 KB); up to 255 a thread", "operands of every instruction",
         "private to a thread", "#2ca02c"),
        ("shared memory / L1", "256 KB a SM (up to 227 KB shared a block)",
         "~33 TB/s all SMs (128 B/clock/SM, derived)", "shared by a block", "#1f77b4"),
        ("L2 cache", "50 MB", "several TB/s", "shared by the GPU", "#9467bd"),
        ("HBM3 (global memory)", "80 GB", "2.95 TB/s device copy, measured on an H100",
         "every thread, every block", "#d62728"),
    ]
    for i, (name, size, bw, scope, color) in enumerate(levels):
        w, y = 0.45 + 0.17 * i, 3 - i
        ax.add_patch(FancyBboxPatch((0.5 - w / 2, y + 0.08), w, 0.84, boxstyle="round,pad=0.01",
                                    facecolor=color, alpha=0.25, edgecolor=color, linewidth=2))
        ax.text(0.5, y + 0.66, name, ha="center", va="center", fontsize=12, weight="bold")
        ax.text(0.5, y + 0.42, size, ha="center", va="center", fontsize=9)
        ax.text(0.5, y + 0.2, f"{bw}; {scope}", ha="center", va="center", fontsize=8.5)
    ax.annotate("", xy=(0.02, 3.9), xytext=(0.02, 0.1), arrowprops=dict(arrowstyle="->", lw=1.5))
    ax.text(0.035, 2.0, "faster, smaller, closer to the FMA units", rotation=90, va="center", fontsize=9)
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 4)
    ax.axis("off")
    ax.set_title("H100 memory hierarchy (132 SMs)", fontsize=13)


fig, ax = plt.subplots(figsize=(9, 5.2))
draw_memory_hierarchy(ax)
plt.show()

# %% [markdown]
# ## 2. Threads, warps, blocks, the grid
#
# A kernel is a function that many threads run at once. You launch it on a **grid** of
# **blocks**, each of **threads**: `kernel[blocks, threads_per_block](args...)`.
#
# * `cuda.threadIdx.x` is a thread's number inside its block, `cuda.blockIdx.x` the block's
#   number in the grid, `cuda.blockDim.x` and `cuda.gridDim.x` the sizes.
# * 32 consecutive threads of a block form a **warp**: they execute one instruction together.
#   When they load 32 consecutive float32s, the hardware serves all 32 with one 128-byte
#   transaction (a **coalesced** load); scattered addresses cost many transactions.
# * A **block** (at most 1024 threads) runs on one SM, shares that SM's **shared memory**,
#   and can wait at a **barrier**, `cuda.syncthreads()`. Blocks cannot wait for each other.
#
# Let us ask each thread who it is.

# %%
@cuda.jit
def whoami(block_ids, thread_ids, warp_ids, global_ids):
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x  # the global index, cuda.grid(1)
    block_ids[i] = cuda.blockIdx.x
    thread_ids[i] = cuda.threadIdx.x
    warp_ids[i] = cuda.threadIdx.x // 32
    global_ids[i] = i


blocks, threads = 2, 64
arrays = [cuda.device_array(blocks * threads, np.int32) for _ in range(4)]
whoami[blocks, threads](*arrays)
block_ids, thread_ids, warp_ids, global_ids = (a.copy_to_host() for a in arrays)
for i in (0, 1, 31, 32, 63, 64, 127):
    print(f"global {global_ids[i]:>3} = block {block_ids[i]} x {threads} + thread {thread_ids[i]:>2}"
          f"   (warp {warp_ids[i]} of its block)")

# %% [markdown]
# ## 3. The copy kernel: coalesced, grid-stride
#
# The simplest kernel that moves bytes: copy a vector. Each thread starts at its global
# index and steps by the number of threads in the whole grid (a **grid-stride loop**), so
# a grid sized for the machine (a few blocks per SM) covers a vector of any length.
# Thread `t` of a warp touches element `base + t`: a warp reads 32 consecutive floats.
#
# ```
# element:  0 1 2 ... 255 | 256 ... 511 | ... | G-1 | G G+1 ...      (G = threads in the grid)
# thread:   block 0       | block 1     | ... |     | block 0 again (next step of the loop)
# ```
#
# The module's version takes `ITEMS` elements a step, a block-width apart, so each thread
# has several loads in flight before its first store (still coalesced):

# %%
print(inspect.getsource(gpu_basics.make_copy))

# %%
rng = np.random.default_rng(0)
x = random_array(rng, (N_COPY,))
for items in (1, 4):
    y = gpu_basics.copy(x, items=items)
    assert np.array_equal(y, x)
print(f"copied {N_COPY} floats exactly, 1 and 4 elements a step; "
      f"bytes moved: {2 * 4 * N_COPY:,} (every element read once and written once)")

# %% [markdown]
# ## 4. Shared memory and barriers: a block reduction
#
# Summing is the first thing that needs threads to cooperate. Each block loads its
# `THREADS` elements into **shared memory**, then halves the number of active threads at
# every step: thread `t` adds element `t + half` to element `t`. Between steps every thread
# waits at `cuda.syncthreads()`, so nobody reads a partial sum before it is written.
#
# ```
# step 0:  a0 a1 a2 a3 a4 a5 a6 a7      (THREADS = 8)
# step 1:  a0+a4 a1+a5 a2+a6 a3+a7      half = 4
# step 2:  (a0+a4)+(a2+a6)  (a1+a5)+(a3+a7)        half = 2
# step 3:  the block's sum                          half = 1
# ```
#
# The barrier sits *outside* `if t < half`: every thread of the block must reach the same
# barrier. A barrier inside a branch that some threads skip is undefined behaviour on a GPU
# (a hang, or garbage); the simulator does not notice.

# %%
print(inspect.getsource(gpu_basics.make_block_sum))

# %%
x = random_array(np.random.default_rng(1), (1000,))
threads = 64
got = gpu_basics.block_sums(x, threads=threads)
padded = np.zeros(-(-len(x) // threads) * threads)
padded[: len(x)] = x
exact = padded.reshape(-1, threads).sum(axis=1)                                  # float64 oracle
baseline = padded.astype(np.float32).reshape(-1, threads).sum(axis=1, dtype=np.float32)
assert_close(got, exact, baseline, name="block sums")
print(f"{len(got)} block sums agree with the float64 oracle within the float32 tolerance rule")

# %% [markdown]
# ## 5. Who touched which element: tracing a kernel
#
# In the simulator every GPU thread is a Python thread, so it can tell us exactly which
# thread read or wrote which element. `kernels.base.trace.trace(kernel, grid, block, *args)`
# launches `kernel[grid, block](*args)` as usual and records every access: to the kernel's
# array arguments (global memory, HBM) and to its `cuda.shared.array`s (shared memory).
# Registers and `cuda.local.array` are not memory traffic and are not recorded.
#
# The picture, one row an array: reads on the left, writes on the right; each cell is an
# element, coloured by the thread that touched it (side-by-side stripes when several did),
# with the number of accesses in it. `highlight=(block, thread)` outlines one thread's
# cells and fades the rest. A 1-D array is drawn 32 elements a line: one warp's coalesced
# load is one line.
#
# First the copy of section 3: 2 blocks of 8 threads (16 threads in the grid) over 40
# elements, so the grid-stride loop goes round three times.

# %%
from kernels.base.trace import trace, tracing

x = np.arange(40, dtype=np.float32)
y = np.zeros_like(x)
copy_trace = trace(gpu_basics.make_copy(1), 2, 8, x, y)
assert np.array_equal(y, x)
print(copy_trace.table())
copy_trace.draw(highlight=(0, 3))
plt.show()

# %% [markdown]
# Thread 3 of block 0 copies elements 3, 19 and 35: it starts at its global index and steps
# by the 16 threads of the grid. Along a line, neighbouring elements belong to neighbouring
# threads: a warp's loads land on consecutive addresses (coalesced). The counts say the
# same in numbers: every element read once and written once, 2 × 4 × 40 bytes in all.

# %%
src = copy_trace["src"]
print("block 0, thread 3 reads", src.elements("read", block=0, thread=3))
print("element 35 is read by (block, thread)", src.threads_of(35, "read"))
print("reads and writes of each thread of block 1:",
      {thread: tuple(c) for (block, thread), c in src.by_thread.items() if block == 1})
print("bytes read + written:", src.bytes_read + copy_trace["dst"].bytes_written)

# %% [markdown]
# Now the block sum of section 4, launched by its own launcher: `with tracing() as
# launches:` traces every kernel launched inside, however it is launched. Shared memory
# shows as its own array (`buf`, named as in the source). Each block has its own copy of
# it; the picture shows one block's (here block 1, whose thread 0 is outlined: it reads
# `buf[0]` at every step and writes the block's sum).

# %%
with tracing() as launches:
    sums = gpu_basics.block_sums(np.arange(16, dtype=np.float32), threads=8)
block_trace = launches[0]
print(sums, "\n")
print(block_trace.table())
block_trace.draw(highlight=(1, 0))
plt.show()

# %% [markdown]
# Each thread also counts the barriers it has passed: `phase=k` keeps the accesses made
# between the k-th and the (k+1)-th `cuda.syncthreads()`. Phase 0 is the load into shared
# memory; phases 1 to 3 the steps of the tree, where `half` threads read two elements and
# write one; phase 4 thread 0 reading the block's sum. The barrier is what makes this safe:
# nobody reads `buf[t + half]` in a phase before the phase that wrote it has ended.

# %%
buf = block_trace["buf"]
for phase in range(block_trace.phases + 1):
    # {thread: the elements of buf it read (wrote) in this phase}, block 0, threads that did
    reads = {t: e for t in range(8) if (e := buf.elements("read", block=0, thread=t, phase=phase))}
    writes = {t: e for t in range(8) if (e := buf.elements("write", block=0, thread=t, phase=phase))}
    print(f"phase {phase}: reads {reads}  writes {writes}")
print("most by one thread:", block_trace.max_per_thread())
block_trace.draw("buf", block=0, phase=1)
plt.show()

# %% [markdown]
# The same works on any kernel, your own included (the exercises' last cell traces yours),
# and on 2-D arrays and 2-D blocks: chapter 2 draws a tiled matmul's shared tiles with it.
# What the picture does not show: time (simulated threads interleave in any order), caches,
# and how a warp's loads are merged into 128-byte transactions; the bytes in the table are
# what the threads ask for.

# %% [markdown]
# ## 6. Occupancy: how many warps an SM keeps busy
#
# An SM hides the latency of a memory load (hundreds of cycles) by switching to another
# warp that is ready. The more warps resident on an SM, the more latency it can hide. What
# limits the count is whichever resource runs out first: threads (2048 a SM on the H100),
# blocks (32 a SM), registers (65536 a SM), shared memory (228 KB a SM, plus 1 KB the
# system reserves a block). The course's fused kernels trade occupancy for tiles: bigger
# tiles in shared memory and registers mean fewer bytes from HBM but fewer resident blocks.

# %%
def occupancy(threads_per_block, registers_per_thread, shared_bytes_per_block):
    """Resident blocks and warps a SM on the H100 (allocation granularity ignored)."""
    limits = {
        "threads": 2048 // threads_per_block,
        "blocks": 32,
        "registers": 65536 // (registers_per_thread * threads_per_block),
        "shared memory": (228 * 1024) // (shared_bytes_per_block + 1024),
    }
    blocks = min(limits.values())
    warps = blocks * threads_per_block // 32
    return blocks, warps, min(limits, key=limits.get)


print(f"{'kernel':<44}{'blocks/SM':>10}{'warps/SM':>10}  limited by")
for name, args in [("copy: 256 threads, 16 regs, no shared", (256, 16, 0)),
                   ("block sum: 256 threads, 16 regs, 1 KB", (256, 16, 1024)),
                   ("a fused tile: 128 threads, 128 regs, 40 KB", (128, 128, 40 * 1024)),
                   ("a big tile: 256 threads, 255 regs, 96 KB", (256, 255, 96 * 1024))]:
    blocks, warps, limit = occupancy(*args)
    print(f"{name:<44}{blocks:>10}{warps:>10}  {limit}")

# %% [markdown]
# ## 7. With a GPU or without one
#
# Every chapter runs in two ways, chosen once when `kernels` is imported:
#
# | `WORKBOOK_DEVICE` | what runs |
# |---|---|
# | unset (`auto`) | the GPU when the CUDA driver reports one, else the simulator |
# | `gpu` | real CUDA: kernels compile to PTX and run on the device (compiling needs no GPU) |
# | `sim` | the **Numba CUDA simulator**: every GPU thread becomes a Python thread on the CPU |
#
# ```bash
# python -m kernels test                           # tests and notebooks (simulator without a GPU)
# WORKBOOK_DEVICE=sim jupyter lab                  # the notebooks, forced into the simulator
# python -m kernels --chapters 0                   # this chapter's bench
# python -m kernels.base.ptx_check                      # compile every kernel for the H100 (sm_90)
# ```
#
# Notebooks read `on_simulator()` in their `parameters` cell and pick tiny sizes there.
#
# ### What the simulator cannot tell you
#
# * **Types.** The simulator runs the kernel as Python: a float64 written into a float32
#   array, an unsupported function, a shared-memory size that is not a compile-time
#   constant all run fine. `python -m kernels.base.ptx_check` compiles every kernel with Numba's
#   real CUDA compiler (`numba.cuda.compile_ptx`, target sm_90) without needing a GPU, and
#   warns when a kernel spills to local memory.
# * **Precision.** `math.exp` in the simulator is Python's float64 `exp`; on the GPU it is
#   float32 (and approximate with `fastmath=True`). A simulator pass can hide a precision
#   problem; the tests therefore always compare to a float64 oracle with a tolerance set
#   by float32 arithmetic, and run again on a GPU.
# * **Races and barriers.** Simulated threads interleave differently from warps: a missing
#   `cuda.syncthreads()` or a barrier inside a divergent branch may pass here.
#   On a GPU, `compute-sanitizer --tool racecheck` and `--tool synccheck` find them
#   (`--tool memcheck` finds out-of-bounds accesses).
# * **Speed.** Simulator timings measure Python. The bench labels them and writes them to
#   `bench-out/`, never over the committed GPU results in `workbook/results/`.

# %%
# The PTX check for this chapter's kernels, in a process with the simulator off:
env = dict(os.environ, WORKBOOK_DEVICE="gpu")
env.pop("NUMBA_ENABLE_CUDASIM", None)
proc = subprocess.run([sys.executable, "-m", "kernels.base.ptx_check", "gpu_basics"], env=env,
                      capture_output=True, text=True, timeout=600)
print(proc.stdout[-2000:] or proc.stderr[-2000:])

# %%
# In the simulator, exp inside a "kernel" is Python's float64 exp:
@cuda.jit
def exp_kernel(x, out):
    i = cuda.grid(1)
    if i < x.shape[0]:
        out[i] = math.exp(x[i])


x = np.array([10.0, -10.0, 0.5], np.float32)
out = np.zeros_like(x)
exp_kernel[1, 32](x, out)
print("kernel exp:", out, "| float32 exp:", np.exp(x), "| float64 exp:", np.exp(x.astype(np.float64)))

# %% [markdown]
# ## 8. How the course times
#
# `kernels.base.runtime.time_fn` (and the bench harness built on it) follows the same rules for
# every kernel and every peer:
#
# * **CUDA events** recorded on the GPU around the call, so the time is what the device
#   spent (in the simulator: the host clock, and the numbers are labelled as such);
# * **warm-up** runs first (compilation, caches, clocks), then the **median** of many runs,
#   with the 10th and 90th percentiles to show the spread;
# * **rotating input sets**: two to four different inputs in turn, so a repeated input does
#   not sit in the 50 MB L2 and make HBM look faster than it is;
# * **random data, never zeros** (zeros hide bugs, and can make the hardware look better);
# * **peers in the same run**: cuBLAS through CuPy, PyTorch's attention backends, so a
#   ratio compares like with like on one device at one time.

# %%
print(inspect.getsource(time_fn))

# %%
sets = [(random_array(np.random.default_rng(s), (N_COPY,)),) for s in range(2)]
t = time_fn(lambda a: gpu_basics.copy(a), sets, warmup=1, repeat=REPEAT)
print(f"copy of {N_COPY} floats (host arrays, so transfers included): median {t.median_ms:.3f} ms, "
      f"p10-p90 spread {t.spread:.0%}, clock: {t.clock}")

# %% [markdown]
# ## 9. How the course counts
#
# * **FLOPs** of attention forward: $4 \cdot B \cdot H \cdot N^2 \cdot d$ (2 for each
#   multiply-add of $S = QK^\top$ and as many for $O = PV$), halved when causal; backward
#   2.5× that. The count is the model's, the same for every kernel and peer.
# * **Bytes** from the IO model: what must cross between HBM and the chip. The standard
#   forward reads Q, K, V, writes and reads S and P, writes O: $4Nd + 4N^2$ elements a
#   head. A fused forward's compulsory traffic is $4Nd + N$ (Q, K, V, O and the logsumexp).
# * **Arithmetic intensity** = FLOPs / bytes. The **roofline**: a kernel of intensity $I$
#   cannot beat $\min(\text{peak FLOP/s},\ I \times \text{bandwidth})$.
#
# For the standard forward in fp32 the intensity is about $d/4$ when $N \gg d$: 16 FLOP/B at
# $d = 64$, just under the ridge, and that is the *best* case. Every extra elementwise pass
# over S (scaling, masking, the row max, the exponentials, the normalisation) adds $2N^2$
# elements of traffic and no matmul FLOPs, and the naive kernels of chapter 1 make several;
# a fused kernel's compulsory traffic is so small that only its arithmetic bounds it.

# %%
print(inspect.getsource(gpu_basics.attention_flops))
from kernels.base.io_model import ceilings

measured = ceilings()  # the committed results of this chapter's bench (cuBLAS fp32 TF32 off; cudaMemcpy)
PEAK_TFLOPS, HBM_TBS = round(measured.fp32_tflops, 1), round(measured.hbm_tbs, 2)
print(f"{measured.device}, driver {measured.driver}: {PEAK_TFLOPS} TFLOP/s, {HBM_TBS} TB/s")
B, H, N, d = 4, 16, 4096, 64
flops = gpu_basics.attention_flops(B, H, N, N, d)
for name, nbytes in [("standard forward (S, P in HBM)", gpu_basics.standard_forward_bytes(B, H, N, d)),
                     ("fused forward, compulsory bytes", gpu_basics.fused_forward_compulsory_bytes(B, H, N, d))]:
    ai = gpu_basics.arithmetic_intensity(flops, nbytes)
    bound = min(PEAK_TFLOPS, ai * HBM_TBS)
    print(f"{name:<34} {nbytes / 1e9:8.2f} GB  intensity {ai:8.1f} FLOP/B  roofline bound {bound:5.1f} TFLOP/s")

# %%
fig, ax = plt.subplots(figsize=(7, 4.2))
ai = np.logspace(-1, 3, 200)
ax.loglog(ai, np.minimum(PEAK_TFLOPS, ai * HBM_TBS), color="black")
ax.axvline(PEAK_TFLOPS / HBM_TBS, color="grey", linestyle=":")
ax.text(PEAK_TFLOPS / HBM_TBS * 1.1, 1, f"ridge {PEAK_TFLOPS / HBM_TBS:.0f} FLOP/B", fontsize=8)
for name, nbytes, color in [("standard fwd", gpu_basics.standard_forward_bytes(B, H, N, d), "tab:red"),
                            ("fused fwd (compulsory)", gpu_basics.fused_forward_compulsory_bytes(B, H, N, d), "tab:blue")]:
    x_ai = gpu_basics.arithmetic_intensity(flops, nbytes)
    ax.plot([x_ai], [min(PEAK_TFLOPS, x_ai * HBM_TBS)], "o", color=color, label=name)
ax.set_xlabel("arithmetic intensity (FLOP / byte of HBM traffic)")
ax.set_ylabel("attainable TFLOP/s (fp32)")
ax.set_title(f"fp32 roofline, ceilings measured ({PEAK_TFLOPS} TFLOP/s, {HBM_TBS} TB/s); "
             f"B={B} H={H} N={N} d={d}", fontsize=9)
ax.legend(fontsize=8)
ax.grid(True, which="both", alpha=0.3)
plt.show()

# %% [markdown]
# ## 10. The measured results
#
# `python -m kernels --chapters 0` measures, in one run: the copy kernel's bandwidth
# against the driver's device-to-device copy and CuPy's copy kernel over N (bytes read +
# written), the cuBLAS fp32 ceiling (8192³, TF32 off) that every chapter's "% FMA" column
# divides by, and Numba's launch overhead. The committed results below come from an H100.

# %%
from kernels.bench.harness import read_csv

results = Path(kernels.__file__).resolve().parent.parent / "workbook" / "results"
csv_path, png_path = results / "gpu_basics.csv", results / "gpu_basics.png"
if csv_path.exists():
    env, rows = read_csv(csv_path)
    print(f"device: {env.get('device')}; driver {env.get('driver', '?')}; {env.get('timings', '')}")
    for r in rows:
        rate = f"{r['tflops']:.1f} TFLOP/s" if r["flops"] > 0 else (
            f"{r['gbps']:.0f} GB/s" if r["model_bytes"] > 0 else f"{r['median_ms'] * 1e3:.1f} µs")
        print(f"  {r['kernel']:<38} {r['config']:<34} {rate}")
    if png_path.exists():
        from IPython.display import Image, display

        display(Image(filename=str(png_path)))
else:
    print("GPU results are not committed yet: run `python -m kernels --chapters 0` on a GPU.")

# %% [markdown]
# ## 11. Exercises
#
# ### Exercise 1: the grid-stride index
#
# Write the list of elements thread `thread` of block `block` copies, in order, for a grid
# of `grid_dim` blocks of `block_dim` threads and a vector of `n` elements (one element a
# step). The checker verifies that all threads together cover every element exactly once
# and that neighbouring threads start on neighbouring elements (coalesced).

# %%
def my_grid_stride_indices(block, thread, block_dim, grid_dim, n):
    # Your code here: start at the global index, step by the number of threads in the grid.
    raise NotImplementedError


# %%
from hypothesis import strategies as st

launches = st.tuples(st.integers(1, 64), st.integers(1, 8), st.integers(0, 600))


def grid_stride_property(indices_fn):
    def prop(case):
        block_dim, grid_dim, n = case
        seen = [i for b in range(grid_dim) for t in range(block_dim)
                for i in indices_fn(b, t, block_dim, grid_dim, n)]
        assert sorted(seen) == list(range(n)), "every element exactly once"
        if n >= 2 and block_dim >= 2:
            assert list(indices_fn(0, 1, block_dim, grid_dim, n))[:1] == [1], "thread 1 starts at element 1"
    return prop


_ = check_exercise(grid_stride_property(my_grid_stride_indices), launches, host=True)
# The module's solution passes:
_ = check_exercise(grid_stride_property(gpu_basics.grid_stride_indices), launches, host=True)

# %% [markdown]
# ### Exercise 2: the arithmetic intensity of standard attention
#
# Write the FLOPs per byte of HBM traffic of the standard (unfused) attention forward, for
# `b` batches, `h` heads, sequence length `n`, head dim `d` and `bpe` bytes per element,
# using the counts of section 9. Is it above or below the ridge of about 17 FLOP/B?

# %%
def my_standard_intensity(b, h, n, d, bpe):
    # Your code here: FLOPs (4 B H N^2 d) over bytes ((4Nd + 4N^2) elements a head).
    raise NotImplementedError


# %%
shapes = st.tuples(st.integers(1, 8), st.integers(1, 16), st.integers(1, 8192), st.integers(1, 256),
                   st.sampled_from([2, 4]))


def intensity_property(fn):
    def prop(case):
        b, h, n, d, bpe = case
        expected = gpu_basics.arithmetic_intensity(gpu_basics.attention_flops(b, h, n, n, d),
                                                   gpu_basics.standard_forward_bytes(b, h, n, d, bpe))
        got = fn(b, h, n, d, bpe)
        assert math.isclose(got, expected, rel_tol=1e-9), f"got {got}, expected {expected}"
    return prop


_ = check_exercise(intensity_property(my_standard_intensity), shapes, host=True)
_ = check_exercise(intensity_property(lambda b, h, n, d, bpe: gpu_basics.arithmetic_intensity(
    gpu_basics.attention_flops(b, h, n, n, d), gpu_basics.standard_forward_bytes(b, h, n, d, bpe))), shapes,
    host=True)

# %% [markdown]
# ### Exercises 3 and 4 (kernels): a scaled sum and a block maximum
#
# Now write two kernels yourself. They go in a file of your own, which the next cell makes
# from a template the first time (`workbook/mine/my_gpu_basics.py`; your edits are kept).
# `grade` then runs **the chapter's own tests** (`tests/test_gpu_basics.py`) with your
# factories in place of the course's, and prints "passed" or the smallest case that fails
# and where: which element, and which block and thread own it. From a shell the same
# grading is `WORKBOOK_LEARNER=workbook/mine/my_gpu_basics.py python -m pytest
# tests/test_gpu_basics.py -k "scale_add or block_maxes"`.
#
# * **Exercise 3.** `make_scale_add(threads)` returns a kernel `(a, x, y, out)` that writes
#   `out[i] = a * x[i] + y[i]` for every `i`, whatever grid it is launched on (the tests
#   launch 1 to 5 blocks of 32 or 64 threads over up to 3000 elements).
# * **Exercise 4.** `make_block_max(threads)` returns a kernel `(x, maxes)` launched with
#   one block of `threads` threads (a power of two) for each `threads` elements: block `b`
#   writes the largest of `x[b*threads : (b+1)*threads]` to `maxes[b]`, NaN if the segment
#   holds a NaN. Section 4's block sum is the pattern.
#
# <details><summary>Hint 1 (exercise 3)</summary>
#
# `cuda.grid(1)` is this thread's global index and `cuda.gridsize(1)` the number of threads
# in the grid; loop from the first while below `x.shape[0]`, stepping by the second.
# </details>
#
# <details><summary>Hint 2 (exercise 4)</summary>
#
# Load one element a thread into a shared array of `threads` floats (`-inf` past the end
# of `x`), then halve: `if t < half`, keep the larger of `buf[t]` and `buf[t + half]`, with a
# `cuda.syncthreads()` after each step that every thread reaches.
# </details>
#
# <details><summary>Hint 3 (exercise 4, NaN)</summary>
#
# Every comparison with a NaN is False, so `a if a > b else b` drops a NaN in `a`, and
# `max(a, b)` (fmaxf on a GPU) returns the number. Test for it: `a != a` is True only for NaN.
# </details>

# %%
from kernels.base.learner import grade, my_file

TEMPLATE = '''"""My kernels for chapter 0 (graded by tests/test_gpu_basics.py)."""
CHAPTER = "gpu_basics"

import math

from numba import cuda, float32, int32


def make_scale_add(threads):
    @cuda.jit
    def scale_add_kernel(a, x, y, out):
        raise NotImplementedError   # your code: out[i] = a * x[i] + y[i] for every i

    return scale_add_kernel


def make_block_max(threads):
    THREADS = threads

    @cuda.jit
    def block_max_kernel(x, maxes):
        raise NotImplementedError   # your code: maxes[b] = max of block b's segment

    return block_max_kernel
'''

mine = my_file("my_gpu_basics.py", TEMPLATE)

# %%
_ = grade(mine)

# %% [markdown]
# ### Your kernel's accesses
#
# The trace of your block maximum (from your file, once it runs; until then the course's):
# every element of `x` read once, by the thread that owns it, and the tree in shared memory
# as in the block sum. A picture that differs (an element read twice, a thread that writes
# `maxes`, one that never does) points at the line to look at.

# %%
from kernels.base.learner import load

x = random_array(np.random.default_rng(2), (20,))
maxes = np.full(3, np.nan, np.float32)       # 3 blocks of 8 threads over 20 elements
try:
    my_module, _, defined = load(mine)
    if "make_block_max" not in defined:
        raise NotImplementedError("no make_block_max in your file")
    max_trace = trace(my_module.make_block_max(8), 3, 8, x, maxes)
    whose = "your"
except Exception as exc:  # the template, or a kernel that does not run yet
    print(f"your make_block_max does not run yet ({type(exc).__name__}: {str(exc)[:100]}); "
          f"tracing the course's")
    max_trace = trace(gpu_basics.make_block_max(8), 3, 8, x, maxes)
    whose = "the course's"
print(f"{whose} maxima: {maxes}\n")
print(max_trace.table())
max_trace.draw(title=f"{whose} block max: {max_trace.kernel}[grid 3, block 8]")
plt.show()

# %% [markdown]
# The course's answers are `gpu_basics.make_scale_add` and `gpu_basics.make_block_max`
# (read them after yours pass). The copy and the block sum of sections 3 and 4 are
# exercises too (`make_copy`, `make_block_sum`: define them in the same file to have the
# chapter's tests grade your versions).

# %% [markdown]
# ## What to take into the next chapters
#
# * HBM is big and slow (2.95 TB/s measured), shared memory and registers small and fast;
#   fp32 arithmetic runs at about 17 FLOPs per HBM byte: count bytes first.
# * Threads in warps of 32, blocks on one SM with shared memory and barriers, a grid of
#   independent blocks; coalesced loads; occupancy limited by registers and shared memory.
# * In the simulator, `kernels.base.trace` shows which thread read and wrote which element,
#   in global and in shared memory, between which barriers: a picture of a kernel's accesses.
# * The simulator runs everything everywhere, but checks no types, computes exp in float64
#   and misses races: the PTX check, the GPU test run and compute-sanitizer cover that.
# * Time with events, warm-up, medians and rotating random inputs; count FLOPs by the
#   formula and bytes by the IO model; compare with peers measured in the same run.
#
# Next: chapter 1 writes attention the obvious way, and counts what it costs.
