"""Nsight Compute's source counters summed by loop (kernels/bench/ncu_source.py).

Against a recorded source page (chapter 12's backward at d = 128 on an H200, the run
``workbook/results/tensor_core_backward_ncu_h200.txt`` summarizes; columns trimmed, gzipped),
against a small hand-made page whose sums are known, and through ``profile`` with a fake
``ncu`` on PATH."""

import csv
import io
import os
import stat
import sys
import textwrap
from pathlib import Path

import pytest

from kernels.bench import ncu_source as ns

ROOT = Path(__file__).resolve().parents[1]
RECORDED = Path(__file__).resolve().parent / "ncu_recorded" / "source_backward_tc_d128_h200.csv.gz"
COLUMNS = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "stall_wait",
           "stall_short_sb", "stall_barrier", "stall_wait (Not Issued)"]


def page(tmp_path, rows, name="source.csv"):
    """A source page as ncu writes it: a line naming the kernel, the header, a row an instruction."""
    buf = io.StringIO()
    w = csv.writer(buf, quoting=csv.QUOTE_ALL)
    w.writerow(["kernel(int)"])
    w.writerow(COLUMNS)
    for address, text, samples, executed, wait, short, barrier in rows:
        w.writerow([hex(address), text, samples, executed, wait, short, barrier, 999])
    path = tmp_path / name
    path.write_text(buf.getvalue())
    return path


# a kernel at 0x7f0000001000: a prologue, a loop of 4 instructions (one HMMA) run 10 times, an epilogue
SMALL = [(0x7f0000001000, "LDC R1, c[0x0][0x28]", 5, 1, 5, 0, 0),
         (0x7f0000001010, "LDSM.16.M88.4 R4, [R2]", 10, 10, 0, 10, 0),
         (0x7f0000001020, "HMMA.16816.F32 R8, R4, R6, R8", 60, 10, 20, 40, 0),
         (0x7f0000001030, "IADD3 R2, R2, 0x20, RZ", 5, 10, 5, 0, 0),
         (0x7f0000001040, "@P0 BRA 0x7f0000001010", 10, 10, 10, 0, 0),
         (0x7f0000001050, "BAR.SYNC.DEFER_BLOCKING 0x0", 10, 1, 0, 0, 10),
         (0x7f0000001060, "EXIT", 0, 1, 0, 0, 0)]


def test_a_small_page_sums_by_its_loop(tmp_path):
    rows = ns.read_source_csv(page(tmp_path, SMALL))
    assert [r.offset for r in rows] == [0, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60]
    assert rows[4].opcode == "BRA" and rows[2].opcode == "HMMA"
    assert rows[2].stalls == {"wait": 20, "short_sb": 40}            # the "Not Issued" column left out
    assert ns.find_loops(rows) == [(0x10, 0x40)]
    text = ns.summarize(rows, top=2)
    lines = text.splitlines()
    # 43 executions, 10 of them HMMA; 100 samples
    assert lines[0] == "executed warp instructions 43; tensor-core 10 (4.30 instructions an mma); stall samples 100"
    assert lines[1] == ("loop 0x00010-0x00040 (4 instructions): 93.0% of instructions, 100% of the mmas, 85.0% of "
                        "the samples (4.00 an mma); short_sb 50.0%, wait 35.0%")
    assert lines[2] == ("in no loop: 7.0% of instructions, 0% of the mmas, 15.0% of the samples; "
                        "barrier 10.0%, wait 5.0%")
    assert lines[4].split()[:3] == ["0x00020", "10", "60"] and "[short_sb 40, wait 20]" in lines[4]


def test_a_branch_forward_is_not_a_loop(tmp_path):
    rows = [(0x1000, "@P0 BRA 0x1030", 1, 1, 0, 0, 0), (0x1010, "NOP", 1, 1, 0, 0, 0),
            (0x1020, "NOP", 1, 1, 0, 0, 0), (0x1030, "EXIT", 1, 1, 0, 0, 0)]
    assert ns.find_loops(ns.read_source_csv(page(tmp_path, rows))) == []


def test_a_branch_to_itself_is_not_a_loop(tmp_path):
    """The branch to itself after EXIT closes nothing (as in ``kernels.base.sass``, whose loop
    finder this page's is)."""
    rows = [(0x1000, "NOP", 1, 1, 0, 0, 0), (0x1010, "EXIT", 1, 1, 0, 0, 0), (0x1020, "BRA 0x1020", 0, 0, 0, 0, 0)]
    assert ns.find_loops(ns.read_source_csv(page(tmp_path, rows))) == []


def test_the_recorded_page_gives_the_committed_summary():
    rows = ns.read_source_csv(RECORDED)
    loops = ns.find_loops(rows)
    # the walk over (query head, query tile) pairs, and inside it the query loop (inside that the
    # k-steps of S^T and dP^T, a loop at d = 128) and dQ's loop
    assert {(0x7820, 0x108D0), (0xC030, 0xDB10), (0xC230, 0xC3F0), (0xDCF0, 0x10850)} <= set(loops)
    text = ns.summarize(rows, top=1)
    assert text.splitlines()[0] == ("executed warp instructions 1,869,164,544; tensor-core 335,544,320 "
                                    "(5.57 instructions an mma); stall samples 732,874")
    assert "  loop 0x0c030-0x0db10 (431 instructions): 55.1% of instructions, 80% of the mmas, 48.3% of the " \
           "samples (3.84 an mma); wait 19.2%, short_sb 14.4%" in text
    assert "0x0c360" in text.splitlines()[-1] and "HMMA" in text.splitlines()[-1]   # the k-step's first product
    # the committed summary is this tool's output on this page, as its header says
    committed = (ROOT / "workbook" / "results" / "tensor_core_backward_ncu_h200.txt").read_text()
    assert ns.summarize(rows, top=12) in committed


def test_not_a_source_page_is_refused(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text('"ID","Kernel Name"\n"0","k"\n')
    with pytest.raises(ValueError, match="no header row"):
        ns.read_source_csv(bad)
    no_samples = tmp_path / "no_samples.csv"
    no_samples.write_text('"k"\n"Address","Source","Instructions Executed"\n"0x10","NOP","1"\n')
    with pytest.raises(ValueError, match="SourceCounters"):
        ns.read_source_csv(no_samples)


def test_profile_runs_ncu_and_writes_the_summary(tmp_path, monkeypatch):
    """``profile`` with a fake ncu: the run writes the report, --import --page source prints the
    small page, --import alone prints details."""
    small = page(tmp_path, SMALL, "recorded.csv")
    log = tmp_path / "calls.txt"
    fake = tmp_path / "bin" / "ncu"
    fake.parent.mkdir()
    fake.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import sys
        args = sys.argv[1:]
        open({str(log)!r}, "a").write(" ".join(args) + "\\n")
        if "--import" in args and "--page" in args:
            sys.stdout.write(open({str(small)!r}).read())
        elif "--import" in args:
            print("details")
        else:
            open(args[args.index("-o") + 1] + ".ncu-rep", "w").write("report")
        """))
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("NCU", raising=False)
    out = tmp_path / "out"
    assert ns.main(["profile", "--kernel", "regex:backward_tc", "--out", str(out), "--", "-c", "pass"]) == 0
    calls = log.read_text().splitlines()
    assert calls[0].startswith("--clock-control none -k regex:backward_tc -c 1 -f -o ")
    assert "--section SourceCounters" in calls[0] and calls[0].endswith("-c pass")
    assert (out / "summary.txt").read_text().startswith("executed warp instructions 43; tensor-core 10")
    assert (out / "details.txt").read_text() == "details\n"
