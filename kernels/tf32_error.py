"""Chapter 11, part 1: what a tensor core's TF32 product costs in accuracy, and how three of
them give fp32 back. NumPy only (float64 where it stands for exact arithmetic): no GPU.

TF32 keeps float32's 8 exponent bits and 10 of its 23 mantissa bits (11 significant bits
with the implicit one). ``cvt.rna.tf32.f32`` rounds to nearest, ties away from zero; the
result is a float32 whose low 13 bits are zero. With x in [2^e, 2^(e+1)) the spacing of
tf32 values there is 2^(e-10), so

    x_hi = tf32(x)                 |x - x_hi| <= 2^(e-11) <= 2^-11 |x|
    x_lo = tf32(x - x_hi)          x - x_hi is exact in float32 (at most 12 significant
                                   bits, in units of x's float32 ulp 2^(e-23)); rounding it
                                   to 11 bits errs by at most one such unit:
                                   |x - x_hi - x_lo| <= 2^(e-23) <= 2^-23 |x|

(valid for 2^-103 <= |x| < (2 - 2^-11) 2^127: below, x - x_hi lands where tf32 has
subnormal spacing; above, x_hi rounds to infinity). A product of two tf32 values has at
most 22 significant bits: exact in float32, and a tensor core forms it exactly. Expand

    a b = (a_hi + a_lo + da)(b_hi + b_lo + db)
        = a_hi b_hi                         ~ |a||b|            1xTF32 keeps this
        + a_hi b_lo + a_lo b_hi             ~ 2^-11 |a||b| each  3xTF32 keeps these too
        + a_lo b_lo                         ~ 2^-22 |a||b|       dropped
        + da b + (a_hi + a_lo) db           ~ 2^-23 |a||b| each  dropped (the split's own error)

so one TF32 product errs by up to 2^-10 of |a||b| (2^-11 from each operand), and three
(hi hi + hi lo + lo hi) by at most 2^-21 + 2^-46: below what accumulating in float32
costs anyway (one rounding, 2^-24, per addition). ``product_bound`` adds the two.

The accumulation model (``product``). ``mma.sync.m16n8k8`` adds 8 exact products to the
fp32 accumulator C per instruction and rounds the result to float32. The model forms each
k-step's 8 products exactly (float64: 22-bit products, sums of 8 exact to 2^-53 relative)
and rounds acc + sum to float32 once per instruction: per k-step of 8, one rounding per
pass, small passes first (a_lo b_hi, a_hi b_lo, then a_hi b_hi: the order of the course's
kernel, ``kernels/flash_tf32.py``). This is the ideal instruction; real tensor cores align
and truncate inside the adder in ways the PTX ISA does not specify, so the model predicts
the size of the error, not its bits (the chapter's kernel is checked by its own tests);
``accumulate="rz"`` rounds toward zero instead, the behaviour measured on earlier tensor
cores (Fasi et al. 2021; Ootomo and Yokota 2022).
The simulator's emulation of ``mma_tf32`` computes exactly this (float64, rounded once).

``attention_tf32`` runs attention with both products through ``product`` (softmax in
float32), and ``attention_check`` measures it against the float64 oracle with the course's
tolerance rule (``kernels.base.testing.assert_close``, as chapter 4's tests use it).

Exercise (no GPU): ``check_split_tf32(fn)`` takes the learner's ``split_tf32`` and prints
"passed" or the smallest failing case.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kernels.base.mma import SPLIT_LO, TF32_MASK, check_split_lo, tf32_bits

__all__ = [
    "TF32_MANTISSA", "U", "PASSES", "PASS_TERMS", "TERM_ERROR", "MMA_K",
    "to_tf32", "truncate_tf32", "SPLIT_LO", "split_tf32", "product", "product_bound", "error_terms", "dot_errors",
    "draw_error_terms", "draw_dot_errors",
    "attention_tf32", "attention_error", "attention_check",
    "SplitCase", "split_cases", "check_split_tf32_case", "check_split_tf32",
]

TF32_MANTISSA = 10                      # explicit mantissa bits (float32: 23)
LOW_BITS = 23 - TF32_MANTISSA           # the 13 low bits a tf32 value has zero
U = 2.0 ** -24                          # float32's unit roundoff
MMA_K = 8                               # m16n8k8: 8 products a k-step
PASSES = (1, 2, 3, "fp32")

# The products a pass count keeps, small first (the order the accumulator sees them).
PASS_TERMS = {1: (("hi", "hi"),),
              2: (("hi", "lo"), ("hi", "hi")),
              3: (("lo", "hi"), ("hi", "lo"), ("hi", "hi"))}

# What a pass count drops, relative to |a||b| (module docstring; |a_lo| <= 2^-11 |a|,
# |da| <= 2^-23 |a|):
#   1: a b - a_hi b_hi = (a - a_hi) b + a_hi (b - b_hi)             <= 2^-11 + 2^-11 (1 + 2^-11)
#   2: a b - a_hi (b_hi + b_lo) = (a - a_hi) b + a_hi db           <= 2^-11 + 2^-23 (1 + 2^-11)
#   3: a_lo b_lo + da b + (a - da) db                              <= 2^-22 + 2^-23 + 2^-23 (1 + 2^-23)
TERM_ERROR = {1: 2.0 ** -10 + 2.0 ** -22,
              2: 2.0 ** -11 + 2.0 ** -23 + 2.0 ** -34,
              3: 2.0 ** -21 + 2.0 ** -46,
              "fp32": 0.0}


# =========================================================================== rounding to tf32

def _float32(x, name):
    """x as a float32 array; TypeError naming ``name`` for anything else (a float64 array
    would be rounded twice on its way to tf32: first to float32, then to tf32)."""
    arr = np.asarray(x)
    if arr.dtype != np.float32:
        raise TypeError(f"{name}: expected float32 values (np.float32 scalar or array), got dtype {arr.dtype}; "
                        f"convert with np.float32(...) / .astype(np.float32) first")
    return arr


def to_tf32(x) -> np.ndarray:
    """x (float32) rounded to tf32 as ``cvt.rna.tf32.f32`` does: to nearest, ties away from
    zero, low 13 mantissa bits zero; +-inf and NaN kept; values that round past the largest
    tf32 become +-inf. A float32 array of x's shape.

    ``kernels.base.mma.tf32_bits`` does the rounding on the bit pattern: adding 2^12 to the
    magnitude bits carries into bit 13 exactly when the low 13 bits are >= 2^12 (half a tf32
    spacing: ties go up in magnitude, i.e. away from zero), then the low bits are cleared."""
    x = _float32(x, "x")
    return tf32_bits(x).view(np.float32).reshape(x.shape)


def truncate_tf32(x) -> np.ndarray:
    """x (float32) with its 13 low mantissa bits cleared: the tf32 value a tensor core
    multiplies when a register holds x's float32 bits (it reads the top 19; ``tests/test_mma.py``
    checks that on the GPU)."""
    x = _float32(x, "x")
    return (x.view(np.uint32) & np.uint32(TF32_MASK)).view(np.float32).reshape(x.shape)


def split_tf32(x, lo: str = "rounded") -> tuple[np.ndarray, np.ndarray]:
    """(x_hi, x_lo), float32 tf32 values with x_hi = tf32(x), x_lo = tf32(x - x_hi):
    |x - x_hi - x_lo| <= 2^-23 |x| for 2^-103 <= |x| < (2 - 2^-11) 2^127 (module docstring).
    ``lo="truncated"``: x_lo = x - x_hi truncated to tf32 (``truncate_tf32``), what the mma
    multiplies where a kernel leaves x - x_hi unrounded (chapter 11's backward): x - x_hi is
    at most 2^12 of x's float32 ulps, so tf32's 11 significant bits drop at most its last bit,
    and a single dropped bit is 0 or a tie: |x - x_hi - x_lo| is the same either way."""
    x = _float32(x, "x")
    check_split_lo(lo)
    hi = to_tf32(x)
    with np.errstate(invalid="ignore"):
        rest = (x - hi).astype(np.float32)              # x - hi is exact in float32
    return hi, (to_tf32(rest) if lo == "rounded" else truncate_tf32(rest))


# =========================================================================== the product

def _check_pair(a, b):
    a, b = _float32(a, "a"), _float32(b, "b")
    if a.ndim < 2:
        raise ValueError(f"a: expected a matrix (..., M, K), got shape {a.shape}")
    if b.ndim < 2:
        raise ValueError(f"b: expected a matrix (..., K, N), got shape {b.shape}")
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"b: expected {a.shape[-1]} rows (a has shape {a.shape}), got shape {b.shape}")
    return a, b


def _check_passes(passes):
    if passes not in PASSES or isinstance(passes, bool):
        raise ValueError(f"passes: expected one of 1, 2, 3 (TF32 products a product) or 'fp32', got {passes!r}")
    return passes


def _to_float32(x, accumulate):
    """float64 -> float32, to nearest ("rn") or toward zero ("rz")."""
    y = x.astype(np.float32)
    if accumulate == "rz":
        past = np.abs(y.astype(np.float64)) > np.abs(x)
        y = np.where(past, np.nextafter(y, np.float32(0)), y).astype(np.float32)
    return y


def product(a, b, passes=3, *, accumulate="rn") -> np.ndarray:
    """a @ b (float32 (..., M, K) @ (..., K, N)) as the tensor cores compute it, float32.

    passes = 1: a_hi b_hi (plain TF32); 2: + a_hi b_lo; 3: + a_lo b_hi (3xTF32);
    "fp32": plain float32 NumPy (no tensor core). Tensor-core passes follow the model of
    the module docstring: per k-step of 8, one float32 rounding per pass, small passes
    first, each pass's 8 products exact. ``accumulate="rz"`` rounds the accumulator toward
    zero instead of to nearest (what measurements of tensor cores have found their adders
    to do: an error of up to one ulp a rounding, always the same way)."""
    a, b = _check_pair(a, b)
    passes = _check_passes(passes)
    if accumulate not in ("rn", "rz"):
        raise ValueError(f"accumulate: expected 'rn' (to nearest) or 'rz' (toward zero), got {accumulate!r}")
    if passes == "fp32":
        return np.matmul(a, b)
    parts_a, parts_b = dict(zip(("hi", "lo"), split_tf32(a))), dict(zip(("hi", "lo"), split_tf32(b)))
    parts_a = {k: v.astype(np.float64) for k, v in parts_a.items()}
    parts_b = {k: v.astype(np.float64) for k, v in parts_b.items()}
    kk = a.shape[-1]
    shape = np.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1])
    acc = np.zeros(shape, np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        for k0 in range(0, kk, MMA_K):
            step = slice(k0, min(k0 + MMA_K, kk))
            for pa, pb in PASS_TERMS[passes]:
                # one mma: D = A B + C, the 8 products exact, D rounded to float32 once
                acc = _to_float32(acc.astype(np.float64) + parts_a[pa][..., :, step] @ parts_b[pb][..., step, :],
                                  accumulate)
    return acc


def product_bound(a, b, passes=3, *, accumulate="rn") -> np.ndarray:
    """A bound on |product(a, b, passes) - a b| (exact), element by element, float64:

        (TERM_ERROR[passes] + R U) (1 + 2^-8) (|a| @ |b|)

    TERM_ERROR: what the kept products miss of each a_k b_k (module docstring); R U: the R =
    passes ceil(K / 8) float32 roundings of the accumulator, each at most U of the running
    sum, itself at most (1 + 2^-9) |a| @ |b| (|a_hi| <= (1 + 2^-11) |a|); the factor covers
    that and the second-order terms. For passes = "fp32": K U (1 + 2^-8) |a| @ |b|, the
    worst case of K float32 products summed in any order (gamma_K). Valid where every |a|, |b| is 0 or within
    [2^-103, 2^127] (the split's range). ``accumulate="rz"``: 2 U a rounding (a whole ulp)."""
    a, b = _check_pair(a, b)
    passes = _check_passes(passes)
    kk = a.shape[-1]
    size = np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64))
    if passes == "fp32":
        return kk * U * (1 + 2.0 ** -8) * size
    rounds = passes * -(-kk // MMA_K)
    per_rounding = 2 * U if accumulate == "rz" else U
    return (TERM_ERROR[passes] + rounds * per_rounding) * (1 + 2.0 ** -8) * size


# =========================================================================== the terms, drawn

def error_terms(a, b) -> dict[str, np.ndarray]:
    """The four terms of (a_hi + a_lo)(b_hi + b_lo) and what the split itself misses
    (a b - (a_hi + a_lo)(b_hi + b_lo)), each relative to |a||b|, element by element
    (float32 a and b of one shape; float64 results; NaN where a b = 0)."""
    a, b = _float32(a, "a"), _float32(b, "b")
    if a.shape != b.shape:
        raise ValueError(f"b: expected the shape of a {a.shape}, got {b.shape}")
    (ah, al), (bh, bl) = ((t.astype(np.float64) for t in split_tf32(x)) for x in (a, b))
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    size = np.abs(a64 * b64)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = lambda t: np.where(size > 0, np.abs(t) / size, np.nan)
        return {"a_hi b_hi": rel(ah * bh), "a_hi b_lo": rel(ah * bl), "a_lo b_hi": rel(al * bh),
                "a_lo b_lo": rel(al * bl), "split residual": rel(a64 * b64 - (ah + al) * (bh + bl))}


def _log2(x, floor=-40.0):
    with np.errstate(divide="ignore"):
        return np.maximum(np.log2(x), floor)


def draw_error_terms(ax, n=20000, seed=0):
    """Histogram of log2(|term| / |a||b|) of each term of (a_hi + a_lo)(b_hi + b_lo) for n
    normal a, b; lines at 2^-11 (what 1xTF32 loses per operand), 2^-22, and U = 2^-24."""
    rng = np.random.default_rng(seed)
    a, b = (rng.standard_normal(n).astype(np.float32) for _ in range(2))
    terms = error_terms(a, b)
    bins = np.arange(-40.5, 1.5, 0.5)
    for (name, t), color in zip(terms.items(), ("C0", "C1", "C2", "C3", "C7")):
        ax.hist(_log2(t[np.isfinite(t)]), bins=bins, histtype="step", lw=1.6, color=color, label=name)
    for x, what in ((-11, "2^-11"), (-22, "2^-22"), (-24, "U = 2^-24")):
        ax.axvline(x, color="k", ls=":", lw=1)
        ax.text(x + 0.3, 0.97, what, fontsize=8, rotation=90, va="top", transform=ax.get_xaxis_transform())
    ax.set_xlabel("log2(|term| / |a||b|)   (-40: the term is zero)")
    ax.set_ylabel(f"count of {n} products")
    ax.set_title("(a_hi + a_lo)(b_hi + b_lo): the four terms")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(0.08, 1.0))
    return ax


def dot_errors(d=64, trials=4000, seed=0) -> dict[str, np.ndarray]:
    """|c - a.b| / (|a|.|b|) of ``trials`` dot products of length d (normal a, b, float32)
    for fp32 and 1, 2, 3 TF32 passes, against float64. {name: (trials,) float64}."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((trials, 1, d)).astype(np.float32)
    b = rng.standard_normal((trials, d, 1)).astype(np.float32)
    exact = (a.astype(np.float64) @ b.astype(np.float64))[:, 0, 0]
    size = (np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64)))[:, 0, 0]
    names = {"fp32": "fp32", 1: "1xTF32", 2: "2xTF32", 3: "3xTF32"}
    return {names[p]: np.abs(product(a, b, p)[:, 0, 0] - exact) / size for p in ("fp32", 1, 2, 3)}


def draw_dot_errors(ax, d=64, trials=4000, seed=0):
    """Histogram of log2 of the relative error (``dot_errors``) of fp32 and 1x, 2x, 3xTF32
    dot products of length d against float64."""
    errors = dot_errors(d, trials, seed)
    bins = np.arange(-40.5, -5.5, 0.5)
    for (name, e), color in zip(errors.items(), ("k", "C3", "C1", "C0")):
        ax.hist(_log2(e), bins=bins, histtype="step", lw=1.8, color=color,
                label=f"{name}: median 2^{np.log2(np.median(e)):.1f}" if np.median(e) > 0 else name)
    ax.axvline(-24, color="k", ls=":", lw=1)
    ax.text(-23.7, 0.97, "U = 2^-24", fontsize=8, rotation=90, va="top", transform=ax.get_xaxis_transform())
    ax.set_xlabel(f"log2(|c - a.b| / |a|.|b|), d = {d}   (-40: exact)")
    ax.set_ylabel(f"count of {trials} dot products")
    ax.set_title("Dot products against float64")
    ax.legend(fontsize=8, loc="upper left")
    return ax


# =========================================================================== attention

def attention_tf32(q, k, v, passes=3, *, causal=False, scale=None, accumulate="rn") -> tuple[np.ndarray, np.ndarray]:
    """(O, L) of attention (float32 (B, H, N, d) inputs) with S = Q K^T and P V through
    ``product(..., passes)``, the softmax in float32 as a flash kernel does it (e = exp(S -
    m), l = sum e, O = (e V) / l, L = m + log l); rows that see no key give O = 0, L = -inf."""
    from kernels import reference as ref

    q, k, v = _float32(q, "q"), _float32(k, "k"), _float32(v, "v")
    if q.ndim != 4:
        raise ValueError(f"q: expected shape (B, H, N, d), got {q.shape}")
    if k.ndim != 4 or k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]:
        raise ValueError(f"k: expected shape {q.shape[:2] + ('Nk', q.shape[3])}, got {k.shape}")
    if v.shape != k.shape:
        raise ValueError(f"v: expected the shape of k {k.shape}, got {v.shape}")
    passes = _check_passes(passes)
    nq, nk, d = q.shape[2], k.shape[2], q.shape[3]
    scale = np.float32(1.0 / np.sqrt(d) if d else 1.0) if scale is None else np.float32(scale)
    s = product(q, np.swapaxes(k, -1, -2).copy(), passes, accumulate=accumulate) * scale
    mask = ref.attention_mask(nq, nk, causal=causal)
    if mask is not None:
        s = np.where(mask, s, np.float32(-np.inf))
    with np.errstate(invalid="ignore", divide="ignore"):
        m = np.max(s, axis=-1, keepdims=True, initial=-np.inf)
        live = np.isfinite(m)
        e = np.where(live, np.exp(s - np.where(live, m, 0)), 0).astype(np.float32)
        l = np.sum(e, axis=-1, keepdims=True, dtype=np.float32)
        o = np.where(live, product(e, v, passes, accumulate=accumulate) / np.where(live, l, 1), 0).astype(np.float32)
        lse = np.where(live, m + np.log(np.where(live, l, 1)), -np.inf).astype(np.float32)[..., 0]
    return o, lse


def attention_error(q, k, v, passes=3, *, causal=False, scale=None, accumulate="rn") -> float:
    """max |O - O_exact| of ``attention_tf32`` against the float64 oracle."""
    from kernels import reference as ref

    o, _ = attention_tf32(q, k, v, passes, causal=causal, scale=scale, accumulate=accumulate)
    exact, _ = ref.attention(q, k, v, causal=causal, scale=scale)
    return float(np.max(np.abs(o - exact), initial=0.0))


def attention_check(q, k, v, passes=3, *, causal=False, scale=None, accumulate="rn"):
    """``attention_tf32``'s O and L against the oracle with the course's tolerance rule
    (error <= 2x float32 NumPy's + the element floors, as chapter 4's tests check the
    kernel). Returns the two ``Closeness`` records (O, L); ``.passed`` and ``.ratio`` (error /
    bound at the worst element, <= 1 passes) say how it went. Never raises on a miss."""
    from kernels import reference as ref
    from kernels.base.testing import assert_close, forward_floor_scales

    o, lse = attention_tf32(q, k, v, passes, causal=causal, scale=scale, accumulate=accumulate)
    exact_o, exact_l = ref.attention(q, k, v, causal=causal, scale=scale)
    base_o, base_l = ref.attention(q, k, v, causal=causal, scale=scale, dtype=np.float32)
    fs_o, fs_l = forward_floor_scales(q, k, v, scale, causal=causal)
    records = []
    for got, exact, base, fs, name in ((o, exact_o, base_o, fs_o, "O"), (lse, exact_l, base_l, fs_l, "L")):
        try:
            assert_close(got, exact, base, name=f"{name} ({passes} passes)", floor_scale=fs, record=records)
        except AssertionError:
            pass
    return tuple(records)


# =========================================================================== the exercise

@dataclass(frozen=True)
class SplitCase:
    """One drawn input of ``split_tf32``: float32 values of all sizes in the split's range,
    their low 13 bits often at the edges that matter (a tie 0x1000, one either side of it,
    all ones, zero)."""
    x: np.ndarray = field(repr=False)
    seed: int = 0

    def __repr__(self):
        x = self.x
        low = (x.view(np.uint32) & 0x1FFF) if x.size else np.zeros(0, np.uint32)
        return (f"SplitCase(shape={x.shape}, |x| in [{np.abs(x).min() if x.size else 0:.3g}, "
                f"{np.abs(x).max() if x.size else 0:.3g}], ties={int(np.sum(low == 0x1000))}, seed={self.seed})")


EDGE_LOW_BITS = np.array([0x0000, 0x0FFF, 0x1000, 0x1001, 0x1FFF, 0x0001], np.uint32)


def split_cases(max_n=24):
    """Hypothesis strategy of ``SplitCase``: 0..max_n values (a vector or a matrix), exponents
    from -100 to 100 (or near 1), random mantissas whose low 13 bits are drawn from the edges
    (``EDGE_LOW_BITS``) half the time, a zero sometimes."""
    from hypothesis import strategies as st

    @st.composite
    def cases(draw):
        n = draw(st.integers(0, max_n))
        rows = draw(st.sampled_from([None, 1, 2]))
        span = draw(st.sampled_from([2, 100]))
        seed = draw(st.integers(0, 2**32 - 1))
        rng = np.random.default_rng(seed)
        sign = rng.integers(0, 2, n).astype(np.uint32) << 31
        expo = (127 + rng.integers(-span, span + 1, n)).astype(np.uint32) << 23
        mant = rng.integers(0, 1 << 23, n, dtype=np.uint32)
        edge = rng.random(n) < 0.5
        mant = np.where(edge, (mant & ~np.uint32(0x1FFF)) | rng.choice(EDGE_LOW_BITS, n), mant)
        x = (sign | expo | mant).astype(np.uint32).view(np.float32)
        x = np.where(rng.random(n) < 0.05, np.float32(0), x).astype(np.float32)
        if rows and n % rows == 0 and n:
            x = x.reshape(rows, -1)
        return SplitCase(x, seed)
    return cases()


def check_split_tf32_case(fn, case):
    """The property: fn(x) returns (hi, lo), float32 arrays of x's shape, both tf32 values
    (low 13 bits zero: what a tensor core multiplies), hi the nearest tf32 to x (ties away
    from zero, as cvt.rna), lo a nearest tf32 to x - hi: then |x - hi - lo| <= 2^-23 |x|."""
    x = case.x
    out = fn(x.copy())
    assert isinstance(out, tuple) and len(out) == 2, f"expected a pair (hi, lo), got {type(out).__name__}"
    hi, lo = (np.asarray(t) for t in out)
    for t, name in ((hi, "hi"), (lo, "lo")):
        assert t.dtype == np.float32, f"{name}: dtype {t.dtype}, expected float32"
        assert t.shape == x.shape, f"{name}: shape {t.shape}, expected {x.shape}"
    if not x.size:
        return
    want = to_tf32(x)
    for t, name in ((hi, "hi"), (lo, "lo")):
        low = t.view(np.uint32) & 0x1FFF
        bad = np.flatnonzero(low != 0)
        assert not bad.size, (f"{name} is not a tf32 value (low 13 bits not zero) at x = {x.flat[bad[0]]!r}: "
                              f"{name} = {t.flat[bad[0]]!r} (bits {int(t.view(np.uint32).flat[bad[0]]):#010x})")
    bad = np.flatnonzero(hi.view(np.uint32) != want.view(np.uint32))
    assert not bad.size, (f"hi is not the nearest tf32 (ties away from zero) at x = {x.flat[bad[0]]!r} "
                          f"(bits {int(x.view(np.uint32).flat[bad[0]]):#010x}): hi = {hi.flat[bad[0]]!r}, "
                          f"expected {want.flat[bad[0]]!r}")
    x64, r = x.astype(np.float64), x.astype(np.float64) - want.astype(np.float64)
    best = np.abs(r - to_tf32(r.astype(np.float32)).astype(np.float64))
    got = np.abs(r - lo.astype(np.float64))
    bad = np.flatnonzero(got > best)
    assert not bad.size, (f"lo is not the nearest tf32 to x - hi at x = {x.flat[bad[0]]!r}: x - hi = "
                          f"{r.flat[bad[0]]!r}, lo = {lo.flat[bad[0]]!r}, expected {to_tf32(r.astype(np.float32)).flat[bad[0]]!r}")
    assert np.all(got <= 2.0 ** -23 * np.abs(x64))      # follows from the above, in the split's range


def check_split_tf32(fn, max_examples=None):
    """Exercise: write ``split_tf32(x) -> (hi, lo)`` for a float32 array x. Prints "passed" or
    the smallest failing case."""
    from kernels.base.testing import check_exercise

    return check_exercise(lambda case: check_split_tf32_case(fn, case), split_cases(), host=True,
                          max_examples=max_examples)
