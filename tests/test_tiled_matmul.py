"""Chapter 2: every rung of the tiled matmul against the float64 oracle, ragged sizes and
drawn tile configurations included, plus the launcher's input validation.

The tests whose ids name ``rung1`` or ``rung2`` grade the notebook's kernel exercises
(``make_naive``, ``make_shared_tiles``; ``EXERCISES`` in the module): they write into an
``out=`` filled with NaN, so an element no thread writes shows, and a failure names the
element of C and the block and thread that own it."""

from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import assume, example, given
from hypothesis import strategies as st
from numba import cuda

from kernels import reference as ref
from kernels.base.mma import bf16_bits
from kernels.base.runtime import on_simulator
from kernels.base.testing import assert_close, matmul_floor, random_array
from kernels.tiled_matmul import (
    EXERCISES,
    MMA_TILES_GPU,
    MMA_TILES_SIM,
    RUNG3_CONFIGS,
    TileCase,
    check_tile_load,
    default_tiles,
    global_bytes,
    load_tile,
    matmul,
    matmul_tensor_cores,
    tile_cases,
)

SIM = on_simulator()
MAX_DIM = 40 if SIM else 700

# Tile configurations the tests draw, per rung. In the simulator every thread is a Python
# thread, so blocks stay small there; on a GPU the production tiles are drawn too.
RUNG1_BLOCKS = [(8, 8), (4, 16), (16, 2)] + ([] if SIM else [(16, 16), (32, 8)])
RUNG2_TILES = [4, 8] + ([] if SIM else [16, 32])
RUNG3_TILES = [(16, 16, 4, 4, 4), (16, 8, 8, 4, 2), (8, 16, 4, 2, 4), (32, 16, 8, 8, 4)] + (
    [] if SIM else list(RUNG3_CONFIGS.values()))


@dataclass
class MatmulCase:
    a: np.ndarray
    b: np.ndarray
    rung: int
    tiles: dict

    def __repr__(self):
        return f"MatmulCase(a={self.a.shape}, b={self.b.shape}, rung={self.rung}, tiles={self.tiles})"


@st.composite
def register_tiles(draw):
    """(BM, BN, BK, TM, TN) whose threads evenly share the tile loads; production tiles on a GPU."""
    if not SIM and draw(st.booleans()):
        return draw(st.sampled_from(list(RUNG3_CONFIGS.values())))
    tm, tn = draw(st.sampled_from([1, 2, 4, 8])), draw(st.sampled_from([1, 2, 4, 8]))
    threads_m, threads_n = draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([1, 2, 4, 8]))
    bm, bn, nt = tm * threads_m, tn * threads_n, threads_m * threads_n
    bks = [bk for bk in (1, 2, 4, 8, 16) if (bm * bk) % nt == 0 and (bk * bn) % nt == 0]
    assume(bks)
    return bm, bn, draw(st.sampled_from(bks)), tm, tn


def _tiles_for(rung, draw_or_choice):
    if rung == 1:
        return {"block": draw_or_choice(RUNG1_BLOCKS)}
    if rung == 2:
        return {"tile": draw_or_choice(RUNG2_TILES)}
    return {"register_tiles": draw_or_choice(RUNG3_TILES)}


@st.composite
def matmul_cases(draw, rungs=(1, 2, 3), max_dim=MAX_DIM):
    rung = draw(st.sampled_from(rungs))
    if rung == 3 and draw(st.booleans()):
        tiles = {"register_tiles": draw(register_tiles())}
    else:
        tiles = _tiles_for(rung, lambda xs: draw(st.sampled_from(xs)))
    m, k, n = (draw(st.integers(0, max_dim)) for _ in range(3))
    magnitude = draw(st.sampled_from([0.01, 1.0, 100.0]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return MatmulCase(random_array(rng, (m, k), magnitude), random_array(rng, (k, n)), rung, tiles)


def case(m, k, n, rung, tiles=None, seed=0):
    rng = np.random.default_rng(seed)
    tiles = tiles if tiles is not None else _tiles_for(rung, lambda xs: xs[0])
    return MatmulCase(random_array(rng, (m, k)), random_array(rng, (k, n)), rung, tiles)


def check(c):
    got = matmul(c.a, c.b, rung=c.rung, **c.tiles)
    assert isinstance(got, np.ndarray) and got.dtype == np.float32
    assert_close(got, ref.matmul(c.a, c.b), ref.matmul(c.a, c.b, dtype=np.float32), name=f"C (rung {c.rung})",
                 floor=matmul_floor(c.a, c.b))


@given(matmul_cases())
@example(case(1, 1, 1, 1)).via("1 x 1 x 1")
@example(case(1, 1, 1, 3)).via("1 x 1 x 1")
@example(case(9, 17, 5, 2, {"tile": 8})).via("one past a tile in m and k")
@example(case(17, 5, 17, 3, {"register_tiles": (16, 16, 4, 4, 4)})).via("one past a block tile in m and n")
@example(case(16, 16, 16, 3, {"register_tiles": (16, 16, 4, 4, 4)})).via("exact tiles")
@example(case(3, 0, 4, 3)).via("K = 0: C is zeros")
@example(case(0, 5, 4, 2)).via("M = 0")
@example(case(4, 5, 0, 1)).via("N = 0")
@example(case(33, 9, 1, 3, {"register_tiles": (32, 16, 8, 8, 4)})).via("a single column")
def test_matmul_matches_oracle(c):
    check(c)


# --------------------------------------------------------------------------- each rung's kernel, into out=

def owner(rung, tiles, i, j):
    """The block and thread of ``matmul``'s launch that compute C[i, j]."""
    if rung in (1, 2):
        bx, by = tiles["block"] if rung == 1 else (tiles["tile"],) * 2
        return (f"block ({j // bx}, {i // by}), thread ({j % bx}, {i % by})'s "
                f"(blocks of {bx} x {by} threads; x along the columns of C, y along its rows)")
    bm, bn, bk, tm, tn = tiles["register_tiles"]
    vm, vn = min(4, tm), min(4, tn)
    step_m, step_n = (bm // tm) * vm, (bn // tn) * vn
    ty, tx = (i % bm) % step_m // vm, (j % bn) % step_n // vn
    return (f"block ({j // bn}, {i // bm}), thread {ty * (bn // tn) + tx}'s "
            f"(its TM x TN micro-tile in a {bm} x {bn} block tile)")


def check_into_out(c):
    """``matmul`` into an out= filled with NaN; a wrong or unwritten element of C is named
    with the block and thread that own it (the first line of the message says it all)."""
    (m, k), n = c.a.shape, c.b.shape[1]
    tiles = {**default_tiles(c.rung), **c.tiles}
    where = f"A {m}x{k} @ B {k}x{n}, rung {c.rung}, {', '.join(f'{key}={v}' for key, v in tiles.items())}"
    out = cuda.to_device(np.full((m, n), np.nan, np.float32))   # NaN: an element never written shows
    assert matmul(c.a, c.b, rung=c.rung, out=out, **tiles) is out
    got = out.copy_to_host()
    unwritten = np.argwhere(np.isnan(got))
    if len(unwritten):
        i, j = (int(x) for x in unwritten[0])
        raise AssertionError(
            f"C[{i}, {j}] is never written ({where}; out= was filled with NaN): it is "
            f"{owner(c.rung, tiles, i, j)}; {len(unwritten)} of {m * n} elements of C are not written")
    exact, baseline = ref.matmul(c.a, c.b), ref.matmul(c.a, c.b, dtype=np.float32)
    record = []
    try:
        assert_close(got, exact, baseline, name=f"C (rung {c.rung})", floor=matmul_floor(c.a, c.b), record=record)
    except AssertionError as e:
        # the worst element, or (an infinity: no ratio to rank by) the first non-finite one
        i, j = record[-1].index if record else (int(x) for x in np.argwhere(~np.isfinite(got))[0])
        raise AssertionError(f"C[{i}, {j}] is wrong ({where}): it is {owner(c.rung, tiles, i, j)}. {e}") from None


RUNG_IDS = ["rung1", "rung2", "rung3"]     # EXERCISES selects a rung's tests by these ids

# Awkward sizes, pinned, for the kernels the learner writes (rung 1 and 2); first, so that a
# kernel that does not run yet fails on the smallest case, at once.
EDGE_CASES = [
    pytest.param(1, (1, 1, 1), {"block": (8, 8)}, id="rung1-1x1x1"),
    pytest.param(1, (9, 17, 5), {"block": (4, 16)}, id="rung1-ragged-blocks-4x16"),
    pytest.param(1, (3, 0, 4), {"block": (8, 8)}, id="rung1-K0-C-is-zeros"),
    pytest.param(1, (1, 7, 33), {"block": (16, 2)}, id="rung1-one-row"),
    pytest.param(2, (1, 1, 1), {"tile": 4}, id="rung2-1x1x1"),
    pytest.param(2, (5, 3, 6), {"tile": 8}, id="rung2-K-shorter-than-a-tile"),
    pytest.param(2, (9, 17, 5), {"tile": 8}, id="rung2-one-past-a-tile-in-m-and-k"),
    pytest.param(2, (8, 16, 12), {"tile": 4}, id="rung2-exact-tiles"),
    pytest.param(2, (3, 0, 4), {"tile": 4}, id="rung2-K0-C-is-zeros"),
]


@pytest.mark.parametrize("rung, mkn, tiles", EDGE_CASES)
def test_rung_kernel_edge_cases(rung, mkn, tiles):
    m, k, n = mkn
    check_into_out(case(m, k, n, rung, tiles, seed=m + k + n))


@pytest.mark.parametrize("rung", [1, 2, 3], ids=RUNG_IDS)
@given(data=st.data())
def test_each_rung_matches_oracle(rung, data):
    check_into_out(data.draw(matmul_cases(rungs=(rung,)), label="case"))


@pytest.mark.parametrize("rung", [1, 2, 3], ids=RUNG_IDS)
def test_default_tiles_ragged(rung):
    check_into_out(case(21, 19, 23, rung, tiles={}, seed=rung))


def test_exercises_select_their_rungs_tests():
    """The learner's hook runs ``pytest -k EXERCISES[name]``: each expression must select
    the pinned cases and the drawn ones of its rung (and no other rung's)."""
    edge_ids = [p.id for p in EDGE_CASES]
    for name, rung in (("make_naive", 1), ("make_shared_tiles", 2)):
        select = EXERCISES[name]
        assert select == RUNG_IDS[rung - 1], f"{name}: selects {select!r}"
        assert [i for i in edge_ids if select in i] == [i for i in edge_ids if i.startswith(f"rung{rung}-")]


def test_device_arrays_in_device_array_out():
    from numba import cuda

    c = case(10, 7, 12, 3, tiles={})
    da, db = cuda.to_device(c.a), cuda.to_device(c.b)
    got = matmul(da, db)
    assert not isinstance(got, np.ndarray)
    floor = matmul_floor(c.a, c.b)
    assert_close(got.copy_to_host(), ref.matmul(c.a, c.b), ref.matmul(c.a, c.b, dtype=np.float32), floor=floor)
    out = cuda.device_array((10, 12), dtype=np.float32)
    assert matmul(da, db, rung=2, out=out) is out
    assert_close(out.copy_to_host(), ref.matmul(c.a, c.b), ref.matmul(c.a, c.b, dtype=np.float32), floor=floor)


A = np.ones((3, 4), np.float32)
B = np.ones((4, 5), np.float32)


@pytest.mark.parametrize("a, b, error, name", [
    (np.ones((2, 3, 4), np.float32), B, ValueError, "a"),
    (np.ones(4, np.float32), B, ValueError, "a"),
    (A, np.ones(4, np.float32), ValueError, "b"),
    (A.astype(np.float64), B, TypeError, "a"),
    (A, B.astype(np.float16), TypeError, "b"),
    (A, np.ones((5, 4), np.float32), ValueError, "b"),
    ([[1.0]], B, TypeError, "a"),
    (A, None, TypeError, "b"),
])
def test_bad_inputs_name_the_argument(a, b, error, name):
    with pytest.raises(error, match=rf"^{name}:"):
        matmul(a, b)


@pytest.mark.parametrize("kwargs, name", [
    ({"rung": 4}, "rung"),
    ({"rung": True}, "rung"),
    ({"rung": 2, "tile": 0}, "tile"),
    ({"rung": 2, "tile": 33}, "tile"),
    ({"rung": 1, "block": (0, 8)}, "block"),
    ({"rung": 3, "register_tiles": (16, 16, 4, 3, 4)}, "register_tiles"),
    ({"rung": 3, "register_tiles": (16, 16, 4)}, "register_tiles"),
    ({"rung": 3, "register_tiles": (8, 8, 1, 1, 1)}, "register_tiles"),
    ({"rung": 3, "register_tiles": (96, 96, 8, 6, 6)}, "register_tiles"),
    ({"rung": 3, "register_tiles": (128, 128, 32, 8, 8)}, "register_tiles"),
    ({"out": np.ones((3, 5), np.float32)}, "out"),
])
def test_bad_options_name_the_option(kwargs, name):
    with pytest.raises((TypeError, ValueError), match=rf"^{name}:"):
        matmul(A, B, **kwargs)


@given(tile_cases())
def test_numpy_tiling_and_masked_tile_load(case):
    check_tile_load(load_tile, case)


def test_tile_load_checker_rejects_an_unmasked_load():
    def unmasked(x, r0, c0, rows, cols):
        return x[r0:r0 + rows, c0:c0 + cols]

    case = TileCase(np.ones((3, 5), np.float32), np.ones((5, 2), np.float32), 2, 2, 4)
    with pytest.raises(AssertionError):
        check_tile_load(unmasked, case)


def test_global_bytes_per_rung():
    m, n, k = 64, 48, 40
    assert global_bytes(m, n, k, rung=1) == 4 * (2 * m * n * k + m * n)
    assert global_bytes(m, n, k, rung=2, tile=16) == 4 * (m * k * 3 + k * n * 4 + m * n)
    assert global_bytes(m, n, k, rung=3, bm=32, bn=32) == 4 * (m * k * 2 + k * n * 2 + m * n)
    assert global_bytes(m, n, k, rung=0) == 4 * (m * k + k * n + m * n)


# --------------------------------------------------------------------------- rung 4: tensor cores

MMA_TILES = [MMA_TILES_SIM, (16, 32, 32, 16, 16), (16, 32, 16, 16, 16, 3), (32, 32, 16, 16, 16, 4)] + (
    [] if SIM else [MMA_TILES_GPU, (64, 64, 32, 32, 32), (128, 128, 32, 64, 32, 2), (128, 64, 64, 64, 32, 3)])


def bf16_of(x):
    """float32 values rounded to bf16: (bit patterns as uint16, their values as float32)."""
    bits = bf16_bits(x).astype(np.uint16)
    return bits, (bits.astype(np.uint32) << 16).view(np.float32)


@st.composite
def mma_cases(draw, max_dim=48 if SIM else 700, bf16=False):
    """(a, b, tiles, a's values, b's values): a, b float16, or bf16 bits (uint16)."""
    m, k, n = (draw(st.integers(0, max_dim)) for _ in range(3))
    if draw(st.booleans()):                       # 16-byte rows (cp.async) or not (element copies)
        k, n = -(-k // 8) * 8, -(-n // 8) * 8
    magnitude = draw(st.sampled_from([0.01, 1.0, 100.0]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    a, b = random_array(rng, (m, k), magnitude), random_array(rng, (k, n))
    tiles = draw(st.sampled_from(MMA_TILES))
    if bf16:
        (a, av), (b, bv) = bf16_of(a), bf16_of(b)
        return a, b, tiles, av, bv
    a, b = a.astype(np.float16), b.astype(np.float16)
    return a, b, tiles, a, b


def check_mma(a, b, tiles, av=None, bv=None, bf16=False):
    """Rung 4 against the oracle on the rounded inputs ``av``, ``bv`` (the products are exact in
    float32 for fp16 and bf16 alike; the sums float32): the float32 rule of the other rungs."""
    av, bv = (a, b) if av is None else (av, bv)
    got = matmul_tensor_cores(a, b, tiles=tiles, bf16=bf16)
    assert isinstance(got, np.ndarray) and got.dtype == np.float32 and got.shape == (a.shape[0], b.shape[1])
    assert_close(got, ref.matmul(av, bv), ref.matmul(av, bv, dtype=np.float32),
                 name=f"C (rung 4, tensor cores, {'bf16' if bf16 else 'fp16'})", floor=matmul_floor(av, bv))


@given(mma_cases())
@example((np.ones((1, 1), np.float16), np.ones((1, 1), np.float16), MMA_TILES_SIM, None, None)).via("1 x 1 x 1")
@example((np.ones((33, 40), np.float16), np.full((40, 17), 0.5, np.float16), MMA_TILES_SIM, None, None)).via("ragged")
@example((np.ones((3, 0), np.float16), np.ones((0, 4), np.float16), MMA_TILES_SIM, None, None)).via("K = 0: C is zeros")
def test_tensor_core_rung_matches_oracle(case):
    check_mma(*case)


def bf16_case(x, y, tiles):
    (a, av), (b, bv) = bf16_of(x), bf16_of(y)
    return a, b, tiles, av, bv


@given(mma_cases(bf16=True))
@example(bf16_case(np.full((33, 40), 1.5, np.float32), np.full((40, 17), 0.3, np.float32), MMA_TILES_SIM)
         ).via("ragged; 0.3 is no bf16 value")
def test_tensor_core_rung_bf16_matches_oracle(case):
    check_mma(*case, bf16=True)


def test_tensor_core_rung_bf16_tolerance_bites():
    """The bf16 check catches bf16 bits read as fp16, and an oracle on the unrounded inputs
    (the tolerance is the float32 rule, far below bf16's rounding of the inputs)."""
    rng = np.random.default_rng(3)
    x, y = rng.standard_normal((20, 24)).astype(np.float32), rng.standard_normal((24, 12)).astype(np.float32)
    (a, av), (b, bv) = bf16_of(x), bf16_of(y)
    check_mma(a, b, MMA_TILES_SIM, av, bv, bf16=True)
    with pytest.raises(AssertionError):             # the wrong mma: bf16 bits taken as fp16
        got = matmul_tensor_cores(a.view(np.float16), b.view(np.float16), tiles=MMA_TILES_SIM)
        assert_close(got, ref.matmul(av, bv), ref.matmul(av, bv, dtype=np.float32), floor=matmul_floor(av, bv))
    with pytest.raises(AssertionError):             # the oracle on the inputs before rounding
        check_mma(a, b, MMA_TILES_SIM, x, y, bf16=True)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(a=np.ones((2, 3), np.float32)), TypeError, "a: expected dtype"),
    (dict(b=np.ones((4, 2), np.float16)), ValueError, "b: expected 3 rows"),
    (dict(tiles=(32, 32, 8, 16, 16)), ValueError, "tiles: expected"),
    (dict(tiles=(32, 32, 16, 16)), ValueError, "tiles: expected"),
    (dict(tiles=(32, 32, 16, 16, 16, 5)), ValueError, "tiles: expected"),
    (dict(tiles=(32, 32, 128, 16, 16)), ValueError, "tiles: expected"),
    (dict(tiles=(256, 256, 64, 64, 64, 4)), ValueError, "tiles: .* bytes of shared memory"),
    (dict(bf16=True), TypeError, "a: expected dtype uint16"),
    (dict(bf16=1), TypeError, "bf16: expected True or False"),
    (dict(a=np.ones((2, 3), np.uint16)), TypeError, "a: expected dtype float16"),
])
def test_tensor_core_rung_bad_input(kwargs, error, match):
    args = dict(a=np.ones((2, 3), np.float16), b=np.ones((3, 2), np.float16))
    args.update(kwargs)
    with pytest.raises(error, match=match):
        matmul_tensor_cores(args.pop("a"), args.pop("b"), **args)


@pytest.mark.skipif(SIM, reason="K = 4096 is for the GPU")
def test_tensor_core_rung_long_k():
    # One chain of mma over all of K let the tensor core's truncating float32 sums drift to 13x
    # NumPy's float32 error at K = 4096 (measured on the H100); the two-level sums meet the rule.
    rng = np.random.default_rng(17)
    a = rng.standard_normal((64, 4096)).astype(np.float16)
    b = rng.standard_normal((4096, 72)).astype(np.float16)
    check_mma(a, b, MMA_TILES_GPU)
    check_mma(*bf16_case(a.astype(np.float32), b.astype(np.float32), MMA_TILES_GPU), bf16=True)
