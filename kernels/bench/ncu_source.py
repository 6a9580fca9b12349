"""Where a kernel's warps wait, instruction by instruction: Nsight Compute's source counters.

The bench says how long a kernel takes; ``kernels.base.sass`` says what the compiler made of
it. Between the two sits the question a tuning step starts from: of the time, which
instructions were the warps stuck at, and waiting for what? Nsight Compute answers it by
sampling each warp's program counter and stall reason while the kernel runs
(``--section SourceCounters``), and by counting each SASS instruction's executions:

    ncu --clock-control none -k regex:NAME -c 1 --section SourceCounters -o REPORT python ...
    ncu --import REPORT.ncu-rep --page source --csv --print-source sass > SOURCE.csv

This module reads that CSV and sums it by the kernel's loops (a branch back to an earlier
instruction closes one, as in ``kernels.base.sass``):

    python -m kernels.bench.ncu_source SOURCE.csv            # the summary
    python -m kernels.bench.ncu_source SOURCE.csv --top 30   # and the 30 most-sampled instructions
    python -m kernels.bench.ncu_source profile --kernel regex:backward_tc --out DIR -- PYTHON_ARGS...

``profile`` runs ncu itself and leaves the report, the CSV and the summary in DIR (a remote
machine then need return one small text file). For each loop: its share of the executed
instructions, of the tensor-core instructions (HMMA and friends) and of the stall samples,
and the stall reasons most sampled there; then what no loop holds. A loop's numbers include
its inner loops'. Stall reasons as ncu names them: ``wait`` a fixed-latency dependency (an
arithmetic result not ready yet), ``short_sb`` a shared-memory or special-function result
(``ldmatrix``, ``exp2``), ``long_sb`` a global-memory one, ``barrier`` a ``syncthreads``,
``mio`` and ``lg`` their queues full, ``math`` a pipe busy; ``selected`` is issuing, not a
stall. Chapter 12 found two of its waits this way (``tensor_core_backward_ncu_h200.txt``).
"""

from __future__ import annotations

import csv
import gzip
import io
import re
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from kernels.base.sass import TENSOR_CORE, Instruction
from kernels.base.sass import find_loops as sass_find_loops

__all__ = ["SourceRow", "read_source_csv", "find_loops", "summarize", "main"]

EXECUTED = "Instructions Executed"
SAMPLES = "Warp Stall Sampling (All Samples)"
_BRANCH = re.compile(r"\bBRA(?:\.\w+)*\s+(0x[0-9a-fA-F]+)")


@dataclass
class SourceRow(Instruction):
    """An instruction (``kernels.base.sass``: offset, text, opcode) with what ncu counted there."""
    address: int = 0       # as ncu prints it (absolute)
    executed: int = 0      # warp-level executions
    samples: int = 0       # stall samples at this instruction (all reasons)
    stalls: dict = field(default_factory=dict)   # reason -> samples


def read_source_csv(path) -> list[SourceRow]:
    """The rows of ``ncu --page source --csv --print-source sass`` (plain, or gzipped as
    .gz): a line naming the kernel, the header, then one row an instruction."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", newline="") as f:
        lines = f.read().splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"Address"')), None)
    if start is None:
        raise ValueError(f"{path}: no header row starting with \"Address\": not ncu's source page as CSV")
    reader = csv.DictReader(io.StringIO("\n".join(lines[start:])))
    names = reader.fieldnames or []
    for need in ("Address", "Source", EXECUTED, SAMPLES):
        if need not in names:
            raise ValueError(f"{path}: no column {need!r} (profile with --section SourceCounters)")
    reasons = [c for c in names if c.startswith("stall_") and "Not Issued" not in c]
    rows = []
    for r in reader:
        address = int(r["Address"], 16)
        stalls = {c[len("stall_"):]: _int(r[c]) for c in reasons if _int(r[c])}
        rows.append(SourceRow(address - (rows[0].address if rows else address), r["Source"].strip(), address,
                              _int(r[EXECUTED]), _int(r[SAMPLES]), stalls))
    if not rows:
        raise ValueError(f"{path}: no instructions")
    return rows


def _int(text) -> int:
    text = (text or "").replace(",", "").strip()
    return int(float(text)) if text not in ("", "-") else 0


def find_loops(rows: list[SourceRow]) -> list[tuple[int, int]]:
    """(first, last) offsets of each loop, outer before inner: ``kernels.base.sass.find_loops``
    on the page's branches, whose targets ncu prints as absolute addresses."""
    base = rows[0].address
    branches = [(row.offset, int(m.group(1), 16) - base) for row in rows if (m := _BRANCH.search(row.text))]
    labels = {target: target for _, target in branches if target >= 0}
    loops = {(loop.start, loop.end) for loop in sass_find_loops(rows, labels, branches)}
    return sorted(loops, key=lambda lo: (lo[0], -lo[1]))


def _totals(rows):
    executed = sum(r.executed for r in rows)
    mma = sum(r.executed for r in rows if r.opcode in TENSOR_CORE)
    samples = sum(r.samples for r in rows)
    stalls = Counter()
    for r in rows:
        stalls.update(r.stalls)
    return executed, mma, samples, stalls


def summarize(rows: list[SourceRow], top: int = 0, min_share: float = 0.01) -> str:
    """The text summary (see the module's docstring): totals, each loop holding at least
    ``min_share`` of the executed instructions or of the samples, what no loop holds, and the
    ``top`` most-sampled instructions."""
    executed, mma, samples, _ = _totals(rows)
    pct = lambda part, whole: 100.0 * part / whole if whole else 0.0
    out = [f"executed warp instructions {executed:,}; tensor-core {mma:,}"
           + (f" ({executed / mma:.2f} instructions an mma)" if mma else "") + f"; stall samples {samples:,}"]
    loops = find_loops(rows)

    def line(label, sel):
        e, m, s, st = _totals(sel)
        reasons = ", ".join(f"{k} {pct(v, samples):.1f}%" for k, v in st.most_common(4))
        return (f"{label}: {pct(e, executed):.1f}% of instructions, {pct(m, mma):.0f}% of the mmas, "
                f"{pct(s, samples):.1f}% of the samples" + (f" ({e / m:.2f} an mma)" if m else "")
                + (f"; {reasons}" if reasons else ""))

    inside = set()
    for lo, hi in loops:
        sel = [r for r in rows if lo <= r.offset <= hi]
        inside.update(r.offset for r in sel)
        e, _, s, _ = _totals(sel)
        if pct(e, executed) >= 100 * min_share or pct(s, samples) >= 100 * min_share:
            depth = sum(1 for a, b in loops if a <= lo and hi <= b and (a, b) != (lo, hi))
            out.append("  " * depth + line(f"loop {lo:#07x}-{hi:#07x} ({len(sel)} instructions)", sel))
    rest = [r for r in rows if r.offset not in inside]
    out.append(line("in no loop", rest))
    if top:
        out.append(f"the {top} most-sampled instructions (offset, executions, samples, top reasons):")
        for r in sorted(rows, key=lambda r: -r.samples)[:top]:
            reasons = ", ".join(f"{k} {v}" for k, v in Counter(r.stalls).most_common(2))
            out.append(f"  {r.offset:#07x} {r.executed:>12,} {r.samples:>8,} {pct(r.samples, samples):4.1f}%  "
                       f"{r.text[:60]}  [{reasons}]")
    return "\n".join(out)


def profile(kernel: str, out: Path, python_args: list, launch_count: int = 1, ncu: str | None = None) -> str:
    """Run ``python python_args`` under ncu (source counters, warp state, instruction and
    scheduler statistics) for ``launch_count`` launches of the kernels ``kernel`` names
    (``regex:NAME``); write report.ncu-rep, source.csv and summary.txt into ``out`` and
    return the summary."""
    from kernels.bench.ncu import find_ncu

    exe = find_ncu(ncu)
    out.mkdir(parents=True, exist_ok=True)
    sections = ["SourceCounters", "WarpStateStats", "InstructionStats", "SchedulerStats", "LaunchStats", "Occupancy"]
    cmd = [exe, "--clock-control", "none", "-k", kernel, "-c", str(launch_count), "-f", "-o", str(out / "report")]
    for s in sections:
        cmd += ["--section", s]
    subprocess.run(cmd + [sys.executable] + list(python_args), check=True)
    with open(out / "source.csv", "w") as f:
        subprocess.run([exe, "--import", str(out / "report.ncu-rep"), "--page", "source", "--csv", "--print-source",
                        "sass"], check=True, stdout=f)
    with open(out / "details.txt", "w") as f:
        subprocess.run([exe, "--import", str(out / "report.ncu-rep")], check=True, stdout=f)
    text = summarize(read_source_csv(out / "source.csv"), top=20)
    (out / "summary.txt").write_text(text + "\n")
    return text


def main(argv=None) -> int:
    import argparse

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["profile"]:
        rest = argv[1:]
        extra = rest[rest.index("--") + 1:] if "--" in rest else []
        rest = rest[:rest.index("--")] if "--" in rest else rest
        p = argparse.ArgumentParser(prog="python -m kernels.bench.ncu_source profile")
        p.add_argument("--kernel", required=True, help="ncu's -k, e.g. regex:backward_tc")
        p.add_argument("--out", required=True, help="folder for report.ncu-rep, source.csv, details.txt, summary.txt")
        p.add_argument("--launch-count", type=int, default=1)
        a = p.parse_args(rest)
        if not extra:
            p.error("the program to profile goes after --, e.g. -- -m kernels.bench.tensor_core_backward ...")
        print(profile(a.kernel, Path(a.out), extra, a.launch_count))
        return 0
    p = argparse.ArgumentParser(prog="python -m kernels.bench.ncu_source",
                                description="sum ncu's source counters (a --page source CSV) by the kernel's loops")
    p.add_argument("csv", help="ncu --import R.ncu-rep --page source --csv --print-source sass > this")
    p.add_argument("--top", type=int, default=0, help="also list the N most-sampled instructions")
    a = p.parse_args(argv)
    print(summarize(read_source_csv(a.csv), top=a.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
