"""Block-sparsity patterns for chapter 6: each function returns a ``BlockMask``.

A pattern decides, tile by tile, which (query tile r, key tile c) pairs are computed.
Every function takes the sequence lengths and the block size and returns flags of shape
(Tq, Tk) = (ceil(Nq / block), ceil(Nk / block)) shared by all heads, or (H, Tq, Tk) where
a pattern takes ``heads``. Tile coordinates are compared on the bottom-right aligned
diagonal (key tile c is "at" query tile r when c = r + (Tk - Tq)), the same convention as
causal masking, so every pattern keeps the diagonal for Nq != Nk too.

sliding_window    local attention: |r - c| <= window tiles (Longformer's local band)
global_local      the band plus ``n_global`` global tiles: the first tile rows attend to
                  everything and every row attends to the first tile columns (BigBird /
                  Longformer global tokens)
strided           Sparse Transformer's strided pattern at tile level: the local band plus
                  every ``stride``-th tile behind or ahead, (r - c) % stride == 0
butterfly         the block butterfly the FlashAttention paper uses for its block-sparse
                  runs (from Pixelated Butterfly, Chen, Dao et al. 2022): tile (r, c) is kept
                  when r XOR c is 0 or a power of two, i.e. the union of the supports of the
                  butterfly factor matrices; about log2(T) + 1 tiles a row
random_blocks     each tile kept with probability ``density`` (seeded), diagonal optionally
                  kept so that no row is empty
"""

from __future__ import annotations

import numpy as np

from kernels.base.masks import BlockMask

__all__ = ["sliding_window", "global_local", "strided", "butterfly", "random_blocks", "dense", "PATTERNS"]


def _check(nq, nk, block):
    for name, value in (("nq", nq), ("nk", nk)):
        if not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"{name}: expected an int >= 0, got {value!r}")
    if not isinstance(block, (int, np.integer)) or block < 1:
        raise ValueError(f"block: expected a positive int, got {block!r}")
    tq, tk = -(-nq // block), -(-nk // block)
    # Shift the shorter side so the bottom-right diagonals line up and both stay >= 0:
    # key tile c is on query tile r's diagonal when c - r == 0 in these coordinates.
    shift = tk - tq
    r = np.arange(tq)[:, None] + max(shift, 0)
    c = np.arange(tk)[None, :] + max(-shift, 0)
    return tq, tk, r, c


def _nonneg(name, value):
    if not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{name}: expected an int >= 0, got {value!r}")
    return int(value)


def dense(nq, nk, *, block):
    """Every tile kept (the dense attention, as a block mask)."""
    tq, tk, _, _ = _check(nq, nk, block)
    return BlockMask(np.ones((tq, tk), bool), block, block)


def sliding_window(nq, nk, *, block, window=1):
    """Local attention: query tile r keeps the key tiles within ``window`` tiles of its diagonal."""
    window = _nonneg("window", window)
    tq, tk, r, c = _check(nq, nk, block)
    return BlockMask(np.abs(r - c) <= window, block, block)


def global_local(nq, nk, *, block, window=1, n_global=1):
    """The local band plus global tiles: the first ``n_global`` query tiles see every key
    tile, and every query tile sees the first ``n_global`` key tiles."""
    window = _nonneg("window", window)
    n_global = _nonneg("n_global", n_global)
    tq, tk, r, c = _check(nq, nk, block)
    rows, cols = np.arange(tq)[:, None], np.arange(tk)[None, :]
    flags = (np.abs(r - c) <= window) | (rows < n_global) | (cols < n_global)
    return BlockMask(np.broadcast_to(flags, (tq, tk)).copy(), block, block)


def strided(nq, nk, *, block, stride=4, window=0):
    """Sparse Transformer's strided pattern, by tiles: keep (r, c) when (r - c) is a
    multiple of ``stride`` or |r - c| <= ``window``."""
    window = _nonneg("window", window)
    if not isinstance(stride, (int, np.integer)) or stride < 1:
        raise ValueError(f"stride: expected a positive int, got {stride!r}")
    tq, tk, r, c = _check(nq, nk, block)
    return BlockMask(((r - c) % stride == 0) | (np.abs(r - c) <= window), block, block)


def butterfly(nq, nk, *, block):
    """Block butterfly: keep (r, c) when r XOR c is 0 or a power of two (in coordinates
    whose bottom-right diagonals line up when Nq != Nk)."""
    tq, tk, r, c = _check(nq, nk, block)
    x = np.bitwise_xor(r, c)
    flags = (x & (x - 1)) == 0  # 0 or a power of two
    return BlockMask(flags, block, block)


def random_blocks(nq, nk, *, block, density=0.25, seed=0, keep_diagonal=True, heads=None):
    """Each tile kept with probability ``density``, seeded; ``heads``: one mask per head
    (flags (H, Tq, Tk)); ``keep_diagonal``: the diagonal tiles are always kept."""
    if not 0.0 <= float(density) <= 1.0:
        raise ValueError(f"density: expected a number in [0, 1], got {density!r}")
    tq, tk, r, c = _check(nq, nk, block)
    rng = np.random.default_rng(seed)
    shape = (tq, tk) if heads is None else (_nonneg("heads", heads), tq, tk)
    flags = rng.random(shape) < density
    if keep_diagonal:
        flags |= (r == c)
    return BlockMask(flags, block, block)


# name -> function of (nq, nk, block): the patterns the notebook and the bench show.
PATTERNS = {
    "sliding window": lambda nq, nk, block: sliding_window(nq, nk, block=block, window=1),
    "global + local": lambda nq, nk, block: global_local(nq, nk, block=block, window=1, n_global=1),
    "strided": lambda nq, nk, block: strided(nq, nk, block=block, stride=4, window=0),
    "butterfly": lambda nq, nk, block: butterfly(nq, nk, block=block),
    "random 25%": lambda nq, nk, block: random_blocks(nq, nk, block=block, density=0.25, seed=0),
}
