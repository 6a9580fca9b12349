"""The course's IO models and measured ceilings (kernels/base/io_model.py): their properties,
and agreement with each chapter module's own ``io_model_bytes`` (imported inside the tests,
so a renamed chapter function fails here by name)."""

import itertools
import math
import shutil

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kernels.base import io_model as io

SHAPES = [(1, 1, 1, 1, 1), (2, 3, 64, 64, 16), (1, 2, 100, 37, 64), (2, 1, 33, 300, 32), (4, 16, 4096, 4096, 64),
          (1, 1, 1000, 1024, 128), (1, 1, 0, 5, 8)]

n_st = st.integers(1, 5000)
d_st = st.sampled_from([16, 32, 64, 96, 128])
tile_st = st.sampled_from([16, 32, 64, 128, 256])


# --------------------------------------------------------------------------- properties

@given(n=n_st, d=d_st, bc=tile_st)
def test_fused_forward_falls_with_br_down_to_the_compulsory_bytes(n, d, bc):
    brs = [16, 32, 64, 128, 256, 512, 1024, 8192]
    traffic = [io.fused_forward_bytes(1, 1, n, n, d, Br=br, Bc=bc) for br in brs]
    assert all(a >= b for a, b in zip(traffic, traffic[1:]))
    compulsory = io.compulsory_forward_bytes(1, 1, n, n, d)
    assert min(traffic) >= compulsory
    assert io.fused_forward_bytes(1, 1, n, n, d, Br=max(n, 1), Bc=bc) == compulsory
    assert io.fused_forward_elements(n, n, d, Br=max(n, 1), Bc=bc) == io.compulsory_forward_elements(n, n, d)


@given(n=st.integers(2048, 20000), d=d_st, br=st.sampled_from([32, 64, 128]), bc=st.sampled_from([32, 64]))
def test_causal_reads_about_half_the_keys(n, d, br, bc):
    full = io.kv_rows_read(n, n, Br=br, Bc=bc)
    causal = io.kv_rows_read(n, n, Br=br, Bc=bc, causal=True)
    assert 0.5 <= causal / full <= 0.5 + 2 * (br + bc) / n
    assert io.fused_forward_bytes(1, 1, n, n, d, Br=br, Bc=bc, causal=True) < \
        io.fused_forward_bytes(1, 1, n, n, d, Br=br, Bc=bc)
    half = io.fused_backward_bytes(1, 1, n, n, d, Bc=bc, causal=True)
    assert half < io.fused_backward_bytes(1, 1, n, n, d, Bc=bc)


def test_causal_with_more_keys_than_queries_sees_the_extra_keys():
    # bottom-right aligned: with Nk - Nq extra keys every query sees at least those
    assert io.kv_rows_read(64, 1024, Br=64, Bc=64, causal=True) == 1024
    assert io.kv_rows_read(1024, 64, Br=64, Bc=64, causal=True) <= io.kv_rows_read(1024, 64, Br=64, Bc=64)


@given(n=n_st, d=d_st, br=tile_st, bc=tile_st)
def test_block_sparse_at_rho_one_is_the_dense_model(n, d, br, bc):
    assert io.block_sparse_forward_bytes(2, 3, n, n, d, Br=br, rho=1.0) == io.fused_forward_bytes(2, 3, n, n, d, Br=br, Bc=bc)
    assert io.block_sparse_backward_bytes(2, 3, n, n, d, Br=br, Bc=bc, rho=1.0) == \
        io.fused_backward_bytes(2, 3, n, n, d, Bc=bc)
    half = io.block_sparse_forward_bytes(1, 1, n, n, d, Br=br, rho=0.5)
    assert io.compulsory_forward_bytes(1, 1, n, n, d) - 2 * n * d * 4 <= half < \
        io.block_sparse_forward_bytes(1, 1, n, n, d, Br=br, rho=1.0)


@pytest.mark.parametrize("d", [32, 64, 128])
def test_the_standard_paths_n_squared_terms_dominate_at_large_n(d):
    n = 1 << 20
    total = io.standard_forward_bytes(1, 1, n, n, d, itemsize=1)["total"]
    assert 1 <= total / (4 * n * n) < 1.001
    assert 1 <= io.standard_backward_elements(n, d) / (7 * n * n) < 1.001
    extra = io.standard_forward_bytes(1, 1, n, n, d, itemsize=1, extra_passes=2)["total"]
    assert extra - total == 2 * 2 * n * n
    # ... and the fused forward's stream is smaller than them by about 2 Br / d
    fused = io.fused_forward_elements(n, n, d, Br=128)
    assert 0.9 * 2 * 128 / d < total / fused < 1.1 * 2 * 128 / d
    # the backward's: 7 N^2 against the key tiles' stream 4 N^2 d / Bc
    fused = io.fused_backward_elements(n, n, d, Bc=64)
    assert 0.9 * 7 * 64 / (4 * d) < io.standard_backward_elements(n, d) / fused < 1.1 * 7 * 64 / (4 * d)


@given(n=n_st, d=d_st, bc=tile_st, br=tile_st, causal=st.booleans())
def test_fused_backward_is_at_least_compulsory(n, d, bc, br, causal):
    floor = io.compulsory_backward_elements(n, n, d)
    for mode in io.DQ_MODES:
        assert io.fused_backward_elements(n, n, d, Bc=bc, Br=br, dq_mode=mode, causal=causal) >= floor - n


def test_fused_backward_atomic_is_the_table_row_plus_the_clearing_pass():
    for n, d, bc in itertools.product([64, 1000, 4096], [32, 64], [32, 64, 128]):
        row = 6 * n * d + n + math.ceil(n / bc) * (4 * n * d + 2 * n)
        assert io.fused_backward_elements(n, n, d, Bc=bc) == row + n * d


def test_bad_dq_mode_and_missing_br_are_named():
    with pytest.raises(ValueError, match="dq_mode"):
        io.fused_backward_bytes(1, 1, 8, 8, 8, Bc=8, dq_mode="fast")
    with pytest.raises(ValueError, match="Br"):
        io.fused_backward_bytes(1, 1, 8, 8, 8, Bc=8, dq_mode="separate")
    with pytest.raises(ValueError, match="dq_mode"):
        io.block_sparse_backward_bytes(1, 1, 8, 8, 8, Br=8, Bc=8, rho=1, dq_mode="fast")


def test_theorem_2_order_and_the_intensity():
    d = 64
    for m in (16384, 65536, 262144):              # on-chip elements; tiles of M / 4d rows
        br = m // (4 * d)
        ratios = [io.fused_forward_elements(n, n, d, Br=br) / io.theorem2_accesses(n, d, m) for n in (1 << 16, 1 << 18)]
        assert all(7 < r < 9 for r in ratios)     # the K/V stream: 8 N^2 d^2 / M
    assert io.kv_intensity(64) == 32 and io.kv_intensity(128) == 2 * io.kv_intensity(64)
    assert io.kv_intensity(64, itemsize=2) == 2 * io.kv_intensity(64)


def test_the_table_at_one_shape():
    rows = io.elements_per_head(4096, 64, Br=128, Bc=64, rho=0.25)
    assert rows["standard forward"] > rows["fused forward"] > rows["block-sparse forward"] > rows["fused forward, compulsory"]
    assert rows["standard backward"] > rows["fused backward (atomic dQ)"] > rows["fused backward, compulsory"]


# --------------------------------------------------------------------------- the ceilings

def test_ceilings_are_quoted_from_the_committed_results():
    c = io.ceilings()
    assert c.device and c.driver and c.device != "?"
    for value in (c.fp32_tflops, c.fp32_tflops_4096, c.memcpy_gbps, c.copy_kernel_gbps):
        assert math.isfinite(value) and value > 0
    assert c.copy_kernel_gbps <= c.memcpy_gbps * 1.5
    assert io.ridge_point(c) == pytest.approx(c.fp32_tflops * 1e3 / c.memcpy_gbps)
    assert 1 < io.ridge_point() < 1000


def test_ceilings_follow_the_csv_and_name_what_is_missing(tmp_path):
    for name in ("gpu_basics.csv", "tiled_matmul.csv"):
        shutil.copy(io.RESULTS_DIR / name, tmp_path / name)
    text = (tmp_path / "gpu_basics.csv").read_text()
    sgemm = [line for line in text.splitlines() if "cuBLAS sgemm" in line][0]
    fields = sgemm.split(",")
    tflops_col = 8                                   # chapter,kernel,config,median,p10,p90,flops,bytes,tflops
    doubled = ",".join(fields[:tflops_col] + [str(2 * float(fields[tflops_col]))] + fields[tflops_col + 1:])
    (tmp_path / "gpu_basics.csv").write_text(text.replace(sgemm, doubled))
    assert io.ceilings(tmp_path).fp32_tflops == pytest.approx(2 * io.ceilings().fp32_tflops)
    (tmp_path / "gpu_basics.csv").write_text(text.replace(sgemm + "\n", ""))
    with pytest.raises(ValueError, match="cuBLAS"):
        io.ceilings(tmp_path)
    (tmp_path / "gpu_basics.csv").write_text(text)
    (tmp_path / "tiled_matmul.csv").unlink()
    with pytest.raises(FileNotFoundError, match="tiled_matmul"):
        io.ceilings(tmp_path)


# --------------------------------------------------------------------------- the chapters delegate

def test_chapter_1_model_is_the_standard_forward():
    from kernels.naive_attention import io_model_bytes, io_model_elements

    for b, h, nq, nk, d in SHAPES:
        assert io_model_elements(nq, nk, d) == io.standard_forward_elements(nq, nk, d)
        for size in (2, 4):
            assert io_model_bytes(b, h, nq, nk, d, bytes_per_element=size) == \
                io.standard_forward_bytes(b, h, nq, nk, d, itemsize=size)


def test_chapter_4_model_is_the_fused_forward():
    from kernels.flash_forward import io_model_bytes

    for (b, h, nq, nk, d), br, bc, causal, size in itertools.product(SHAPES, [16, 64, 256], [32, 64], [False, True], [2, 4]):
        assert io_model_bytes(b, h, nq, nk, d, Br=br, Bc=bc, causal=causal, in_bytes=size) == \
            io.fused_forward_bytes(b, h, nq, nk, d, Br=br, Bc=bc, causal=causal, itemsize=size)


def test_chapter_5_model_is_the_fused_backward():
    import inspect

    from kernels.flash_backward import default_tiles, io_model_bytes, standard_backward_bytes

    takes_kept = "kept" in inspect.signature(io_model_bytes).parameters
    for (b, h, nq, nk, d), mode, causal in itertools.product(SHAPES, io.DQ_MODES, [False, True]):
        if d not in (16, 32, 64, 128):
            continue
        t = default_tiles(d)
        # the dK/dV kernel's key tile and the dQ kernel's query tile (named Bc, dq_Br; before: block_k, dq_block_q)
        bc, br = getattr(t, "Bc", None) or t.block_k, getattr(t, "dq_Br", None) or t.dq_block_q
        assert io_model_bytes(b, h, nq, nk, d, dq_mode=mode, causal=causal) == \
            io.fused_backward_bytes(b, h, nq, nk, d, Bc=bc, Br=br, dq_mode=mode, causal=causal)
        if takes_kept:
            assert io_model_bytes(b, h, nq, nk, d, dq_mode=mode, kept=0.3) == \
                io.fused_backward_bytes(b, h, nq, nk, d, Bc=bc, Br=br, dq_mode=mode, kept=0.3)
    for b, h, n, _, d in SHAPES:
        assert standard_backward_bytes(b, h, n, d) == io.standard_backward_bytes(b, h, n, d)


def test_chapter_6_models_are_the_block_sparse_ones():
    from kernels.block_sparse import io_model_bytes as forward
    from kernels.block_sparse_backward import io_model_bytes as backward

    for (b, h, nq, nk, d), br, bc, rho in itertools.product(SHAPES, [32, 64], [32, 64], [0.0, 0.125, 0.5, 1.0]):
        assert forward(b, h, nq, nk, d, Br=br, rho=rho) == io.block_sparse_forward_bytes(b, h, nq, nk, d, Br=br, rho=rho)
        for mode in io.DQ_MODES:
            assert backward(b, h, nq, nk, d, Br=br, Bc=bc, rho=rho, dq_mode=mode) == \
                io.block_sparse_backward_bytes(b, h, nq, nk, d, Br=br, Bc=bc, rho=rho, dq_mode=mode)
