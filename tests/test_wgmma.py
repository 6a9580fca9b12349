"""Hopper's warpgroup mma (kernels/base/wgmma.py): the layout, the descriptor, the product.

On a Hopper GPU the tensor cores are the judge: one warpgroup multiplies a 64 x K A (its
fragments in registers) by an N x K B (in shared memory, laid out by ``canonical_word``,
described by ``wgmma_desc``), K / 8 wgmma chained on one accumulator, and the result must be
A B^T of the operands as the tensor core reads tf32 (low 13 bits dropped), to float32's
accumulation. In the simulator the same kernel runs the emulation. A B laid out with the
strides swapped must fail.
"""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from numba import cuda, float32, uint32

from kernels.base import wgmma as wg
from kernels.base.mma import TF32_MASK, a_position_tf32, c_position, shared_address
from kernels.base.runtime import on_simulator

K_MAX, N_MAX = 32, 64


@pytest.fixture(scope="module")
def hopper():
    """wgmma runs on Hopper (sm_90a) only; the simulator emulates it."""
    if not on_simulator() and cuda.get_current_device().compute_capability[0] != 9:
        pytest.skip("wgmma needs a Hopper GPU (sm_90a)")


# --------------------------------------------------------------------------- the layout

@pytest.mark.parametrize("rows, K", [(8, 8), (64, 8), (32, 128), (64, 64)])
def test_canonical_layout_puts_each_element_in_one_word(rows, K):
    words = sorted(wg.canonical_word(r, k, K) for r in range(rows) for k in range(K))
    assert words == list(range(rows * K))


def test_a_core_matrix_is_128_contiguous_bytes_and_the_strides_say_where_the_next_is():
    K = 64
    lbo, sbo = wg.canonical_strides(K)
    for r0, k0 in [(0, 0), (8, 4), (24, 60)]:
        base = wg.canonical_word(r0, k0, K)
        core = sorted(wg.canonical_word(r0 + r, k0 + k, K) for r in range(8) for k in range(4))
        assert core == list(range(base, base + 32))              # 8 rows of 16 bytes, in order
        assert wg.canonical_word(r0, k0 + 4, K) - base == lbo // 4   # next along k
        assert wg.canonical_word(r0 + 8, k0, K) - base == sbo // 4   # next along the rows


def test_the_shapes_are_the_ptx_isas():
    assert wg.wgmma_shapes()[0] == 8 and wg.wgmma_shapes()[-1] == 256 and len(wg.wgmma_shapes()) == 32
    with pytest.raises(ValueError, match="n_cols"):
        wg.make_wgmma_tf32(12)


# --------------------------------------------------------------------------- the product

@pytest.fixture(scope="module")
def kernels(hopper):
    out = {}
    for n_cols in (8, 64):
        for swapped in (False, True):
            out[n_cols, swapped] = _make_product(n_cols, swapped)
    return out


def _make_product(N, swapped):
    """One warpgroup: D = A B^T over K (a multiple of 8) by K / 8 chained wgmma m64nNk8; a (64, K)
    and b (N, K) uint32 (float32 bits), out (128, N / 2) float32: each thread's accumulators."""
    wgmma = wg.make_wgmma_tf32(N)
    wait = wg.make_wgmma_wait(N // 2)
    zeros = wg.make_zeros(N // 2)
    ROWS = N_MAX * K_MAX // 4

    @cuda.jit
    def product(a, b, out):
        K = b.shape[1]
        sb = cuda.shared.array((ROWS, 4), uint32)
        tid = cuda.threadIdx.x
        for i in range(tid, N * K, 128):
            r, k = i // K, i % K
            word = 32 * ((r // 8) * (K // 4) + k // 4) + 4 * (r % 8) + k % 4     # canonical_word(r, k, K)
            sb[word // 4, word % 4] = b[r, k]
        wg.async_fence()
        cuda.syncthreads()
        lbo, sbo = 128, 32 * K                                                    # canonical_strides(K)
        if swapped:
            lbo, sbo = sbo, lbo
        warp, lane = tid // 32, tid % 32
        g, t = lane // 4, lane % 4
        row = 16 * warp + g
        base = shared_address(sb, 0, 0)
        acc = zeros()
        wg.wgmma_fence()
        for s in range(K // 8):
            regs = (a[row, 8 * s + t], a[row + 8, 8 * s + t], a[row, 8 * s + t + 4], a[row + 8, 8 * s + t + 4])
            acc = wgmma(regs, wg.wgmma_desc(base + uint32(256 * s), lbo, sbo), acc, 1 if s > 0 else 0)
        wg.wgmma_commit()
        acc = wait(acc)
        for i in range(N // 2):
            out[tid, i] = acc[i]

    return product


def _run(kernel, a, b, N):
    out = cuda.device_array((128, N // 2), np.float32) if not on_simulator() else np.zeros((128, N // 2), np.float32)
    kernel[1, 128](a.view(np.uint32), b.view(np.uint32), out)
    out = out if on_simulator() else out.copy_to_host()
    d = np.zeros((64, N))
    for th in range(128):
        for i in range(N // 2):
            r, c = c_position(th % 32, i % 4)
            d[16 * (th // 32) + r, 8 * (i // 4) + c] = out[th, i]
    return d


def _tf32(x):
    return (np.asarray(x, np.float32).view(np.uint32) & np.uint32(TF32_MASK)).view(np.float32).astype(np.float64)


@settings(max_examples=6, deadline=None)
@given(st.sampled_from([8, 64]), st.sampled_from([8, 16, 32]), st.integers(0, 2**32 - 1))
def test_chained_wgmma_is_a_b_transposed(kernels, N, K, seed):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((64, K)).astype(np.float32)
    b = rng.standard_normal((N, K)).astype(np.float32)
    got = _run(kernels[N, False], a, b, N)
    terms = _tf32(a)[:, None, :] * _tf32(b)[None, :, :]
    want = terms.sum(-1)
    # each product of two tf32 is exact in float32; only the K sums round: a few ulps of sum |terms|
    bound = 4 * K * 2.0**-24 * np.abs(terms).sum(-1)
    assert np.all(np.abs(got - want) <= bound), np.abs(got - want).max()


def test_a_b_described_with_its_strides_swapped_is_caught(kernels):
    rng = np.random.default_rng(7)
    a = rng.standard_normal((64, 16)).astype(np.float32)
    b = rng.standard_normal((64, 16)).astype(np.float32)
    want = (_tf32(a)[:, None, :] * _tf32(b)[None, :, :]).sum(-1)
    assert np.abs(_run(kernels[64, False], a, b, 64) - want).max() < 1e-4
    assert np.abs(_run(kernels[64, True], a, b, 64) - want).max() > 0.1


# --------------------------------------------------------------------------- chapter 11's forward with S on wgmma

@pytest.fixture(scope="module")
def forward_helpers(hopper):
    import test_flash_tf32 as tf

    return tf


def _forward_case(tf, case, tiles, mode, paired, misaligned, inflight=None, chain=None, pv_schedule=None):
    from kernels.flash_tf32 import launch_forward

    B, H, n_q, d = case.q.shape
    Hkv = case.k.shape[1]
    scale = case.scale if case.scale is not None else 1 / np.sqrt(d)
    o = cuda.device_array((B * H, n_q, d), np.float32)
    lse = cuda.device_array((B * H, n_q), np.float32)
    views = [tf.on_device(x.reshape(x.shape[0] * x.shape[1], x.shape[2], d), misaligned) for x in (case.q, case.k, case.v)]
    launch_forward(*views, o, lse, scale, int(case.causal), 3, tiles=tiles, wgmma=mode, paired=paired,
                   inflight=inflight, chain=chain, pv_schedule=pv_schedule)
    return o.copy_to_host().reshape(case.q.shape), lse.copy_to_host().reshape(B, H, n_q)


def _cases():
    import test_flash_tf32 as tf

    return tf.tf32_cases()


@given(case=st.deferred(_cases), mode=st.sampled_from(["s", "s+pv"]), paired=st.booleans(),
       misaligned=st.booleans(), schedule=st.sampled_from([(2, 1), (4, 1), (2, 2), (4, 2)]),
       pv=st.sampled_from([None, (2, 1), (4, 2), (1, 2)]), pv_halves=st.booleans())
@settings(max_examples=3 if on_simulator() else 60, deadline=None)
def test_forward_on_wgmma_meets_the_fp32_rule(forward_helpers, case, mode, paired, misaligned, schedule, pv,
                                              pv_halves):
    """S = Q_i K_j^T on wgmma from K_j's parts in planes ("s"), and O += P V_j from V_j^T's
    ("s+pv"), each k-step from zero and added in fp32, the rest of chapter 11's forward unchanged:
    the fp32 rule, ragged N and d, causal, grouped-query heads, K_j and V_j landed together or in
    turn, by cp.async or plain loads; S's schedule and P V's own (its groups over all of O's
    columns or half). (A tile's k-steps chained on one accumulator instead failed this rule on
    the H100: L's error 1.02x its bound.)"""
    from hypothesis import assume

    from kernels.flash_tf32 import tf32_tiles

    tf = forward_helpers
    B, H, n_q, d = case.q.shape
    assume(B * H and n_q and case.k.shape[2])
    Br, Bc, D = tf32_tiles(d, n_q)
    tiles = (64, 16) if on_simulator() else (max(Br, 64), Bc)
    pv_schedule = None if pv is None else (*pv, D // 2 if pv_halves and D % 16 == 0 else D)
    o, lse = _forward_case(tf, case, tiles, mode, paired, misaligned, *schedule, pv_schedule)
    tf.check_result(case, o, lse)


@pytest.mark.parametrize("inflight, chain", [(4, 1), (2, 2), (4, 2), (1, 2)])
def test_every_wgmma_schedule_meets_the_fp32_rule(forward_helpers, inflight, chain):
    """Each schedule of the k-steps (``inflight`` groups a round, ``chain`` k-steps a group on
    one accumulator): at d = 72 S's 9 k-steps fill whole rounds and leave one over (a group
    of its own), at Bc = 64 P V's 8 fill whole rounds; causal, ragged keys."""
    from kernels.base.testing import case_with

    tf = forward_helpers
    case = case_with((1, 1, 64, 72), (1, 1, 50, 72), causal=True, seed=inflight + chain)
    o, lse = _forward_case(tf, case, (64, 64), "s+pv", False, False, inflight, chain)
    tf.check_result(case, o, lse)


@pytest.mark.parametrize("pv_schedule", [(4, 2, 16), (1, 2, 16)])
def test_p_v_in_two_halves_of_o_meets_the_fp32_rule(forward_helpers, pv_schedule):
    """P V's own schedule with each group over half of O's columns (two products, the second's
    V_j^T rows and O's accumulator tiles D / 2 on): d = 32, Bc = 32 (P V's 4 k-steps: a round of
    two groups of two, or two rounds of one), ragged keys."""
    from kernels.base.testing import case_with

    tf = forward_helpers
    case = case_with((1, 1, 64, 32), (1, 1, 45, 32), causal=False, seed=sum(pv_schedule))
    o, lse = _forward_case(tf, case, (64, 32), "s+pv", True, False, 4, 2, pv_schedule)
    tf.check_result(case, o, lse)


def test_the_launchers_put_products_on_wgmma_where_it_runs(monkeypatch):
    """``tf32_wgmma``: on a Hopper GPU with 128-row tiles, S at every d and P V too at d <= 64;
    nowhere else (other GPUs, the simulator, the short heads' 64-row tiles)."""
    from kernels.base import wgmma as module
    from kernels.flash_tf32 import KERNEL_HEAD_DIMS, tf32_wgmma

    monkeypatch.setattr(module, "has_wgmma", lambda: True)
    assert [tf32_wgmma(128, D) for D in (8, 64, 72, 128)] == ["s+pv", "s+pv", "s", "s"]
    assert all(tf32_wgmma(64, D) is None for D in KERNEL_HEAD_DIMS)
    monkeypatch.setattr(module, "has_wgmma", lambda: False)
    assert all(tf32_wgmma(128, D) is None for D in KERNEL_HEAD_DIMS)


def test_a_shape_wgmma_cannot_take_is_named():
    from kernels.flash_tf32 import make_flash_forward_tf32

    with pytest.raises(ValueError, match=r"^wgmma: expected Br a multiple of 64"):
        make_flash_forward_tf32(32, 16, 16, 3, wgmma="s")
    with pytest.raises(ValueError, match=r"^wgmma: expected Br a multiple of 64 .* presplit=True"):
        make_flash_forward_tf32(128, 32, 64, 3, presplit=True, wgmma="s")
    with pytest.raises(ValueError, match=r"^wgmma: expected one of \('s', 's\+pv'\) or None, got 'pv'"):
        make_flash_forward_tf32(128, 32, 64, 3, wgmma="pv")
