"""The access trace (kernels.base.trace) counts exactly what tiny kernels do by hand:
which thread read or wrote which element, of global and of shared arrays, and when
(between which barriers)."""

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from numba import cuda, float32

from kernels import gpu_basics
from kernels.base.trace import Counts, Score, TracedArray, trace, tracing

TILE = 2   # the tiled kernel's tile: 2×2 threads a block, a 2×2 shared tile of A and of B


@cuda.jit
def tiled_matmul(a, b, c):
    """C = AB, one 2×2 tile of C a block: each step loads a tile of A and of B into shared
    memory (one element a thread), waits, and multiplies them."""
    sa = cuda.shared.array((TILE, TILE), float32)
    sb = cuda.shared.array((TILE, TILE), float32)
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    row = cuda.blockIdx.y * TILE + ty
    col = cuda.blockIdx.x * TILE + tx
    acc = float32(0.0)
    for k0 in range(0, a.shape[1], TILE):
        sa[ty, tx] = a[row, k0 + tx]
        sb[ty, tx] = b[k0 + ty, col]
        cuda.syncthreads()
        for k in range(TILE):
            acc += sa[ty, k] * sb[k, tx]
        cuda.syncthreads()
    c[row, col] = acc


@cuda.jit
def add_one_by_rows(a, hits):
    """Thread i adds 1 to every element of row i of ``a`` through a row view, and counts
    itself in ``hits[0]`` with an atomic."""
    i = cuda.threadIdx.x
    row = a[i]
    for j in range(row.shape[0]):
        row[j] += 1.0
    cuda.atomic.add(hits, 0, 1)


def test_copy_counts_every_element_once_by_its_owner():
    """Grid-stride copy of 10 floats by 2 blocks of 4 threads: 8 threads, so threads 0
    and 1 of block 0 take a second element (8 and 9)."""
    x = np.arange(10, dtype=np.float32)
    y = np.full_like(x, np.nan)
    t = trace(gpu_basics.make_copy(1), 2, 4, x, y)
    np.testing.assert_array_equal(y, x)
    assert t.names == ["src", "dst"]                   # the local array `vals` is not memory traffic
    assert t.counts == {"src": Counts(10, 0), "dst": Counts(0, 10)}
    assert t["src"].memory == t["dst"].memory == "global"
    np.testing.assert_array_equal(t["src"].read_counts, np.ones(10))
    assert t["dst"].bytes_written == 40 and t["src"].bytes_read == 40
    assert t["src"].by_thread[(0, 0)] == Counts(2, 0) and t["src"].by_thread[(1, 3)] == Counts(1, 0)
    assert t["src"].elements("read", block=0, thread=1) == [1, 9]
    assert t["dst"].elements("write", block=1, thread=2) == [6]
    assert t["dst"].threads_of(9, "write") == [(0, 1)]
    assert t.grid == 2 and t.block == 4
    assert t.max_per_thread() == Score(2, 2, 0, 0)


@given(n=st.integers(0, 40), threads=st.sampled_from([1, 4, 8]), blocks=st.integers(1, 3),
       items=st.sampled_from([1, 2]))
@example(n=17, threads=4, blocks=2, items=2)
def test_copy_trace_matches_the_grid_stride_indices(n, threads, blocks, items):
    """Each thread reads and writes exactly the elements gpu_basics.grid_stride_indices
    gives it, once each."""
    x = np.arange(n, dtype=np.float32)
    y = np.zeros_like(x)
    t = trace(gpu_basics.make_copy(items), blocks, threads, x, y)
    assert t.counts == {"src": Counts(n, 0), "dst": Counts(0, n)}
    for b in range(blocks):
        for th in range(threads):
            mine = sorted(gpu_basics.grid_stride_indices(b, th, threads, blocks, n, items))
            assert t["src"].elements("read", block=b, thread=th) == mine, (b, th)
            assert t["dst"].elements("write", block=b, thread=th) == mine, (b, th)


def test_tiled_kernel_shared_tiles_and_barriers():
    """4×4 C = AB with 2×2 tiles: 4 blocks of 2×2 threads, 2 steps of (load, barrier,
    multiply, barrier)."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((4, 4)).astype(np.float32), rng.standard_normal((4, 4)).astype(np.float32)
    c = np.full((4, 4), np.nan, np.float32)
    t = trace(tiled_matmul, (2, 2), (TILE, TILE), a, b, c)
    np.testing.assert_allclose(c, a.astype(np.float64) @ b, rtol=1e-5, atol=1e-5)
    assert t.names == ["a", "b", "c", "sa", "sb"]      # shared arrays named as in the source
    assert [x.memory for x in t] == ["global"] * 3 + ["shared"] * 2
    # global: 16 threads x 2 steps, one element of A and one of B a step; C written once
    assert t.counts["a"] == t.counts["b"] == Counts(32, 0)
    assert t.counts["c"] == Counts(0, 16)
    np.testing.assert_array_equal(t["a"].read_counts, np.full((4, 4), 2))   # two blocks read each
    # shared: 16 threads x 2 steps write one element, read TILE elements of each tile
    assert t.counts["sa"] == t.counts["sb"] == Counts(64, 32)
    assert t.max_per_thread() == Score(4, 1, 8, 4)
    assert t.per_thread()[((1, 0), (1, 0))] == Score(4, 1, 8, 4)
    assert t.phases == 4
    # thread (tx=1, ty=0) of block (1, 0) loads sa[0, 1] (from A[0, k0 + 1]) and sb[0, 1]
    # (from B[k0, 3]) each step, and reads row 0 of sa and column 1 of sb
    blk, thr = (1, 0), (1, 0)
    assert t["sa"].elements("write", block=blk, thread=thr) == [(0, 1)]
    assert t["sa"].elements("read", block=blk, thread=thr) == [(0, 0), (0, 1)]
    assert t["sb"].elements("read", block=blk, thread=thr) == [(0, 1), (1, 1)]
    assert t["a"].elements("read", block=blk, thread=thr) == [(0, 1), (0, 3)]
    assert t["b"].elements("read", block=blk, thread=thr) == [(0, 3), (2, 3)]
    assert t["c"].elements("write", block=blk, thread=thr) == [(0, 3)]
    # phases: the first step's loads before barrier 1, its reads between 1 and 2, ...
    assert t["sa"].elements("write", block=blk, thread=thr, phase=0) == [(0, 1)]
    assert t["sa"].elements("read", block=blk, thread=thr, phase=0) == []
    assert t["sa"].elements("read", block=blk, thread=thr, phase=3) == [(0, 0), (0, 1)]
    assert t["a"].elements("read", block=blk, thread=thr, phase=2) == [(0, 3)]
    # each block's thread (1, 0) writes sa[0, 1]; it is read by threads (0, 0) and (1, 0)
    assert t["sa"].threads_of((0, 1), "write") == [(bk, (1, 0)) for bk in [(0, 0), (0, 1), (1, 0), (1, 1)]]
    assert {thread for block, thread in t["sa"].threads_of((0, 1), "read")} == {(0, 0), (1, 0)}


def test_shared_reads_of_a_block_reduction_by_the_right_threads():
    """The course's block sum (8 threads, a tree over a shared buffer), launched by its
    own launcher inside tracing()."""
    x = np.arange(16, dtype=np.float32)
    with tracing() as launches:
        sums = gpu_basics.block_sums(x, threads=8)
    np.testing.assert_array_equal(sums, [28, 92])
    (t,) = launches
    buf = t["buf"]
    assert buf.memory == "shared" and buf.shape == (8,)
    # each block: 8 loads; then steps half = 4, 2, 1 read 2·half and write half; thread 0 reads buf[0]
    assert buf.n_writes == 2 * (8 + 4 + 2 + 1) and buf.n_reads == 2 * (8 + 4 + 2 + 1)
    assert buf.by_thread[(1, 0)] == Counts(7, 4) and buf.by_thread[(1, 5)] == Counts(0, 1)
    # buf[1] is loaded by thread 1, read by thread 1 (half = 4, 2) and thread 0 (half = 1)
    assert buf.elements("read", block=0, thread=1) == [1, 3, 5]
    assert [w for w in buf.threads_of(1, "read") if w[0] == 0] == [(0, 0), (0, 1)]
    assert buf.threads_of(1, "write") == [(0, 1), (1, 1)]
    table = t.table()
    assert table.row("all global")["reads"] == 16 and table.row("all global")["writes"] == 2
    assert table.row("all shared")["bytes read"] == 4 * 30
    assert "most by one thread: 1 global reads, 1 global writes, 7 shared reads, 4 shared writes" in str(table)


def test_reads_writes_views_and_atomics():
    """``row[j] += 1`` through a row view is one read and one write of a[i, j]; an atomic
    add is one read and one write."""
    a = np.zeros((3, 4), np.float32)
    hits = np.zeros(1, np.int32)
    t = trace(add_one_by_rows, 1, 3, a, hits)
    np.testing.assert_array_equal(a, 1)
    assert hits[0] == 3
    assert t.counts == {"a": Counts(12, 12), "hits": Counts(3, 3)}
    assert t["a"].elements("write", thread=2) == [(2, j) for j in range(4)]
    assert t["a"].by_thread[(0, 1)] == Counts(4, 4)
    assert isinstance(t["a"].traced, TracedArray) and t["a"].traced.distinct_writes == 12


def test_counts_stay_exact_past_the_cap():
    x = np.arange(40, dtype=np.float32)
    t = trace(gpu_basics.make_copy(1), 2, 8, x, np.zeros_like(x), max_events=10)
    assert t.counts == {"src": Counts(40, 0), "dst": Counts(0, 40)}
    assert t.recorded == 10 and t.dropped == 70
    assert len(t["src"].accesses()) + len(t["dst"].accesses()) == 10
    assert "70 more were not" in str(t.table())


def test_draw_gives_a_figure_with_a_panel_for_reads_and_writes():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    x = np.arange(16, dtype=np.float32)
    t = trace(gpu_basics.make_block_sum(8), 2, 8, x, np.zeros(2, np.float32))
    fig = t.draw(highlight=(1, 1))
    try:
        assert len(fig.axes) == 2 * len(t)
        titles = [ax.get_title() for ax in fig.axes]
        assert "buf (shared, block 1): 15 reads" in titles and "x (global): 16 reads" in titles
        # outlined: the cells block 1's thread 1 read (x[9]; buf[1], buf[3], buf[5]) and wrote (buf[1])
        outlined = [sum(isinstance(p, Rectangle) for p in ax.patches) for ax in fig.axes]
        assert outlined == [1, 0, 0, 0, 3, 1]
    finally:
        plt.close(fig)
    fig = t.draw("buf", kinds="read", block=0, phase=3, color_by="warp")
    try:
        assert [ax.get_title() for ax in fig.axes] == ["buf (shared, block 0): 2 reads"]   # half = 1
    finally:
        plt.close(fig)


def test_bad_arguments_are_named_and_the_simulator_is_restored():
    from numba.cuda.simulator.kernel import FakeCUDAKernel

    launch = FakeCUDAKernel.__call__
    x = np.zeros(4, np.float32)
    with pytest.raises(TypeError, match="kernel"):
        trace(lambda a: a, 1, 4, x)
    t = trace(gpu_basics.make_copy(1), 1, 4, x, np.zeros_like(x))
    with pytest.raises(KeyError, match="src, dst"):
        t["nope"]
    with pytest.raises(ValueError, match="color_by"):
        t.draw(color_by="rainbow")
    with pytest.raises(ValueError, match="kind"):
        t["src"].elements("load")
    with pytest.raises(RuntimeError, match="already on"):
        with tracing():
            with tracing():
                pass
    with pytest.raises(IndexError):            # an out-of-bounds access fails as in the simulator
        trace(gpu_basics.make_copy(1), 1, 4, np.zeros(4, np.float32), np.zeros(2, np.float32))
    assert FakeCUDAKernel.__call__ is launch


GPU_MODE_SCRIPT = '''
import numpy as np
import kernels
from kernels.base.runtime import on_simulator
from kernels.base.trace import trace
from kernels import gpu_basics
from numba import cuda

assert not on_simulator()

@cuda.jit(device=True)
def twice(v):
    return 2 * v

def make_reverse(n):
    @cuda.jit(device=True)
    def twice_plus_n(v):          # a device function in a closure, calling a global one
        return twice(v) + n

    @cuda.jit
    def reverse(x, y):
        t = cuda.threadIdx.x
        y[t] = twice_plus_n(x[7 - t])
    return reverse

x = np.arange(8, dtype=np.float32)
y = np.zeros(8, np.float32)
t = trace(make_reverse(1), 1, 8, x, y)
assert list(y) == [15, 13, 11, 9, 7, 5, 3, 1], y
assert t["x"].threads_of(7, "read") == [(0, 0)]
sums = np.zeros(2, np.float32)
t = trace(gpu_basics.make_block_sum(4), 2, 4, x, sums)
assert list(sums) == [6, 22] and t["buf"].n_writes == 2 * (4 + 2 + 1), t
print("ok")
'''


def test_trace_simulates_kernels_compiled_for_a_gpu():
    """With real CUDA selected (no GPU is needed: nothing is compiled or launched), a
    traced launch runs the kernel's Python source in the simulator, device functions too."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, WORKBOOK_DEVICE="gpu")
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    proc = subprocess.run([sys.executable, "-c", GPU_MODE_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
