"""Chapter 9, one GPU: P shards' partials reduced as a tree (and flat) against the float64 oracle.

The tree's schedule and its NumPy twin; the tree kernel on drawn partials (empty pieces,
rows of nothing but empty pieces, logits up to 300, any P); the whole decode with P
devices (ragged caches, GQA, Nq up to 4, causal rows that see no key, more shards than
keys, logits ~ 1e4, fp16 caches), tree == flat == oracle within the decode chapter's
tolerance rule (``tests/test_decode.py``'s floors); the launcher's validation; and a
planted bug (a level that drops the odd slot when P is not a power of two) that the tests
must catch.
"""

import importlib.util

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_decode import PartialSet, decode_floors, make_case, merge_float32, merge_floors

from kernels import reference as ref
from kernels.base.runtime import on_simulator
from kernels.base.testing import gpu_examples, assert_close
from kernels.decode import merge_partials_numpy
from kernels.tree_attention import (
    MAX_SHARDS,
    prepare_tree_decode,
    shard_ranges,
    tree_decode_attention,
    tree_levels,
    tree_reduce_numpy,
    tree_reduce_partials,
)

SIM = on_simulator()
MAX_N = 40 if SIM else 600
MAX_D = 16 if SIM else 128
MAX_P = 9 if SIM else 70
LOGIT_STDS = (0.5, 3.0, 30.0)


# --------------------------------------------------------------------------- the tree in Python

@pytest.mark.parametrize("shards", list(range(1, 70)) + [127, 128, 129, MAX_SHARDS])
def test_tree_levels_merge_every_slot_once_in_log_depth(shards):
    levels = tree_levels(shards)
    assert len(levels) == (shards - 1).bit_length()                   # ceil(log2 P)
    holds = {s: {s} for s in range(shards)}                           # the shards each live slot holds
    for level in levels:
        slots = [i for i, _ in level] + [j for _, j in level if j is not None]
        assert sorted(slots) == sorted(holds)                         # every live slot, once
        for i, j in level:
            if j is not None:
                holds[i] |= holds.pop(j)
    assert holds == {0: set(range(shards))}


@given(st.data())
def test_tree_in_numpy_is_the_merge(data):
    P = data.draw(st.integers(1, 12), label="P")
    shape = (P, 2, 3)
    rng = np.random.default_rng(data.draw(st.integers(0, 99), label="seed"))
    l_parts = rng.standard_normal(shape) * data.draw(st.sampled_from([1.0, 30.0, 1e4]), label="scale")
    l_parts[rng.random(shape) < data.draw(st.sampled_from([0.0, 0.5, 1.0]), label="empty")] = -np.inf
    o_parts = np.where(np.isfinite(l_parts)[..., None], rng.standard_normal(shape + (4,)), 0.0)
    o, lse = tree_reduce_numpy(o_parts, l_parts)
    exact_o, exact_l = merge_partials_numpy(o_parts, l_parts)
    np.testing.assert_allclose(o, exact_o, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, exact_l, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- the reduction kernels

@st.composite
def partial_sets(draw, max_p=MAX_P):
    n = draw(st.integers(0, 12))
    P = draw(st.integers(1, max_p))
    return PartialSet(S=P, H=draw(st.integers(1, 2)), rows=draw(st.integers(1, 3)), d=draw(st.integers(1, 9)), n=n,
                      cuts=sorted(draw(st.lists(st.integers(0, n), min_size=P - 1, max_size=P - 1))),
                      masked=draw(st.sampled_from([0.0, 0.3, 1.0])),
                      magnitude=draw(st.sampled_from([1.0, 10.0, 300.0])), seed=draw(st.integers(0, 2**31)))


def check_reduction(parts, reduce):
    o, lse = tree_reduce_partials(parts.o_parts, parts.l_parts, reduce=reduce)
    exact_o, exact_l = merge_partials_numpy(parts.o_parts, parts.l_parts)
    base_o, base_l = merge_float32(parts.o_parts, parts.l_parts)
    f_o, f_l = merge_floors(parts.o_parts, parts.l_parts, exact_o, exact_l)
    assert_close(o, exact_o, base_o, floor=f_o, name=f"O ({reduce}; [h, r, c]: block (r, h, c // DC))")
    assert_close(lse, exact_l, base_l, floor=f_l, name=f"L ({reduce}; [h, r]: block (r, h, 0), thread 0)")
    return o, lse


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@given(partial_sets())
@example(PartialSet(S=5, H=1, rows=2, d=3, n=0))                                          # every piece empty
@example(PartialSet(S=7, H=2, rows=2, d=5, n=9, cuts=[0, 2, 2, 5, 9, 9], masked=0.3, magnitude=300.0))
@example(PartialSet(S=3, H=1, rows=3, d=9, n=8, cuts=[1, 8], masked=1.0))                 # rows all masked
@example(PartialSet(S=6, H=1, rows=1, d=4, n=6, cuts=[1, 2, 3, 4, 5]))   # every slot weighs
def test_tree_reduction_of_drawn_partials_matches_the_merge(parts):
    """The tree kernel on any P partials (empty pieces weigh nothing; a row of nothing but
    empty pieces is O = 0, L = -inf) against the float64 merge of the same float32
    partials, with the merge's own floors; the same for the flat reduction."""
    check_reduction(parts, "tree")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("shards", [2, 33] if SIM else [2, 33, 64, 65, 200, MAX_SHARDS])
def test_tree_reduction_of_many_partials(shards):
    """P beyond one level of the block's threads, and (GPU) beyond the columns' split of
    shared memory: P = 200 and 1024 take fewer columns a block."""
    parts = PartialSet(S=shards, H=1, rows=2, d=5 if SIM else 128, n=3 * shards, masked=0.2, magnitude=30.0,
                       seed=shards)
    check_reduction(parts, "tree")
    check_reduction(parts, "flat")


# --------------------------------------------------------------------------- the whole decode

class TreeCase:
    """A decode case (``tests/test_decode.py``'s) and P, the devices."""

    def __init__(self, case, shards):
        self.case, self.shards = case, shards

    def __repr__(self):
        return f"TreeCase({self.case!r}, shards={self.shards})"


def tree_case(shards, **kw):
    return TreeCase(make_case(**kw), shards)


@st.composite
def tree_cases(draw):
    b = draw(st.integers(1, 2))
    hkv = draw(st.integers(1, 3 - b))               # B * Hkv <= 2 (the simulator's cost)
    n_max = draw(st.integers(0, MAX_N))
    lengths = draw(st.one_of(st.none(), st.lists(st.sampled_from([0, min(1, n_max), n_max]) | st.integers(0, n_max),
                                                 min_size=b, max_size=b)))
    case = make_case(b=b, hkv=hkv if SIM else draw(st.integers(1, 3)), group=draw(st.sampled_from([1, 2, 4])),
                     nq=draw(st.integers(1, 4)), n_max=n_max, d=draw(st.integers(1, MAX_D)), lengths=lengths,
                     causal=draw(st.booleans()), scale=draw(st.one_of(st.none(), st.floats(0.05, 2.0))),
                     logit_std=draw(st.sampled_from(LOGIT_STDS)),
                     kv_dtype=draw(st.sampled_from([np.float32, np.float16])), seed=draw(st.integers(0, 2**31)))
    return TreeCase(case, draw(st.integers(1, MAX_P)))


def check(tc, reduce_first="tree"):
    """Tree and flat, on the same P partials, against the oracle with the decode chapter's
    floors (the partials' weights erring by L's floor is in them: both reductions merge
    the same partials), and against each other."""
    c = tc.case
    exact_o, exact_l = ref.decode_attention(c.q, c.k, c.v, c.lengths, c.causal, c.scale)
    base_o, base_l = ref.decode_attention(c.q, c.k, c.v, c.lengths, c.causal, c.scale, dtype=np.float32)
    f_o, f_l = decode_floors(c)
    other = "flat" if reduce_first == "tree" else "tree"
    run = prepare_tree_decode(c.q, c.k, c.v, shards=tc.shards, reduce=reduce_first, cache_lengths=c.lengths,
                              causal=c.causal, scale=c.scale)
    out = {reduce_first: run()}                   # the P devices' partials, then the first reduction
    run.run_reduction(other)                      # the other one, on the same partials
    out[other] = run.result()
    for reduce, (o, lse) in out.items():
        assert o.dtype == np.float32 and lse.dtype == np.float32
        assert o.shape == c.q.shape and lse.shape == c.q.shape[:3]
        assert_close(o, exact_o, base_o, name=f"O ({reduce}, P = {tc.shards})", floor=f_o)
        assert_close(lse, exact_l, base_l, name=f"L ({reduce}, P = {tc.shards})", floor=f_l)
    return out


# (small: each partial block, P x row tiles x B*Hkv of them, costs the simulator ~0.1 s)
HARD_CASES = [
    tree_case(1, b=2, hkv=1, group=2, nq=2, n_max=9, lengths=[9, 4], causal=True),           # one device
    tree_case(5, b=2, hkv=1, group=2, nq=3, n_max=13, d=5, lengths=[13, 2], causal=True),   # P odd; length < Nq
    tree_case(6, b=2, hkv=1, group=2, nq=1, n_max=4, d=3, lengths=[4, 0]),                  # P > N; an empty cache
    tree_case(7, b=1, hkv=1, group=4, nq=4, n_max=23, d=6, causal=True, logit_std=1e4),     # 16 rows; logits ~ 1e4
    tree_case(6, b=1, hkv=1, group=2, nq=2, n_max=17, d=8, causal=True, kv_dtype=np.float16),  # fp16 cache
    tree_case(3, b=1, hkv=1, group=2, nq=1, n_max=11, d=64, lengths=[10]),                  # d = 64 (DC < d on a GPU)
]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("tc", HARD_CASES, ids=repr)
def test_matches_oracle_on_hard_cases(tc):
    check(tc, reduce_first="flat" if tc.shards % 2 else "tree")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@settings(max_examples=max(2, settings().max_examples // 2) if SIM else gpu_examples(60))
@given(tree_cases())
def test_matches_oracle(tc):
    check(tc)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_partials_are_the_shards_attention():
    """``PreparedTreeDecode.partials()``: device s's (O_s, L_s) is the oracle on shard s's
    keys alone (an empty shard: O = 0, L = -inf), and the tree of them is the answer."""
    c = make_case(b=1, hkv=1, group=2, nq=1, n_max=10, d=4, lengths=[10])
    run = prepare_tree_decode(c.q, c.k, c.v, shards=4, cache_lengths=c.lengths)
    o, lse = run()
    o_s, l_s = run.partials()
    assert o_s.shape == (4,) + c.q.shape and l_s.shape == (4,) + c.q.shape[:3]
    for s, (a, b) in enumerate(shard_ranges(10, 4)):
        eo, el = ref.decode_attention(c.q, c.k[:, :, a:b], c.v[:, :, a:b])
        np.testing.assert_allclose(o_s[s], eo, rtol=0, atol=1e-5)
        np.testing.assert_allclose(l_s[s], el, rtol=0, atol=1e-5)
    to, tl = tree_reduce_numpy(o_s, l_s)
    np.testing.assert_allclose(o, to, rtol=0, atol=1e-5)
    np.testing.assert_allclose(lse, tl, rtol=0, atol=1e-5)
    again = run()                                  # the same launches again: the same bits
    assert np.array_equal(o, again[0]) and np.array_equal(lse, again[1])


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_nan_in_a_query_row_reaches_that_row_only():
    c = make_case(b=1, hkv=2, group=2, nq=2, n_max=12, d=4)
    c.q[0, 2, 1, 3] = np.nan
    o, lse = tree_decode_attention(c.q, c.k, c.v, shards=3)
    exact_o, exact_l = ref.decode_attention(c.q, c.k, c.v)
    assert np.array_equal(np.isnan(o), np.isnan(exact_o)) and np.isnan(o[0, 2, 1]).all()
    assert np.array_equal(np.isnan(lse), np.isnan(exact_l)) and np.isnan(lse[0, 2, 1])


@pytest.mark.parametrize("kw, error, match", [
    (dict(shards=0), ValueError, "shards: expected an int in 1..1024"),
    (dict(shards=MAX_SHARDS + 1), ValueError, "shards: expected an int in 1..1024"),
    (dict(shards=2.0), TypeError, "shards: expected an int"),
    (dict(shards=True), TypeError, "shards: expected an int"),
    (dict(shards=2, reduce="ring"), ValueError, "reduce: expected 'tree' or 'flat'"),
    (dict(shards=2, causal=1), TypeError, "causal"),
    (dict(shards=2, cache_lengths=[5]), ValueError, "cache_lengths: expected 0 <= length"),
])
def test_names_bad_arguments(kw, error, match):
    c = make_case(b=1, hkv=1, group=2, n_max=4)
    with pytest.raises(error, match=match):
        tree_decode_attention(c.q, c.k, c.v, **kw)


def test_names_bad_arrays():
    c = make_case(b=1, hkv=1, group=2, n_max=4)
    with pytest.raises(ValueError, match="k_cache"):
        tree_decode_attention(c.q, c.k[:, :, :, :3], c.v[:, :, :, :3], shards=2)
    with pytest.raises(ValueError, match="l_parts: expected shape"):
        tree_reduce_partials(np.zeros((2, 1, 3, 4), np.float32), np.zeros((2, 1, 4), np.float32))
    with pytest.raises(ValueError, match="reduce"):
        tree_reduce_partials(np.zeros((2, 1, 3, 4), np.float32), np.zeros((2, 1, 3), np.float32), reduce="x")


# --------------------------------------------------------------------------- a planted bug

def _mutant(name, edits):
    """kernels.tree_attention loaded from its source with the edits made (each snippet
    exactly once), as a separate module (``tests/mutants.py``'s Mutant does the edits)."""
    from mutants import Mutant

    source = Mutant(name, 9, "kernels.tree_attention", tuple(edits), (), "", "").mutated_source()
    spec = importlib.util.spec_from_loader(f"kernels._mutant_{name.replace('-', '_')}", loader=None)
    module = importlib.util.module_from_spec(spec)
    exec(compile(source, f"<{name}>", "exec"), module.__dict__)
    return module


PLANTED = {
    "tree-drops-odd-slot": [("live = (shards + 2 * stride - 1) // (2 * stride)",
                             "live = shards // (2 * stride)")],
    "tree-odd-slot-not-carried": [("                if c == 0:                        # the state of the next level",
                                   "                if c == 0 and j < shards:         # PLANTED")],
}


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("name", sorted(PLANTED))
def test_the_tests_catch_a_planted_bug(name, monkeypatch):
    """A tree level that loses the slot without a partner (P not a power of two) must fail
    the checks above: on partials where every slot weighs, and on a decode with P = 6 (at
    level 1 slot 4 holds shards 4 and 5 and has no partner)."""
    mutant = _mutant(name, PLANTED[name])
    monkeypatch.setitem(globals(), "tree_reduce_partials", mutant.tree_reduce_partials)
    monkeypatch.setitem(globals(), "prepare_tree_decode", mutant.prepare_tree_decode)
    with pytest.raises(AssertionError):
        check_reduction(PartialSet(S=6, H=1, rows=1, d=4, n=6, cuts=[1, 2, 3, 4, 5]), "tree")
    with pytest.raises(AssertionError):
        check(tree_case(6, b=1, hkv=1, group=2, nq=1, n_max=12, d=4))
    check_reduction(PartialSet(S=4, H=1, rows=1, d=4, n=6, cuts=[1, 2, 3]), "tree")   # (P = 4: no odd slot)
