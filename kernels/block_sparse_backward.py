"""Chapter 6: block-sparse FlashAttention, the backward pass.

Chapter 5's recomputing backward (``kernels.flash_backward``), walking the kept tiles only.
What is new is the walk: chapter 5's kernel bodies visit the tiles ``tile_of(walk, t)``,
t = first .. first + count - 1, and here, as in the block-sparse forward, ``tile_of`` is
``listed_tile``, which reads the lists of kept tiles built from the block mask
(``kernels.block_sparse.tile_lists``):

* the dK/dV kernel (K/V tiles outer, grid Tc x B*H) owns key tile c and walks the query
  tiles that keep it, the CSC lists of the mask (its transpose):
  ``row_idx[col_ptr[g*Tc + c] : col_ptr[g*Tc + c + 1]]`` in place of ``range(first, Tr)``;
* the separate dQ kernel (Q tiles outer, grid Tr x B*H) owns query tile r and walks the key
  tiles it keeps, the CSR lists: ``col_idx[row_ptr[g*Tr + r] : row_ptr[g*Tr + r + 1]]``;
* blocks take their tile from ``col_order`` / ``row_order``: the longest lists start first,
  so that with uneven lists (global tokens) the last wave of blocks is short.

g = bh % groups is the head's mask (one for all heads, one a head, or one a (batch, head)).
Everything else is chapter 5's: its tiles (fitted to the mask's blocks, below), its D
pre-pass, its register prefetch (the next tile's index is read a step ahead, before the
barriers), its two-level sums, atomic or separate dQ. With every tile kept it is chapter 5's
dense backward. Tiles wholly above the causal diagonal are not in the lists; the diagonal's
tiles, ragged last tiles and rows that see nothing are masked element by element (P = 0,
dS = 0), and a key tile no query keeps gets dK = dV = 0.

Tiles: each kernel's tile must lie inside one mask block, so its Br divides the mask's
block_q and its Bc block_k. By default chapter 5's production tiles shrink to the largest
powers of two that divide (with fewer threads where the smaller tiles need them); the lists
of each kernel are built for its own tiles.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
from numba import cuda, float32, int32

from kernels.base.backward_args import DQ_MODES, allocate_outputs, check_backward_args, device_views, zero_gradients
from kernels.base.backward_tiles import (BackwardTiles, check_tiles, default_tiles, dkdv_layout, dq_layout, fits,
                                    head_dim_bucket)
from kernels.base.fused import ALIGN, FASTMATH
from kernels.base.runtime import ArrayKind, cdiv, check_flag, check_scale
from kernels.base.shared_memory import launch_with_shared
from kernels.block_sparse import TileLists, check_tiles_fit_mask, fit_to_mask, listed_tile, lists_for
from kernels.flash_backward import DKDV_SIG, DQ_SIG, GPU_TILES, launch_delta, make_dkdv_body, make_dq_body, shared_bytes
from kernels.flash_backward import io_model_bytes as dense_io_model_bytes

__all__ = ["block_sparse_attention_backward", "backward_tiles", "backward_lists", "make_listed_dkdv",
           "make_listed_dq", "io_model_bytes", "ptx_targets", "DQ_MODES"]


@functools.lru_cache(maxsize=None)
def make_listed_dkdv(Br: int, Bc: int, Dh: int, NT: int, dynamic: bool = False, atomic_dq: bool = False,
                     merged: bool = False):
    """Chapter 5's dK/dV kernel walking the CSC lists: grid (Tc, B*H), NT threads."""
    body = make_dkdv_body(Br, Bc, Dh, NT, atomic_dq, merged, listed_tile)
    SHARED = 0 if dynamic else dkdv_layout(Br, Bc, Dh, merged)[1]

    @cuda.jit(fastmath=FASTMATH)
    def listed_dkdv(q, k, v, do, lse, delta, dq, dk, dv, col_ptr, row_idx, col_order, groups, nq, nk, scale,
                    causal):
        sm = cuda.shared.array(SHARED, float32, alignment=ALIGN)
        bh = int32(cuda.blockIdx.y)
        g = (bh % groups) * int32(cuda.gridDim.x)                   # this head's lists
        j = col_order[g + int32(cuda.blockIdx.x)]                   # the longest lists first
        first = col_ptr[g + j]
        body(sm, q, k, v, do, lse, delta, dq, dk, dv, nq, nk, scale, causal, bh, j, row_idx, first,
             col_ptr[g + j + 1] - first)

    return listed_dkdv


@functools.lru_cache(maxsize=None)
def make_listed_dq(Br: int, Bc: int, Dh: int, NT: int, dynamic: bool = False):
    """Chapter 5's separate dQ kernel walking the CSR lists: grid (Tr, B*H), NT threads."""
    body = make_dq_body(Br, Bc, Dh, NT, listed_tile)
    SHARED = 0 if dynamic else dq_layout(Br, Bc, Dh)[1]

    @cuda.jit(fastmath=FASTMATH)
    def listed_dq(q, k, v, do, lse, delta, dq, row_ptr, col_idx, row_order, groups, nq, nk, scale, causal):
        sm = cuda.shared.array(SHARED, float32, alignment=ALIGN)
        bh = int32(cuda.blockIdx.y)
        g = (bh % groups) * int32(cuda.gridDim.x)
        i = row_order[g + int32(cuda.blockIdx.x)]
        first = row_ptr[g + i]
        body(sm, q, k, v, do, lse, delta, dq, nq, nk, scale, causal, bh, i, col_idx, first,
             row_ptr[g + i + 1] - first)

    return listed_dq


# --------------------------------------------------------------------------- tiles and lists

def _fewer_threads(tiles: BackwardTiles, Dh: int, dq_mode: str) -> BackwardTiles:
    """Halve each kernel's threads until its (smaller) tiles split evenly over them."""
    for kernel, name in (("dK/dV", "threads"), ("dQ", "dq_threads")):
        while getattr(tiles, name) > 1 and not fits(tiles, Dh, kernel, dq_mode):
            tiles = dataclasses.replace(tiles, **{name: getattr(tiles, name) // 2})
    return check_tiles(tiles, Dh, dq_mode)


def backward_tiles(d: int, block_mask, tiles=None, dq_mode: str = "atomic") -> BackwardTiles:
    """The tiles for head dim d and this mask: ``tiles`` if given (each kernel's Br x Bc must
    divide the mask's blocks: ValueError naming block_mask otherwise), else chapter 5's
    production tiles shrunk to the largest powers of two that divide the blocks."""
    Dh = head_dim_bucket(d)
    if tiles is not None:
        check_tiles(tiles, Dh, dq_mode)
        check_tiles_fit_mask(block_mask, tiles.Br, tiles.Bc, "tiles: Br x Bc")
        if dq_mode == "separate":
            check_tiles_fit_mask(block_mask, tiles.dq_Br, tiles.dq_Bc, "tiles: dq_Br x dq_Bc")
        return tiles
    t = default_tiles(d)
    Br, Bc = fit_to_mask(block_mask, t.Br, t.Bc)
    dq_Br, dq_Bc = fit_to_mask(block_mask, t.dq_Br, t.dq_Bc)
    if (Br, Bc, dq_Br, dq_Bc) == (t.Br, t.Bc, t.dq_Br, t.dq_Bc):
        return check_tiles(t, Dh, dq_mode)
    return _fewer_threads(dataclasses.replace(t, Br=Br, Bc=Bc, dq_Br=dq_Br, dq_Bc=dq_Bc), Dh, dq_mode)


def backward_lists(block_mask, lists, b, h, nq, nk, causal, tiles, dq_mode="atomic"):
    """(dK/dV kernel lists, dQ kernel lists or None): each kernel's lists built for its own
    tiles, or taken from ``lists`` (a TileLists, or several) where one was built for them."""
    given = [] if lists is None else [lists] if isinstance(lists, TileLists) else list(lists)
    wanted = [(tiles.Br, tiles.Bc)] + ([(tiles.dq_Br, tiles.dq_Bc)] if dq_mode == "separate" else [])
    for x in given:
        if not isinstance(x, TileLists) or (x.Br, x.Bc) not in wanted:
            lists_for(block_mask, x, b, h, nq, nk, causal, *wanted[0])     # raises, naming lists
    out = []
    for Br, Bc in wanted:
        match = [x for x in given + out if (x.Br, x.Bc) == (Br, Bc)]
        out.append(lists_for(block_mask, match[0] if match else None, b, h, nq, nk, causal, Br, Bc))
    return out[0], (out[1] if len(out) > 1 else None)


# --------------------------------------------------------------------------- the launcher

def block_sparse_attention_backward(q, k, v, o, lse, do, block_mask, *, causal=False, scale=None, tiles=None,
                                    lists=None, dq_mode="atomic"):
    """Gradients (dq, dk, dv) of block-sparse attention for the upstream gradient ``do``.

    q: (B, H, Nq, d); k, v: (B, H, Nk, d); o, do: (B, H, Nq, d); lse: (B, H, Nq): the
    forward's O and L for the same ``block_mask``, ``causal`` and ``scale``. Rows that see
    nothing (L = -inf) and keys no query sees get zero gradients. ``tiles``: a chapter 5
    ``BackwardTiles`` whose kernel tiles divide the mask's blocks; ``lists``: ``tile_lists``
    built for them (one TileLists, or one a kernel), reused; ``dq_mode``: "atomic" (the
    default; dQ's last bits vary run to run) or "separate" (bitwise reproducible, slower).
    """
    b, h, nq, nk, d = check_backward_args(q, k, v, o, lse, do, dq_mode)
    causal, scale = check_flag(causal, "causal"), check_scale(scale, d)
    tiles = backward_tiles(d, block_mask, tiles, dq_mode)
    dkdv_lists, dq_lists = backward_lists(block_mask, lists, b, h, nq, nk, causal, tiles, dq_mode)
    kind = ArrayKind(q)
    if b * h == 0 or nq == 0 or nk == 0:
        return zero_gradients(kind, (b, h, nq, d), (b, h, nk, d))
    q3, k3, v3, o3, l2, do3 = device_views(q, k, v, o, lse, do)
    bh, Dh, atomic = b * h, head_dim_bucket(d), dq_mode == "atomic"
    delta, dq, dk, dv = allocate_outputs(bh, nq, nk, d, kind)
    n_q, n_k, sc, ca = np.int32(nq), np.int32(nk), np.float32(scale), np.int32(1 if causal else 0)
    launch_delta(o3, do3, delta, dq, nq, Dh, atomic)
    dkdv_bytes, dq_bytes = shared_bytes(tiles, Dh)
    merged, lc = tiles.merged_at(Dh), dkdv_lists.device()
    launch_with_shared(lambda dyn: make_listed_dkdv(tiles.Br, tiles.Bc, Dh, tiles.threads, dyn, atomic, merged),
                       dkdv_bytes, (cdiv(nk, tiles.Bc), bh), tiles.threads,
                       (q3, k3, v3, do3, l2, delta, dq, dk, dv, lc.col_ptr, lc.row_idx, lc.col_order,
                        np.int32(dkdv_lists.groups), n_q, n_k, sc, ca))
    if not atomic:
        lr = dq_lists.device()
        launch_with_shared(lambda dyn: make_listed_dq(tiles.dq_Br, tiles.dq_Bc, Dh, tiles.dq_threads, dyn),
                           dq_bytes, (cdiv(nq, tiles.dq_Br), bh), tiles.dq_threads,
                           (q3, k3, v3, do3, l2, delta, dq, lr.row_ptr, lr.col_idx, lr.row_order,
                            np.int32(dq_lists.groups), n_q, n_k, sc, ca))
    return tuple(kind.give_back(x.reshape(b, h, x.shape[1], d)) for x in (dq, dk, dv))


def io_model_bytes(b, h, nq, nk, d, *, Br, Bc, rho, in_bytes=4, dq_mode="atomic"):
    """HBM bytes by chapter 5's IO model with the streams over the kept tiles only (fraction
    rho): Bc the dK/dV kernel's key tile, Br the separate dQ kernel's query tile."""
    tiles = BackwardTiles(Bc=Bc, dq_Br=Br)
    return dense_io_model_bytes(b, h, nq, nk, d, tiles, dq_mode, itemsize=in_bytes, kept=rho)


# --------------------------------------------------------------------------- PTX targets

_LISTS = "int32[::1], int32[::1], int32[::1], int32"
LISTED_DKDV_SIG = DKDV_SIG.replace("float32[:, :, ::1], int32, int32", f"float32[:, :, ::1], {_LISTS}, int32, int32")
LISTED_DQ_SIG = DQ_SIG.replace("float32[:, :, ::1], int32, int32", f"float32[:, :, ::1], {_LISTS}, int32, int32")


def ptx_targets(every_shape: bool = False):
    """The list-walking kernels at chapter 5's production tiles, both dQ modes, d = 64 and
    128 (``every_shape``: d = 16..128)."""
    targets = []
    for Dh in (16, 32, 64, 128) if every_shape else (64, 128):
        t = GPU_TILES[Dh]
        big = [n > 48 * 1024 for n in shared_bytes(t, Dh)]
        for atomic in (False, True):
            targets.append((f"block-sparse bwd dkdv{' + atomic dQ' if atomic else ''} fp32 Br={t.Br} Bc={t.Bc} "
                            f"t={t.threads} d={Dh}",
                            make_listed_dkdv(t.Br, t.Bc, Dh, t.threads, big[0], atomic, t.merged_at(Dh)),
                            LISTED_DKDV_SIG))
        targets.append((f"block-sparse bwd dq fp32 Br={t.dq_Br} Bc={t.dq_Bc} t={t.dq_threads} d={Dh}",
                        make_listed_dq(t.dq_Br, t.dq_Bc, Dh, t.dq_threads, big[1]), LISTED_DQ_SIG))
    return targets
