"""Performance on a napkin: every chapter's main kernel as arrays, bytes and levels.

After "FlashAttention on a Napkin" (Abbott and Zardini, 2024; [12]): draw attention as a
diagram of its arrays (Q, K, V, S = QK^T, P = softmax(S), O = PV), each a box with its
shape and the memory level it lives in, and the data movement between them as arrows
labelled with bytes. Then read the time off the diagram: a kernel cannot finish before
each level of the machine has moved the bytes that cross it, nor before the arithmetic
units have done its FLOPs,

    t  >=  max( bytes_HBM / BW_HBM,  bytes_L2 / BW_L2,  bytes_smem / BW_smem,  FLOPs / rate )

and the level that attains the max is the **bound**. The model is a lower bound made of
four divisions; where a kernel's measured time is far above it, the sentence that explains
the gap is the lesson (``MISSES``).

The levels of the H100 and where their figures come from (``h100()``):

| level | figure | source |
|---|---|---|
| HBM | copy 2.95 TB/s (read + write), read 2.96 TB/s | measured: gpu_basics.csv, decode.csv |
| L2 -> SM | about 5.5 TB/s | nominal: a published microbenchmark of the H100, not measured by the course |
| shared memory | 128 B a clock an SM | derived: 32 banks x 4 B, at the clock the measured FMA rate implies |
| registers | FLOP rate: fp32 FMA 50.9, mma.sync fp16 612 TFLOP/s | measured: gpu_basics.csv, flash_tensor_cores.csv |

The bytes at each level are the course's own: HBM bytes are Nsight Compute's DRAM bytes
where they are committed (``*_dram.csv``) and the IO model's (``kernels.base.io_model``)
otherwise; L2 -> SM bytes are Nsight's L2 reads (plus the DRAM writes, which pass through
L2) or, where none are committed, the IO model without reuse, which is what the SMs ask of
L2 (the fused forward measures 0.92x it); shared-memory bytes are what the register
micro-tiles load: a thread that keeps a TM x TN tile of outputs reads TM + TN operands for
TM TN multiply-adds, so ``(1/TM + 1/TN) itemsize / 2`` bytes a FLOP, plus the tiles stored
into shared memory (``smem_bytes``).

Quantization (``quantized``): fp16 halves and fp8 quarters every byte; the FLOP rate moves
only where the arithmetic moves to the tensor cores. The H100 has no native fp8 mma.sync:
``mma.sync.m16n8k32.e4m3`` (an sm_89 instruction) compiles for sm_90, but runs as a
conversion to fp16 followed by fp16 mma (NVIDIA/cutlass#1986); native fp8 is wgmma only,
which this course does not reach from Numba. So fp8 through mma.sync gets at most the fp16
rate, and the napkin gives it that.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from kernels.base import io_model as io

__all__ = ["LEVELS", "Machine", "Work", "Part", "Case", "MissingMeasurement", "h100", "level_times", "predict",
           "predict_case", "smem_bytes", "quantized", "reference_cases", "prediction_table", "quantization_table",
           "quantization_checks",
           "MISSES", "fmt_bytes", "draw_standard", "draw_streamed", "draw_predictions", "RESULTS_DIR"]

RESULTS_DIR = io.RESULTS_DIR
LEVELS = ("HBM", "L2", "shared memory", "registers")   # registers: where the FLOPs happen
SMEM_BYTES_PER_CLOCK = 128        # 32 banks x 4 bytes, an SM a clock
FMA_FLOPS_PER_CLOCK = 256         # 128 fp32 FMA units an SM x 2 FLOPs
MUFU_PER_CLOCK = 16               # exp2 and friends, an SM a clock (compute capability 9.0)
L2_NOMINAL_TBS = 5.5              # H100 L2 -> SM, the order a published microbenchmark found (PCIe card)
SMS = 132


class MissingMeasurement(LookupError):
    """A committed CSV, or a row in it, that the model reads is not there."""


# --------------------------------------------------------------------------- the machine

@dataclass(frozen=True)
class Machine:
    """Bandwidths (bytes/s) and FLOP rates (FLOP/s) of a GPU, each with its source.

    ``bandwidth``: {"HBM copy", "HBM read", "L2", "shared memory"}; ``flop_rate``:
    {"fp32 FMA", "fp16 mma.sync", "fp8 mma.sync"}; ``sources``: {key: (kind, text)},
    kind one of "measured", "derived", "nominal"."""
    device: str
    bandwidth: dict
    flop_rate: dict
    sources: dict
    exp_rate: float = math.nan      # exponentials a second (MUFU), for the misses' asides

    def clock_hz(self) -> float:
        """The clock the measured fp32 FMA rate implies: rate / (256 FLOP a clock x SMs)."""
        return self.flop_rate["fp32 FMA"] / (FMA_FLOPS_PER_CLOCK * SMS)


def _read(name, results_dir=None):
    from kernels.bench.harness import read_csv

    path = Path(results_dir or RESULTS_DIR) / name
    if not path.exists():
        raise MissingMeasurement(f"{path}: no committed results (the chapter's bench writes it on a GPU)")
    return path, read_csv(path)[1]


def _row(path, rows, kernel, config="", *, exact=False):
    """The first row whose kernel starts with ``kernel`` (is ``kernel``, ``exact``) and whose
    config contains ``config`` (is ``config``, ``exact``)."""
    if exact:
        hits = [r for r in rows if r["kernel"] == kernel and r["config"] == config]
    else:
        hits = [r for r in rows if r["kernel"].startswith(kernel) and config in r["config"]]
    if not hits:
        raise MissingMeasurement(f"{Path(path).name}: no row {kernel!r} with config {config!r}")
    return hits[0]


def _extra(row) -> dict:
    out = {}
    for item in (row.get("extra") or "").split(";"):
        key, sep, value = item.partition("=")
        if sep:
            try:
                out[key] = float(value)
            except ValueError:
                out[key] = value
    return out


def h100(results_dir=None) -> Machine:
    """The H100 of the course's committed results: measured HBM and FLOP rates, a derived
    shared-memory bandwidth and a nominal L2 bandwidth (see the module docstring)."""
    c = io.ceilings(results_dir)                                  # gpu_basics.csv, tiled_matmul.csv
    dpath, drows = _read("decode.csv", results_dir)
    read = _row(dpath, drows, "peer: read bandwidth")
    tpath, trows = _read("flash_tensor_cores.csv", results_dir)
    mma16 = _row(tpath, trows, "ceiling: mma.sync m16n8k16 fp16")
    fpath, frows = _read("flash_forward_dram.csv", results_dir)
    seen_l2 = max((_extra(r).get("l2_read_bytes", 0.0) / (r["median_ms"] * 1e-3) for r in frows
                   if r["median_ms"] > 0), default=math.nan)     # the fastest L2 stream the course measured
    fma = c.fp32_tflops * 1e12
    clock = fma / (FMA_FLOPS_PER_CLOCK * SMS)
    bandwidth = {
        "HBM copy": c.memcpy_gbps * 1e9,
        "HBM read": read["gbps"] * 1e9,
        "L2": L2_NOMINAL_TBS * 1e12,
        "shared memory": SMEM_BYTES_PER_CLOCK * SMS * clock,
    }
    flop_rate = {"fp32 FMA": fma, "fp16 mma.sync": mma16["tflops"] * 1e12, "fp8 mma.sync": mma16["tflops"] * 1e12}
    sources = {
        "HBM copy": ("measured", f"cudaMemcpy D2D, 2 GiB, bytes read + written (gpu_basics.csv): "
                                 f"{c.memcpy_gbps / 1e3:.2f} TB/s"),
        "HBM read": ("measured", f"torch.sum over 4 GiB (decode.csv): {read['gbps'] / 1e3:.2f} TB/s"),
        "L2": ("nominal", f"{L2_NOMINAL_TBS} TB/s L2 -> SM: the order a published microbenchmark found on the "
                          "H100 PCIe (Chips and Cheese, 2023); not measured by the course, whose kernels streamed "
                          f"at least {seen_l2 / 1e12:.2f} TB/s from L2 ({fpath.name}, Br = 16)"),
        "shared memory": ("derived", f"{SMEM_BYTES_PER_CLOCK} B a clock an SM (32 banks x 4 B) x {SMS} SMs x "
                                     f"{clock / 1e9:.2f} GHz, the clock the measured FMA rate implies: "
                                     f"{bandwidth['shared memory'] / 1e12:.1f} TB/s"),
        "fp32 FMA": ("measured", f"cuBLAS sgemm 8192^3, TF32 off (gpu_basics.csv): {c.fp32_tflops:.1f} TFLOP/s"),
        "fp16 mma.sync": ("measured", f"mma.sync m16n8k16 throughput loop (flash_tensor_cores.csv): "
                                      f"{mma16['tflops']:.0f} TFLOP/s"),
        "fp8 mma.sync": ("derived", "no native fp8 mma.sync on sm_90: the e4m3 instruction is converted to fp16 "
                                    "mma (NVIDIA/cutlass#1986), so at most the fp16 rate; native fp8 is wgmma only"),
    }
    return Machine(c.device, bandwidth, flop_rate, sources, exp_rate=MUFU_PER_CLOCK * SMS * clock)


# --------------------------------------------------------------------------- work and time

@dataclass(frozen=True)
class Work:
    """What one kernel does: FLOPs (on the ``rate`` engine) and bytes crossing each level.
    ``hbm_key``: "HBM copy" for kernels that read and write, "HBM read" for read-only
    streams (decode)."""
    flops: float
    hbm: float
    l2: float = 0.0
    smem: float = 0.0
    rate: str = "fp32 FMA"
    hbm_key: str = "HBM copy"

    def __post_init__(self):
        for name in ("flops", "hbm", "l2", "smem"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name}: expected a finite number >= 0, got {value!r}")


def level_times(work: Work, machine: Machine) -> dict:
    """Seconds each level needs for ``work``: {"HBM", "L2", "shared memory", "registers"}."""
    if work.rate not in machine.flop_rate:
        raise ValueError(f"rate: expected one of {sorted(machine.flop_rate)}, got {work.rate!r}")
    if work.hbm_key not in ("HBM copy", "HBM read"):
        raise ValueError(f"hbm_key: expected 'HBM copy' or 'HBM read', got {work.hbm_key!r}")
    bw = machine.bandwidth
    return {"HBM": work.hbm / bw[work.hbm_key], "L2": work.l2 / bw["L2"],
            "shared memory": work.smem / bw["shared memory"], "registers": work.flops / machine.flop_rate[work.rate]}


def predict(work: Work, machine: Machine) -> tuple[float, str]:
    """(seconds, bound): the largest of the level times and the level that sets it
    ("registers" means the FLOP rate: FMA-bound or tensor-core-bound)."""
    times = level_times(work, machine)
    bound = max(LEVELS, key=lambda k: times[k])
    return times[bound], bound


def smem_bytes(flops: float, tm: float, tn: float, *, itemsize: int = 4, stored: float = 0.0) -> float:
    """Shared-memory bytes of a register-tiled product: each thread (or warp, for mma) with a
    tm x tn tile of outputs reads tm + tn operands for tm tn multiply-adds (2 tm tn FLOPs),
    so FLOPs (1/tm + 1/tn) itemsize / 2 bytes; plus ``stored``, the bytes of the tiles
    written into shared memory. ``tn = inf``: the other operand sits in registers."""
    if tm <= 0 or tn <= 0:
        raise ValueError(f"tm, tn: expected > 0, got {tm}, {tn}")
    return flops * (1.0 / tm + 1.0 / tn) * itemsize / 2.0 + stored


# --------------------------------------------------------------------------- the reference cases

@dataclass(frozen=True)
class Part:
    name: str
    work: Work


@dataclass(frozen=True)
class Case:
    """One chapter's main kernel at its reference shape: its parts (kernels run one after
    the other; the prediction is the sum of their bounds), the measured time and where it
    was read from."""
    chapter: str
    kernel: str
    shape: str
    parts: tuple
    measured_ms: float
    source: str
    itemsize: int = 4
    notes: dict = field(default_factory=dict)


def predict_case(case: Case, machine: Machine) -> tuple[float, str]:
    """(seconds, bound) of a case: the sum over its parts of each part's bound; the bound
    names each part's level where the parts differ ("shared memory + HBM + ...")."""
    total, bounds = 0.0, []
    for part in case.parts:
        t, b = predict(part.work, machine)
        total += t
        if b not in bounds:
            bounds.append(b)
    return total, " + ".join(bounds)


def _attention_flops(B, H, n, d):
    return 4.0 * B * H * n * n * d


def reference_cases(results_dir=None) -> list[Case]:
    """Every chapter's main kernel at its reference shape, its bytes at each level and its
    measured time, all read from the committed CSVs (``MissingMeasurement`` if one is not
    there). Shapes: attention B=4 H=16 N=4096 d=64 (fp32; fp16 for chapter 8), matmul
    4096^3, softmax 65536 x 4096, decode B=1 H=32 N=128k d=128, the tree reduction P=8,
    chapter 10's two kernels at B=1 H=16 N=4096 (Algorithm 1's order at d=64, the
    M < d^2 algorithm at d=256)."""
    cases = []
    R = results_dir
    att = "B=4 H=16 N=4096 d=64 fp32 causal=False"

    # ch0: the copy kernel, 2 GiB
    path, rows = _read("gpu_basics.csv", R)
    r = _row(path, rows, "copy kernel, 4 a step", "N=268435456")
    cases.append(Case("0", "copy kernel", "N=2^28 fp32", (Part("copy", Work(0.0, r["model_bytes"], r["model_bytes"])),),
                      r["median_ms"], f"{path.name}: {r['kernel']}"))

    # ch1: three kernels, S and P through HBM; DRAM bytes by Nsight Compute
    path, rows = _read("naive_attention.csv", R)
    dpath, drows = _read("naive_attention_dram.csv", R)
    total = _row(path, rows, "naive attention (3 kernels)", att)
    B, H, n, d = 4, 16, 4096, 64
    s_row, pv_row = _row(path, rows, "S kernel (S = scale Q K^T)", att), _row(path, rows, "PV kernel (O = P V)", att)
    dram = {k: _extra(_row(dpath, drows, k, att))["dram_total_bytes"]
            for k in ("S kernel", "softmax kernel", "PV kernel")}
    # L2: Q re-read by every Bc-wide key tile and K by every Br-tall query tile (Br = Bc = 64), S written
    l2_s = B * H * (n * d * (n // 64) * 2) * 4 + B * H * n * n * 4
    parts = (Part("S = QK^T", Work(s_row["flops"], dram["S kernel"], l2_s, smem_bytes(s_row["flops"], 4, 4))),
             Part("P = softmax(S)", Work(0.0, dram["softmax kernel"], dram["softmax kernel"])),
             Part("O = PV", Work(pv_row["flops"], dram["PV kernel"], l2_s, smem_bytes(pv_row["flops"], 4, 4))))
    cases.append(Case("1", "naive attention (3 kernels)", "B4 H16 N4096 d64 fp32", parts, total["median_ms"],
                      f"{path.name}: {total['kernel']}; DRAM bytes {dpath.name}"))

    # ch2: rung 3 (fp32 registers, 8x8 a thread) and rung 4 (mma.sync fp16, warp tile 64x32)
    path, rows = _read("tiled_matmul.csv", R)
    mm = "M=4096 N=4096 K=4096"
    r3 = _row(path, rows, "rung 3 (registers)", mm + " fp32", exact=True)
    comp3 = 3 * 4096 * 4096 * 4
    cases.append(Case("2", "matmul rung 3 (registers)", "4096^3 fp32",
                      (Part("C = AB", Work(r3["flops"], comp3, r3["model_bytes"],
                                           smem_bytes(r3["flops"], 8, 8, stored=r3["model_bytes"]))),),
                      r3["median_ms"], f"{path.name}: {r3['kernel']} (L2: its IO model without reuse)"))
    r4 = _row(path, rows, "rung 4 (tensor cores)", mm + " fp16", exact=True)
    comp4 = 2 * 4096 * 4096 * 2 + 4096 * 4096 * 4
    cases.append(Case("2", "matmul rung 4 (mma.sync)", "4096^3 fp16",
                      (Part("C = AB", Work(r4["flops"], comp4, r4["model_bytes"],
                                           smem_bytes(r4["flops"], 64, 32, itemsize=2, stored=r4["model_bytes"]),
                                           rate="fp16 mma.sync")),),
                      r4["median_ms"], f"{path.name}: {r4['kernel']}", itemsize=2))

    # ch3: the row softmax, read once
    path, rows = _read("online_softmax.csv", R)
    r = _row(path, rows, "row softmax kernel", "rows=65536 n=4096 fp32", exact=True)
    cases.append(Case("3", "row softmax", "65536 x 4096 fp32",
                      (Part("softmax", Work(0.0, r["model_bytes"], r["model_bytes"])),),
                      r["median_ms"], f"{path.name}: {r['kernel']}"))

    # ch4: the fused forward, Br=256 Bc=64, 8x8 micro-tiles; DRAM and L2 bytes by Nsight
    path, rows = _read("flash_forward.csv", R)
    dpath, drows = _read("flash_forward_dram.csv", R)
    r = _row(path, rows, "flash fwd (default tiles)", att)
    x = _extra(_row(dpath, drows, "flash fwd Br=256", att))
    l2 = x["l2_read_bytes"] + x["dram_write_bytes"]
    cases.append(Case("4", "fused forward", "B4 H16 N4096 d64 fp32",
                      (Part("forward", Work(r["flops"], x["dram_total_bytes"], l2,
                                            smem_bytes(r["flops"], 8, 8, stored=x["l2_read_bytes"]))),),
                      r["median_ms"], f"{path.name}: {r['kernel']}; bytes {dpath.name}"))

    # ch5: the backward, atomic dQ; DRAM and L2 bytes by Nsight; micro-tiles taken as 8x8
    path, rows = _read("flash_backward.csv", R)
    dpath, drows = _read("flash_backward_dram.csv", R)
    r = _row(path, rows, "flash backward (atomic dQ)", att)
    x = _extra(_row(dpath, drows, "backward, atomic dQ", att))
    cases.append(Case("5", "backward (atomic dQ)", "B4 H16 N4096 d64 fp32",
                      (Part("backward", Work(r["flops"], x["dram_total_bytes"],
                                             x["l2_read_bytes"] + x["dram_write_bytes"],
                                             smem_bytes(r["flops"], 8, 8, stored=x["l2_read_bytes"]))),),
                      r["median_ms"], f"{path.name}: {r['kernel']}; bytes {dpath.name}"))

    # ch6: block-sparse forward, a random quarter of the tiles kept
    path, rows = _read("block_sparse.csv", R)
    dpath, drows = _read("block_sparse_dram.csv", R)
    r = _row(path, rows, "block-sparse forward", att + " random 0.25", exact=True)
    x = _extra(_row(dpath, drows, "block-sparse forward, density 0.25", att))
    cases.append(Case("6", "block-sparse forward, kept 0.25", "B4 H16 N4096 d64 fp32",
                      (Part("forward", Work(r["flops"], x["dram_total_bytes"],
                                            x["l2_read_bytes"] + x["dram_write_bytes"],
                                            smem_bytes(r["flops"], 8, 8, stored=x["l2_read_bytes"]))),),
                      r["median_ms"], f"{path.name}: {r['kernel']}; bytes {dpath.name}"))

    # ch7: decode, stream-k through prepare_decode, fp32 and fp16 caches
    path, rows = _read("decode.csv", R)
    for kv, item in (("fp32", 4), ("fp16", 2)):
        r = _row(path, rows, "prepare_decode stream-k (run)", f"B=1 Hq=32 Hkv=32 N=128k d=128 {kv} KV")
        cases.append(Case("7", f"decode stream-k, {kv} cache", f"B1 H32 N128k d128 {kv}",
                          (Part("decode", Work(r["flops"], r["model_bytes"], r["model_bytes"],
                                               hbm_key="HBM read")),),
                          r["median_ms"], f"{path.name}: {r['kernel']}", itemsize=item))

    # ch8: the tensor-core forward, Br=128 (8 warps of 16 rows) Bc=64; Q and P in registers
    path, rows = _read("flash_tensor_cores.csv", R)
    r = _row(path, rows, "flash fwd tensor cores (bare)", "B=4 H=16 N=4096 d=64 fp16 causal=False")
    l2 = io.fused_forward_bytes(4, 16, 4096, 4096, 64, Br=128, Bc=64, itemsize=2)
    cases.append(Case("8", "tensor-core forward", "B4 H16 N4096 d64 fp16",
                      (Part("forward", Work(r["flops"], r["model_bytes"], l2,
                                            smem_bytes(r["flops"], 16, math.inf, itemsize=2, stored=l2),
                                            rate="fp16 mma.sync")),),
                      r["median_ms"], f"{path.name}: {r['kernel']} (L2: the IO model at Br=128)", itemsize=2))

    # ch9: the tree reduction of P=8 partials, one launch of 20 back to back
    path, rows = _read("tree_attention.csv", R)
    r = _row(path, rows, "P=8: tree reduction, x20 (per launch)", "N=16k")
    cases.append(Case("9", "tree reduction, P = 8", "B1 Hq32 Hkv8 N16k fp16",
                      (Part("reduce", Work(r["flops"] / 20, r["model_bytes"] / 20, r["model_bytes"] / 20)),),
                      r["median_ms"], f"{path.name}: {r['kernel']}"))
    # ch10: Algorithm 1's loop order (one block a head) and the M < d^2 algorithm at d = 256;
    # DRAM and L2 bytes by Nsight. A thread a query row reads K_j and V_j by broadcast: one
    # shared word serves a warp's 32 rows (tm = 32); the small-cache products read A's word by
    # broadcast and B's a lane each (tm = 32, tn = 1).
    path, rows = _read("io_theory.csv", R)
    dpath, drows = _read("io_theory_dram.csv", R)
    for label, kernel, config, shape, dram_kernel, tm, tn in (
            ("Algorithm 1 order (kv-outer)", "Algorithm 1 order (kv-outer)", "B=1 H=16 N=4096 d=64 fp32 Br=64 Bc=64",
             "B1 H16 N4096 d64 fp32", "Algorithm 1 order (kv-outer)", 32, math.inf),
            ("M < d^2 algorithm, d = 256", "small-cache (S in HBM, b x b products)", "B=1 H=16 N=4096 d=256 fp32",
             "B1 H16 N4096 d256 fp32", "small-cache (S in HBM, b x b products) d=256", 32, 1)):
        r = _row(path, rows, kernel, config)
        x = _extra(_row(dpath, drows, dram_kernel, "B=1 H=16 N=4096"))
        cases.append(Case("10", label, shape,
                          (Part("forward", Work(r["flops"], x["dram_total_bytes"],
                                                x["l2_read_bytes"] + x["dram_write_bytes"],
                                                smem_bytes(r["flops"], tm, tn, stored=x["l2_read_bytes"]))),),
                          r["median_ms"], f"{path.name}: {r['kernel']}; bytes {dpath.name}"))
    return cases


MISSES = {   # a sentence a case: why the measured time is not the napkin's
    "copy kernel": "A Numba grid-stride copy of 4-byte elements; cudaMemcpy on the same 2 GiB reaches the HBM "
                   "figure itself (that is where the figure comes from), so the 26% is the kernel's instruction "
                   "stream, not the memory.",
    "naive attention (3 kernels)": "The softmax kernel sits on its HBM bound (1.0x); the two products, 4x4 "
                                   "micro-tiles reducing over only d = 64, take 11.9 and 12.3 ms against 5.4 ms "
                                   "each: every output tile is loaded, computed and stored in a few hundred "
                                   "cycles, and those per-tile costs are not on the napkin.",
    "matmul rung 3 (registers)": "Shared memory and the FMA units tie (2.87 and 2.70 ms) and share the issue "
                                 "slots with the address arithmetic: they do not overlap perfectly, and the "
                                 "napkin, a max, assumes they do.",
    "matmul rung 4 (mma.sync)": "Nominal L2 bandwidth, a 4-stage cp.async pipeline to fill for each tile and "
                                "mma.sync's operands through ldmatrix: cuBLAS, with larger tiles and wgmma, runs "
                                "the same product in 0.19 ms.",
    "row softmax": "Read once, written once: within 10% of the HBM copy, as a streaming kernel should be.",
    "fused forward": "Shared memory and the FMA units both need about 5.4 ms, and the softmax (max, exp, the "
                     "rescaling of O) shares the same issue slots: the fused fp32 kernels are issue-bound, not "
                     "FMA-bound, and CUTLASS's fp32 kernel (SDPA memory-efficient, 8.06 ms) stops at the same "
                     "place.",
    "backward (atomic dQ)": "Five products a tile instead of two, dQ added through L2 with float32 atomics and "
                            "254 registers a thread (one block an SM, little latency hiding): further from its "
                            "bound than the forward.",
    "block-sparse forward, kept 0.25": "Each query tile walks a list of a quarter of the key tiles, so its fixed "
                                       "costs (Q load, the list, the final rescale and store) weigh four times "
                                       "more than in the dense forward (1.53x).",
    "decode stream-k, fp32 cache": "One query against the cache: about 0.5 FLOP a byte, so HBM is the bound, and "
                                   "stream-k reaches it.",
    "decode stream-k, fp16 cache": "Half the bytes, half the time: still the HBM read bound.",
    "tensor-core forward": "The mma.sync products alone need 0.45 ms and ldmatrix's reads of K and V for every "
                           "16-row warp 0.76 ms; the rest is the softmax between the two products (exp on the "
                           "MUFU, max and rescale on the FMA pipe), which FlashAttention-2's loop does not "
                           "overlap with the tensor cores (FlashAttention-3's ping-pong does).",
    "Algorithm 1 order (kv-outer)": "One block a head: 16 blocks of 64 threads on 132 SMs, each walking the "
                                    "query tiles in turn. The napkin divides by the whole GPU's rates; this "
                                    "kernel has an eighth of the SMs and two warps on each, so latency, not a "
                                    "bandwidth, sets its pace (chapter 10, section 1).",
    "M < d^2 algorithm, d = 256": "Its bytes are right (L2 traffic 0.98x its count) but each product is one "
                                  "dependent chain a thread, two shared loads a multiply-add, in one block an SM "
                                  "with no copy overlapped: latency-bound, 4x our shared-memory estimate "
                                  "(chapter 10, section 4).",
    "tree reduction, P = 8": "150 kB is 0.05 us of bandwidth: the time is the launch and one block's latency "
                             "(~8 us back to back), which no bandwidth term sees; a napkin for tiny kernels needs "
                             "a fixed term.",
}


def prediction_table(machine: Machine | None = None, cases=None, results_dir=None) -> list[dict]:
    """One row a case: chapter, kernel, shape, predicted ms, bound, measured ms, ratio
    (measured / predicted), the level times in ms and the miss explained."""
    machine = machine or h100(results_dir)
    cases = cases if cases is not None else reference_cases(results_dir)
    out = []
    for c in cases:
        t, bound = predict_case(c, machine)
        levels = {k: sum(level_times(p.work, machine)[k] for p in c.parts) * 1e3 for k in LEVELS}
        out.append({"chapter": c.chapter, "kernel": c.kernel, "shape": c.shape, "predicted_ms": t * 1e3,
                    "bound": bound, "measured_ms": c.measured_ms, "ratio": c.measured_ms / (t * 1e3),
                    "levels_ms": levels, "miss": MISSES.get(c.kernel, ""), "source": c.source})
    return out


# --------------------------------------------------------------------------- quantization

def quantized(work: Work, itemsize: int, *, from_itemsize: int = 4, rate: str | None = None) -> Work:
    """The same kernel on ``itemsize``-byte data: every byte scaled by itemsize /
    from_itemsize; the FLOP rate is ``rate`` if the arithmetic moves (to the tensor cores),
    else unchanged (fp16 data, fp32 math keeps the FMA rate)."""
    if itemsize not in (1, 2, 4) or from_itemsize not in (1, 2, 4):
        raise ValueError(f"itemsize: expected 1, 2 or 4 bytes, got {itemsize} (from {from_itemsize})")
    s = itemsize / from_itemsize
    return replace(work, hbm=work.hbm * s, l2=work.l2 * s, smem=work.smem * s, rate=rate or work.rate)


def quantization_table(machine: Machine | None = None, cases=None, results_dir=None) -> list[dict]:
    """Each fp32 case on fp16 and fp8 data, the math where it was (bytes / 2, / 4): predicted
    ms and the gain over fp32; the bandwidth-bound kernels gain, the FLOP-bound do not."""
    machine = machine or h100(results_dir)
    cases = cases if cases is not None else reference_cases(results_dir)
    out = []
    for c in cases:
        if c.itemsize != 4 or c.chapter == "9":
            continue
        t32, b32 = predict_case(c, machine)
        row = {"chapter": c.chapter, "kernel": c.kernel, "fp32_ms": t32 * 1e3, "fp32_bound": b32}
        for name, item in (("fp16", 2), ("fp8", 1)):
            q = replace(c, parts=tuple(Part(p.name, quantized(p.work, item)) for p in c.parts), itemsize=item)
            t, b = predict_case(q, machine)
            row[f"{name}_ms"], row[f"{name}_bound"], row[f"{name}_gain"] = t * 1e3, b, t32 / t
        out.append(row)
    return out


def quantization_checks(machine: Machine | None = None, cases=None, results_dir=None) -> list[dict]:
    """The napkin's gains from smaller data beside the course's measured ones, each from the
    committed rows: decode fp32 -> fp16 cache (decode.csv); chapter 4 fed fp16, math still
    fp32 (flash_forward.csv); chapter 4 fp32 -> chapter 8 fp16 on the tensor cores."""
    machine = machine or h100(results_dir)
    cases = cases if cases is not None else reference_cases(results_dir)
    by = {c.kernel: c for c in cases}
    pred = {k: predict_case(c, machine)[0] for k, c in by.items()}
    out = []

    def add(what, predicted, measured, rows):
        out.append({"what": what, "predicted_gain": predicted, "measured_gain": measured, "rows": rows})

    a, b = by["decode stream-k, fp32 cache"], by["decode stream-k, fp16 cache"]
    add("decode: fp32 -> fp16 KV cache (HBM-bound)", pred[a.kernel] / pred[b.kernel], a.measured_ms / b.measured_ms,
        f"{a.source} | {b.source}")
    f32 = by["fused forward"]
    path, rows = _read("flash_forward.csv", results_dir)
    r = _row(path, rows, "flash fwd fp16 in (fp32 math)", "B=4 H=16 N=4096 d=64 fp16 causal=False")
    q = replace(f32, parts=tuple(Part(p.name, quantized(p.work, 2)) for p in f32.parts), itemsize=2)
    add("fused forward: fp16 data, fp32 math (FMA-bound)", pred[f32.kernel] / predict_case(q, machine)[0],
        f32.measured_ms / r["median_ms"], f"{f32.source} | {path.name}: {r['kernel']}")
    tc = by["tensor-core forward"]
    add("fused forward fp32 (ch4) -> fp16 on tensor cores (ch8)", pred[f32.kernel] / pred[tc.kernel],
        f32.measured_ms / tc.measured_ms, f"{f32.source} | {tc.source}")
    return out


# --------------------------------------------------------------------------- drawing

def fmt_bytes(n: float) -> str:
    """Bytes in binary units: 1536 -> '1.5 KiB'."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


_COLOURS = {"HBM": "#dbe9f6", "smem": "#fde8c8", "reg": "#d9f0d3", "op": "#ffffff"}


def _box(ax, x, y, w, h, text, colour, *, fontsize=10, bold=False):
    from matplotlib.patches import FancyBboxPatch

    ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.02", fc=colour, ec="black",
                                lw=1.0))
    ax.text(x, y, text, ha="center", va="center", fontsize=fontsize, fontweight="bold" if bold else "normal")


def _arrow(ax, a, b, label="", *, colour="black", offset=(0.0, 0.0), fontsize=9, rad=0.0):
    ax.annotate("", xy=b, xytext=a, arrowprops=dict(arrowstyle="-|>", color=colour, lw=1.4,
                                                    connectionstyle=f"arc3,rad={rad}"))
    if label:
        ax.text((a[0] + b[0]) / 2 + offset[0], (a[1] + b[1]) / 2 + offset[1], label, fontsize=fontsize,
                ha="center", va="center", color=colour, bbox=dict(fc="white", ec="none", pad=0.5))


def _bands(ax, labels, spans, corners):
    """Shaded horizontal bands, one a memory level, each named in a corner: "tl", "bl", "br"."""
    for (label, colour), (lo, hi), corner in zip(labels, spans, corners):
        ax.axhspan(lo, hi, color=colour, alpha=0.35, lw=0)
        top, left = corner[0] == "t", corner[1] == "l"
        ax.text(0.005 if left else 0.995, hi - 0.04 if top else lo + 0.04, label, fontsize=9, style="italic",
                va="top" if top else "bottom", ha="left" if left else "right", transform=ax.get_yaxis_transform())


def draw_standard(ax, *, n: int = 4096, d: int = 64, itemsize: int = 4):
    """Standard attention as a napkin diagram: Q, K, V, S, P, O in HBM (shapes and bytes of
    one head), the three kernels on the chip, every arrow an HBM transfer labelled with its
    bytes; the N x N arrays make the traffic 4N^2 + 4Nd elements."""
    nd, nn = n * d * itemsize, n * n * itemsize
    ax.set_xlim(0, 10.6)
    ax.set_ylim(0.2, 3.6)
    ax.axis("off")
    _bands(ax, [("HBM (80 GB, 2.95 TB/s measured)", _COLOURS["HBM"]),
                ("on chip: shared memory + registers", _COLOURS["smem"])], [(1.95, 3.55), (0.25, 1.55)], ("tl", "bl"))
    arrays = {"Q": (0.9, f"Q\n{n}x{d}\n{fmt_bytes(nd)}"), "K": (2.3, f"K\n{n}x{d}\n{fmt_bytes(nd)}"),
              "S": (4.3, f"S = QK^T\n{n}x{n}\n{fmt_bytes(nn)}"), "P": (6.5, f"P\n{n}x{n}\n{fmt_bytes(nn)}"),
              "V": (8.0, f"V\n{n}x{d}\n{fmt_bytes(nd)}"), "O": (9.6, f"O\n{n}x{d}\n{fmt_bytes(nd)}")}
    for name, (x, text) in arrays.items():
        big = name in "SP"
        _box(ax, x, 2.6, 1.5 if big else 1.05, 0.95, text, "#ffffff" if not big else "#f6d5d5", fontsize=9,
             bold=big)
    ops = {"mm1": (2.3, "matmul"), "sm": (5.4, "softmax"), "mm2": (8.0, "matmul")}
    for x, text in ops.values():
        _box(ax, x, 0.8, 1.2, 0.5, text, _COLOURS["op"], fontsize=10)
    red = "#b2182b"
    _arrow(ax, (0.9, 2.1), (2.0, 1.05), fmt_bytes(nd), offset=(-0.35, 0.0))
    _arrow(ax, (2.3, 2.1), (2.3, 1.05), fmt_bytes(nd), offset=(0.32, 0.0))
    _arrow(ax, (2.6, 1.05), (4.1, 2.1), fmt_bytes(nn), colour=red, offset=(0.1, -0.05))
    _arrow(ax, (4.5, 2.1), (5.2, 1.05), fmt_bytes(nn), colour=red, offset=(-0.1, 0.0))
    _arrow(ax, (5.7, 1.05), (6.4, 2.1), fmt_bytes(nn), colour=red, offset=(0.1, 0.0))
    _arrow(ax, (6.7, 2.1), (7.7, 1.05), fmt_bytes(nn), colour=red, offset=(0.55, 0.1))
    _arrow(ax, (8.0, 2.1), (8.0, 1.05), fmt_bytes(nd), offset=(0.32, 0.0))
    _arrow(ax, (8.3, 1.05), (9.5, 2.1), fmt_bytes(nd), offset=(0.35, -0.1))
    total = 4 * nn + 4 * nd
    ax.set_title(f"Standard attention, one head: {fmt_bytes(total)} through HBM (4N\u00b2 + 4Nd elements; "
                 f"red: the N\u00d7N arrays)", fontsize=11)
    return ax


def draw_streamed(ax, *, n: int = 4096, d: int = 64, Br: int = 256, Bc: int = 64, itemsize: int = 4):
    """The fused forward as a napkin diagram: one block holds Q_i (Br x d), streams K_j, V_j
    (Bc x d) through shared memory, keeps S_ij, the state (m, l) and O_i in registers; the
    ceil(N/Br) blocks of the Q tiles run in parallel, each reading all of K and V once.
    Arrows carry bytes a tile and a head."""
    tr, tc = -(-n // Br), -(-n // Bc)
    q_tile, kv_tile = Br * d * itemsize, Bc * d * itemsize
    ax.set_xlim(0, 10.6)
    ax.set_ylim(-0.45, 4.65)
    ax.axis("off")
    _bands(ax, [("HBM", _COLOURS["HBM"]), ("shared memory\n(227 KB a block)", _COLOURS["smem"]),
                ("registers", _COLOURS["reg"])], [(3.3, 4.6), (1.65, 2.95), (0.2, 1.45)], ("tl", "br", "bl"))
    # HBM arrays: Q in Tr tiles, K and V in Tc tiles, O and L
    _box(ax, 1.6, 3.85, 1.3, 0.8, f"Q\n{tr} tiles of\n{Br}x{d}", "#ffffff", fontsize=8)
    _box(ax, 4.0, 3.85, 2.2, 0.8, f"K, V\n{tc} tiles of {Bc}x{d} each", "#ffffff", fontsize=9)
    _box(ax, 9.3, 3.85, 1.6, 0.8, f"O ({n}x{d}),\nL ({n})", "#ffffff", fontsize=9)
    # shared memory: Q_i, K_j, V_j
    for k, dx in enumerate((0.12, 0.06, 0.0)):      # shadows: the Tr blocks in parallel
        _box(ax, 1.6 + dx, 2.3 + dx, 1.4, 0.8, "" if k < 2 else f"Q_i {Br}x{d}\n\u00d7{tr} blocks\nin parallel",
             "#ffffff", fontsize=9)
    _box(ax, 4.0, 2.2, 2.2, 0.7, f"K_j, V_j\n{Bc}x{d} each", "#ffffff", fontsize=9)
    # registers: S_ij, (m, l), O_i
    _box(ax, 4.0, 0.8, 1.6, 0.7, f"S_ij, P_ij\n{Br}x{Bc}", "#ffffff", fontsize=9)
    _box(ax, 6.1, 0.8, 1.4, 0.7, f"(m, \u2113)\n{Br} each", "#ffffff", fontsize=9, bold=True)
    _box(ax, 8.0, 0.8, 1.5, 0.7, f"O_i (acc.)\n{Br}x{d}", "#ffffff", fontsize=9)
    _arrow(ax, (1.6, 3.45), (1.6, 2.72), f"{fmt_bytes(q_tile)}\nonce", offset=(0.55, 0.0), fontsize=8)
    _arrow(ax, (4.0, 3.45), (4.0, 2.57), f"{fmt_bytes(2 * kv_tile)} a tile,\n{tc} tiles = "
           f"{fmt_bytes(2 * n * d * itemsize)}", offset=(1.5, 0.0), fontsize=8)
    _arrow(ax, (1.9, 1.88), (3.4, 1.15), "Q_i K_j\u1d40", offset=(-0.35, -0.1), fontsize=8)
    _arrow(ax, (4.0, 1.85), (4.0, 1.15), "", fontsize=8)
    _arrow(ax, (4.8, 0.8), (5.4, 0.8), "", fontsize=8)
    _arrow(ax, (6.8, 0.8), (7.25, 0.8), "rescale", offset=(0.0, 0.3), fontsize=8)
    _arrow(ax, (5.1, 1.95), (7.7, 1.15), "P_ij V_j", offset=(0.3, 0.12), fontsize=8)
    _arrow(ax, (8.6, 1.15), (9.2, 3.45), f"{fmt_bytes(Br * d * 4)}\nonce", offset=(0.5, 0.0), fontsize=8)
    ax.annotate("", xy=(4.0, 0.45), xytext=(8.0, 0.45),
                arrowprops=dict(arrowstyle="-|>", lw=1.2, connectionstyle="arc3,rad=-0.12", color="#2166ac"))
    ax.text(6.0, -0.3, f"for j = 1..{tc}: next K_j, V_j; (m, \u2113, O_i) carried", fontsize=8, ha="center",
            color="#2166ac")
    kv_total = 2 * n * d * itemsize * tr
    ax.set_title(f"Fused forward, one head: K, V stream {tr}\u00d7 = {fmt_bytes(kv_total)} L2\u2192SM; "
                 f"HBM compulsory {fmt_bytes((4 * n * d + n) * itemsize)}; no N\u00d7N array leaves the chip",
                 fontsize=10)
    return ax


def draw_predictions(ax, table: list[dict]):
    """Predicted against measured ms, one pair of bars a case (log scale), the bound named."""
    import numpy as np

    labels = [f"ch{r['chapter']} {r['kernel']}" for r in table]
    y = np.arange(len(table))
    ax.barh(y - 0.2, [r["predicted_ms"] for r in table], height=0.4, color="#92c5de", label="napkin (max of levels)")
    ax.barh(y + 0.2, [r["measured_ms"] for r in table], height=0.4, color="#f4a582", label="measured (H100)")
    for yi, r in zip(y, table):
        ax.text(max(r["predicted_ms"], r["measured_ms"]) * 1.15, yi, f"{r['ratio']:.1f}x  {r['bound']}",
                va="center", fontsize=8)
    ax.set_yticks(y, labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("ms")
    ax.legend(loc="lower right", fontsize=8)
    ax.set_xlim(right=max(r["measured_ms"] for r in table) * 40)
    return ax
