"""Chapter 10's IO theory (kernels/io_theory.py): every closed form against the loop it
counts, run in NumPy with each HBM access counted; the bounds against what the algorithms
achieve; the crossover at M = d^2; the readers of the committed Nsight Compute results.
NumPy only, no kernel launch: well under a second."""

import math

import numpy as np
import pytest

from kernels import io_theory as th
from kernels import reference as ref
from kernels.base import io_model as io

# (N, d, Br, Bc): ragged N, tiles larger than N, one-row tiles
SHAPES = [(37, 8, 5, 7), (16, 4, 4, 4), (9, 3, 16, 2), (13, 6, 1, 13), (1, 2, 1, 1)]


def _qkv(n, d, seed=0, count=3):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((n, d)) for _ in range(count)]


def _oracle(q, k, v):
    o, lse = ref.attention(q[None, None], k[None, None], v[None, None])
    return o[0, 0], lse[0, 0]


def check_counts(hbm, formula):
    """The loop's counted reads and writes equal the closed form's, exactly."""
    got = hbm.counts()
    assert (got["reads"], got["writes"]) == (formula["reads"], formula["writes"]), (got, formula)


# --------------------------------------------------------------------------- the loops against the closed forms

@pytest.mark.parametrize("n, d, Br, Bc", SHAPES)
def test_fa1_forward_counts_and_output(n, d, Br, Bc):
    q, k, v = _qkv(n, d)
    o, l, m, hbm = th.simulate_fa1_forward(q, k, v, Br=Br, Bc=Bc)
    o_ref, lse_ref = _oracle(q, k, v)
    np.testing.assert_allclose(o, o_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(m + np.log(l), lse_ref, rtol=1e-12, atol=1e-12)
    check_counts(hbm, th.fa1_forward_accesses(n, d, Br=Br, Bc=Bc))
    tc = math.ceil(n / Bc)
    assert hbm.writes["O"] == (tc + 1) * n * d == th.fa1_forward_accesses(n, d, Br=Br, Bc=Bc)["O_writes"]
    assert hbm.reads["K"] == hbm.reads["V"] == n * d                     # K, V once
    assert hbm.reads["Q"] == tc * n * d                                  # Tc passes over Q


@pytest.mark.parametrize("n, d, Br, Bc", SHAPES)
def test_fa2_forward_counts_and_output(n, d, Br, Bc):
    q, k, v = _qkv(n, d, seed=1)
    o, lse, hbm = th.simulate_fa2_forward(q, k, v, Br=Br, Bc=Bc)
    o_ref, lse_ref = _oracle(q, k, v)
    np.testing.assert_allclose(o, o_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, lse_ref, rtol=1e-12, atol=1e-12)
    check_counts(hbm, th.fa2_forward_accesses(n, d, Br=Br, Bc=Bc))
    assert hbm.writes["O"] == n * d and hbm.reads["Q"] == n * d          # O once, Q once
    assert hbm.reads["K"] == math.ceil(n / Br) * n * d                   # Tr passes over K
    assert hbm.counts()["total"] == io.fused_forward_elements(n, n, d, Br=Br, Bc=Bc)


@pytest.mark.parametrize("n, d, Br, Bc", SHAPES[:3])
def test_fa1_backward_counts_and_gradients(n, d, Br, Bc):
    q, k, v, do = _qkv(n, d, seed=2, count=4)
    o, l, m, _ = th.simulate_fa1_forward(q, k, v, Br=Br, Bc=Bc)
    dq, dk, dv, hbm = th.simulate_fa1_backward(q, k, v, o, l, m, do, Br=Br, Bc=Bc)
    o_ref, lse_ref = _oracle(q, k, v)
    want = ref.attention_backward(*(x[None, None] for x in (q, k, v, o_ref)), lse_ref[None, None], do[None, None])
    for got, w in zip((dq, dk, dv), want):
        np.testing.assert_allclose(got, w[0, 0], rtol=1e-10, atol=1e-10)
    check_counts(hbm, th.fa1_backward_accesses(n, d, Br=Br, Bc=Bc))


@pytest.mark.parametrize("n, d, M", [(37, 8, 40), (20, 16, 4), (11, 5, 100), (64, 16, 200)])
def test_small_cache_counts_and_output(n, d, M):
    q, k, v = _qkv(n, d, seed=3)
    o, lse, hbm = th.simulate_small_cache(q, k, v, M=M)
    o_ref, lse_ref = _oracle(q, k, v)
    np.testing.assert_allclose(o, o_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, lse_ref, rtol=1e-12, atol=1e-12)
    check_counts(hbm, th.small_cache_accesses(n, d, M))
    b = th.small_cache_tile(M)
    assert 3 * b * b + b <= M < 3 * (b + 1) ** 2 + b + 1                 # the largest block that fits


def test_planted_bug_fa1_without_o_write_backs_is_caught():
    """FA-1's count as if O were written once (the FA-2 habit): the loop disagrees."""
    n, d, Br, Bc = SHAPES[0]
    _, _, _, hbm = th.simulate_fa1_forward(*_qkv(n, d), Br=Br, Bc=Bc)
    right = th.fa1_forward_accesses(n, d, Br=Br, Bc=Bc)
    tc = math.ceil(n / Bc)
    buggy = {**right, "writes": right["writes"] - (tc - 1) * n * d}   # O written once, not Tc times
    with pytest.raises(AssertionError):
        check_counts(hbm, buggy)


def test_agrees_with_the_kv_outer_kernels_count():
    """kernels/kv_outer_forward.py (the GPU kernel of Algorithm 1's order) counts the same
    loop, plus its final L = m + log l (2N reads, N writes)."""
    from kernels.kv_outer_forward import hbm_elements

    for n, d, Br, Bc in SHAPES:
        fa1, fa2 = th.fa1_forward_accesses(n, d, Br=Br, Bc=Bc), th.fa2_forward_accesses(n, d, Br=Br, Bc=Bc)
        kv, qo = hbm_elements(n, n, d, Br, Bc, "kv-outer"), hbm_elements(n, n, d, Br, Bc, "q-outer")
        assert (kv["read"], kv["written"]) == (fa1["reads"] + 2 * n, fa1["writes"] + n)
        assert (qo["read"], qo["written"]) == (fa2["reads"], fa2["writes"])


# --------------------------------------------------------------------------- tiles, orders and bounds

def test_tiles_from_m_follow_algorithm_1():
    assert th.tiles_from_m(64, 58112) == (64, 227)        # Bc = ceil(M/4d), Br = min(., d)
    assert th.tiles_from_m(64, 1000) == (4, 4)
    assert th.fa2_tiles_from_m(64, 58112) == (227, 64)
    for d in (4, 16, 64):
        for M in range(4 * d, d * d * 8, max(1, d * d // 3)):
            Br, Bc = th.tiles_from_m(d, M)
            assert Br <= d and th.fa1_on_chip_elements(d, Br, Bc) <= 1.25 * M + 9 * d   # O(M)
    with pytest.raises(ValueError, match="M"):
        th.tiles_from_m(64, 0)
    with pytest.raises(TypeError, match="d"):
        th.tiles_from_m(64.0, 100)


def test_theorem2_order_within_constants_of_the_exact_counts():
    """With the tiles from M, FA-1's exact count is 12 N^2 d^2 / M to leading order and
    FA-2's (mirrored tiles) 8 N^2 d^2 / M while the tiles grow with M (M <= 4d^2); FA-1
    moves more than FA-2 at every M up to Nd."""
    n, d = 4096, 64
    for M in (4 * d * 4, 4 * d * 16, 4 * d * 64, n * d):
        order = th.theorem2_order(n, d, M)
        fa1 = th.fa1_forward_accesses(n, d, **dict(zip(("Br", "Bc"), th.tiles_from_m(d, M))))["total"]
        fa2 = th.fa2_forward_accesses(n, d, **dict(zip(("Br", "Bc"), th.fa2_tiles_from_m(d, M))))["total"]
        if M <= 4 * d * d:                    # the tiles grow with M: the leading terms
            assert 12 <= fa1 / order < 13.5 and 8 <= fa2 / order < 9
        assert fa1 > fa2                       # FA-1 writes O Tc times and reads it Tc times
    assert th.standard_order(n, d) == n * d + n * n


def test_lower_bounds_never_above_what_is_achieved():
    """optimal_order ([5], with Nd) is below every exact count, FA-1 and FA-2 with tiles
    from M and the small-cache algorithm, on a grid of N, d, M (constants included: the
    counts carry constants >= 1 and the bound none)."""
    for n in (64, 1000, 4096):
        for d in (16, 64, 256):
            for M in sorted({d, 4 * d, d * d // 4, d * d, 4 * d * d, n * d}):
                if not d <= M <= n * d:
                    continue
                bound = th.optimal_order(n, d, M)
                assert bound >= n * d
                fa1 = th.fa1_forward_accesses(n, d, **dict(zip(("Br", "Bc"), th.tiles_from_m(d, M))))["total"]
                fa2 = th.fa2_forward_accesses(n, d, **dict(zip(("Br", "Bc"), th.fa2_tiles_from_m(d, M))))["total"]
                small = th.small_cache_accesses(n, d, M)["total"] if M >= 4 else math.inf
                assert bound <= min(fa1, fa2, small), (n, d, M)
                assert th.proposition4_order(n, d, M, 0.25) <= th.proposition4_order(n, d, M, 1.0)


def test_crossover_at_d_squared():
    """The orders meet at M = d^2 (both N^2); each is the smaller on its side; the exact
    counts of the two algorithms there agree within a constant (12 vs 4 sqrt(3) + 2)."""
    n = 1024
    for d in (8, 32, 64, 128):
        M = th.crossover_m(d)
        assert th.theorem2_order(n, d, M) == pytest.approx(n * n) == th.small_cache_order(n, d, M)
        assert th.small_cache_order(n, d, M / 4) < th.theorem2_order(n, d, M / 4)   # M < d^2: small cache wins
        assert th.small_cache_order(n, d, M * 4) > th.theorem2_order(n, d, M * 4)   # M > d^2: FlashAttention
        eps = 1e-9 * M
        assert th.optimal_order(n, d, M - eps) == pytest.approx(th.optimal_order(n, d, M + eps), rel=1e-6)
        fa1 = th.fa1_forward_accesses(n, d, **dict(zip(("Br", "Bc"), th.tiles_from_m(d, M))))["total"]
        small = th.small_cache_accesses(n, d, M)["total"]
        assert 1 / 3 < fa1 / small < 3, (d, fa1 / small)
        assert th.regime(d, M) != th.regime(d, M - 1)


def test_h100_regimes():
    fp32, fp16 = th.h100_regime(256, 4), th.h100_regime(256, 2)
    assert (fp32["M"], fp32["d2"]) == (58112, 65536) and fp32["regime"].startswith("M < d^2")
    assert fp16["M"] == 116224 and fp16["regime"].startswith("M >= d^2")
    assert fp32["gain"] == pytest.approx(256 / math.sqrt(58112))
    assert th.h100_regime(128, 4)["regime"].startswith("M >= d^2")


# --------------------------------------------------------------------------- the committed results

def _need(name):
    path = io.RESULTS_DIR / name
    if not path.exists():
        pytest.skip(f"{name} is not committed (written by the GPU bench: `.ci/gpu-check ncu`)")


def test_m_sweep_reads_the_br_sweep():
    _need("flash_forward_dram.csv")
    rows = th.m_sweep()
    assert [r["Br"] for r in rows] == sorted(r["Br"] for r in rows) and len(rows) >= 3
    for r in rows:
        d, Br, Bc = r["d"], r["Br"], r["Bc"]
        assert r["M"] == d * (Br + 4) + d * (Bc + 4) + Bc * (d + 8) + Bc * (Br + 4)   # Qt, Kt, V, Pt, padded
        assert r["M"] * 4 <= th.H100_SHARED_BYTES
        assert 0.5 < r["dram"] / r["compulsory"] < 1.5          # HBM: compulsory bytes at every Br
        assert r["l2_read"] <= 1.05 * r["kv_stream"]            # L2 -> SM: at most the K/V stream
    first, last = rows[0], rows[-1]
    assert first["l2_read"] / last["l2_read"] > last["M"] / first["M"]   # falls faster than 1 / M here


def test_measured_vs_model_rows():
    for name in ("flash_forward_dram.csv", "flash_backward_dram.csv", "block_sparse_dram.csv"):
        _need(name)
    rows = th.measured_vs_model()
    results = {r["result"] for r in rows}
    assert results == {"Theorem 2", "Theorem 5", "Proposition 4"}
    for r in rows:
        assert r["dram"] < 2 * r["compulsory"] and r["dram"] < r["l2"]
    fwd = {r["s"]: r["l2"] for r in rows if r["kernel"].startswith("block-sparse forward")}
    assert fwd[0.125] < fwd[0.25] < fwd[1.0]                    # Proposition 4: the stream scales with s


def test_chapter_rows_and_the_orders_traffic():
    _need("io_theory.csv")
    _need("io_theory_dram.csv")
    from kernels.kv_outer_forward import hbm_elements

    rows = th.chapter_rows()
    kernels = {r["kernel"] for r in rows}
    assert {"Algorithm 1 order (kv-outer)", "FlashAttention-2 order (ch 4 rung 2)",
            "dropout forward p=0.1", "dropout backward p=0.1"} <= kernels
    assert all(r["ms"] > 0 and r["tflops"] > 0 for r in rows)
    for r in rows:                                  # the bench's model bytes are the closed form
        if r["kernel"].endswith("order (kv-outer)") or r["kernel"].endswith("(ch 4 rung 2)"):
            c = hbm_elements(r["N"], r["N"], r["d"], 64, 64, r["extra"]["order"])
            assert r["model"] == 4 * r["B"] * r["H"] * (c["read"] + c["written"])
    dram = {r["kernel"].replace(" (Nsight Compute)", ""): r for r in th.read_dram("io_theory_dram.csv")}
    kv, q = dram["Algorithm 1 order (kv-outer)"], dram["FlashAttention-2 order (ch 4 rung 2)"]
    assert kv["dram_write"] > 4 * kv["compulsory"] > 4 * q["dram"]     # Algorithm 1's write-backs reach HBM


def test_chapter_rows_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="io_theory.csv"):
        th.chapter_rows(tmp_path)
