"""Measured HBM traffic (Nsight Compute) of chapter 1's naive kernels, held against the IO model.

Three modes:
    python .ci/ncu_dram.py profile OUT [--raw NCU_CSV]
                                              both steps below: run-naive under Nsight Compute
                                              (kernels.bench.ncu.profile, DRAM bytes read and
                                              written), then the table into OUT
    python .ci/ncu_dram.py run-naive          launches S, softmax and PV once each at the
                                              reference configuration (the program ncu watches)
    python .ci/ncu_dram.py table NCU_CSV OUT  turns ``ncu --csv`` output into a results CSV

On a GPU machine:
    python .ci/ncu_dram.py profile workbook/results/naive_attention_dram.csv --raw ncu_naive.csv
"""

import os
import sys

import numpy as np

import kernels  # noqa: F401  (GPU or simulator first)
from kernels.base import runtime
from kernels.bench import ncu
from kernels.bench.harness import Result, environment, read_ncu, write_csv

REFERENCE = (4, 16, 4096, 64)   # B, H, N, d, fp32, non-causal
PARTS = (("scores", "S kernel (S = scale Q K^T)"), ("softmax", "softmax kernel (P = softmax S)"),
         ("weighted", "PV kernel (O = P V)"))


def run_naive():
    from kernels.naive_attention import row_softmax, scores, weighted_sum

    b, h, n, d = REFERENCE
    rng = np.random.default_rng(0)
    q, k, v = (runtime.to_device(rng.standard_normal((b, h, n, d)).astype(np.float32), name) for name in "qkv")
    s = scores(q, k)
    p, _ = row_softmax(s)
    weighted_sum(p, v)
    from numba import cuda

    cuda.synchronize()


def profile(out_path, raw=None):
    """run-naive under Nsight Compute (DRAM bytes), then the table."""
    launches = ncu.profile([os.path.abspath(__file__), "run-naive"], ncu.DRAM, raw=raw)
    tabulate(launches, out_path)


def table(ncu_csv, out_path):
    tabulate(read_ncu(ncu_csv), out_path)


def tabulate(launches, out_path):
    from kernels.naive_attention import io_model_bytes

    b, h, n, d = REFERENCE
    model = io_model_bytes(b, h, n, n, d)
    config = f"B={b} H={h} N={n} d={d} fp32 causal=False"
    results = []
    for launch in launches:
        name, metrics = launch["kernel"], launch["metrics"]
        part = next(((key, label) for key, label in PARTS if key in name), None)
        if part is None:
            continue
        read, write = metrics.get("dram__bytes_read.sum", np.nan), metrics.get("dram__bytes_write.sum", np.nan)
        predicted = next((v for key, v in model.items() if part[0] in key), np.nan)
        results.append(Result(1, f"{part[1]} (Nsight Compute)", config, np.nan, np.nan, np.nan, 0.0, predicted,
                              np.nan, np.nan, np.nan, np.nan, False,
                              f"measured DRAM bytes {(read + write) / 1e9:.3f} GB = {(read + write) / predicted:.2f} x the IO model",
                              {"dram_read_bytes": read, "dram_write_bytes": write, "dram_total_bytes": read + write,
                               "model_bytes": predicted, "part": "ncu"}))
    if results:
        total_measured = sum(r.extra["dram_total_bytes"] for r in results)
        results.append(Result(1, "naive attention, 3 kernels (Nsight Compute)", config, np.nan, np.nan, np.nan, 0.0,
                              model["total"], np.nan, np.nan, np.nan, np.nan, False,
                              f"measured DRAM bytes {total_measured / 1e9:.3f} GB = {total_measured / model['total']:.2f} x the IO model",
                              {"dram_total_bytes": total_measured, "model_bytes": model["total"], "part": "ncu"}))
    write_csv(out_path, results, environment())
    for r in results:
        print(f"{r.kernel:<48} {r.note}")


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else ""
    if mode == "run-naive":
        run_naive()
    elif mode == "table" and len(sys.argv) == 4:
        table(sys.argv[2], sys.argv[3])
    elif mode == "profile" and len(sys.argv) in (3, 5) and (len(sys.argv) == 3 or sys.argv[3] == "--raw"):
        try:
            profile(sys.argv[2], sys.argv[4] if len(sys.argv) == 5 else None)
        except (ncu.NcuMissing, ncu.NcuError) as err:
            sys.exit(f"ncu_dram profile: {err}")
    else:
        sys.exit(__doc__)
