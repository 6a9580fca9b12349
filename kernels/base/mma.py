"""Tensor cores from Numba: mma.sync, the register packing it needs, ldmatrix and cp.async.

A tensor core multiplies small matrices in one instruction issued by a whole warp. PTX's
``mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32`` computes D = A B + C for A 16x16
(fp16), B 16x8 (fp16) and C, D 16x8 (fp32): 4096 FLOPs per instruction, where an FMA
does 2. No thread holds a whole matrix. Each of the warp's 32 lanes holds a FRAGMENT, a
few elements of each operand in its registers, at positions the PTX ISA fixes ("Matrix
Fragments for mma.m16n8k16 with floating point type"):

    lane = 4 group + t  (group = lane // 4 in 0..7, t = lane % 4 in 0..3)
    A 16x16, 8 halves:  a[i] = A[group + 8 ((i // 2) % 2), 2 t + i % 2 + 8 (i // 4)]
    B 16x8,  4 halves:  b[i] = B[2 t + i % 2 + 8 (i // 2), group]
    C, D 16x8, 4 fp32:  c[i] = C[group + 8 (i // 2), 2 t + i % 2]

The functions ``a_position``, ``b_position`` and ``c_position`` (and the tf32 ones) are
that table, the single source for the simulator's emulation, the figures and the tests.
Two halves share one 32-bit register, the lower index in the low 16 bits: a kernel
passes A as 4 registers, B as 2, C as 4 floats. bf16 uses the same positions; tf32
(``m16n8k8``, A 16x8, B 8x8) has its own (``a_position_tf32``, ``b_position_tf32``).

Numba has no tensor-core API. A Numba ``@intrinsic`` can emit LLVM inline assembly, and
so any PTX instruction: that is all this module does on the GPU. The device functions:

    mma_f16(a, b, c), mma_bf16(a, b, c)     a: 4 uint32, b: 2 uint32, c: 4 float32 -> 4 float32
    mma_tf32(a, b, c)                       a: 4 uint32, b: 2 uint32 (tf32 bit patterns)
    pack_f16(lo, hi), pack_bf16(lo, hi)     two float32 -> one uint32 (round to nearest even)
    unpack_f16(w)                           one uint32 -> its two fp16 halves as float32 (lo, hi)
    unpack_bf16(w)                          one uint32 -> its two bf16 halves as float32 (lo, hi)
    to_tf32(x)                              float32 -> uint32 (tf32: 10 mantissa bits, rounded)
    split_tf32(x)                           float32 -> (hi, lo) uint32 tf32 patterns: hi = x rounded,
                                            lo = (x - hi) rounded (3xTF32: x = hi + lo to ~2^-22);
                                            on sm_90 and later rounded to nearest even
                                            (cvt.rn.tf32.f32: one instruction), before
                                            sm_90 ties away (cvt.rna: four); ``split_ties()``
    split_tf32_unrounded(x)                 the same hi, lo = x - hi left as it is (float32 bits:
                                            the mma reads a tf32 operand's top 19 bits, so it
                                            truncates lo itself; one instruction less a split)
    split_tf32_at(addr)                     the float32 at a shared address (from shared_address
                                            plus a byte offset) split: one ld.shared; hi as
                                            split_tf32's, lo = x - hi left as it is (float32 bits:
                                            the mma reads a tf32 operand's top 19 bits, so it
                                            truncates lo itself; one instruction less a split)
    split_tf32_at_rounded(addr)             the same with lo rounded, as split_tf32's
    load_words(a, row, col)                 16 bytes of a 2-D array from a[row, col] -> 4 uint32
    store_word(a, row, col, w)              one uint32 into a 2-D 16-bit array at a[row, col .. col + 1]
    store_words(a, row, col, w0, w1, w2, w3)   4 uint32 into a 2-D 32-bit array at a[row, col .. col + 3]
                                            (one 16-byte store: a[row, col] 16-byte aligned)
    float_of_word(w), word_of_float(x)      a uint32's bits as a float32, and back (no conversion)
    red_add_pair(a, row, col, x, y)         a[row, col] += x, a[row, col + 1] += y (float32, one
                                            red.global.add.v2.f32; col even, the pair 8-byte aligned)
    ldmatrix(s, row, col), ldmatrix_trans   four 8x8 b16 matrices from shared memory -> 4 uint32
    shared_address(s, row, col)             the 32-bit shared-memory address of s[row, col] (bytes)
    ldmatrix_at(addr), ldmatrix_trans_at    ldmatrix at an address from shared_address plus a byte
                                            offset: a kernel adds constants to an address it made
                                            once (where indexing an array costs 64-bit arithmetic)
    cp_async(dst, drow, dcol, src, srow, scol)   16 bytes global -> shared, asynchronously
    global_address(a, row, col)             the 64-bit global address of a[row, col] (bytes)
    cp_async_at(saddr, gaddr, nbytes)       cp.async of 16 bytes from a global address (from
                                            global_address plus a byte offset) to a shared one:
                                            the first nbytes (0 or 16) copied, the rest zeros
    cp_async_word_at(saddr, gaddr, nbytes)  the same for one 4-byte word (nbytes 0 or 4)
    cp_async_commit(), cp_async_wait_all(), cp_async_wait_prior()   (all but the last group done)
    cp_async_wait_prior2()                  (all but the last two groups done)

``make_output_store(o_type)`` makes a device function ``store(a, i, j, k, x)`` that writes a
float32 result into a 3-D array: as it is, or rounded to fp16 or bf16 (a kernel that returns
O in its inputs' type writes it so, and no cast follows).

In the simulator the same calls run as Python. mma and ldmatrix need every lane's
registers: each lane posts its fragment to a table shared by its warp, the block meets at
a barrier, each lane computes its own outputs from the rebuilt matrices (in float64, then
rounded to float32 once), and the block meets again before the table can be reused. So
in the simulator EVERY thread of the block must make the same mma calls together (on the
GPU, every lane of a warp: the ``.aligned`` in the instruction's name).
"""

from __future__ import annotations

import functools
import threading

import numpy as np

from kernels.base.inlined import inlined
from kernels.base.runtime import on_simulator

__all__ = ["a_position", "b_position", "c_position", "a_position_tf32", "b_position_tf32",
           "ldmatrix_position", "fragment_a", "fragment_b", "fragment_c", "matrix_from_c",
           "mma_f16", "mma_bf16", "mma_tf32", "pack_f16", "pack_bf16", "unpack_f16", "unpack_bf16", "to_tf32", "split_tf32", "split_tf32_unrounded", "split_tf32_at", "split_tf32_at_rounded",
           "load_words", "store_word", "store_words", "float_of_word", "word_of_float", "red_add_pair", "ldmatrix", "ldmatrix_trans", "shared_address", "ldmatrix_at", "ldmatrix_trans_at", "cp_async", "global_address", "cp_async_at", "cp_async_word_at", "cp_async_commit", "cp_async_wait_all",
           "cp_async_wait_prior", "cp_async_wait_prior2",
           "half_bits", "bf16_bits", "tf32_bits", "TF32_MASK", "SPLIT_LO", "check_split_lo", "splits_for", "split_ties", "words_to_halves", "make_output_store",
           "OUTPUT_TYPES", "PTX"]

M, N, K = 16, 8, 16          # the f16/bf16 shape; tf32 is 16 x 8 x 8


# --------------------------------------------------------------------------- who holds what

def a_position(lane: int, i: int) -> tuple[int, int]:
    """(row, col) of A (16x16) that lane holds as its element i (0..7), f16 or bf16."""
    group, t = lane // 4, lane % 4
    return group + 8 * ((i // 2) % 2), 2 * t + i % 2 + 8 * (i // 4)


def b_position(lane: int, i: int) -> tuple[int, int]:
    """(row k, col n) of B (16x8) that lane holds as its element i (0..3), f16 or bf16."""
    group, t = lane // 4, lane % 4
    return 2 * t + i % 2 + 8 * (i // 2), group


def c_position(lane: int, i: int) -> tuple[int, int]:
    """(row, col) of C and D (16x8, fp32) that lane holds as its element i (0..3)."""
    group, t = lane // 4, lane % 4
    return group + 8 * (i // 2), 2 * t + i % 2


def a_position_tf32(lane: int, i: int) -> tuple[int, int]:
    """(row, col) of A (16x8, tf32) that lane holds as its register i (0..3)."""
    group, t = lane // 4, lane % 4
    return group + 8 * (i % 2), t + 4 * (i // 2)


def b_position_tf32(lane: int, i: int) -> tuple[int, int]:
    """(row k, col n) of B (8x8, tf32) that lane holds as its register i (0..1)."""
    group, t = lane // 4, lane % 4
    return t + 4 * i, group


def ldmatrix_position(lane: int, i: int) -> tuple[int, int, int]:
    """ldmatrix .x4: (matrix, row, col) of the four 8x8 b16 matrices that lane receives as
    its element i (0..7; register i // 2, half i % 2). Lane 8 j + r gives the address of
    row r of matrix j. With .trans, (row, col) are swapped."""
    return i // 2, lane // 4, 2 * (lane % 4) + i % 2


# --------------------------------------------------------------------------- host-side helpers

def half_bits(x) -> np.ndarray:
    """float32 values rounded to fp16, as their 16-bit patterns (uint32); beyond fp16's
    range they become +-inf, as ``cvt.rn.f16x2.f32`` makes them."""
    with np.errstate(over="ignore"):
        return np.asarray(x, np.float32).astype(np.float16).view(np.uint16).astype(np.uint32)


def bf16_bits(x) -> np.ndarray:
    """float32 values rounded to bf16 (to nearest, ties to even), as 16-bit patterns (uint32)."""
    bits = np.atleast_1d(np.asarray(x, np.float32)).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint32)
    nan = np.isnan(np.atleast_1d(np.asarray(x, np.float32)))
    out = np.where(nan, np.uint32(0x7FC0), rounded).astype(np.uint32)
    return out.reshape(np.shape(x))


TF32_MASK = 0xFFFFE000          # a float32's sign, exponent and top 10 mantissa bits: the tf32 it holds
# How a 3xTF32 split leaves lo = x - hi: rounded to tf32, or its float32 bits as they are,
# which the mma truncates to tf32 (split_tf32_at; kernels.tf32_error.split_tf32 models both)
SPLIT_LO = ("rounded", "truncated")


def check_split_lo(lo: str) -> str:
    """``lo`` if it is one of ``SPLIT_LO``, else a ValueError naming it."""
    if lo not in SPLIT_LO:
        raise ValueError(f"lo: expected one of {SPLIT_LO}, got {lo!r}")
    return lo


def tf32_bits(x, ties: str = "away") -> np.ndarray:
    """float32 values rounded to tf32 (10 mantissa bits; to nearest, ties away from zero, as
    ``cvt.rna.tf32.f32``, or with ``ties="even"`` ties to even, as ``cvt.rn.tf32.f32``), as
    float32 bit patterns (uint32) with the low 13 bits zero; Inf and NaN unchanged."""
    if ties not in ("away", "even"):
        raise ValueError(f"ties: expected 'away' or 'even', got {ties!r}")
    bits = np.atleast_1d(np.asarray(x, np.float32)).view(np.uint32).astype(np.uint64)
    # to nearest: add half a tf32 ulp to the magnitude bits, clear the 13 low bits; ties to
    # even add one less where the kept last bit is 0, so an exact tie rounds down to it
    half = 0x1000 if ties == "away" else 0xFFF + ((bits >> 13) & 1)
    out = ((bits + half) & TF32_MASK).astype(np.uint32)
    finite = np.isfinite(np.atleast_1d(np.asarray(x, np.float32)))
    out = np.where(finite, out, np.atleast_1d(np.asarray(x, np.float32)).view(np.uint32))
    return out.reshape(np.shape(x))


def words_to_halves(words, kind: str = "f16") -> np.ndarray:
    """32-bit registers -> their two 16-bit values as float64, (..., 2), low half first."""
    w = np.asarray(words, np.uint64).astype(np.uint32)
    lo, hi = w & 0xFFFF, w >> 16
    if kind == "f16":
        conv = lambda h: h.astype(np.uint16).view(np.float16).astype(np.float64)
    else:
        conv = lambda h: (h.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return np.stack([conv(lo), conv(hi)], axis=-1)


def _pack_pairs(bits) -> np.ndarray:
    bits = np.asarray(bits, np.uint32)
    return (bits[..., 0::2] | (bits[..., 1::2] << 16)).astype(np.uint32)


def _fragment(x, kind, position, position_tf32, halves):
    """Every lane's registers for an operand: element i of lane l is x[position(l, i)], two
    fp16/bf16 halves a register (``halves`` of them a lane), or one tf32 a register."""
    x = np.asarray(x, np.float32)
    if kind == "tf32":
        return np.array([[tf32_bits(x[position_tf32(l, i)]) for i in range(halves // 2)] for l in range(32)],
                        np.uint32)
    conv = half_bits if kind == "f16" else bf16_bits
    return _pack_pairs(np.array([[conv(x[position(l, i)]) for i in range(halves)] for l in range(32)], np.uint32))


def fragment_a(a, kind: str = "f16") -> np.ndarray:
    """The registers every lane holds for A (16x16 f16/bf16, or 16x8 tf32): (32, 4) uint32."""
    return _fragment(a, kind, a_position, a_position_tf32, 8)


def fragment_b(b, kind: str = "f16") -> np.ndarray:
    """The registers every lane holds for B (16x8 f16/bf16, or 8x8 tf32): (32, 2) uint32."""
    return _fragment(b, kind, b_position, b_position_tf32, 4)


def fragment_c(c) -> np.ndarray:
    """The floats every lane holds for C (16x8 fp32): (32, 4) float32."""
    c = np.asarray(c, np.float32)
    return np.array([[c[c_position(l, i)] for i in range(4)] for l in range(32)], np.float32)


def matrix_from_c(frags) -> np.ndarray:
    """The 16x8 matrix that the lanes' accumulator registers (32, 4) hold."""
    out = np.zeros((M, N), np.float64)
    for lane in range(32):
        for i in range(4):
            out[c_position(lane, i)] = frags[lane][i]
    return out


# --------------------------------------------------------------------------- the split's rounding

def split_ties() -> str:
    """How ``split_tf32`` rounds on the current device: "even" (``cvt.rn.tf32.f32``, sm_90
    and later: one instruction) or "away" (``cvt.rna.tf32.f32``, all sm_80 has). The
    simulator and a compile with no GPU (``kernels.base.ptx_check``: sm_90) round as the
    H100 does. Asked when a kernel compiles, not at import (a process picks its GPU first)."""
    if on_simulator():
        return "even"
    from numba import cuda
    try:
        cc = tuple(cuda.get_current_device().compute_capability)
    except Exception:                           # no driver: PTX compiled for sm_90
        return "even"
    return "even" if cc >= (9, 0) else "away"


# --------------------------------------------------------------------------- the PTX each function emits

PTX = {
    "mma_f16": "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",
    "mma_bf16": "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
    "mma_tf32": "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32",
    "pack_f16": "cvt.rn.f16x2.f32",
    "pack_bf16": "cvt.rn.bf16x2.f32",
    "to_tf32": "cvt.rna.tf32.f32",
    "split_tf32": "sub.f32 r,",                  # within: cvt.rn.tf32.f32 (cvt.rna before sm_90) twice around it
    "split_tf32_unrounded": "sub.f32 rest,",     # lo = x - hi, its bits moved out as they are
    "split_tf32_at": "ld.shared.f32 x,",         # then cvt.rn.tf32.f32 and sub.f32 (and, rounded, a cvt more)
    "ldmatrix": "ldmatrix.sync.aligned.m8n8.x4.shared.b16",
    "ldmatrix_trans": "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16",
    "cp_async": "cp.async.cg.shared.global",
    "cp_async_at": "cp.async.cg.shared.global [%r",     # a 32-bit shared address, then the source size
    "cp_async_word_at": "cp.async.ca.shared.global [%r",  # 4 bytes (.cg takes 16 only)
    "cp_async_commit": "cp.async.commit_group",
    "cp_async_wait_all": "cp.async.wait_all",
    "cp_async_wait_prior": "cp.async.wait_group 1",
    "cp_async_wait_prior2": "cp.async.wait_group 2",
}


# --------------------------------------------------------------------------- the simulator's emulation

def _sim_thread():
    t = threading.current_thread()
    if not hasattr(t, "_manager"):
        raise RuntimeError("tensor-core emulation: call it from a kernel running in the simulator")
    return t


def _warp_exchange(value):
    """Post this lane's value, wait for the block, return (lane, the warp's 32 values);
    the caller must call _release() after reading."""
    t = _sim_thread()
    warp, lane = t.thread_id // 32, t.thread_id % 32
    table = t._manager.__dict__.setdefault("_exchange_table", {})
    row = table.setdefault(warp, [None] * 32)
    row[lane] = value
    t.syncthreads()                      # every lane has posted
    return lane, list(row)


def _release():
    _sim_thread().syncthreads()          # every lane has read: the table may be reused


def _index_arrays(position, count):
    """position(lane, i) for every lane and i, as two (32, count) index arrays."""
    rows = np.array([[position(l, i)[0] for i in range(count)] for l in range(32)])
    cols = np.array([[position(l, i)[1] for i in range(count)] for l in range(32)])
    return rows, cols


_OPERANDS = {   # kind: (A's positions, elements a lane; B's; A's shape, B's shape)
    "f16": (_index_arrays(a_position, 8), _index_arrays(b_position, 4), (16, 16), (16, 8)),
    "bf16": (_index_arrays(a_position, 8), _index_arrays(b_position, 4), (16, 16), (16, 8)),
    "tf32": (_index_arrays(a_position_tf32, 4), _index_arrays(b_position_tf32, 2), (16, 8), (8, 8)),
}


def _operand(words, kind, positions, shape):
    """An operand rebuilt from the lanes' registers, words (32, registers) uint32."""
    if kind == "tf32":
        # the tensor core reads a tf32 operand's sign, exponent and 10 mantissa bits: the 13
        # low bits of the register are dropped (truncated), whatever they hold
        # (tests/test_mma.py holds the GPU and this emulation to it)
        values = (words & np.uint32(TF32_MASK)).view(np.float32).astype(np.float64)
    else:
        values = words_to_halves(words, kind).reshape(32, -1)
    out = np.zeros(shape, np.float64)
    out[positions] = values
    return out


def _sim_mma(kind, a, b, c):
    """Each lane posts its A and B registers; the first lane past the barrier rebuilds A
    and B and computes A B (in float64: exact for these operands) for the warp; each lane
    adds its own C and rounds once to float32."""
    t = _sim_thread()
    warp, lane = t.thread_id // 32, t.thread_id % 32
    table = t._manager.__dict__.setdefault("_mma_table", {})
    entry = table.get(warp)
    if entry is None:
        entry = table.setdefault(warp, {"a": np.zeros((32, 4), np.uint32), "b": np.zeros((32, 2), np.uint32),
                                        "product": None, "lock": threading.Lock()})
    if lane == 0:
        entry["product"] = None          # (every lane has read the last one: it passed the barrier)
    entry["a"][lane] = [int(x) & 0xFFFFFFFF for x in a]
    entry["b"][lane] = [int(x) & 0xFFFFFFFF for x in b]
    t.syncthreads()                      # every lane has posted
    with entry["lock"]:
        if entry["product"] is None:
            pa, pb, sa, sb = _OPERANDS[kind]
            entry["product"] = _operand(entry["a"], kind, pa, sa) @ _operand(entry["b"], kind, pb, sb)
    product = entry["product"]
    out = tuple(np.float32(product[c_position(lane, i)] + float(c[i])) for i in range(4))
    t.syncthreads()                      # every lane has read: the table may be reused
    return out


def _sim_pack(bits_of):
    def pack(lo, hi):
        return np.uint32(int(bits_of(np.float32(lo))) | (int(bits_of(np.float32(hi))) << 16))
    return pack


def _sim_unpack_f16(w):
    lo, hi = words_to_halves(np.uint64(int(w) & 0xFFFFFFFF))
    return np.float32(lo), np.float32(hi)


def _sim_unpack_bf16(w):
    w = int(w) & 0xFFFFFFFF
    lo, hi = np.array([(w & 0xFFFF) << 16, w & 0xFFFF0000], np.uint32).view(np.float32)
    return np.float32(lo), np.float32(hi)


def _sim_to_tf32(x):
    return np.uint32(int(tf32_bits(np.float32(x))))


def _sim_split_tf32(x, round_lo=True):
    x = np.float32(x)
    hi = np.uint32(int(tf32_bits(x, split_ties())))
    with np.errstate(invalid="ignore", over="ignore"):
        rest = np.float32(x - np.array(hi, np.uint32).view(np.float32))
    if not round_lo:                                       # lo's float32 bits: the mma truncates them
        return hi, np.uint32(int(np.array(rest, np.float32).view(np.uint32)))
    return hi, np.uint32(int(tf32_bits(rest, split_ties())))


def _sim_split_tf32_at(round_lo):
    def split_at(addr):
        array, row, col = addr.element()
        x = np.asarray(array[row, col])                    # ld.shared.f32: the word's bits as a float32
        return _sim_split_tf32(x.view(np.float32) if x.dtype != np.float32 else x, round_lo)
    return split_at


def _sim_load_words(a, row, col):
    raw = np.ascontiguousarray(a[row, col:col + 16 // a.itemsize]).view(np.uint32)
    return tuple(np.uint32(w) for w in raw)


def _sim_store_word(a, row, col, w):
    w = int(w) & 0xFFFFFFFF
    a[row, col] = w & 0xFFFF
    a[row, col + 1] = w >> 16


_sim_red_lock = threading.Lock()


def _sim_store_words(a, row, col, w0, w1, w2, w3):
    a[row, col:col + 4] = np.array([w0, w1, w2, w3], dtype=np.uint64).astype(np.uint32).view(a.dtype)


def _sim_float_of_word(w):
    return np.uint32(int(w) & 0xFFFFFFFF).view(np.float32)


def _sim_word_of_float(x):
    return np.float32(x).view(np.uint32)


def _sim_red_add_pair(a, row, col, x, y):
    with _sim_red_lock:                      # the simulator's threads are Python threads
        a[row, col] += np.float32(x)
        a[row, col + 1] += np.float32(y)


def _sim_ldmatrix(trans):
    def load(s, row, col):
        lane, posted = _warp_exchange((s, int(row), int(col)))
        out = []
        for i in range(8):
            j, r, cc = ldmatrix_position(lane, i)
            if trans:
                r, cc = cc, r
            arr, prow, pcol = posted[8 * j + r]
            out.append(int(np.asarray(arr[prow, pcol + cc]).view(np.uint16)))
        _release()
        return tuple(np.uint32(out[2 * k] | (out[2 * k + 1] << 16)) for k in range(4))
    return load


class _SimAddress:
    """The simulator's shared address: a 2-D array and a byte offset from its [0, 0]."""

    def __init__(self, array, offset):
        self.array, self.offset = array, int(offset)

    def __add__(self, nbytes):
        return _SimAddress(self.array, self.offset + int(nbytes))

    def element(self):
        row, rest = divmod(self.offset, self.array.strides[0])
        return self.array, row, rest // self.array.itemsize


def _sim_address(a, row, col):
    """shared_address and global_address in the simulator: the array and a byte offset."""
    return _SimAddress(a, int(row) * a.strides[0] + int(col) * a.itemsize)


def _sim_ldmatrix_at(trans):
    load = _sim_ldmatrix(trans)

    def load_at(addr):
        return load(*addr.element())
    return load_at


def _sim_cp_async(dst, drow, dcol, src, srow, scol):
    n = 16 // src.itemsize
    chunk = np.asarray(src[srow, scol:scol + n])          # 16 bytes, copied as bits (float32 into uint32 too)
    dst[drow, dcol:dcol + 16 // dst.itemsize] = chunk.view(dst.dtype) if chunk.dtype != dst.dtype else chunk


def _sim_cp_async_at(saddr, gaddr, nbytes):
    dst, drow, dcol = saddr.element()
    n = 16 // dst.itemsize
    if int(nbytes) == 0:
        dst[drow, dcol:dcol + n] = 0
    else:
        src, srow, scol = gaddr.element()
        _sim_cp_async(dst, drow, dcol, src, srow, scol)


def _sim_cp_async_word_at(saddr, gaddr, nbytes):
    dst, drow, dcol = saddr.element()
    if dst.itemsize != 4:
        raise TypeError(f"cp_async_word_at: expected a 4-byte shared array, got {dst.dtype}")
    if int(nbytes) == 0:
        dst[drow, dcol] = 0
    else:
        src, srow, scol = gaddr.element()
        dst[drow, dcol:dcol + 1] = np.asarray(src[srow, scol:scol + 1]).view(dst.dtype)


def _sim_nothing():
    return None


# --------------------------------------------------------------------------- the GPU's intrinsics

def _gpu_functions():
    from llvmlite import ir
    from numba.core import types
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    i32, f32 = ir.IntType(32), ir.FloatType()

    def asm(builder, out_types, text, constraints, args, side_effect=False):
        """Emit one inline-assembly block; returns its outputs as a list."""
        if not out_types:
            ret = ir.VoidType()
        elif len(out_types) == 1:
            ret = out_types[0]
        else:
            ret = ir.LiteralStructType(out_types)
        fnty = ir.FunctionType(ret, [a.type for a in args])
        value = builder.call(ir.InlineAsm(fnty, text, constraints, side_effect=side_effect), args)
        if not out_types:
            return []
        if len(out_types) == 1:
            return [value]
        return [builder.extract_value(value, k) for k in range(len(out_types))]

    def tuple_of(ty, n, kind):
        return (isinstance(ty, types.BaseTuple) and len(ty) == n
                and all(isinstance(e, kind) for e in ty.types))

    def elements(context, builder, ty, value, target):
        return [context.cast(builder, builder.extract_value(value, k), ty.types[k], target)
                for k in range(len(ty))]

    def make_mma(name, dtype_ab, shape):
        text = (f"mma.sync.aligned.{shape}.row.col.f32.{dtype_ab}.{dtype_ab}.f32 "
                "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};")
        constraints = "=f,=f,=f,=f," + ",".join(["r"] * 6 + ["f"] * 4)
        result = types.UniTuple(types.float32, 4)

        @intrinsic
        def mma(typingctx, a, b, c):
            if not (tuple_of(a, 4, types.Integer) and tuple_of(b, 2, types.Integer) and tuple_of(c, 4, types.Number)):
                raise TypeError(f"{name}(a, b, c): expected a = 4 uint32 registers, b = 2, c = 4 float32; "
                                f"got {a}, {b}, {c}")

            def codegen(context, builder, sig, args):
                ta, tb, tc = sig.args
                ops = (elements(context, builder, ta, args[0], types.uint32)
                       + elements(context, builder, tb, args[1], types.uint32)
                       + elements(context, builder, tc, args[2], types.float32))
                outs = asm(builder, [f32] * 4, text, constraints, ops)
                return context.make_tuple(builder, result, outs)

            return result(a, b, c), codegen

        return mma

    def make_pack(name, text):
        @intrinsic
        def pack(typingctx, lo, hi):
            if not (isinstance(lo, types.Number) and isinstance(hi, types.Number)):
                raise TypeError(f"{name}(lo, hi): expected two numbers, got {lo}, {hi}")

            def codegen(context, builder, sig, args):
                lo_v = context.cast(builder, args[0], sig.args[0], types.float32)
                hi_v = context.cast(builder, args[1], sig.args[1], types.float32)
                # cvt.rn.{f16,bf16}x2.f32 d, a, b puts a in the HIGH half, b in the low one
                return asm(builder, [i32], text + " $0, $1, $2;", "=r,f,f", [hi_v, lo_v])[0]

            return types.uint32(lo, hi), codegen

        return pack

    @intrinsic
    def unpack_f16(typingctx, w):
        if not isinstance(w, types.Integer):
            raise TypeError(f"unpack_f16(w): expected a 32-bit register, got {w}")
        result = types.UniTuple(types.float32, 2)

        def codegen(context, builder, sig, args):
            word = context.cast(builder, args[0], sig.args[0], types.uint32)
            halves = [builder.trunc(word, ir.IntType(16)),
                      builder.trunc(builder.lshr(word, ir.Constant(i32, 16)), ir.IntType(16))]
            vals = [builder.fpext(builder.bitcast(h, ir.HalfType()), f32) for h in halves]
            return context.make_tuple(builder, result, vals)

        return result(w), codegen

    @intrinsic
    def unpack_bf16(typingctx, w):
        if not isinstance(w, types.Integer):
            raise TypeError(f"unpack_bf16(w): expected a 32-bit register, got {w}")
        result = types.UniTuple(types.float32, 2)

        def codegen(context, builder, sig, args):
            word = context.cast(builder, args[0], sig.args[0], types.uint32)
            # a bf16 is the top half of the float32 it rounds: shift it there, or mask the low half off
            bits = [builder.shl(word, ir.Constant(i32, 16)), builder.and_(word, ir.Constant(i32, 0xFFFF0000))]
            return context.make_tuple(builder, result, [builder.bitcast(b, f32) for b in bits])

        return result(w), codegen

    @intrinsic
    def to_tf32(typingctx, x):
        if not isinstance(x, types.Number):
            raise TypeError(f"to_tf32(x): expected a number, got {x}")

        def codegen(context, builder, sig, args):
            v = context.cast(builder, args[0], sig.args[0], types.float32)
            return asm(builder, [i32], "cvt.rna.tf32.f32 $0, $1;", "=r,f", [v])[0]

        return types.uint32(x), codegen

    def make_split(name, round_lo):
        @intrinsic
        def split(typingctx, x):
            if not isinstance(x, types.Number):
                raise TypeError(f"{name}(x): expected a number, got {x}")
            result = types.UniTuple(types.uint32, 2)

            def codegen(context, builder, sig, args):
                v = context.cast(builder, args[0], sig.args[0], types.float32)
                # hi = x rounded to tf32; lo = (x - hi), rounded or (round_lo False) left for the
                # mma to truncate (a .b32 register is a valid f32 operand); cvt.rn (ties to even)
                # is one instruction on sm_90 (F2FP.TF32), cvt.rna four (an add, a mask and the
                # check for Inf and NaN), and all sm_80 has
                cvt = "cvt.rna.tf32.f32" if split_ties() == "away" else "cvt.rn.tf32.f32"
                if round_lo:
                    body = f"{{ .reg .f32 r; {cvt} $0, $2; sub.f32 r, $2, $0; {cvt} $1, r; }}"
                else:
                    body = f"{{ .reg .f32 rest; {cvt} $0, $2; sub.f32 rest, $2, $0; mov.b32 $1, rest; }}"
                return context.make_tuple(builder, result, asm(builder, [i32, i32], body, "=&r,=r,f", [v]))

            return result(x), codegen

        return split

    split_tf32 = make_split("split_tf32", True)
    split_tf32_unrounded = make_split("split_tf32_unrounded", False)

    def element_pointer(context, builder, aryty, ary_value, row, rowty, col, colty):
        ary = context.make_array(aryty)(context, builder, value=ary_value)
        inds = [context.cast(builder, row, rowty, types.intp), context.cast(builder, col, colty, types.intp)]
        return cgutils.get_item_pointer(context, builder, aryty, ary, inds)

    def is_2d(ty):
        return isinstance(ty, types.Array) and ty.ndim == 2

    @intrinsic
    def load_words(typingctx, array, row, col):
        if not is_2d(array):
            raise TypeError(f"load_words(a, row, col): expected a 2-D array, got {array}")
        result = types.UniTuple(types.uint32, 4)

        def codegen(context, builder, sig, args):
            ptr = element_pointer(context, builder, sig.args[0], args[0], args[1], sig.args[1], args[2], sig.args[2])
            vec = builder.load(builder.bitcast(ptr, ir.VectorType(i32, 4).as_pointer()), align=16)
            return context.make_tuple(builder, result,
                                      [builder.extract_element(vec, ir.Constant(i32, k)) for k in range(4)])

        return result(array, row, col), codegen

    def make_address(name, space, bits):
        """``name(a, row, col)``: the address of a[row, col] in the ``space`` state space (bytes),
        ``bits`` wide (shared: 32, what ldmatrix and cp.async take; global: 64)."""
        i64 = ir.IntType(64)
        if bits == 32:
            out, result, constraints = i32, types.uint32, "=r,l"
            body = f"{{ .reg .u64 s; cvta.to.{space}.u64 s, $1; cvt.u32.u64 $0, s; }}"
        else:
            out, result, constraints = i64, types.uint64, "=l,l"
            body = f"cvta.to.{space}.u64 $0, $1;"

        @intrinsic
        def address(typingctx, array, row, col):
            if not is_2d(array):
                raise TypeError(f"{name}(a, row, col): expected a 2-D {space} array, got {array}")

            def codegen(context, builder, sig, args):
                ptr = element_pointer(context, builder, sig.args[0], args[0], args[1], sig.args[1], args[2],
                                      sig.args[2])
                return asm(builder, [out], body, constraints, [builder.ptrtoint(ptr, i64)])[0]

            return result(array, row, col), codegen

        return address

    shared_address = make_address("shared_address", "shared", 32)
    global_address = make_address("global_address", "global", 64)

    def make_split_at(name, round_lo):
        @intrinsic
        def split_at(typingctx, addr):
            if not isinstance(addr, types.Integer):
                raise TypeError(f"{name}(addr): expected a 32-bit shared address, got {addr}")
            result = types.UniTuple(types.uint32, 2)

            def codegen(context, builder, sig, args):
                a = context.cast(builder, args[0], sig.args[0], types.uint32)
                if not round_lo:
                    # lo = x - hi as float32 bits: the mma reads only a tf32 operand's top 19
                    # bits, so lo reaches the tensor core truncated, with no instruction here
                    cvt = "cvt.rna.tf32.f32" if split_ties() == "away" else "cvt.rn.tf32.f32"
                    body = f"{{ .reg .f32 x; ld.shared.f32 x, [$2]; {cvt} $0, x; sub.f32 $1, x, $0; }}"
                elif split_ties() == "away":
                    # before sm_90 lo is rounded by integer arithmetic (add half a tf32 ulp to the
                    # magnitude bits, clear the 13 low bits): cvt.rna's check for Inf and NaN costs
                    # two more instructions, and lo is finite wherever x is (for x = Inf or NaN, hi
                    # carries it and lo is a finite leftover)
                    body = ("{ .reg .f32 x, r; .reg .b32 u; ld.shared.f32 x, [$2]; cvt.rna.tf32.f32 $0, x; "
                            "sub.f32 r, x, $0; mov.b32 u, r; add.u32 u, u, 4096; and.b32 $1, u, -8192; }")
                else:
                    body = ("{ .reg .f32 x, r; ld.shared.f32 x, [$2]; cvt.rn.tf32.f32 $0, x; "
                            "sub.f32 r, x, $0; cvt.rn.tf32.f32 $1, r; }")
                outs = asm(builder, [i32, i32], body, "=&r,=r,r,~{memory}", [a], side_effect=True)
                return context.make_tuple(builder, result, outs)

            return result(addr), codegen

        return split_at

    split_tf32_at = make_split_at("split_tf32_at", False)
    split_tf32_at_rounded = make_split_at("split_tf32_at_rounded", True)

    def make_ldmatrix_at(text):
        result = types.UniTuple(types.uint32, 4)

        @intrinsic
        def load_at(typingctx, addr):
            if not isinstance(addr, types.Integer):
                raise TypeError(f"ldmatrix_at(addr): expected a 32-bit shared address, got {addr}")

            def codegen(context, builder, sig, args):
                a = context.cast(builder, args[0], sig.args[0], types.uint32)
                outs = asm(builder, [i32] * 4, text + " {$0,$1,$2,$3}, [$4];", "=r,=r,=r,=r,r,~{memory}", [a],
                           side_effect=True)
                return context.make_tuple(builder, result, outs)

            return result(addr), codegen

        return load_at

    @intrinsic
    def store_word(typingctx, array, row, col, w):
        if not (is_2d(array) and array.dtype.bitwidth == 16 and isinstance(w, types.Integer)):
            raise TypeError(f"store_word(a, row, col, w): expected a 2-D 16-bit array and a word, got {array}, {w}")

        def codegen(context, builder, sig, args):
            ptr = element_pointer(context, builder, sig.args[0], args[0], args[1], sig.args[1], args[2], sig.args[2])
            word = context.cast(builder, args[3], sig.args[3], types.uint32)
            builder.store(word, builder.bitcast(ptr, i32.as_pointer()), align=4)
            return context.get_dummy_value()

        return types.void(array, row, col, w), codegen

    @intrinsic
    def store_words(typingctx, array, row, col, w0, w1, w2, w3):
        if not (is_2d(array) and array.dtype.bitwidth == 32
                and all(isinstance(w, types.Integer) for w in (w0, w1, w2, w3))):
            raise TypeError(f"store_words(a, row, col, w0, w1, w2, w3): expected a 2-D 32-bit array and four words, "
                            f"got {array}, {w0}, {w1}, {w2}, {w3}")

        def codegen(context, builder, sig, args):
            ptr = element_pointer(context, builder, sig.args[0], args[0], args[1], sig.args[1], args[2], sig.args[2])
            vec = ir.Constant(ir.VectorType(i32, 4), ir.Undefined)
            for k in range(4):
                word = context.cast(builder, args[3 + k], sig.args[3 + k], types.uint32)
                vec = builder.insert_element(vec, word, ir.Constant(i32, k))
            builder.store(vec, builder.bitcast(ptr, ir.VectorType(i32, 4).as_pointer()), align=16)
            return context.get_dummy_value()

        return types.void(array, row, col, w0, w1, w2, w3), codegen

    @intrinsic
    def float_of_word(typingctx, w):
        if not isinstance(w, types.Integer):
            raise TypeError(f"float_of_word(w): expected a 32-bit word, got {w}")

        def codegen(context, builder, sig, args):
            return builder.bitcast(context.cast(builder, args[0], sig.args[0], types.uint32), ir.FloatType())

        return types.float32(w), codegen

    @intrinsic
    def word_of_float(typingctx, x):
        if not isinstance(x, types.Number):
            raise TypeError(f"word_of_float(x): expected a number, got {x}")

        def codegen(context, builder, sig, args):
            return builder.bitcast(context.cast(builder, args[0], sig.args[0], types.float32), i32)

        return types.uint32(x), codegen

    @intrinsic
    def red_add_pair(typingctx, array, row, col, x, y):
        if not (is_2d(array) and array.dtype == types.float32):
            raise TypeError(f"red_add_pair(a, row, col, x, y): expected a 2-D float32 array, got {array}")

        def codegen(context, builder, sig, args):
            ptr = element_pointer(context, builder, sig.args[0], args[0], args[1], sig.args[1], args[2], sig.args[2])
            vals = [context.cast(builder, args[k], sig.args[k], types.float32) for k in (3, 4)]
            asm(builder, [], "red.global.add.v2.f32 [$0], {$1, $2};", "l,f,f,~{memory}",
                [builder.ptrtoint(ptr, ir.IntType(64)), *vals], side_effect=True)
            return context.get_dummy_value()

        return types.void(array, row, col, x, y), codegen

    def make_ldmatrix(text):
        result = types.UniTuple(types.uint32, 4)

        @intrinsic
        def load(typingctx, array, row, col):
            if not (is_2d(array) and array.dtype.bitwidth == 16):
                raise TypeError(f"ldmatrix(s, row, col): expected a 2-D shared array of 16-bit elements, got {array}")

            def codegen(context, builder, sig, args):
                ptr = element_pointer(context, builder, sig.args[0], args[0], args[1], sig.args[1], args[2], sig.args[2])
                addr = builder.ptrtoint(ptr, ir.IntType(64))
                body = ("{ .reg .u64 s; cvta.to.shared.u64 s, $4; " + text + " {$0,$1,$2,$3}, [s]; }")
                outs = asm(builder, [i32] * 4, body, "=r,=r,=r,=r,l,~{memory}", [addr], side_effect=True)
                return context.make_tuple(builder, result, outs)

            return result(array, row, col), codegen

        return load

    @intrinsic
    def cp_async(typingctx, dst, drow, dcol, src, srow, scol):
        if not (is_2d(dst) and is_2d(src)):
            raise TypeError(f"cp_async(dst, drow, dcol, src, srow, scol): expected 2-D arrays, got {dst}, {src}")

        def codegen(context, builder, sig, args):
            d = element_pointer(context, builder, sig.args[0], args[0], args[1], sig.args[1], args[2], sig.args[2])
            s = element_pointer(context, builder, sig.args[3], args[3], args[4], sig.args[4], args[5], sig.args[5])
            body = ("{ .reg .u64 d, s; cvta.to.shared.u64 d, $0; cvta.to.global.u64 s, $1; "
                    "cp.async.cg.shared.global [d], [s], 16; }")
            asm(builder, [], body, "l,l,~{memory}",
                [builder.ptrtoint(d, ir.IntType(64)), builder.ptrtoint(s, ir.IntType(64))], side_effect=True)
            return context.get_dummy_value()

        return types.void(dst, drow, dcol, src, srow, scol), codegen

    def make_cp_async_at(name, text):
        """``name(saddr, gaddr, nbytes)``: cp.async by addresses, ``text`` the instruction up to
        its source size (cp.async.cg copies 16 bytes only, .ca also 4 and 8)."""
        @intrinsic
        def copy_at(typingctx, saddr, gaddr, nbytes):
            if not all(isinstance(x, types.Integer) for x in (saddr, gaddr, nbytes)):
                raise TypeError(f"{name}(saddr, gaddr, nbytes): expected integers, got {saddr}, {gaddr}, {nbytes}")

            def codegen(context, builder, sig, args):
                s = context.cast(builder, args[0], sig.args[0], types.uint32)
                g = context.cast(builder, args[1], sig.args[1], types.uint64)
                n = context.cast(builder, args[2], sig.args[2], types.uint32)
                asm(builder, [], text + ", $2;", "r,l,r,~{memory}", [s, g, n], side_effect=True)
                return context.get_dummy_value()

            return types.void(saddr, gaddr, nbytes), codegen

        return copy_at

    cp_async_at = make_cp_async_at("cp_async_at", "cp.async.cg.shared.global [$0], [$1], 16")
    cp_async_word_at = make_cp_async_at("cp_async_word_at", "cp.async.ca.shared.global [$0], [$1], 4")

    def make_fence(text):
        @intrinsic
        def fence(typingctx):
            def codegen(context, builder, sig, args):
                asm(builder, [], text, "~{memory}", [], side_effect=True)
                return context.get_dummy_value()

            return types.void(), codegen

        return fence

    return dict(
        mma_f16=make_mma("mma_f16", "f16", "m16n8k16"),
        mma_bf16=make_mma("mma_bf16", "bf16", "m16n8k16"),
        mma_tf32=make_mma("mma_tf32", "tf32", "m16n8k8"),
        pack_f16=make_pack("pack_f16", "cvt.rn.f16x2.f32"),
        pack_bf16=make_pack("pack_bf16", "cvt.rn.bf16x2.f32"),
        unpack_f16=unpack_f16,
        unpack_bf16=unpack_bf16,
        to_tf32=to_tf32,
        split_tf32=split_tf32,
        split_tf32_unrounded=split_tf32_unrounded,
        split_tf32_at=split_tf32_at,
        split_tf32_at_rounded=split_tf32_at_rounded,
        load_words=load_words,
        store_word=store_word,
        store_words=store_words,
        float_of_word=float_of_word,
        word_of_float=word_of_float,
        red_add_pair=red_add_pair,
        ldmatrix=make_ldmatrix("ldmatrix.sync.aligned.m8n8.x4.shared.b16"),
        ldmatrix_trans=make_ldmatrix("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16"),
        shared_address=shared_address,
        ldmatrix_at=make_ldmatrix_at("ldmatrix.sync.aligned.m8n8.x4.shared.b16"),
        ldmatrix_trans_at=make_ldmatrix_at("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16"),
        cp_async=cp_async,
        global_address=global_address,
        cp_async_at=cp_async_at,
        cp_async_word_at=cp_async_word_at,
        cp_async_commit=make_fence("cp.async.commit_group;"),
        cp_async_wait_all=make_fence("cp.async.wait_all;"),
        cp_async_wait_prior=make_fence("cp.async.wait_group 1;"),
        cp_async_wait_prior2=make_fence("cp.async.wait_group 2;"),
    )


def _sim_functions():
    return dict(
        mma_f16=lambda a, b, c: _sim_mma("f16", a, b, c),
        mma_bf16=lambda a, b, c: _sim_mma("bf16", a, b, c),
        mma_tf32=lambda a, b, c: _sim_mma("tf32", a, b, c),
        pack_f16=_sim_pack(half_bits),
        pack_bf16=_sim_pack(bf16_bits),
        unpack_f16=_sim_unpack_f16,
        unpack_bf16=_sim_unpack_bf16,
        to_tf32=_sim_to_tf32,
        split_tf32=_sim_split_tf32,
        split_tf32_unrounded=lambda x: _sim_split_tf32(x, False),
        split_tf32_at=_sim_split_tf32_at(False),
        split_tf32_at_rounded=_sim_split_tf32_at(True),
        load_words=_sim_load_words,
        store_word=_sim_store_word,
        store_words=_sim_store_words,
        float_of_word=_sim_float_of_word,
        word_of_float=_sim_word_of_float,
        red_add_pair=_sim_red_add_pair,
        ldmatrix=_sim_ldmatrix(False),
        ldmatrix_trans=_sim_ldmatrix(True),
        shared_address=_sim_address,
        ldmatrix_at=_sim_ldmatrix_at(False),
        ldmatrix_trans_at=_sim_ldmatrix_at(True),
        cp_async=_sim_cp_async,
        global_address=_sim_address,
        cp_async_at=_sim_cp_async_at,
        cp_async_word_at=_sim_cp_async_word_at,
        cp_async_commit=_sim_nothing,
        cp_async_wait_all=_sim_nothing,
        cp_async_wait_prior=_sim_nothing,
        cp_async_wait_prior2=_sim_nothing,
    )


_functions = _sim_functions() if on_simulator() else _gpu_functions()
mma_f16 = _functions["mma_f16"]
mma_bf16 = _functions["mma_bf16"]
mma_tf32 = _functions["mma_tf32"]
pack_f16 = _functions["pack_f16"]
pack_bf16 = _functions["pack_bf16"]
unpack_f16 = _functions["unpack_f16"]
unpack_bf16 = _functions["unpack_bf16"]
to_tf32 = _functions["to_tf32"]
split_tf32 = _functions["split_tf32"]
split_tf32_unrounded = _functions["split_tf32_unrounded"]
split_tf32_at = _functions["split_tf32_at"]
split_tf32_at_rounded = _functions["split_tf32_at_rounded"]
load_words = _functions["load_words"]
store_word = _functions["store_word"]
store_words = _functions["store_words"]
float_of_word = _functions["float_of_word"]
word_of_float = _functions["word_of_float"]
red_add_pair = _functions["red_add_pair"]
ldmatrix = _functions["ldmatrix"]
ldmatrix_trans = _functions["ldmatrix_trans"]
shared_address = _functions["shared_address"]
ldmatrix_at = _functions["ldmatrix_at"]
ldmatrix_trans_at = _functions["ldmatrix_trans_at"]
cp_async = _functions["cp_async"]
global_address = _functions["global_address"]
cp_async_at = _functions["cp_async_at"]
cp_async_word_at = _functions["cp_async_word_at"]
cp_async_commit = _functions["cp_async_commit"]
cp_async_wait_all = _functions["cp_async_wait_all"]
cp_async_wait_prior = _functions["cp_async_wait_prior"]
cp_async_wait_prior2 = _functions["cp_async_wait_prior2"]


OUTPUT_TYPES = (None, "f16", "bf16")       # a result written as float32, or rounded to fp16 or bf16


@functools.lru_cache(maxsize=None)
def make_output_store(o_type: str | None = None):
    """Device function ``store(a, i, j, k, x)``: a[i, j, k] = x for a float32 x. ``o_type``
    None: ``a`` is float32 and x goes in as it is; "f16" or "bf16": ``a`` holds 16-bit
    patterns (uint16) and x goes in rounded to nearest even (``cvt.rn``, one instruction:
    ``pack_f16`` / ``pack_bf16`` with a zero in the high half)."""
    from numba import cuda, float32, uint16, uint32

    if o_type not in OUTPUT_TYPES:
        raise ValueError(f"o_type: expected one of {OUTPUT_TYPES}, got {o_type!r}")
    if o_type is None:
        @inlined
        def store(a, i, j, k, x):
            a[i, j, k] = x

        return store
    pack = pack_bf16 if o_type == "bf16" else pack_f16

    @inlined
    def store_rounded(a, i, j, k, x):
        a[i, j, k] = uint16(pack(x, float32(0.0)) & uint32(0xFFFF))

    return store_rounded


def splits_for(lo: str):
    """(the register split, the shared-address split) that leave lo = x - hi as ``lo`` says:
    "rounded" (``split_tf32``, ``split_tf32_at_rounded``) or "truncated", its float32 bits for
    the mma to truncate (``split_tf32_unrounded``, ``split_tf32_at``)."""
    if check_split_lo(lo) == "rounded":
        return split_tf32, split_tf32_at_rounded
    return split_tf32_unrounded, split_tf32_at
