"""The napkin model: its arithmetic on cases checkable by hand, its monotonicity, the committed
measurements it reads, and a planted bug in the quantization (fp16 counted as 4 bytes)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from kernels import napkin_model as nm
from kernels.bench.harness import read_csv

ROUND = nm.Machine("round numbers",
                   bandwidth={"HBM copy": 1e12, "HBM read": 2e12, "L2": 4e12, "shared memory": 8e12},
                   flop_rate={"fp32 FMA": 1e13, "fp16 mma.sync": 1e14, "fp8 mma.sync": 1e14}, sources={})


def committed():
    """(machine, cases) from the committed CSVs, or a skip naming what is missing."""
    try:
        return nm.h100(), nm.reference_cases()
    except nm.MissingMeasurement as e:
        pytest.skip(f"committed results missing: {e}")


# --------------------------------------------------------------------------- arithmetic by hand

def test_level_times_by_hand():
    w = nm.Work(flops=2e13, hbm=1e12, l2=2e12, smem=4e12)
    assert nm.level_times(w, ROUND) == {"HBM": 1.0, "L2": 0.5, "shared memory": 0.5, "registers": 2.0}
    assert nm.predict(w, ROUND) == (2.0, "registers")
    assert nm.predict(nm.Work(0.0, 3e12), ROUND) == (3.0, "HBM")
    assert nm.predict(nm.Work(0.0, 3e12, hbm_key="HBM read"), ROUND) == (1.5, "HBM")
    assert nm.predict(nm.Work(1e13, 0.0, smem=16e12), ROUND) == (2.0, "shared memory")
    assert nm.predict(nm.Work(1e14, 0.0, rate="fp16 mma.sync"), ROUND) == (1.0, "registers")


def test_smem_bytes_by_hand():
    # 8x8 micro-tile: 16 operands (64 B) for 64 FMAs = 128 FLOPs: 0.5 B a FLOP
    assert nm.smem_bytes(128, 8, 8) == 64
    assert nm.smem_bytes(128, 4, 4) == 128                      # 4x4: 1 B a FLOP
    assert nm.smem_bytes(128, 16, math.inf, itemsize=2) == 8    # a 16-row warp, the other operand read in full
    assert nm.smem_bytes(128, 8, 8, stored=10) == 74
    with pytest.raises(ValueError, match="tm, tn"):
        nm.smem_bytes(1, 0, 8)


def test_case_sums_its_parts():
    parts = (nm.Part("a", nm.Work(1e13, 0.0)), nm.Part("b", nm.Work(0.0, 2e12)), nm.Part("c", nm.Work(3e13, 0.0)))
    case = nm.Case("x", "three kernels", "", parts, 7.0, "")
    assert nm.predict_case(case, ROUND) == (6.0, "registers + HBM")
    row = nm.prediction_table(ROUND, [case])[0]
    assert row["predicted_ms"] == 6000.0 and row["ratio"] == 7.0 / 6000.0
    assert row["levels_ms"]["registers"] == 4000.0 and row["levels_ms"]["HBM"] == 2000.0


def test_bad_work_is_named():
    with pytest.raises(ValueError, match="hbm"):
        nm.Work(1.0, -1.0)
    with pytest.raises(ValueError, match="rate"):
        nm.level_times(nm.Work(1.0, 1.0, rate="tf32"), ROUND)
    with pytest.raises(ValueError, match="hbm_key"):
        nm.level_times(nm.Work(1.0, 1.0, hbm_key="HBM"), ROUND)


@pytest.mark.parametrize("field", ["flops", "hbm", "l2", "smem"])
def test_more_work_never_takes_less_time(field):
    w = nm.Work(1e13, 1e12, 1e12, 1e12)
    times = [nm.predict(replace(w, **{field: getattr(w, field) * s}), ROUND)[0] for s in (0.1, 0.5, 1, 2, 10)]
    assert times == sorted(times)


@pytest.mark.parametrize("key", ["HBM copy", "L2", "shared memory"])
def test_more_bandwidth_never_takes_more_time(key):
    w = nm.Work(1e13, 4e12, 8e12, 16e12)
    times = []
    for s in (0.25, 0.5, 1, 2, 4):
        m = replace(ROUND, bandwidth={**ROUND.bandwidth, key: ROUND.bandwidth[key] * s})
        times.append(nm.predict(w, m)[0])
    assert times == sorted(times, reverse=True)


# --------------------------------------------------------------------------- quantization and a planted bug

def check_quantized(quantized):
    """What any quantization must do: fp16 halves and fp8 quarters every byte, the FLOPs stay;
    an HBM-bound kernel then runs 2x and 4x faster, an FMA-bound one no faster."""
    w = nm.Work(1e12, 4e12, 4e12, 8e12)
    for item, s in ((2, 0.5), (1, 0.25)):
        q = quantized(w, item)
        assert (q.hbm, q.l2, q.smem, q.flops) == (w.hbm * s, w.l2 * s, w.smem * s, w.flops)
        assert nm.predict(w, ROUND)[0] / nm.predict(q, ROUND)[0] == pytest.approx(1 / s)
    f = nm.Work(1e14, 1e12)
    assert nm.predict(quantized(f, 2), ROUND)[0] == nm.predict(f, ROUND)[0]
    assert quantized(f, 2, rate="fp16 mma.sync").rate == "fp16 mma.sync"


def test_quantized():
    check_quantized(nm.quantized)
    with pytest.raises(ValueError, match="itemsize"):
        nm.quantized(nm.Work(1, 1), 3)


def test_planted_bug_fp16_counted_as_4_bytes_is_caught():
    def fp16_as_4_bytes(work, itemsize, *, from_itemsize=4, rate=None):
        return nm.quantized(work, 4 if itemsize == 2 else itemsize, from_itemsize=from_itemsize, rate=rate)

    with pytest.raises(AssertionError):
        check_quantized(fp16_as_4_bytes)


# --------------------------------------------------------------------------- the committed measurements

def test_machine_figures_are_the_committed_ones():
    from kernels.base.io_model import ceilings

    machine, _ = committed()
    c = ceilings()
    assert machine.bandwidth["HBM copy"] == c.memcpy_gbps * 1e9
    assert machine.flop_rate["fp32 FMA"] == c.fp32_tflops * 1e12
    _, rows = read_csv(nm.RESULTS_DIR / "flash_tensor_cores.csv")
    ceiling = [r for r in rows if r["kernel"] == "ceiling: mma.sync m16n8k16 fp16"]
    assert ceiling and machine.flop_rate["fp16 mma.sync"] == ceiling[0]["tflops"] * 1e12
    assert machine.flop_rate["fp8 mma.sync"] <= machine.flop_rate["fp16 mma.sync"]   # emulated on sm_90
    assert machine.bandwidth["shared memory"] == pytest.approx(128 * 132 * machine.clock_hz())
    assert {k for k, (kind, _) in machine.sources.items() if kind == "measured"} >= {"HBM copy", "HBM read",
                                                                                     "fp32 FMA", "fp16 mma.sync"}
    assert machine.sources["L2"][0] == "nominal" and machine.sources["shared memory"][0] == "derived"


def test_every_chapter_is_found_and_each_ratio_comes_from_its_row():
    machine, cases = committed()
    assert {c.chapter for c in cases} >= {str(k) for k in range(11)}
    table = nm.prediction_table(machine, cases)
    for case, row in zip(cases, table):
        csv_name = case.source.split(":")[0]
        _, rows = read_csv(nm.RESULTS_DIR / csv_name)
        assert any(r["median_ms"] == case.measured_ms for r in rows), (csv_name, case.kernel)
        t, bound = nm.predict_case(case, machine)
        assert row["measured_ms"] == case.measured_ms and row["predicted_ms"] == t * 1e3
        assert row["ratio"] == case.measured_ms / (t * 1e3) and row["bound"] == bound
        assert row["miss"], case.kernel


def test_bounds_and_quantization_read_as_the_chapters_say():
    machine, cases = committed()
    bound = {r["kernel"]: r["bound"] for r in nm.prediction_table(machine, cases)}
    for kernel in ("row softmax", "decode stream-k, fp32 cache", "decode stream-k, fp16 cache", "copy kernel"):
        assert bound[kernel] == "HBM"
    assert "HBM" not in bound["fused forward"] and "HBM" not in bound["tensor-core forward"]
    gains = {r["kernel"]: r for r in nm.quantization_table(machine, cases)}
    for kernel in ("row softmax", "decode stream-k, fp32 cache"):       # bandwidth-bound: all of it
        assert gains[kernel]["fp16_gain"] == pytest.approx(2) and gains[kernel]["fp8_gain"] == pytest.approx(4)
    assert gains["fused forward"]["fp16_gain"] < 1.1                     # FMA-bound: nothing
    checks = nm.quantization_checks(machine, cases)
    assert [c["predicted_gain"] > 0 and c["measured_gain"] > 0 for c in checks] == [True] * 3


def test_a_missing_csv_is_named(tmp_path):
    with pytest.raises((nm.MissingMeasurement, FileNotFoundError), match="no committed results"):
        nm.reference_cases(tmp_path)


def test_diagrams_draw():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2)
    nm.draw_standard(a, n=256, d=16)
    nm.draw_streamed(b, n=256, d=16, Br=64, Bc=32)
    assert nm.fmt_bytes((4 * 256 * 256 + 4 * 256 * 16) * 4) in a.get_title()   # 4N^2 + 4Nd floats
    assert "4\u00d7" in b.get_title()           # ceil(256 / 64) query tiles stream K, V
    plt.close(fig)
    assert nm.fmt_bytes(1536) == "1.5 KiB" and nm.fmt_bytes(64 * 2**20) == "64 MiB" and nm.fmt_bytes(12) == "12 B"
