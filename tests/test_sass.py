"""The SASS reader (``kernels.base.sass``): what ptxas makes of a kernel, read with no GPU.

The parsing is checked on a hand-written listing; the whole path (compile_ptx, nvJitLink,
nvdisasm) on chapter 0's block sum, in a subprocess with the simulator off (as
``tests/test_ptx.py`` does), and on chapter 12's backward, whose compiled code must keep what
its tuning bought: no register spills and no call to a 64-bit division (the walk of query
tiles divides in 32 bits)."""

from kernels.base.sass import Sass, find_loops, parse
from test_ptx import _run              # python in a process with the simulator off

LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   LDSM.16.M88.4 R4, [R2] ;
        /*0020*/                   HMMA.16816.F32 R8, R4, R6, R8 ;
.L_x_2:
        /*0030*/                   HMMA.16816.F32 R12, R4, R6, R12 ;
        /*0040*/                   IADD3 R0, R0, 0x1, RZ ;
        /*0050*/               @P0 BRA `(.L_x_2) ;
        /*0060*/              @!P1 BRA `(.L_x_1) ;
        /*0070*/                   CALL.REL.NOINC `($__internal_0_$__cuda_sm20_div_s64) ;
        /*0080*/                   EXIT ;
.L_x_3:
        /*0090*/                   BRA `(.L_x_3);
"""


def test_the_listing_is_read_into_instructions_and_loops():
    instructions, labels, branches = parse(LISTING)
    assert [i.opcode for i in instructions] == ["MOV", "LDSM", "HMMA", "HMMA", "IADD3", "BRA", "BRA", "CALL", "EXIT",
                                                "BRA"]
    assert labels == {".L_x_1": 0x10, ".L_x_2": 0x30, ".L_x_3": 0x90}
    loops = find_loops(instructions, labels, branches)
    # the outer loop (0x10-0x60) and the inner one (0x30-0x50); the branch to itself is none
    assert [(lp.start, lp.end, lp.instructions, lp.mma) for lp in loops] == [(0x10, 0x60, 6, 2), (0x30, 0x50, 3, 1)]
    assert loops[1].per_mma() == 3.0
    sass = Sass("listing", 32, 0, 0, instructions, loops)
    assert sass.mma == 2 and sass.division_calls == 1
    assert sass.summary() == ("listing: 32 registers, no spills; 10 instructions, 2 tensor-core; "
                              "1 calls to a 64-bit division")


def _compile(module, match):
    proc = _run(["-m", "kernels.base.sass", module, match], timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    return out


def test_a_kernel_is_compiled_to_sass_and_counted():
    out = _compile("gpu_basics", "block sum")
    line = next(line for line in out.splitlines() if line.startswith("block sum fp32 256 threads:"))
    registers = int(line.split(": ")[1].split()[0])
    count = int(line.split("; ")[1].split()[0])
    assert 0 < registers <= 255 and count > 20, out
    assert "no spills" in line and "0 tensor-core" in line, out


def test_the_tensor_core_backward_keeps_what_its_tuning_bought():
    out = _compile("tensor_core_backward", "fp16 Br=128")
    line = next(line for line in out.splitlines() if line.startswith("backward tensor cores fp16 Br=128"))
    assert "no spills" in line, out
    assert "0 calls to a 64-bit division" in line, out
