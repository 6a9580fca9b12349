"""Chapter 0: the copy kernel copies exactly, the block reduction sums like the oracle."""

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from numba import cuda

from kernels import gpu_basics
from kernels.base.testing import assert_close, random_array

MAX_LEN = 3000  # the simulator runs every thread in Python


@st.composite
def vectors(draw, max_len=MAX_LEN):
    n = draw(st.integers(0, max_len))
    magnitude = draw(st.sampled_from([1e-3, 1.0, 1e4]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return random_array(rng, (n,), magnitude)


@given(x=vectors(), items=st.sampled_from([1, 2, 4]), threads=st.sampled_from([32, 64, 96]),
       blocks=st.one_of(st.none(), st.integers(1, 5)))
@example(x=np.arange(1, 2, dtype=np.float32), items=1, threads=32, blocks=None)        # N = 1
@example(x=np.linspace(1, 2, 129, dtype=np.float32), items=4, threads=32, blocks=1)   # one past a tile, one block
@example(x=np.zeros(0, np.float32), items=1, threads=32, blocks=None)                # N = 0
def test_copy_is_exact(x, items, threads, blocks):
    got = gpu_basics.copy(x, items=items, threads=threads, blocks=blocks)
    assert isinstance(got, np.ndarray) and got.dtype == np.float32
    # again into an output poisoned with NaN: an element the kernel never writes shows
    # (a fresh allocation may hold the right values from an earlier case)
    out = cuda.to_device(np.full(x.shape, np.nan, np.float32))
    gpu_basics.copy(cuda.to_device(x), out=out, items=items, threads=threads, blocks=blocks)
    got = out.copy_to_host()
    assert got.shape == x.shape
    wrong = np.flatnonzero(~((got == x) | (np.isnan(got) & np.isnan(x))))
    if wrong.size:
        i = int(wrong[0])
        grid = gpu_basics.copy_grid(len(x), threads, items, blocks)
        block, thread = gpu_basics.copy_owner(i, threads, grid, items)
        raise AssertionError(f"{wrong.size} of {len(x)} elements wrong; the first, element {i}: got {got[i]!r}, "
                             f"expected {x[i]!r}; it is block {block}, thread {thread}'s "
                             f"(grid of {grid} blocks of {threads} threads, {items} a step)")


def test_copy_into_out_and_on_device():
    x = random_array(np.random.default_rng(1), (777,))
    out = np.full_like(x, np.nan)
    assert gpu_basics.copy(x, out=out) is out
    np.testing.assert_array_equal(out, x)
    d = cuda.to_device(x)
    d_out = cuda.device_array_like(d)
    gpu_basics.copy(d, out=d_out)
    np.testing.assert_array_equal(d_out.copy_to_host(), x)
    back = gpu_basics.copy(d)
    assert not isinstance(back, np.ndarray)
    np.testing.assert_array_equal(back.copy_to_host(), x)


def _segment_sums(x, threads, dtype):
    n = len(x)
    padded = np.zeros(-(-n // threads) * threads, dtype)
    padded[:n] = x
    return padded.reshape(-1, threads).sum(axis=1, dtype=dtype)


@given(x=vectors(max_len=1200), threads=st.sampled_from([1, 2, 32, 64, 128]))
@example(x=np.ones(1, np.float32), threads=64)
@example(x=np.linspace(-1, 3, 65, dtype=np.float32), threads=64)  # one past a block
def test_block_sums_match_the_oracle(x, threads):
    got = gpu_basics.block_sums(x, threads=threads)
    exact = _segment_sums(x.astype(np.float64), threads, np.float64)
    baseline = _segment_sums(x, threads, np.float32)
    assert got.shape == exact.shape
    assert_close(got, exact, baseline, name="block sums (element b is block b's)")


@given(x=vectors(), a=st.sampled_from([0.0, 1.0, -2.5, 3.0e3]), seed=st.integers(0, 2**32 - 1),
       threads=st.sampled_from([32, 64]), blocks=st.one_of(st.none(), st.integers(1, 5)))
@example(x=np.ones(1, np.float32), a=2.0, seed=0, threads=32, blocks=None)            # N = 1
@example(x=np.zeros(0, np.float32), a=2.0, seed=0, threads=32, blocks=None)           # N = 0
def test_scale_add_matches_the_oracle(x, a, seed, threads, blocks):
    y = random_array(np.random.default_rng(seed), x.shape)
    assert isinstance(gpu_basics.scale_add(a, x, y, threads=threads, blocks=blocks), np.ndarray)
    out = cuda.to_device(np.full(x.shape, np.nan, np.float32))      # NaN: an element never written shows
    gpu_basics.scale_add(a, x, y, out=out, threads=threads, blocks=blocks)
    got = out.copy_to_host()
    exact = np.float64(np.float32(a)) * x.astype(np.float64) + y
    baseline = np.float32(a) * x + y                  # NumPy float32: one rounding a step
    assert_close(got, exact, baseline, name="a*x + y (element i is thread i's, modulo the grid)")


def _segment_maxes(x, threads):
    n = len(x)
    padded = np.full(-(-n // threads) * threads, -np.inf, np.float32)
    padded[:n] = x
    return padded.reshape(-1, threads).max(axis=1)     # NaN in a segment gives NaN


@given(x=vectors(max_len=1200), threads=st.sampled_from([1, 2, 32, 64, 128]), nans=st.integers(0, 2),
       seed=st.integers(0, 2**32 - 1))
@example(x=np.ones(1, np.float32), threads=64, nans=0, seed=0)
@example(x=-np.linspace(1, 3, 65, dtype=np.float32), threads=64, nans=0, seed=0)  # negatives, one past a block
@example(x=np.array([1.0, np.nan, 3.0], np.float32), threads=2, nans=0, seed=0)   # NaN then a larger number
def test_block_maxes_match_the_oracle(x, threads, nans, seed):
    x = x.copy()
    if len(x) and nans:
        x[np.random.default_rng(seed).integers(0, len(x), nans)] = np.nan
    expected = _segment_maxes(x, threads)
    assert isinstance(gpu_basics.block_maxes(x, threads=threads), np.ndarray)
    out = cuda.to_device(np.full(expected.shape, 7.0, np.float32))   # a value no segment's max: never written shows
    gpu_basics.block_maxes(x, out=out, threads=threads)
    got = out.copy_to_host()
    assert got.shape == expected.shape
    wrong = np.flatnonzero(~((got == expected) | (np.isnan(got) & np.isnan(expected))))
    if wrong.size:
        b = int(wrong[0])
        raise AssertionError(f"{wrong.size} of {len(expected)} maxima wrong; the first, block {b} "
                             f"(x[{b * threads}:{(b + 1) * threads}]): got {got[b]!r}, expected {expected[b]!r}")


def test_block_sums_on_device_stay_on_device():
    x = random_array(np.random.default_rng(2), (300,))
    got = gpu_basics.block_sums(cuda.to_device(x), threads=64)
    assert not isinstance(got, np.ndarray)
    np.testing.assert_allclose(got.copy_to_host(), _segment_sums(x, 64, np.float64), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("call, match, exc", [
    (lambda: gpu_basics.copy([1.0, 2.0]), "x:", TypeError),
    (lambda: gpu_basics.copy(np.ones((2, 2), np.float32)), "x: expected 1 dimensions", ValueError),
    (lambda: gpu_basics.copy(np.ones(4, np.float64)), "x: expected dtype float32", TypeError),
    (lambda: gpu_basics.copy(np.ones(4, np.float32), out=np.ones(5, np.float32)), "out:", ValueError),
    (lambda: gpu_basics.copy(np.ones(4, np.float32), items=0), "items:", ValueError),
    (lambda: gpu_basics.copy(np.ones(4, np.float32), threads=2048), "threads:", ValueError),
    (lambda: gpu_basics.copy(np.ones(4, np.float32), blocks=1.5), "blocks:", TypeError),
    (lambda: gpu_basics.block_sums(np.ones(4, np.float32), threads=48), "threads: expected a power of two", ValueError),
    (lambda: gpu_basics.block_sums(None), "x:", TypeError),
    (lambda: gpu_basics.scale_add("2", np.ones(4, np.float32), np.ones(4, np.float32)), "a:", TypeError),
    (lambda: gpu_basics.scale_add(2.0, np.ones(4, np.float32), np.ones(5, np.float32)), "y: expected shape", ValueError),
    (lambda: gpu_basics.scale_add(2.0, np.ones(4, np.float32), np.ones(4, np.float64)), "y: expected dtype", TypeError),
    (lambda: gpu_basics.block_maxes(np.ones(4, np.float32), threads=48), "threads: expected a power of two", ValueError),
])
def test_bad_input_names_the_argument(call, match, exc):
    with pytest.raises(exc, match=match):
        call()


@given(block_dim=st.integers(1, 64), grid_dim=st.integers(1, 8), n=st.integers(0, 700), items=st.sampled_from([1, 4]))
def test_grid_stride_indices_cover_every_element_once(block_dim, grid_dim, n, items):
    seen = [i for b in range(grid_dim) for t in range(block_dim)
            for i in gpu_basics.grid_stride_indices(b, t, block_dim, grid_dim, n, items)]
    assert sorted(seen) == list(range(n))
    for b in range(grid_dim):                     # copy_owner inverts it (what a failing copy test names)
        for t in range(block_dim):
            for i in gpu_basics.grid_stride_indices(b, t, block_dim, grid_dim, n, items):
                assert gpu_basics.copy_owner(i, block_dim, grid_dim, items) == (b, t)
    if n >= 2 and block_dim >= 2:  # coalesced: neighbouring threads start on neighbouring elements
        assert gpu_basics.grid_stride_indices(0, 1, block_dim, grid_dim, n, items)[0] == 1


@given(b=st.integers(1, 3), h=st.integers(1, 3), n=st.integers(1, 300), d=st.integers(1, 128))
@example(b=1, h=1, n=4096, d=64)
def test_counts_are_the_arrays_and_products_they_count(b, h, n, d):
    """The counting formulas against the things they count: the bytes of the actual arrays
    (Q, K, V, O, L; S and P for the standard forward, each written once and read once),
    the multiply-adds of the two products, the pairs the causal mask keeps, and chapter 1's
    IO model (itself checked against the elements its kernels touch)."""
    from kernels.naive_attention import io_model_bytes

    q = k = v = o = np.empty((b, h, n, d), np.float32)
    lse = np.empty((b, h, n), np.float32)
    s = p = np.empty((b, h, n, n), np.float32)
    qkvo = q.nbytes + k.nbytes + v.nbytes + o.nbytes
    assert gpu_basics.fused_forward_compulsory_bytes(b, h, n, d) == qkvo + lse.nbytes
    assert gpu_basics.standard_forward_bytes(b, h, n, d) == qkvo + 2 * s.nbytes + 2 * p.nbytes
    assert io_model_bytes(b, h, n, n, d)["total"] == gpu_basics.standard_forward_bytes(b, h, n, d) + lse.nbytes
    # S = Q K^T and O = P V: B*H*N*N dot products of length d each, 2 FLOPs a multiply-add.
    assert gpu_basics.attention_flops(b, h, n, n, d) == 2 * (2 * d) * b * h * n * n
    # Causal: the pairs kept are N(N+1)/2, the halved count misses only the diagonal's half.
    kept = int(np.tril(np.ones((n, n), bool)).sum()) if n <= 300 else n * (n + 1) // 2
    exact = 2 * (2 * d) * b * h * kept
    assert 0 <= exact - gpu_basics.attention_flops(b, h, n, n, d, causal=True) == 2 * d * b * h * n


def test_the_standard_forward_is_bandwidth_bound_the_fused_one_is_not():
    # At N = 4096, d = 64 the standard forward sits below the measured fp32 ridge point
    # (FLOP/s over HBM bandwidth, from the committed results), the fused one far above:
    # the chapter's argument in two numbers.
    from kernels.base.io_model import ridge_point

    ridge = ridge_point()
    flops = gpu_basics.attention_flops(1, 1, 4096, 4096, 64)
    assert gpu_basics.arithmetic_intensity(flops, gpu_basics.standard_forward_bytes(1, 1, 4096, 64)) < ridge
    assert gpu_basics.arithmetic_intensity(flops, gpu_basics.fused_forward_compulsory_bytes(1, 1, 4096, 64)) > ridge
