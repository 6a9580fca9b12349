"""The tour: ``python -m kernels`` runs every chapter's bench with one harness.

Each module ``kernels/bench/<idea>.py`` that defines ``CHAPTER``, ``TITLE`` and
``run(ctx)`` is found (nothing is listed by hand), run in chapter order, and leaves

    <out>/<idea>.csv   every Result, headed by the device, driver and package versions
    <out>/<idea>.png   throughput per kernel and config (peers hatched), and a line plot
                       over N when the results carry N in ``extra``; in the simulator,
                       time instead of throughput (a rate from a simulated time means nothing)

``<out>`` is ``workbook/results/`` for a full run on a GPU (the committed results the notebooks
show) and ``bench-out/`` otherwise (the simulator, or ``--quick``), so neither simulator
timings nor a quick run's fewer sizes overwrite the full GPU results.
A chapter that raises is reported and skipped; the tour then exits non-zero.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import importlib
import importlib.util
import math
import os
import pkgutil
import re
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from kernels.base import runtime
from kernels.bench import harness
from kernels.base.runtime import on_simulator

REPO = Path(__file__).resolve().parents[2]
GPU_RESULTS = REPO / "workbook" / "results"
SIM_RESULTS = REPO / "bench-out"
NOT_CHAPTERS = {"harness", "tour", "turns", "traffic", "peer_pipes", "ncu", "ncu_source", "mma_ceiling", "__init__", "__main__"}
SIM_METRIC = "median time (ms)"  # what the simulator's plots show: times, never rates
SIM_LABEL = "SIMULATOR timings (Numba CUDA simulator on the CPU, tiny sizes): not GPU performance"


@dataclass
class Chapter:
    name: str          # the module's idea name: results are <name>.csv / <name>.png
    chapter: int
    title: str
    module: object


# --------------------------------------------------------------------------- discovery

def discover(bench_dir: Path | None = None) -> tuple[list[Chapter], list[tuple[str, str]]]:
    """Chapters found in ``kernels/bench/`` (or ``bench_dir``), sorted by chapter number,
    and (module, error) for every module that failed to import or lacks the interface."""
    found, broken = [], []
    if bench_dir is None:
        import kernels.bench as pkg

        names = [m.name for m in pkgutil.iter_modules(pkg.__path__) if not m.ispkg]
        load = lambda name: importlib.import_module(f"kernels.bench.{name}")  # noqa: E731
    else:
        paths = {p.stem: p for p in sorted(Path(bench_dir).glob("*.py"))}
        names = list(paths)

        def load(name):
            spec = importlib.util.spec_from_file_location(f"_bench_{name}", paths[name])
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
    for name in names:
        if name in NOT_CHAPTERS or name.startswith("_"):
            continue
        try:
            module = load(name)
        except Exception as exc:
            broken.append((name, f"import failed: {type(exc).__name__}: {exc}"))
            continue
        missing = [attr for attr in ("CHAPTER", "TITLE", "run") if not hasattr(module, attr)]
        if missing:
            broken.append((name, f"not a chapter bench module (missing {', '.join(missing)})"))
            continue
        found.append(Chapter(name, int(module.CHAPTER), str(module.TITLE), module))
    found.sort(key=lambda c: (c.chapter, c.name))
    return found, broken


# --------------------------------------------------------------------------- plots

def _metric(r, judged_by=None, simulator=False):
    """What a result is best judged by: FLOP rate, byte rate, or plain time. A chapter
    whose kernels are bound by bandwidth (decode) says ``JUDGED_BY = "GB/s"``. In the
    simulator only the time means anything (a rate from a CPU time is noise): plain time."""
    if simulator:
        return SIM_METRIC, r.median_ms
    if judged_by == "GB/s" and r.model_bytes and float(r.model_bytes) > 0:
        return "GB/s", r.gbps
    if r.flops and r.flops > 0:
        return "TFLOP/s", r.tflops
    if r.model_bytes and r.model_bytes > 0:
        return "GB/s", r.gbps
    return "median time (µs)", r.median_ms * 1e3


def _without_n(config: str) -> str:
    return re.sub(r"\s*\bN=\S+", "", config).strip()


def _judged_by(name):
    """The bench module's ``JUDGED_BY`` (None if it has none)."""
    try:
        return getattr(importlib.import_module(f"kernels.bench.{name}"), "JUDGED_BY", None)
    except ImportError:
        return None


def _plot_of(module_or_name):
    """The chapter bench's own ``plot`` (same signature as ``plot_results``: one question a
    panel), else the generic ``plot_results``."""
    module = module_or_name
    if isinstance(module_or_name, str):
        try:
            module = importlib.import_module(f"kernels.bench.{module_or_name}")
        except ImportError:
            return plot_results
    return getattr(module, "plot", plot_results)


def replot(folder):
    """Redraw every ``<idea>.png`` in ``folder`` from its committed ``<idea>.csv``; a CSV that
    is not a bench's results (an A/B's or a sweep's own columns) is skipped and named."""
    for csv_path in sorted(Path(folder).glob("*.csv")):
        try:
            env, results = harness.read_results(csv_path)
        except KeyError as missing:
            print(f"skipped {csv_path.name}: not a bench's results (no {missing} column)")
            continue
        if not any(math.isfinite(r.median_ms) for r in results):
            continue  # tables of counters (Nsight Compute), nothing timed to plot
        # the run's measured ceiling, read back from any row's TFLOP/s and % of it
        ceiling = next((100 * r.tflops / r.pct_fma_ceiling for r in results
                        if math.isfinite(r.pct_fma_ceiling) and r.pct_fma_ceiling > 0), math.nan)
        title = f"chapter {results[0].chapter}: {env.get('chapter', csv_path.stem).split(' ', 1)[-1]} ({env.get('device', '')})"
        _plot_of(csv_path.stem)(results, csv_path.with_suffix(".png"), title=title,
                                simulator="simulator" in env.get("device", "").lower(),
                                ceiling=ceiling, judged_by=_judged_by(csv_path.stem))
        print("redrew", csv_path.with_suffix(".png"))


def plot_results(results, path, *, title, simulator, ceiling=math.nan, judged_by=None):
    """One PNG: per metric a line plot over N (results with N in ``extra``) and/or a bar
    chart per kernel and config; peers dashed/hatched, the course's kernels solid."""
    import matplotlib

    _metric_of = _metric
    metric_of = lambda r: _metric_of(r, judged_by, simulator)  # noqa: E731

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = []  # (metric, "line" | "bar", [results], panel title)
    for metric in ("TFLOP/s", "GB/s", "median time (µs)", SIM_METRIC):
        group = [r for r in results if metric_of(r)[0] == metric and math.isfinite(metric_of(r)[1])]
        # One line panel per configuration family (the config without N: dtype, d, causal...),
        # so that like is plotted with like; a family seen at a single N goes to the bars.
        families = {}
        for r in group:
            if "N" in r.extra:
                families.setdefault(_without_n(r.config), []).append(r)
        in_lines = []
        for rest, rs in families.items():
            if len({str(r.extra["N"]) for r in rs}) >= 2:
                panels.append((metric, "line", rs, rest))
                in_lines.extend(rs)
        bars = [r for r in group if not any(r is x for x in in_lines)]
        if bars:
            panels.append((metric, "bar", bars, ""))
    heights = [max(2.6, 0.32 * len(rs) + 1.2) if kind == "bar" else 3.4 for _, kind, rs, _ in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, sum(heights) + 0.8),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    ours_colors = plt.cm.tab10.colors
    peer_colors = ("0.35", "0.55", "#8c564b", "#7f7f7f", "0.7", "#bcbd22")
    for ax, (metric, kind, rs, family) in zip(axes[:, 0], panels):
        if kind == "line":
            series = {}
            for r in rs:  # one line per kernel; the panel's title carries the config
                series.setdefault((r.is_peer, r.kernel), []).append(r)
            n_ours = n_peer = 0
            for (is_peer, label), pts in sorted(series.items()):
                pts.sort(key=lambda r: float(r.extra["N"]))
                xs = [float(r.extra["N"]) for r in pts]
                ys = [metric_of(r)[1] for r in pts]
                if is_peer:
                    color, style, marker = peer_colors[n_peer % len(peer_colors)], "--", "s"
                    n_peer += 1
                else:
                    color, style, marker = ours_colors[n_ours % 10], "-", "o"
                    n_ours += 1
                ax.plot(xs, ys, linestyle=style, marker=marker, color=color, label=label, linewidth=2 - is_peer * 0.5)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("N")
            ax.set_title(family, fontsize=8)
            ax.set_ylabel(metric)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
        else:
            labels = [f"{r.kernel} | {r.config}" for r in rs]
            values = [metric_of(r)[1] for r in rs]
            ys = range(len(rs))
            colors = [peer_colors[0] if r.is_peer else ours_colors[0] for r in rs]
            bars = ax.barh(list(ys), values, color=colors, edgecolor="black", linewidth=0.5)
            for bar, r in zip(bars, rs):
                if r.is_peer:
                    bar.set_hatch("//")
            ax.set_yticks(list(ys))
            ax.set_yticklabels(labels, fontsize=7)
            ax.invert_yaxis()
            ax.set_xlabel(metric + "   (hatched grey: peers; blue: this course's kernels)")
            for y, v in zip(ys, values):
                ax.text(v, y, f" {v:.3g}", va="center", fontsize=7)
            ax.grid(True, axis="x", alpha=0.3)
        if metric == "TFLOP/s" and math.isfinite(ceiling):
            (ax.axhline if kind == "line" else ax.axvline)(ceiling, color="red", linestyle=":", linewidth=1)
            ax.annotate(f"cuBLAS fp32 ceiling {ceiling:.1f}", xy=(0.99, 0.02), xycoords="axes fraction",
                        ha="right", fontsize=7, color="red")
    heading = title + ("\n" + SIM_LABEL if simulator else "")
    fig.suptitle(heading, fontsize=10, color="darkred" if simulator else "black")
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


# --------------------------------------------------------------------------- the run

def _free_device_memory():
    gc.collect()
    if on_simulator():
        return
    for get in (harness.cupy_or_none, harness.torch_or_none):
        lib = get()
        if lib is None:
            continue
        if lib.__name__ == "cupy":
            lib.get_default_memory_pool().free_all_blocks()
        else:
            lib.cuda.empty_cache()


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m kernels", description=(
        "The tour: run every chapter's bench (kernels and peers in the same run), print a table "
        "per chapter, write <out>/<idea>.csv and <out>/<idea>.png."))
    p.add_argument("--chapters", help="comma-separated chapter numbers, e.g. 0,2,4 (default: all)")
    p.add_argument("--benches", help="comma-separated bench module names, e.g. tf32_backward: only these "
                   "(a chapter with two modules runs one; default: all of the chosen chapters)")
    p.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    p.add_argument("--out", type=Path, help=f"results folder (default: {GPU_RESULTS.relative_to(REPO)}/ "
                   f"for a full run on a GPU, {SIM_RESULTS.relative_to(REPO)}/ in the simulator or with --quick)")
    p.add_argument("--list", action="store_true", help="list the chapters found and exit")
    p.add_argument("--warmup", type=int, help="warm-up runs per measurement")
    p.add_argument("--repeat", type=int, help="timed runs per measurement (the median is reported)")
    p.add_argument("--bench-dir", type=Path, help=argparse.SUPPRESS)  # load bench modules from elsewhere (tests)
    args = p.parse_args(argv)
    if args.chapters:
        try:
            args.chapters = sorted({int(c) for c in args.chapters.split(",") if c.strip()})
        except ValueError:
            p.error(f"--chapters: expected comma-separated numbers such as 0,2,4, got {args.chapters!r}")
    if args.benches is not None:
        args.benches = sorted({b.strip() for b in args.benches.split(",") if b.strip()})
    return args


def default_out(simulator: bool, quick: bool) -> Path:
    """Where results go without --out: only a full GPU run replaces the committed results."""
    return SIM_RESULTS if (simulator or quick) else GPU_RESULTS


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    simulator = on_simulator()
    chapters, broken = discover(args.bench_dir)
    if args.list:
        for c in chapters:
            print(f"{c.chapter:>3}  {c.name:<20} {c.title}")
        for name, why in broken:
            print(f"  ?  {name:<20} {why}")
        return 1 if broken else 0

    failures = [f"{name}: {why}" for name, why in broken]
    if args.chapters is not None:
        present = {c.chapter for c in chapters}
        for n in args.chapters:
            if n not in present:
                failures.append(f"chapter {n}: no bench module in kernels/bench/ defines CHAPTER = {n}")
        chapters = [c for c in chapters if c.chapter in args.chapters]
    if args.benches is not None:
        present = {c.name for c in chapters}
        for name in args.benches:
            if name not in present:
                failures.append(f"--benches: no chapter bench module {name} among the chapters chosen "
                                f"(kernels/bench/{name}.py)")
        chapters = [c for c in chapters if c.name in args.benches]
    out = args.out or default_out(simulator, args.quick)
    out.mkdir(parents=True, exist_ok=True)

    if simulator:
        forced = os.environ.get("WORKBOOK_DEVICE", "").strip().lower() == "sim" or \
            os.environ.get("NUMBA_ENABLE_CUDASIM") == "1" and runtime._cuda_device_count() > 0
        print(f"{'Simulator requested' if forced else 'No GPU found'}: "
              "falling back to the Numba CUDA simulator at small sizes.\n"
              "Every timing below is a SIMULATOR timing (Python threads on the CPU): it says nothing\n"
              "about GPU performance, so the tables and plots show times only (no TFLOP/s or GB/s).\n"
              "The committed GPU results are in workbook/results/.")
    env = harness.environment()
    print(f"device: {env['device']}; numba-cuda {env.get('numba-cuda', '?')}; results to {out}/")
    print("chapters: " + (", ".join(f"{c.chapter} {c.name}" for c in chapters) or "none found"))
    for name, why in broken:
        print(f"!! {name}: {why}")

    # The simulator compiles nothing and its timings only show that the code runs: no warm-up,
    # and one run with --quick (a simulated launch of a fused kernel takes seconds).
    warmup = args.warmup if args.warmup is not None else (0 if simulator else 3)
    repeat = args.repeat if args.repeat is not None else (
        (1 if args.quick else 3) if simulator else (10 if args.quick else 30))
    ctx = harness.Context(quick=args.quick, warmup=warmup, repeat=repeat, progress=lambda s: print(s, flush=True),
                          out=out)
    t_start = time.perf_counter()
    ran = 0
    for c in chapters:
        print(f"\n== chapter {c.chapter}: {c.title}  (kernels/bench/{c.name}.py)", flush=True)
        t0 = time.perf_counter()
        try:
            results = list(c.module.run(ctx))
        except Exception:
            traceback.print_exc()
            failures.append(f"chapter {c.chapter} ({c.name}) raised: see the traceback above")
            print(f"!! chapter {c.chapter} failed after {time.perf_counter() - t0:.1f} s; going on", flush=True)
            _free_device_memory()
            continue
        print(harness.format_table(results, simulator=simulator))
        chapter_env = harness.environment()  # now that the chapter imported CuPy/PyTorch, their versions too
        chapter_env["chapter"] = f"{c.chapter} {c.title}"
        chapter_env["timings"] = SIM_LABEL if simulator else "GPU timings: CUDA events, median of repeated runs, rotating inputs"
        chapter_env["date (UTC)"] = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M")
        chapter_env["quick"] = str(args.quick)
        chapter_env["warmup, repeat"] = f"{warmup}, {repeat}"
        ceiling = ctx.measured_ceiling_tflops
        if math.isfinite(ceiling):
            chapter_env["fp32 ceiling TFLOP/s (cuBLAS, this run)"] = f"{ceiling:.2f}"
        csv_path, png_path = out / f"{c.name}.csv", out / f"{c.name}.png"
        try:
            harness.write_csv(csv_path, results, chapter_env)
            _plot_of(c.module)(results, png_path, title=f"chapter {c.chapter}: {c.title} ({env['device']})",
                         simulator=simulator, ceiling=ceiling, judged_by=getattr(c.module, "JUDGED_BY", None))
            print(f"wrote {csv_path} and {png_path}  ({time.perf_counter() - t0:.1f} s)", flush=True)
            ran += 1
        except Exception:
            traceback.print_exc()
            failures.append(f"chapter {c.chapter} ({c.name}): writing results failed")
        _free_device_memory()

    print(f"\ntour finished in {time.perf_counter() - t_start:.1f} s: {ran} of {len(chapters)} chapter(s) "
          "ran and wrote their results")
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        return 1
    return 0
