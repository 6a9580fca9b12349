"""The M < d^2 algorithm of [5] as GPU kernels (``kernels/small_cache_attention.py``): the
answer against the float64 oracle with the course's tolerance rule on drawn shapes (ragged
N, Nq != Nk, causal, d past several chunks of a small tile), its HBM traffic counted element
by element in the simulator against ``hbm_elements`` and ``io_theory.small_cache_accesses``,
a planted bug (the last chunk of d dropped) caught, bad inputs named."""

from __future__ import annotations

import importlib.util
import sys

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kernels import io_theory
from kernels import reference as ref
from kernels.base.runtime import on_simulator
from kernels.base.testing import gpu_examples, assert_close, attention_cases, case_with, forward_floor_scales
from kernels.small_cache_attention import default_tile, hbm_elements, small_cache_attention

SIM = on_simulator()
TILES = [3, 4, None] if SIM else [16, 37, None]
EXAMPLES = [
    (case_with((1, 1, 1, 4), (1, 1, 1, 4)), 3),                              # N = 1
    (case_with((1, 1, 7, 5), (1, 1, 3, 5), causal=True), 2),                 # Nq > Nk: rows that see no key
    (case_with((1, 1, 5, 40), (1, 1, 6, 40), causal=True), 8),               # d = 40: five chunks of d
    (case_with((1, 1, 6, 9), (1, 1, 6, 9), magnitude=100.0), 4),             # logits ~ +-1e4
    (case_with((1, 1, 4, 8), (1, 1, 0, 8), causal=True), 3),                 # Nk = 0: O = 0, L = -inf
]


def check(case, tile, run=small_cache_attention):
    o, lse = run(case.q, case.k, case.v, causal=case.causal, scale=case.scale, tile=tile)
    exact_o, exact_l = ref.attention(case.q, case.k, case.v, causal=case.causal, scale=case.scale)
    base_o, base_l = ref.attention(case.q, case.k, case.v, causal=case.causal, scale=case.scale, dtype=np.float32)
    fs_o, fs_l = forward_floor_scales(case.q, case.k, case.v, case.scale, causal=case.causal)
    assert o.dtype == np.float32 and lse.dtype == np.float32
    b = default_tile() if tile is None else tile
    owner = f"row i of head b*H + h: output block (i // {b}, column // {b}) of that head"
    assert_close(o, exact_o, base_o, name=f"O ({owner})", floor_scale=fs_o)
    assert_close(lse, exact_l, base_l, name="L (row i of head b*H + h, chapter 3's row softmax)", floor_scale=fs_l)


def with_examples(test):
    for case, tile in EXAMPLES:
        test = example(case=case, tile=tile)(test)
    return test


@given(case=attention_cases(max_n=10 if SIM else 300, max_d=12 if SIM else 256), tile=st.sampled_from(TILES))
@settings(max_examples=4 if SIM else gpu_examples(150))
@with_examples
def test_matches_oracle(case, tile):
    check(case, tile)


@pytest.mark.skipif(not SIM, reason="counts every element access in the simulator (kernels.base.trace)")
def test_hbm_traffic_is_the_closed_form():
    """Every element read and written in HBM, launch by launch, equals ``hbm_elements``; and
    against ``io_theory.small_cache_accesses`` (same b, an L-only softmax pass, exp(S - L)
    in the P V product) the kernels write P over S (+ N^2) and never read L (- N Td)."""
    from kernels.base.trace import tracing

    n, d, M = 10, 7, 30                                    # b = 3: T = 4 row blocks, Td = 3 chunks of d
    b = io_theory.small_cache_tile(M)
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 1, n, d)).astype(np.float32) for _ in range(3))
    with tracing() as launches:
        small_cache_attention(q, k, v, tile=b)
    counted = [(sum(a.n_reads for a in t.arrays if a.memory == "global"),
                sum(a.n_writes for a in t.arrays if a.memory == "global")) for t in launches]
    model = hbm_elements(n, n, d, b)
    assert counted == [model["scores"], model["softmax"], model["pv"]]
    formula = io_theory.small_cache_accesses(n, d, M)
    td = -(-d // b)
    assert sum(r for r, _ in counted) == formula["reads"] - n * td
    assert sum(w for _, w in counted) == formula["writes"] + n * n


def test_writing_s_costs_less_than_the_products_below_d_squared():
    """The algorithm's point: for M < d^2 the N^2 of S (and of P) is below Theta(N^2 d / sqrt(M)),
    and the whole count is a constant times it (H100: d = 256 fp32, b = 139: about 3 d / b
    + Td + 3 = 10.5 accesses per score, against d / sqrt(M) = 1.06 for the order)."""
    n, d, M = 4096, 256, io_theory.h100_regime(256, 4)["M"]
    b = io_theory.small_cache_tile(M)
    assert b == 139 and M < d * d
    count = hbm_elements(n, n, d, b)
    total = count["read"] + count["written"]
    assert n * n < io_theory.small_cache_order(n, d, M)
    assert total == io_theory.small_cache_accesses(n, d, M)["total"] + n * n - n * -(-d // b)
    assert 10 < total / io_theory.small_cache_order(n, d, M) < 10.5


def test_planted_bug_missing_last_chunk_of_d_is_caught():
    """The inner sum stopping one chunk early (here: the last chunk of d in S = Q K^T, and
    of N in P V) must fail the oracle test."""
    import kernels.small_cache_attention as good

    source = open(good.__file__).read()
    snippet = "for k0 in range(0, k_end, B):"
    assert source.count(snippet) == 1
    spec = importlib.util.spec_from_loader("small_cache_mutant", loader=None)
    mutant = importlib.util.module_from_spec(spec)
    sys.modules["small_cache_mutant"] = mutant
    try:
        exec(compile(source.replace(snippet, "for k0 in range(0, k_end - B, B):"), good.__file__, "exec"),
             mutant.__dict__)
        with pytest.raises(AssertionError):
            check(case_with((1, 1, 4, 7), (1, 1, 5, 7)), 3, run=mutant.small_cache_attention)
    finally:
        del sys.modules["small_cache_mutant"]


def test_bad_inputs_name_the_argument():
    x = np.zeros((1, 1, 4, 8), np.float32)
    with pytest.raises(TypeError, match="q"):
        small_cache_attention(x.astype(np.float64), x, x)
    with pytest.raises(ValueError, match="q: expected head dim"):
        y = np.zeros((1, 1, 4, 257), np.float32)
        small_cache_attention(y, y, y)
    with pytest.raises(ValueError, match="tile"):
        small_cache_attention(x, x, x, tile=0)
    with pytest.raises(ValueError, match="tile"):
        small_cache_attention(x, x, x, tile=10**4)
    with pytest.raises(TypeError, match="tile"):
        small_cache_attention(x, x, x, tile=2.0)
    with pytest.raises(TypeError, match="causal"):
        small_cache_attention(x, x, x, causal=1)
    with pytest.raises(ValueError, match="scale"):
        small_cache_attention(x, x, x, scale=-1.0)
