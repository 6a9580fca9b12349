"""Chapter 7: decode (split-K and stream-K) against the float64 oracle.

O and L for drawn decode batches: ragged cache lengths (0 and 1 included), grouped-query
and multi-query heads, Nq up to 16 with causal masking relative to the end of each cache,
float32 and float16 caches, any split count and any stream-K grid; large logits; NaN
beyond the cache lengths (never read into the result) and in a query row (that row only);
bitwise reproducibility; the stream-K schedule and the split-K rule; the merge in NumPy;
the launcher's validation; the first versions (the notebook's kernel exercises: split-K's
combine and a first partial, which a learner's kernels replace, ``kernels.base.learner``).
"""

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kernels import reference as ref
from kernels.base.fused import padded_head_dim
from kernels.base.runtime import is_device_array, on_simulator
from kernels.base.testing import gpu_examples, Floor, assert_close, attention_floors, magnitude_for_logits, random_array
from kernels.decode import (
    MAX_QUERIES,
    StreamKSchedule,
    check_schedule,
    combine_partials,
    decode_attention,
    decode_numpy,
    first_split_k,
    io_model_bytes,
    merge_partials_numpy,
    plan,
    prepare_decode,
    split_count,
    split_ranges,
    stream_k_schedule,
    wave_efficiency,
)

SIM = on_simulator()
MAX_N = 40 if SIM else 600
MAX_D = 16 if SIM else 128
MAX_NQ = 3 if SIM else MAX_QUERIES
LOGIT_STDS = (0.5, 3.0, 30.0)


class DecodeCase:
    def __init__(self, q, k, v, lengths, causal, scale, schedule, splits, blocks):
        self.q, self.k, self.v, self.lengths = q, k, v, lengths
        self.causal, self.scale, self.schedule, self.splits, self.blocks = causal, scale, schedule, splits, blocks

    @property
    def options(self):
        extra = {"splits": self.splits} if self.schedule == "split-k" else {"blocks": self.blocks}
        return dict(cache_lengths=self.lengths, causal=self.causal, scale=self.scale, schedule=self.schedule,
                    **extra)

    def __repr__(self):
        b, hq, nq, d = self.q.shape
        return (f"DecodeCase(B={b}, Hq={hq}, Hkv={self.k.shape[1]}, Nq={nq}, Nmax={self.k.shape[2]}, d={d}, "
                f"lengths={self.lengths}, causal={self.causal}, scale={self.scale}, kv={self.k.dtype}, "
                f"{self.schedule}, splits={self.splits}, blocks={self.blocks})")


def make_case(b=1, hkv=1, group=1, nq=1, n_max=8, d=4, lengths=None, causal=False, scale=None,
              schedule="stream-k", splits=None, blocks=None, logit_std=3.0, kv_dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    mag = magnitude_for_logits(logit_std, d, scale)
    q = random_array(rng, (b, hkv * group, nq, d), mag)
    k = random_array(rng, (b, hkv, n_max, d), mag, kv_dtype)
    v = random_array(rng, (b, hkv, n_max, d), 1.0, kv_dtype)
    return DecodeCase(q, k, v, lengths, causal, scale, schedule, splits, blocks)


@st.composite
def decode_cases(draw, schedules=("split-k", "stream-k"), kv_dtypes=(np.float32, np.float16)):
    b = draw(st.integers(1, 3))
    hkv = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 2, 4] if SIM else [1, 2, 4, 8, 32]))
    nq = draw(st.integers(0, MAX_NQ))
    n_max = draw(st.integers(0, MAX_N))
    lengths = draw(st.one_of(st.none(), st.lists(st.sampled_from([0, min(1, n_max), n_max, n_max // 2])
                                                 | st.integers(0, n_max), min_size=b, max_size=b)))
    d = draw(st.integers(1, MAX_D))
    schedule = draw(st.sampled_from(schedules))
    return make_case(b=b, hkv=hkv, group=group, nq=nq, n_max=n_max, d=d, lengths=lengths,
                     causal=draw(st.booleans()), scale=draw(st.one_of(st.none(), st.floats(0.05, 2.0))),
                     schedule=schedule,
                     splits=draw(st.one_of(st.none(), st.integers(1, 6))) if schedule == "split-k" else None,
                     blocks=draw(st.one_of(st.none(), st.integers(1, 7))) if schedule == "stream-k" else None,
                     logit_std=draw(st.sampled_from(LOGIT_STDS)),
                     kv_dtype=draw(st.sampled_from(kv_dtypes)), seed=draw(st.integers(0, 2**31)))


def decode_floors(case):
    """Element-by-element floors of O and L: chapter 4's (``attention_floors``) for each
    sequence's query heads against its own keys, plus, for O, the merge of the partials:
    each partial's weight exp(L_s - L) errs by L_s's floor, which moves O by that much of
    |O_s - O| <= 2 max|V| (bounded by L's floor times 2 max|V| over the row's keys)."""
    q, k, v = (np.asarray(x, np.float64) for x in (case.q, case.k, case.v))
    B, hq, nq, d = q.shape
    group = hq // k.shape[1]
    lengths = np.full(B, k.shape[2]) if case.lengths is None else np.asarray(case.lengths)
    f_o, f_l = np.zeros(q.shape), np.zeros((B, hq, nq))
    for b in range(B):
        n = int(lengths[b])
        kb, vb = np.repeat(k[b, :, :n], group, axis=0), np.repeat(v[b, :, :n], group, axis=0)
        f = attention_floors(q[b], kb, vb, causal=case.causal, scale=case.scale)
        vmax = np.abs(vb).max(axis=(-1, -2), initial=0.0)[:, None, None]
        f_l[b] = f.lse.value
        f_o[b] = f.o.value + 2.0 * f.lse.value[..., None] * vmax
    return (Floor(f_o, "O floor: chapter 4's, plus the partials' weights erring by L's floor"),
            Floor(f_l, "L floor: chapter 4's"))


def check(case):
    o, lse = decode_attention(case.q, case.k, case.v, **case.options)
    exact_o, exact_l = ref.decode_attention(case.q, case.k, case.v, case.lengths, case.causal, case.scale)
    base_o, base_l = ref.decode_attention(case.q, case.k, case.v, case.lengths, case.causal, case.scale,
                                          dtype=np.float32)
    assert o.dtype == np.float32 and lse.dtype == np.float32
    assert o.shape == case.q.shape and lse.shape == case.q.shape[:3]
    f_o, f_l = decode_floors(case)
    assert_close(o, exact_o, base_o, name="O", floor=f_o)
    assert_close(lse, exact_l, base_l, name="L", floor=f_l)
    return o, lse


# --------------------------------------------------------------------------- against the oracle

HARD_CASES = [
    make_case(),                                                                          # one key... of 8
    make_case(n_max=1, lengths=[1]),                                                      # a cache of one key
    make_case(b=3, lengths=[8, 0, 1], schedule="split-k", splits=3),                      # empty and one-key caches
    make_case(b=2, hkv=2, group=2, nq=3, n_max=13, lengths=[13, 2], causal=True, schedule="stream-k",
              blocks=3),                                                                  # GQA, causal, len < Nq
    make_case(b=2, hkv=1, group=4, nq=2, n_max=11, d=5, causal=True, kv_dtype=np.float16,
              schedule="split-k", splits=4),                                              # MQA, fp16 cache
    make_case(b=1, hkv=2, nq=2, n_max=9, d=3, logit_std=1e4, lengths=[9], schedule="stream-k",
              blocks=5),                                                                  # logits ~ 1e4
    make_case(b=1, hkv=1, nq=0, n_max=5),                                                 # Nq = 0
    make_case(b=2, hkv=1, group=2, nq=2, n_max=9, d=64, lengths=[9, 3], causal=True, kv_dtype=np.float16,
              schedule="split-k", splits=2),                                              # 16-byte loads: 8 fp16
    make_case(b=1, hkv=1, group=2, n_max=7, d=28, lengths=[6], schedule="stream-k", blocks=3),  # 4 fp32, d < D
]


@pytest.mark.parametrize("case", HARD_CASES, ids=repr)
def test_matches_oracle_on_hard_cases(case):
    check(case)


# The drawn cases, one test a (schedule, cache dtype), so that on a GPU the four compile
# their kernels in parallel (pytest -n 4): a quarter of the profile's examples each, and 40
# on a GPU, where most drawn cases need kernels of a shape not compiled yet (seconds each).
@pytest.mark.parametrize("kv_dtype", [np.float32, np.float16], ids=["fp32-kv", "fp16-kv"])
@pytest.mark.parametrize("schedule", ["split-k", "stream-k"])
@settings(max_examples=max(2, settings().max_examples // 4) if SIM else gpu_examples(40))
@given(data=st.data())
def test_matches_oracle(schedule, kv_dtype, data):
    check(data.draw(decode_cases(schedules=(schedule,), kv_dtypes=(kv_dtype,)), label="case"))



@st.composite
def tensor_core_cases(draw):
    """What the tensor-core partial takes: float16 caches, d = 64 or 128, several rows a KV
    head (GQA and/or Nq > 1); float32 or float16 queries."""
    group = draw(st.sampled_from([1, 2, 4] if SIM else [1, 2, 4, 8, 32]))
    nq = draw(st.integers(1 if group > 1 else 2, MAX_NQ))
    n_max = draw(st.integers(0, 40 if SIM else MAX_N))
    b = draw(st.integers(1, 2))
    lengths = draw(st.one_of(st.none(), st.lists(st.integers(0, n_max), min_size=b, max_size=b)))
    schedule = draw(st.sampled_from(["split-k", "stream-k"]))
    case = make_case(b=b, hkv=draw(st.integers(1, 2)), group=group, nq=nq, n_max=n_max,
                     d=draw(st.sampled_from([64, 128])), lengths=lengths, causal=draw(st.booleans()),
                     scale=draw(st.one_of(st.none(), st.floats(0.05, 2.0))), schedule=schedule,
                     splits=draw(st.integers(1, 4)) if schedule == "split-k" else None,
                     blocks=draw(st.integers(1, 5)) if schedule == "stream-k" else None,
                     logit_std=draw(st.sampled_from(LOGIT_STDS)), kv_dtype=np.float16,
                     seed=draw(st.integers(0, 2**31)))
    if draw(st.booleans()):
        case.q = case.q.astype(np.float16)
    return case


@settings(max_examples=3 if SIM else gpu_examples(150))
@given(tensor_core_cases())
@example(make_case(b=2, hkv=1, group=4, nq=1, n_max=37, d=64, lengths=[37, 5], causal=True, logit_std=30.0,
                   kv_dtype=np.float16, schedule="stream-k", blocks=3))
def test_tensor_core_partial_matches_oracle(case):
    """fp16 caches with grouped rows go through tensor cores (mma.sync) and must meet the
    same tolerance as the FMA kernel: q and P are split into two fp16 parts each."""
    rows = case.q.shape[1] // case.k.shape[1] * case.q.shape[2]
    assert plan(case.q.shape[3], rows, 2, True, case.q.dtype.itemsize).MMA
    check(case)

@pytest.mark.parametrize("schedule", ["split-k", "stream-k"])
def test_many_partials_of_a_long_cache(schedule):
    """Many splits (or many blocks crossing heads) over one long cache each: the merge of a
    dozen partials, with large logits so that the weights exp(L_s - L) span decades."""
    n = 64 if SIM else 5000
    case = make_case(b=2, hkv=2, group=2, nq=2, n_max=n, d=8 if SIM else 128, lengths=[n, n // 3 + 1],
                     causal=True, logit_std=30.0, schedule=schedule,
                     splits=12 if schedule == "split-k" else None, blocks=9 if schedule == "stream-k" else None)
    check(case)


def test_split_k_and_stream_k_agree_with_chapter_4():
    """With one query head a KV head and full caches, decode is chapter 4's forward."""
    from kernels.flash_forward import flash_attention

    case = make_case(b=2, hkv=2, nq=2, n_max=19, d=8, causal=True)
    o4, l4 = flash_attention(case.q, case.k, case.v, causal=True)
    for schedule in ("split-k", "stream-k"):
        o, lse = decode_attention(case.q, case.k, case.v, causal=True, schedule=schedule)
        np.testing.assert_allclose(o, o4, rtol=0, atol=1e-5)
        np.testing.assert_allclose(lse, l4, rtol=0, atol=1e-5)


# --------------------------------------------------------------------------- the first versions
# The notebook's kernel exercises (EXERCISES in kernels/decode.py; a learner's factories
# replace the course's): split-K's combine, on drawn partials and inside decode_attention,
# then the first partial through first_split_k (which runs the combine after it, so a
# combine that is wrong fails the tests above first). Outputs start as NaN, so an element
# never written shows; the messages name the block and thread that own the worst element.

U = 2.0 ** -24                      # half an ulp of 1 in float32: one rounding


class PartialSet:
    """Partials as split-K leaves them: o_parts (S, H, rows, d), l_parts (S, H, rows)
    float32; each row's scores (some -inf) cut into S slices, some empty, and each slice's
    (O_s, L_s) from the oracle (O_s = 0, L_s = -inf for a slice the row sees nothing of).
    ``rt``: the rows a combine block takes."""

    def __init__(self, S=3, H=1, rows=2, d=3, n=6, cuts=None, rt=1, masked=0.0, magnitude=1.0, seed=0):
        rng = np.random.default_rng(seed)
        cuts = sorted(rng.integers(0, n + 1, S - 1).tolist()) if cuts is None else list(cuts)
        x = rng.standard_normal((H, rows, n)) * magnitude
        x[rng.random((H, rows, n)) < masked] = -np.inf
        vals = rng.standard_normal((H, n, d))
        bounds = [0, *cuts, n]
        o_parts, l_parts = np.zeros((S, H, rows, d)), np.full((S, H, rows), -np.inf)
        with np.errstate(invalid="ignore", divide="ignore"):
            for s in range(S):
                a, b = bounds[s], bounds[s + 1]
                if b > a:
                    o_parts[s] = ref.softmax(x[..., a:b]) @ vals[:, a:b]
                    l_parts[s] = ref.logsumexp(x[..., a:b])
        self.o_parts, self.l_parts = o_parts.astype(np.float32), l_parts.astype(np.float32)
        self.rt, self.cuts = rt, cuts

    def __repr__(self):
        S, H, rows, d = self.o_parts.shape
        return (f"PartialSet(S={S}, H={H}, rows={rows}, d={d}, RT={self.rt}, cuts={self.cuts}, "
                f"L_s={np.round(self.l_parts, 2).tolist()})")


@st.composite
def partial_sets(draw):
    n = draw(st.integers(0, 10))
    S = draw(st.integers(1, 5))
    return PartialSet(S=S, H=draw(st.integers(1, 2)), rows=draw(st.integers(1, 6)), d=draw(st.integers(1, 9)), n=n,
                      cuts=sorted(draw(st.lists(st.integers(0, n), min_size=S - 1, max_size=S - 1))),
                      rt=draw(st.sampled_from([1, 2, 4])), masked=draw(st.sampled_from([0.0, 0.3, 1.0])),
                      magnitude=draw(st.sampled_from([1.0, 10.0, 300.0])), seed=draw(st.integers(0, 2**31)))


def merge_float32(o_parts, l_parts):
    """The merge in float32 NumPy: the baseline whose error sets the tolerance."""
    with np.errstate(invalid="ignore", divide="ignore"):
        m = l_parts.max(axis=0)
        base = np.where(np.isfinite(m), m, np.float32(0.0))
        w = np.exp(l_parts - base)                               # 0 for an empty piece
        total = w.sum(axis=0)
        o = np.einsum("s...,s...d->...d", w, o_parts) / np.where(total > 0, total, 1)[..., None]
        lse = np.where(total > 0, base + np.log(np.where(total > 0, total, 1)), -np.inf)
    return o.astype(np.float32), lse.astype(np.float32)


def merge_floors(o_parts, l_parts, o, lse):
    """Floors of the merge's own roundings, element by element: each weight exp(L_s - L)
    errs by its argument's rounding (|L_s - max L| U) and exp's, moving O by that much of
    |O_s - O|; the S products and sums err by about U of sum_s P_s |O_s| each; L by U of
    |L|, of its terms and of log l."""
    o_parts, l_parts = o_parts.astype(np.float64), l_parts.astype(np.float64)
    S = len(l_parts)
    with np.errstate(invalid="ignore", over="ignore"):
        m = np.max(l_parts, axis=0)
        p = np.where(np.isfinite(l_parts) & np.isfinite(lse), np.exp(l_parts - np.where(np.isfinite(lse), lse, 0)), 0)
        spread = np.where(p > 0, np.abs(l_parts - np.where(np.isfinite(m), m, 0)), 0)
    f_o = 4 * U * (S * np.einsum("s...,s...d->...d", p, np.abs(o_parts))
                   + np.einsum("s...,s...d->...d", p * (2 + spread), np.abs(o_parts - o)))
    f_l = 4 * U * (np.abs(np.where(np.isfinite(lse), lse, 0)) + S + (p * spread).sum(axis=0))
    return (Floor(f_o, "O floor: the merge's weights and sums, element by element"),
            Floor(f_l, "L floor: m + log l and the weights' arguments"))


@given(partial_sets())
@example(PartialSet(S=3, H=2, rows=3, d=5, n=0, rt=2))                                    # every piece empty
@example(PartialSet(S=4, H=2, rows=6, d=5, n=7, cuts=[0, 3, 3], rt=4, masked=0.3, magnitude=300.0))
@example(PartialSet(S=2, H=1, rows=5, d=9, n=8, cuts=[8], rt=4, masked=1.0))              # rows all masked
def test_combine_of_drawn_partials_matches_the_merge(parts):
    """Split-K's combine kernel on partials laid out as split-K leaves them (RT rows a
    slot, the last tile ragged, d < the padded D), against the float64 merge of the same
    float32 partials: empty pieces (L_s = -inf) weigh nothing and a row of nothing but
    empty pieces is O = 0, L = -inf, never NaN."""
    from numba import cuda

    S, H, rows, d = parts.o_parts.shape
    exact_o, exact_l = merge_partials_numpy(parts.o_parts, parts.l_parts)
    base_o, base_l = merge_float32(parts.o_parts, parts.l_parts)
    out = cuda.to_device(np.full((H, rows, d), np.nan, np.float32))       # NaN: an element never written shows
    lse_out = cuda.to_device(np.full((H, rows), np.nan, np.float32))
    combine_partials(parts.o_parts, parts.l_parts, rows_per_block=parts.rt, out=out, lse_out=lse_out)
    f_o, f_l = merge_floors(parts.o_parts, parts.l_parts, exact_o, exact_l)
    threads, D, rt = 32 if SIM else 128, padded_head_dim(d), parts.rt
    assert_close(out.copy_to_host(), exact_o, base_o, floor=f_o,
                 name=f"O (element [h, r, c] is block (r // {rt}, h)'s, thread ((r % {rt}) * {D} + c) % {threads})")
    assert_close(lse_out.copy_to_host(), exact_l, base_l, floor=f_l,
                 name=f"L (row [h, r] is block (r // {rt}, h)'s, thread ((r % {rt}) * {D}) % {threads})")


@pytest.mark.parametrize("case", [
    make_case(b=3, lengths=[8, 0, 1], schedule="split-k", splits=3),                     # empty caches, empty splits
    make_case(b=2, hkv=1, group=2, nq=3, n_max=9, d=5, lengths=[9, 2], causal=True, logit_std=30.0,
              schedule="split-k", splits=4),                                 # GQA: 6 rows of a tile of 8
], ids=repr)
def test_combine_inside_split_k_decode(case):
    """The same kernel as decode_attention's split-K combine (its plan looks the factory
    up when it is made), against the float64 oracle."""
    o, lse = decode_attention(case.q, case.k, case.v, **case.options)
    exact_o, exact_l = ref.decode_attention(case.q, case.k, case.v, case.lengths, case.causal, case.scale)
    base_o, base_l = ref.decode_attention(case.q, case.k, case.v, case.lengths, case.causal, case.scale,
                                          dtype=np.float32)
    B, hq, nq, d = case.q.shape
    hkv = case.k.shape[1]
    p = plan(d, hq // hkv * nq)
    # element [b, h, i, c] is row (h % g)*Nq + i of KV head b*Hkv + h // g: the combine's
    # block (that row // RT, b*Hkv + h // g), thread ((row % RT) * D + c) % THREADS
    whose = (f"[b, h, i, c]: row = (h % {hq // hkv})*{nq} + i, the combine's block (row // {p.RT}, "
             f"b*{hkv} + h // {hq // hkv}), thread ((row % {p.RT}) * {p.D} + c) % {p.threads}")
    f_o, f_l = decode_floors(case)
    assert_close(o, exact_o, base_o, name=f"O ({whose})", floor=f_o)
    assert_close(lse, exact_l, base_l, name=f"L ({whose}, c = 0)", floor=f_l)


@st.composite
def first_split_k_cases(draw):
    """Small decode batches for the first partial (a block a query row and split): ragged
    lengths (0 and 1), more splits than keys, GQA, causal with Nq > length."""
    b = draw(st.integers(1, 2))
    n_max = draw(st.integers(0, 12))
    lengths = draw(st.one_of(st.none(), st.lists(st.sampled_from([0, min(1, n_max), n_max]) | st.integers(0, n_max),
                                                 min_size=b, max_size=b)))
    return make_case(b=b, hkv=draw(st.integers(1, 2)), group=draw(st.sampled_from([1, 2])), nq=draw(st.integers(0, 2)),
                     n_max=n_max, d=draw(st.integers(1, 8)), lengths=lengths, causal=draw(st.booleans()),
                     scale=draw(st.one_of(st.none(), st.floats(0.05, 2.0))), schedule="split-k",
                     splits=draw(st.integers(1, 4)), logit_std=draw(st.sampled_from(LOGIT_STDS)),
                     kv_dtype=draw(st.sampled_from([np.float32, np.float16])), seed=draw(st.integers(0, 2**31)))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@given(first_split_k_cases())
@example(make_case(b=2, hkv=1, group=2, nq=2, n_max=9, d=5, lengths=[9, 0], causal=True, schedule="split-k",
                   splits=3))                                                            # an empty cache
@example(make_case(b=2, hkv=2, nq=2, n_max=10, d=3, lengths=[2, 1], causal=True, schedule="split-k",
                   splits=4, logit_std=30.0))                              # more splits than keys; length < Nq
@example(make_case(b=1, hkv=1, group=2, nq=1, n_max=8, d=4, lengths=[5], logit_std=1e4, schedule="split-k",
                   splits=2))                                                            # logits ~ 1e4
def test_first_split_k_matches_the_oracle(case):
    """The first partial, then the combine, against the float64 oracle. Rows past each
    sequence's length hold NaN: a partial that reads them spoils its row."""
    from numba import cuda

    k, v = case.k.copy(), case.v.copy()
    lengths = [k.shape[2]] * k.shape[0] if case.lengths is None else case.lengths
    for b, n in enumerate(lengths):
        k[b, :, n:] = np.nan
        v[b, :, n:] = np.nan
    out = cuda.to_device(np.full(case.q.shape, np.nan, np.float32))     # NaN: an element never written shows
    lse_out = cuda.to_device(np.full(case.q.shape[:3], np.nan, np.float32))
    first_split_k(case.q, k, v, cache_lengths=case.lengths, causal=case.causal, scale=case.scale,
                  splits=case.splits, out=out, lse_out=lse_out)
    exact_o, exact_l = ref.decode_attention(case.q, case.k, case.v, case.lengths, case.causal, case.scale)
    base_o, base_l = ref.decode_attention(case.q, case.k, case.v, case.lengths, case.causal, case.scale,
                                          dtype=np.float32)
    f_o, f_l = decode_floors(case)
    whose = ("row [b, h, i] is the partial blocks ((b*Hq + h)*Nq + i, s), one a split s, then the combine's "
             "block ((b*Hq + h)*Nq + i, 0)")
    assert_close(out.copy_to_host(), exact_o, base_o, floor=f_o, name=f"O ({whose}; column c: thread c of each)")
    assert_close(lse_out.copy_to_host(), exact_l, base_l, floor=f_l, name=f"L ({whose})")


@pytest.mark.parametrize("call, error, match", [
    (lambda c: first_split_k(c.q, c.k, c.v, splits=None), TypeError, "splits: expected an int"),
    (lambda c: first_split_k(c.q, c.k, c.v, splits=0), ValueError, "splits: expected an int in 1..1024"),
    (lambda c: first_split_k(c.q, c.k, c.v, out=np.zeros(c.q.shape, np.float32)), TypeError,
     "out: expected a device array"),
    (lambda c: combine_partials(np.zeros((2, 1, 3, 4), np.float32), np.zeros((2, 1, 4), np.float32)), ValueError,
     "l_parts: expected shape"),
    (lambda c: combine_partials(np.zeros((2, 1, 3, 4)), np.zeros((2, 1, 3))), TypeError, "o_parts: expected dtype"),
    (lambda c: combine_partials(np.zeros((2, 1, 3, 4), np.float32), np.zeros((2, 1, 3), np.float32),
                                rows_per_block=17), ValueError, "rows_per_block: expected an int in 1..16"),
])
def test_first_versions_name_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call(make_case(b=1, hkv=1, group=2, n_max=4))


# --------------------------------------------------------------------------- hard input

@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("schedule, d, kv_dtype", [("split-k", 6, np.float32), ("stream-k", 6, np.float32),
                                                   ("stream-k", 64, np.float16)])    # FMA; tensor cores
def test_what_lies_beyond_a_cache_is_never_read_into_the_result(schedule, d, kv_dtype):
    """Rows past a sequence's length are not its keys: NaN there changes nothing, bit for bit."""
    case = make_case(b=3, hkv=2, group=2, nq=2, n_max=21, d=d, lengths=[21, 7, 0], causal=True,
                     kv_dtype=kv_dtype, schedule=schedule, splits=3 if schedule == "split-k" else None,
                     blocks=4 if schedule == "stream-k" else None)
    o, lse = check(case)
    k, v = case.k.copy(), case.v.copy()
    for b, n in enumerate(case.lengths):
        k[b, :, n:] = np.nan
        v[b, :, n:] = np.inf
    o2, l2 = decode_attention(case.q, k, v, **case.options)
    assert np.array_equal(o, o2) and np.array_equal(lse, l2)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("schedule, d, kv_dtype", [("split-k", 4, np.float32), ("stream-k", 4, np.float32),
                                                   ("stream-k", 64, np.float16)])    # FMA; tensor cores
def test_nan_in_a_query_row_reaches_that_row_only(schedule, d, kv_dtype):
    case = make_case(b=2, hkv=2, group=2, nq=2, n_max=12, d=d, kv_dtype=kv_dtype, schedule=schedule,
                     splits=3 if schedule == "split-k" else None, blocks=3 if schedule == "stream-k" else None)
    case.q[1, 2, 1, 3] = np.nan
    o, lse = decode_attention(case.q, case.k, case.v, **case.options)
    exact_o, exact_l = ref.decode_attention(case.q, case.k, case.v)
    assert np.array_equal(np.isnan(o), np.isnan(exact_o)) and np.isnan(o[1, 2, 1]).all()
    assert np.array_equal(np.isnan(lse), np.isnan(exact_l)) and np.isnan(lse[1, 2, 1])


@pytest.mark.parametrize("schedule", ["split-k", "stream-k"])
def test_bitwise_reproducible(schedule):
    """The merge order is fixed (split order; stream-K: segment order, whichever block
    arrives last): the same call gives the same bits, also after other calls."""
    case = make_case(b=2, hkv=2, group=2, nq=2, n_max=30, d=8, lengths=[30, 11], causal=True,
                     schedule=schedule, splits=4 if schedule == "split-k" else None,
                     blocks=5 if schedule == "stream-k" else None)
    first = decode_attention(case.q, case.k, case.v, **case.options)
    # in between: other queries on the same schedule (its counters and workspaces), checked
    shifted = make_case(b=2, hkv=2, group=2, nq=2, n_max=30, d=8, lengths=[30, 11], causal=True,
                        schedule=schedule, splits=case.splits, blocks=case.blocks, seed=5)
    check(shifted)
    other = make_case(b=1, hkv=1, n_max=9, schedule=schedule, seed=3)
    check(other)
    again = decode_attention(case.q, case.k, case.v, **case.options)
    assert all(np.array_equal(a, b) for a, b in zip(first, again))


# --------------------------------------------------------------------------- the pieces in NumPy

@given(n=st.integers(0, 200), splits=st.integers(1, 40))
def test_split_ranges_cover_the_keys_in_order(n, splits):
    ranges = split_ranges(n, splits)
    assert len(ranges) == splits
    assert ranges[0][0] == 0 and ranges[-1][1] == n
    assert all(a <= b for a, b in ranges) and all(ranges[i][1] == ranges[i + 1][0] for i in range(splits - 1))


@given(st.data())
@settings(max_examples=60)
def test_merge_of_partials_is_attention_over_the_whole(data):
    """merge_partials_numpy of any cut of the keys is the oracle over all of them (and the
    NumPy split-K, decode_numpy, is the oracle)."""
    n = data.draw(st.integers(0, 30), label="n")
    splits = data.draw(st.integers(1, 8), label="splits")
    causal = data.draw(st.booleans(), label="causal")
    case = make_case(b=2, hkv=2, group=2, nq=3, n_max=n, d=5, causal=causal, logit_std=30.0,
                     lengths=[n, data.draw(st.integers(0, n), label="len1")], seed=data.draw(st.integers(0, 99)))
    o, lse = decode_numpy(case.q, case.k, case.v, cache_lengths=case.lengths, causal=causal, splits=splits)
    exact_o, exact_l = ref.decode_attention(case.q, case.k, case.v, case.lengths, causal)
    np.testing.assert_allclose(o, exact_o, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lse, exact_l, rtol=1e-10, atol=1e-12)


def test_merge_identity_and_nan():
    o = np.arange(6.0).reshape(1, 2, 3)
    l = np.array([[0.5, -1.0]])
    mo, ml = merge_partials_numpy(np.concatenate([o, np.full_like(o, 7.0)]), np.concatenate([l, [[-np.inf] * 2]]))
    np.testing.assert_array_equal(mo, o[0]) and np.testing.assert_array_equal(ml, l[0])
    mo, ml = merge_partials_numpy(np.zeros((2, 1, 3)), np.full((2, 1), -np.inf))
    assert np.all(mo == 0) and np.all(ml == -np.inf)


@st.composite
def schedule_cases(draw):
    tiles = draw(st.lists(st.integers(0, 12), min_size=1, max_size=12))
    return tiles, draw(st.integers(1, 20))


@given(schedule_cases())
@example(([10, 10, 10, 10], 6))          # uniform: blocks cross heads
@example(([40, 3, 3, 3], 6))             # ragged: one long sequence split over blocks
@example(([0, 0, 5], 2))                 # empty caches first
@example(([0], 3))                       # nothing to do but write O = 0, L = -inf
@example(([3], 7))                       # more blocks than work
def test_stream_k_schedule_is_a_balanced_cut(case):
    tiles, blocks = case
    check_schedule(stream_k_schedule(tiles, blocks), tiles, blocks)


def test_check_schedule_catches_a_bad_schedule():
    """The exercise's checker bites: a schedule that drops a tile, or is unbalanced, fails."""
    tiles, blocks = [4, 4], 2
    good = stream_k_schedule(tiles, blocks)
    dropped = StreamKSchedule(good.cta_first, good.seg_item, good.seg_tile_start,
                              np.where(np.arange(len(good.seg_tile_end)) == 0, good.seg_tile_end - 1,
                                       good.seg_tile_end).astype(np.int32), good.item_first, good.item_count)
    with pytest.raises(AssertionError):
        check_schedule(dropped, tiles, blocks)
    one_block = stream_k_schedule(tiles, 1)
    lopsided = StreamKSchedule(np.array([0, 2, 2], np.int32), one_block.seg_item, one_block.seg_tile_start,
                               one_block.seg_tile_end, one_block.item_first, one_block.item_count)
    with pytest.raises(AssertionError, match="unbalanced"):
        check_schedule(lopsided, tiles, blocks)


@given(items=st.integers(1, 300), n_keys=st.integers(0, 1 << 20), slots=st.integers(1, 2000))
def test_split_count_is_the_wave_efficiency_rule(items, n_keys, slots):
    s = split_count(items, n_keys, slots)
    limit = max(1, min(128, n_keys // 256))
    assert 1 <= s <= limit
    if items >= slots:
        assert s == 1
    else:
        best = max(wave_efficiency(items * t, slots) for t in range(1, limit + 1))
        assert wave_efficiency(items * s, slots) >= 0.85 * best
        assert all(wave_efficiency(items * t, slots) < 0.85 * best for t in range(1, s))


def test_plan_keeps_output_registers_bounded():
    for d in (1, 16, 64, 100, 128):
        for rows in (1, 2, 4, 8, 16, 64, 512):
            for itemsize in (2, 4):
                for wide in (False, True):
                    p = plan(d, rows, itemsize, wide)
                    if p.MMA:                     # tensor cores: fp16 keys, grouped rows, d = D in {64, 128}
                        assert itemsize == 2 and wide and rows >= 2 and p.D == d in (64, 128) and p.RT <= 16
                        continue
                    assert p.RT <= 16 and p.D >= d and p.D % p.LK == 0 and p.threads % p.LK == 0
                    assert p.RT * p.D // p.LK <= 64 or p.LK == min(32, p.D)
                    # a lane's loads: whole 4-, 8- or 16-byte loads tiling its share of the row
                    assert p.D % (p.LK * p.VEC) == 0
                    assert p.VEC == 1 or (wide and p.VEC * itemsize in (4, 8, 16))


def test_io_model_counts_k_and_v_once():
    assert io_model_bytes(1, 32, 32, 1, 4096, 128, kv_itemsize=2) == 2 * 4096 * 32 * 128 * 2 + 32 * (128 * 4 * 2 + 4)
    assert io_model_bytes(2, 8, 2, 1, [10, 0], 4) == 2 * 10 * 2 * 4 * 4 + 2 * 8 * (4 * 4 * 2 + 4)


# --------------------------------------------------------------------------- the launcher

def test_device_arrays_in_device_arrays_out():
    from numba import cuda

    case = make_case(b=1, hkv=1, group=2, n_max=6)
    o, lse = decode_attention(*(cuda.to_device(x) for x in (case.q, case.k, case.v)),
                              cache_lengths=cuda.to_device(np.array([4], np.int32)))
    assert is_device_array(o) and is_device_array(lse)
    exact_o, _ = ref.decode_attention(case.q, case.k, case.v, [4])
    np.testing.assert_allclose(o.copy_to_host(), exact_o, atol=1e-5)


@pytest.mark.parametrize("schedule", ["split-k", "stream-k"])
def test_prepared_call_runs_again_on_new_queries(schedule):
    """Plan once, run many: after the queries are rewritten in place, the next run attends
    with the new ones (a serving loop's decode steps)."""
    from numba import cuda

    case = make_case(b=2, hkv=2, group=2, nq=1, n_max=15, d=4, lengths=[15, 6])
    q = cuda.to_device(case.q)
    run = prepare_decode(q, cuda.to_device(case.k), cuda.to_device(case.v), cache_lengths=case.lengths,
                         schedule=schedule, **({"splits": 3} if schedule == "split-k" else {"blocks": 3}))
    for step in range(2):
        new_q = np.asarray(case.q + step, np.float32)
        q.copy_to_device(new_q)
        o, lse = run()
        exact_o, exact_l = ref.decode_attention(new_q, case.k, case.v, case.lengths)
        np.testing.assert_allclose(o.copy_to_host(), exact_o, atol=1e-5)
        np.testing.assert_allclose(lse.copy_to_host(), exact_l, atol=1e-5)


@pytest.mark.parametrize("schedule", ["split-k", "stream-k"])
def test_a_call_like_the_last_reuses_its_launches_on_its_own_arrays(schedule):
    """Calls with the same shapes, lengths and options (the layers of a model in one decode
    step) share one cached plan: each attends with its own arrays into new results, and the
    cache keeps none of them alive (a KV cache is gigabytes)."""
    import gc
    import weakref

    from numba import cuda

    from kernels import decode

    options = dict(cache_lengths=[13, 5], causal=True, schedule=schedule,
                   **({"splits": 3} if schedule == "split-k" else {"blocks": 3}))
    cases = [make_case(b=2, hkv=2, group=2, nq=2, n_max=13, d=4, seed=seed) for seed in (1, 2)]
    before = len(decode._launches)
    results, alive = [], []
    for case in cases:
        arrays = [cuda.to_device(x) for x in (case.q, case.k, case.v)]
        alive += [weakref.ref(a) for a in arrays]
        o, lse = decode_attention(*arrays, **options)
        results.append((o.copy_to_host(), lse.copy_to_host()))
        del arrays
    assert len(decode._launches) <= before + 1, "the second call planned again"
    for case, (o, lse) in zip(cases, results):
        exact_o, exact_l = ref.decode_attention(case.q, case.k, case.v, [13, 5], causal=True)
        np.testing.assert_allclose(o, exact_o, atol=1e-5)
        np.testing.assert_allclose(lse, exact_l, atol=1e-5)
    gc.collect()
    assert not any(ref_() is not None for ref_ in alive), "the cached plan keeps a call's arrays alive"


def bad(**changes):
    case = make_case(b=2, hkv=2, group=2, nq=1, n_max=5, d=4)
    args = dict(q=case.q, k_cache=case.k, v_cache=case.v)
    args.update(changes)
    return args


@pytest.mark.parametrize("args, error, match", [
    (bad(q=np.zeros((2, 4, 1), np.float32)), ValueError, "q: expected 4 dimensions"),
    (bad(q=np.zeros((2, 4, 1, 4), np.float64)), TypeError, "q: expected dtype"),
    (bad(k_cache=np.zeros((2, 3, 5, 4), np.float32), v_cache=np.zeros((2, 3, 5, 4), np.float32)), ValueError,
     "k_cache: expected KV heads dividing"),
    (bad(v_cache=np.zeros((2, 2, 5, 4), np.float16)), TypeError, "v_cache: expected the dtype of k_cache"),
    (bad(v_cache=np.zeros((2, 2, 6, 4), np.float32)), ValueError, "v_cache: expected the shape of k_cache"),
    (bad(k_cache=np.zeros((3, 2, 5, 4), np.float32), v_cache=np.zeros((3, 2, 5, 4), np.float32)), ValueError,
     "k_cache: expected batch"),
    (bad(q=np.zeros((2, 4, 17, 4), np.float32)), ValueError, "at most 16 new queries"),
    (bad(q=np.zeros((2, 4, 1, 129), np.float32), k_cache=np.zeros((2, 2, 5, 129), np.float32),
         v_cache=np.zeros((2, 2, 5, 129), np.float32)), ValueError, "head dim d in 1..128"),
    (bad(cache_lengths=[5]), ValueError, r"cache_lengths: expected shape \(2,\)"),
    (bad(cache_lengths=[5, 6]), ValueError, "cache_lengths: expected 0 <= length <= 5"),
    (bad(cache_lengths=[-1, 2]), ValueError, "cache_lengths: expected 0 <= length"),
    (bad(cache_lengths=[1.0, 2.0]), TypeError, "cache_lengths: expected integers"),
    (bad(schedule="ring"), ValueError, "schedule: expected"),
    (bad(schedule="stream-k", splits=2), ValueError, "splits: only for schedule='split-k'"),
    (bad(schedule="split-k", blocks=2), ValueError, "blocks: only for schedule='stream-k'"),
    (bad(schedule="split-k", splits=0), ValueError, "splits: expected an int in 1..1024"),
    (bad(causal=1), TypeError, "causal: expected True or False"),
    (bad(tensor_cores="yes"), TypeError, "tensor_cores: expected True or False"),
    (bad(scale=-1.0), ValueError, "scale: expected a finite positive number"),
])
def test_bad_input_is_named_before_any_launch(args, error, match):
    with pytest.raises(error, match=match):
        decode_attention(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"), **args)
