"""Chapter 13's floor bench: its peer computes attention, its pairing of cells is right, and
the committed sweep covers every configuration the sweep names (CPU)."""

import math

import numpy as np
import pytest
from hypothesis import given, strategies as st

torch = pytest.importorskip("torch")

from kernels import reference as ref  # noqa: E402
from kernels.bench import capstone_floor as floor  # noqa: E402
from kernels.bench.harness import RESULTS_DIR, Result, read_results  # noqa: E402


@given(n=st.integers(1, 40), d=st.sampled_from([4, 16, 32]), causal=st.booleans(), seed=st.integers(0, 2**16))
def test_the_peer_is_attention(n, d, causal, seed):
    """Plain PyTorch as the bench runs it: softmax(q k^T / sqrt(d)) v, the causal mask its cached
    buffer, within float32's error of the float64 oracle (a wrong peer would fake the floor)."""
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((1, 2, n, d)).astype(np.float32) for _ in range(3))
    plain = floor.PlainAttention(torch)
    got = plain(*(torch.from_numpy(x) for x in (q, k, v)), causal).double().numpy()
    again = plain(*(torch.from_numpy(x) for x in (q, k, v)), causal).double().numpy()   # the cached mask
    exact, _ = ref.attention(q, k, v, causal=causal)
    assert np.abs(got - exact).max() <= 1e-5 * max(1.0, np.abs(exact).max())
    np.testing.assert_array_equal(got, again)


def _row(kernel, config, ms, **extra):
    return Result(13, kernel, config, ms, ms, ms, 1.0, math.nan, math.nan, math.nan, math.nan, math.nan,
                  kernel == floor.PLAIN, "", extra)


def test_cells_pair_ours_with_the_peer_of_the_same_configuration():
    extra = dict(BH=8, d=64, N=1024, causal=False, dtype="bf16", **{"pass": "fwd"})
    rows = [_row(floor.OURS, "a", 2.0, **extra), _row(floor.PLAIN, "a", 1.0, **extra),
            _row(floor.OURS, "b", 1.0, **dict(extra, causal=True)), _row(floor.PLAIN, "b", math.nan, **extra)]
    grid = floor.cells(rows)
    assert grid == {("bf16", "fwd"): {(8, 64, 1024, False): 0.5, (8, 64, 1024, True): None}}


def test_the_committed_sweep_covers_every_configuration():
    """workbook/results/capstone_floor.csv: each (precision, pass, B*H, N, d, causal) of the GPU
    sweep once, ours and plain PyTorch; ours timed in every cell (plain may run out of memory)."""
    path = RESULTS_DIR / "capstone_floor.csv"
    env, results = read_results(path)
    assert env["device"].startswith("NVIDIA"), f"a GPU run, not {env['device']!r}"

    class GPU:
        simulator, quick = False, False

    bhs, ns, ds, precisions = floor.sweep(GPU)
    grid = floor.cells(results)
    for precision in precisions:
        for pass_ in ("fwd", "fwd+bwd"):
            cells = grid[(precision, pass_)]
            expected = {(bh, d, n, c) for bh in bhs for d in ds for n in ns for c in (False, True)}
            assert set(cells) == expected, f"{precision} {pass_}: cells missing or extra"
    ours = [r for r in results if r.kernel == floor.OURS]
    assert len(ours) == len(precisions) * 2 * len(bhs) * len(ns) * len(ds) * 2
    assert all(r.median_ms > 0 for r in ours), "ours has a cell without a time"


class _Context:
    def __init__(self, simulator):
        self.simulator, self.quick = simulator, False

    def progress(self, line):
        pass


def test_the_two_sides_take_turns_and_each_round_is_a_ratio(monkeypatch):
    """``_time_pair`` on a GPU: ROUNDS runs a side, which side goes first alternating; each
    side's median its own, the ratios those of one round's two runs."""
    order, times = [], {"plain": iter([2.0, 2.0, 4.0, 2.0, 2.0, 2.0, 8.0, 2.0, 2.0]),
                        "ours": iter([1.0, 1.0, 1.0, 4.0, 1.0, 1.0, 1.0, 1.0, 1.0])}

    def back_to_back(fn, inputs, calls):
        order.append(fn())
        return next(times[fn()])

    monkeypatch.setattr(floor, "_back_to_back", back_to_back)
    once = (floor.Timing(1.0, 1.0, 1.0, 1, ""), floor.Timing(0.5, 0.5, 0.5, 1, ""))
    plain, ours, ratios = floor._time_pair(_Context(False), lambda: "plain", lambda: "ours", [()], once)
    assert order == [side for r in range(floor.ROUNDS) for side in
                     (("plain", "ours") if r % 2 == 0 else ("ours", "plain"))]
    assert (plain.median_ms, ours.median_ms) == (2.0, 1.0)
    assert (plain.p10_ms, plain.p90_ms, ours.p10_ms, ours.p90_ms) == (2.0, 4.0, 1.0, 1.0)
    assert ratios == sorted([2.0, 2.0, 4.0, 0.5, 2.0, 2.0, 8.0, 2.0, 2.0])


def test_a_cell_where_plain_runs_out_of_memory_times_ours_once():
    """The peer out of memory: its row NaN and so noted, ours run once and timed, no ratio."""
    def plain(q, k, v, causal):
        raise torch.OutOfMemoryError("plain's N x N scores")

    def ours(q, k, v, causal=False):
        calls.append(1)
        return q * 1.0

    calls, results = [], []
    inputs = [tuple(torch.randn(1, 1, 8, 4).requires_grad_(i < 3) for i in range(4))]
    floor._cell(_Context(True), torch, results, ours, plain, inputs, "fp32", 1, 1, 8, 4, False, "fwd")
    got = {r.kernel: r for r in results}
    assert math.isnan(got[floor.PLAIN].median_ms) and got[floor.PLAIN].note == "out of memory"
    assert got[floor.OURS].median_ms > 0 and len(calls) == 1
    assert got[floor.OURS].extra["speedup over plain"] == "plain out of memory"
    assert floor.cells(results) == {("fp32", "fwd"): {(1, 4, 8, False): None}}
