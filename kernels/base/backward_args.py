"""The backward's arguments and buffers, shared by chapters 5 and 6 (plumbing, not kernels).

    check_backward_args  q, k, v, o, lse, do and dq_mode checked before any launch (errors
                         name the argument); returns (B, H, Nq, Nk, d)
    check_grouped_args   the same for the tensor-core backwards (grouped-query attention: k
                         and v with Hkv heads); returns (B, H, Hkv, Nq, Nk, d)
    run_grouped_backward what the tensor-core backwards' launchers share after their checks:
                         the gradients allocated, the launches bound once a call shape, run
    device_views         the six arrays on the device as (B*H, N, ...) views
    zero_gradients       (dq, dk, dv) of zeros, when nothing attends to anything
    allocate_outputs     the device buffers (D, dQ, dK, dV) the kernels write
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from kernels.base.fused import MAX_GRID_Y
from kernels.base.runtime import (as_bits16, check_array, check_qkv, device_bits16, device_empty, fill,
                                  is_device_array, run_bound, to_device)

# "atomic": the dK/dV kernel adds its pieces of dQ with float32 atomics (dQ's last bits vary
# from run to run); "separate": a second kernel sums each dQ entry in a fixed order.
DQ_MODES = ("atomic", "separate")


def check_backward_args(q, k, v, o, lse, do, dq_mode):
    """(B, H, Nq, Nk, d) after checking the arrays and dq_mode (errors name the argument)."""
    B, H, nq, nk, d, _ = check_qkv(q, k, v)
    for x, name, shape, what in ((o, "o", (B, H, nq, d), "the forward output, like q"),
                                 (lse, "lse", (B, H, nq), "the forward logsumexp, (B, H, Nq)"),
                                 (do, "do", (B, H, nq, d), "the gradient of o, like q")):
        got, _ = check_array(x, name, ndim=len(shape), dtypes=(np.float32,))
        if tuple(got) != shape:
            raise ValueError(f"{name}: expected shape {shape} ({what}), got {tuple(got)}")
    if not isinstance(dq_mode, str) or dq_mode not in DQ_MODES:
        raise ValueError(f"dq_mode: expected one of {DQ_MODES}, got {dq_mode!r}")
    if B * H > MAX_GRID_Y:
        raise ValueError(f"q: expected B*H <= {MAX_GRID_Y} (one grid row a head), got B={B}, H={H}")
    return B, H, nq, nk, d


def check_grouped_args(q, k, v, o, lse, do, want, o_dtypes):
    """(B, H, Hkv, Nq, Nk, d) after checking q, do (B, H, Nq, d) and k, v (B, Hkv, Nk, d) of
    dtype ``want`` (H a multiple of Hkv, d <= 128), o (B, H, Nq, d) of one of ``o_dtypes``
    and lse (B, H, Nq) float32 (errors name the argument)."""
    B, H, n_q, n_k, d, _ = check_qkv(q, k, v, dtypes=(want,), grouped=True)
    hkv = int(k.shape[1])                          # (k's four dimensions checked just above)
    for x, name, shape, dtypes in ((o, "o", (B, H, n_q, d), o_dtypes),
                                   (lse, "lse", (B, H, n_q), (np.float32,)),
                                   (do, "do", (B, H, n_q, d), (want,))):
        got, _ = check_array(x, name, ndim=len(shape), dtypes=dtypes)
        if tuple(got) != shape:
            raise ValueError(f"{name}: expected shape {shape} (like q), got {tuple(got)}")
    if B * H > MAX_GRID_Y:
        raise ValueError(f"q: expected B*H <= {MAX_GRID_Y} (one grid row a head), got B={B}, H={H}")
    return B, H, hkv, n_q, n_k, d


def device_views(*arrays):
    """q, k, v, o, lse, do as device arrays of (B*H, N, ...) views."""
    names = ("q", "k", "v", "o", "lse", "do")
    return [to_device(x, n).reshape(x.shape[0] * x.shape[1], *x.shape[2:]) for x, n in zip(arrays, names)]


def zero_gradients(kind, q_shape, k_shape):
    """(dq, dk, dv) of zeros (nothing attends to anything), as ``kind`` wants them."""
    shapes = (q_shape, k_shape, k_shape)
    if not kind.on_device:
        return tuple(np.zeros(s, np.float32) for s in shapes)
    return tuple(kind.give_back(cuda.to_device(np.zeros(s, np.float32)) if np.prod(s) else device_empty(s))
                 for s in shapes)


def allocate_outputs(bh: int, nq: int, nk: int, d: int, kind=None):
    """Device buffers (delta, dq, dk, dv) for ``launch`` on (B*H, N, d) views, from the
    caller's allocator when ``kind`` (an ``ArrayKind``) has one."""
    empty = device_empty if kind is None else kind.empty
    return empty((bh, nq)), empty((bh, nq, d)), empty((bh, nk, d)), empty((bh, nk, d))



def run_grouped_backward(kind, arrays: dict, dims, key, cache, make, words: int, scratch=("delta",), out=None):
    """The gradients (dq, dk, dv) of a tensor-core backward whose arguments are checked:
    ``arrays`` q, k, v, o, lse, do as given, ``dims`` (B, H, Hkv, Nq, Nk, d). Allocates dq
    (B, H, Nq, d), dk and dv (B, Hkv, Nk, d) float32 from the caller's allocator (zeros when
    nothing attends to anything, without a launch), finds the call shape's launches in
    ``cache`` (a ``LaunchCache``) under ``key`` + (aligned, device) or binds them by
    ``make(views, aligned)``, and runs them: on the data pointers on a GPU, on device views
    (16-bit inputs as their bits) in the simulator. ``words``: elements a 16-byte chunk, so
    that aligned = d a multiple of it and the rows of q, k, v, dO and dQ 16-byte aligned.
    ``scratch``: the kernels' per-row float32 buffers (B*H, Nq) (D = rowsum(dO o O), ...),
    allocated each call like the gradients: a bound launch shared by calls on two streams
    must not share them. ``out``: (dq, dk, dv) float32 of those shapes to write instead
    (a caller that allocates them in one piece)."""
    B, H, hkv, n_q, n_k, d = dims
    if not (B * H and n_q and n_k):
        if out is not None:
            for g in out:
                fill(g, 0.0)
            return tuple(out)
        return zero_gradients(kind, (B, H, n_q, d), (B, hkv, n_k, d))
    held = {name: x if is_device_array(x) else to_device(x, name) for name, x in arrays.items()}
    if out is None:
        out = (kind.new((B, H, n_q, d)), kind.new((B, hkv, n_k, d)), kind.new((B, hkv, n_k, d)))
    grads = dict(zip(("dq", "dk", "dv"), out))
    rows = dict(zip(scratch, kind.new_parts(len(scratch), (B * H, n_q))))     # the row buffers, one allocation
    run_bound(cache, key, {**held, **grads, **rows}, lambda arrays: grouped_views(arrays, B * H, B * hkv, n_q, n_k, d), make,
              aligned_names=("q", "k", "v", "do", "dq"), aligned_d=d % words == 0)
    return tuple(kind.result(grads[n]) for n in ("dq", "dk", "dv"))


def grouped_views(arrays: dict, bh: int, bkv: int, n_q: int, n_k: int, d: int) -> dict:
    """Numba device views of a call's arrays in the kernels' shapes ((B*H, Nq, d), ...), 16-bit
    inputs as their bits (uint16)."""
    shapes = dict(q=(bh, n_q, d), do=(bh, n_q, d), o=(bh, n_q, d), lse=(bh, n_q), k=(bkv, n_k, d),
                  v=(bkv, n_k, d), dq=(bh, n_q, d), dk=(bkv, n_k, d), dv=(bkv, n_k, d), delta=(bh, n_q),
                  l2=(bh, n_q))
    return {name: device_bits16(as_bits16(x), name).reshape(*shapes[name]) for name, x in arrays.items()}
