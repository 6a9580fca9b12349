"""Chapter 8's bench pieces that the tour does not check: the mma.sync ceiling loop computes
what it claims (so its TFLOP/s count real mma), and the bench's plot draws a GPU run's N
sweep, read back from its CSV as the tour's replot does. (The tour runs the bench itself in
the simulator.)"""

import math

import numpy as np
import pytest

from kernels.bench import flash_tensor_cores as bench
from kernels.bench import mma_ceiling
from kernels.bench.harness import Result, write_csv


@pytest.mark.parametrize("bf16", [False, True])
def test_the_ceiling_loop_sums_every_chain_exactly(bf16):
    launch, a, b, out, flops, (blocks, threads, steps) = mma_ceiling.ceiling_inputs(bf16)
    launch(a, b, out)
    assert mma_ceiling.check_output(out, bf16) == 0
    assert flops == blocks * threads // 32 * steps * mma_ceiling.CHAINS * 4096
    # the check bites: a step lost in every chain, or one chain's start, is far from zero
    assert mma_ceiling.check_output(out, bf16, steps=steps + 1) >= mma_ceiling.CHAINS
    assert mma_ceiling.check_output(out.copy_to_host() - np.float32(7), bf16) == 7
    x, y, _, _ = mma_ceiling.operands(bf16=bf16)
    assert np.count_nonzero(x @ y) > 64          # (zeros in A B would hide lost steps)


def _gpu_like_results(dims=(64, 128), ns=(512, 1024, 2048, 4096, 8192, 16384), peers=True):
    """Rows shaped as a GPU run writes them (throughputs made up)."""
    ceilings = {"fp16": 660.0, "bf16": 655.0}
    rows = [Result(8, f"{bench.CEILING} {kind}", "528 blocks x 256 threads, 8192 steps", 1.7, 1.7, 1.7, 1e12, 0.0,
                   t, 0.0, math.nan, math.nan, False, "", {"dtype": kind, "ceiling": "mma.sync"})
            for kind, t in ceilings.items()]
    speeds = {bench.BARE: 130, bench.LAUNCHER: 110, "peer: SDPA flash": 290, "peer: SDPA cuDNN": 500}
    at_ref = {bench.FMA: 30, "peer: SDPA memory-efficient": 125, bench.FLEX: 260} if peers else {}
    for d in dims:
        for kind in ("fp16", "bf16"):
            for n in (ns if kind == "fp16" else (4096,)):
                for causal in (False, True):
                    for kernel, t in list(speeds.items()) + list(at_ref.items() if n == 4096 else []):
                        extra = {"N": n, "B": 16384 // n, "d": d, "causal": causal, "dtype": kind}
                        r = Result(8, kernel, f"B={16384 // n} H=16 N={n} d={d} {kind} causal={causal}", 1.0, 1.0,
                                   1.0, 1e12, 1e8, t * (1 - 256 / n), 100.0, math.nan, math.nan,
                                   kernel.startswith("peer"), "", extra)
                        rows.append(bench._with_ceiling(r, ceilings))
    return rows


def test_rows_carry_their_share_of_the_ceiling():
    rows = _gpu_like_results(dims=(64,), ns=(1024, 4096))
    r = next(r for r in rows if r.kernel == bench.BARE and r.extra["dtype"] == "bf16")
    assert r.extra["pct_mma_ceiling"] == f"{100 * r.tflops / 655.0:.1f}" and "of the mma.sync ceiling" in r.note


def test_the_plot_draws_a_gpu_run_and_a_quick_one(tmp_path):
    from kernels.bench.tour import replot

    write_csv(tmp_path / "flash_tensor_cores.csv", _gpu_like_results(),
              {"device": "NVIDIA H100 80GB HBM3", "chapter": "8 tensor cores"})
    replot(tmp_path)                                 # from the CSV: every extra a string
    assert (tmp_path / "flash_tensor_cores.png").stat().st_size > 50_000
    quick = [r for r in _gpu_like_results(dims=(64,), ns=(1024, 4096, 16384), peers=False)
             if not r.kernel.startswith(bench.CEILING)]   # a quick run whose ceiling and peers failed
    bench.plot(quick, tmp_path / "quick.png", title="quick", simulator=False)
    assert (tmp_path / "quick.png").stat().st_size > 20_000
