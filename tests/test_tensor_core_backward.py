"""Chapter 12: the backward on tensor cores (fp16/bf16 in) against the float64 oracle.

The oracle (``kernels.reference.attention_backward``) runs in float64 on the inputs as
rounded to fp16 or bf16, with K and V repeated over each group of query heads (GQA) and
dK, dV summed back over the group. The o and lse given to the backward are the oracle
forward's, rounded to float32, as in chapter 5's tests. The yardstick is
``rounded_backward_numpy``: float32 NumPy that rounds P and dS to the input type before
the products that use them, as the kernel (and FlashAttention-2) does. Each gradient must
be within 2x the yardstick's error of the oracle, plus chapter 5's gradient floors
(``gradient_floor_scales``). Drawn: fp16 or bf16, causal, scale, ragged Nq != Nk (N = 0
too), d not a multiple of 8 (padded to D; dQ then takes the scalar atomic adds), GQA
groups of 1 and 2, logit spreads. Pinned: N = 1, rows that see no key, big logits, one
past a query tile and a key tile, GQA with causal.
"""

import numpy as np
import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from kernels import reference as ref
from kernels.base.query_split import choose_query_splits
from kernels.base.runtime import ArrayKind, on_simulator
from kernels.base.testing import (gpu_examples, Floor, assert_close, case_with, gradient_floor_scales,
                                  grouped_attention_cases, over_group)
from kernels.tensor_core_backward import (backward_checked, flash_attention_backward_tc, launch_backward,
                                          rounded_backward_numpy, tc_backward_tiles)
from test_flash_tensor_cores import _Bf16Interface, to_input   # chapter 8's inputs (fp16, bf16 bits) and values

SIM = on_simulator()
# The simulator runs each of a block's 32 W threads in Python (a launch of one block takes
# seconds): one tile of queries and keys there, B * H <= 2.
MAX_N = 24 if SIM else 300
HEAD_DIMS = [4, 13, 16] if SIM else [16, 40, 64, 100, 128]     # 4, 13, 40, 100: d % 8 != 0
BR, W, _ = tc_backward_tiles(16)
BC = 16 * W                                                    # keys a block
WHERE = {"dQ": "(row [b, h, i]: the atomic adds of every key block)",
         "dK": f"(row [b, hkv, j]: warp (j % {BC}) // 16 of block (j // {BC}, b*Hkv + hkv))"}
WHERE["dV"] = WHERE["dK"]


def tc_backward_cases():
    """The drawn cases at this file's sizes (``kernels.base.testing.grouped_attention_cases``)."""
    return grouped_attention_cases(max_n=MAX_N, head_dims=HEAD_DIMS, small=SIM, dtype=np.float64)


def pinned(q_shape, k_shape, *, causal=False, scale=None, magnitude=1.0, seed=0):
    return case_with(q_shape, k_shape, causal=causal, scale=scale, magnitude=magnitude, seed=seed, dtype=np.float64)


class Inputs:
    """A case as the kernel takes it (fp16, or bf16 bits as uint16) and as the oracle sees
    it (float64 values of the 16-bit inputs); o, lse from the float64 forward, in float32."""

    def __init__(self, case, bf16, seed=1, o_16bit=False):
        self.case, self.bf16 = case, bf16
        self.group = case.q.shape[1] // case.k.shape[1]
        self.q, self.qx = to_input(case.q, bf16)
        self.k, self.kx = to_input(case.k, bf16)
        self.v, self.vx = to_input(case.v, bf16)
        self.do, self.dox = to_input(np.random.default_rng(seed).standard_normal(case.q.shape), bf16)
        o, lse = ref.attention(self.qx, *self.repeated(self.kx, self.vx), causal=case.causal, scale=case.scale)
        self.o, self.ox = o.astype(np.float32), o.astype(np.float32)
        if o_16bit:                                           # o in the inputs' type: the oracle takes it so
            self.o, self.ox = to_input(self.ox, bf16)
        self.lse = lse.astype(np.float32)

    def repeated(self, *xs):
        return (np.repeat(x, self.group, axis=1) for x in xs)

    def run(self, splits=None):
        c = self.case
        if splits is None:
            return flash_attention_backward_tc(self.q, self.k, self.v, self.o, self.lse, self.do, causal=c.causal,
                                               scale=c.scale, bf16=self.bf16)
        # the checked entry, the query tiles split among ``splits`` blocks a key tile
        scale = c.scale if c.scale is not None else 1 / np.sqrt(c.q.shape[-1])
        return backward_checked(ArrayKind(self.q), self.q, self.k, self.v, self.o, self.lse, self.do,
                                causal=c.causal, scale=scale, bf16=self.bf16, splits=splits)

    def run_chunks(self, chunks):
        """The bare launches (``launch_backward``) with the query loop taking ``chunks`` 16-query
        chunks a step (``tiles=(Br, W, 0, chunks)``, Br and W as the launcher takes them at
        this d: at d = 128 the d = 16 tiles' Br = 128 would ask more shared memory than a
        block has); Nq, Nk > 0."""
        from numba import cuda

        c = self.case
        B, H, n_q, d = self.q.shape
        n_k = self.k.shape[2]
        flat = lambda a: cuda.to_device(np.ascontiguousarray(a).reshape(-1, a.shape[-2], a.shape[-1]))   # noqa: E731
        bits = lambda a: flat(np.ascontiguousarray(a).view(np.uint16))                                    # noqa: E731
        dq, dk, dv = (cuda.device_array((B * h, n, d), np.float32) for h, n in ((H, n_q), (self.k.shape[1], n_k),
                                                                                 (self.k.shape[1], n_k)))
        delta, l2 = (cuda.device_array((B * H, n_q), np.float32) for _ in range(2))
        o = bits(self.o) if self.o.dtype != np.float32 else flat(self.o)
        scale = c.scale if c.scale is not None else 1 / np.sqrt(d)
        launch_backward(bits(self.q), bits(self.k), bits(self.v), o, cuda.to_device(self.lse.reshape(B * H, n_q)),
                        bits(self.do), delta, l2, dq, dk, dv, scale, int(c.causal), self.bf16,
                        tiles=tc_backward_tiles(d)[:2] + (0, chunks))    # the tiles the launcher takes at d
        return tuple(g.copy_to_host().reshape(B, -1, g.shape[1], d) for g in (dq, dk, dv))

    def check(self, got, floors_from=None):
        """Each gradient under the rule; NaN exactly where the oracle's is (assert_close).
        ``floors_from``: finite (q, k, v, o, lse, do) to take the floors from."""
        c, hkv = self.case, self.k.shape[1]
        kw = dict(causal=c.causal, scale=c.scale)
        kr, vr = self.repeated(self.kx, self.vx)
        with np.errstate(invalid="ignore", over="ignore"):
            dq, dk, dv = ref.attention_backward(self.qx, kr, vr, self.ox, self.lse, self.dox, **kw)
            exact = (dq, over_group(dk, hkv), over_group(dv, hkv))
            yardstick = rounded_backward_numpy(self.qx, self.kx, self.vx, self.ox, self.lse, self.dox,
                                               bf16=self.bf16, **kw)
        fq, fk, fv = gradient_floor_scales(*(floors_from or (self.qx, kr, vr, self.ox, self.lse, self.dox)), **kw)
        floors = (fq, Floor(over_group(fk.value, hkv), fk.why), Floor(over_group(fv.value, hkv), fv.why))
        for name, g, e, y, f in zip(("dQ", "dK", "dV"), got, exact, yardstick, floors):
            assert g.dtype == np.float32, f"{name}: dtype {g.dtype}"
            assert_close(g, e, y, name=f"{name} ({'bf16' if self.bf16 else 'fp16'}) {WHERE[name]}", floor_scale=f)


ONE_PAST_Q, ONE_PAST_K = BR + 1, BC + 1


@given(case=tc_backward_cases(), bf16=st.booleans(), seed=st.integers(0, 2**16))
@settings(max_examples=5 if SIM else gpu_examples(200))
@example(case=pinned((1, 1, 1, 4), (1, 1, 1, 4)), bf16=False, seed=0)                              # N = 1
@example(case=pinned((1, 1, 13, 13), (1, 1, 5, 13), causal=True), bf16=False, seed=1)              # Nq > Nk
@example(case=pinned((1, 2, 19, 16), (1, 1, 23, 16), causal=True), bf16=True, seed=2)              # GQA, causal
@example(case=pinned((1, 1, 17, 16), (1, 1, 19, 16), scale=0.37, magnitude=8.0), bf16=False, seed=3)  # big logits
@example(case=pinned((1, 1, ONE_PAST_Q, 13), (1, 1, ONE_PAST_K, 13), causal=True), bf16=True, seed=4)  # one past
@example(case=pinned((1, 2, 6, 8), (1, 1, 0, 8), causal=True), bf16=False, seed=5)                 # Nk = 0
@example(case=pinned((1, 2, 0, 8), (1, 2, 7, 8)), bf16=True, seed=6)                               # Nq = 0
@example(case=pinned((1, 1, BR + 8, 16), (1, 1, BC + 13, 16), causal=True), bf16=False, seed=7)    # skipped tiles
@example(case=pinned((1, 1, BR + 5, 24), (1, 1, BC + 3, 24)), bf16=True, seed=8)                   # d = 24 < D = 32
def test_gradients_match_the_oracle(case, bf16, seed):
    """Pinned: N = 1 (dS = 0 up to rounding: the floors decide); Nq > Nk causal (rows 0..7
    see no key: L = -inf, zero gradients); GQA group 2, causal, d = 16 (cp.async copies,
    dQ's paired adds); logits of several hundred (P nearly one-hot: dS = P (dP - D) cancels); one
    past a query tile (the next tile's copies) and a key tile (a second block, skipping
    the first query tile); empty sequences (zeros of the right shapes, no launch); causal with
    Nk - Nq = 5 over two query and two key tiles (the second key tile is first seen by the
    last rows of the first query tile, which its walk must not skip); d = 24, D = 32 (the
    tile copy by column: two chunks a thread, a row tile apart, the chunk past d zeros)."""
    x = Inputs(case, bf16, seed)
    got = x.run()
    x.check(got)
    if case.causal and case.q.shape[2] > case.k.shape[2]:
        dead = case.q.shape[2] - case.k.shape[2]
        assert np.isneginf(x.lse[..., :dead]).all() and (got[0][..., :dead, :] == 0).all(), "rows that see no key"


@given(case=tc_backward_cases(), bf16=st.booleans(), seed=st.integers(0, 2**16), splits=st.integers(2, 5))
@settings(max_examples=3 if SIM else gpu_examples(100))
@example(case=pinned((1, 2, 3 * BR + 1, 16), (1, 1, BC + 1, 16), causal=True), bf16=True, seed=7, splits=3)
@example(case=pinned((1, 1, 13, 13), (1, 1, 5, 13), causal=True), bf16=False, seed=1, splits=4)
def test_queries_split_among_blocks_meet_the_same_rule(case, bf16, seed, splits):
    """The split backward (``kernels.base.query_split``): S blocks a key tile, each a share
    of the (query head, query tile) pairs, adding dK_j and dV_j into zeroed gradients. Pinned:
    GQA's two heads and causal shares (the last key tile sees one query tile a head), and
    more splits than pairs (empty shares)."""
    x = Inputs(case, bf16, seed)
    x.check(x.run(splits=splits))


@given(case=tc_backward_cases(), bf16=st.booleans(), seed=st.integers(0, 2**16))
@settings(max_examples=2 if SIM else gpu_examples(40))
@example(case=pinned((1, 2, 19, 16), (1, 1, 23, 16), causal=True), bf16=True, seed=2)              # GQA, causal
def test_one_chunk_a_step_meets_the_same_rule(case, bf16, seed):
    """``CC = 1``: the query loop one 16-query chunk a step (the kernel's default takes two
    wherever Br / 16 is even, as at every tile it chooses) still meets the rule."""
    assume(case.q.shape[2] > 0 and case.k.shape[2] > 0)      # (the bare launches take no empty sequence)
    x = Inputs(case, bf16, seed)
    x.check(x.run_chunks(1))


def test_splits_only_where_the_grid_is_too_small():
    """choose_query_splits: none unless two splits of every block fit in one wave; else as
    many as fit, at least two query tiles a split, at most 16."""
    assert choose_query_splits(67, 1 << 20, 128, sms=132) == 1         # 2 x 67 > 132
    assert choose_query_splits(32, 4096, 128, sms=132) == 4            # 32 blocks x 4 <= 132
    assert choose_query_splits(1, 1 << 20, 128, sms=132) == 16         # at most 16
    assert choose_query_splits(8, 1024, 128, sms=132) == 4             # 8 query tiles: 4 splits of 2
    assert choose_query_splits(8, 256, 128, sms=132) == 1              # 2 query tiles: no split


def test_big_logits_are_pinned():
    """The example above has logits of several hundred (so that it tests what it says)."""
    c = pinned((1, 1, 17, 16), (1, 1, 19, 16), scale=0.37, magnitude=8.0)
    assert np.abs(c.scale * c.q[0, 0] @ c.k[0, 0].T).max() > 200


@pytest.mark.parametrize("bf16", [False, True], ids=["fp16", "bf16"])
def test_o_in_the_inputs_type(bf16):
    """O as the 16-bit type (what a fp16 / bf16 forward stores) instead of float32: the
    same gradients, under the rule, for D = rowsum(dO o O) of the rounded O."""
    case = pinned((1, 1, 18, 13), (1, 1, 21, 13), causal=True, seed=7)
    x = Inputs(case, bf16, seed=7, o_16bit=True)
    assert x.o.dtype == (np.uint16 if bf16 else np.float16)
    x.check(x.run())


@pytest.mark.parametrize("d", [40] if SIM else [40, 72, 100])
def test_head_dims_with_an_odd_number_of_column_pairs(d):
    """D / 16 odd (D = 48, 80, 112): dQ's pieces of 16 x 16 CP columns must still tile D."""
    x = Inputs(pinned((1, 1, 9, d), (1, 1, 11, d), causal=True, seed=d), False, seed=11)
    x.check(x.run())


def test_a_bound_call_shape_takes_each_calls_arrays():
    """The launcher binds its launches once a call shape (``BackwardLaunches``); a second call
    of that shape with other values (and fresh output arrays) gets its own gradients, and a
    third with the other causal flag its own launches."""
    shape_q, shape_k = (1, 2, 21, 16), (1, 1, 19, 16)
    first, second = (Inputs(pinned(shape_q, shape_k, causal=True, seed=s), False, seed=s) for s in (31, 32))
    first.check(first.run())
    second.check(second.run())
    third = Inputs(pinned(shape_q, shape_k, causal=False, seed=33), False, seed=33)
    third.check(third.run())


# --------------------------------------------------------------------------- NaN

# A NaN in one row of dO (or of L) reaches the gradients that row touches: its row of dQ,
# and the rows of dK and dV of the keys it sees; everything else stays finite and within
# the rule. The oracle's dense formulas take 0 x NaN = NaN for the keys a row does not
# see, where the kernel simply masks them (P = dS = 0 assigned, or a key tile skipped):
# a row of dO planted with causal masking is the last one (it sees every key).
NAN_CASES = [
    ("do", False, 6, False),           # non-causal: a middle row
    ("do", True, 16, True),            # causal: the last row (sees every key)
    ("lse", True, 6, False),           # L = NaN is not a dead row (-inf): its P is NaN
]


@pytest.mark.parametrize("where, causal, row, bf16", NAN_CASES, ids=["do", "do-causal-last-row", "lse"])
def test_nan_reaches_what_its_row_touches(where, causal, row, bf16):
    case = pinned((1, 1, 17, 13), (1, 1, 11, 13), causal=causal, seed=8)    # causal: rows 0..5 see no key
    x = Inputs(case, bf16, seed=9)
    clean = (x.qx, x.kx, x.vx, x.ox, x.lse.copy(), x.dox.copy())
    if where == "do":
        dox = x.dox.copy()
        dox[0, 0, row, 2] = np.nan
        x.do, x.dox = to_input(dox, bf16)
    else:
        x.lse = x.lse.copy()
        x.lse[0, 0, row] = np.nan
    dq, dk, dv = got = x.run()
    seen = np.arange(11) <= row + (11 - 17) if causal else np.ones(11, bool)   # the keys row sees
    assert np.isnan(dq[0, 0]).any(axis=-1).tolist() == [r == row for r in range(17)], "dQ: rows with a NaN"
    for name, g in (("dK", dk), ("dV", dv)):
        assert np.isnan(g[0, 0]).any(axis=-1).tolist() == seen.tolist(), f"{name}: rows with a NaN"
    x.check(got, floors_from=clean)


# --------------------------------------------------------------------------- bad input

def _good():
    h = np.zeros((1, 2, 4, 8), np.float16)
    return dict(q=h, k=h[:, :1, :5], v=h[:, :1, :5], o=np.zeros((1, 2, 4, 8), np.float32),
                lse=np.zeros((1, 2, 4), np.float32), do=h)


@pytest.mark.parametrize("change, error, name", [
    (dict(q=np.zeros((1, 2, 4, 8), np.float32)), TypeError, "q"),                 # fp16 (or bf16 bits) only
    (dict(q=np.zeros((2, 4, 8), np.float16)), ValueError, "q"),
    (dict(v=np.zeros((1, 1, 6, 8), np.float16)), ValueError, "v"),                # v's shape is not k's
    (dict(k=np.zeros((1, 1, 5, 7), np.float16), v=np.zeros((1, 1, 5, 7), np.float16)), ValueError, "k"),
    (dict(k=np.zeros((2, 1, 5, 8), np.float16), v=np.zeros((2, 1, 5, 8), np.float16)), ValueError, "k"),
    (dict(q=np.zeros((1, 3, 4, 8), np.float16), o=np.zeros((1, 3, 4, 8), np.float32),
          lse=np.zeros((1, 3, 4), np.float32), do=np.zeros((1, 3, 4, 8), np.float16),
          k=np.zeros((1, 2, 5, 8), np.float16), v=np.zeros((1, 2, 5, 8), np.float16)), ValueError, "k"),  # 3 % 2
    (dict(q=np.zeros((1, 2, 4, 136), np.float16), k=np.zeros((1, 1, 5, 136), np.float16),
          v=np.zeros((1, 1, 5, 136), np.float16), o=np.zeros((1, 2, 4, 136), np.float32),
          do=np.zeros((1, 2, 4, 136), np.float16)), ValueError, "q"),             # d > 128
    (dict(o=np.zeros((1, 2, 5, 8), np.float32)), ValueError, "o"),
    (dict(o=np.zeros((1, 2, 4, 8), np.float64)), TypeError, "o"),
    (dict(lse=np.zeros((1, 2, 3), np.float32)), ValueError, "lse"),
    (dict(lse=np.zeros((1, 2, 4, 1), np.float32)), ValueError, "lse"),
    (dict(lse=np.zeros((1, 2, 4), np.float64)), TypeError, "lse"),
    (dict(do=np.zeros((1, 2, 4, 8), np.float32)), TypeError, "do"),
    (dict(do=np.zeros((1, 2, 3, 8), np.float16)), ValueError, "do"),
    (dict(k=_Bf16Interface()), TypeError, "k"),                                   # bf16 without the flag
    (dict(bf16=True), TypeError, "q"),                                            # bf16 wants uint16 bits
    (dict(bf16=1), TypeError, "bf16"),
    (dict(causal="yes"), TypeError, "causal"),
    (dict(scale=-1.0), ValueError, "scale"),
])
def test_bad_inputs_name_the_argument(change, error, name):
    args = _good()
    args.update(change)
    options = {key: args.pop(key) for key in ("bf16", "causal", "scale") if key in args}
    with pytest.raises(error, match=rf"^{name}\b"):
        flash_attention_backward_tc(args["q"], args["k"], args["v"], args["o"], args["lse"], args["do"], **options)


# --------------------------------------------------------------------------- GPU sizes

@pytest.mark.skipif(SIM, reason="N = 2048 is for the GPU")
@pytest.mark.parametrize("d, causal, hkv, bf16", [(64, False, 2, False), (64, True, 1, True), (128, False, 1, True),
                                                  (128, True, 2, False)])
def test_long_sequence_meets_the_rule(d, causal, hkv, bf16):
    """N = 2048, two query heads (hkv = 1: one group of 2): N / Bc key blocks, each walking
    up to N / Br query tiles of each head of its group; dQ summed by N / Bc blocks' atomic
    adds."""
    case = pinned((1, 2, 2048, d), (1, hkv, 2048, d), causal=causal, seed=d + causal)
    x = Inputs(case, bf16, seed=10)
    x.check(x.run())


def test_torch_bf16_tensors_are_accepted():
    """PyTorch bf16 CUDA tensors in (typestr <V2), torch tensors out; the same dK, dV as
    their bits as uint16 (dQ's atomic adds may differ in the last bits: the rule)."""
    torch = pytest.importorskip("torch")
    if SIM or not torch.cuda.is_available():
        pytest.skip("needs a GPU and PyTorch: the simulator has no CUDA tensors")
    case = pinned((1, 2, 150, 40), (1, 1, 170, 40), causal=True, seed=12)
    x = Inputs(case, True, seed=13)
    as_tensor = lambda a: torch.as_tensor(a.view(np.int16), device="cuda").view(torch.bfloat16)
    got = flash_attention_backward_tc(as_tensor(x.q), as_tensor(x.k), as_tensor(x.v),
                                      torch.as_tensor(x.o, device="cuda"), torch.as_tensor(x.lse, device="cuda"),
                                      as_tensor(x.do), causal=True, bf16=True)
    assert all(isinstance(g, torch.Tensor) and g.is_cuda for g in got), "PyTorch tensors in, PyTorch tensors out"
    got = [g.cpu().numpy() for g in got]
    bits = x.run()
    np.testing.assert_array_equal(got[1], bits[1])
    np.testing.assert_array_equal(got[2], bits[2])
    x.check(got)
