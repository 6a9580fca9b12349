"""Planted bugs: the mutants the chapters' property tests must catch, and the import hook
that plants one.

A mutant is a copy of one kernel module with one or more exact snippets of its source
replaced: a dropped rescale, a shifted diagonal, a skipped ragged tile, a wrong L, a less
accurate P. ``tests/test_planted_bugs.py`` runs each chapter's own tests (a ``-k``
selection) in a child process with ``WORKBOOK_MUTANT=<id>``; ``tests/conftest.py`` then
calls ``install(id)`` before anything imports the kernels, and the import of the named
module loads its source with the snippets replaced. The child must fail with an assertion
error: a mutant that passes is a bug the tests cannot see.

Every snippet must occur exactly once in the module's current source, so a refactor that
moves the code a mutant targets fails loudly (``MutantError``) instead of testing nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


class MutantError(RuntimeError):
    """A mutant that cannot be planted: its snippet is missing or not unique."""


@dataclass(frozen=True)
class Mutant:
    """One planted bug.

    id        a short name, the value of WORKBOOK_MUTANT
    chapter   the chapter whose kernel it breaks
    module    the kernel module (dotted name) whose source is edited
    edits     (snippet, replacement) pairs; each snippet occurs exactly once
    tests     the test files to run (paths relative to the repository)
    select    the ``-k`` expression that picks the tests expected to catch it
    bug       what the mutant does, in words
    gpu_only  only a GPU run can catch it (sizes the simulator cannot reach); the planted-bug
              suite skips it in the simulator and says why
    escapes   a known gap: the chapter's tests do not catch it yet (why, and what would);
              the suite expects it to escape (strict: once the tests catch it, the suite
              fails until this note is removed)
    """

    id: str
    chapter: int
    module: str
    edits: tuple
    tests: tuple
    select: str
    bug: str
    gpu_only: str = ""
    escapes: str = ""

    @property
    def path(self) -> Path:
        return ROOT / (self.module.replace(".", "/") + ".py")

    def mutated_source(self, source: str | None = None) -> str:
        """The module's source with every edit applied; MutantError unless each snippet
        occurs exactly once (in the source as it is before any edit)."""
        source = self.path.read_text() if source is None else source
        out = source
        for snippet, replacement in self.edits:
            count = source.count(snippet)
            if count != 1:
                raise MutantError(f"mutant {self.id}: the snippet occurs {count} times in {self.module} "
                                  f"(expected exactly once): {snippet!r}")
            out = out.replace(snippet, replacement)
        return out


def _veltkamp(value: str, bits: int, indent: str, out: str) -> str:
    """Lines that store ``value`` rounded to ``bits`` significant bits into ``out``
    (Veltkamp's split: c = v (2^(24 - bits) + 1); hi = c - (c - v))."""
    factor = float(2 ** (24 - bits) + 1)
    return (f"{indent}_v = {value}\n"
            f"{indent}_c = _v * float32({factor!r})\n"
            f"{indent}{out} = _c - (_c - _v)")


# --------------------------------------------------------------------------- the table

NAIVE = "kernels.naive_attention"
ONLINE = "kernels.online_softmax"
T1 = ("tests/test_naive_attention.py",)
T3 = ("tests/test_online_softmax.py",)
CH1_ORACLE = "test_each_step_matches_the_oracle or test_naive_attention_matches_the_oracle"
CH3_KERNEL = "test_softmax_matches_oracle"

MUTANTS = [
    # ---- chapter 1: naive attention
    Mutant("ch1-no-max-subtraction", 1, NAIVE,
           (("        m = red_m[0]\n",
             "        m = red_m[0] if red_m[0] == NEG_INF else float32(0)   # PLANTED: no max subtracted\n"),),
           T1, CH1_ORACLE, "softmax without subtracting the row max: exp overflows on large logits"),
    Mutant("ch1-wrong-lse", 1, NAIVE,
           (("            lse[bh, i] = m + math.log(l)\n",
             "            lse[bh, i] = math.log(l)   # PLANTED: L without the max\n"),),
           T1, CH1_ORACLE, "L = log l: the max m is left out of the logsumexp"),
    Mutant("ch1-causal-diagonal-shifted", 1, NAIVE,
           (("                    if causal and j > i + shift:\n",
             "                    if causal and j >= i + shift:   # PLANTED: the diagonal is masked\n"),),
           T1, CH1_ORACLE, "the causal mask hides the diagonal too (j >= i + Nk - Nq)"),
    Mutant("ch1-causal-top-left", 1, NAIVE,
           (("        shift = nk - nq                      # causal: key j allowed iff j <= i + shift\n",
             "        shift = max(nk - nq, 0)   # PLANTED: top-left aligned when Nq > Nk\n"),),
           T1, CH1_ORACLE, "the causal mask is off when Nq > Nk (top-left instead of bottom-right aligned)"),
    Mutant("ch1-ragged-key-tile-skipped", 1, NAIVE,
           (("        for j0 in range(0, j_end, bk):\n",
             "        for j0 in range(0, j_end - j_end % bk, bk):   # PLANTED: the ragged last key tile is skipped\n"),),
           T1, CH1_ORACLE, "O = P V skips the last, partial tile of keys"),
    Mutant("ch1-ragged-head-dim-skipped", 1, NAIVE,
           (("        for k0 in range(0, d, bk):\n",
             "        for k0 in range(0, d - d % bk if d > bk else d, bk):   # PLANTED: a ragged last chunk of d is skipped\n"),),
           T1, CH1_ORACLE, "S = Q K^T skips the last, partial chunk of the head dimension"),
    Mutant("ch1-p-fp16-precision", 1, NAIVE,
           (("                    p[bh, i, j] = x[u] * inv_l\n",
             _veltkamp("x[u] * inv_l", 11, " " * 20, "p[bh, i, j]") + "   # PLANTED: P to fp16's 11 bits\n"),),
           T1, CH1_ORACLE, "P rounded to fp16's precision (11 significant bits) before P V"),
    Mutant("ch1-p-4x-less-accurate", 1, NAIVE,
           (("                    p[bh, i, j] = x[u] * inv_l\n",
             _veltkamp("x[u] * inv_l", 21, " " * 20, "p[bh, i, j]") + "   # PLANTED: P to 21 bits\n"),),
           T1, CH1_ORACLE, "P rounded to 21 significant bits: P's error about 4x the kernel's (median over the cases)"),

    # ---- chapter 3: online softmax
    Mutant("ch3-no-rescale", 3, ONLINE,
           (("                l = l * math.exp(m - m_new) + lc     # = merge((m, l), (mc, lc)) with the chunk's state\n",
             "                l = l + lc   # PLANTED: the running sum is not rescaled when the max grows\n"),),
           T3, CH3_KERNEL, "the running sum l is not rescaled by exp(m_old - m_new) when a chunk raises the max"),
    Mutant("ch3-merge-one-side", 3, ONLINE,
           (("    return m, l1 * math.exp(m1 - m) + l2 * math.exp(m2 - m)\n",
             "    return m, l1 + l2 * math.exp(m2 - m)   # PLANTED: the left state is not rescaled\n"),),
           T3, CH3_KERNEL, "the (m, l) merge rescales only one of the two states"),
    Mutant("ch3-tree-skips-half", 3, ONLINE,
           (("        s = TPR // 2\n",
             "        s = TPR // 4   # PLANTED: the tree starts one level too low\n"),),
           T3, CH3_KERNEL, "the tree reduction of a row's states starts one level too low: half the states are lost"),
    Mutant("ch3-wrong-lse", 3, ONLINE,
           (("                lse[r] = _NEG_INF if empty else m + math.log(l)\n",
             "                lse[r] = _NEG_INF if empty else math.log(l)   # PLANTED: L without the max\n"),),
           T3, CH3_KERNEL, "L = log l: the max m is left out of the logsumexp"),
    Mutant("ch3-ragged-chunk-skipped", 3, ONLINE,
           (("                v = x[r, j] if (valid and j < n) else _NEG_INF\n",
             "                v = x[r, j] if (valid and base + CHUNK <= n) else _NEG_INF   # PLANTED: a ragged last chunk is skipped\n"),),
           T3, CH3_KERNEL, "pass 1 skips the last, partial chunk of a row: its entries never reach m and l"),
    Mutant("ch3-nan-row-as-empty", 3, ONLINE,
           (("        empty = l == float32(0.0)\n",
             "        empty = not l > float32(0.0)   # PLANTED: a NaN row is taken for an empty one\n"),),
           T3, "test_nan_or_inf_in_a_row_reaches_that_row_only",
           "a row whose l is NaN is treated like a row of all -inf: p = 0, L = -inf instead of NaN"),
    Mutant("ch3-p-fp16-precision", 3, ONLINE,
           (("                        p[r, j] = math.exp(v - m) * inv_l\n",
             _veltkamp("math.exp(v - m) * inv_l", 11, " " * 24, "p[r, j]") + "   # PLANTED: p to fp16's 11 bits\n"),),
           T3, CH3_KERNEL, "p rounded to fp16's precision (11 significant bits)"),
    Mutant("ch3-p-4x-less-accurate", 3, ONLINE,
           (("                        p[r, j] = math.exp(v - m) * inv_l\n",
             _veltkamp("math.exp(v - m) * inv_l", 21, " " * 24, "p[r, j]") + "   # PLANTED: p to 21 bits\n"),),
           T3, CH3_KERNEL, "p rounded to 21 significant bits: p's error about 4x the kernel's (median over the cases)"),
]

MATMUL = "kernels.tiled_matmul"
T2 = ("tests/test_tiled_matmul.py",)
CH2_ORACLE = "test_matmul_matches_oracle or test_each_rung_matches_oracle or test_default_tiles_ragged"

MUTANTS += [
    # ---- chapter 2: the tiled matmul
    Mutant("ch2-ragged-k-tile-skipped", 2, MATMUL,
           (("tiles = (K + int32(BK - 1)) // int32(BK)",
             "tiles = K // int32(BK)   # PLANTED: the ragged last k-tile is skipped"),),
           T2, CH2_ORACLE, "rung 3: the last, partial k-tile of A and B is never multiplied"),
    Mutant("ch2-shared-ragged-k-tile-skipped", 2, MATMUL,
           (("for k0 in range(int32(0), K, int32(T)):",
             "for k0 in range(int32(0), K - K % int32(T), int32(T)):   # PLANTED: the ragged last k-tile is skipped"),),
           T2, CH2_ORACLE, "rung 2: the last, partial k-tile is never loaded"),
    Mutant("ch2-accumulator-fp16-precision", 2, MATMUL,
           (("                acc += a[row, k] * b[k, col]\n",
             _veltkamp("acc + a[row, k] * b[k, col]", 11, " " * 16, "acc") + "   # PLANTED: the sum kept to 11 bits\n"),),
           T2, CH2_ORACLE, "rung 1: the running sum rounded to fp16's precision (11 bits) at every step"),
    Mutant("ch2-accumulator-4x-less-accurate", 2, MATMUL,
           (("                acc += a[row, k] * b[k, col]\n",
             _veltkamp("acc + a[row, k] * b[k, col]", 22, " " * 16, "acc") + "   # PLANTED: the sum kept to 22 bits\n"),),
           T2, CH2_ORACLE, "rung 1: the running sum rounded to 22 bits at every step: 4x float32's rounding error"),
    Mutant("ch2-mma-b-tiles-swapped", 2, MATMUL,
           (("            bf[2 * j, 0] = x[0]\n            bf[2 * j, 1] = x[1]\n",
             "            bf[2 * j, 0] = x[2]\n            bf[2 * j, 1] = x[3]\n"),),
           T2, "test_tensor_core_rung_matches_oracle",
           "rung 4: ldmatrix.trans's second n8 tile taken for the first (C's columns mixed up)"),
    Mutant("ch2-mma-stage-sums-dropped", 2, MATMUL,
           (("                        acc[i, j, e] += part[i, j, e]", "                        acc[i, j, e] = part[i, j, e]"),),
           T2, "test_tensor_core_rung_matches_oracle",
           "rung 4: each stage's sums replace C's instead of adding to them (only the last BK of K counts)"),
]

FORWARD = "kernels.flash_forward"
SPARSE = "kernels.block_sparse"
T4 = ("tests/test_flash_forward.py",)
T6 = ("tests/test_block_sparse.py",)
CH4_ORACLE = "test_matches_oracle or test_drawn_tiles"
CH6_FORWARD = "test_forward_matches_oracle or test_forward_patterns"

MUTANTS += [
    # ---- chapter 4: the fused forward (make_attend_query_tile, shared with chapter 6)
    Mutant("ch4-output-not-rescaled", 4, FORWARD,
           (("                    acc[i, c] *= alpha\n",
             "                    pass   # PLANTED: O is not rescaled when the max grows\n"),),
           T4, CH4_ORACLE, "the running output O is not rescaled by alpha = exp(m_old - m_new)"),
    Mutant("ch4-sum-not-rescaled", 4, FORWARD,
           (("                l[i] *= alpha\n",
             "                pass   # PLANTED: l is not rescaled when the max grows\n"),),
           T4, CH4_ORACLE, "the running sum l is not rescaled by alpha = exp(m_old - m_new)"),
    Mutant("ch4-causal-diagonal-shifted", 4, FORWARD,
           (("if col >= n_k or (causal and col > row + diag):",
             "if col >= n_k or (causal and col >= row + diag):   # PLANTED: the diagonal is masked"),),
           T4, CH4_ORACLE, "the causal mask hides the diagonal too"),
    Mutant("ch4-ragged-key-tile-skipped", 4, FORWARD,
           (("n_tiles = (max(kv_end, 0) + Bc - 1) // Bc",
             "n_tiles = max(kv_end, 0) // Bc   # PLANTED: the ragged last K/V tile is skipped"),),
           T4, CH4_ORACLE, "the last, partial K/V tile is never visited"),
    Mutant("ch4-ragged-keys-not-masked", 4, FORWARD,
           (("if k0 + Bc > n_k or (causal and k0 + Bc - 1 > q0 + diag):",
             "if causal and k0 + Bc - 1 > q0 + diag:   # PLANTED: keys past Nk are not masked"),),
           T4, CH4_ORACLE, "the zero-padded keys past Nk in the last tile get score 0 instead of being masked"),
    Mutant("ch4-wrong-lse", 4, FORWARD,
           (("lse_row = m[i] * scale + math.log(total)",
             "lse_row = math.log(total)   # PLANTED: L without the max"),),
           T4, CH4_ORACLE, "L = log l: the max m is left out of the logsumexp"),
    Mutant("ch4-no-normalisation", 4, FORWARD,
           (("inv = float32(1.0) / total",
             "inv = float32(1.0)   # PLANTED: O is not divided by l"),),
           T4, CH4_ORACLE, "O = acc: the division by l is dropped"),
    Mutant("ch4-p-fp16-precision", 4, FORWARD,
           (("                    p = math.exp2(s[i, jj] * scale_log2e - base)\n",
             _veltkamp("math.exp2(s[i, jj] * scale_log2e - base)", 11, " " * 20, "p") + "   # PLANTED: P to fp16's 11 bits\n"),),
           T4, CH4_ORACLE, "P rounded to fp16's precision (11 significant bits), in l and in P V"),

    # ---- chapter 6: the block-sparse forward (the list walk, the lists)
    Mutant("ch6-list-walk-off-by-one", 6, SPARSE,
           (("count = row_ptr[g * tr + i + 1] - first",
             "count = row_ptr[g * tr + i + 1] - first - 1   # PLANTED: the last kept tile is not walked"),),
           T6, CH6_FORWARD, "the walk over a query tile's kept K/V tiles stops one tile short"),
    Mutant("ch6-diagonal-tile-dropped", 6, SPARSE,
           (("kept = kept & (first_k[None, :] <= last_q[:, None] + (nk - nq))[None]",
             "kept = kept & (first_k[None, :] < last_q[:, None] + (nk - nq))[None]   # PLANTED: off by one"),),
           T6, CH6_FORWARD, "causal: a tile whose first key is the last query's diagonal key is dropped from the lists"),
    Mutant("ch6-one-mask-for-all-heads", 6, SPARSE,
           (("g = int32(bh) % groups",
             "g = int32(0)   # PLANTED: every head walks head 0's lists"),),
           T6, CH6_FORWARD, "per-head masks: every head walks the first head's lists"),
]

BACKWARD = "kernels.flash_backward"
SPARSE_BACKWARD = "kernels.block_sparse_backward"
T5 = ("tests/test_flash_backward.py",)
T6B = ("tests/test_block_sparse_backward.py",)
CH5_ORACLE = ("test_gradients_match_the_oracle or test_two_level_sums_across_many_tiles "
              "or test_fully_masked_rows_give_zero_dq_and_no_nan")
CH6_BACKWARD = "test_backward_matches_oracle"

MUTANTS += [
    # ---- chapter 5: the recomputing backward (its building blocks are chapter 6's too)
    Mutant("ch5-delta-dropped", 5, BACKWARD,
           (("            out[bh, row] = total\n",
             "            out[bh, row] = float32(0.0)   # PLANTED: D = rowsum(dO O) is dropped\n"),),
           T5, CH5_ORACLE, "D = rowsum(dO * O) is taken as 0: dS = P dP instead of P (dP - D)"),
    Mutant("ch5-causal-diagonal-shifted", 5, BACKWARD,
           (("cols = min(cols, r0 + r + (nk - nq) + int32(1))",
             "cols = min(cols, r0 + r + (nk - nq))   # PLANTED: the diagonal is masked"),),
           T5, CH5_ORACLE, "the backward's causal mask hides the diagonal too"),
    Mutant("ch5-p-from-a-wrong-lse", 5, BACKWARD,
           (("p = math.exp(s[a, b] * scale - lrow)",
             "p = math.exp((s[a, b] - lrow) * scale)   # PLANTED: L taken as a raw score"),),
           T5, CH5_ORACLE, "P is rebuilt as exp(scale (S - L)): the saved L is used in the wrong units"),
    Mutant("ch5-ragged-query-tile-skipped", 5, BACKWARD,
           (("count = (nq + int32(Br - 1)) // int32(Br) - first",
             "count = nq // int32(Br) - first   # PLANTED: the ragged last query tile is skipped"),),
           T5, CH5_ORACLE, "dK/dV: the last, partial query tile is never walked"),
    Mutant("ch5-ragged-key-tile-skipped-in-dq", 5, BACKWARD,
           (("count = last_col // int32(Bc) + int32(1)",
             "count = (last_col + int32(1)) // int32(Bc)   # PLANTED: the ragged last key tile is skipped"),),
           T5, CH5_ORACLE, "the separate dQ kernel never walks the last, partial key tile"),
    Mutant("ch5-dk-unscaled", 5, BACKWARD,
           (("write(dk, sm, O_SK, t, acc_dk, bh, c0, nk, d, ty_b, tx_b, scale)",
             "write(dk, sm, O_SK, t, acc_dk, bh, c0, nk, d, ty_b, tx_b, float32(1.0))   # PLANTED: no scale"),),
           T5, CH5_ORACLE, "dK = dS^T Q without the softmax scale"),
    Mutant("ch5-flush-overwrites", 5, BACKWARD,
           (("sm[uint64(o + (a * N + b) * NT + t)] += acc[a, b]",
             "sm[uint64(o + (a * N + b) * NT + t)] = acc[a, b]   # PLANTED: the running sum is overwritten"),),
           T5, "test_two_level_sums_across_many_tiles and False", "the two-level sums: a flush overwrites the running sum instead of adding to it"),
    Mutant("ch5-single-register-sums", 5, BACKWARD,
           (("FLUSH = max(1, ACC_ROWS // Br)                                  # query tiles a partial sum holds",
             "FLUSH = 1 << 30   # PLANTED: one register sums every query tile"),
            ("FLUSH = max(1, ACC_ROWS // Bc)                                  # key tiles a partial sum holds",
             "FLUSH = 1 << 30   # PLANTED: one register sums every key tile")),
           T5, "test_long_causal_sequence",
           "single-register sums in place of the two-level sums: dV's error grows with N (4x NumPy's at N = 4096)",
           gpu_only="the error shows at N = 4096 (test_long_causal_sequence); at the simulator's sizes "
                    "float32 NumPy's own sums are single sequences too"),

    # ---- chapter 6: the block-sparse backward (chapter 5's bodies walking the lists)
    Mutant("ch6-backward-dkdv-walk-one-short", 6, SPARSE_BACKWARD,
           (("col_ptr[g + j + 1] - first",
             "col_ptr[g + j + 1] - first - 1"),),
           T6B, CH6_BACKWARD, "dK/dV: the walk over a key tile's kept query tiles stops one tile short"),
    Mutant("ch6-backward-dq-walk-one-short", 6, SPARSE_BACKWARD,
           (("row_ptr[g + i + 1] - first",
             "row_ptr[g + i + 1] - first - 1"),),
           T6B, CH6_BACKWARD, "separate dQ: the walk over a query tile's kept key tiles stops one tile short"),
    Mutant("ch6-backward-one-mask-for-all-heads", 6, SPARSE_BACKWARD,
           (("g = (bh % groups) * int32(cuda.gridDim.x)                   # this head's lists",
             "g = int32(0) * int32(cuda.gridDim.x)   # PLANTED: every head walks head 0's lists"),),
           T6B, CH6_BACKWARD, "per-head masks: dK/dV of every head walk the first head's lists"),
]

# ---- chapter 7: decode (split-K, stream-K)
DECODE = "kernels.decode"
T7 = ("tests/test_decode.py",)
CH7 = "test_matches_oracle or test_many_partials or test_bitwise_reproducible or test_prepared"
CH7_MMA = "test_what_lies_beyond_a_cache_is_never_read_into_the_result and float16 and stream"
MUTANTS += [
    Mutant("ch7-no-rescale", 7, DECODE,
           (("""                for t in range(CPL):
                    acc[r, t] *= alpha
""", ""),),
           T7, CH7, "a stream's running O is not rescaled when its maximum grows"),
    Mutant("ch7-causal-diagonal-shifted", 7, DECODE,
           (("if j >= k_end or (causal and j > i + diag):", "if j >= k_end or (causal and j > i + diag + 1):"),),
           T7, CH7, "causal: each new query also sees the key after its own"),
    Mutant("ch7-grouped-rows-one-query", 7, DECODE,
           (("i = (row0 + r) % n_q", "i = row0 + r"),),
           T7, CH7, "GQA rows: the causal diagonal counts a group's rows as queries of one head"),
    Mutant("ch7-split-drops-a-key", 7, DECODE,
           (("k_end = min(k_start + chunk, n_keys)", "k_end = min(k_start + chunk, n_keys - 1)"),),
           T7, CH7, "split-K: the last split stops one key short of the cache's end"),
    Mutant("ch7-merge-unweighted", 7, DECODE,
           (("o = o * math.exp(m - m_new) + o_part[uint64(slot), uint64(r), uint64(c)] * math.exp(l_s - m_new)",
             "o = o + o_part[uint64(slot), uint64(r), uint64(c)]"),),
           T7, CH7, "the merge of partials adds the O_s without their weights exp(L_s - L)"),
    Mutant("ch7-streams-merged-unweighted", 7, DECODE,
           (("                o += so[z, r, c] * w", "                o += so[z, r, c]"),),
           T7, CH7, "a block's streams merged without their weights 2^(m_z - m)"),
    Mutant("ch7-counter-not-reset", 7, DECODE,
           (("                        counters[item] = 0", "                        counters[item] = counters[item]"),),
           T7, "test_bitwise_reproducible or test_prepared",      # (only a second launch can see it)
           "stream-K: the merging block leaves its counter set, so the next launch never merges"),
    # the tensor-core partial (fp16 caches, grouped rows): one test that goes through it
    Mutant("ch7-mma-p-one-fp16-part", 7, DECODE,
           (("                    c4 = mma_f16((p_lo0, p_lo1, p_lo2, p_lo3), b, c4)\n", ""),),
           T7, CH7_MMA, "tensor cores: P rounded to one fp16 part (what it loses never reaches O)"),
    Mutant("ch7-mma-q-one-fp16-part", 7, DECODE,
           (("                            c4 = mma_f16((q_lo[s_, 0], q_lo[s_, 1], q_lo[s_, 2], q_lo[s_, 3]), b, c4)",
             "                            pass"),),
           T7, CH7_MMA, "tensor cores: float32 q rounded to one fp16 part in S = q K^T"),
    Mutant("ch7-mma-v-halves-swapped", 7, DECODE,
           (("                    upper = j % 2 == 1", "                    upper = j % 2 == 0"),),
           T7, CH7_MMA, "tensor cores: V's B fragment takes the other half of each word (columns mixed up)"),
]

# ---- tensor cores: the FlashAttention-2 forward on mma.sync
TC = "kernels.flash_tensor_cores"
FRAGMENTS = "kernels.base.fragment_softmax"      # the softmax between the products, shared with chapter 11
T8 = ("tests/test_flash_tensor_cores.py",)
CH8 = "test_pinned_cases or test_matches_oracle"
MUTANTS += [
    Mutant("tc-no-rescale", 8, FRAGMENTS,
           (("""            for j in range(ND):
                acc[j, 2 * h] *= alpha
                acc[j, 2 * h + 1] *= alpha
""", ""),),
           T8, CH8, "O's accumulator fragments are not rescaled when the row's maximum grows"),
    Mutant("tc-p-tiles-swapped", 8, TC,
           (("return (pack(c0[0], c0[1]), pack(c0[2], c0[3]), pack(c1[0], c1[1]), pack(c1[2], c1[3]))",
             "return (pack(c1[0], c1[1]), pack(c1[2], c1[3]), pack(c0[0], c0[1]), pack(c0[2], c0[3]))"),),
           T8, CH8, "P's two n8 tiles swapped in the A fragment of P V (keys 0-7 weigh V's rows 8-15)"),
    Mutant("tc-causal-diagonal-shifted", 8, FRAGMENTS,
           (("if key >= n_k or (causal != 0 and key > row + diag):", "if key >= n_k or (causal != 0 and key > row + diag + 1):"),),
           T8, CH8, "causal: each query also sees the key after its own"),
    Mutant("tc-lse-base-2", 8, FRAGMENTS,
           (("lse[bh, row] = (m[h] + math.log2(total)) * float32(LN2)", "lse[bh, row] = m[h] + math.log2(total)"),),
           T8, CH8, "L left in base 2 (the scores' base), not the natural log"),
    Mutant("tc-gqa-wrong-kv-head", 8, TC,
           (("            kvh = int32(uint32(bh) // uint32(kv_group))     # is a", "            kvh = int32(uint32(bh) % uint32(k.shape[0]))     # is a"),),
           T8, CH8, "grouped-query: query head row bh reads KV row bh mod B*Hkv (heads interleaved), not bh // group"),
    Mutant("tc-o16-truncated", 8, "kernels.base.mma",
           (("        a[i, j, k] = uint16(pack(x, float32(0.0)) & uint32(0xFFFF))",
             "        a[i, j, k] = uint16(pack(x, float32(0.0)) & uint32(0xFFFF)) & uint16(0xFFFE)   # PLANTED"),),
           T8, "test_o_in_the_inputs_type", "O in the inputs' type: the last bit of each 16-bit value dropped "
                                            "(rounded toward zero where it was set)"),
]

# ---- FlashAttention-1's loop order (the theory chapter)
MUTANTS += [
    Mutant("kv-outer-o-not-unnormalised", 10, "kernels.kv_outer_forward",
           (("o_i[c] *= l_i * a_old", "o_i[c] *= a_old"),),
           ("tests/test_kv_outer_forward.py",), "test_matches_oracle",
           "Algorithm 1's O_i, stored normalised, is taken back without its l_i: earlier tiles weigh too little"),
]

# ---- fp32 on tensor cores: 3xTF32 (chapter 11)
TF32 = "kernels.flash_tf32"
T11 = ("tests/test_flash_tf32.py",)
MUTANTS += [
    Mutant("tf32-no-hi-lo-term", 11, "kernels.base.tf32_product",
           (("""            for j in range(n):
                x = mma_tf32(a_hi, (b[j, 2], b[j, 3]), (c[j, 0], c[j, 1], c[j, 2], c[j, 3]))
                for e in range(4):
                    c[j, e] = x[e]
""", ""),),
           T11, "test_matches_oracle", "3xTF32 without a_hi b_lo: two products, about 2^-11 of |a||b| lost"),
    Mutant("tf32-k-lo-parts-dropped", 11, TF32,
           (("store_words(Kp, r, 2 * c + 4 * t, h0, h1, l0, l1)", "store_words(Kp, r, 2 * c + 4 * t, h0, h1, uint32(0), uint32(0))"),),
           T11, "test_matches_oracle", "K_j's lo parts never written (zeros): S from K's hi parts alone, about 2^-11 of "
                                       "|q||k| lost"),
    Mutant("tf32-presplit-k-lo-dropped", 11, TF32,
           (("store_words(kp[h], r, 2 * c + 4 * t, h0, h1, l0, l1)",
             "store_words(kp[h], r, 2 * c + 4 * t, h0, h1, uint32(0), uint32(0))"),),
           T11, "test_keys_split_once_before_the_forward_meet_the_same_rule",
           "the split before the forward writes K's hi parts only: S from K's hi parts alone"),
    Mutant("tf32-presplit-next-tile-over-this-one", 11, TF32,
           (("land_parts(kh, vh, Kp, Vp, 1 - st, k0 + Bc, n_k, tid)", "land_parts(kh, vh, Kp, Vp, st, k0 + Bc, n_k, tid)"),),
           T11, "test_keys_split_once_before_the_forward_meet_the_same_rule",
           "tile j + 1's parts land in the stage tile j is read from, while it is read"),
    Mutant("tf32-q-lo-parts-dropped", 11, TF32,
           (("store_words(Ql, qrow + U(32 * s_), 0, lo[0], lo[1], lo[2], lo[3])",
             "store_words(Ql, qrow + U(32 * s_), 0, uint32(0), uint32(0), uint32(0), uint32(0))"),),
           T11, "test_query_parts", "Q_i's lo parts, kept in shared memory, never written (zeros): S from Q's hi "
                                    "parts alone, about 2^-11 of |q||k| lost"),
    Mutant("tf32-q-parts-of-another-lane", 11, TF32,
           (("return load_words(Qh, qrow + U(32) * s_, 0), load_words(Ql, qrow + U(32) * s_, 0)",
             "return load_words(Qh, (qrow ^ U(4)) + U(32) * s_, 0), load_words(Ql, qrow + U(32) * s_, 0)"),),
           T11, "test_query_parts", "Q_i's hi parts read back from lane ^ 4's row (the fragment of query row g ^ 1): "
                                    "S mixes two queries' rows"),
    Mutant("tf32-wgmma-k-plane-rows-shifted", 11, TF32,
           (("row = 8 * ((r // 8) * (D // 4) + c // 4) + r % 8", "row = 8 * ((r // 8) * (D // 4) + c // 4) + (r + 1) % 8"),),
           ("tests/test_wgmma.py",), "test_forward_on_wgmma",
           "(wgmma) K_j's planes written one row off within each core matrix: S's column of key r reads key r - 1"),
    Mutant("tf32-wgmma-v-plane-keys-not-renumbered", 11, TF32,
           (("r0 = 8 * (q4 // 2) + q4 % 2", "r0 = 8 * (q4 // 2) + 1 - q4 % 2"),),
           ("tests/test_wgmma.py",), "test_forward_on_wgmma",
           "(wgmma P V) V_j^T's planes renumber a k-step's keys the other way round (key 2t + 1 where P's "
           "fragment takes key 2t)"),
    Mutant("tf32-wgmma-chain-repeats-a-k-step", 11, "kernels.base.wgmma_product",
           (("x = more(x, src, s + U(1), dh, dl)", "x = more(x, src, s, dh, dl)"),),
           ("tests/test_wgmma.py",), "test_every_wgmma_schedule",
           "(wgmma, two k-steps a group) the group's second k-step is its first again: S counts Q's columns "
           "8s..8s + 7 twice and drops the next eight (P V its keys)"),
    Mutant("tf32-wgmma-pv-half-not-offset", 11, TF32,
           (("pv_wgmma2(acc, pv, desc_add(dvh, PV_COLS // 8 * VSBO), desc_add(dvl, PV_COLS // 8 * VSBO))",
             "pv_wgmma2(acc, pv, dvh, dvl)"),),
           ("tests/test_wgmma.py",), "test_p_v_in_two_halves",
           "(wgmma P V in two halves of O) the second half's descriptors not moved on: O's columns D / 2 on "
           "get V's first D / 2 columns"),
    Mutant("tf32-v-pair-swapped", 11, TF32,
           (("store_words(Vp, p, 4 * (c + e), h0, h1, l0, l1)", "store_words(Vp, p, 4 * (c + e), h1, h0, l1, l0)"),),
           T11, "test_matches_oracle", "V's parts laid out with the keys of a pair swapped: key 2p's P weighs V row "
                                       "2p + 1"),
    Mutant("tf32-gqa-wrong-kv-head", 11, TF32,
           (("            kvh = int32(uint32(bh) // uint32(kv_group))\n", "            kvh = int32(uint32(bh) % uint32(k.shape[0]))\n"),),
           T11, "test_matches_oracle", "grouped-query: query head row bh reads KV row bh mod B*Hkv (heads interleaved), "
                                       "not bh // group"),
    Mutant("tf32-p-keys-not-renumbered", 11, TF32,
           (("return split4(pv[kp, 0], pv[kp, 2], pv[kp, 1], pv[kp, 3])",
             "return split4(pv[kp, 0], pv[kp, 1], pv[kp, 2], pv[kp, 3])"),),
           T11, "test_matches_oracle", "P's accumulator tile used as P V's A operand as it lies: keys 2t + 1 and t + 4 "
                                       "mixed up, rows g and g + 8 too"),
    Mutant("tf32-chained-accumulator", 11, TF32,
           (("    o_products = make_tf32_products(passes, DG)               # DG of O's tiles' products, interleaved\n",
             "    o_products = make_tf32_products(passes, DG)               # DG of O's tiles' products, interleaved\n\n"
             "    from kernels.base.mma import mma_tf32\n\n"
             "    @cuda.jit(device=True, inline=True)\n"
             "    def chained(a_hi, a_lo, b, c, n):   # PLANTED: the k-steps chained in the tensor core\n"
             "        for j in range(n):\n"
             "            x = mma_tf32(a_lo, (b[j, 0], b[j, 1]), (c[j, 0], c[j, 1], c[j, 2], c[j, 3]))\n"
             "            x = mma_tf32(a_hi, (b[j, 2], b[j, 3]), x)\n"
             "            x = mma_tf32(a_hi, (b[j, 0], b[j, 1]), x)\n"
             "            for e in range(4):\n"
             "                c[j, e] = x[e]\n"),
            ("                s_products(a_hi, a_lo, bs, cs)\n", "                chained(a_hi, a_lo, bs, sc, NS)\n"),
            ("                        sc[nt, e] += cs[nt, e]\n", "                        cs[nt, e] = sc[nt, e]\n"),
            ("                    o_products(a_hi, a_lo, bo, co)\n",
             "                    for j in range(DG):\n"
             "                        for e in range(4):\n"
             "                            co[j, e] = acc[dg * DG + j, e]\n"
             "                    chained(a_hi, a_lo, bo, co, DG)\n"),
            ("                            acc[dg * DG + j, e] += co[j, e]\n",
             "                            acc[dg * DG + j, e] = co[j, e]\n")),
           T11, "test_matches_oracle or test_long_sequence_meets_the_rule",
           "every k-step chained into S's and O's accumulators in the tensor core (chapter 8's way), as the kernel was "
           "first written: the H100's fp32 sums there are not rounded to nearest, and O's error grows with N",
           gpu_only="the simulator's mma adds exactly and rounds once; on the H100 O's error was 12x float32 NumPy's at "
                    "N = 1024 and 93x at N = 8192 (test_long_sequence_meets_the_rule, N = 16384)"),
]

# ---- the backward on tensor cores (chapter 12)
TCB = "kernels.tensor_core_backward"
T12 = ("tests/test_tensor_core_backward.py",)
TCOPY = ("tests/test_tile_copy.py",)                  # the tile copy chapters 8, 11 and 12 share
CHCOPY = "test_the_tile_holds_the_rows_and_zeros_past_them"
CH12 = "test_gradients_match_the_oracle"
MUTANTS += [
    Mutant("tcb-dk-unscaled", 12, TCB,
           (("store_gradients(dk, dv, bkv, key, col, dka[j, e] * scale, dva[j, e])",
             "store_gradients(dk, dv, bkv, key, col, dka[j, e], dva[j, e])   # PLANTED: no scale"),),
           T12, CH12, "dK = dS^T Q written without the softmax scale"),
    Mutant("tcb-splits-overwrite", 12, "kernels.base.query_split",      # the split chapters 11, 12 share
           (("            cuda.atomic.add(dk, (bkv, key, col), xk)\n",
             "            dk[bkv, key, col] = xk   # PLANTED: the splits overwrite each other's dK_j\n"),),
           T12, "test_queries_split_among_blocks_meet_the_same_rule",
           "the query split: each split stores its dK_j instead of adding it to the others'"),
    Mutant("tcb-causal-diagonal-shifted", 12, TCB,
           (("diag = n_k - n_q\n", "diag = n_k - n_q + 1   # PLANTED: the diagonal one key late\n"),),
           T12, CH12, "causal: each query also sees the key after its own (the mask and the query tiles walked)"),
    Mutant("tcb-p-tiles-swapped", 12, TCB,
           (("ap = (pack(pt[u, 0, 0], pt[u, 0, 1]), pack(pt[u, 0, 2], pt[u, 0, 3]),\n"
             "                          pack(pt[u, 1, 0], pt[u, 1, 1]), pack(pt[u, 1, 2], pt[u, 1, 3]))",
             "ap = (pack(pt[u, 1, 0], pt[u, 1, 1]), pack(pt[u, 1, 2], pt[u, 1, 3]),\n"
             "                          pack(pt[u, 0, 0], pt[u, 0, 1]), pack(pt[u, 0, 2], pt[u, 0, 3]))"
             "   # PLANTED: P^T's two n8 tiles swapped"),),
           T12, CH12, "dV = P^T dO: P^T's two n8 tiles swapped in the A fragment (queries 0-7 weigh dO's rows 8-15)"),
    Mutant("tcb-first-query-tile-rounded-up", 12, "kernels.base.key_block_walk",   # the walk chapters 11, 12 share
           (("first = max(k0 - diag, 0) // Br if causal != 0 else 0",
             "first = (max(k0 - diag, 0) + Br - 1) // Br if causal != 0 else 0   # PLANTED: rounded up"),),
           T12, CH12, "causal: a key tile skips the query tile whose last rows first see it (its first query "
                      "rounded up to a tile)"),
    Mutant("tcb-second-chunk-reads-the-first", 12, TCB,
           (("x = ldmatrix_at(qb + cb + u * (32 * SD) + s_ * 32)",
             "x = ldmatrix_at(qb + cb + s_ * 32)   # PLANTED: every chunk of a step reads the step's first Q_c"),),
           T12, CH12, "two chunks a step: S^T of the second chunk computed from the first chunk's queries"),
    Mutant("tcb-dq-tile-rows-not-offset", 12, "kernels.base.gradient_adds",   # the adds chapters 11, 12 share
           (("red_add_pair(dqh, r + uint32(8 * h), c + uint32(8 * j),",
             "red_add_pair(dqh, r, c + uint32(8 * j),   # PLANTED: rows g + 8 added into rows g\n                                "),),
           T12, CH12, "dQ's unchecked tile adds: the lane's second row (g + 8) added into its first (g)"),
    Mutant("tcb-copy-past-d-not-zeros", 12, "kernels.base.tile_copy",   # the copy chapters 8, 11, 12 share
           (("uint32(16 if live else 0))", "uint32(16))   # PLANTED: chunks past rows or d copy row 0, not zeros"),),
           TCOPY, CHCOPY, "the tile copy by column: a chunk past d (or past the rows) copies 16 bytes of row 0 "
                      "instead of filling zeros"),
    Mutant("tcb-walk-next-head-from-tile-0", 12, "kernels.base.key_block_walk",   # the walk chapters 11, 12 share
           (("return int32(bh + 1), int32(first * Br)",
             "return int32(bh + 1), int32(0)   # PLANTED: the next head's walk from tile 0"),),
           ("tests/test_key_block_walk.py",), "test_the_walk_visits_the_pairs_in_order",
           "causal GQA: after a query head's last tile, the next head's walk starts at tile 0, not at the first "
           "tile that sees the keys"),
    Mutant("tcb-words-one-past-n", 12, "kernels.base.tile_copy",
           (("live = r0 + r < n\n", "live = r0 + r <= n   # PLANTED: one word past the row's end\n"),),
           TCOPY, "test_the_word_copy_holds_the_row_and_zeros_past_n",
           "the word copy (L and D of a query tile): the word just past n is copied instead of a zero"),
    Mutant("tcb-copy-rows-not-stepped", 12, "kernels.base.tile_copy",
           (("ga + uint64(k) * gstep if live", "ga if live   # PLANTED: every chunk of a thread reads its first row\n"
             "                               "),),
           TCOPY, CHCOPY, "the tile copy by column: each of a thread's chunks reads the thread's first row"),
    Mutant("tcb-lse-not-base-2", 12, TCB,
           (("else L * float32(LOG2E)", "else L   # PLANTED: L left in natural log"),),
           T12, CH12, "make_delta_tc: L is not converted to base 2 for P = exp2(S scale log2 e - L log2 e)"),
]

# ---- the fp32 backward on tensor cores (chapter 11, part two)
TFB = "kernels.tf32_backward"
T11B = ("tests/test_tf32_backward.py",)
CH11B = "test_gradients_match_the_oracle"
MUTANTS += [
    Mutant("tfb-p-keys-not-renumbered", 11, TFB,
           (("hi, lo = split4(pt[0], pt[2], pt[1], pt[3])", "hi, lo = split4(pt[0], pt[1], pt[2], pt[3])"),),
           T11B, CH11B, "dV = P^T dO: P^T's accumulator tile used as the A operand as it lies (queries 2t + 1 and "
                        "t + 4 mixed up, key rows g and g + 8 too)"),
    Mutant("tfb-dq-keys-not-renumbered", 11, TFB,
           (("kb = shared_address(Ks, U(2) * t, g)", "kb = shared_address(Ks, t, g)   # PLANTED"),),
           T11B, CH11B, "dQ = dS K: K_j's rows read as keys t, t + 1 where dS's A fragment holds keys 2t, 2t + 1"),
    Mutant("tfb-dk-unscaled", 11, TFB,
           (("store_gradients(dk, dv, bkv, key, col, dka[j, e] * scale, dva[j, e])",
             "store_gradients(dk, dv, bkv, key, col, dka[j, e], dva[j, e])   # PLANTED: no scale"),),
           T11B, CH11B, "dK = dS^T Q written without the softmax scale"),
    Mutant("tfb-split-share-rounded-down", 11, "kernels.base.key_split",     # the share both splits take
           (("    share = (n + splits - 1) // splits\n",
             "    share = n // splits   # PLANTED: rounded down, the last pairs walked by no split\n"),),
           T11B, "test_queries_split_among_blocks_meet_the_same_rule",
           "the query split: each split's share rounded down, so the walk's last (head, query tile) pairs are "
           "never visited"),
    Mutant("tfb-no-hi-lo-term", 11, "kernels.base.tf32_product",
           (("            c = mma_tf32(a_hi, b_lo, c)\n", ""),),
           T11B, CH11B, "the backward's products without a_hi b_lo: about 2^-11 of |a||b| lost"),
    Mutant("tfb-chunk-reads-its-first-tile", 11, TFB,
           (("at = cb + U(n * ROWS8 + 32 * s_)", "at = cb + U(32 * s_)   # PLANTED: every tile of the chunk reads the first"),),
           T11B, "test_chunks_of_query_tiles_meet_the_same_rule",
           "S^T and dP^T for a chunk of query tiles: every tile's Q_c and dO_c fragments read from the chunk's "
           "first tile"),
    Mutant("tfb-split-lo-not-subtracted", 11, "kernels.base.mma",
           (("        return hi, np.uint32(int(np.array(rest, np.float32).view(np.uint32)))",
             "        return hi, np.uint32(int(np.array(x, np.float32).view(np.uint32)))   # PLANTED"),),
           T11B, "test_lo_truncated_by_the_mma_or_rounded_meets_the_same_rule",
           "the split at a fragment load leaves lo as x itself, not x - hi (the mma then adds a second x_hi b)"),
    Mutant("tf-forward-split-lo-not-subtracted", 11, "kernels.base.mma",
           (("        return hi, np.uint32(int(np.array(rest, np.float32).view(np.uint32)))",
             "        return hi, np.uint32(int(np.array(x, np.float32).view(np.uint32)))   # PLANTED"),),
           ("tests/test_flash_tf32.py",), "test_lo_truncated_by_the_mma_or_rounded_meets_the_same_rule",
           "the forward's register splits (lo='truncated') leave lo as x itself, not x - hi"),
    Mutant("tfb-mma-reads-whole-registers", 11, "kernels.base.mma",
           (("values = (words & np.uint32(TF32_MASK)).view(np.float32)",
             "values = words.view(np.float32)   # PLANTED: the 13 low bits kept"),),
           ("tests/test_mma.py",), "test_the_mma_truncates_a_tf32_operands_low_bits",
           "the tf32 mma's emulation multiplies a register's whole float32 value, where the tensor core "
           "truncates it to tf32 (a lo left unrounded would then count bits the GPU drops)"),
    Mutant("tfb-tile-adds-rows-not-offset", 11, TFB,
           (("add_tiles(dqh, acc, q0 + int32(rg * U(16)), int32(n0 * U(8)), g, t, scale, n_q, d, aligned)",
             "add_tiles(dqh, acc, q0, int32(n0 * U(8)), g, t, scale, n_q, d, aligned)   # PLANTED"),),
           T11B, "test_dq_added_a_tile_at_a_time_meets_the_rule",
           "dQ's tile adds: every row group of 16 queries added into the tile's first"),
]

# Chapter 13, the capstone's PyTorch attention: the plumbing around the chapters' kernels.
TA = "kernels.torch_attention"
T13 = ("tests/test_torch_attention.py",)
CH13 = "test_fp32_gradients_match_the_oracle"
MUTANTS += [
    Mutant("ta-groups-averaged", 13, TA,
           (("return dx.view(B, H // group, group, N, d).sum(dim=2)",
             "return dx.view(B, H // group, group, N, d).mean(dim=2)   # PLANTED"),),
           T13, CH13, "grouped-query attention: a KV head's gradient averaged over its group of query heads, "
                      "not summed"),
    Mutant("ta-backward-not-causal", 13, TA,
           (("ctx.options = (causal, scale, block_mask)", "ctx.options = (False, scale, block_mask)   # PLANTED"),),
           T13, CH13, "the backward forgets the causal mask the forward used"),
]

BY_ID = {m.id: m for m in MUTANTS}
assert len(BY_ID) == len(MUTANTS), "mutant ids must be unique"


# --------------------------------------------------------------------------- the import hook

class _MutantLoader(importlib.machinery.SourceFileLoader):
    """Loads the module from its source with the mutant's edits (never from a .pyc)."""

    def __init__(self, mutant: Mutant, fullname: str, path: str):
        super().__init__(fullname, path)
        self.mutant = mutant

    def get_code(self, fullname):
        source = self.mutant.mutated_source(Path(self.path).read_text())
        return compile(source, self.path, "exec", dont_inherit=True)


class _MutantFinder(importlib.abc.MetaPathFinder):
    def __init__(self, mutant: Mutant):
        self.mutant = mutant

    def find_spec(self, fullname, path, target=None):
        if fullname != self.mutant.module:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.origin is None:
            raise MutantError(f"mutant {self.mutant.id}: cannot find {fullname}")
        loader = _MutantLoader(self.mutant, fullname, spec.origin)
        return importlib.util.spec_from_file_location(fullname, spec.origin, loader=loader)


def install(mutant_id: str) -> Mutant:
    """Plant mutant ``mutant_id``: the next import of its module loads the mutated source.
    Must run before anything imports that module."""
    mutant = BY_ID.get(mutant_id)
    if mutant is None:
        raise MutantError(f"WORKBOOK_MUTANT={mutant_id!r}: no such mutant (known: {', '.join(BY_ID)})")
    if mutant.module in sys.modules:
        raise MutantError(f"mutant {mutant_id}: {mutant.module} was imported before the mutant was planted")
    mutant.mutated_source()                     # fail now if a snippet is gone
    sys.meta_path.insert(0, _MutantFinder(mutant))
    return mutant
