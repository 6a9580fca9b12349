"""Compile every kernel of the course to PTX for the H100 (sm_90), with no GPU needed.

    python -m kernels.base.ptx_check            # every module in kernels/ that defines ptx_targets()
    python -m kernels.base.ptx_check flash_forward gpu_basics
    python -m kernels.base.ptx_check --serve    # module names on stdin, one check each (tests/test_ptx.py)

The simulator runs kernels as Python: it never type-checks them, so code that the GPU
compiler rejects (a float64 sneaking into a float32 array, an unsupported call, a
shared-memory size that is not a constant) can pass every simulator test. Here each
kernel a chapter lists in ``ptx_targets()`` -- ``(label, dispatcher, signature)`` -- goes
through Numba's real CUDA compiler (``numba.cuda.compile_ptx``) with the kernel's own
``fastmath`` option. Each target is reported OK or FAIL; a kernel whose PTX declares
local memory (``.local``: registers spilled, or a per-thread array the compiler could not
keep in registers) gets a warning, since local memory lives in HBM (cached) and is slow.

The check needs the real CUDA target, so it runs with ``WORKBOOK_DEVICE=gpu``; started
in a simulator process, it restarts itself in a subprocess that has that setting. Nothing
is launched, so no GPU (and no driver) is needed. (One gap is filled: Numba compiles a
device function that the CUDA compiler inlines, ``forceinline``, for the current device,
and asks the driver which that is even under ``compile_ptx(cc=...)``. With no driver,
``answer_sm_90_without_a_driver`` answers sm_90 for it.)
"""

from __future__ import annotations

import importlib
import inspect
import os
import pkgutil
import re
import subprocess
import sys
import time
import traceback

import kernels
from kernels.base.runtime import on_simulator

# Modules of the package that are not chapters (they define no kernels).
NOT_CHAPTERS = {"reference", "__main__"}
SM_90 = (9, 0)
_LOCAL = re.compile(r"^\s*\.local\s", re.MULTILINE)


def kernel_modules() -> list[str]:
    """Names of the modules in ``kernels/`` that may hold kernels (found, not listed)."""
    return sorted(m.name for m in pkgutil.iter_modules(kernels.__path__)
                  if not m.ispkg and m.name not in NOT_CHAPTERS and not m.name.startswith("_"))


def answer_sm_90_without_a_driver():
    """Where no CUDA driver answers, let Numba's device-function compiler take sm_90 as the
    current device (it only reads its compute capability)."""
    from numba import cuda
    import numba.cuda.dispatcher as dispatcher

    if cuda.is_available():
        return

    class _SM90:
        compute_capability = SM_90

    dispatcher.get_current_device = lambda: _SM90()


def check_module(name: str, report=print, every_shape: bool = False) -> tuple[int, int, int]:
    """Compile the module's targets; returns (ok, failed, local-memory warnings).

    ``every_shape``: also the other tile shapes and head dims a module lists (its bench's
    sweeps, d = 16 and 32); without it, each kernel and each of its code paths at the
    production shapes of d = 64 and 128 (what CI's simulator run compiles; a GPU run of
    the tests asks for every shape)."""
    from numba import cuda

    answer_sm_90_without_a_driver()

    try:
        module = importlib.import_module(f"kernels.{name}")
    except Exception as exc:  # a module that does not import is a failure of every target
        report(f"FAIL  kernels.{name}: import failed: {type(exc).__name__}: {exc}")
        return 0, 1, 0
    if not hasattr(module, "ptx_targets"):
        report(f"skip  kernels.{name}: no ptx_targets()")
        return 0, 0, 0
    try:
        takes_shapes = "every_shape" in inspect.signature(module.ptx_targets).parameters
        targets = list(module.ptx_targets(every_shape=every_shape) if takes_shapes else module.ptx_targets())
    except Exception as exc:
        report(f"FAIL  kernels.{name}.ptx_targets() raised {type(exc).__name__}: {exc}")
        return 0, 1, 0
    ok = failed = warned = 0
    for label, dispatcher, signature in targets:
        fastmath = getattr(dispatcher, "targetoptions", {}).get("fastmath", False)
        t0 = time.perf_counter()
        try:
            ptx, _ = cuda.compile_ptx(dispatcher.py_func, signature, cc=SM_90, fastmath=fastmath)
        except Exception as exc:
            failed += 1
            first = str(exc).strip().splitlines()
            report(f"FAIL  {name}: {label}  [{signature}]")
            report("      " + "\n      ".join(first[:12] or [type(exc).__name__]))
            continue
        ok += 1
        note = f"({time.perf_counter() - t0:.1f} s{', fastmath' if fastmath else ''})"
        report(f"OK    {name}: {label}  {note}")
        if _LOCAL.search(ptx):
            warned += 1
            report(f"WARN  {name}: {label}: the PTX uses local memory (.local): "
                   f"spilled registers or a per-thread array kept in (slow) local memory")
    return ok, failed, warned


def rerun_for_the_gpu_target(module: str, argv) -> int:
    """``python -m <module> <argv>`` again in a process with the simulator off: compile_ptx
    needs the real CUDA target (nothing is launched, so no GPU is needed). Its exit status."""
    env = dict(os.environ, WORKBOOK_DEVICE="gpu")
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    return subprocess.call([sys.executable, "-m", module, *argv], env=env)


# ``--serve``: the line that ends each request's output; the request's exit status follows it.
SERVED = "PTX check served, exit status "


def serve(every_shape: bool = False) -> int:
    """``python -m kernels.base.ptx_check --serve [--every-shape]``: one process that checks
    module after module, each named on a line of stdin, each exactly as ``main([name])``
    would (the same output), followed by the line ``SERVED <exit status>``. For
    ``tests/test_ptx.py``: one check a test, without starting Python, importing Numba and
    the course, and compiling again the device functions the chapters share (``kernels.base``:
    a device function is compiled once a process, the same code for every kernel that calls
    it, so each kernel's PTX is the one a fresh process would compile)."""
    for line in sys.stdin:
        name = line.strip()
        if not name:
            continue
        try:
            status = main([name, *(["--every-shape"] if every_shape else [])])
        except KeyboardInterrupt:
            raise
        except BaseException:                   # what main() did not catch (SystemExit too): this request fails
            traceback.print_exc()
            status = 1
        sys.stderr.flush()
        print(f"{SERVED}{status}", flush=True)
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if on_simulator():
        return rerun_for_the_gpu_target("kernels.base.ptx_check", argv)
    every_shape = "--every-shape" in argv
    if "--serve" in argv:
        return serve(every_shape)
    names = [a for a in argv if not a.startswith("--")] or kernel_modules()
    print(f"PTX check for sm_90 (numba.cuda.compile_ptx; nothing is launched; "
          f"{'every shape' if every_shape else 'production shapes, d = 64 and 128'}): {', '.join(names)}")
    totals = [0, 0, 0]
    for name in names:
        try:
            counts = check_module(name, every_shape=every_shape)
        except Exception:
            traceback.print_exc()
            counts = (0, 1, 0)
        totals = [a + b for a, b in zip(totals, counts)]
    ok, failed, warned = totals
    print(f"PTX check: {ok} OK, {failed} FAIL, {warned} using local memory")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
