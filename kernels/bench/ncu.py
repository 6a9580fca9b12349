"""One way to run a case under Nsight Compute and read what it counted.

The bench times kernels with CUDA events; what they move to and from HBM, and which
pipes they use, only the hardware counters say. Every place that asks them (chapter 1's
DRAM bytes in ``.ci/ncu_dram.py``, chapters 5 and 6 in ``traffic``, the fp32 peer's pipes
in ``peer_pipes``, chapter 4's Br sweep) goes through ``profile``:

    from kernels.bench import ncu
    rows = ncu.profile("kernels.bench.traffic:run_case", ncu.DRAM + ncu.l2_read(),
                       args=("bwd-atomic",), from_start=False, raw="ncu_bwd-atomic.csv")

It runs the target in a child Python process under

    ncu --csv --clock-control none [--profile-from-start off] [-k FILTER]
        [--launch-skip N] [--launch-count N] --metrics M1,M2,... python ...

and returns one dict a profiled kernel launch (``harness.read_ncu``: ``id``, ``kernel``,
``grid``, ``block``, ``metrics`` with sizes in bytes and L2 sectors as bytes). The target
is either ``"module:function"`` (or an importable function), called with ``args`` as
strings by ``python -m kernels.bench.ncu call``, or a list of Python arguments
(``["-m", "kernels.bench.flash_forward", "--ncu", "256,64,8,8"]``, a script path and its
arguments). ``from_start=False`` profiles only what runs between cuProfilerStart and
cuProfilerStop (``numba.cuda.profile_start``/``profile_stop``), so compilation and
warm-up stay out of the counts. ``--clock-control none`` leaves the clocks as the bench
sees them. Without ``ncu`` on PATH (or in ``$NCU``), ``NcuMissing`` says so before
anything runs.

From a shell (what ``.ci/gpu-check`` uses):

    python -m kernels.bench.ncu check                     # is ncu here, has it the L2 metric?
    python -m kernels.bench.ncu metrics --l2 dram__bytes_read.sum,dram__bytes_write.sum
    python -m kernels.bench.ncu profile --metrics M1,M2 [-k regex:NAME] [--launch-skip N]
        [--launch-count N] [--from-start off] [--raw OUT.csv] -- PYTHON_ARGS...
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

DRAM = ("dram__bytes_read.sum", "dram__bytes_write.sum")
# The bytes the SMs read from L2 (32-byte sectors): what an IO model with no cache between
# shared memory and HBM predicts. Not every ncu has it: ``l2_read()`` asks.
L2_READ = "lts__t_sectors_srcunit_tex_op_read.sum"
# What the execution pipes did (``peer_pipes``): time, FMA- and tensor-pipe instructions and cycles.
PIPES = ("gpu__time_duration.sum", "sm__inst_executed_pipe_fma.sum", "sm__inst_executed_pipe_tensor.sum",
         "sm__pipe_fma_cycles_active.sum", "sm__pipe_tensor_cycles_active.sum")


class NcuMissing(RuntimeError):
    """Nsight Compute is not installed here (or not on PATH)."""


class NcuError(RuntimeError):
    """ncu ran but the profiled program failed or nothing was profiled."""


def find_ncu(ncu=None) -> str:
    """The ncu executable: ``ncu`` if given, else ``$NCU`` (that one only), else ``ncu`` on
    PATH, else the CUDA toolkit's; ``NcuMissing`` (saying what to install) when there is none."""
    chosen = ncu or os.environ.get("NCU")
    candidates = [chosen] if chosen else ["ncu", "/usr/local/cuda/bin/ncu"]
    for name in candidates:
        path = shutil.which(name)
        if path:
            return path
    raise NcuMissing(
        f"Nsight Compute (ncu) not found ({' / '.join(candidates)}): install NVIDIA Nsight Compute "
        "(it comes with the CUDA toolkit, or as the nsight-compute package), put ncu on PATH or set NCU. "
        "Measured traffic also needs a GPU and permission to read its counters.")


_metric_lists: dict = {}


def available_metrics(ncu=None) -> str:
    """``ncu --query-metrics`` of this machine (cached)."""
    exe = find_ncu(ncu)
    if exe not in _metric_lists:
        proc = subprocess.run([exe, "--query-metrics"], capture_output=True, text=True, timeout=300)
        _metric_lists[exe] = proc.stdout
    return _metric_lists[exe]


def has_metric(name: str, ncu=None) -> bool:
    """Whether this ncu knows metric ``name`` (the base name, without ``.sum``)."""
    base = name.split(".")[0]
    return any(line.split()[:1] == [base] for line in available_metrics(ncu).splitlines())


def l2_read(ncu=None) -> tuple:
    """``(L2_READ,)`` where this ncu has the metric, ``()`` (and a line on stderr) otherwise."""
    if has_metric(L2_READ, ncu):
        return (L2_READ,)
    print("ncu: no L2 read metric here; DRAM bytes only", file=sys.stderr)
    return ()


def _target_args(target, args) -> list:
    if callable(target):
        module, name = getattr(target, "__module__", None), getattr(target, "__qualname__", "")
        if not module or "<" in name or module == "__main__":
            raise TypeError(f"target: expected an importable function, got {target!r}")
        target = f"{module}:{name}"
    if isinstance(target, str):
        if ":" not in target:
            raise ValueError(f"target: expected 'module:function', got {target!r}")
        return ["-m", "kernels.bench.ncu", "call", target, *map(str, args)]
    if isinstance(target, (list, tuple)) and all(isinstance(a, (str, os.PathLike)) for a in target):
        if args:
            raise ValueError("args: give them in the target list when the target is a list of Python arguments")
        return [str(a) for a in target]
    raise TypeError(f"target: expected 'module:function', a function or a list of Python arguments, got {target!r}")


def command(target, metrics, *, args=(), kernel=None, launch_skip=None, launch_count=None,
            from_start=True, ncu=None, python=None) -> list:
    """The ncu command line ``profile`` runs (see the module docstring)."""
    metrics = [metrics] if isinstance(metrics, str) else list(metrics)
    if not metrics:
        raise ValueError("metrics: expected at least one metric name")
    cmd = [find_ncu(ncu), "--csv", "--clock-control", "none"]
    if not from_start:
        cmd += ["--profile-from-start", "off"]
    if kernel:
        cmd += ["-k", kernel]
    if launch_skip is not None:
        cmd += ["--launch-skip", str(int(launch_skip))]
    if launch_count is not None:
        cmd += ["--launch-count", str(int(launch_count))]
    cmd += ["--metrics", ",".join(metrics)]
    return cmd + [python or sys.executable] + _target_args(target, args)


def profile(target, metrics, *, args=(), kernel=None, launch_skip=None, launch_count=None, from_start=True,
            raw=None, ncu=None, python=None, env=None, timeout=None) -> list:
    """Run ``target`` under Nsight Compute; the profiled launches as ``harness.read_ncu`` rows.

    ``metrics``: metric names (``DRAM``, ``l2_read()``, ``PIPES`` or any others).
    ``kernel``: ncu's ``-k`` filter (``"regex:flash_forward"``); ``launch_skip`` and
    ``launch_count``: which of the matching launches to profile. ``raw``: where to keep
    ncu's CSV output (a temporary file otherwise). ``env``: the child's environment
    (default: this one). Raises ``NcuMissing`` without ncu, ``NcuError`` when the program
    fails or no launch was profiled (with the end of ncu's messages)."""
    from kernels.bench.harness import read_ncu

    cmd = command(target, metrics, args=args, kernel=kernel, launch_skip=launch_skip,
                  launch_count=launch_count, from_start=from_start, ncu=ncu, python=python)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(raw) if raw is not None else Path(tmp) / "ncu.csv"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as out:
            proc = subprocess.run(cmd, stdout=out, stderr=subprocess.PIPE, text=True, env=env, timeout=timeout)
        messages = proc.stderr.strip().splitlines()[-15:]
        if proc.returncode != 0:
            raise NcuError(f"ncu exited with {proc.returncode}: {' '.join(cmd)}\n" + "\n".join(messages))
        rows = read_ncu(path)
    if not rows:
        raise NcuError(f"ncu profiled no kernel launch: {' '.join(cmd)}\n" + "\n".join(messages))
    return rows


def totals(rows, *names) -> dict:
    """Each metric summed over the launches (NaN where a launch lacks it)."""
    names = names or sorted({m for r in rows for m in r["metrics"]})
    return {m: sum(r["metrics"].get(m, float("nan")) for r in rows) for m in names}


def format_rows(rows) -> str:
    names = sorted({m for r in rows for m in r["metrics"]})
    lines = [f"{'id':>4}  {'kernel':<48} " + " ".join(f"{m[:24]:>24}" for m in names)]
    for r in rows:
        short = r["kernel"].split("(")[0].split("[")[0].split("::")[-1]
        lines.append(f"{r['id']:>4}  {short:<48.48} " + " ".join(f"{r['metrics'].get(m, float('nan')):>24.6g}"
                                                              for m in names))
    return "\n".join(lines)


# --------------------------------------------------------------------------- command line

def _call(spec: str, args) -> None:
    module, _, name = spec.partition(":")
    fn = importlib.import_module(module)
    for part in name.split("."):
        fn = getattr(fn, part)
    fn(*args)


def main(argv=None) -> int:
    import argparse

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["call"]:                       # the child side of profile(): no option parsing
        if len(argv) < 2:
            print("usage: python -m kernels.bench.ncu call MODULE:FUNCTION [ARG ...]", file=sys.stderr)
            return 2
        _call(argv[1], argv[2:])
        return 0
    rest = []
    if "--" in argv:
        i = argv.index("--")
        argv, rest = argv[:i], argv[i + 1:]
    parser = argparse.ArgumentParser(prog="python -m kernels.bench.ncu")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("check", help="is ncu installed, and has it the L2 read metric?")
    p_metrics = sub.add_parser("metrics", help="print a comma-separated metric list")
    p_metrics.add_argument("metrics", help="comma-separated metric names")
    p_metrics.add_argument("--l2", action="store_true", help="add the L2 -> SM read metric where ncu has it")
    p_prof = sub.add_parser("profile", help="run PYTHON_ARGS (after --) under ncu and print the launches")
    p_prof.add_argument("--metrics", required=True)
    p_prof.add_argument("-k", "--kernel", default=None)
    p_prof.add_argument("--launch-skip", type=int, default=None)
    p_prof.add_argument("--launch-count", type=int, default=None)
    p_prof.add_argument("--from-start", choices=("on", "off"), default="on")
    p_prof.add_argument("--raw", default=None, help="keep ncu's CSV output here")
    args = parser.parse_args(argv)
    try:
        if args.command == "check":
            print(f"ncu: {find_ncu()}; L2 read metric: {'yes' if has_metric(L2_READ) else 'no'}")
        elif args.command == "metrics":
            names = [m for m in args.metrics.split(",") if m]
            print(",".join(names + (list(l2_read()) if args.l2 else [])))
        else:
            if not rest:
                parser.error("profile: give the Python arguments after --")
            rows = profile(rest, args.metrics.split(","), kernel=args.kernel, launch_skip=args.launch_skip,
                           launch_count=args.launch_count, from_start=args.from_start == "on", raw=args.raw)
            print(format_rows(rows))
    except (NcuMissing, NcuError) as err:
        print(f"{type(err).__name__}: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
