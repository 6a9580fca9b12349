"""Chapter 6: the block-sparsity patterns (NumPy only, no kernels)."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kernels import reference as ref
from kernels import sparsity_patterns as sp

sizes = st.integers(0, 300)
blocks = st.sampled_from((1, 3, 16, 64))


def aligned(nq, nk, block):
    """Tile coordinates with the bottom-right diagonals lined up: (r, c) on it when r == c."""
    tq, tk = -(-nq // block), -(-nk // block)
    r = np.arange(tq)[:, None] + max(tk - tq, 0)
    c = np.arange(tk)[None, :] + max(tq - tk, 0)
    return tq, tk, r, c


@given(sizes, sizes, blocks)
def test_every_pattern_is_a_block_mask_of_the_right_shape(nq, nk, block):
    tq, tk = -(-nq // block), -(-nk // block)
    for name, make in sp.PATTERNS.items():
        mask = make(nq, nk, block)
        assert isinstance(mask, ref.BlockMask), name
        assert mask.flags.shape == (tq, tk) and mask.flags.dtype == np.bool_, name
        assert (mask.block_q, mask.block_k) == (block, block), name
        # the diagonal (bottom-right aligned) is kept: causal rows are never empty
        _, _, r, c = aligned(nq, nk, block)
        assert mask.flags[np.broadcast_to(r == c, (tq, tk))].all(), name


@given(sizes, sizes, blocks, st.integers(0, 5))
def test_sliding_window_is_a_band(nq, nk, block, window):
    tq, tk, r, c = aligned(nq, nk, block)
    flags = sp.sliding_window(nq, nk, block=block, window=window).flags
    assert np.array_equal(flags, np.broadcast_to(np.abs(r - c) <= window, (tq, tk)))


@given(sizes, sizes, blocks, st.integers(0, 3), st.integers(0, 3))
def test_global_local_adds_full_rows_and_columns(nq, nk, block, window, n_global):
    flags = sp.global_local(nq, nk, block=block, window=window, n_global=n_global).flags
    band = sp.sliding_window(nq, nk, block=block, window=window).flags
    assert flags[:n_global].all() and flags[:, :n_global].all()
    assert np.array_equal(flags[n_global:, n_global:], band[n_global:, n_global:])


@given(sizes, sizes, blocks, st.integers(1, 6))
def test_strided_keeps_every_stride_th_diagonal(nq, nk, block, stride):
    tq, tk, r, c = aligned(nq, nk, block)
    flags = sp.strided(nq, nk, block=block, stride=stride).flags
    assert np.array_equal(flags, np.broadcast_to((r - c) % stride == 0, (tq, tk)))


def test_butterfly_definition_and_density():
    flags = sp.butterfly(256, 256, block=16).flags  # 16 x 16 tiles
    for i in range(16):
        for j in range(16):
            x = i ^ j
            assert flags[i, j] == (x == 0 or (x & (x - 1)) == 0)
    assert (flags.sum(axis=1) == 5).all()          # log2(16) + 1 tiles a row
    assert np.array_equal(flags, flags.T)


@given(sizes, sizes, blocks, st.floats(0, 1), st.integers(0, 2**32 - 1), st.booleans())
def test_random_blocks_are_seeded(nq, nk, block, density, seed, keep_diagonal):
    a = sp.random_blocks(nq, nk, block=block, density=density, seed=seed, keep_diagonal=keep_diagonal)
    b = sp.random_blocks(nq, nk, block=block, density=density, seed=seed, keep_diagonal=keep_diagonal)
    assert np.array_equal(a.flags, b.flags)
    if density == 1.0:
        assert a.flags.all()


def test_random_blocks_density_and_heads():
    mask = sp.random_blocks(4096, 4096, block=64, density=0.125, seed=1, keep_diagonal=False, heads=3)
    assert mask.flags.shape == (3, 64, 64)
    assert abs(mask.density - 0.125) < 0.01
    assert not np.array_equal(mask.flags[0], mask.flags[1])


def test_bad_arguments_name_them():
    with pytest.raises(ValueError, match="block"):
        sp.sliding_window(8, 8, block=0)
    with pytest.raises(ValueError, match="window"):
        sp.sliding_window(8, 8, block=4, window=-1)
    with pytest.raises(ValueError, match="stride"):
        sp.strided(8, 8, block=4, stride=0)
    with pytest.raises(ValueError, match="density"):
        sp.random_blocks(8, 8, block=4, density=1.5)
    with pytest.raises(ValueError, match="nq"):
        sp.butterfly(-1, 8, block=4)
