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
