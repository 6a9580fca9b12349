"""Measured HBM traffic (Nsight Compute) of chapter 1's naive kernels, held against the IO model.

Two modes:
    python .ci/ncu_dram.py run-naive          launches S, softmax and PV once each at the
                                              reference configuration (the program ncu watches)
    python .ci/ncu_dram.py table NCU_CSV OUT  turns ``ncu --csv`` output into a results CSV

On a GPU machine:
    ncu --csv --clock-control none --metrics dram__bytes_read.sum,dram__bytes_write.sum \
        python .ci/ncu_dram.py run-naive > ncu_naive.csv
    python .ci/ncu_dram.py table ncu_naive.csv workbook/results/naive_attention_dram.csv
"""

import sys

import numpy as np

import kernels  # noqa: F401  (GPU or simulator first)
from kernels.base import runtime
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


def table(ncu_csv, out_path):
    from kernels.naive_attention import io_model_bytes

    b, h, n, d = REFERENCE
    model = io_model_bytes(b, h, n, n, d)
    config = f"B={b} H={h} N={n} d={d} fp32 causal=False"
    results = []
    for launch in read_ncu(ncu_csv):
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
    if sys.argv[1] == "run-naive":
        run_naive()
    elif sys.argv[1] == "table":
        table(sys.argv[2], sys.argv[3])
    else:
        sys.exit(__doc__)
