"""Chapter 9, part 1: attention as the gradient of an energy, and a napkin model of a decode
step spread over p devices. NumPy float64 only: nothing here needs a GPU.

The energy (one query q (d,), keys K (N, d), values V (N, d_v), scale s)

    F(zeta, q) = log sum_a exp(s q.k_a + zeta.v_a)          (a scalar; zeta (d_v,) a "source")

Write x_a = s q.k_a + zeta.v_a and P_a = exp(x_a - F) (a softmax: P >= 0, sum P = 1). Then

    dF/dzeta       = sum_a P_a v_a                           at zeta = 0: softmax(s q K^T) V = O
    dF/dq          = s sum_a P_a k_a                         = s softmax(s q K^T) K
    d2F/dzeta2     = sum_a P_a v_a v_a^T - O O^T             the covariance of v under P
    F(0, q)        = logsumexp(s q K^T) = L                  the L every flash kernel saves

so attention's output is a gradient, and its L is the energy itself. The sum over a runs
over the keys; cut them into shards (any cut, empty shards allowed) and

    F(union of shards) = log sum_shards exp F_shard          (logaddexp of the shards' F)

which is chapter 3's merge: the state (m, l) = (F_s, 1) of each shard merged with
``kernels.online_softmax.merge`` (any order, any tree shape), and with O carried along it is
the decode chapter's ``merge_partials_numpy``. A device that holds a shard of the KV cache
computes (O_s, F_s) alone; only the merge needs the others: that is Tree Attention
(arXiv 2408.04093, Algorithm 3), and the napkin model at the end of this module says what
the merge costs across devices against passing the KV shards around a ring.

Edge cases, as in the rest of the course: a shard with no key (N = 0, or every key masked)
has F = -inf, O = 0 and a zero Hessian, never NaN; large logits are safe (the max is
subtracted before exp).

Exercises (no GPU; checked against central differences in float64): ``check_grad_zeta``,
``check_merge``, ``check_hessian_zeta`` take the learner's function and print "passed" or
the smallest failing case.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from kernels.decode import merge_partials_numpy
from kernels.online_softmax import IDENTITY, logsumexp_of, merge

__all__ = [
    # the energy
    "energy", "energy_weights", "energy_grad_zeta", "energy_grad_q", "energy_hessian_zeta", "attention_from_energy",
    "shard_energy", "merge_energies", "merge_shards", "cuts_to_ranges",
    # checking derivatives
    "central_difference", "difference_tolerance", "grad_zeta_tolerance", "grad_q_tolerance", "hessian_tolerance",
    # exercises
    "EnergyCase", "energy_cases", "check_grad_zeta_case", "check_merge_case", "check_hessian_zeta_case",
    "check_grad_zeta", "check_merge", "check_hessian_zeta",
    # the napkin model
    "Link", "Cluster", "DecodeShape", "H100_DGX", "PAPER_SHAPE", "LLAMA_31_8B", "PAPER_CLAIMS",
    "kv_bytes", "allreduce_time", "fixed_cost_for_ratio", "tree_step", "ring_step", "decode_model", "napkin_table", "plot_decode_model",
]

EPS = np.finfo(np.float64).eps


# =========================================================================== the energy

def _inputs(q, k, v, zeta, scale, mask):
    """float64 arrays, shapes checked: q (d,), k (N, d), v (N, d_v), zeta (d_v,), mask (N,) bool."""
    q = np.asarray(q, np.float64)
    k = np.asarray(k, np.float64)
    v = np.asarray(v, np.float64)
    if q.ndim != 1:
        raise ValueError(f"q: expected one query of shape (d,), got shape {q.shape}")
    d = q.shape[0]
    if k.ndim != 2 or k.shape[1] != d:
        raise ValueError(f"k: expected shape (N, {d}), got {k.shape}")
    if v.ndim != 2 or v.shape[0] != k.shape[0]:
        raise ValueError(f"v: expected shape ({k.shape[0]}, d_v), got {v.shape}")
    zeta = np.zeros(v.shape[1]) if zeta is None else np.asarray(zeta, np.float64)
    if zeta.shape != (v.shape[1],):
        raise ValueError(f"zeta: expected shape ({v.shape[1]},), got {zeta.shape}")
    if scale is None:
        scale = 1.0 / math.sqrt(d) if d else 1.0
    if not np.isfinite(scale):
        raise ValueError(f"scale: expected a finite number, got {scale}")
    if mask is not None:
        mask = np.asarray(mask)
        if mask.dtype != np.bool_ or mask.shape != (k.shape[0],):
            raise ValueError(f"mask: expected a bool array of shape ({k.shape[0]},), got {mask.dtype} {mask.shape}")
    return q, k, v, zeta, float(scale), mask


def _logits(q, k, v, zeta, scale, mask):
    """x_a = s q.k_a + zeta.v_a, -inf where a key is masked."""
    x = scale * (k @ q) + v @ zeta
    return x if mask is None else np.where(mask, x, -np.inf)


def _logsumexp(x):
    """log sum exp x, the max subtracted first; -inf when x is empty or all -inf."""
    if x.size == 0:
        return -np.inf
    m = np.max(x)
    if m == -np.inf:
        return -np.inf
    return m + np.log(np.sum(np.exp(x - m)))


def energy(q, k, v, zeta=None, scale=None, *, mask=None):
    """F(zeta, q) = log sum_a exp(s q.k_a + zeta.v_a). -inf when no key is seen."""
    q, k, v, zeta, scale, mask = _inputs(q, k, v, zeta, scale, mask)
    return float(_logsumexp(_logits(q, k, v, zeta, scale, mask)))


def energy_weights(q, k, v, zeta=None, scale=None, *, mask=None):
    """P_a = exp(x_a - F): the softmax the derivatives average over (zeros when no key is seen)."""
    q, k, v, zeta, scale, mask = _inputs(q, k, v, zeta, scale, mask)
    x = _logits(q, k, v, zeta, scale, mask)
    f = _logsumexp(x)
    return np.zeros_like(x) if f == -np.inf else np.exp(x - f)


def energy_grad_zeta(q, k, v, zeta=None, scale=None, *, mask=None):
    """dF/dzeta = sum_a P_a v_a: at zeta = 0, attention's output O = softmax(s q K^T) V."""
    return energy_weights(q, k, v, zeta, scale, mask=mask) @ np.asarray(v, np.float64)


def energy_grad_q(q, k, v, zeta=None, scale=None, *, mask=None):
    """dF/dq = s sum_a P_a k_a (= s softmax(s q K^T) K at zeta = 0)."""
    q, k, v, zeta, scale, mask = _inputs(q, k, v, zeta, scale, mask)
    return scale * (energy_weights(q, k, v, zeta, scale, mask=mask) @ k)


def energy_hessian_zeta(q, k, v, zeta=None, scale=None, *, mask=None):
    """d2F/dzeta2 = sum_a P_a v_a v_a^T - O O^T: the covariance of v under P (PSD)."""
    p = energy_weights(q, k, v, zeta, scale, mask=mask)
    v = np.asarray(v, np.float64)
    o = p @ v
    return (v * p[:, None]).T @ v - np.outer(o, o)


def attention_from_energy(q, k, v, scale=None, *, mask=None):
    """(O, L) of one query: the gradient of F at zeta = 0, and F itself."""
    return energy_grad_zeta(q, k, v, None, scale, mask=mask), energy(q, k, v, None, scale, mask=mask)


# --------------------------------------------------------------------------- shards and their merge

def cuts_to_ranges(cuts, n):
    """Key ranges [start, end) of the shards between cut points: cuts (sorted, in 0..n) split
    0..n into len(cuts) + 1 shards; repeated cuts give empty shards."""
    cuts = [int(c) for c in cuts]
    if any(c < 0 or c > n for c in cuts) or cuts != sorted(cuts):
        raise ValueError(f"cuts: expected sorted positions in 0..{n}, got {cuts}")
    edges = [0, *cuts, n]
    return list(zip(edges[:-1], edges[1:]))


def shard_energy(q, k, v, ranges, zeta=None, scale=None, *, mask=None):
    """Each shard's (F_s, dF_s/dzeta): what one device computes from its own keys.
    ranges: [(start, end), ...] key ranges (``cuts_to_ranges``). Returns F (S,), O (S, d_v)."""
    q, k, v, zeta, scale, mask = _inputs(q, k, v, zeta, scale, mask)
    f = np.empty(len(ranges))
    o = np.zeros((len(ranges), v.shape[1]))
    for s, (a, b) in enumerate(ranges):
        m = None if mask is None else mask[a:b]
        f[s] = energy(q, k[a:b], v[a:b], zeta, scale, mask=m)
        o[s] = energy_grad_zeta(q, k[a:b], v[a:b], zeta, scale, mask=m)
    return f, o


def merge_energies(f_parts, *, order="tree"):
    """F of the union of shards from the shards' F: log sum_s exp F_s, through chapter 3's
    merge of the states (m, l) = (F_s, 1) (an empty shard, F_s = -inf, is the identity).

    order="flat": one shard after the other; "tree": pairs, then pairs of pairs (log2 S levels,
    as a tree all-reduce does across devices). The merge is associative: both give the same F
    up to rounding."""
    f_parts = np.asarray(f_parts, np.float64).ravel()
    states = [IDENTITY if f == -np.inf else (f, 1.0) for f in f_parts]
    if order == "flat":
        acc = IDENTITY
        for st in states:
            acc = merge(acc, st)
    elif order == "tree":
        while len(states) > 1:
            pairs = [merge(states[i], states[i + 1]) for i in range(0, len(states) - 1, 2)]
            states = pairs + ([states[-1]] if len(states) % 2 else [])
        acc = states[0] if states else IDENTITY
    else:
        raise ValueError(f"order: expected 'tree' or 'flat', got {order!r}")
    return float(logsumexp_of(acc))


def merge_shards(o_parts, f_parts):
    """(O, F) of the union from the shards' (O_s, F_s): the decode chapter's merge of partials,
    O = sum_s exp(F_s - F) O_s. The tree all-reduce of Algorithm 3 computes exactly this."""
    o, f = merge_partials_numpy(np.asarray(o_parts, np.float64), np.asarray(f_parts, np.float64))
    return o, float(f)


# =========================================================================== checking derivatives

def central_difference(f, x, h=1e-5):
    """(f(x + h e_j) - f(x - h e_j)) / 2h for each coordinate j of the vector x.

    f scalar-valued: the gradient, shape x.shape. f vector-valued (shape (m,)): the Jacobian,
    shape (m, x.size), column j the derivative along x_j (of a gradient: the Hessian).
    Error: h^2/6 |f'''| (truncation) plus about eps |f| / h (rounding). Where f is the same
    on both sides (-inf: no key seen) the difference is 0, the course's convention there."""
    x = np.asarray(x, np.float64)
    cols = []
    for j in range(x.size):
        e = np.zeros_like(x)
        e.flat[j] = h
        up, down = np.asarray(f(x + e), np.float64), np.asarray(f(x - e), np.float64)
        with np.errstate(invalid="ignore"):
            cols.append(np.where(up == down, 0.0, (up - down) / (2 * h)))   # F = -inf on both sides: 0
    if not cols:
        return np.zeros(x.shape) if np.ndim(f(x)) == 0 else np.zeros((np.size(f(x)), 0))
    return np.array(cols) if np.ndim(cols[0]) == 0 else np.stack(cols, axis=-1)


def difference_tolerance(h, third, size):
    """What a central difference with step h may be off by: h^2/6 * |third derivative| + the
    rounding of two evaluations of size ``size`` (a few eps * size each) divided by 2h."""
    return h * h / 6.0 * third + 16 * EPS * size / h


def _range(a):
    return float(np.ptp(a, axis=0).max()) if a.size else 0.0


def _logit_size(q, k, v, zeta, scale):
    """Magnitude of the logits (bounds F and the rounding of exp(x - F))."""
    x = scale * (np.asarray(k) @ np.asarray(q)) + np.asarray(v) @ zeta if len(k) else np.zeros(1)
    return float(np.abs(x).max()) + math.log(len(k) + 1) + 1.0


def grad_zeta_tolerance(q, k, v, zeta, scale, h):
    """Bound on |central difference of F in zeta - dF/dzeta|: the third derivative along zeta_i
    is the third central moment of v_i under P, at most R^3 / 4 (R: the range of v_i)."""
    return difference_tolerance(h, _range(np.asarray(v)) ** 3 / 4, _logit_size(q, k, v, zeta, scale))


def grad_q_tolerance(q, k, v, zeta, scale, h):
    """The same along q_i: the logits move by s k_ai, so R = |s| * range of k_i."""
    return difference_tolerance(h, (abs(scale) * _range(np.asarray(k))) ** 3 / 4, _logit_size(q, k, v, zeta, scale))


def hessian_tolerance(q, k, v, zeta, scale, h):
    """For the Hessian as the central difference of the gradient: the second derivative of
    O_i along zeta_j is a third mixed moment, at most R_v^3 / 4; O is rounded at about
    eps * (logit size) * max |v| (exp(x - F) is rounded relative to the size of x)."""
    v = np.asarray(v)
    vmax = float(np.abs(v).max()) if v.size else 0.0
    return difference_tolerance(h, _range(v) ** 3 / 4, _logit_size(q, k, v, zeta, scale) * (vmax + 1.0))


# =========================================================================== exercises

@dataclass(frozen=True)
class EnergyCase:
    """One drawn case: q (d,), k (N, d), v (N, d_v), scale; a cut of the keys into two shards
    (k[:cut], k[cut:], either may be empty); a level added to every logit (F moves by it)."""
    q: np.ndarray = field(repr=False)
    k: np.ndarray = field(repr=False)
    v: np.ndarray = field(repr=False)
    scale: float
    cut: int
    level: float = 0.0
    seed: int = 0

    def __repr__(self):
        n, d = self.k.shape
        x = self.scale * (self.k @ self.q)
        big = float(np.abs(x).max()) if n else 0.0
        return (f"EnergyCase(N={n}, d={d}, d_v={self.v.shape[1]}, scale={self.scale:.4g}, max|s q.k|={big:.3g}, "
                f"cut={self.cut}, level={self.level:g}, seed={self.seed})")


def energy_cases(max_n=40, max_d=16, *, levels=(0.0,)):
    """Hypothesis strategy of ``EnergyCase``: N 0..max_n, d and d_v 1..max_d, scale 1/sqrt(d)
    or drawn, the largest logit |s q.k| about 1, 10 or 80 (q rescaled), a cut anywhere in
    0..N, a level from ``levels``."""
    from hypothesis import strategies as st

    @st.composite
    def cases(draw):
        n = draw(st.integers(0, max_n))
        d = draw(st.integers(1, max_d))
        dv = draw(st.integers(1, max_d))
        scale = draw(st.sampled_from([1.0 / math.sqrt(d), 0.3, 2.5]))
        big = draw(st.sampled_from([1.0, 10.0, 80.0]))
        seed = draw(st.integers(0, 2**32 - 1))
        rng = np.random.default_rng(seed)
        q, k, v = rng.standard_normal(d), rng.standard_normal((n, d)), rng.standard_normal((n, dv))
        top = np.abs(scale * (k @ q)).max() if n else 0.0
        if top > 0:
            q = q * (big / top)
        return EnergyCase(q, k, v, scale, draw(st.integers(0, n)), draw(st.sampled_from(levels)), seed)
    return cases()


def _close(got, want, tol, what):
    got = np.asarray(got, np.float64)
    assert got.shape == np.shape(want), f"{what}: shape {got.shape}, expected {np.shape(want)}"
    assert np.all(np.isfinite(got)), f"{what}: not finite: {got}"
    err = float(np.abs(got - want).max()) if got.size else 0.0
    assert err <= tol, f"{what}: off by {err:.3g} (tolerance {tol:.3g}) from the central difference"


def check_grad_zeta_case(fn, case, h=1e-5):
    """The property: fn(q, k, v, scale) (dF/dzeta at zeta = 0, shape (d_v,)) agrees with the
    central difference of ``energy`` in zeta, within ``grad_zeta_tolerance``."""
    q, k, v, s = case.q, case.k, case.v, case.scale
    zero = np.zeros(v.shape[1])
    want = central_difference(lambda z: energy(q, k, v, z, s), zero, h)
    with np.errstate(all="ignore"):
        got = fn(q.copy(), k.copy(), v.copy(), s)
    _close(got, want, grad_zeta_tolerance(q, k, v, zero, s, h), "dF/dzeta")


def check_hessian_zeta_case(fn, case, h=1e-5):
    """The property: fn(q, k, v, scale) (d2F/dzeta2 at zeta = 0, (d_v, d_v)) agrees with the
    central difference of dF/dzeta (``energy_grad_zeta``) within ``hessian_tolerance``."""
    q, k, v, s = case.q, case.k, case.v, case.scale
    zero = np.zeros(v.shape[1])
    want = central_difference(lambda z: energy_grad_zeta(q, k, v, z, s), zero, h)
    with np.errstate(all="ignore"):
        got = fn(q.copy(), k.copy(), v.copy(), s)
    _close(got, want, hessian_tolerance(q, k, v, zero, s, h), "d2F/dzeta2")


def check_merge_case(fn, case):
    """The property: fn(F_1, F_2) of two shards' energies (either may be -inf: an empty shard)
    is the energy of their union, F_1 and F_2 shifted by the case's level (up to 1e3: a merge
    that forms exp(F) overflows)."""
    q, k, v, s, c = case.q, case.k, case.v, case.scale, case.cut
    f1 = energy(q, k[:c], v[:c], None, s) + case.level
    f2 = energy(q, k[c:], v[c:], None, s) + case.level
    want = energy(q, k, v, None, s) + case.level
    with np.errstate(all="ignore"):
        got = float(fn(f1, f2))
    if want == -np.inf:
        assert got == -np.inf, f"merge of two empty shards: {got}, expected -inf"
        return
    assert np.isfinite(got), f"merge({f1!r}, {f2!r}) = {got}, expected {want!r}"
    # F's own rounding, plus that of the logits s q.k: the shards' products and the whole's
    # may round differently (BLAS picks its kernel by size), each by up to d eps sum |s q_i k_i|
    logit_err = q.size * EPS * float(np.max(np.abs(s * k) @ np.abs(q))) if len(k) else 0.0
    tol = 8 * EPS * (abs(want) + 1.0) + 2 * logit_err
    assert abs(got - want) <= tol, f"merge({f1!r}, {f2!r}) = {got!r}, expected {want!r} (tolerance {tol:.3g})"


def _check(prop, fn, strategy, max_examples):
    from kernels.base.testing import check_exercise

    return check_exercise(lambda case: prop(fn, case), strategy, host=True, max_examples=max_examples)


def check_grad_zeta(fn, max_examples=None):
    """Exercise: write dF/dzeta at zeta = 0, ``fn(q, k, v, scale) -> (d_v,)``. Prints "passed"
    or the smallest failing case."""
    return _check(check_grad_zeta_case, fn, energy_cases(), max_examples)


def check_hessian_zeta(fn, max_examples=None):
    """Exercise (optional): write d2F/dzeta2 at zeta = 0, ``fn(q, k, v, scale) -> (d_v, d_v)``."""
    return _check(check_hessian_zeta_case, fn, energy_cases(max_d=8), max_examples)


def check_merge(fn, max_examples=None):
    """Exercise: write the merge of two shards' energies, ``fn(f1, f2) -> F`` (floats, -inf for
    an empty shard)."""
    return _check(check_merge_case, fn, energy_cases(levels=(0.0, 1000.0, -1000.0)), max_examples)


# =========================================================================== the napkin model
# One decode step (one new token per sequence) of attention over a context of N tokens whose KV
# cache is cut into p shards, one a GPU. Two ways to get the exact answer:
#
#   tree (Algorithm 3)  each GPU attends over its N/p keys (reads N/p tokens of KV from HBM),
#                       then all-reduce MAX of L, SUM of exp(L_s - m) O_s, SUM of exp(L_s - m):
#                       3 collectives of b n_h (d_h + 2) elements in all, independent of N.
#   ring (the paper's   the query is on every GPU; the KV shards travel around the ring: p
#   baseline)           steps, each attending over the shard in hand and passing it on (p - 1
#                       hops of a whole shard, 2 b (N/p) n_kv d_h elements). Every GPU reads
#                       all N tokens and receives (p - 1)/p of the whole cache.
#
# Times are napkin sums: bytes / bandwidth + a latency per message (alpha). Figures:
#   HBM       2.96 TB/s: chapter 7's measured read bandwidth on this course's H100 SXM
#             (torch.sum over 4 GiB, workbook/results/decode.csv; README, chapter 7; the
#             decode kernels reach 2.8-3.1 TB/s at 128k), against 3.35 TB/s nominal.
#   NVLink 4  450 GB/s a direction a GPU (900 GB/s bidirectional, H100 SXM data sheet); alpha
#             3 us (an assumption: NCCL's small-message latency within a node is a few us).
#   network   InfiniBand NDR, one 400 Gb/s port a GPU (DGX H100): 50 GB/s a direction; alpha
#             10 us (an assumption: across nodes, about 10 us a message).
#   launch    5 us a kernel (an assumption; chapter 7's smallest decode steps took 48 us
#             against a 23 us byte floor).
# All-reduce: a tree (recursive doubling) takes ceil(log2 p) latency steps, log2 of the GPUs in a
# node on NVLink and log2 of the nodes on the network; a ring all-reduce 2 (p - 1) steps on
# the slowest link. Either moves 2 (p - 1)/p of the message a GPU (the formula).
# Partials travel in float32 (4 bytes an element).

@dataclass(frozen=True)
class Link:
    bytes_per_s: float
    alpha_s: float


@dataclass(frozen=True)
class Cluster:
    name: str
    hbm_bytes_per_s: float
    nvlink: Link
    network: Link
    gpus_per_node: int = 8
    launch_s: float = 5e-6

    def ring_link(self, p):
        """The slowest link a ring of p GPUs crosses: NVLink within a node, the network beyond."""
        return self.nvlink if p <= self.gpus_per_node else self.network


H100_DGX = Cluster("H100 SXM DGX nodes (HBM 2.96 TB/s measured, NVLink 4, IB NDR 400 Gb/s a GPU)",
                   hbm_bytes_per_s=2.96e12, nvlink=Link(450e9, 3e-6), network=Link(50e9, 10e-6))


@dataclass(frozen=True)
class DecodeShape:
    """A decode step: batch b, n_h query heads (n_kv KV heads), head dim d_h, KV dtype bytes,
    layers (each with its own attention and all-reduce), and rest_bytes: what else a GPU reads
    from HBM each step (the weights, when every GPU holds them all)."""
    batch: int = 1
    heads: int = 16
    head_dim: int = 128
    kv_heads: int | None = None
    dtype_bytes: int = 2
    layers: int = 1
    rest_bytes: float = 0.0
    partial_bytes: int = 4
    name: str = ""

    @property
    def n_kv(self):
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def bytes_per_token(self):
        """K and V of one token, every layer: 2 b n_kv d_h dtype_bytes layers."""
        return 2 * self.batch * self.n_kv * self.head_dim * self.dtype_bytes * self.layers


# The reference code's benchmark (Zyphra/tree_attention, tree_shard_test.py): B = 1, 16 heads of
# 128 (hidden 2048), fp16, one layer, non-causal.
PAPER_SHAPE = DecodeShape(batch=1, heads=16, head_dim=128, dtype_bytes=2, name="1 layer, 16 heads x 128, fp16")
# Llama-3.1-8B: 32 layers, 32 query heads, 8 KV heads of 128, bf16; 8.03e9 parameters = 16.06 GB
# of weights read every step (each GPU holding all of them: sequence parallelism only).
LLAMA_31_8B = DecodeShape(batch=1, heads=32, head_dim=128, kv_heads=8, dtype_bytes=2, layers=32,
                          rest_bytes=16.06e9, name="Llama-3.1-8B, bf16, weights on every GPU")

PAPER_CLAIMS = (
    dict(p=128, n=5_120_000, speedup=8.0, shape=PAPER_SHAPE,
         what="up to 8x over Ring Attention, 128 H100s (16 DGX nodes), 5.12M tokens"),
    dict(p=8, n=None, speedup=(2.0, 4.0), shape=LLAMA_31_8B,
         what="2-4x over Ring Attention, Llama-3.1-8B decode, 8 H100s (one node)"),
)


def kv_bytes(shape, n_tokens):
    """Bytes of K and V for n_tokens tokens."""
    return shape.bytes_per_token * n_tokens


def _check_model(p, n):
    if int(p) != p or p < 1:
        raise ValueError(f"p: expected a whole number of devices >= 1, got {p}")
    if n < 0:
        raise ValueError(f"n: expected a context length >= 0, got {n}")


def allreduce_time(message_bytes, p, cluster, algorithm="tree"):
    """Napkin time of one all-reduce of message_bytes over p GPUs (latency + bandwidth)."""
    if p == 1:
        return 0.0
    g = min(p, cluster.gpus_per_node)
    nodes = math.ceil(p / cluster.gpus_per_node)
    slow = cluster.ring_link(p)
    moved = 2 * (p - 1) / p * message_bytes                  # bytes a GPU sends (and receives)
    if algorithm == "tree":
        latency = math.ceil(math.log2(g)) * cluster.nvlink.alpha_s + math.ceil(math.log2(nodes)) * cluster.network.alpha_s
    elif algorithm == "ring":
        latency = 2 * (p - 1) * slow.alpha_s
    else:
        raise ValueError(f"algorithm: expected 'tree' or 'ring', got {algorithm!r}")
    return latency + moved / slow.bytes_per_s


def tree_step(shape, n, p, cluster=H100_DGX, *, allreduce="tree"):
    """Tree Attention's decode step: attend over N/p tokens, then 3 all-reduces a layer
    (MAX of b n_h L's, SUM of b n_h d_h numerators, SUM of b n_h denominators)."""
    _check_model(p, n)
    compute = kv_bytes(shape, n / p) / cluster.hbm_bytes_per_s + shape.layers * cluster.launch_s
    elems = (shape.batch * shape.heads, shape.batch * shape.heads * shape.head_dim, shape.batch * shape.heads)
    comm = shape.layers * sum(allreduce_time(e * shape.partial_bytes, p, cluster, allreduce) for e in elems)
    rest = shape.rest_bytes / cluster.hbm_bytes_per_s
    sent = shape.layers * 2 * (p - 1) / p * sum(elems) * shape.partial_bytes
    return dict(compute_s=compute, comm_s=comm, rest_s=rest, total_s=compute + comm + rest,
                bytes_sent_per_gpu=sent, elements_per_gpu=sent / shape.partial_bytes)


def ring_step(shape, n, p, cluster=H100_DGX, *, overlap=False):
    """Ring Attention's decode step: p steps, each attending over the shard in hand (N/p tokens
    from HBM) and passing it on (p - 1 hops of the whole shard over the ring's slowest link).
    overlap=False: each hop waits for the attention (the paper's baseline runs the hops in a
    lax.scan whose own comment calls their overlap with the kernel "unreliable");
    overlap=True: a hop hides behind the attention of the shard in hand."""
    _check_model(p, n)
    shard = kv_bytes(shape, n / p)
    att = shard / cluster.hbm_bytes_per_s + shape.layers * cluster.launch_s   # one shard, every layer
    link = cluster.ring_link(p)
    hop = (shard / link.bytes_per_s + shape.layers * link.alpha_s) if p > 1 else 0.0
    if overlap:
        core = att + (p - 1) * max(att, hop)
    else:
        core = p * att + (p - 1) * hop
    rest = shape.rest_bytes / cluster.hbm_bytes_per_s
    return dict(compute_s=p * att, comm_s=(p - 1) * hop, rest_s=rest, total_s=core + rest,
                bytes_sent_per_gpu=(p - 1) * shard, elements_per_gpu=(p - 1) * shard / shape.dtype_bytes)


def decode_model(shape, n, p, cluster=H100_DGX, *, overlap=False, allreduce="tree"):
    """Both steps and the ratio ring / tree (how many times faster the tree is)."""
    tree = tree_step(shape, n, p, cluster, allreduce=allreduce)
    ring = ring_step(shape, n, p, cluster, overlap=overlap)
    return dict(tree=tree, ring=ring, ratio=ring["total_s"] / tree["total_s"])


def fixed_cost_for_ratio(tree_s, ring_s, ratio):
    """The cost c, the same on both sides (dispatch, synchronisation, a timer around more than
    the step), that would squeeze the napkin ratio ring_s / tree_s to a measured ``ratio``:
    (ring_s + c) / (tree_s + c) = ratio."""
    if not ratio > 1:
        raise ValueError(f"ratio: expected a measured speedup > 1, got {ratio}")
    return max((ring_s - ratio * tree_s) / (ratio - 1), 0.0)


def napkin_table(shape=PAPER_SHAPE, ps=(8, 128), ns=(131072, 5_120_000), cluster=H100_DGX, *, report=print):
    """The model's numbers at a few (p, N), one line each; returns the rows."""
    rows = []
    for p in ps:
        for n in ns:
            m = decode_model(shape, n, p, cluster)
            mo = decode_model(shape, n, p, cluster, overlap=True)
            t, r = m["tree"], m["ring"]
            rows.append(dict(p=p, n=n, tree_ms=t["total_s"] * 1e3, tree_compute_ms=t["compute_s"] * 1e3,
                             tree_comm_ms=t["comm_s"] * 1e3, tree_bytes=t["bytes_sent_per_gpu"],
                             ring_ms=r["total_s"] * 1e3, ring_comm_ms=r["comm_s"] * 1e3,
                             ring_bytes=r["bytes_sent_per_gpu"], ratio=m["ratio"], ratio_overlapped=mo["ratio"]))
            report(f"p={p:4d} N={n:>9,d}: tree {t['total_s'] * 1e3:9.3f} ms (attention {t['compute_s'] * 1e3:.3f}, "
                   f"all-reduce {t['comm_s'] * 1e3:.3f}, {t['bytes_sent_per_gpu'] / 1e3:.1f} kB a GPU) | "
                   f"ring {r['total_s'] * 1e3:10.2f} ms ({r['bytes_sent_per_gpu'] / 1e9:.2f} GB a GPU) | "
                   f"ring/tree {m['ratio']:7.1f}x ({mo['ratio']:.1f}x overlapped)")
    return rows


def plot_decode_model(cluster=H100_DGX, *, fig=None):
    """Three panels: time a step vs N (p = 8 and 128, one layer of the paper's shape), the
    ratio ring / tree vs p, and Llama-3.1-8B on 8 GPUs with the paper's 2-4x band."""
    import matplotlib.pyplot as plt

    fig = fig or plt.figure(figsize=(15, 4.6))
    axes = fig.subplots(1, 3)
    ns = np.unique(np.geomspace(8192, 5_120_000, 60).astype(int))
    ax = axes[0]
    for p, ls in ((8, "-"), (128, "--")):
        for name, step, color in (("tree", tree_step, "C0"), ("ring", ring_step, "C3")):
            ax.loglog(ns, [step(PAPER_SHAPE, n, p, cluster)["total_s"] * 1e3 for n in ns], ls, color=color,
                      label=f"{name}, p = {p}")
    ax.set(xlabel="context N (tokens)", ylabel="ms a decode step (one layer)", title="time a step")
    ax.legend(fontsize=10)
    ax = axes[1]
    ps = [2, 4, 8, 16, 32, 64, 128]
    for n, color in ((131072, "C0"), (1_048_576, "C1"), (5_120_000, "C2")):
        ax.loglog(ps, [decode_model(PAPER_SHAPE, n, p, cluster)["ratio"] for p in ps], "o-", color=color,
                  label=f"N = {n:,}")
        ax.loglog(ps, [decode_model(PAPER_SHAPE, n, p, cluster, overlap=True)["ratio"] for p in ps], ":",
                  color=color)
    ax.plot([128], [8], "k*", ms=14, label="paper: 8x at p = 128, 5.12M")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="GPUs p", ylabel="ring time / tree time", title="napkin speedup (dotted: ring overlapped)")
    ax.legend(fontsize=10, loc="upper left")
    ax = axes[2]
    ns_l = np.unique(np.geomspace(4096, 1_048_576, 50).astype(int))
    ax.semilogx(ns_l, [decode_model(LLAMA_31_8B, n, 8, cluster)["ratio"] for n in ns_l], "C0-",
                label="ring / tree, whole step")
    ax.semilogx(ns_l, [decode_model(replace(LLAMA_31_8B, rest_bytes=0.0), n, 8, cluster)["ratio"] for n in ns_l],
                "C0:", label="attention alone")
    ax.axhspan(2, 4, color="0.85", label="paper: 2-4x")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(plt.FuncFormatter(lambda y, _: f"{y:g}"))
    ax.yaxis.set_minor_formatter(plt.NullFormatter())
    ax.set_yticks([1, 2, 4, 10, 20, 40])
    ax.set(xlabel="context N (tokens)", ylabel="ring time / tree time", title="Llama-3.1-8B, 8 GPUs, one node")
    ax.legend(fontsize=10)
    fig.tight_layout()
    return fig
