"""Chapter 12's bench pieces that the tour does not check: the guard on head (0, 0) passes
gradients as good as the tests' yardstick and stops a broken run, and a configuration's rows
differ only in N across the sweep (the tour's plot draws them as lines over N). No kernel
runs here; the tour runs the bench itself in the simulator."""

import numpy as np
import pytest
from numba import cuda

from kernels import reference as ref
from kernels.base.mma import bf16_bits
from kernels.base.runtime import on_simulator
from kernels.bench import tensor_core_backward as bench
from kernels.bench.tour import _without_n
from kernels.tensor_core_backward import rounded_backward_numpy


def _case(bf16, causal, n=32, d=16, seed=12):
    """The bare launch's inputs (B H = 1) as device arrays, and the host float32 values."""
    rng = np.random.default_rng(seed)
    xs = [rng.standard_normal((1, 1, n, d)).astype(np.float32) for _ in range(4)]
    if bf16:
        bits = [bf16_bits(x).astype(np.uint16).reshape(x.shape) for x in xs]
        vals = [(b.astype(np.uint32) << 16).view(np.float32) for b in bits]
    else:
        vals = [x.astype(np.float16).astype(np.float32) for x in xs]
        bits = [v.astype(np.float16).view(np.uint16) for v in vals]
    q, k, v, do = vals
    o, lse = (x.astype(np.float32) for x in ref.attention(q, k, v, causal=causal))
    inputs = tuple(cuda.to_device(x.reshape(1, n, d)) for x in bits[:3]) + (
        cuda.to_device(o.reshape(1, n, d)), cuda.to_device(lse.reshape(1, n)), cuda.to_device(bits[3].reshape(1, n, d)))
    grads = rounded_backward_numpy(q, k, v, o, lse, do, causal=causal, bf16=bf16)
    return inputs, [g.reshape(1, n, d) for g in grads]


@pytest.mark.parametrize("bf16, causal", [(False, False), (True, True)])
def test_the_guard_passes_the_yardstick_and_stops_a_broken_run(bf16, causal):
    inputs, grads = _case(bf16, causal)
    errors = bench.check_head(None, inputs, [cuda.to_device(g) for g in grads], causal, bf16)
    assert set(errors) == {"dq", "dk", "dv"}
    for err, top, times in errors.values():
        assert 0 < err < 0.01 * top and times == pytest.approx(1.0)    # the yardstick against itself
    # planted: a query tile's dQ never added (its 16 rows zero), then dK without its scale
    lost = grads[0].copy()
    lost[:, -16:] = 0
    with pytest.raises(AssertionError, match="dq of head"):
        bench.check_head(None, inputs, [cuda.to_device(g) for g in (lost, grads[1], grads[2])], causal, bf16)
    unscaled = grads[1] * np.sqrt(grads[1].shape[-1])
    with pytest.raises(AssertionError, match="dk of head"):
        bench.check_head(None, inputs, [cuda.to_device(g) for g in (grads[0], unscaled, grads[2])], causal, bf16)


def test_a_configuration_differs_only_in_n_across_the_sweep():
    names = [bench.config_name(16 * 1024, 16, n, 64, "fp16", True) for n in (1024, 4096, 16384)]
    assert len(set(names)) == 3 and len({_without_n(c) for c in names}) == 1
    assert names[0] == "B=16k/N H=16 N=1024 d=64 fp16 causal=True"
    assert bench.config_name(16, 1, 8, 16, "bf16", False) == "B=16/N H=1 N=8 d=16 bf16 causal=False"


def test_the_tile_sweep_checks_each_candidate_and_reports_one_it_cannot_run():
    from kernels.bench.harness import Context

    lines = []
    ctx = Context(quick=False, warmup=0, repeat=1, progress=lines.append)
    results = bench.tile_sweep(ctx, dims=(64,), candidates=[(32, 2), (24, 2), (32, 1, 0, 1)])   # d = 16 in the simulator
    peers = [r for r in results if r.kernel.startswith("peer: ")]      # on a GPU: SDPA flash's rows
    results = [r for r in results if r not in peers]
    assert all("tiles" not in r.extra for r in peers)
    # (24, 2): Br not a multiple of 16, refused by the kernel's factory: said, and skipped
    assert [r.extra["tiles"] for r in results] == ["32x2", "32x1x0x1"] * 2
    assert [r.extra["causal"] for r in results] == [False, False, True, True]
    assert sum("tiles (24, 2) failed: ValueError" in line for line in lines) == 2
    for r in results:                     # each row's gradients checked against float64 (NumPy here)
        assert 0 < r.extra["max_error"] < 1e-2 and 0.5 < r.extra["dq_error_vs_rounded"] < 2


def test_once_runs_the_profilers_call(capsys):
    """``--once D``: the call a profiler watches (chapter 8's forward, the backward once); in
    the simulator at B = H = 1, N = 16. A bad D is the launcher's clear error."""
    assert bench.main(["--once", "16", "--causal"]) == 0
    size = "B=1 H=1 N=16" if on_simulator() else "B=4 H=16 N=4096"
    assert f"ran: chapter 12's backward, {size} d=16 fp16 causal=True" in capsys.readouterr().out
    with pytest.raises(ValueError, match="head dim d in 1..128, got 0"):
        bench.main(["--once", "0"])
