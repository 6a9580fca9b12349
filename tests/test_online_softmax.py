"""Chapter 3: the online-softmax ladder in NumPy, the (m, l) merge, and the row-softmax kernel,
all against the float64 oracle.

Tolerance: ``assert_close`` with the element-by-element floors of ``softmax_floors`` (a
kernel whose error grows 4x fails: tests/test_planted_bugs.py). The drawn logits have
spreads of 0.3 to 8, where p depends on many entries; logits of +-1e4 (one-hot) are
pinned with @example. A NaN or +inf makes its row NaN, and only its row."""

import math
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import assume, example, given
from hypothesis import strategies as st
from numba import cuda

from kernels import reference as ref
from kernels.online_softmax import (
    IDENTITY,
    attend_1pass,
    check_merge_tree,
    chunk_state,
    first_softmax,
    merge,
    merge_tree_cases,
    online_state,
    softmax,
    softmax_2pass,
    softmax_3pass,
)
from kernels.base.runtime import on_simulator
from kernels.base.testing import assert_close, softmax_floors

SIM = on_simulator()
MAX_ROW = 80 if SIM else 20000           # row length n (the simulator runs every thread in Python)
MAX_LEAD = 3 if SIM else 48              # each leading axis
MAX_ELEMS = 2_000_000                    # keeps the float64 oracle quick on the GPU
# Drawn tiles: a few per axis on the GPU, so that the examples share compiled kernels.
TPR_CHOICES = [32, 64] if SIM else [32, 128, 512, 1024]
K_CHOICES = [1, 2, 3, 4] if SIM else [1, 4, 16, 32]
# Spreads of the drawn logits: informative ones (a softmax over many entries); +-30 and
# +-1e4 (one-hot) are pinned with @example.
LOGIT_STDS = [0.3, 1.0, 3.0, 8.0]


@dataclass
class SoftmaxCase:
    x: np.ndarray
    tiles: dict

    def __repr__(self):
        finite = self.x[np.isfinite(self.x)]
        return (f"SoftmaxCase(shape={self.x.shape}, tiles={self.tiles}, "
                f"|x|max={np.abs(finite).max() if finite.size else 0:.3g}, "
                f"-inf entries={int(np.isneginf(self.x).sum())})")


def make_case(shape, *, magnitude=1.0, masked="none", seed=0, **tiles):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * magnitude).astype(np.float32)
    if x.size and masked == "some":
        x[rng.random(shape) < 0.3] = -np.inf
    elif x.size and masked == "rows":                # whole rows of -inf, others untouched
        rows = x.reshape(-1, shape[-1])
        rows[:: 2] = -np.inf
    elif masked == "all":
        x[...] = -np.inf
    return SoftmaxCase(x, tiles)


@st.composite
def softmax_cases(draw):
    lead = draw(st.lists(st.integers(1, MAX_LEAD), min_size=0, max_size=2))
    rows = int(np.prod(lead)) if lead else 1
    n = min(draw(st.integers(0, MAX_ROW)), MAX_ELEMS // rows)
    magnitude = draw(st.sampled_from(LOGIT_STDS))
    masked = draw(st.sampled_from(["none", "none", "some", "rows"]))
    tiles = {}
    if draw(st.booleans()):                          # drawn tiles, else the defaults
        tpr = draw(st.sampled_from(TPR_CHOICES))
        tiles = dict(threads_per_row=tpr,
                     rows_per_block=draw(st.sampled_from([r for r in (1, 2, 4) if tpr * r <= (128 if SIM else 1024)])),
                     per_thread=draw(st.sampled_from(K_CHOICES)))
    return make_case((*lead, n), magnitude=magnitude, masked=masked,
                     seed=draw(st.integers(0, 2**32 - 1)), **tiles)


def check_softmax(case):
    p, lse = softmax(case.x, return_lse=True, **case.tiles)
    assert isinstance(p, np.ndarray) and p.dtype == np.float32 and p.shape == case.x.shape
    assert lse.shape == case.x.shape[:-1]
    floor_p, floor_l = softmax_floors(case.x)
    assert_close(p, ref.softmax(case.x), ref.softmax(case.x, dtype=np.float32), name="p", floor=floor_p)
    assert_close(lse, ref.logsumexp(case.x), ref.logsumexp(case.x, dtype=np.float32), name="lse", floor=floor_l)
    if case.x.size:                                  # rows of all -inf: exactly zeros, L = -inf
        masked = np.all(np.isneginf(case.x), axis=-1)
        assert np.all(p[masked] == 0) and np.all(np.isneginf(lse[masked]))


@given(softmax_cases())
@example(make_case((3, 0)))                                            # row length 0
@example(make_case((0, 7)))                                            # no rows
@example(make_case((5, 1), magnitude=3.0))                             # row length 1
@example(make_case((3, 33), threads_per_row=32, rows_per_block=2, per_thread=1))  # one past the block
@example(make_case((2, 65), threads_per_row=32, rows_per_block=1, per_thread=2))  # one past a chunk: 3 chunks
@example(make_case((4, 20), masked="rows"))                            # rows of all -inf give zeros
@example(make_case((3, 40), masked="all"))                             # every row -inf
@example(make_case((2, 3, 50), magnitude=1e4, masked="some"))          # logits ~1e4, scattered -inf
@example(make_case((3, 70), magnitude=30.0, threads_per_row=32, rows_per_block=2, per_thread=2))  # logits ~30
@example(make_case((7,), magnitude=1.0))                               # rank 1
def test_softmax_matches_oracle(case):
    check_softmax(case)


@given(softmax_cases())
@example(make_case((3, 0)))                                            # row length 0
@example(make_case((4, 20), masked="rows"))                            # rows of all -inf give zeros
@example(make_case((2, 50), magnitude=1e4, masked="some"))             # logits ~1e4, scattered -inf
@example(make_case((2, 70), magnitude=30.0))                           # logits ~30: the max grows often
def test_first_softmax_matches_oracle(case):
    """The notebook's kernel exercise, one thread a row (a learner's version replaces it
    through kernels.base.learner): the oracle and floors of the production kernel."""
    x = case.x.reshape(int(np.prod(case.x.shape[:-1])), case.x.shape[-1])
    p_out = cuda.to_device(np.full(x.shape, np.nan, np.float32))      # NaN: an element never written shows
    l_out = cuda.to_device(np.full(x.shape[:1], np.nan, np.float32))
    first_softmax(x, out=p_out, lse_out=l_out)
    p, lse = p_out.copy_to_host(), l_out.copy_to_host()
    floor_p, floor_l = softmax_floors(x)
    assert_close(p, ref.softmax(x), ref.softmax(x, dtype=np.float32), name="p (row r is thread r's)", floor=floor_p)
    assert_close(lse, ref.logsumexp(x), ref.logsumexp(x, dtype=np.float32), name="lse", floor=floor_l)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")     # inf - inf in simulated threads
@given(softmax_cases(), st.data())
@example(make_case((3, 40), magnitude=3.0), None)
def test_nan_or_inf_in_a_row_reaches_that_row_only(case, data):
    """A NaN or +inf in one entry makes that row's p and L NaN, every entry of it, and no
    other row changes; a -inf is a masked entry, not an error."""
    x = case.x.copy()
    if data is None:                                 # pinned: a NaN in the middle row
        index, bad = (1, 17), np.nan
    else:
        assume(x.size > 0)
        index = tuple(data.draw(st.integers(0, n - 1), label="index") for n in x.shape)
        bad = data.draw(st.sampled_from([np.nan, np.inf, -np.inf]), label="value")
    x[index] = bad
    p, lse = softmax(x, return_lse=True, **case.tiles)
    exact_p, exact_l = ref.softmax(x), ref.logsumexp(x)
    assert np.array_equal(np.isnan(p), np.isnan(exact_p)), "p: NaN in other places than the oracle's"
    assert np.array_equal(np.isnan(lse), np.isnan(exact_l)), "L: NaN in other places than the oracle's"
    row = index[:-1]
    if not np.isneginf(bad):
        assert np.isnan(p[row]).all() and np.isnan(lse[row])
    floor_p, floor_l = softmax_floors(x)
    assert_close(p, exact_p, ref.softmax(x, dtype=np.float32), name="p", floor=floor_p)
    assert_close(lse, exact_l, ref.logsumexp(x, dtype=np.float32), name="lse", floor=floor_l)


def test_softmax_device_in_device_out():
    x = make_case((4, 3, 37), magnitude=5.0, seed=3).x
    d = cuda.to_device(x)
    p, lse = softmax(d, return_lse=True)
    assert not isinstance(p, np.ndarray) and not isinstance(lse, np.ndarray)
    assert p.shape == x.shape and lse.shape == x.shape[:-1]
    assert_close(p.copy_to_host(), ref.softmax(x), ref.softmax(x, dtype=np.float32), name="p")
    assert_close(lse.copy_to_host(), ref.logsumexp(x), ref.logsumexp(x, dtype=np.float32), name="lse")
    empty = softmax(cuda.to_device(np.ones((2, 0), np.float32)))
    assert not isinstance(empty, np.ndarray) and empty.shape == (2, 0)


# --------------------------------------------------------------------------- the NumPy ladder

@st.composite
def numpy_rows(draw):
    shape = (draw(st.integers(0, 4)), draw(st.integers(0, 40)))
    case = make_case(shape, magnitude=draw(st.sampled_from(LOGIT_STDS + [1e4])),
                     masked=draw(st.sampled_from(["none", "some", "rows"])), seed=draw(st.integers(0, 2**32 - 1)))
    return case.x


@given(numpy_rows())
@example(np.full((2, 5), -np.inf, np.float32))
@example(np.zeros((3, 0), np.float32))
def test_ladder_matches_oracle(x):
    exact, base = ref.softmax(x), ref.softmax(x, dtype=np.float32)
    floor_p, floor_l = softmax_floors(x)
    with np.errstate(invalid="raise"):               # no exp(-inf - (-inf)) anywhere
        for fn in (softmax_3pass, softmax_2pass):
            assert_close(fn(x), exact, base, name=fn.__name__, floor=floor_p)
            assert_close(fn(x.astype(np.float64)), exact, np.asarray(exact), name=fn.__name__ + " float64", floor_ulps=1e-6)
        m, l = online_state(x.astype(np.float64))
        with np.errstate(divide="ignore"):
            lse = np.where(l > 0, m + np.log(np.where(l > 0, l, 1)), -np.inf)
        assert_close(lse, ref.logsumexp(x), ref.logsumexp(x, dtype=np.float32), name="online lse", floor=floor_l)


@given(numpy_rows(), st.integers(1, 5), st.integers(0, 2**32 - 1))
def test_attend_1pass_matches_oracle(x, d, seed):
    v = np.random.default_rng(seed).standard_normal((x.shape[-1], d)).astype(np.float32)
    with np.errstate(invalid="raise"):
        o, lse = attend_1pass(x, v)
    exact = ref.softmax(x) @ v.astype(np.float64)
    base = ref.softmax(x, dtype=np.float32) @ v
    assert_close(o, exact, base, name="o")
    assert_close(lse, ref.logsumexp(x), ref.logsumexp(x, dtype=np.float32), name="lse")


# --------------------------------------------------------------------------- the merge operator

@given(merge_tree_cases())
def test_merge_any_order_any_tree(case):
    """THE property: chunk a row, merge the chunk states in a random order along a random
    tree: the whole row's (m, l), m exactly, l within float rounding."""
    check_merge_tree(merge, case)


@given(merge_tree_cases(max_chunks=3))
def test_merge_associative_commutative_identity(case):
    states = [chunk_state(ch) for ch in case.chunks()] + [IDENTITY] * 2
    a, b, c = states[:3]
    with np.errstate(invalid="raise"):
        left, right = merge(merge(a, b), c), merge(a, merge(b, c))
        assert float(left[0]) == float(right[0])                      # m: exactly associative
        assert math.isclose(float(left[1]), float(right[1]), rel_tol=1e-14, abs_tol=0)
        ab, ba = merge(a, b), merge(b, a)
        assert float(ab[0]) == float(ba[0]) and float(ab[1]) == float(ba[1])   # exactly commutative
        for s in (a, IDENTITY):
            e1, e2 = merge(IDENTITY, s), merge(s, IDENTITY)
            assert (float(e1[0]), float(e1[1])) == (float(s[0]), float(s[1])) == (float(e2[0]), float(e2[1]))


def test_merge_float32_any_tree():
    """In float32 the tree order changes l only by rounding."""
    rng = np.random.default_rng(7)
    x = (rng.standard_normal(64) * 10).astype(np.float32)
    chunks = np.split(x, [5, 17, 18, 40])
    states = [online_state(c) for c in chunks]
    direct = online_state(x)
    for perm in (range(5), [4, 2, 0, 3, 1]):
        acc = IDENTITY
        for i in perm:
            acc = merge(acc, states[i])
        assert acc[0] == direct[0]
        assert abs(acc[1] - direct[1]) <= 8 * 64 * np.finfo(np.float32).eps * direct[1]


# --------------------------------------------------------------------------- bad input

X = np.ones((2, 8), np.float32)


@pytest.mark.parametrize("args, kwargs, exc, name", [
    ((None,), {}, TypeError, "x"),
    (([1.0, 2.0],), {}, TypeError, "x"),
    ((X.astype(np.float64),), {}, TypeError, "x"),
    ((np.array(1.0, np.float32),), {}, ValueError, "x"),
    ((X,), dict(threads_per_row=48), ValueError, "threads_per_row"),
    ((X,), dict(threads_per_row=2048), ValueError, "threads_per_row"),
    ((X,), dict(threads_per_row=32.0), TypeError, "threads_per_row"),
    ((X,), dict(per_thread=0), ValueError, "per_thread"),
    ((X,), dict(per_thread=True), TypeError, "per_thread"),
    ((X,), dict(rows_per_block=0), ValueError, "rows_per_block"),
    ((X,), dict(threads_per_row=1024, rows_per_block=2), ValueError, "rows_per_block"),
    ((X,), dict(return_lse="yes"), TypeError, "return_lse"),
])
def test_bad_input_names_the_argument(args, kwargs, exc, name):
    with pytest.raises(exc, match=name):
        softmax(*args, **kwargs)


def test_non_contiguous_device_array_is_refused():
    d = cuda.to_device(np.ones((4, 8), np.float32))
    with pytest.raises(ValueError, match="x"):
        softmax(d[:, ::2])
