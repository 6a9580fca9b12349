"""The IO models and the measured ceilings of the course: how many bytes each attention
kernel must move between HBM and the chip, and how fast the machine can move and compute.

Every chapter counts bytes the same way, and this module is where the counting is written
down. A model counts the elements a kernel reads from or writes to HBM (global memory),
assuming nothing in between: no reuse through L2, every tile load goes to HBM. Per head
(one (batch, head) pair), with N the sequence length (Nq queries, Nk keys where they
differ), d the head dimension, Br x Bc the tiles of the fused kernels:

| kernel | HBM elements a head |
|---|---|
| standard forward (S and P through HBM) | 4Nd + 4N^2 (+2N^2 per extra elementwise pass) |
| standard backward | 7N^2 + 10Nd + N |
| fused forward, Q tile outer, no L2 reuse | 2Nd + N + 2Nd ceil(N/Br) |
| fused forward, compulsory (each input read once) | 4Nd + N |
| fused backward, K/V tile outer | 6Nd + N + ceil(N/Bc) (4Nd + 2N) |
| fused backward, compulsory | 8Nd + 3N |
| block-sparse forward, a fraction rho of the tiles kept | 2Nd + N + 2Nd ceil(N/Br) rho |

Times the bytes an element (4 for float32, 2 for float16) times B H heads gives bytes.
What the terms are:

* **Standard forward** (chapter 1): three kernels. S = scale Q K^T reads Q and K (2Nd)
  and writes S (N^2); the softmax reads S and writes P (2N^2) and the row logsumexp L
  (N); O = P V reads P and V and writes O (N^2 + 2Nd). Every further elementwise pass
  over the N x N matrix (a mask, a dropout, a scale) reads and writes it once more: 2N^2.
  The N^2 terms dominate as soon as N >> d.
* **Standard backward**: the same three products backwards with dS = P o (dP - D)
  between them, each N x N matrix (P read twice, dP written and read, dS written and read
  twice) through HBM: 7N^2; the N x d terms are dO (read twice), V, K, Q read and dQ, dK,
  dV written, plus D = rowsum(dO o O) (reads dO and O): 10Nd; D itself: N.
* **Fused forward** (chapter 4, FlashAttention with the query tile outer): Q is read once
  (Nd), O and L are written once (Nd + N); each of the ceil(N/Br) query tiles streams all
  of K and V through shared memory (2Nd each). The only term that grows faster than N is
  the K/V stream 2N^2 d / Br, smaller than the standard 4N^2 by a factor 2 Br / d. With
  causal masking a query tile skips the key tiles above the diagonal: about half.
* **Compulsory**: every input read once, every output written once; no kernel can do
  less. The fused forward reaches it when one query tile covers all of N (Br >= N).
* **Fused backward** (chapter 5, K/V tile outer): K and V are read and dK, dV written once
  (4Nd); dO and O are read once to form D (2Nd + N); each of the ceil(N/Bc) key tiles
  streams Q, dO (2Nd), L and D (2N) and reads and writes its share of dQ (2Nd). Our
  kernels add what this row leaves out: the pass that clears dQ (Nd) with atomic dQ, or,
  with a separate dQ kernel, that kernel's own K/V stream (2Nd ceil(N/Br)).
* **Fused backward, compulsory**: Q, K, V, O, dO read, dQ, dK, dV written (8Nd); L read,
  D written and read (3N).
* **Block-sparse forward** (chapter 6): the fused forward in which a query tile reads K and
  V only for the tiles the block mask keeps, so the stream is scaled by the kept fraction
  rho; Q, O and L do not shrink.

**The bound.** FlashAttention's Theorem 2 (Dao et al., 2022): with on-chip memory of M
elements, the fused forward makes Theta(N^2 d^2 / M) HBM accesses (the tiles are about
M / 4d rows, so the K/V stream 2N^2 d / Br is about 8 N^2 d^2 / M), against
Theta(Nd + N^2) for the standard one. Saha and Ye (ICML 2024) prove this optimal: for
M >= d^2 no algorithm that computes attention exactly does asymptotically fewer accesses.

**Bound by what.** Against the K/V stream a fused kernel does 4 Br d FLOPs for every K/V
row (2d elements) it loads: an arithmetic intensity of about 2 Br / (bytes an element)
FLOP per byte (32 for fp32 at Br = 64). The machine's ridge point is its FLOP/s divided
by its bandwidth, both measured by the course's bench and committed in
``workbook/results`` (``ceilings()``, ``ridge_point()``); a kernel above the ridge is
bound by arithmetic (and shared-memory traffic), below it by HBM. The standard path's
softmax does a handful of FLOPs per element it moves: far below, whatever the GPU.

The functions below take the shapes the chapters take (Nq != Nk, causal where a chapter
supports it) and return elements a head (``*_elements``) or bytes for B x H heads
(``*_bytes``); the chapter modules' ``io_model_bytes`` are these, with their own argument
names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parents[2] / "workbook" / "results"
DQ_MODES = ("atomic", "separate")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --------------------------------------------------------------------------- standard (chapter 1)

def standard_forward_elements(nq: int, nk: int, d: int, *, extra_passes: int = 0) -> dict:
    """Elements each kernel of the standard forward reads + writes, a head.

    ``scores``: Q, K read, S written; ``row_softmax``: S read, P and L written;
    ``weighted_sum``: P, V read, O written. With Nq = Nk = N they sum to 4Nd + 4N^2 + N.
    ``extra_passes`` elementwise passes over the Nq x Nk matrix add ``elementwise``
    (2 Nq Nk each: read it, write it).
    """
    elements = {
        "scores": nq * d + nk * d + nq * nk,          # read Q, K; write S
        "row_softmax": 2 * nq * nk + nq,              # read S; write P and L
        "weighted_sum": nq * nk + nk * d + nq * d,    # read P, V; write O
    }
    if extra_passes:
        elements["elementwise"] = 2 * nq * nk * extra_passes
    return elements


def standard_forward_bytes(B: int, H: int, nq: int, nk: int, d: int, *, itemsize: int = 4,
                           extra_passes: int = 0) -> dict:
    """HBM bytes of each standard-forward kernel for B x H heads, and their ``"total"``."""
    per = {k: v * B * H * itemsize
           for k, v in standard_forward_elements(nq, nk, d, extra_passes=extra_passes).items()}
    per["total"] = sum(per.values())
    return per


def standard_backward_elements(n: int, d: int) -> int:
    """Elements the standard (unfused) backward moves, a head: 7N^2 + 10Nd + N."""
    return 7 * n * n + 10 * n * d + n


def standard_backward_bytes(B: int, H: int, n: int, d: int, *, itemsize: int = 4) -> float:
    """HBM bytes of the standard backward for B x H heads of length N."""
    return float(standard_backward_elements(n, d)) * B * H * itemsize


# --------------------------------------------------------------------------- fused forward (chapter 4)

def kv_rows_read(nq: int, nk: int, *, Br: int, Bc: int = 64, causal: bool = False) -> int:
    """K (and V) rows the ceil(Nq/Br) query tiles of one head read from HBM.

    Without masking every tile reads all Nk rows. Causal (query i sees key j iff
    j <= i + Nk - Nq): a tile stops after the key tile holding its last visible key,
    so it reads whole Bc-tiles up to there (never more than Nk rows)."""
    rows = 0
    for q0 in range(0, nq, Br):
        kv_end = min(nk, q0 + Br + nk - nq) if causal else nk
        rows += min(nk, _cdiv(max(kv_end, 0), Bc) * Bc)
    return rows


def fused_forward_elements(nq: int, nk: int, d: int, *, Br: int, Bc: int = 64, causal: bool = False) -> int:
    """Elements the fused forward moves, a head: Q read (Nq d), O written (Nq d), L written
    (Nq), K and V read by every query tile (2 d ``kv_rows_read``); 2Nd + N + 2Nd ceil(N/Br)
    without masking."""
    return 2 * nq * d + nq + 2 * d * kv_rows_read(nq, nk, Br=Br, Bc=Bc, causal=causal)


def fused_forward_bytes(B: int, H: int, nq: int, nk: int, d: int, *, Br: int, Bc: int = 64,
                        causal: bool = False, itemsize: int = 4) -> int:
    """HBM bytes of the fused forward for B x H heads. Q, K, V are ``itemsize`` bytes an
    element (4 for float32, 2 for float16); O and L are written as float32."""
    kv = kv_rows_read(nq, nk, Br=Br, Bc=Bc, causal=causal)
    per_head = nq * d * itemsize + nq * d * 4 + nq * 4 + 2 * kv * d * itemsize
    return B * H * per_head


def compulsory_forward_elements(nq: int, nk: int, d: int) -> int:
    """Each input read once and each output written once, a head: Q, O (2 Nq d), K, V
    (2 Nk d), L (Nq); 4Nd + N."""
    return 2 * nq * d + 2 * nk * d + nq


def compulsory_forward_bytes(B: int, H: int, nq: int, nk: int, d: int, *, itemsize: int = 4) -> int:
    """Compulsory forward bytes for B x H heads (inputs ``itemsize`` bytes, O and L float32):
    what ``fused_forward_bytes`` comes down to when one query tile covers Nq."""
    return B * H * ((nq + 2 * nk) * d * itemsize + nq * d * 4 + nq * 4)


# --------------------------------------------------------------------------- fused backward (chapter 5)

def fused_backward_elements(nq: int, nk: int, d: int, *, Bc: int, Br: int | None = None,
                            dq_mode: str = "atomic", causal: bool = False, kept: float | None = None) -> float:
    """Elements chapter 5's three kernels move, a head.

    D = rowsum(dO o O): reads O, dO, writes D (2 Nq d + Nq). dK/dV, K/V tile outer: reads
    K, V once and writes dK, dV (4 Nk d); each of its ceil(Nk/Bc) key tiles streams Q, dO,
    L, D (2 Nq d + 2 Nq). dQ, ``"atomic"``: each key tile reads and writes dQ (2 Nq d) and
    a pre-pass clears it (Nq d); ``"separate"``: a dQ kernel reads Q, dO, L, D once and
    writes dQ (3 Nq d + 2 Nq), and each of its ceil(Nq/Br) query tiles streams K, V
    (2 Nk d). ``kept``: the fraction of the tiles the kernels visit, which scales the
    streams (default: 1/2 causal, 1 otherwise; a block mask's kept fraction). With
    Nq = Nk = N, atomic dQ is the table's 6Nd + N + ceil(N/Bc)(4Nd + 2N) plus the Nd of the
    clearing pass.
    """
    if dq_mode not in DQ_MODES:
        raise ValueError(f"dq_mode: expected one of {DQ_MODES}, got {dq_mode!r}")
    half = (0.5 if causal else 1.0) if kept is None else kept
    tc = _cdiv(nk, Bc)
    elems = 2 * nq * d + nq + 4 * nk * d + half * tc * (2 * nq * d + 2 * nq)
    if dq_mode == "atomic":
        return elems + nq * d + half * tc * 2 * nq * d
    if Br is None:
        raise ValueError("Br: the separate dQ kernel's query tile is needed with dq_mode='separate'")
    return elems + 3 * nq * d + 2 * nq + half * _cdiv(nq, Br) * 2 * nk * d


def fused_backward_bytes(B: int, H: int, nq: int, nk: int, d: int, *, Bc: int, Br: int | None = None,
                         dq_mode: str = "atomic", causal: bool = False, itemsize: int = 4,
                         kept: float | None = None) -> float:
    """HBM bytes of chapter 5's backward for B x H heads (``fused_backward_elements``)."""
    return float(fused_backward_elements(nq, nk, d, Bc=Bc, Br=Br, dq_mode=dq_mode, causal=causal, kept=kept)) \
        * B * H * itemsize


def compulsory_backward_elements(nq: int, nk: int, d: int) -> int:
    """Q, O, dO read and dQ written (4 Nq d); K, V read and dK, dV written (4 Nk d); L read,
    D written and read (3 Nq): 8Nd + 3N a head."""
    return 4 * nq * d + 4 * nk * d + 3 * nq


def compulsory_backward_bytes(B: int, H: int, nq: int, nk: int, d: int, *, itemsize: int = 4) -> int:
    return compulsory_backward_elements(nq, nk, d) * B * H * itemsize


# --------------------------------------------------------------------------- block-sparse (chapter 6)

def block_sparse_forward_bytes(B: int, H: int, nq: int, nk: int, d: int, *, Br: int, rho: float,
                               itemsize: int = 4) -> float:
    """HBM bytes of the block-sparse forward, B x H heads: per head Q read and O written
    (2 Nq d), L written (Nq), and K, V read for every kept tile: 2 Nk d ceil(Nq/Br) rho, rho
    the kept fraction of the Tr x Tc tiles (which also accounts for causal masking). All
    ``itemsize`` bytes an element. At rho = 1 it is the dense ``fused_forward_bytes``."""
    return float(B * H * itemsize * (2 * nq * d + nq + 2 * nk * d * _cdiv(nq, Br) * rho))


def block_sparse_backward_bytes(B: int, H: int, nq: int, nk: int, d: int, *, Br: int, Bc: int, rho: float,
                                itemsize: int = 4, dq_mode: str = "atomic") -> float:
    """HBM bytes of chapter 6's backward, B x H heads: chapter 5's kernels walking the kept
    tiles, so chapter 5's model with its streams over the kept fraction ``rho`` of the tiles
    (``fused_backward_bytes(..., kept=rho)``; Bc the dK/dV kernel's key tile, Br the
    separate dQ kernel's query tile). At rho = 1 it is the dense model."""
    return fused_backward_bytes(B, H, nq, nk, d, Bc=Bc, Br=Br, dq_mode=dq_mode, itemsize=itemsize, kept=rho)


# --------------------------------------------------------------------------- the table, bound, intensity

def elements_per_head(n: int, d: int, *, Br: int, Bc: int = 64, rho: float = 1.0) -> dict:
    """The table above at Nq = Nk = N, non-causal: {row: elements a head}."""
    return {
        "standard forward": sum(standard_forward_elements(n, n, d).values()),
        "standard backward": standard_backward_elements(n, d),
        "fused forward": fused_forward_elements(n, n, d, Br=Br, Bc=Bc),
        "fused forward, compulsory": compulsory_forward_elements(n, n, d),
        "fused backward (atomic dQ)": fused_backward_elements(n, n, d, Bc=Bc),
        "fused backward, compulsory": compulsory_backward_elements(n, n, d),
        "block-sparse forward": block_sparse_forward_bytes(1, 1, n, n, d, Br=Br, rho=rho, itemsize=1),
    }


def theorem2_accesses(n: int, d: int, m: int) -> float:
    """N^2 d^2 / M: the order of the fused forward's HBM accesses with M elements of on-chip
    memory (FlashAttention, Theorem 2), optimal for M >= d^2 (Saha and Ye, 2024)."""
    return n * n * d * d / m


def kv_intensity(Br: int, *, itemsize: int = 4) -> float:
    """FLOP per byte of the K/V stream of a fused kernel with Br query rows a tile: each K/V
    row (2d elements) feeds 4 Br d FLOPs (S and P V), so 2 Br / itemsize."""
    return 2 * Br / itemsize


# --------------------------------------------------------------------------- the measured ceilings

@dataclass(frozen=True)
class Ceilings:
    """The ceilings the course measured, quoted from the committed results.

    ``fp32_tflops``: cuBLAS fp32 matmul 8192^3, TF32 off (the FMA ceiling; gpu_basics.csv).
    ``fp32_tflops_4096``: cuBLAS fp32 4096^3 (tiled_matmul.csv, chapter 2's peer).
    ``memcpy_gbps``: cudaMemcpy device to device on the largest buffer, bytes read +
    written a second (the HBM bandwidth). ``copy_kernel_gbps``: the best Numba copy kernel
    of chapter 0. ``device``, ``driver``, ``date``: from gpu_basics.csv's header.
    """
    device: str
    driver: str
    date: str
    fp32_tflops: float
    fp32_tflops_4096: float
    memcpy_gbps: float
    copy_kernel_gbps: float
    sources: tuple

    @property
    def hbm_tbs(self) -> float:
        return self.memcpy_gbps / 1e3


def _read(path):
    from kernels.bench.harness import read_csv

    if not path.exists():
        raise FileNotFoundError(f"{path}: no committed results (run `python -m kernels` on a GPU)")
    return read_csv(path)


def _pick(rows, path, what, keep, key):
    chosen = [r for r in rows if keep(r)]
    if not chosen:
        raise ValueError(f"{path.name}: no row for {what}")
    return max(chosen, key=key)


def ceilings(results_dir=None) -> Ceilings:
    """The measured ceilings from ``workbook/results`` (or ``results_dir``): gpu_basics.csv
    (device copy, cudaMemcpy, cuBLAS fp32 8192^3) and tiled_matmul.csv (cuBLAS 4096^3)."""
    folder = Path(results_dir) if results_dir is not None else RESULTS_DIR
    basics, matmul = folder / "gpu_basics.csv", folder / "tiled_matmul.csv"
    env, rows = _read(basics)
    sgemm = _pick(rows, basics, "cuBLAS fp32 8192^3", lambda r: "cuBLAS" in r["kernel"] and "8192" in r["config"],
                  lambda r: r["flops"])
    memcpy = _pick(rows, basics, "cudaMemcpy D2D", lambda r: "cudaMemcpy" in r["kernel"],
                   lambda r: r["model_bytes"])
    copy = _pick(rows, basics, "the copy kernel", lambda r: r["kernel"].startswith("copy kernel"),
                 lambda r: r["gbps"])
    _, mrows = _read(matmul)
    sgemm4k = _pick(mrows, matmul, "cuBLAS fp32 4096^3",
                    lambda r: r["kernel"].startswith("peer: cuBLAS") and r["config"].startswith("M=4096 N=4096 K=4096"),
                    lambda r: r["tflops"])
    return Ceilings(env.get("device", "?"), env.get("driver", "?"), env.get("date (UTC)", "?"),
                    sgemm["tflops"], sgemm4k["tflops"], memcpy["gbps"], copy["gbps"],
                    (str(basics), str(matmul)))


def ridge_point(c: Ceilings | None = None, *, results_dir=None) -> float:
    """FLOP per HBM byte at which fp32 arithmetic and HBM take equal time: the cuBLAS fp32
    FLOP/s over the cudaMemcpy bandwidth, both measured (``ceilings()``)."""
    c = c if c is not None else ceilings(results_dir)
    value = c.fp32_tflops * 1e12 / (c.memcpy_gbps * 1e9)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"ridge point: ceilings {c.fp32_tflops} TFLOP/s, {c.memcpy_gbps} GB/s")
    return value
