"""FlashAttention-1's loop order (``kernels/kv_outer_forward.py``): the answer against the
float64 oracle with the course's tolerance rule, and its HBM traffic counted element by
element in the simulator against the closed forms of ``hbm_elements`` (both loop orders:
chapter 4's query-tile rung is FlashAttention-2's)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kernels import reference as ref
from kernels.base.runtime import on_simulator
from kernels.base.testing import gpu_examples, assert_close, attention_cases, case_with, forward_floor_scales
from kernels.kv_outer_forward import hbm_elements, kv_outer_attention

SIM = on_simulator()
TILES = [(8, 8), (3, 5), (1, 1)] if SIM else [(64, 64), (32, 16), (17, 8)]
EXAMPLES = [
    case_with((1, 1, 1, 4), (1, 1, 1, 4)),                                  # N = 1
    case_with((2, 1, 11, 7), (2, 1, 5, 7), causal=True),                    # Nq > Nk: rows that see no key
    case_with((1, 1, 9, 16), (1, 1, 9, 16), magnitude=100.0),               # logits ~ +-1e4
    case_with((1, 2, 6, 8), (1, 2, 0, 8), causal=True),                     # Nk = 0: O = 0, L = -inf
]


def check(case, tiles):
    o, lse = kv_outer_attention(case.q, case.k, case.v, causal=case.causal, scale=case.scale, tiles=tiles)
    exact_o, exact_l = ref.attention(case.q, case.k, case.v, causal=case.causal, scale=case.scale)
    base_o, base_l = ref.attention(case.q, case.k, case.v, causal=case.causal, scale=case.scale, dtype=np.float32)
    fs_o, fs_l = forward_floor_scales(case.q, case.k, case.v, case.scale, causal=case.causal)
    owner = f"row i of head b*H + h, in step (K/V tile, query tile i // {tiles[0]}) of block b*H + h"
    assert_close(o, exact_o, base_o, name=f"O ({owner})", floor_scale=fs_o)
    assert_close(lse, exact_l, base_l, name=f"L ({owner})", floor_scale=fs_l)


def with_examples(test):
    for case in EXAMPLES:
        test = example(case=case, tiles=TILES[0])(test)
    return test


@given(case=attention_cases(max_n=24 if SIM else 300, max_d=8 if SIM else 128), tiles=st.sampled_from(TILES))
@settings(max_examples=8 if SIM else gpu_examples(150))
@with_examples
def test_matches_oracle(case, tiles):
    check(case, tiles)


@pytest.mark.skipif(not SIM, reason="counts every element access in the simulator (kernels.base.trace)")
@pytest.mark.parametrize("n_q, n_k, d, Br, Bc", [(10, 13, 5, 4, 3), (7, 16, 3, 8, 8), (1, 5, 2, 3, 2)])
def test_hbm_traffic_is_the_closed_form(n_q, n_k, d, Br, Bc):
    """Every element read and written in HBM, counted, equals ``hbm_elements`` for both loop
    orders: Algorithm 1 (this kernel) and FlashAttention-2's (chapter 4's query-tile rung)."""
    from kernels.base.trace import tracing
    from kernels.flash_forward import query_tile_attention

    rng = np.random.default_rng(n_q * 100 + n_k)
    q, k, v = (rng.standard_normal((1, 1, n, d)).astype(np.float32) for n in (n_q, n_k, n_k))
    for order, run in (("kv-outer", lambda: kv_outer_attention(q, k, v, tiles=(Br, Bc))),
                       ("q-outer", lambda: query_tile_attention(q, k, v, tiles=(Br, Bc)))):
        with tracing() as launches:
            run()
        (t,) = launches
        glob = [a for a in t.arrays if a.memory == "global"]
        counted = {"read": sum(a.n_reads for a in glob), "written": sum(a.n_writes for a in glob)}
        assert counted == hbm_elements(n_q, n_k, d, Br, Bc, order), \
            f"{order}: counted {counted}, closed form {hbm_elements(n_q, n_k, d, Br, Bc, order)}"


def test_algorithm_1_moves_the_state_tc_times():
    """At the course's reference size the kv-outer order moves Q, O, l and m once per K/V
    tile: its traffic grows with Tc, FlashAttention-2's with Tr on K and V."""
    n, d = 4096, 64
    a = hbm_elements(n, n, d, 64, 64, "kv-outer")
    b = hbm_elements(n, n, d, 64, 64, "q-outer")
    tc = n // 64
    assert a["written"] == n * d + 2 * n + tc * (n * d + 2 * n) + n
    assert b["written"] == n * d + n
    assert a["read"] + a["written"] > 1.4 * (b["read"] + b["written"])


def test_bad_inputs_name_the_argument():
    x = np.zeros((1, 1, 4, 8), np.float32)
    with pytest.raises(TypeError, match="q"):
        kv_outer_attention(x.astype(np.float64), x, x)
    with pytest.raises(ValueError, match="tiles"):
        kv_outer_attention(x, x, x, tiles=(0, 4))
    with pytest.raises(ValueError, match="order"):
        hbm_elements(4, 4, 8, 2, 2, "diagonal")
