"""What the compiler makes of a kernel, with no GPU: its SASS, the GPU's own instructions.

    python -m kernels.base.sass tensor_core_backward                  # every target of its ptx_targets()
    python -m kernels.base.sass tensor_core_backward "fp16 Br=128"    # the targets whose label has this
    python -m kernels.base.sass gpu_basics "block sum" --listing      # and the SASS itself

Numba compiles a kernel to PTX, a virtual instruction set (``kernels.base.ptx_check`` does it
for sm_90). When a kernel loads, the driver's assembler, ptxas, turns the PTX into SASS for the
GPU at hand, and that is what runs: register allocation, scheduling and most of the index
arithmetic are decided there. The same assembler ships in nvJitLink (``nvidia-nvjitlink``,
which requirements.txt installs with PyTorch's CUDA libraries; its version may be newer than
a driver's, so registers can differ by a few), and a disassembler, nvdisasm, ships with
Triton (which PyTorch installs too). So on any machine with the course's packages:

    PTX (numba.cuda.compile_ptx)  ->  cubin for sm_90 (nvJitLink)  ->  SASS text (nvdisasm)

What it reports for each kernel: ptxas's registers a thread and spills, the instructions in
all, the tensor-core instructions (HMMA: mma.sync on fp16, bf16, tf32), the 64-bit division
calls (``__cuda_sm20_div_s64`` and friends: Python's ``//`` and ``%`` on Numba's int64), and
for every loop (a branch back to an earlier instruction) its instructions and tensor-core
instructions. Instructions an mma in a kernel's hot loop is the number the tensor-core
chapters tune: each non-mma instruction takes an issue slot from the warp's scheduler.
Counts are of the code, not of what runs: a loop's body is counted once, its branches both.
"""

from __future__ import annotations

import importlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from kernels.base.runtime import on_simulator

__all__ = ["Instruction", "Loop", "Sass", "nvdisasm_path", "ptx_to_cubin", "disassemble", "parse", "find_loops",
           "compile_kernel", "main"]

SM_90 = (9, 0)
TENSOR_CORE = ("HMMA", "HGMMA", "IMMA", "DMMA")
DIVISION_CALLS = re.compile(r"__cuda_sm20_(div|rem)_[su]64")
_LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_TARGET = re.compile(r"`\((\.L_x_\d+)\)")


@dataclass
class Instruction:
    offset: int           # bytes from the kernel's start
    text: str             # as nvdisasm prints it, predicate included, without the ';'

    @property
    def opcode(self) -> str:
        """The mnemonic without its predicate (``@!P0``) and modifiers (``.F32``)."""
        words = self.text.split()
        if words and words[0].startswith("@"):
            words = words[1:]
        return words[0].split(".")[0] if words else ""


@dataclass
class Loop:
    start: int            # offset of the first instruction (the branch's target)
    end: int              # offset of the branch back
    instructions: int
    mma: int

    def per_mma(self) -> float:
        return self.instructions / self.mma if self.mma else float("nan")


@dataclass
class Sass:
    label: str
    registers: int
    spill_stores: int
    spill_loads: int
    instructions: list = field(default_factory=list)
    loops: list = field(default_factory=list)
    text: str = ""

    @property
    def mma(self) -> int:
        return sum(i.opcode in TENSOR_CORE for i in self.instructions)

    @property
    def division_calls(self) -> int:
        return sum(bool(DIVISION_CALLS.search(i.text)) for i in self.instructions if i.opcode == "CALL")

    def summary(self) -> str:
        spills = f", spills {self.spill_stores} B stored / {self.spill_loads} B loaded" \
            if self.spill_stores or self.spill_loads else ", no spills"
        return (f"{self.label}: {self.registers} registers{spills}; {len(self.instructions)} instructions, "
                f"{self.mma} tensor-core; {self.division_calls} calls to a 64-bit division")


def nvdisasm_path() -> str:
    """nvdisasm: ``$WORKBOOK_NVDISASM``, else on PATH, else the one Triton ships."""
    found = os.environ.get("WORKBOOK_NVDISASM") or shutil.which("nvdisasm")
    if found:
        return found
    try:
        import triton
    except ImportError:
        triton = None
    if triton is not None:
        candidate = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
        if candidate.exists():
            return str(candidate)
    raise FileNotFoundError("nvdisasm not found: it comes with Triton (pip install -r requirements.txt installs "
                            "PyTorch, which brings it), with the CUDA toolkit, or in the nvidia-cuda-nvdisasm "
                            "wheel; or set WORKBOOK_NVDISASM to its path")


def ptx_to_cubin(ptx: str, cc=SM_90) -> tuple[bytes, str]:
    """PTX -> (cubin, ptxas's report) through nvJitLink: the driver's assembler, no GPU needed."""
    from cuda.bindings import nvjitlink

    data = ptx.encode()
    handle = nvjitlink.create(2, [f"-arch=sm_{cc[0]}{cc[1]}{cc[2] if len(cc) > 2 else ''}", "-verbose"])
    try:
        nvjitlink.add_data(handle, nvjitlink.InputType.PTX, data, len(data), "kernel.ptx")
        try:
            nvjitlink.complete(handle)
        except Exception as exc:
            log = bytearray(nvjitlink.get_error_log_size(handle))
            nvjitlink.get_error_log(handle, log)
            raise RuntimeError(f"nvJitLink could not assemble the PTX: {log.decode(errors='replace')}") from exc
        cubin = bytearray(nvjitlink.get_linked_cubin_size(handle))
        nvjitlink.get_linked_cubin(handle, cubin)
        log = bytearray(nvjitlink.get_info_log_size(handle))
        nvjitlink.get_info_log(handle, log)
    finally:
        nvjitlink.destroy(handle)
    return bytes(cubin), log.decode(errors="replace")


def disassemble(cubin: bytes) -> str:
    """The cubin's SASS as nvdisasm prints it (code only)."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "kernel.cubin"
        path.write_bytes(cubin)
        proc = subprocess.run([nvdisasm_path(), "-c", str(path)], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"nvdisasm failed: {proc.stderr.strip()[:500]}")
    return proc.stdout


def parse(text: str) -> tuple[list, dict, list]:
    """(instructions, labels, branches): every instruction; each label's offset; each branch
    as (its offset, its target label)."""
    instructions, labels, branches, pending = [], {}, [], []
    for line in text.splitlines():
        label = _LABEL.match(line.strip())
        if label:
            pending.append(label.group(1))
            continue
        m = _LINE.match(line)
        if not m:
            continue
        ins = Instruction(int(m.group(1), 16), m.group(2))
        for name in pending:
            labels[name] = ins.offset
        pending = []
        instructions.append(ins)
        target = _TARGET.search(ins.text)
        if target and ins.opcode == "BRA":
            branches.append((ins.offset, target.group(1)))
    return instructions, labels, branches


def find_loops(instructions, labels, branches) -> list:
    """Each branch back to an earlier instruction closes a loop: its instructions from the
    target to the branch, in code order (inner loops are counted inside outer ones too)."""
    loops = []
    for at, target in branches:
        start = labels.get(target)
        if start is None or start >= at:          # (the branch to itself after EXIT is no loop)
            continue
        body = [i for i in instructions if start <= i.offset <= at]
        loops.append(Loop(start, at, len(body), sum(i.opcode in TENSOR_CORE for i in body)))
    return sorted(loops, key=lambda loop: loop.start)


def _ptxas_numbers(log: str) -> tuple[int, int, int]:
    registers = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return (int(registers.group(1)) if registers else -1,
            int(spills.group(1)) if spills else 0, int(spills.group(2)) if spills else 0)


def compile_kernel(label, dispatcher, signature, cc=SM_90) -> Sass:
    """A ``ptx_targets()`` entry (label, kernel, signature) compiled down to SASS and read."""
    from numba import cuda

    options = getattr(dispatcher, "targetoptions", {})
    ptx, _ = cuda.compile_ptx(dispatcher.py_func, signature, cc=cc, fastmath=options.get("fastmath", False),
                              launch_bounds=options.get("launch_bounds"))
    cubin, log = ptx_to_cubin(ptx, cc)
    text = disassemble(cubin)
    instructions, labels, branches = parse(text)
    registers, stores, loads = _ptxas_numbers(log)
    return Sass(label, registers, stores, loads, instructions, find_loops(instructions, labels, branches), text)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from kernels.base.ptx_check import answer_sm_90_without_a_driver, rerun_for_the_gpu_target

    if on_simulator():
        return rerun_for_the_gpu_target("kernels.base.sass", argv)

    listing = "--listing" in argv
    words = [a for a in argv if not a.startswith("--")]
    if not words:
        print(__doc__.strip().splitlines()[2].strip())
        return 2
    name, match = words[0], (words[1] if len(words) > 1 else "")
    answer_sm_90_without_a_driver()
    module = importlib.import_module(f"kernels.{name}")
    targets = [t for t in module.ptx_targets() if match in t[0]]
    if not targets:
        print(f"no target of kernels.{name}.ptx_targets() has {match!r} in its label")
        return 1
    for label, dispatcher, signature in targets:
        sass = compile_kernel(label, dispatcher, signature)
        print(sass.summary())
        for loop in sass.loops:
            per = f", {loop.per_mma():.1f} instructions an mma" if loop.mma else ""
            print(f"    loop {loop.start:#07x}-{loop.end:#07x}: {loop.instructions} instructions, "
                  f"{loop.mma} tensor-core{per}")
        if listing:
            print(sass.text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
