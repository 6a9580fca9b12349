"""The tour (``python -m kernels``) finds chapter bench modules, survives a failing one,
and writes a labelled CSV and a PNG per chapter. Stub chapters live in a temp folder."""

import os
import subprocess
import sys

from kernels.bench.harness import read_csv

STUB_OK = '''
CHAPTER = {chapter}
TITLE = "stub {chapter}"
import numpy as np
def run(ctx):
    out = []
    for n in (16, 32):
        x = np.random.default_rng(n).standard_normal((n, n)).astype(np.float32)
        for peer in (False, True):
            out.append(ctx.measure(CHAPTER, "peer: numpy" if peer else "ours", f"N={{n}}",
                                   lambda a: a @ a, [(x,), (x + 1,)], flops=2.0 * n**3,
                                   model_bytes=8.0 * n * n, is_peer=peer, extra={{"N": n}}))
    out.append(ctx.measure(CHAPTER, "no N", "fixed", lambda: None, [()], flops=0, model_bytes=0))
    return out
'''
STUB_RAISES = '''
CHAPTER = 1
TITLE = "stub that raises"
def run(ctx):
    raise RuntimeError("this chapter is broken on purpose")
'''


def _tour(tmp_path, *args):
    bench = tmp_path / "bench"
    bench.mkdir(exist_ok=True)
    (bench / "stub_two.py").write_text(STUB_OK.format(chapter=2))
    (bench / "stub_zero.py").write_text(STUB_OK.format(chapter=0))
    (bench / "stub_raises.py").write_text(STUB_RAISES)
    (bench / "helper_not_a_chapter.py").write_text("X = 1\n")
    env = dict(os.environ, WORKBOOK_DEVICE="sim", MPLBACKEND="Agg")
    return subprocess.run([sys.executable, "-m", "kernels", "--bench-dir", str(bench), *args],
                          env=env, capture_output=True, text=True, timeout=300)


def test_tour_runs_in_order_survives_a_failure_and_writes_results(tmp_path):
    out = tmp_path / "out"
    proc = _tour(tmp_path, "--out", str(out), "--quick")
    text = proc.stdout + proc.stderr
    assert proc.returncode == 1, text                      # one chapter raised, one module is no chapter
    assert "falling back to the Numba CUDA simulator" in text
    assert "this chapter is broken on purpose" in text
    assert "helper_not_a_chapter: not a chapter bench module" in text
    lines = proc.stdout.splitlines()
    heads = [i for i, line in enumerate(lines) if line.startswith("kernel ")]
    assert len(heads) == 2, proc.stdout                     # one table a chapter that ran
    for i in heads:                                        # the simulator's table: times, no rates, no nan
        assert lines[i].split()[-3:] == ["median", "ms", "spread"], lines[i]
        assert not any("nan" in row for row in lines[i + 2:i + 7]), "\n".join(lines[i:i + 7])
    assert text.index("== chapter 0") < text.index("== chapter 1") < text.index("== chapter 2")
    for name in ("stub_zero", "stub_two"):
        env, rows = read_csv(out / f"{name}.csv")
        assert "SIMULATOR" in env["timings"]
        assert env["device"].startswith("Numba CUDA simulator")
        assert len(rows) == 5 and {r["kernel"] for r in rows} == {"ours", "peer: numpy", "no N"}
        assert all(r["median_ms"] > 0 for r in rows)
        png = (out / f"{name}.png").read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert not (out / "stub_raises.csv").exists()


def test_tour_chapters_option_and_list(tmp_path):
    out = tmp_path / "out"
    proc = _tour(tmp_path, "--out", str(out), "--chapters", "2", "--quick")
    assert proc.returncode == 1  # the broken helper module is still reported
    assert sorted(p.name for p in out.iterdir()) == ["stub_two.csv", "stub_two.png"]
    proc = _tour(tmp_path, "--list")
    assert "stub_zero" in proc.stdout and "stub_two" in proc.stdout and "stub that raises" in proc.stdout


def test_tour_benches_option_runs_one_module_and_names_a_missing_one(tmp_path):
    out = tmp_path / "out"
    proc = _tour(tmp_path, "--out", str(out), "--benches", "stub_two", "--quick")
    assert proc.returncode == 1, proc.stdout + proc.stderr     # the broken helper module is still reported
    assert sorted(p.name for p in out.iterdir()) == ["stub_two.csv", "stub_two.png"]
    assert "1 of 1 chapter(s) ran" in proc.stdout
    proc = _tour(tmp_path, "--out", str(tmp_path / "out2"), "--chapters", "0", "--benches", "stub_two,nope", "--quick")
    assert proc.returncode == 1
    assert "--benches: no chapter bench module stub_two among the chapters chosen" in proc.stdout
    assert "--benches: no chapter bench module nope" in proc.stdout
    assert "0 of 0 chapter(s) ran" in proc.stdout


def test_tour_names_a_chapter_it_does_not_have_and_counts_what_ran(tmp_path):
    out = tmp_path / "out"
    proc = _tour(tmp_path, "--out", str(out), "--chapters", "2,9", "--quick")
    assert proc.returncode == 1
    assert "chapter 9: no bench module" in proc.stdout
    assert "1 of 1 chapter(s) ran" in proc.stdout
    proc = _tour(tmp_path, "--out", str(out), "--chapters", "9", "--quick")
    assert proc.returncode == 1 and "0 of 0 chapter(s) ran" in proc.stdout


def test_only_a_full_gpu_run_writes_the_committed_results():
    from kernels.bench.tour import GPU_RESULTS, SIM_RESULTS, default_out

    assert default_out(simulator=False, quick=False) == GPU_RESULTS
    assert default_out(simulator=False, quick=True) == SIM_RESULTS
    assert default_out(simulator=True, quick=False) == SIM_RESULTS


def test_tour_finds_the_real_chapters():
    env = dict(os.environ, WORKBOOK_DEVICE="sim")
    proc = subprocess.run([sys.executable, "-m", "kernels", "--list"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert "gpu_basics" in proc.stdout, proc.stdout + proc.stderr


def test_every_bench_module_is_a_chapter_or_a_named_helper():
    """A helper module added to kernels/bench/ without a place in NOT_CHAPTERS fails the tour
    (it lists it as a broken chapter and exits 1): say so here, before the tour does."""
    from kernels.bench.tour import discover

    found, broken = discover()
    assert broken == [], broken
    assert len(found) >= 14


def test_chapter_0_bench_runs_in_the_simulator(tmp_path):
    env = dict(os.environ, WORKBOOK_DEVICE="sim", MPLBACKEND="Agg")
    proc = subprocess.run([sys.executable, "-m", "kernels", "--chapters", "0", "--quick", "--out", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=300)
    text = proc.stdout + proc.stderr
    assert "== chapter 0" in text and "Traceback" not in text, text
    _, rows = read_csv(tmp_path / "gpu_basics.csv")
    kernels = {r["kernel"] for r in rows}
    assert {"copy kernel, 1 a step", "copy kernel, 4 a step", "launch: empty kernel, no arguments"} <= kernels
    assert all(r["gbps"] > 0 for r in rows if r["kernel"].startswith("copy kernel"))
    assert (tmp_path / "gpu_basics.png").exists()


def _result(**kw):
    from kernels.bench.harness import Result

    values = dict(chapter=4, kernel="flash_attention", config="N=64 d=32", median_ms=2.0, p10_ms=1.9,
                  p90_ms=2.1, flops=1e6, model_bytes=1e5, tflops=5e-7, gbps=5e-5, pct_fma_ceiling=float("nan"),
                  peak_mem_mb=float("nan"))
    return Result(**{**values, **kw})


def test_table_in_the_simulator_shows_times_only_and_on_a_gpu_every_column():
    from kernels.bench.harness import format_table

    sim = format_table([_result(), _result(kernel="peer: numpy")], simulator=True).splitlines()
    assert sim[0].split()[-3:] == ["median", "ms", "spread"]
    assert all("nan" not in line and "e-0" not in line for line in sim)
    assert sim[2].split()[-2:] == ["2", "10.0%"]
    gpu = format_table([_result(tflops=41.5, gbps=900.0, pct_fma_ceiling=83.0, peak_mem_mb=12.5)],
                       simulator=False).splitlines()
    assert gpu[0] == (f"{'kernel':<36}{'config':<44}{'median ms':>11} {'spread':>7} {'TFLOP/s':>8} {'GB/s':>8} "
                      f"{'%FMA':>6} {'peak MB':>8}")
    assert gpu[2].split()[-6:] == ["2", "10.0%", "41.5", "900", "83", "12.5"]


def test_plots_in_the_simulator_show_time_not_rates():
    from kernels.bench.tour import SIM_METRIC, _metric

    r = _result()
    assert _metric(r, simulator=True) == (SIM_METRIC, 2.0) and SIM_METRIC == "median time (ms)"
    assert _metric(r, "GB/s", simulator=True) == (SIM_METRIC, 2.0)
    assert _metric(r) == ("TFLOP/s", r.tflops)  # a GPU run: rates, as before


def test_chapter_plots_redraw_the_committed_csvs(tmp_path):
    """The chapters' own plots (one question a panel) draw from the committed GPU results."""
    import shutil

    from kernels.bench.tour import GPU_RESULTS, replot

    names = ("tiled_matmul", "online_softmax", "flash_backward", "block_sparse", "decode")
    for name in names:
        shutil.copy(GPU_RESULTS / f"{name}.csv", tmp_path)
    replot(tmp_path)
    assert all((tmp_path / f"{n}.png").stat().st_size > 10_000 for n in names)


def test_replot_skips_a_csv_that_is_not_a_benchs_results(tmp_path, capsys):
    """The results folder also holds A/B and sweep CSVs with their own columns: replot names
    and skips them, and still draws the bench's."""
    import shutil

    from kernels.bench.tour import GPU_RESULTS, replot

    for name in ("flash_tf32_column_copy_ab", "tiled_matmul"):
        shutil.copy(GPU_RESULTS / f"{name}.csv", tmp_path)
    replot(tmp_path)
    assert (tmp_path / "tiled_matmul.png").stat().st_size > 10_000
    assert not (tmp_path / "flash_tf32_column_copy_ab.png").exists()
    assert "skipped flash_tf32_column_copy_ab.csv: not a bench's results" in capsys.readouterr().out
