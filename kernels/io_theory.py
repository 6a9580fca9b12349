"""The IO complexity of attention in terms of the on-chip memory M, and what the H100 measured.

``kernels.base.io_model`` counts the HBM bytes of the course's own kernels. This module
reads the papers: it counts the HBM accesses (elements read or written) of the algorithms
as written, with the on-chip memory M (in elements) as the parameter, next to the bounds.
Notation of [1]: N the sequence length, d the head dimension, M the elements the chip
holds, Br x Bc the tiles, Tr = ceil(N/Br), Tc = ceil(N/Bc), l and m the row sum and max.

1. **The algorithms, counted exactly.** [1] Algorithm 1 picks its tiles from M,
   Bc = ceil(M/4d), Br = min(ceil(M/4d), d) (``tiles_from_m``), and loops K/V tile outer,
   query tile inner: each of the Tc passes reads Q, O, l, m and writes O, l, m back
   (``fa1_forward_accesses``: 3Nd + 2N + Tc (3Nd + 4N), O written Tc + 1 times).
   [4] Algorithm 1 loops query tile outer: K and V are read Tr times, Q once, O and L
   written once (``fa2_forward_accesses``: 2Nd + N + 2Nd Tr, ``io_model``'s fused forward).
   [1] Algorithm 4 (the backward, K/V outer) reads Q, O, dO, dQ, l, m and writes dQ every
   pass (``fa1_backward_accesses``: 7Nd + Tc (5Nd + 2N)). Each count is checked against
   the loop itself run in NumPy with every HBM read and write counted
   (``simulate_fa1_forward``, ``simulate_fa2_forward``, ``simulate_fa1_backward``);
   ``kernels/kv_outer_forward.py`` is Algorithm 1's order as a GPU kernel.
2. **The orders.** [1] Theorem 2: standard attention Theta(Nd + N^2), FlashAttention
   Theta(N^2 d^2 / M) for d <= M <= Nd (Tc = ceil(N / ceil(M/4d)) ~ 4Nd / M passes of
   3Nd). Theorem 5: the backward, the same order. Proposition 4: block-sparse with a
   fraction s of the blocks kept, Theta(Nd + N^2 d^2 s / M).
3. **The lower bounds.** [1] Proposition 3: no exact algorithm does o(N^2 d^2 / M)
   accesses for *all* M in [d, Nd] (at M = Nd the Nd inputs must be read: a bound at one
   end of the range only). Saha and Ye [5] close it: for M >= d^2, Theta(N^2 d^2 / M) is
   tight (FlashAttention is optimal); for M < d^2 the optimum is Theta(N^2 d / sqrt(M)),
   the IO of the matrix products QK^T and PV themselves (Hong and Kung 1981: an n x k by
   k x m product with M words on chip needs Theta(nkm / sqrt(M)) accesses). Their
   algorithm for that regime needs no fusion: it writes S to HBM, which costs
   N^2 <= N^2 d / sqrt(M) once sqrt(M) < d, and tiles both products in sqrt(M) x sqrt(M)
   blocks (``small_cache_accesses``, ``simulate_small_cache``). At M = d^2 the two
   orders meet (both N^2): ``optimal_order`` is continuous there.
4. **The H100.** 227 KB of shared memory a block is 58,112 fp32 elements: d = 256 in fp32
   has d^2 = 65,536 > M, so the M < d^2 regime exists on real hardware; in fp16 (116,224
   elements) it does not (``h100_regime``).
5. **What was measured.** Nsight Compute's DRAM bytes and L2-to-SM bytes of the course's
   kernels (workbook/results/*_dram.csv) beside the models (``measured_vs_model``,
   ``m_sweep``): HBM bytes stay compulsory, because the 50 MB L2 absorbs the re-reads,
   while the bytes the SMs read from L2 follow N^2 d / Br. In practice the "M" of the
   theorem is the L2 for the HBM traffic and the shared memory for the L2 traffic.

Counts are elements a head, as in ``io_model``; times bytes an element times heads gives
bytes.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from kernels.base import io_model as io

__all__ = ["tiles_from_m", "fa2_tiles_from_m", "fa1_on_chip_elements", "fa1_forward_accesses",
           "fa2_forward_accesses", "fa1_backward_accesses", "small_cache_tile", "small_cache_accesses",
           "standard_order", "theorem2_order", "theorem5_order", "proposition4_order", "hong_kung_matmul",
           "small_cache_order", "optimal_order", "crossover_m", "regime", "h100_regime",
           "H100_SHARED_BYTES", "HBM", "simulate_fa1_forward", "simulate_fa2_forward",
           "simulate_fa1_backward", "simulate_small_cache", "read_dram", "chapter_rows", "m_sweep",
           "measured_vs_model"]

H100_SHARED_BYTES = 227 * 1024      # shared memory one block may opt in to on an H100


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check_pos(**kw):
    for name, value in kw.items():
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
        if value < 1:
            raise ValueError(f"{name}: expected >= 1, got {value}")


# --------------------------------------------------------------------------- tiles from M

def tiles_from_m(d: int, M: int) -> tuple[int, int]:
    """(Br, Bc) of [1] Algorithm 1, line 1: Bc = ceil(M/4d), Br = min(ceil(M/4d), d).

    Kj, Vj, Qi, Oi take 2 Bc d + 2 Br d <= M (+ 4d for the ceilings) and Br <= d keeps the
    Br x Bc tile of S within M/4 (+ d): O(M) in all (``fa1_on_chip_elements``)."""
    _check_pos(d=d, M=M)
    b = _cdiv(M, 4 * d)
    return min(b, d), b


def fa2_tiles_from_m(d: int, M: int) -> tuple[int, int]:
    """(Br, Bc) for the query-outer order of [4]: the mirror of ``tiles_from_m``,
    Br = ceil(M/4d), Bc = min(ceil(M/4d), d). [4] fixes its tiles (64, 128) by hand; the
    passes over K and V are Tr, so the large tile goes to the queries (our choice)."""
    Br, Bc = tiles_from_m(d, M)
    return Bc, Br


def fa1_on_chip_elements(d: int, Br: int, Bc: int) -> int:
    """Elements [1] Algorithm 1 holds on chip at once: Kj, Vj (2 Bc d), Qi, Oi (2 Br d),
    li, mi (2 Br), Sij / Pij (Br Bc), the tile's row max and sum (2 Br)."""
    _check_pos(d=d, Br=Br, Bc=Bc)
    return 2 * Bc * d + 2 * Br * d + 4 * Br + Br * Bc


# --------------------------------------------------------------------------- exact counts

def _counts(reads: int, writes: int, **parts) -> dict:
    return {"reads": reads, "writes": writes, "total": reads + writes, **parts}


def fa1_forward_accesses(n: int, d: int, *, Br: int, Bc: int) -> dict:
    """HBM elements [1] Algorithm 1 reads and writes, one head, exactly (N need not be a
    multiple of the tiles).

    Line 2 writes O = 0, l = 0, m = -inf (Nd + 2N). Line 6 loads each Kj, Vj once (2Nd).
    Every one of the Tc outer iterations runs over all Tr query tiles: line 8 loads Qi,
    Oi, li, mi (2Nd + 2N), lines 12-13 write Oi, li, mi back (Nd + 2N). Reads
    2Nd + Tc (2Nd + 2N), writes Nd + 2N + Tc (Nd + 2N); ``"O_writes"``: (Tc + 1) Nd."""
    _check_pos(n=n, d=d, Br=Br, Bc=Bc)
    tc = _cdiv(n, Bc)
    reads = 2 * n * d + tc * (2 * n * d + 2 * n)
    writes = n * d + 2 * n + tc * (n * d + 2 * n)
    return _counts(reads, writes, O_writes=(tc + 1) * n * d, passes=tc)


def fa2_forward_accesses(n: int, d: int, *, Br: int, Bc: int) -> dict:
    """HBM elements [4] Algorithm 1 reads and writes, one head: Q once (Nd), Kj and Vj
    once for each of the Tr query tiles (2Nd Tr), O and L written once (Nd + N); the
    total is ``io_model.fused_forward_elements`` (non-causal)."""
    _check_pos(n=n, d=d, Br=Br, Bc=Bc)
    tr = _cdiv(n, Br)
    reads = n * d + 2 * n * d * tr
    writes = n * d + n
    assert reads + writes == io.fused_forward_elements(n, n, d, Br=Br, Bc=Bc)
    return _counts(reads, writes, O_writes=n * d, passes=tr)


def fa1_backward_accesses(n: int, d: int, *, Br: int, Bc: int) -> dict:
    """HBM elements [1] Algorithm 4 (the backward, no dropout) reads and writes, one head.

    Line 5 writes dQ = dK = dV = 0 (3Nd); each Kj, Vj is loaded once (2Nd) and dKj, dVj
    written once (2Nd); each of the Tc passes loads Qi, Oi, dOi, dQi, li, mi (4Nd + 2N)
    and writes dQi back (Nd): 7Nd + Tc (5Nd + 2N) in all. Theorem 5's Theta(N^2 d^2 / M)."""
    _check_pos(n=n, d=d, Br=Br, Bc=Bc)
    tc = _cdiv(n, Bc)
    reads = 2 * n * d + tc * (4 * n * d + 2 * n)
    writes = 3 * n * d + 2 * n * d + tc * n * d
    return _counts(reads, writes, passes=tc)


def small_cache_tile(M: int) -> int:
    """b, the side of the square blocks of ``small_cache_accesses``: the largest b with
    3b^2 + b <= M (an output block, one block of each factor, a slice of L)."""
    _check_pos(M=M)
    if M < 4:
        raise ValueError(f"M: the small-cache algorithm needs M >= 4 elements, got {M}")
    b = math.isqrt(M // 3)
    while 3 * b * b + b > M:
        b -= 1
    return b


def small_cache_accesses(n: int, d: int, M: int) -> dict:
    """HBM elements of the unfused algorithm for M < d^2 ([5]), one head, exactly.

    b = ``small_cache_tile(M)``, T = ceil(N/b), Td = ceil(d/b).
    (1) S = scale Q K^T by b x b output blocks, the d sum in chunks of b: 2Nd T reads,
        N^2 writes (Hong and Kung's blocking).
    (2) L = rowsum logsumexp of S, a row block at a time: N^2 reads, N writes.
    (3) O = exp(S - L) V by b x min(b, d) output blocks, the N sum in chunks of b:
        S read Td times (N^2 Td), V read T times (Nd T), L (N Td); O written (Nd).
    About 3N^2 d / b + N^2 Td + 2N^2 = Theta(N^2 d / sqrt(M)) while sqrt(M) < d."""
    _check_pos(n=n, d=d, M=M)
    b = small_cache_tile(M)
    t, td = _cdiv(n, b), _cdiv(d, b)
    reads = 2 * n * d * t + n * n + (n * n * td + n * d * t + n * td)
    writes = n * n + n + n * d
    return _counts(reads, writes, tile=b)


# --------------------------------------------------------------------------- the orders and bounds

def standard_order(n: int, d: int) -> float:
    """[1] Theorem 2, standard attention: Theta(Nd + N^2) (S and P through HBM)."""
    return float(n * d + n * n)


def theorem2_order(n: int, d: int, M: float) -> float:
    """[1] Theorem 2, FlashAttention: Theta(N^2 d^2 / M), for d <= M <= Nd
    (``io_model.theorem2_accesses``)."""
    return io.theorem2_accesses(n, d, M)


def theorem5_order(n: int, d: int, M: float) -> float:
    """[1] Theorem 5, the FlashAttention backward: Theta(N^2 d^2 / M) as well."""
    return io.theorem2_accesses(n, d, M)


def proposition4_order(n: int, d: int, M: float, s: float) -> float:
    """[1] Proposition 4, block-sparse FlashAttention with a fraction s of the blocks
    kept: Theta(Nd + N^2 d^2 s / M)."""
    if not 0 <= s <= 1:
        raise ValueError(f"s: expected the kept fraction in [0, 1], got {s}")
    return n * d + io.theorem2_accesses(n, d, M) * s


def hong_kung_matmul(n: int, k: int, m: int, M: float) -> float:
    """Theta(n k m / sqrt(M)): the IO of an (n x k) (k x m) product with M words on chip
    (Hong and Kung 1981; the red-blue pebble game), the standard (non-Strassen) algorithm."""
    return n * k * m / math.sqrt(M)


def small_cache_order(n: int, d: int, M: float) -> float:
    """[5], M < d^2: Theta(N^2 d / sqrt(M)), the order of QK^T itself (``hong_kung_matmul``)."""
    return hong_kung_matmul(n, d, n, M)


def crossover_m(d: int) -> int:
    """M = d^2, where [5]'s two regimes meet: N^2 d^2 / M = N^2 d / sqrt(M) = N^2."""
    return d * d


def optimal_order(n: int, d: int, M: float) -> float:
    """The tight IO complexity of exact attention [5], up to constants: N^2 d^2 / M for
    M >= d^2, N^2 d / sqrt(M) for M < d^2, i.e. the smaller of the two (they cross at
    M = d^2); never below reading the input, Nd ([1] Proposition 3 at M = Nd)."""
    return max(n * d, min(theorem2_order(n, d, M), small_cache_order(n, d, M)))


def regime(d: int, M: int) -> str:
    """Which of [5]'s regimes M elements of on-chip memory put head dim d in."""
    _check_pos(d=d, M=M)
    return "M >= d^2: FlashAttention optimal" if M >= crossover_m(d) else "M < d^2: small cache"


def h100_regime(d: int, itemsize: int, *, shared_bytes: int = H100_SHARED_BYTES) -> dict:
    """M = a block's shared memory in elements of ``itemsize`` bytes, d^2, the regime and
    the factor d / sqrt(M) by which the small-cache order undercuts Theorem 2's (< 1:
    it does not)."""
    _check_pos(d=d, itemsize=itemsize, shared_bytes=shared_bytes)
    M = shared_bytes // itemsize
    return {"d": d, "itemsize": itemsize, "M": M, "d2": d * d, "regime": regime(d, M),
            "gain": d / math.sqrt(M)}


# --------------------------------------------------------------------------- the loops, counted

class HBM:
    """Arrays in "HBM" whose every element read or written is counted, per array.

    ``load(name, rows)`` returns a copy of those rows (what lands on chip) and
    ``store(name, rows, tile)`` writes a tile back; ``reads``, ``writes`` map each name to
    its element count."""

    def __init__(self, **arrays):
        self.arrays = {k: np.array(v, dtype=np.float64) for k, v in arrays.items()}
        self.reads = dict.fromkeys(self.arrays, 0)
        self.writes = dict.fromkeys(self.arrays, 0)

    def new(self, name, shape, fill):
        self.arrays[name] = np.full(shape, fill, dtype=np.float64)
        self.reads.setdefault(name, 0)
        self.writes[name] = self.writes.get(name, 0) + self.arrays[name].size    # written in HBM

    def load(self, name, idx=slice(None)):
        tile = self.arrays[name][idx].copy()
        self.reads[name] += tile.size
        return tile

    def store(self, name, idx, tile):
        self.arrays[name][idx] = tile
        self.writes[name] += np.asarray(tile).size

    def counts(self) -> dict:
        r, w = sum(self.reads.values()), sum(self.writes.values())
        return _counts(r, w, per_array={k: (self.reads[k], self.writes[k]) for k in self.arrays})


def _tiles(n, b):
    return [slice(s, min(s + b, n)) for s in range(0, n, b)]


def simulate_fa1_forward(q, k, v, *, Br: int, Bc: int, scale=None):
    """[1] Algorithm 1 line by line on one head (q, k, v: (N, d)); returns (O, l, m, HBM)."""
    n, d = q.shape
    scale = 1 / math.sqrt(d) if scale is None else scale
    hbm = HBM(Q=q, K=k, V=v)
    hbm.new("O", (n, d), 0.0)                                           # line 2
    hbm.new("l", n, 0.0)
    hbm.new("m", n, -np.inf)
    for cj in _tiles(n, Bc):                                            # line 5
        Kj, Vj = hbm.load("K", cj), hbm.load("V", cj)                   # line 6
        for ri in _tiles(n, Br):                                        # line 7
            Qi, Oi = hbm.load("Q", ri), hbm.load("O", ri)               # line 8
            li, mi = hbm.load("l", ri), hbm.load("m", ri)
            S = scale * Qi @ Kj.T                                       # line 9
            m_t = S.max(axis=1)                                         # line 10
            P = np.exp(S - m_t[:, None])
            l_t = P.sum(axis=1)
            m_new = np.maximum(mi, m_t)                                 # line 11
            l_new = np.exp(mi - m_new) * li + np.exp(m_t - m_new) * l_t
            Oi = ((li * np.exp(mi - m_new))[:, None] * Oi + np.exp(m_t - m_new)[:, None] * (P @ Vj)) / l_new[:, None]
            hbm.store("O", ri, Oi)                                      # line 12
            hbm.store("l", ri, l_new)                                   # line 13
            hbm.store("m", ri, m_new)
    return hbm.arrays["O"], hbm.arrays["l"], hbm.arrays["m"], hbm


def simulate_fa2_forward(q, k, v, *, Br: int, Bc: int, scale=None):
    """[4] Algorithm 1 line by line on one head; returns (O, L, HBM)."""
    n, d = q.shape
    scale = 1 / math.sqrt(d) if scale is None else scale
    hbm = HBM(Q=q, K=k, V=v, O=np.zeros((n, d)), L=np.zeros(n))
    for ri in _tiles(n, Br):                                            # line 3
        Qi = hbm.load("Q", ri)                                          # line 4
        rows = Qi.shape[0]
        Oi, li, mi = np.zeros((rows, d)), np.zeros(rows), np.full(rows, -np.inf)   # line 5, on chip
        for cj in _tiles(n, Bc):                                        # line 6
            Kj, Vj = hbm.load("K", cj), hbm.load("V", cj)               # line 7
            S = scale * Qi @ Kj.T                                       # line 8
            m_new = np.maximum(mi, S.max(axis=1))                       # line 9
            P = np.exp(S - m_new[:, None])
            li = np.exp(mi - m_new) * li + P.sum(axis=1)
            Oi = np.exp(mi - m_new)[:, None] * Oi + P @ Vj
            mi = m_new
        hbm.store("O", ri, Oi / li[:, None])                            # lines 11, 13
        hbm.store("L", ri, mi + np.log(li))                             # lines 12, 14
    return hbm.arrays["O"], hbm.arrays["L"], hbm


def simulate_fa1_backward(q, k, v, o, l, m, do, *, Br: int, Bc: int, scale=None):
    """[1] Algorithm 4 (no dropout, no mask) line by line on one head, with the l and m of
    the forward; returns (dQ, dK, dV, HBM)."""
    n, d = q.shape
    scale = 1 / math.sqrt(d) if scale is None else scale
    hbm = HBM(Q=q, K=k, V=v, O=o, dO=do, l=l, m=m)
    for name in ("dQ", "dK", "dV"):
        hbm.new(name, (n, d), 0.0)                                      # line 5
    for cj in _tiles(n, Bc):                                            # line 6
        Kj, Vj = hbm.load("K", cj), hbm.load("V", cj)                   # line 7
        dKj, dVj = np.zeros_like(Kj), np.zeros_like(Vj)                 # line 8, on chip
        for ri in _tiles(n, Br):                                        # line 9
            Qi, Oi, dOi, dQi = (hbm.load(x, ri) for x in ("Q", "O", "dO", "dQ"))   # line 10
            li, mi = hbm.load("l", ri), hbm.load("m", ri)
            S = scale * Qi @ Kj.T                                       # line 11
            P = np.exp(S - mi[:, None]) / li[:, None]                   # line 13
            dVj += P.T @ dOi                                            # line 16
            dP = dOi @ Vj.T                                             # line 17
            Di = (dOi * Oi).sum(axis=1)                                 # line 19
            dS = P * (dP - Di[:, None])                                 # line 20
            hbm.store("dQ", ri, dQi + scale * dS @ Kj)                  # line 21
            dKj += scale * dS.T @ Qi                                    # line 22
        hbm.store("dK", cj, dKj)                                        # line 24
        hbm.store("dV", cj, dVj)
    return hbm.arrays["dQ"], hbm.arrays["dK"], hbm.arrays["dV"], hbm


def simulate_small_cache(q, k, v, *, M: int, scale=None):
    """The M < d^2 algorithm of ``small_cache_accesses`` on one head; returns (O, L, HBM)."""
    n, d = q.shape
    scale = 1 / math.sqrt(d) if scale is None else scale
    b = small_cache_tile(M)
    hbm = HBM(Q=q, K=k, V=v, S=np.zeros((n, n)), L=np.zeros(n), O=np.zeros((n, d)))
    rows, dcols = _tiles(n, b), _tiles(d, b)
    for ri in rows:                                      # (1) S = scale Q K^T, b x b blocks
        for cj in rows:
            acc = 0.0
            for ck in dcols:
                acc = acc + hbm.load("Q", (ri, ck)) @ hbm.load("K", (cj, ck)).T
            hbm.store("S", (ri, cj), scale * acc)
    for ri in rows:                                      # (2) L, a row block at a time
        m_, l_ = np.full(ri.stop - ri.start, -np.inf), 0.0
        for cj in rows:
            s = hbm.load("S", (ri, cj))
            m_new = np.maximum(m_, s.max(axis=1))
            l_ = l_ * np.exp(m_ - m_new) + np.exp(s - m_new[:, None]).sum(axis=1)
            m_ = m_new
        hbm.store("L", ri, m_ + np.log(l_))
    for ri in rows:                                      # (3) O = exp(S - L) V, b x b blocks
        for ck in dcols:
            Li, acc = hbm.load("L", ri), 0.0
            for cj in rows:
                acc = acc + np.exp(hbm.load("S", (ri, cj)) - Li[:, None]) @ hbm.load("V", (cj, ck))
            hbm.store("O", (ri, ck), acc)
    return hbm.arrays["O"], hbm.arrays["L"], hbm


# --------------------------------------------------------------------------- what the H100 measured

def _extra(row) -> dict:
    return dict(kv.split("=", 1) for kv in row["extra"].split(";") if "=" in kv)


def _config(row) -> dict:
    cfg = dict(kv.split("=", 1) for kv in row["config"].split() if "=" in kv)
    return {k: int(cfg[k]) for k in ("B", "H", "N", "d")}


def read_dram(name: str, results_dir=None) -> list[dict]:
    """The Nsight Compute rows of ``workbook/results/<name>`` (``*_dram.csv``) that carry
    L2 bytes: kernel, shape (B, H, N, d), DRAM bytes (read + write, and the writes),
    bytes the SMs read from L2, the IO model's and the compulsory bytes, the ``extra``
    fields. Raises FileNotFoundError when the file is not committed."""
    folder = Path(results_dir) if results_dir is not None else io.RESULTS_DIR
    _, rows = io._read(folder / name)
    out = []
    for r in rows:
        ex = _extra(r)
        if "l2_read_bytes" not in ex:
            continue
        out.append({"kernel": r["kernel"], **_config(r), "dram": float(ex["dram_total_bytes"]),
                    "dram_write": float(ex["dram_write_bytes"]), "l2_read": float(ex["l2_read_bytes"]),
                    "model": float(ex["model_bytes"]), "compulsory": float(ex["compulsory_bytes"]),
                    "ms": r["median_ms"], "extra": ex})
    return out


def chapter_rows(results_dir=None) -> list[dict]:
    """The timed rows of chapter 10's bench (``workbook/results/io_theory.csv``): kernel,
    shape (B, H, N, d), median ms, TFLOP/s, the model's bytes and the ``extra`` fields, in
    the bench's order. Raises FileNotFoundError when the file is not committed."""
    folder = Path(results_dir) if results_dir is not None else io.RESULTS_DIR
    _, rows = io._read(folder / "io_theory.csv")
    return [{"kernel": r["kernel"], **_config(r), "ms": float(r["median_ms"]), "tflops": float(r["tflops"]),
             "model": float(r["model_bytes"]), "extra": _extra(r)} for r in rows]


def m_sweep(results_dir=None) -> list[dict]:
    """The Br sweep of flash_forward_dram.csv re-read as an M sweep.

    Each row's tiles use ``flash_forward.shared_bytes`` of shared memory a block: M is
    that in fp32 elements (Qt, Kt, V, Pt with their padding; Bc = 64 fixed, so
    M = 128 Br + 9472 at d = 64, not proportional to Br). Beside the measured bytes:
    ``model``, the IO model (2Nd + N + 2Nd Tr a head), and ``theorem2``, N^2 d^2 / M a
    head, both in bytes for all B H heads."""
    from kernels.flash_forward import Tiles, shared_bytes

    out = []
    for r in read_dram("flash_forward_dram.csv", results_dir):
        Br, Bc, TM, TX = (int(x) for x in r["extra"]["tiles"].split(","))
        M = shared_bytes(Tiles(Br, Bc, TM, TX), r["d"]) // 4
        heads_bytes = r["B"] * r["H"] * 4
        out.append({**r, "Br": Br, "Bc": Bc, "M": M,
                    "theorem2": heads_bytes * theorem2_order(r["N"], r["d"], M),
                    "kv_stream": heads_bytes * 2 * r["N"] * r["d"] * _cdiv(r["N"], Br)})
    return sorted(out, key=lambda row: row["M"])


def measured_vs_model(results_dir=None) -> list[dict]:
    """One row per profiled case of the forward's Br sweep, the backward and block-sparse
    (flash_forward_dram.csv, flash_backward_dram.csv, block_sparse_dram.csv): the measured
    DRAM and L2-to-SM bytes next to the IO model and the compulsory bytes, and which
    result of [1] the case illustrates. Files not committed are left out."""
    out = []
    for name, result in (("flash_forward_dram.csv", "Theorem 2"), ("flash_backward_dram.csv", "Theorem 5"),
                         ("block_sparse_dram.csv", "Proposition 4")):
        try:
            rows = read_dram(name, results_dir)
        except FileNotFoundError:
            continue
        for r in rows:
            s = float(r["kernel"].split("density ")[1].split()[0]) if "density" in r["kernel"] else 1.0
            out.append({"result": result, "kernel": r["kernel"].replace(" (Nsight Compute)", ""), "s": s,
                        "dram": r["dram"], "l2": r["l2_read"] + r["dram_write"], "model": r["model"],
                        "compulsory": r["compulsory"]})
    return out
