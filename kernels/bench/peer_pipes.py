"""Which execution pipes the fp32 peer uses: PyTorch SDPA's memory-efficient kernels, counted
by Nsight Compute.

The course's kernels run every product on the fp32 FMA units (Numba exposes no tensor-core
instruction). Chapters 4 and 5 compare them with SDPA's memory-efficient backend on fp32
inputs, so it matters what that peer executes. On a GPU with Nsight Compute and PyTorch:

    python -m kernels.bench.peer_pipes profile [OUT_DIR] [--raw ncu_sdpa.csv]   # -> sdpa_pipes.csv

runs ``run`` under ``kernels.bench.ncu.profile`` with the metrics ``ncu.PIPES`` (time, FMA-
and tensor-pipe instructions and active cycles) and then ``table``. The two steps apart:

    python -m kernels.bench.peer_pipes run                    # the program ncu watches
    python -m kernels.bench.peer_pipes table ncu_sdpa.csv     # -> workbook/results/sdpa_pipes.csv

``run`` times nothing: it warms up, then runs SDPA memory-efficient forward + backward once
at B=4 H=16 N=4096, d = 64 and d = 128, fp32, between cuProfilerStart and cuProfilerStop.
``table`` keeps the attention kernels and adds, for each, the tensor-core instructions
times the FLOPs of one TF32 mma.sync m16n8k8 (2 x 16 x 8 x 8 = 2048), divided by the
FLOPs the attention needs (4 B H N^2 d forward, 2.5 x that backward): a ratio of 3 is what
an fp32 product computed as three TF32 products (the "3xTF32" split of each operand into a
large and a small TF32 part, which keeps about fp32 accuracy) looks like in these counters.
"""

from __future__ import annotations

import sys
from pathlib import Path

SHAPE = (4, 16, 4096)
MMA_FLOPS = 2 * 16 * 8 * 8


def run():
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    b, h, n = SHAPE
    for d in (64, 128):
        q, k, v = (torch.randn(b, h, n, d, device="cuda", requires_grad=True) for _ in range(3))
        do = torch.randn(b, h, n, d, device="cuda")
        for profiled in (False, True):
            torch.cuda.synchronize()
            if profiled:
                torch.cuda.profiler.start()
            with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                sdpa(q, k, v).backward(do)
            torch.cuda.synchronize()
            if profiled:
                torch.cuda.profiler.stop()


def table(path, out=None):
    from kernels.bench import harness
    from kernels.bench.harness import Result

    b, h, n = SHAPE
    results = []
    for launch in harness.read_ncu(path):
        name, m = launch["kernel"].split("(")[0], launch["metrics"]
        if "fmha" not in name:
            continue
        d = 128 if "k128" in name or "64x128" in name else 64
        backward = "cutlassB" in name
        flops = 4 * b * h * n * n * d * (2.5 if backward else 1.0)
        tensor = m.get("sm__inst_executed_pipe_tensor.sum", float("nan"))
        ratio = tensor * MMA_FLOPS / flops
        ms = m.get("gpu__time_duration.sum", float("nan")) / 1e6
        results.append(Result(
            5 if backward else 4, f"peer: SDPA memory-efficient {'backward' if backward else 'forward'} ({name})",
            f"B={b} H={h} N={n} d={d} fp32 causal=False", ms, float("nan"), float("nan"), flops, float("nan"),
            flops / ms / 1e9, float("nan"), float("nan"), float("nan"), True,
            f"tensor-core mma x 2048 FLOPs / attention FLOPs = {ratio:.2f}; "
            f"tensor pipe active {m.get('sm__pipe_tensor_cycles_active.sum', float('nan')):.3g} cycles, "
            f"FMA pipe {m.get('sm__pipe_fma_cycles_active.sum', float('nan')):.3g}",
            {"d": d, "part": "backward" if backward else "forward", "tensor_inst": tensor,
             "fma_inst": m.get("sm__inst_executed_pipe_fma.sum", float("nan")),
             "tensor_cycles": m.get("sm__pipe_tensor_cycles_active.sum", float("nan")),
             "fma_cycles": m.get("sm__pipe_fma_cycles_active.sum", float("nan")),
             "tf32_flops_over_attention_flops": round(ratio, 3)}))
    out = Path(out) if out else Path(__file__).resolve().parents[2] / "workbook" / "results"
    out.mkdir(parents=True, exist_ok=True)
    harness.write_csv(out / "sdpa_pipes.csv", results, harness.environment())
    for r in results:
        print(f"{r.kernel:<75} {r.config:<36} {r.median_ms:7.2f} ms  {r.note}")


def profile(out=None, raw=None):
    """``run`` once under Nsight Compute (a child process), then ``table``."""
    import tempfile

    from kernels.bench import ncu

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(raw) if raw else Path(tmp) / "ncu_sdpa.csv"
        ncu.profile("kernels.bench.peer_pipes:run", ncu.PIPES, from_start=False, raw=path)
        table(path, out)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["run"]:
        run()
    elif argv[:1] == ["profile"]:
        from kernels.bench import ncu

        rest, raw = argv[1:], None
        if "--raw" in rest[:-1]:
            i = rest.index("--raw")
            raw, rest = rest[i + 1], rest[:i] + rest[i + 2:]
        try:
            profile(rest[0] if rest else None, raw)
        except (ncu.NcuMissing, ncu.NcuError) as err:
            raise SystemExit(f"peer_pipes profile: {err}")
    elif argv[:1] == ["table"] and len(argv) >= 2:
        table(argv[1], argv[2] if len(argv) > 2 else None)
    else:
        print(__doc__)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
