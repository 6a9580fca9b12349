"""What the tests (and the notebooks' exercise checkers) share: the tolerance rule and the
floors it rests on, the Hypothesis strategies for attention inputs, and the checker that
reports the smallest failing case of a learner's function.

The tolerance rule, as FlashAttention's own tests state it: a kernel's error against the
float64 oracle must be at most twice the error that a plain float32 NumPy computation of
the same thing makes (the *float32 term*), plus a small *floor* for what that yardstick
cannot see: the steps the kernel rounds and NumPy does not (a fast exp2, a reciprocal),
and the cases where float32 NumPy is exact by luck (N = 1, tiny shapes). A fixed
``atol=1e-2`` would hide real bugs; so does a floor much larger than the float32 term,
which is why the floors here are derived element by element from the kernels' own
rounding steps (``attention_floors``, ``softmax_floors``, ``matmul_floor``) instead of
being a few ulps of the largest value anywhere. ``assert_close`` says which term decided
the bound at the worst element, so a floor that starts to decide shows up.

Strategies: shapes, logit spreads and seeds are drawn by Hypothesis (so failures shrink to
the smallest shape); the array values come from a NumPy generator seeded by the drawn
seed, which is far faster than drawing every element and still never zeros.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st

from kernels.base.runtime import on_simulator

FLOAT32_EPS = float(np.finfo(np.float32).eps)   # 2^-23: the spacing of float32 numbers at 1
U = FLOAT32_EPS / 2                             # 2^-24: float32's unit roundoff (half an ulp)

# --------------------------------------------------------------------------- the rule


@dataclass(frozen=True)
class Floor:
    """An absolute floor, one value per element (or one for all), and the model behind it.

    Pass it to ``assert_close`` as ``floor=`` (or as ``floor_scale=``, where the floor
    functions' results used to go): it is used as it is, not multiplied by ulps.
    """

    value: np.ndarray | float
    why: str

    def __getitem__(self, index):            # a Floor of part of the outputs
        return Floor(np.asarray(self.value)[index], self.why)


@dataclass
class Closeness:
    """What ``assert_close`` found: the worst element (largest error / bound) and how its
    bound was made. ``ratio`` <= 1 passes; ``decided_by`` names the larger term of the
    bound there ("float32": factor x the float32 NumPy error, "floor": the floor)."""

    name: str
    passed: bool
    ratio: float = 0.0               # max over elements of error / bound
    index: tuple = ()
    got: float = 0.0
    expected: float = 0.0
    error: float = 0.0               # |got - expected| at the worst element
    bound: float = 0.0               # the bound there: float32_term + floor
    float32_term: float = 0.0        # factor x max |float32 NumPy - oracle|
    floor: float = 0.0               # the floor there
    floor_why: str = ""
    max_error: float = 0.0           # max |got - oracle| over all finite elements
    float32_error: float = 0.0       # max |float32 NumPy - oracle| over all finite elements
    elements: int = 0                # finite elements compared

    @property
    def decided_by(self) -> str:
        return "floor" if self.floor > self.float32_term else "float32"

    def __str__(self):
        if not self.elements:
            return f"{self.name}: no finite element to compare"
        return (f"{self.name}: error/bound = {self.ratio:.3g} at {self.index}: got {self.got!r}, "
                f"expected {self.expected!r}, error {self.error:.3e} vs bound {self.bound:.3e} = "
                f"float32 term {self.float32_term:.3e} (2x float32 NumPy's max error {self.float32_error:.3e})"
                f" + floor {self.floor:.3e} ({self.floor_why}); the {self.decided_by} term decides. "
                f"Max error anywhere {self.max_error:.3e} over {self.elements} elements.")


def _log(record: Closeness):
    """``WORKBOOK_TOLERANCE_LOG=path``: append every comparison as a JSON line (to study how
    tight the bounds are across a whole test run)."""
    path = os.environ.get("WORKBOOK_TOLERANCE_LOG")
    if not path:
        return
    row = {k: (v if isinstance(v, (str, bool, int)) else (list(v) if isinstance(v, tuple) else float(v)))
           for k, v in record.__dict__.items()}
    row["decided_by"] = record.decided_by
    row["test"] = os.environ.get("PYTEST_CURRENT_TEST", "")
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def assert_close(got, exact, baseline, *, name="output", factor=2.0, floor_ulps=8.0, floor_scale=None,
                 floor=None, record=None) -> Closeness:
    """Check ``got`` against ``exact`` (float64 oracle) with the float32 ``baseline``'s error as yardstick.

    Element by element: |got - exact| <= factor * max|baseline - exact| + floor.

    Non-finite entries must match the oracle exactly: NaN where the oracle has NaN (and only
    there), the same infinities (e.g. L = -inf on fully masked rows).

    The floor, in order of preference:

    * ``floor``: absolute, a number or an array broadcastable to ``exact``, or a ``Floor``
      (from ``attention_floors``, ``softmax_floors``, ``matmul_floor``): the first-order
      rounding error of the kernel's own steps, element by element.
    * ``floor_scale``: ``floor_ulps`` float32 ulps (eps = 2^-23) of it (a number or an
      array); a ``Floor`` here is used as ``floor``.
    * neither: ``floor_ulps`` ulps of the largest exact value (at least 1), the loose rule
      for outputs that nothing better has been derived for.

    On failure the message names the worst element (largest error / bound), its error and
    bound, which term decided the bound there, and the ratio. Returns that as a
    ``Closeness`` (also appended to ``record`` when it is a list).
    """
    got = np.asarray(got, dtype=np.float64)
    exact = np.asarray(exact, dtype=np.float64)
    baseline = np.asarray(baseline, dtype=np.float64)
    assert got.shape == exact.shape, f"{name}: shape {got.shape}, expected {exact.shape}"

    # Non-finite entries: NaN exactly where the oracle has NaN, infinities equal.
    got_nan, exact_nan = np.isnan(got), np.isnan(exact)
    wrong_nan = got_nan & ~exact_nan
    assert not wrong_nan.any(), (
        f"{name}: {int(wrong_nan.sum())} NaN entries where the oracle is not NaN, first at "
        f"{np.argwhere(wrong_nan)[:5].tolist()} (oracle {exact[wrong_nan][:5]})")
    missing_nan = exact_nan & ~got_nan
    assert not missing_nan.any(), (
        f"{name}: {int(missing_nan.sum())} entries are not NaN where the oracle is NaN, first at "
        f"{np.argwhere(missing_nan)[:5].tolist()} (got {got[missing_nan][:5]})")
    finite = np.isfinite(exact)
    mismatch = ~finite & ~exact_nan & (got != exact)
    assert not mismatch.any(), (
        f"{name}: non-finite entries differ at {np.argwhere(mismatch)[:5].tolist()}: "
        f"got {got[mismatch][:5]}, expected {exact[mismatch][:5]}"
    )
    bad = finite & ~np.isfinite(got)
    assert not bad.any(), (f"{name}: non-finite values where the oracle is finite, first at "
                           f"{np.argwhere(bad)[:5].tolist()}: got {got[bad][:5]}")

    if isinstance(floor_scale, Floor) and floor is None:
        floor, floor_scale = floor_scale, None
    if floor is not None:
        why = floor.why if isinstance(floor, Floor) else "given"
        floor_arr = np.asarray(floor.value if isinstance(floor, Floor) else floor, dtype=np.float64)
    elif floor_scale is not None:
        why = f"{floor_ulps:g} ulps of the floor scale"
        floor_arr = floor_ulps * FLOAT32_EPS * np.asarray(floor_scale, dtype=np.float64)
    else:
        why = f"{floor_ulps:g} ulps of max(1, max |exact|)"
        top = float(np.max(np.abs(exact[finite]), initial=0.0))
        floor_arr = np.asarray(floor_ulps * FLOAT32_EPS * max(1.0, top))
    floor_arr = np.broadcast_to(floor_arr, exact.shape)

    result = Closeness(name=name, passed=True, elements=int(finite.sum()), floor_why=why)
    if finite.any():
        both = finite & np.isfinite(baseline)
        err = np.abs(np.where(finite, got, 0.0) - np.where(finite, exact, 0.0))
        err_f32 = float(np.max(np.abs(np.where(both, baseline, 0.0) - np.where(both, exact, 0.0)), initial=0.0))
        term = factor * err_f32
        bound = term + floor_arr
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(finite, np.where(bound > 0, err / bound, np.where(err > 0, np.inf, 0.0)), -1.0)
        worst = np.unravel_index(int(np.argmax(ratio)), exact.shape)
        result = Closeness(
            name=name, passed=bool(ratio[worst] <= 1.0), ratio=float(ratio[worst]),
            index=tuple(int(i) for i in worst), got=float(got[worst]), expected=float(exact[worst]),
            error=float(err[worst]), bound=float(bound[worst]), float32_term=term,
            floor=float(floor_arr[worst]), floor_why=why, max_error=float(err.max()),
            float32_error=err_f32, elements=int(finite.sum()))
    if isinstance(record, list):
        record.append(result)
    _log(result)
    assert result.passed, str(result)
    return result


# --------------------------------------------------------------------------- floors from the kernels' rounding steps
# Every kernel of the course rounds the same few steps; to first order each step's error
# is one rounding of the value it produces, and independent roundings add in quadrature
# (a worst-case linear sum would be sqrt(N) times larger than what kernels do, and would
# decide every bound). In units of U = 2^-24 (half an ulp of 1):
#
#   S = scale Q K^T       a float32 dot product errs by about one U of the sum of its
#                         absolute products, a = scale |Q| |K|^T (random signs: partial
#                         sums grow like sqrt(d), their roundings add up to ~0.6 U a); a
#                         key aligned with its query (large logits, the keys that carry P)
#                         makes the partial sums grow steadily towards S, and the error
#                         with them: ``serial_sum_spread`` models both, sigma_j
#   exp(x), x = S - m     the argument is rounded to an ulp of |x| (the subtraction; on a
#                         GPU also the product with log2 e that feeds ex2.approx, which
#                         errs by 2 ulps itself): P_j's relative error is about
#                         rel_j = C_EXP + C_ARG |x_j| + C_SERIAL scale sigma_j (S's error
#                         at its tail: measured on the H100, one U of a fell 5-10% short
#                         on rows carried by two aligned keys)
#   l = sum e_j, P = e/l  P_j errs by rel_j - sum_k P_k rel_k (the normalisation moves the
#                         whole row) plus C_NORM for l's sum, 1/l and the product
#   O = P V               O = sum_j e_j V_j / sum_j e_j moves by sum_j P_j rel_j (V_j - O),
#                         in quadrature over j, plus C_NORM U |O|, plus the sum's own
#                         rounding, about one U of sum_j P_j |V_j|
#   L = m + log l         one U of |L|, plus l's relative error sum_j P_j rel_j (in
#                         quadrature), plus C_NORM for the log
#
# float32 NumPy makes most of these errors too (that is what the float32 term measures);
# the floor counts them once more, element by element: it covers the kernel's extra steps
# and NumPy's lucky cases while staying at or below the float32 term on typical inputs, so
# that a kernel whose errors grow 4x fails (tests/test_planted_bugs.py plants such a
# regression). The simulator computes exp in float64 (one rounding, no ex2.approx): its
# constants are smaller. Each floor is capped at the legacy floor (8 ulps of the exponent
# scale times max |V|, see ``forward_floor_scales``), so it is never looser than that.

if on_simulator():
    C_EXP, C_ARG, C_NORM = 1.0, 1.0, 2.0
else:
    C_EXP = 4.0     # ex2.approx: 2 ulps relative
    C_ARG = 2.0     # the exp2 argument rounded twice (x = S - m, then x log2 e), an ulp of |x| each
    C_NORM = 4.0    # l's sum and a fast reciprocal 1/l (2 ulps), the product e / l
# Two more, measured against the H100 over the gpu profile's hundreds of drawn cases:
# C_DOT   an output that is itself a dot product (S, C = AB, the sum of O = PV): its error
#         is about 0.6 U a at one element, but the largest over thousands of elements is
#         the tail of that spread, 3-4 times it (seen: 2.9 U a for a matmul, 2.5 for S).
# C_LSE   L is computed in base 2, L = ln 2 (m2 + log2 l) with m2 = log2(e) scale max S:
#         the product by log2 e, the sum and the product by ln 2 each round at |L| log2 e
#         or |L| (seen: 5 U |L| at |L| = 19, row terms included).
C_DOT = 3.0
C_LSE = 4.0
# C_SERIAL  the largest error of a float32 dot product summed term after term, in units of
#           its spread ``serial_sum_spread``: 4.0 over 3e5 sums of 64 terms, coherent or not.
C_SERIAL = 4.5


def serial_sum_spread(x, y):
    """The spread (one sigma, in U) of the rounding error of x y^T (last axes summed) when
    each element is one float32 sum, term after term, as a thread computes S = Q K^T: each
    addition rounds at the partial sum so far (by up to U of it, uniformly: U^2/3 each).
    The partial sums drift towards the result (sum of squares S^2 d/3) and spread by the
    terms (d sum_e (x_e y_e)^2 / 2). When x and y are unrelated this is about 0.6 U |x||y|^T;
    when they are aligned (a dominant key) it grows with sqrt(d) times |S| instead."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    d = x.shape[-1]
    yt = np.swapaxes(y, -1, -2)
    drift = (x @ yt) ** 2 * d / 3.0
    spread = d * ((x * x) @ (yt * yt)) / 2.0
    return np.sqrt((drift + spread) / 3.0)


def _nan0(x):
    return np.nan_to_num(np.asarray(x, np.float64), nan=0.0, posinf=0.0, neginf=0.0)


def _softmax_model(s, a=None):
    """(P, P * rel, row error) of rows of scores s (-inf masked): rel is the relative error
    of each P_j in U (exp argument and approximation, plus a = the error of s itself), the
    row error sum_j P_j rel_j in quadrature (how far the normalisation moves the row)."""
    from kernels import reference as ref

    s = np.asarray(s, np.float64)
    with np.errstate(invalid="ignore"):
        fin = np.isfinite(s)
        m = np.max(np.where(fin, s, -np.inf), axis=-1, keepdims=True, initial=-np.inf)
        x = np.where(fin, s - np.where(np.isfinite(m), m, 0.0), 0.0)
    rel = C_EXP + C_ARG * np.abs(x)
    if a is not None:
        rel = rel + _nan0(a)
    with np.errstate(invalid="ignore"):
        p = _nan0(ref.softmax(s)) if s.size else s.copy()
    pr = p * rel
    row = np.sqrt(np.sum(pr * pr, axis=-1, keepdims=True))
    return p, pr, row


def softmax_floors(x):
    """(Floor of P, Floor of L) for P = softmax(x), L = logsumexp(x) over the last axis.

    P_j errs by rel_j, plus the row's normalisation error (see the notes above);
    L by one U of |L| plus l's relative error.
    """
    from kernels import reference as ref

    x = np.asarray(x, np.float64)
    p, pr, row = _softmax_model(x)
    with np.errstate(invalid="ignore"):
        lse = _nan0(ref.logsumexp(x)) if x.shape[-1] else np.zeros(x.shape[:-1])
    f_p = U * (pr + p * (row + C_NORM))
    f_l = U * (C_LSE * np.abs(lse) + row[..., 0] + C_NORM)
    return (Floor(f_p, "softmax floor: exp2 argument and approximation, normalisation"),
            Floor(f_l, "logsumexp floor: C_LSE U |L| + l's relative error"))


def matmul_floor(a, b, *, scale=1.0):
    """Floor of C = scale A B: one U of |C| (the final rounding) plus one U of scale |A| |B|
    (the sum of absolute products, what a float32 dot product's partial sums round to)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    c = scale * (a @ b)
    return Floor(U * (np.abs(c) + C_DOT * scale * (np.abs(a) @ np.abs(b))), "dot-product floor: U (|C| + C_DOT |A||B|)")


@dataclass(frozen=True)
class AttentionFloors:
    """Floors of attention's outputs (see the notes above ``C_EXP``):

    s    S = scale Q K^T (-inf where masked: no floor needed there)
    p    P = softmax(S) from Q and K (S's error included)
    o    O = P V
    lse  L = logsumexp(S)
    """

    s: Floor
    p: Floor
    o: Floor
    lse: Floor


def attention_floors(q, k, v, *, causal=False, scale=None, block_mask=None) -> AttentionFloors:
    """Element-by-element floors of attention's S, P, O and L, from the kernels' rounding steps."""
    from kernels import reference as ref

    q, k, v = (np.asarray(t, np.float64) for t in (q, k, v))
    nq, nk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = (1.0 / np.sqrt(d) if d > 0 else 1.0) if scale is None else float(scale)
    with np.errstate(invalid="ignore", over="ignore"):
        a = scale * (np.abs(q) @ np.swapaxes(np.abs(k), -1, -2))
        s = scale * (q @ np.swapaxes(k, -1, -2))
    mask = ref.attention_mask(nq, nk, causal=causal, block_mask=block_mask)
    if mask is not None:
        s = np.where(mask, s, -np.inf)
    f_s = U * (np.abs(_nan0(s)) + C_DOT * _nan0(a))
    # S's error as it reaches P: the tail (C_SERIAL) of a float32 sum taken term after term,
    # whose partial sums grow towards S where a key is aligned with its query (large logits)
    with np.errstate(invalid="ignore", over="ignore"):
        s_err = C_SERIAL * scale * _nan0(serial_sum_spread(q, k))
    p, pr, row = _softmax_model(s, s_err)
    f_p = U * (pr + p * (row + C_NORM))
    vv = _nan0(v)
    o = p @ vv
    # sum_j (P_j rel_j)^2 (V_j - O)^2, without the (Nq, Nk, d) intermediate.
    w = pr * pr
    spread = w @ (vv * vv) - 2.0 * o * (w @ vv) + o * o * np.sum(w, axis=-1, keepdims=True)
    f_o = U * (np.sqrt(np.maximum(spread, 0.0)) + C_NORM * np.abs(o) + C_DOT * (p @ np.abs(vv)))
    with np.errstate(invalid="ignore"):
        lse = _nan0(ref.logsumexp(s)) if nk else np.zeros(s.shape[:-1])
    f_l = U * (C_LSE * np.abs(lse) + row[..., 0] + C_NORM)
    # Never looser than the legacy floors.
    legacy_o, legacy_l = _legacy_forward_floor_scales(q, k, v, scale)
    f_o = np.minimum(f_o, 8 * FLOAT32_EPS * legacy_o)
    f_l = np.minimum(f_l, 8 * FLOAT32_EPS * legacy_l)
    return AttentionFloors(
        s=Floor(f_s, "S floor: U (|S| + C_DOT scale |Q||K|^T)"),
        p=Floor(f_p, "P floor: exp2 argument and approximation, S's error, normalisation"),
        o=Floor(f_o, "O floor: P's errors weighting V - O in quadrature, normalisation, U sum P|V|"),
        lse=Floor(f_l, "L floor: C_LSE U |L| + l's relative error"),
    )


def exponent_scale(q, k, scale=None) -> float:
    """1 + max|scale * Q K^T|: how large the exponents of softmax get (the legacy floors'
    scale; ``attention_floors`` weights each exponent by its P instead)."""
    q = np.asarray(q, np.float64)
    k = np.asarray(k, np.float64)
    if q.shape[-2] == 0 or k.shape[-2] == 0 or q.shape[-1] == 0:
        return 1.0
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    with np.errstate(invalid="ignore", over="ignore"):
        return 1.0 + float(np.max(_nan0(np.abs(scale * (q @ np.swapaxes(k, -1, -2))))))


def _legacy_forward_floor_scales(q, k, v, scale=None):
    e = exponent_scale(q, k, scale)
    vmax = float(np.max(_nan0(np.abs(v)))) if np.size(v) else 0.0
    return e * max(1.0, vmax), e


def forward_floor_scales(q, k, v, scale=None, *, causal=None, block_mask=None):
    """Floors for (O, L) of attention.

    With ``causal=`` (and ``block_mask=`` where there is one) given: the element-by-element
    ``Floor``s of ``attention_floors`` (pass them as ``floor_scale=`` or ``floor=``).

    Without (the legacy call): loose scalar floor scales, for 8 ulps each: O = P V errs by
    (relative error of P) x max|V| and P's relative error by ulps of the largest exponent
    anywhere, e = 1 + max|scale Q K^T|; L by e. These decide nearly every bound (at d = 64
    with N(0, 1) inputs the floor is ~50x the float32 term): prefer the keyword form.
    """
    if causal is None and block_mask is None:
        return _legacy_forward_floor_scales(q, k, v, scale)
    f = attention_floors(q, k, v, causal=bool(causal), scale=scale, block_mask=block_mask)
    return f.o, f.lse


def attention_gradient_floors(q, k, v, o, lse, do, *, causal=False, scale=None, block_mask=None):
    """Element-by-element floors (``Floor``) of (dQ, dK, dV), from the backward's rounding
    steps (the notes above ``C_EXP``), for a kernel that rebuilds P = exp(scale S - L) from
    the saved L:

    P_ij     relative error rel_ij = C_EXP + C_ARG |x_ij| + C_SERIAL scale sigma_ij (x = scale
             S - L, the exp's argument; sigma = ``serial_sum_spread(Q, K)``, the spread of
             S's error). In the forward, S's error moves P_j and the row's max and sum
             together and largely cancels; here L comes from outside, so S's error reaches
             P whole, and it is largest where P is: a key aligned with its query makes the
             partial sums of S grow steadily, each rounding at their size (measured on the
             H100: 5 U scale |Q||K|^T at d = 125, where the one-U-of-a model said 1)
    dS_ij    = P_ij (dP_ij - D_i): P's error times |dP - D|, plus the absolute errors of dP
             = dO V^T (C_DOT U of |dO||V|^T) and of D = rowsum(dO O) (C_DOT U of
             rowsum|dO O|), dot products both, whose errors do not shrink when dP - D
             cancels (large logits; a row that sees one key has dS = 0 exactly, and gets
             their difference)
    dV_j     = sum_i P_ij dO_i: P's errors in quadrature, plus one U of sum_i P_ij |dO_i|
    dQ_i     = scale sum_j dS_ij K_j and dK_j = scale sum_i dS_ij Q_i: dS's errors in
             quadrature (D's error, common to a row, adds coherently in dQ), plus one U of
             the sum of absolute terms

    Each is capped at the legacy floor (``gradient_floor_scales(..., per_element=False)``).
    """
    from kernels import reference as ref

    q, k, v, o, lse, do = (np.asarray(x, np.float64) for x in (q, k, v, o, lse, do))
    nq, nk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = (1.0 / np.sqrt(d) if d > 0 else 1.0) if scale is None else float(scale)
    zero = (Floor(np.zeros(q.shape), "empty"), Floor(np.zeros(k.shape), "empty"), Floor(np.zeros(v.shape), "empty"))
    if nq == 0 or nk == 0:
        return zero
    q, k, v, o, do = (_nan0(x) for x in (q, k, v, o, do))
    kt = np.swapaxes(k, -1, -2)
    allowed = ref.attention_mask(nq, nk, causal=causal, block_mask=block_mask)
    allowed = np.ones((1, 1), bool) if allowed is None else allowed
    live = np.isfinite(lse)[..., None]
    x = scale * (q @ kt) - np.where(live, _nan0(lse)[..., None], 0.0)
    on = allowed & live
    p = np.where(on, np.exp(np.minimum(np.where(on, x, 0.0), 0.0)), 0.0)
    rel = np.where(on, C_EXP + C_ARG * np.abs(x) + C_SERIAL * scale * serial_sum_spread(q, k), 0.0)
    dp = do @ np.swapaxes(v, -1, -2)
    big_d = np.sum(do * o, axis=-1, keepdims=True)
    abs_d = C_DOT * np.sum(np.abs(do * o), axis=-1, keepdims=True)
    ds = p * (dp - big_d)
    err_ds = p * (rel * np.abs(dp - big_d) + C_DOT * (np.abs(do) @ np.swapaxes(np.abs(v), -1, -2)))   # in U
    t = lambda a: np.swapaxes(a, -1, -2)
    f_dv = U * (np.sqrt(t(p * rel) ** 2 @ (do * do)) + t(p) @ np.abs(do))
    f_dq = U * scale * (np.sqrt(err_ds ** 2 @ (k * k)) + abs_d * np.abs(p @ k) + np.abs(ds) @ np.abs(k))
    f_dk = U * scale * (np.sqrt(t(err_ds) ** 2 @ (q * q) + t(p * abs_d) ** 2 @ (q * q)) + t(np.abs(ds)) @ np.abs(q))
    legacy = gradient_floor_scales(q, k, v, o, lse, do, causal=causal, scale=scale, block_mask=block_mask,
                                   per_element=False)
    why = "gradient floor: P's, dP's and D's errors through dS, in quadrature, plus U of the sums"
    return tuple(Floor(np.minimum(f, 8 * FLOAT32_EPS * cap), f"{name} {why}")
                 for name, f, cap in (("dQ", f_dq, legacy[0]), ("dK", f_dk, legacy[1]), ("dV", f_dv, legacy[2])))


def gradient_floor_scales(q, k, v, o, lse, do, *, causal=False, scale=None, block_mask=None, per_element=None):
    """Floors for (dQ, dK, dV) of attention.

    ``per_element`` (the default; WORKBOOK_GRADIENT_FLOORS=legacy turns it off): the
    ``Floor``s of ``attention_gradient_floors``, about the size of the float32 term, so that
    a backward whose errors grow 4x fails. ``per_element=False``: the legacy scalar floor
    scales (for 8 ulps each), 50-80x the float32 error on typical cases, which the rest of
    this docstring derives:

    dS = P (dP - D) with D = rowsum(dO O) = sum_j P_j dP_j: where a row's softmax is nearly
    one-hot (large logits), dP - D is a small difference of float32 sums of size |dP| + |D|,
    and any float32 computation of it keeps an absolute error of a few ulps of those terms,
    not of the small result (the float32 baseline can be exact by luck on tiny shapes), and
    a float32 dot product errs by ulps of the sum of its absolute products; P itself is only
    accurate to ulps of the exponent scale e (see ``exponent_scale``). To first order dS errs
    by P (e |dP - D| + |dO| |V|^T + rowsum|dO O|) ulps, and dQ = scale dS K, dK = scale dS^T Q
    carry that summed over a row (column) against |K| (resp. |Q|). dV = P^T dO errs by
    e P^T |dO| ulps.
    """
    from kernels import reference as ref

    if per_element is None:
        per_element = os.environ.get("WORKBOOK_GRADIENT_FLOORS", "element") != "legacy"
    if per_element:
        return attention_gradient_floors(q, k, v, o, lse, do, causal=causal, scale=scale, block_mask=block_mask)
    q, k, v, o, lse, do = (np.asarray(x, np.float64) for x in (q, k, v, o, lse, do))
    d = q.shape[-1]
    scale = 1.0 / np.sqrt(max(d, 1)) if scale is None else scale
    if q.shape[-2] == 0 or k.shape[-2] == 0:
        return 1.0, 1.0, 1.0
    e = exponent_scale(q, k, scale)
    allowed = ref.attention_mask(q.shape[-2], k.shape[-2], causal=causal, block_mask=block_mask)
    allowed = np.ones((1, 1), bool) if allowed is None else allowed
    s = scale * (q @ np.swapaxes(k, -1, -2))
    live = np.isfinite(lse)[..., None]
    p = np.where(allowed & live, np.exp(np.minimum(s - np.where(live, lse[..., None], 0.0), 0.0)), 0.0)
    # First-order error of dS = P (dP - D): dP (P's relative error, e ulps) (dP - D), plus
    # P d(dP - D), where a float32 dot product errs by ulps of the sum of its absolute
    # products (not of |the result|): dP = dO V^T and D = rowsum(dO O) are such sums.
    dp = do @ np.swapaxes(v, -1, -2)
    big_d = np.sum(do * o, axis=-1, keepdims=True)
    sums = np.abs(do) @ np.swapaxes(np.abs(v), -1, -2) + np.sum(np.abs(do * o), axis=-1, keepdims=True)
    terms = p * (e * np.abs(dp - big_d) + sums)
    dq_scale = scale * float(np.max(terms @ np.abs(k), initial=0.0))
    dk_scale = scale * float(np.max(np.swapaxes(terms, -1, -2) @ np.abs(q), initial=0.0))
    dv_scale = e * float(np.max(np.swapaxes(p, -1, -2) @ np.abs(do), initial=0.0))
    return max(1.0, dq_scale), max(1.0, dk_scale), max(1.0, dv_scale)


# --------------------------------------------------------------------------- strategies

# The simulator runs every thread in Python: keep sizes small there.
MAX_N = 64 if on_simulator() else 512
MAX_D = 32 if on_simulator() else 128
MAX_BH = 2 if on_simulator() else 4

# The spreads (standard deviations) of the logits scale * Q K^T that the attention cases
# draw. A spread of 0.3 gives a nearly uniform softmax, 8 one dominated by a few keys: the
# range where O depends on many P_j and a wrong P shows. Much larger logits make softmax
# one-hot (O is one row of V, exact in any precision) and tell little; the tests pin them
# with @example instead (case_with(..., magnitude=30.0): logits around 1e3 to 1e4).
LOGIT_STDS = (0.3, 1.0, 3.0, 8.0)


def gpu_examples(n: int) -> int:
    """How many cases a property test draws on a GPU: its own ``n``, or fewer where the loaded
    Hypothesis profile asks for fewer (``gpu``, 300: every test's own n; ``dev``, 40: a GPU run
    that finishes in minutes; ``mutants``, 25). Read when the test is defined, after conftest
    loaded the profile."""
    from hypothesis import settings

    return min(int(n), settings().max_examples)


def random_array(rng, shape, magnitude=1.0, dtype=np.float32):
    """Normal(0, magnitude) values; never all zeros."""
    return (rng.standard_normal(shape) * magnitude).astype(dtype)


def magnitude_for_logits(logit_std, d, scale=None):
    """The std of Q and K entries that gives logits scale * Q K^T of std ``logit_std``:
    a sum of d products of two N(0, m^2) has std m^2 sqrt(d)."""
    scale = 1.0 / np.sqrt(max(d, 1)) if scale is None else scale
    return float(np.sqrt(logit_std / (scale * np.sqrt(max(d, 1)))))


@dataclass
class AttentionCase:
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    causal: bool
    scale: float | None

    def __repr__(self):
        return (
            f"AttentionCase(q={self.q.shape}, k={self.k.shape}, dtype={self.q.dtype}, "
            f"causal={self.causal}, scale={self.scale}, |q|max={np.abs(self.q).max() if self.q.size else 0:.3g})"
        )


@st.composite
def attention_cases(draw, *, max_n=MAX_N, max_d=MAX_D, head_dims=None, dtypes=(np.float32,),
                    allow_causal=True, allow_empty=True, magnitudes=None, logit_stds=LOGIT_STDS):
    """q (B, H, Nq, d), k and v (B, H, Nk, d), causal, scale: Nq != Nk, ragged N, odd d.

    The logits' spread is drawn from ``logit_stds`` (Q and K scaled to give it, whatever
    d and scale are); ``magnitudes=`` draws the std of Q and K entries directly instead."""
    b = draw(st.integers(1, MAX_BH))
    h = draw(st.integers(1, MAX_BH))
    lo = 0 if allow_empty else 1
    nq = draw(st.integers(lo, max_n))
    nk = draw(st.integers(lo, max_n))
    d = draw(st.sampled_from(head_dims) if head_dims else st.integers(1, max_d))
    dtype = draw(st.sampled_from(dtypes))
    causal = draw(st.booleans()) if allow_causal else False
    scale = draw(st.one_of(st.none(), st.floats(0.01, 2.0)))
    if magnitudes is not None:
        magnitude = draw(st.sampled_from(magnitudes))
    else:
        magnitude = magnitude_for_logits(draw(st.sampled_from(logit_stds)), d, scale)
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    q = random_array(rng, (b, h, nq, d), magnitude, dtype)
    k = random_array(rng, (b, h, nk, d), magnitude, dtype)
    v = random_array(rng, (b, h, nk, d), 1.0, dtype)
    return AttentionCase(q, k, v, causal, scale)


def case_with(q_shape, k_shape, *, causal=False, scale=None, magnitude=1.0, seed=0, dtype=np.float32,
              logit_std=None):
    """A fixed case for ``@example``: the awkward shapes every chapter pins. ``logit_std``
    (instead of ``magnitude``) scales Q and K to give logits of that spread."""
    rng = np.random.default_rng(seed)
    if logit_std is not None:
        magnitude = magnitude_for_logits(logit_std, q_shape[-1], scale)
    q = random_array(rng, q_shape, magnitude, dtype)
    k = random_array(rng, k_shape, magnitude, dtype)
    v = random_array(rng, k_shape, 1.0, dtype)
    return AttentionCase(q, k, v, causal, scale)


@st.composite
def grouped_attention_cases(draw, *, max_n, head_dims, small, dtype=np.float64, groups=(1, 2)):
    """q (B, H, Nq, d), k and v (B, Hkv, Nk, d) with H = group Hkv (grouped-query attention,
    a group from ``groups``), ragged Nq and Nk from 0 to ``max_n``, d from ``head_dims``,
    causal, scale, logit spreads; ``small``: B * H <= 2 (the simulator). The tensor-core
    chapters' cases (8's forward and 11 and 12's backwards: groups of 1 and 2)."""
    group = draw(st.sampled_from(list(groups)))
    if small:
        b, hkv = (1, 1) if group == 2 else draw(st.sampled_from([(1, 1), (1, 2), (2, 1)]))
    else:
        b, hkv = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    nq, nk = draw(st.integers(0, max_n)), draw(st.integers(0, max_n))
    d = draw(st.sampled_from(head_dims))
    causal = draw(st.booleans())
    scale = draw(st.one_of(st.none(), st.floats(0.05, 1.0)))
    magnitude = magnitude_for_logits(draw(st.sampled_from([0.3, 1.0, 3.0, 8.0])), d, scale)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    q = random_array(rng, (b, hkv * group, nq, d), magnitude, dtype)
    k = random_array(rng, (b, hkv, nk, d), magnitude, dtype)
    v = random_array(rng, (b, hkv, nk, d), 1.0, dtype)
    return AttentionCase(q, k, v, causal, scale)


def over_group(x, hkv):
    """(B, H, Nk, d) per query head -> (B, Hkv, Nk, d): the sum over each group of H / Hkv
    query heads (in x's dtype): a KV head's gradient under grouped-query attention."""
    b, h, n, d = x.shape
    return x.reshape(b, hkv, h // hkv, n, d).sum(axis=2)


# --------------------------------------------------------------------------- counting memory traffic (simulator)

class CountingArray:
    """A stand-in for a device array, in the simulator only: it records the index of every
    element a kernel reads and writes (a kernel sees ``shape`` and indexing, nothing more).
    ``reads``/``writes``: every access in order; ``distinct_reads``/``distinct_writes``:
    the elements touched, each once (what an IO model that reads each input once counts)."""

    def __init__(self, array):
        self.array = array
        self.shape = array.shape
        self.ndim = array.ndim
        self.dtype = array.dtype
        self.reads = []          # list.append is atomic: simulated threads may interleave
        self.writes = []

    @staticmethod
    def _key(index):
        return tuple(int(i) for i in index) if isinstance(index, tuple) else (int(index),)

    def __getitem__(self, index):
        key = self._key(index)
        self.reads.append(key)
        return self.array[key]

    def __setitem__(self, index, value):
        key = self._key(index)
        self.writes.append(key)
        self.array[key] = value

    @property
    def distinct_reads(self) -> int:
        return len(set(self.reads))

    @property
    def distinct_writes(self) -> int:
        return len(set(self.writes))


@dataclass
class Launch:
    """One kernel launch seen by ``counting_launches``: the factory that made the kernel
    and its array arguments, each a ``CountingArray``."""

    factory: str
    arrays: list

    def elements(self, *, distinct=True) -> int:
        """Elements read plus elements written in global memory."""
        if distinct:
            return sum(a.distinct_reads + a.distinct_writes for a in self.arrays)
        return sum(len(a.reads) + len(a.writes) for a in self.arrays)


class _CountingKernel:
    def __init__(self, factory, kernel, launches):
        self.factory, self.kernel, self.launches = factory, kernel, launches

    def __getitem__(self, config):
        def launch(*args):
            wrapped = [CountingArray(a._ary) if hasattr(a, "_ary") else
                       (CountingArray(a) if isinstance(a, np.ndarray) else a) for a in args]
            self.launches.append(Launch(self.factory, [a for a in wrapped if isinstance(a, CountingArray)]))
            return self.kernel[config](*wrapped)
        return launch


class counting_launches:
    """``with counting_launches(module, "make_scores", ...) as launches:`` every kernel the
    named factories of ``module`` make while inside is launched on ``CountingArray``s, and
    each launch is appended to ``launches``. Simulator only (a GPU kernel needs real arrays)."""

    def __init__(self, module, *factories):
        if not on_simulator():
            raise RuntimeError("counting_launches needs the CUDA simulator")
        self.module, self.factories, self.launches = module, factories, []

    def __enter__(self):
        self.saved = {name: getattr(self.module, name) for name in self.factories}
        for name, factory in self.saved.items():
            def make(*args, _name=name, _factory=factory, **kwargs):
                return _CountingKernel(_name, _factory(*args, **kwargs), self.launches)
            setattr(self.module, name, make)
        return self.launches

    def __exit__(self, *exc):
        for name, factory in self.saved.items():
            setattr(self.module, name, factory)
        return False


# --------------------------------------------------------------------------- exercise checker

# How many cases the checker draws. A host-side exercise (NumPy or plain Python, no kernel
# launch) costs microseconds a case, so it draws hundreds everywhere: a mistake that shows
# in one case of twenty (a missing max subtraction, a mask wrong only when Nq > Nk) must be
# caught every run, not most runs. A kernel exercise in the simulator runs every thread in
# Python, so it draws a few cases there and many on a GPU.
HOST_EXAMPLES = 300
KERNEL_EXAMPLES = 10 if on_simulator() else 100


def check_exercise(prop, strategy, *, host=False, max_examples=None):
    """Run ``prop(case)`` (which raises AssertionError on a wrong answer) on cases drawn from
    ``strategy``; print "passed" or the smallest failing case Hypothesis can shrink to.

    ``host=True`` marks an exercise that launches no kernel (NumPy or plain Python): it draws
    ``HOST_EXAMPLES`` cases, simulator or not; a kernel exercise draws ``KERNEL_EXAMPLES``
    (few in the simulator). ``max_examples`` overrides both. A strategy with fewer distinct
    cases than that is checked on all of them (the message says how many ran).

    Returns True when every case passed. Used by the notebooks' exercise cells.
    """
    from hypothesis import HealthCheck, find, settings
    from hypothesis.errors import NoSuchExample

    def fails(case):
        fails.calls += 1
        try:
            prop(case)
        except Exception as exc:  # a wrong answer, or code that does not run yet
            fails.last_error = exc
            return True
        return False

    fails.calls = 0
    n = max_examples or (HOST_EXAMPLES if host else KERNEL_EXAMPLES)
    try:
        # From Hypothesis's own defaults, not the loaded test profile: the checker draws
        # afresh each run (the ci profile derandomizes) and shrinks (the mutants one does not).
        smallest = find(strategy, fails, settings=settings(
            settings.get_profile("default"), max_examples=n, deadline=None, database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]))
    except NoSuchExample:
        print(f"passed: {fails.calls} drawn cases agree with the oracle")
        return True
    fails(smallest)
    print(f"not yet: smallest failing case {smallest!r}")
    print(f"  {type(fails.last_error).__name__}: {str(fails.last_error)[:500]}")
    return False
