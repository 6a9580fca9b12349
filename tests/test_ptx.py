"""Every kernel of the course compiles to PTX for sm_90 (no GPU needed).

The simulator does not type-check, so this is what catches code that only the GPU
compiler rejects. Runs ``python -m kernels.base.ptx_check`` in a subprocess with the simulator
off (``WORKBOOK_DEVICE=gpu``): one such process a pytest worker (``--serve``), which checks
each test's module in turn, exactly as ``python -m kernels.base.ptx_check <module>`` would.
"""

import os
import queue
import subprocess
import sys
import textwrap
import threading
import time

import pytest


def _gpu_env():
    env = dict(os.environ, WORKBOOK_DEVICE="gpu")
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    return env


def _run(args, timeout=900):
    return subprocess.run([sys.executable, *args], env=_gpu_env(), capture_output=True, text=True,
                          timeout=timeout)


def _modules():
    """Kernel modules that define ptx_targets() (read from the source: nothing imported here)."""
    from pathlib import Path

    import kernels
    from kernels.base.ptx_check import kernel_modules

    folder = Path(kernels.__file__).parent
    return [m for m in kernel_modules() if "def ptx_targets" in (folder / f"{m}.py").read_text()]


class _Checker:
    """``python -m kernels.base.ptx_check --serve``, started on first use: ``check(module)``
    returns (exit status, output) of that module's check. Starting Python, importing Numba
    and the course, and compiling the device functions the chapters share is then done once
    a worker instead of once a module. A checker that dies (or runs past the timeout) fails
    that module's test and is started again for the next."""

    TIMEOUT_S = 900

    def __init__(self, args):
        self.args = args
        self.proc = None

    def _start(self):
        self.proc = subprocess.Popen([sys.executable, "-m", "kernels.base.ptx_check", "--serve", *self.args],
                                     env=_gpu_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, bufsize=1)
        self.lines = queue.Queue()
        threading.Thread(target=self._read, args=(self.proc.stdout, self.lines), daemon=True).start()

    @staticmethod
    def _read(stream, lines):
        for line in stream:
            lines.put(line)
        lines.put(None)                             # the checker exited

    def check(self, module):
        from kernels.base.ptx_check import SERVED

        if self.proc is None or self.proc.poll() is not None:
            self._start()
        try:
            self.proc.stdin.write(module + "\n")
            self.proc.stdin.flush()
        except OSError:                             # it has just exited: its output says why
            pass
        out = []
        deadline = time.monotonic() + self.TIMEOUT_S
        try:
            while True:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
                if line is None:
                    rc = self.proc.wait()
                    self.proc = None
                    return (rc or 1), "".join(out) + f"(the PTX checker exited, status {rc})\n"
                if line.startswith(SERVED):
                    return int(line[len(SERVED):]), "".join(out)
                out.append(line)
        except queue.Empty:
            self.close()
            return 1, "".join(out) + f"(the PTX check of {module} ran past {self.TIMEOUT_S} s)\n"

    def close(self):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


@pytest.fixture(scope="module")
def ptx_checker():
    # In the simulator (CI) the production shapes; on a GPU machine every shape the modules list.
    from kernels.base.runtime import on_simulator

    checker = _Checker([] if on_simulator() else ["--every-shape"])
    yield checker
    checker.close()


@pytest.mark.parametrize("module", _modules())
def test_every_kernel_compiles_to_ptx(module, ptx_checker):
    # One module a test (each passes or fails on its own); tests/conftest.py runs them first,
    # so that one worker's checker compiles the device functions the modules share once.
    returncode, out = ptx_checker.check(module)
    print(out)
    failures = [line for line in out.splitlines() if line.startswith("FAIL")]
    assert not failures, f"kernels of {module} that do not compile for sm_90:\n" + out
    assert returncode == 0, out
    assert f"OK    {module}:" in out, out


def test_the_check_catches_a_typing_error_the_simulator_lets_through():
    # A float32 array cannot hold a tuple: the simulator would run this, the compiler refuses.
    script = textwrap.dedent("""
        import sys, types
        import kernels
        from numba import cuda
        mod = types.ModuleType("kernels.broken_example")
        @cuda.jit
        def bad(x):
            x[0] = (1.0, 2.0)
        @cuda.jit(fastmath=True)
        def spills(x):
            a = cuda.local.array(64, dtype=x.dtype)
            for i in range(64):
                a[i] = x[i]
            x[0] = a[int(x[1])]
        mod.ptx_targets = lambda: [("bad", bad, "void(float32[::1])"), ("spills", spills, "void(float32[::1])")]
        sys.modules["kernels.broken_example"] = mod
        from kernels.base.ptx_check import check_module
        ok, failed, warned = check_module("broken_example")
        print("counts", ok, failed, warned)
    """)
    proc = _run(["-c", script], timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "counts 1 1 1" in out, out
    assert "FAIL  broken_example: bad" in out, out


@pytest.mark.parametrize("name", ["runtime", "reference", "testing"])
def test_discovery_skips_the_shared_modules(name):
    from kernels.base.ptx_check import kernel_modules

    found = kernel_modules()
    assert name not in found
    assert "gpu_basics" in found


def test_an_inlined_block_leaves_no_call_and_keeps_its_own_fast_math():
    # kernels.base.inlined: the block is marked alwaysinline for LLVM (no .func, no call left in the
    # kernel's PTX), and its flags are its own, not the kernel's: FASTMATH's arcp/afn make a / b
    # the approximate division, fastmath=False the rounded one.
    script = textwrap.dedent("""
        import kernels
        from numba import cuda
        from kernels.base.inlined import inlined
        from kernels.base.ptx_check import SM_90, answer_sm_90_without_a_driver
        answer_sm_90_without_a_driver()

        @inlined
        def quotient_fast(a, b):
            return a / b

        @inlined(fastmath=False)
        def quotient_exact(a, b):
            return a / b

        def fast(x):
            x[0] = quotient_fast(x[1], x[2])

        def exact(x):
            x[0] = quotient_exact(x[1], x[2])

        for kernel, block in ((fast, quotient_fast), (exact, quotient_exact)):
            ptx, _ = cuda.compile_ptx(kernel, "void(float32[::1])", cc=SM_90)
            body = [line.split()[0] for line in ptx.splitlines() if line.strip().startswith(("div", "call", ".func"))]
            marked = all(" alwaysinline" in ir.split("{")[0] for ir in block.inspect_llvm().values())
            print(kernel.__name__, body, "alwaysinline" if marked else "left to LLVM's judgement")
    """)
    proc = _run(["-c", script], timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "fast ['div.approx.f32'] alwaysinline" in out, out
    assert "exact ['div.rn.f32'] alwaysinline" in out, out
