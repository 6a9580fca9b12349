"""The oracle: plain, obviously-correct NumPy for everything the course computes.

Every kernel in the course is tested against these functions and nothing else.
They compute in float64 by default; ``dtype=np.float32`` computes the same thing
plainly in float32, which the tests use as the yardstick for "how much error is
float32 arithmetic allowed to make here" (see ``kernels/base/testing.py``).

Conventions, written once here:

* Shapes are (B, H, N, d), row-major, like PyTorch's SDPA. ``q`` is (B, H, Nq, d),
  ``k`` and ``v`` are (B, H, Nk, d); the logsumexp ``lse`` is (B, H, Nq).
* ``scale`` defaults to 1/sqrt(d).
* Causal masking is bottom-right aligned (FlashAttention >= 2.1): query i may attend
  to key j iff ``j <= i + (Nk - Nq)``. With Nq = Nk this is the usual lower triangle.
* A query row that may attend to nothing gets O = 0 and L = -inf (never NaN), and
  zero gradients.
* A NaN or Inf in an input gives NaN (or Inf) in the outputs its arithmetic reaches, as
  PyTorch's math does: a query row only its own row; a key or value row every row whose
  product touches it (here that includes masked rows: 0 * NaN is NaN in ``P @ V``).
  In softmax and logsumexp a row with a NaN or +inf is NaN throughout (x - max meets
  inf - inf); -inf is a masked entry, and a row of all -inf gives zeros and L = -inf.
* Decode (``decode_attention``): the keys of sequence b are its first ``cache_lengths[b]``
  cached rows (what lies beyond is not an input); query head h reads KV head
  h // (Hq / Hkv) (grouped-query attention); causal masking is the rule above with
  Nk = that sequence's cache length.
* A block mask carries its own block size (``BlockMask``): flag [..., r, c] keeps the
  tile of queries [r*block_q, (r+1)*block_q) and keys [c*block_k, (c+1)*block_k).
"""

from __future__ import annotations

import numpy as np

from kernels.base.masks import BlockMask

__all__ = [
    "BlockMask",
    "matmul",
    "softmax",
    "logsumexp",
    "causal_mask",
    "expand_block_mask",
    "attention_mask",
    "attention",
    "attention_backward",
    "decode_attention",
]


def matmul(a, b, *, dtype=np.float64):
    """C = A @ B."""
    return np.asarray(a, dtype=dtype) @ np.asarray(b, dtype=dtype)


def logsumexp(x, axis=-1, *, dtype=np.float64):
    """log(sum(exp(x))) along ``axis``, safely: -inf for an all -inf row, NaN for a row with
    a NaN or +inf (m + log(sum(exp(x - m))) with m = +inf meets inf - inf, as a kernel does)."""
    x = np.asarray(x, dtype=dtype)
    if x.shape[axis] == 0:  # nothing to sum: log(0)
        return np.full(np.delete(x.shape, axis % x.ndim), -np.inf, dtype=dtype)
    m = np.max(x, axis=axis, keepdims=True)
    m_safe = np.where(m == -np.inf, 0, m)  # only an all -inf row is shifted by 0
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.log(np.sum(np.exp(x - m_safe), axis=axis, keepdims=True)) + m_safe
    return np.squeeze(out, axis=axis)


def softmax(x, axis=-1, *, dtype=np.float64):
    """Safe softmax: subtract the row max before exp. A row of all -inf gives zeros; a row
    with a NaN or +inf gives NaN (as PyTorch does)."""
    x = np.asarray(x, dtype=dtype)
    if x.size == 0:
        return x.copy()
    m = np.max(x, axis=axis, keepdims=True)
    m_safe = np.where(m == -np.inf, 0, m)  # a NaN or +inf max stays: x - m is NaN somewhere
    with np.errstate(invalid="ignore"):
        e = np.exp(x - m_safe)
        total = np.sum(e, axis=axis, keepdims=True)
        # 0 / 0 only for a row of all -inf (zeros); a NaN (or +inf) makes the whole row NaN
        return np.divide(e, total, out=np.zeros_like(e), where=total != 0)


def causal_mask(nq: int, nk: int) -> np.ndarray:
    """(Nq, Nk) booleans, True where query i may attend key j: j <= i + (Nk - Nq)."""
    i = np.arange(nq)[:, None]
    j = np.arange(nk)[None, :]
    return j <= i + (nk - nq)


def expand_block_mask(block_mask: BlockMask, nq: int, nk: int) -> np.ndarray:
    """Expand tile flags to one boolean per score: (..., Nq, Nk)."""
    tq, tk = block_mask.tiles_for(nq, nk)
    flags = block_mask.flags
    if flags.shape[-2:] != (tq, tk):
        raise ValueError(
            f"block_mask: expected {tq} x {tk} tiles for Nq={nq}, Nk={nk} with blocks "
            f"{block_mask.block_q} x {block_mask.block_k}, got {flags.shape[-2:]}"
        )
    rows = np.arange(nq) // block_mask.block_q
    cols = np.arange(nk) // block_mask.block_k
    return flags[..., rows[:, None], cols[None, :]]


def attention_mask(nq: int, nk: int, *, causal=False, block_mask: BlockMask | None = None):
    """The boolean "may attend" mask, broadcastable to (B, H, Nq, Nk); None if all allowed."""
    mask = causal_mask(nq, nk) if causal else None
    if block_mask is not None:
        expanded = expand_block_mask(block_mask, nq, nk)
        mask = expanded if mask is None else (expanded & mask)
    return mask


def _scores(q, k, scale, mask, dtype):
    s = np.asarray(scale, dtype=dtype) * (q @ np.swapaxes(k, -1, -2))
    if mask is not None:
        s = np.where(mask, s, -np.inf)
    return s


def _default_scale(d):
    return 1.0 / np.sqrt(d) if d > 0 else 1.0


def attention(q, k, v, causal=False, scale=None, block_mask=None, *, dtype=np.float64):
    """Standard attention. Returns (O, L): O = softmax(scale * Q K^T + mask) V, L = logsumexp.

    A row with nothing to attend to gets O = 0 and L = -inf.
    """
    q, k, v = (np.asarray(t, dtype=dtype) for t in (q, k, v))
    nq, nk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = _default_scale(d) if scale is None else scale
    mask = attention_mask(nq, nk, causal=causal, block_mask=block_mask)
    s = _scores(q, k, scale, mask, dtype)
    lse = logsumexp(s, axis=-1, dtype=dtype)
    p = softmax(s, axis=-1, dtype=dtype)
    return p @ v, lse


def attention_backward(q, k, v, o, lse, do, causal=False, scale=None, block_mask=None, *, dtype=np.float64):
    """The closed-form gradients (dQ, dK, dV) of attention for an upstream gradient dO.

    P is rebuilt from Q, K and the saved L, exactly as the FlashAttention backward does:
      P  = exp(S - L)           (0 where masked, and 0 on rows with L = -inf)
      dV = P^T dO
      dP = dO V^T
      D  = rowsum(dO * O)       (= rowsum(P * dP))
      dS = P * (dP - D)
      dQ = scale * dS K,   dK = scale * dS^T Q
    """
    q, k, v, o, lse, do = (np.asarray(t, dtype=dtype) for t in (q, k, v, o, lse, do))
    nq, nk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = _default_scale(d) if scale is None else scale
    mask = attention_mask(nq, nk, causal=causal, block_mask=block_mask)
    s = _scores(q, k, scale, mask, dtype)
    # P is 0 where the mask hides a key and on rows that see nothing (L = -inf); anywhere
    # else it is exp(S - L), so a NaN or Inf in S or L stays NaN (as PyTorch's would).
    visible = np.ones(s.shape, bool) if mask is None else np.broadcast_to(mask, s.shape)
    live = visible & (lse != -np.inf)[..., None]
    with np.errstate(invalid="ignore", over="ignore"):
        p = np.where(live, np.exp(np.where(live, s - lse[..., None], 0)), 0)
    dv = np.swapaxes(p, -1, -2) @ do
    dp = do @ np.swapaxes(v, -1, -2)
    D = np.sum(do * o, axis=-1, keepdims=True)
    ds = p * (dp - D)
    dq = np.asarray(scale, dtype=dtype) * (ds @ k)
    dk = np.asarray(scale, dtype=dtype) * (np.swapaxes(ds, -1, -2) @ q)
    return dq, dk, dv


def decode_attention(q, k, v, cache_lengths=None, causal=False, scale=None, *, dtype=np.float64):
    """Attention of a few new queries against a KV cache. Returns (O, L) like ``attention``.

    q (B, Hq, Nq, d); k and v (B, Hkv, Nmax, d) with Hkv dividing Hq: query head h reads
    KV head h // (Hq // Hkv). ``cache_lengths`` (B,): sequence b's keys are rows
    [0, cache_lengths[b]) of its cache (None: all Nmax). Causal: query i of Nq sees key j
    iff j <= i + cache_lengths[b] - Nq.
    """
    q, k, v = (np.asarray(t, dtype=dtype) for t in (q, k, v))
    B, hq, nq, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    lengths = np.full(B, k.shape[2]) if cache_lengths is None else np.asarray(cache_lengths)
    o = np.zeros(q.shape, dtype)
    lse = np.full((B, hq, nq), -np.inf, dtype)
    for b in range(B):
        n = int(lengths[b])
        kb = np.repeat(k[b, :, :n], group, axis=0)      # KV head of each query head
        vb = np.repeat(v[b, :, :n], group, axis=0)
        o[b], lse[b] = attention(q[b], kb, vb, causal=causal, scale=scale, dtype=dtype)
    return o, lse
