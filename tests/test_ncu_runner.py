"""The Nsight Compute runner (kernels/bench/ncu.py) and the tools built on it, against a fake
``ncu`` on PATH: it records its command line, runs the profiled program when asked to, and
prints a recorded ``ncu --csv`` output. What is tested: the command line, the child that
calls a function, the parsing, the errors, and that each port writes its results CSV."""

import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kernels.bench import ncu
from kernels.bench.harness import read_csv

ROOT = Path(__file__).resolve().parents[1]
RECORDED = Path(__file__).resolve().parent / "ncu_recorded"     # real ncu --csv output, H100, ncu 2025.3
HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
          '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')


def ncu_csv(launches):
    """An ``ncu --csv`` output: launches = [(id, kernel, grid, block, [(metric, unit, value)])]."""
    lines = ["==PROF== Connected to process 4242 (/usr/bin/python3.12)", HEADER]
    for i, kernel, grid, block, metrics in launches:
        for name, unit, value in metrics:
            lines.append(f'"{i}","4242","python3.12","127.0.0.1","{kernel}","1","7","{block}","{grid}","0","9.0",'
                         f'"Command line profiler metrics","{name}","{unit}","{value}"')
    return "\n".join(lines) + "\n==PROF== Disconnected from process 4242\n"


NAIVE = "cudapy::kernels::naive_attention::make_{}::<locals>::{}_kernel[abi:v1,cw51c](Array<float, 3, C, mutable, aligned>)"
NAIVE_CSV = ncu_csv([
    (0, NAIVE.format("scores", "scores"), "(32, 32, 64)", "(256, 1, 1)",
     [("dram__bytes_read.sum", "Mbyte", "67.50"), ("dram__bytes_write.sum", "Gbyte", "4.30")]),
    (1, NAIVE.format("row_softmax", "softmax"), "(4096, 64, 1)", "(256, 1, 1)",
     [("dram__bytes_read.sum", "Gbyte", "4.29"), ("dram__bytes_write.sum", "byte", "4,296,015,872")]),
    (2, NAIVE.format("weighted_sum", "weighted"), "(1, 32, 64)", "(256, 1, 1)",
     [("dram__bytes_read.sum", "Gbyte", "4.35"), ("dram__bytes_write.sum", "Mbyte", "67.11")]),
])
TRAFFIC = "cudapy::kernels::flash_backward::make_{0}::<locals>::{0}[abi:v1](float*)"
TRAFFIC_CSV = ncu_csv([
    (i, TRAFFIC.format(k), "(64, 64, 1)", "(128, 1, 1)",
     [("dram__bytes_read.sum", "Gbyte", "0.5"), ("dram__bytes_write.sum", "Mbyte", "120"),
      ("lts__t_sectors_srcunit_tex_op_read.sum", "sector", "40,000,000")])
    for i, k in enumerate(["delta", "dkdv"])
])
SDPA = "void fmha_cutlass{}_f32_aligned_64x64_k64_sm80(PyTorchMemEffAttention::AttentionKernel<float>::Params)"
PIPES_CSV = ncu_csv([
    (0, SDPA.format("F"), "(64, 64, 1)", "(128, 1, 1)",
     [("gpu__time_duration.sum", "msecond", "8.1"), ("sm__inst_executed_pipe_tensor.sum", "inst", "402,653,184"),
      ("sm__inst_executed_pipe_fma.sum", "inst", "1,000"), ("sm__pipe_tensor_cycles_active.sum", "cycle", "5e8"),
      ("sm__pipe_fma_cycles_active.sum", "cycle", "1e7")]),
    (1, "void at::native::vectorized_elementwise_kernel<4>(int)", "(8, 1, 1)", "(128, 1, 1)",
     [("gpu__time_duration.sum", "usecond", "3.2")]),
])

FAKE_NCU = r'''#!{python}
import json, os, subprocess, sys
argv = sys.argv[1:]
if "--query-metrics" in argv:
    print("Device GH100\n---------------------------------------- ----------------")
    print("dram__bytes_read                         # of bytes read from DRAM")
    if os.environ.get("FAKE_NCU_L2") == "1":
        print("lts__t_sectors_srcunit_tex_op_read       # of LTS sectors read by the TEX unit")
    sys.exit(0)
with open(os.environ["FAKE_NCU_LOG"], "a") as log:
    log.write(json.dumps(argv) + "\n")
valued = {{"--metrics", "-k", "--kernel-name", "--launch-skip", "-s", "--launch-count", "-c",
          "--clock-control", "--profile-from-start"}}
i = 0
while i < len(argv) and argv[i].startswith("-"):
    i += 2 if argv[i] in valued else 1
program = argv[i:]
rc = 0
if os.environ.get("FAKE_NCU_EXEC") == "1":
    proc = subprocess.run(program, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sys.stdout.write(proc.stdout)
    sys.stderr.write(proc.stderr)
    rc = proc.returncode
sys.stdout.write(open(os.environ["FAKE_NCU_CSV"]).read())
sys.exit(rc)
'''


@pytest.fixture
def fake_ncu(tmp_path, monkeypatch):
    """A fake ``ncu`` first on PATH; returns a function (csv text, exec=False, l2=False) that
    arms it and returns the path of its log of command lines."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / "ncu"
    exe.write_text(FAKE_NCU.format(python=sys.executable))
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("NCU", raising=False)
    log = tmp_path / "ncu_calls.jsonl"
    monkeypatch.setenv("FAKE_NCU_LOG", str(log))
    ncu._metric_lists.clear()

    def arm(text, exec=False, l2=False):
        (tmp_path / "recorded.csv").write_text(text)
        monkeypatch.setenv("FAKE_NCU_CSV", str(tmp_path / "recorded.csv"))
        monkeypatch.setenv("FAKE_NCU_EXEC", "1" if exec else "0")
        monkeypatch.setenv("FAKE_NCU_L2", "1" if l2 else "0")
        ncu._metric_lists.clear()
        return log

    return arm


def calls(log):
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_the_command_line():
    cmd = ncu.command("pkg.mod:fn", ncu.DRAM, args=("a", 1), kernel="regex:flash_forward", launch_skip=1,
                      launch_count=1, from_start=False, ncu=sys.executable, python="python3")
    assert cmd == [sys.executable, "--csv", "--clock-control", "none", "--profile-from-start", "off",
                   "-k", "regex:flash_forward", "--launch-skip", "1", "--launch-count", "1",
                   "--metrics", "dram__bytes_read.sum,dram__bytes_write.sum",
                   "python3", "-m", "kernels.bench.ncu", "call", "pkg.mod:fn", "a", "1"]
    cmd = ncu.command(["-m", "kernels.bench.flash_forward", "--ncu", "256,64,8,8"], "m.sum", ncu=sys.executable,
                      python="py")
    assert cmd == [sys.executable, "--csv", "--clock-control", "none", "--metrics", "m.sum",
                   "py", "-m", "kernels.bench.flash_forward", "--ncu", "256,64,8,8"]
    assert ncu.command(ncu.totals, ["x"], ncu=sys.executable)[-2:] == ["call", "kernels.bench.ncu:totals"]
    with pytest.raises(TypeError, match="importable"):
        ncu.command(lambda: None, ["x"], ncu=sys.executable)
    with pytest.raises(ValueError, match="module:function"):
        ncu.command("no_colon", ["x"], ncu=sys.executable)
    with pytest.raises(ValueError, match="metrics"):
        ncu.command("a:b", [], ncu=sys.executable)


def test_missing_ncu_is_named_before_anything_runs(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("NCU", raising=False)
    monkeypatch.setattr(ncu.shutil, "which", lambda name: None)     # not on PATH, not in the toolkit
    with pytest.raises(ncu.NcuMissing, match="Nsight Compute"):
        ncu.profile("a:b", ncu.DRAM)
    # $NCU names the only candidate: a wrong NCU is an error even where a CUDA toolkit has ncu
    proc = subprocess.run([sys.executable, "-m", "kernels.bench.ncu", "check"], capture_output=True, text=True,
                          env=dict(os.environ, PATH=str(tmp_path), NCU="no-such-ncu"), cwd=ROOT)
    assert proc.returncode == 1 and "NcuMissing" in proc.stderr and "install" in proc.stderr


def test_profile_runs_the_function_in_a_child_and_parses_the_launches(fake_ncu, tmp_path):
    log = fake_ncu(NAIVE_CSV, exec=True)
    (tmp_path / "case_mod.py").write_text(textwrap.dedent('''
        def case(path, word):
            open(path, "w").write(word)
            print("the case ran")
    '''))
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    raw = tmp_path / "raw" / "ncu_case.csv"
    rows = ncu.profile("case_mod:case", ncu.DRAM, args=(tmp_path / "ran.txt", "yes"), from_start=False,
                       raw=raw, env=env)
    assert (tmp_path / "ran.txt").read_text() == "yes"
    assert "the case ran" in raw.read_text()                 # the program's output stays in the raw file
    (argv,) = calls(log)
    assert argv[:5] == ["--csv", "--clock-control", "none", "--profile-from-start", "off"]
    assert argv[argv.index("--metrics") + 1] == "dram__bytes_read.sum,dram__bytes_write.sum"
    assert [r["id"] for r in rows] == ["0", "1", "2"]
    assert "scores" in rows[0]["kernel"] and rows[0]["grid"] == "(32, 32, 64)" and rows[0]["block"] == "(256, 1, 1)"
    assert rows[0]["metrics"]["dram__bytes_read.sum"] == pytest.approx(67.5e6)
    assert rows[0]["metrics"]["dram__bytes_write.sum"] == pytest.approx(4.3e9)
    assert rows[1]["metrics"]["dram__bytes_write.sum"] == 4296015872
    assert ncu.totals(rows, "dram__bytes_read.sum")["dram__bytes_read.sum"] == pytest.approx(67.5e6 + 4.29e9 + 4.35e9)


def test_a_failing_program_or_no_launch_is_an_error_with_ncus_messages(fake_ncu, tmp_path):
    fake_ncu(NAIVE_CSV, exec=True)
    with pytest.raises(ncu.NcuError, match="exited with 1(.|\n)*No module named"):
        ncu.profile("no_such_module_here:fn", ncu.DRAM)
    fake_ncu("==PROF== Connected\n==WARNING== No kernels were profiled.\n")
    with pytest.raises(ncu.NcuError, match="no kernel launch"):
        ncu.profile("a:b", ncu.DRAM)


def test_the_l2_metric_only_where_ncu_has_it(fake_ncu):
    fake_ncu(NAIVE_CSV, l2=True)
    assert ncu.l2_read() == (ncu.L2_READ,)
    fake_ncu(NAIVE_CSV, l2=False)
    assert ncu.l2_read() == ()
    out = subprocess.run([sys.executable, "-m", "kernels.bench.ncu", "metrics", "--l2", "a.sum,b.sum"],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.stdout.strip() == "a.sum,b.sum" and "no L2 read metric" in out.stderr


def test_the_profile_command_passes_the_program_and_filters(fake_ncu, tmp_path):
    log = fake_ncu(NAIVE_CSV)
    raw = tmp_path / "ncu_fused.csv"
    proc = subprocess.run([sys.executable, "-m", "kernels.bench.ncu", "profile", "--metrics", "m1.sum,m2.sum",
                           "-k", "regex:flash_forward", "--launch-skip", "1", "--launch-count", "1", "--raw", str(raw),
                           "--", "-m", "kernels.bench.flash_forward", "--ncu", "128,64,8,8"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    (argv,) = calls(log)
    assert argv[argv.index("-k") + 1] == "regex:flash_forward"
    assert argv[argv.index("--launch-skip") + 1] == "1" and argv[argv.index("--launch-count") + 1] == "1"
    assert "--profile-from-start" not in argv
    assert argv[-4:] == ["-m", "kernels.bench.flash_forward", "--ncu", "128,64,8,8"]
    assert raw.exists() and "scores_kernel" in proc.stdout


# --------------------------------------------------------------------------- the ports

def test_ncu_dram_profile_writes_the_naive_table(fake_ncu, tmp_path):
    log = fake_ncu(NAIVE_CSV)
    out, raw = tmp_path / "naive_attention_dram.csv", tmp_path / "ncu_naive.csv"
    proc = subprocess.run([sys.executable, ".ci/ncu_dram.py", "profile", str(out), "--raw", str(raw)],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    (argv,) = calls(log)
    assert argv[-2:] == [str(ROOT / ".ci" / "ncu_dram.py"), "run-naive"] and "--profile-from-start" not in argv
    _, rows = read_csv(out)
    assert [r["kernel"] for r in rows] == ["S kernel (S = scale Q K^T) (Nsight Compute)",
                                           "softmax kernel (P = softmax S) (Nsight Compute)",
                                           "PV kernel (O = P V) (Nsight Compute)",
                                           "naive attention, 3 kernels (Nsight Compute)"]
    assert all(r["model_bytes"] > 0 for r in rows)
    assert "dram_total_bytes=4367500000.0" in rows[0]["extra"]


def test_traffic_profile_writes_the_backward_table(fake_ncu, tmp_path):
    log = fake_ncu(TRAFFIC_CSV, l2=True)
    proc = subprocess.run([sys.executable, "-m", "kernels.bench.traffic", "profile", "bwd-atomic", "bwd-separate",
                           "--out", str(tmp_path / "res"), "--raw-dir", str(tmp_path / "raw")],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    argvs = calls(log)
    assert [a[-1] for a in argvs] == ["bwd-atomic", "bwd-separate"]
    assert all(a[a.index("--metrics") + 1].endswith(ncu.L2_READ) and "off" in a for a in argvs)
    assert argvs[0][-3:-1] == ["call", "kernels.bench.traffic:run_case"]
    assert (tmp_path / "raw" / "ncu_bwd-atomic.csv").exists()
    _, rows = read_csv(tmp_path / "res" / "flash_backward_dram.csv")
    assert [r["kernel"] for r in rows] == ["backward, atomic dQ (Nsight Compute)", "backward, separate dQ (Nsight Compute)"]
    assert "l2_read_bytes=2560000000.0" in rows[0]["extra"] and "delta:0.620/1.280" in rows[0]["extra"]


def test_traffic_profile_names_an_unknown_case_before_running_ncu(fake_ncu, tmp_path):
    log = fake_ncu(TRAFFIC_CSV)
    proc = subprocess.run([sys.executable, "-m", "kernels.bench.traffic", "profile", "bwd-fast", "--out", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode != 0 and "unknown case 'bwd-fast'" in proc.stderr and not log.exists()


def test_peer_pipes_profile_writes_the_pipes_table(fake_ncu, tmp_path):
    log = fake_ncu(PIPES_CSV)
    proc = subprocess.run([sys.executable, "-m", "kernels.bench.peer_pipes", "profile", str(tmp_path),
                           "--raw", str(tmp_path / "ncu_sdpa.csv")], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    (argv,) = calls(log)
    assert argv[argv.index("--metrics") + 1] == ",".join(ncu.PIPES)
    assert argv[-2:] == ["call", "kernels.bench.peer_pipes:run"]
    _, rows = read_csv(tmp_path / "sdpa_pipes.csv")
    assert len(rows) == 1 and rows[0]["median_ms"] == pytest.approx(8.1)
    assert "tensor_inst=402653184.0" in rows[0]["extra"]


@pytest.mark.parametrize("case", ["bwd-atomic", "bwd-separate", "bs-fwd-1", "bs-fwd-0.125", "bs-bwd-1", "bs-bwd-0.125"])
def test_every_traffic_case_has_its_model(case):
    from kernels.bench import traffic

    fn, chapter, what, model = traffic._case(case, build=False)
    assert fn is None and chapter in (5, 6) and what and model > 0


# --------------------------------------------------------------------------- recorded on an H100

def test_recorded_naive_run_matches_the_io_model(fake_ncu, tmp_path):
    fake_ncu((RECORDED / "naive_h100.csv").read_text())
    out = tmp_path / "naive_attention_dram.csv"
    proc = subprocess.run([sys.executable, ".ci/ncu_dram.py", "profile", str(out)], capture_output=True, text=True,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    _, rows = read_csv(out)
    assert len(rows) == 4
    for r in rows:
        measured = float(r["extra"].split("dram_total_bytes=")[1].split(";")[0])
        assert 0.95 < measured / r["model_bytes"] < 1.05, r


def test_recorded_backward_and_pipes_runs_tabulate(fake_ncu, tmp_path):
    fake_ncu((RECORDED / "bwd-atomic_h100.csv").read_text(), l2=True)
    proc = subprocess.run([sys.executable, "-m", "kernels.bench.traffic", "profile", "bwd-atomic", "--out", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    _, rows = read_csv(tmp_path / "flash_backward_dram.csv")
    assert len(rows) == 1 and "2 kernels" in rows[0]["note"] and "delta:" in rows[0]["extra"]
    fake_ncu((RECORDED / "sdpa_h100.csv").read_text())
    proc = subprocess.run([sys.executable, "-m", "kernels.bench.peer_pipes", "profile", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    _, rows = read_csv(tmp_path / "sdpa_pipes.csv")
    assert len(rows) == 4 and all(5 < r["median_ms"] < 50 for r in rows)          # ncu printed ns
    assert all("tf32_flops_over_attention_flops=3.0" in r["extra"] for r in rows)
