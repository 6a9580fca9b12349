"""One harness for every chapter: time a callable, count its FLOPs and bytes, compare with peers.

A chapter's bench module (``kernels/bench/<idea>.py``) defines

    CHAPTER = 4                      # the notebook number
    TITLE = "fused forward"
    def run(ctx: Context) -> list[Result]

and uses ``ctx.measure(...)`` for each kernel and each peer, in the same run, so that
ratios compare like with like. ``python -m kernels`` discovers the modules, runs them,
and writes one CSV (with the device, driver and versions) and one PNG per chapter.
"""

from __future__ import annotations

import csv
import gc
import math
import os
import platform
import sys
from dataclasses import asdict, dataclass, field

import numpy as np

from kernels.base import runtime
from kernels.base.runtime import on_simulator, time_fn


def committed_fp32_ceiling_tflops() -> float:
    """The fp32 FMA ceiling of the committed results (cuBLAS fp32 8192^3, TF32 off, in
    workbook/results/gpu_basics.csv; ``kernels.base.io_model.ceilings``). Only a fallback:
    on a GPU the bench re-measures it in the same run and uses that figure instead."""
    from kernels.base.io_model import ceilings

    return ceilings().fp32_tflops


@dataclass
class Result:
    chapter: int
    kernel: str               # e.g. "flash_attention" or "peer: SDPA efficient"
    config: str               # e.g. "B=4 H=16 N=4096 d=64 fp32 causal=False"
    median_ms: float
    p10_ms: float
    p90_ms: float
    flops: float              # FLOPs the computation needs (model, not counted by hardware)
    model_bytes: float        # HBM bytes the IO model predicts for this kernel
    tflops: float
    gbps: float
    pct_fma_ceiling: float    # tflops / measured fp32 FMA ceiling
    peak_mem_mb: float        # device memory the call allocated at its peak (nan if unknown)
    is_peer: bool = False
    note: str = ""
    extra: dict = field(default_factory=dict)


class Context:
    """What a chapter's ``run`` gets: the sizes to use, the measuring function, progress."""

    def __init__(self, *, quick: bool, warmup: int, repeat: int, progress=print, out=None):
        self.simulator = on_simulator()
        self.quick = quick
        self.out = out                  # the run's results folder (None: workbook/results), for extra files
        self.warmup = warmup
        self.repeat = repeat
        self.progress = progress
        self._ceiling = None

    # -- the fp32 ceiling, measured once per run
    @property
    def measured_ceiling_tflops(self) -> float:
        """The ceiling if this run has measured it already, NaN otherwise (never measures)."""
        return self._ceiling if self._ceiling is not None else float("nan")

    def fp32_ceiling_tflops(self) -> float:
        if self._ceiling is None:
            self._ceiling = float("nan") if self.simulator else _measure_cublas_fp32_ceiling()
        return self._ceiling

    def measure(self, chapter, kernel, config, fn, input_sets, *, flops, model_bytes,
                is_peer=False, note="", peak_memory=True, repeat=None, warmup=None, extra=None) -> Result:
        """Time ``fn(*inputs)`` over rotating ``input_sets``; median of ``repeat`` runs."""
        self.progress(f"  ch{chapter} {kernel:<34} {config}")
        timing = time_fn(fn, input_sets, warmup=self.warmup if warmup is None else warmup,
                         repeat=self.repeat if repeat is None else repeat)
        # (said as it is measured: a run cut short still leaves its times in the log)
        self.progress(f"      {timing.median_ms:.4g} ms (p10 {timing.p10_ms:.4g}, p90 {timing.p90_ms:.4g})")
        peak = measure_peak_memory_mb(fn, input_sets[0]) if (peak_memory and not self.simulator) else float("nan")
        seconds = timing.median_ms / 1e3
        tflops = flops / seconds / 1e12 if seconds > 0 else float("nan")
        gbps = model_bytes / seconds / 1e9 if seconds > 0 else float("nan")
        ceiling = self.fp32_ceiling_tflops()
        return Result(chapter, kernel, config, timing.median_ms, timing.p10_ms, timing.p90_ms, flops,
                      model_bytes, tflops, gbps, 100.0 * tflops / ceiling if ceiling == ceiling else float("nan"),
                      peak, is_peer, note, dict(extra or {}))


# --------------------------------------------------------------------------- peers

def token_sweep(ctx):
    """The fixed-tokens sweep of the tensor-core benches (chapters 11 and 12), as (tokens B N,
    H, the sweep's N, the reference N, head dims): B N = 16k and H = 16, N from 1k to 16k
    (``--quick``: 1k and 4k, d = 64), d = 64 and 128; in the simulator 16 tokens, H = 1,
    N = 8 and 16, d = 16."""
    k = 1024
    if ctx.simulator:
        return 16, 1, (8, 16), 16, (16,)
    if ctx.quick:
        return 16 * k, 16, (1 * k, 4 * k), 4 * k, (64,)
    return 16 * k, 16, (1 * k, 2 * k, 4 * k, 8 * k, 16 * k), 4 * k, (64, 128)


def torch_or_none():
    """PyTorch (for peers) if it is importable and sees the GPU; None otherwise."""
    if on_simulator():
        return None
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def cupy_or_none():
    if on_simulator():
        return None
    try:
        import cupy

        cupy.cuda.runtime.getDeviceCount()
        return cupy
    except Exception:  # no CuPy, or no usable device
        return None


def _measure_cublas_fp32_ceiling(n=8192) -> float:
    cp = cupy_or_none()
    if cp is None:
        return committed_fp32_ceiling_tflops()
    os.environ.pop("CUPY_TF32", None)  # TF32 off: plain fp32 FMA
    a = cp.random.standard_normal((n, n), dtype=cp.float32)
    b = cp.random.standard_normal((n, n), dtype=cp.float32)
    t = time_fn(lambda x, y: cp.matmul(x, y), [(a, b)], warmup=2, repeat=10)
    return 2 * n**3 / (t.median_ms / 1e3) / 1e12


# --------------------------------------------------------------------------- memory

def measure_peak_memory_mb(fn, inputs) -> float:
    """Device memory one call allocates at its peak, in MB.

    Numba frees device memory lazily; inside ``defer_cleanup`` nothing is freed, so
    the drop in free memory across the call is everything it allocated. PyTorch peers
    use their allocator's own peak counter instead.
    """
    from numba import cuda

    torch = torch_or_none()
    if torch is not None and any(isinstance(x, torch.Tensor) for x in inputs):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = fn(*inputs)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        del out
        return peak / 1e6
    gc.collect()
    cuda.current_context().deallocations.clear()
    cuda.synchronize()
    with cuda.defer_cleanup():
        free_before, _ = cuda.current_context().get_memory_info()
        out = fn(*inputs)
        cuda.synchronize()
        free_after, _ = cuda.current_context().get_memory_info()
        del out
    return max(0, free_before - free_after) / 1e6


# --------------------------------------------------------------------------- output

def environment() -> dict:
    """Device, driver and versions, written next to every result."""
    import numba

    env = {
        "device": runtime.device_name(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "numba": numba.__version__,
        "platform": platform.platform(),
    }
    try:
        from importlib.metadata import version

        env["numba-cuda"] = version("numba-cuda")
    except Exception:
        pass
    if not on_simulator():
        from numba import cuda

        drv = cuda.cudadrv.driver.driver.get_version()
        env["cuda driver api"] = ".".join(map(str, drv))
        try:
            import subprocess

            env["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20).stdout.strip()
        except Exception:
            pass
        for name in ("cupy", "torch"):
            mod = sys.modules.get(name)
            if mod is not None:
                env[name] = mod.__version__
    return env


def write_csv(path, results, env):
    fields = [f for f in Result.__dataclass_fields__ if f != "extra"] + ["extra"]
    with open(path, "w", newline="") as fh:
        for key, value in env.items():
            fh.write(f"# {key}: {value}\n")
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        for r in results:
            row = asdict(r)
            row["extra"] = ";".join(f"{k}={v}" for k, v in r.extra.items())
            writer.writerow(row)


def read_csv(path):
    """(env, rows) from a CSV written by ``write_csv``: what notebooks use to show results."""
    env, lines = {}, []
    with open(path) as fh:
        for line in fh:
            if line.startswith("# "):
                key, _, value = line[2:].partition(": ")
                env[key] = value.strip()
            else:
                lines.append(line)
    rows = list(csv.DictReader(lines))
    for row in rows:
        for key in ("median_ms", "p10_ms", "p90_ms", "flops", "model_bytes", "tflops", "gbps",
                    "pct_fma_ceiling", "peak_mem_mb"):
            row[key] = float(row[key]) if row.get(key) not in (None, "") else math.nan
        row["chapter"] = int(row["chapter"])
        row["is_peer"] = row.get("is_peer") == "True"
    return env, rows


def read_results(path):
    """(env, [Result]) from a CSV written by ``write_csv``, the extras as strings."""
    env, rows = read_csv(path)
    fields = [f for f in Result.__dataclass_fields__ if f != "extra"]
    results = []
    for row in rows:
        extra = dict(item.split("=", 1) for item in (row.get("extra") or "").split(";") if "=" in item)
        results.append(Result(**{f: row[f] for f in fields}, extra=extra))
    return env, results


# Nsight Compute's units: byte sizes to bytes, L2 sectors (32 B) to bytes, durations to
# nanoseconds (ncu scales both to the value's size); other units (inst, cycle, ...) are kept.
NCU_UNITS = {"byte": 1, "B": 1, "Kbyte": 1e3, "KB": 1e3, "Mbyte": 1e6, "MB": 1e6, "Gbyte": 1e9, "GB": 1e9,
             "Tbyte": 1e12, "sector": 32, "nsecond": 1, "ns": 1, "usecond": 1e3, "us": 1e3, "msecond": 1e6,
             "ms": 1e6, "second": 1e9, "s": 1e9}


def read_ncu(path) -> list[dict]:
    """The profiled launches in one ``ncu --csv`` output, in launch order: dicts with ``id``,
    ``kernel`` (the full name), ``grid`` and ``block`` ("(x, y, z)") and ``metrics``
    ({metric name: value, sizes in bytes, durations in nanoseconds})."""
    lines = [line for line in open(path).read().splitlines() if line.startswith('"')]
    launches: dict = {}
    for row in csv.DictReader(lines):
        key = (row.get("ID"), row.get("Kernel Name", ""))
        launch = launches.setdefault(key, {"id": row.get("ID"), "kernel": row.get("Kernel Name", ""),
                                           "grid": row.get("Grid Size", ""), "block": row.get("Block Size", ""),
                                           "metrics": {}})
        value = float(str(row["Metric Value"]).replace(",", ""))
        launch["metrics"][row["Metric Name"]] = value * NCU_UNITS.get(row.get("Metric Unit", "byte"), 1)
    return sorted(launches.values(), key=lambda launch: int(launch["id"] or 0))


# The printed table's columns: (heading, width, format, value, a rate?). Rates (FLOP/s,
# bytes/s, % of the ceiling) divide a model count by a time; a simulator time is Python
# threads on the CPU, so a rate made from it means nothing and the simulator leaves it out.
TABLE_COLUMNS = (
    ("median ms", 11, ".4g", lambda r: r.median_ms, False),
    ("spread", 7, ".1%", lambda r: (r.p90_ms - r.p10_ms) / r.median_ms if r.median_ms else 0, False),
    ("TFLOP/s", 8, ".3g", lambda r: r.tflops, True),
    ("GB/s", 8, ".4g", lambda r: r.gbps, True),
    ("%FMA", 6, ".3g", lambda r: r.pct_fma_ceiling, True),
    ("peak MB", 8, ".4g", lambda r: r.peak_mem_mb, False),
)


def table_columns(results, simulator=None) -> list:
    """The columns ``format_table`` prints: all of them on a GPU; in the simulator, no
    rate and no column that has no number in any row (peak memory is not measured there)."""
    simulator = on_simulator() if simulator is None else simulator
    if not simulator:
        return list(TABLE_COLUMNS)
    return [col for col in TABLE_COLUMNS if not col[4]
            and any(math.isfinite(float(col[3](r))) for r in results)]


def format_table(results, simulator=None) -> str:
    """One line per result: kernel, config, then the columns of ``table_columns``."""
    columns = table_columns(results, simulator)
    head = f"{'kernel':<36}{'config':<44}" + " ".join(f"{name:>{width}}" for name, width, *_ in columns)
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(f"{r.kernel:<36.36}{r.config:<44.44}"
                     + " ".join(f"{value(r):>{width}{fmt}}" for _, width, fmt, value, _ in columns))
    return "\n".join(lines)


RESULTS_DIR = __import__("pathlib").Path(__file__).resolve().parents[2] / "workbook" / "results"
SIM_RESULTS_DIR = RESULTS_DIR.parents[1] / "bench-out"


def results_folder(out=None):
    """The folder a bench writes to, made if missing: ``out`` if given, else the committed
    results (workbook/results) on a GPU and bench-out/ in the simulator."""
    from pathlib import Path

    folder = Path(out) if out else (SIM_RESULTS_DIR if on_simulator() else RESULTS_DIR)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def committed_results(name, chapter=None):
    """(env, rows) of the committed ``workbook/results/<name>.csv``, or ({}, []) and a line
    saying it is not committed yet and which bench run makes it (``chapter``'s, if given)."""
    csv_path = RESULTS_DIR / f"{name}.csv"
    if not csv_path.exists():
        how = "python -m kernels" + (f" --chapters {chapter}" if chapter is not None else "")
        print(f"GPU results are not committed yet (workbook/results/{name}.csv): run `{how}` on a GPU.")
        return {}, []
    return read_csv(csv_path)


def show_results(name, columns=("kernel", "config", "median_ms", "tflops", "gbps", "peak_mem_mb")):
    """What the notebooks show: the committed ``workbook/results/<name>.csv`` as a table (the
    device, driver and date first) and its plot, or a plain statement that there is none yet."""
    png_path = RESULTS_DIR / f"{name}.png"
    env, rows = committed_results(name)
    if not rows:
        return None
    print("device:", env.get("device"), "| driver:", env.get("driver"), "| date:", env.get("date (UTC)"))
    widths = {"kernel": 40, "config": 44}
    print("".join(f"{c:<{widths[c]}}" if c in widths else f"{c:>12}" for c in columns))
    for r in rows:
        print("".join(f"{str(r[c]):<{widths[c]}.{widths[c]}}" if c in widths else f"{r[c]:>12.4g}"
                      for c in columns))
    if png_path.exists():
        from IPython.display import Image, display

        display(Image(str(png_path)))
    return rows
