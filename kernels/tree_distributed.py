"""Chapter 9: tree attention across processes, through MPI.

p processes, one device each (rank r uses GPU r % count; without a GPU, the Numba CUDA
simulator), hold contiguous shards of the KV cache: rank s holds keys [start_s, end_s) of
every sequence, and every rank holds the whole q, as a decode step does. Each rank
computes its shard's partial with the decode chapter's launcher,

    (O_s, L_s) = decode_attention(q, K_s, V_s)       (an empty shard: O_s = 0, L_s = -inf)

and the p partials are reduced into (O, L) on every rank. Algorithm 3 of the Tree Attention
paper (arXiv 2408.04093) does it with all-reduces, which an MPI library or NCCL runs as a
tree or a ring over the devices (log p or p - 1 latency steps; bytes independent of N):

    m   = AllReduce_max(L_s)
    num = AllReduce_sum(exp(L_s - m) O_s)
    den = AllReduce_sum(exp(L_s - m))
    O   = num / den,   L = m + log den                (den = 0: no key seen, O = 0, L = -inf)

The exercise ladder of the reduction (each returns the full (O, L) on every rank):

    reduce_tree       (a) the three all-reduces above
    reduce_packed     (b) the MAX, then ONE SUM of [num | den] packed in one buffer
    reduce_allgather  (c) one all-gather of [O_s | L_s] and a local merge (the decode
                      chapter's ``merge_partials_numpy``, chapter 3's operator)

and the baseline, Ring Attention (``ring_attention``): the KV shards travel around the ring
of ranks, p - 1 steps of send-to-the-next, receive-from-the-previous, each rank merging the
partial of every shard that visits it. The variant here keeps the whole q on every rank (as
the tree does, so both give (O, L) on every rank with no final step): each rank computes
the partial of every shard, the whole cache, so its compute is p times the tree's; a variant
that splits the query heads among the ranks computes 1/p each but needs a final all-gather
of O. Both move the same KV bytes, which is the point of the comparison.

Bytes (elements of 4 bytes for float32; R = B Hq Nq query rows, d the head dim):

    tree, packed   one rank sends and receives 2 (p - 1) / p (R d + 2 R): an all-reduce of n
                   elements run as reduce-scatter then all-gather (the bandwidth-optimal ring
                   algorithm) moves (p - 1)/p n each way in each half. The paper's
                   2 (p - 1)/p (b d + 2 b n_h) with d the model width n_h d_h: the numerator
                   and, per head, the max and the denominator. Which algorithm MPI actually
                   runs is its own choice (MPICH: recursive doubling, log2 p rounds of all n
                   elements, for short messages; Rabenseifner's reduce-scatter + all-gather
                   for long ones): the count below is the bandwidth-optimal one, the message
                   sizes (the payload) are counted exactly.
    allgather      (p - 1) R (d + 1) each way: p/2 times the all-reduce's, for one collective
    ring           rank r sends every shard but the next rank's own, 2 B Hkv d (N - t_{r+1})
                   elements, and receives every shard but its own, 2 B Hkv d (N - t_r):
                   2 b t d (p - 1) for equal shards of t keys (the issue's 2 b t d p counts a
                   whole turn of the ring, p hops). It grows with N; the tree's does not.

The collective layer is one small class, ``MpiEngine`` (mpi4py, host NumPy buffers; it
counts every message). ``NcclEngine`` is the seam for GPUs: the same five calls through
CuPy's NCCL binding, not written yet (the multi-GPU run is its own step).

Launch: ``mpiexec -n 4 python -m kernels.tree_distributed --method all``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from kernels.base.runtime import on_simulator, to_device
from kernels.decode import decode_attention, merge_partials_numpy, split_ranges

__all__ = ["MpiEngine", "NcclEngine", "Traffic", "shard_bounds", "local_partial", "reduce_tree", "reduce_packed",
           "reduce_allgather", "REDUCTIONS", "METHODS", "tree_decode", "ring_attention", "tree_bytes",
           "ring_bytes", "bind_device", "main"]

METHODS = ("tree", "packed", "allgather", "ring")


# --------------------------------------------------------------------------- the collective layer

@dataclass
class Traffic:
    """What one rank's collectives moved: one row a call, (op, payload, sent, received) in
    bytes. The payload is the message's size (the buffer given to the call); sent and
    received follow the algorithm model of the module docstring (exact for point-to-point)."""

    calls: list = field(default_factory=list)

    def add(self, op: str, payload: int, sent: float, received: float):
        self.calls.append((op, int(payload), float(sent), float(received)))

    @property
    def payload(self) -> int:
        return sum(c[1] for c in self.calls)

    @property
    def sent(self) -> float:
        return sum(c[2] for c in self.calls)

    @property
    def received(self) -> float:
        return sum(c[3] for c in self.calls)

    @property
    def messages(self) -> int:
        return len(self.calls)

    def reset(self):
        self.calls.clear()


def _host(x) -> np.ndarray:
    """A host NumPy view of a buffer (a device array is copied: the MPICH wheel is not
    CUDA-aware; with a CUDA-aware MPI, mpi4py takes ``__cuda_array_interface__`` directly)."""
    if isinstance(x, np.ndarray):
        return x
    return x.copy_to_host() if hasattr(x, "copy_to_host") else x.get()      # Numba's, CuPy's


def _bytes(a: np.ndarray) -> np.ndarray:
    """A C-contiguous array's memory as a flat uint8 view (the same memory: a receive lands in ``a``)."""
    return a.reshape(-1).view(np.uint8)


class MpiEngine:
    """The collectives the reductions need, through mpi4py, on host NumPy buffers.

    allreduce(buf, op)        in place, op "max" or "sum"
    allgather(buf)            -> (p, *buf.shape), rank s's buffer at [s]
    exchange(send, dest, recv, source)   start sending arrays to ``dest`` and receiving into
                              arrays from ``source`` (Isend/Irecv); returns a handle for ``wait``
    wait(handle), barrier()
    """

    def __init__(self, comm=None):
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.traffic = Traffic()

    def allreduce(self, buf: np.ndarray, op: str) -> np.ndarray:
        ops = {"max": self.MPI.MAX, "sum": self.MPI.SUM}
        if op not in ops:
            raise ValueError(f"op: expected 'max' or 'sum', got {op!r}")
        if not (isinstance(buf, np.ndarray) and buf.flags.c_contiguous):
            raise TypeError("buf: expected a C-contiguous NumPy array (reduced in place)")
        p, n = self.size, buf.nbytes
        self.comm.Allreduce(self.MPI.IN_PLACE, buf, op=ops[op])
        self.traffic.add(f"allreduce-{op}", n, 2 * (p - 1) / p * n, 2 * (p - 1) / p * n)
        return buf

    def allgather(self, buf: np.ndarray) -> np.ndarray:
        buf = np.ascontiguousarray(_host(buf))
        out = np.empty((self.size,) + buf.shape, buf.dtype)
        self.comm.Allgather(buf, out)
        n = buf.nbytes                                  # (the ring: p - 1 blocks each way)
        self.traffic.add("allgather", n, (self.size - 1) * n, (self.size - 1) * n)
        return out

    def exchange(self, send, dest: int, recv, source: int):
        send = [np.ascontiguousarray(_host(a)) for a in send]     # (kept alive until wait)
        for i, a in enumerate(recv):
            if not (isinstance(a, np.ndarray) and a.flags.c_contiguous):
                raise TypeError(f"recv[{i}]: expected a C-contiguous NumPy array (received into in place)")
        # (as bytes: an MPI without a float16 datatype, Open MPI's, refuses a float16 cache)
        reqs = [self.comm.Isend(_bytes(a), dest=dest, tag=i) for i, a in enumerate(send)]
        reqs += [self.comm.Irecv(_bytes(a), source=source, tag=i) for i, a in enumerate(recv)]
        self.traffic.add("sendrecv", sum(a.nbytes for a in send), sum(a.nbytes for a in send),
                         sum(a.nbytes for a in recv))
        return reqs, send

    def wait(self, handle):
        self.MPI.Request.Waitall(handle[0])

    def barrier(self):
        self.comm.Barrier()


class NcclEngine:
    """The GPU seam, not written yet: the same calls through NCCL (``cupy.cuda.nccl``), on
    device buffers, no copy to the host. What each becomes:

    __init__     uid = nccl.get_unique_id() on rank 0, broadcast through MPI (comm.bcast);
                 NcclCommunicator(p, uid, rank) after cuda.select_device(rank % count)
    allreduce    comm.allReduce(ptr, ptr, n, NCCL_FLOAT32, NCCL_MAX or NCCL_SUM, stream)
    allgather    comm.allGather(ptr, out_ptr, n, NCCL_FLOAT32, stream)
    exchange     nccl.groupStart(); comm.send(..., dest); comm.recv(..., source); nccl.groupEnd()
    wait         the stream's synchronize

    NCCL picks ring or tree all-reduce by size and topology (NCCL_ALGO overrides it). The
    multi-GPU run is its own step; until then this class refuses to be built.
    """

    def __init__(self, *args, **kwargs):
        raise NotImplementedError("NcclEngine: the NCCL path (cupy.cuda.nccl) is not written yet; "
                                  "use MpiEngine (host buffers) on GPUs too")


def bind_device(rank: int) -> str:
    """Rank r's device: GPU r % count (before any CUDA context), or the simulator."""
    if on_simulator():
        return "Numba CUDA simulator (CPU)"
    from numba import cuda

    count = len(cuda.gpus)
    cuda.select_device(rank % count)
    name = cuda.get_current_device().name
    return f"GPU {rank % count} of {count}: {name.decode() if isinstance(name, bytes) else name}"


# --------------------------------------------------------------------------- a rank's partial

def shard_bounds(n_max: int, p: int) -> list[tuple[int, int]]:
    """Contiguous shards [start, end) of n_max cache rows over p ranks (ceil-sized, the last
    ones shorter or empty, as split-K cuts its slices)."""
    return split_ranges(n_max, p)


def _lengths(cache_lengths, B: int, n_max: int) -> np.ndarray:
    lengths = np.full(B, n_max, np.int64) if cache_lengths is None else np.asarray(cache_lengths, np.int64)
    if lengths.shape != (B,):
        raise ValueError(f"cache_lengths: expected shape ({B},), got {lengths.shape}")
    return lengths


def local_partial(q, k_shard, v_shard, start: int, *, cache_lengths=None, n_max=None, causal=False,
                  scale=None, **decode_options):
    """The partial (O_s, L_s) of keys [start, start + t) of the cache, t = k_shard.shape[2].

    ``cache_lengths`` (B,) are the sequences' lengths in the WHOLE cache (of ``n_max`` rows);
    the shard holds min(t, max(0, length - start)) of sequence b's keys. Causal (query i of
    Nq sees key j iff j <= i + length - Nq) is decided in global positions: the decode
    launcher's causal mask is relative to the end of the keys it is given, which is right
    only for the shard holding the end, so for Nq > 1 each query row i is one call with
    the keys it sees, length - (Nq - 1 - i), and no mask (Nq = 1: every key is visible).
    An empty shard gives (O = 0, L = -inf) without a launch. Returns float32 NumPy arrays."""
    q = np.asarray(q)
    B, hq, nq, d = q.shape
    t = k_shard.shape[2]
    lengths = _lengths(cache_lengths, B, start + t if n_max is None else n_max)
    o = np.zeros((B, hq, nq, d), np.float32)
    lse = np.full((B, hq, nq), -np.inf, np.float32)
    rows = [(slice(None), lengths)] if not causal or nq <= 1 else \
        [(slice(i, i + 1), lengths - (nq - 1 - i)) for i in range(nq)]
    for sl, seen in rows:                          # seen: keys [0, seen_b) of the cache are visible
        local = np.clip(seen - start, 0, t)
        if t == 0 or not local.any() or nq == 0:
            continue
        o_s, l_s = decode_attention(q[:, :, sl], k_shard, v_shard, cache_lengths=local, causal=False,
                                    scale=scale, **decode_options)
        o[:, :, sl], lse[:, :, sl] = _host(o_s), _host(l_s)
    return o, lse


# --------------------------------------------------------------------------- the ladder of reductions

def _weights(l, m):
    """exp(L_s - m): 0 for an empty shard (L_s = -inf), and no exp(-inf - (-inf)) where m =
    -inf on every rank (a row that sees no key): there the reference point is 0."""
    return np.exp(l - np.where(m == -np.inf, np.float32(0), m))


def _finish(num, den, m):
    """O = num / den, L = m + log den; den = 0 (no key anywhere) gives O = 0, L = -inf."""
    empty = den == 0
    safe = np.where(empty, np.float32(1), den)
    o = np.where(empty[..., None], np.float32(0), num / safe[..., None])
    lse = np.where(empty, np.float32(-np.inf), m + np.log(safe))
    return o.astype(np.float32), lse.astype(np.float32)


def reduce_tree(engine, o, l):
    """(a) Algorithm 3 as written: three all-reduces, MAX of L, SUM of exp(L_s - m) O_s, SUM
    of exp(L_s - m)."""
    m = engine.allreduce(np.array(l, np.float32), "max")              # m = max_s L_s
    w = _weights(l, m)                                                # exp(L_s - m)
    num = engine.allreduce(np.ascontiguousarray(w[..., None] * o, np.float32), "sum")
    den = engine.allreduce(np.ascontiguousarray(w, np.float32), "sum")
    return _finish(num, den, m)


def reduce_packed(engine, o, l):
    """(b) The MAX, then one SUM: [exp(L_s - m) O_s | exp(L_s - m)] in one buffer of d + 1
    floats a row (one latency instead of two; the same bytes)."""
    d = o.shape[-1]
    m = engine.allreduce(np.array(l, np.float32), "max")
    w = _weights(l, m)
    packed = np.empty(o.shape[:-1] + (d + 1,), np.float32)
    packed[..., :d] = w[..., None] * o                                # numerator
    packed[..., d] = w                                                # denominator
    engine.allreduce(packed, "sum")
    return _finish(packed[..., :d], packed[..., d], m)


def reduce_allgather(engine, o, l):
    """(c) One all-gather of [O_s | L_s] and chapter 3's merge on every rank: one collective
    (one latency), p/2 times the bytes of an all-reduce, p partials merged locally."""
    d = o.shape[-1]
    mine = np.empty(o.shape[:-1] + (d + 1,), np.float32)
    mine[..., :d], mine[..., d] = o, l
    parts = engine.allgather(mine)                                    # (p, ..., d + 1)
    o_all, l_all = merge_partials_numpy(parts[..., :d], parts[..., d])
    return o_all.astype(np.float32), l_all.astype(np.float32)


REDUCTIONS = {"tree": reduce_tree, "packed": reduce_packed, "allgather": reduce_allgather}


def tree_decode(engine, q, k_shard, v_shard, start: int, *, method="tree", cache_lengths=None, n_max=None,
                causal=False, scale=None, **decode_options):
    """One decode step by tree attention: this rank's partial, then the reduction ``method``
    ("tree", "packed" or "allgather"). Returns (O, L), float32, the same on every rank."""
    if method not in REDUCTIONS:
        raise ValueError(f"method: expected one of {', '.join(REDUCTIONS)}, got {method!r}")
    o, l = local_partial(q, k_shard, v_shard, start, cache_lengths=cache_lengths, n_max=n_max, causal=causal,
                         scale=scale, **decode_options)
    return REDUCTIONS[method](engine, o, l)


# --------------------------------------------------------------------------- the baseline: Ring Attention

def ring_attention(engine, q, k_shard, v_shard, bounds, *, cache_lengths=None, causal=False, scale=None,
                   step_times=None, **decode_options):
    """Ring Attention, decode: the KV shards travel around the ring of ranks.

    ``bounds``: every rank's [start, end) (the same list on every rank). Step s = 1 .. p - 1:
    send the shard held now (origin r - s + 1) to rank r + 1 and receive origin r - s from
    rank r - 1, while computing the held shard's partial (the transfer overlaps the compute);
    merge each partial into the running (O, L). Every rank ends with (O, L) of the whole
    cache. ``step_times``, a list, receives each step's seconds (partial, merge and wait)."""
    p, r = engine.size, engine.rank
    if len(bounds) != p:
        raise ValueError(f"bounds: expected {p} shards (one a rank), got {len(bounds)}")
    n_max = bounds[-1][1]
    held, origin = (k_shard, v_shard), r          # (device arrays go through the host: exchange)
    o_run = l_run = None
    for s in range(p):
        t0 = time.perf_counter()
        handle = None
        if s < p - 1:                                     # start the next hop before computing
            nxt = (r - s - 1) % p
            size = bounds[nxt][1] - bounds[nxt][0]
            shape = held[0].shape[:2] + (size,) + held[0].shape[3:]
            incoming = (np.empty(shape, held[0].dtype), np.empty(shape, held[1].dtype))
            handle = engine.exchange(held, (r + 1) % p, incoming, (r - 1) % p)
        o_s, l_s = local_partial(q, held[0], held[1], bounds[origin][0], cache_lengths=cache_lengths,
                                 n_max=n_max, causal=causal, scale=scale, **decode_options)
        if o_run is None:
            o_run, l_run = o_s, l_s
        else:                                             # chapter 3's merge of two partials
            o_m, l_m = merge_partials_numpy(np.stack([o_run, o_s]), np.stack([l_run, l_s]))
            o_run, l_run = o_m.astype(np.float32), l_m.astype(np.float32)
        if handle is not None:
            engine.wait(handle)
            held, origin = incoming, nxt
        if step_times is not None:
            step_times.append(time.perf_counter() - t0)
    return o_run, l_run


# --------------------------------------------------------------------------- the formulas

def tree_bytes(method: str, rows: int, d: int, p: int, itemsize: int = 4) -> dict:
    """Bytes one rank sends (= receives) in one reduction, by the formulas of the module
    docstring; ``payload`` is the sum of the messages' sizes, ``messages`` the collectives."""
    if method in ("tree", "packed"):
        elements = rows * d + 2 * rows                    # num, den, and the max of L
        return dict(payload=elements * itemsize, sent=2 * (p - 1) / p * elements * itemsize,
                    messages=3 if method == "tree" else 2)
    if method == "allgather":
        elements = rows * (d + 1)                          # [O_s | L_s]
        return dict(payload=elements * itemsize, sent=(p - 1) * elements * itemsize, messages=1)
    raise ValueError(f"method: expected 'tree', 'packed' or 'allgather', got {method!r}")


def ring_bytes(bounds, rank: int, B: int, hkv: int, d: int, itemsize: int = 4) -> dict:
    """Bytes rank ``rank`` sends and receives in Ring Attention: K and V of every shard but
    the next rank's (sent) and but its own (received)."""
    p = len(bounds)
    n = bounds[-1][1] - bounds[0][0]
    t = [e - s for s, e in bounds]
    row = 2 * B * hkv * d * itemsize                         # K and V of one key position
    if p == 1:
        return dict(sent=0, received=0, messages=0)
    return dict(sent=row * (n - t[(rank + 1) % p]), received=row * (n - t[rank]), messages=p - 1)


# --------------------------------------------------------------------------- the command line

def _parse(argv):
    sim = on_simulator()
    ap = argparse.ArgumentParser(prog="mpiexec -n P python -m kernels.tree_distributed",
                                 description="Tree attention and Ring Attention decode across MPI ranks "
                                             "(defaults: small in the simulator, Llama-3.1-8B's heads on a GPU).")
    ap.add_argument("--n", type=int, default=32 if sim else 131072, help="keys in the cache (N)")
    ap.add_argument("--d", type=int, default=8 if sim else 128, help="head dim")
    ap.add_argument("--heads", type=int, default=2 if sim else 32, help="query heads Hq")
    ap.add_argument("--kv-heads", type=int, default=1 if sim else 8, help="KV heads Hkv (GQA when fewer than Hq)")
    ap.add_argument("--batch", type=int, default=1, help="sequences B")
    ap.add_argument("--nq", type=int, default=1, help="new queries a sequence")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--kv-dtype", choices=("float32", "float16"), default="float32" if sim else "float16")
    ap.add_argument("--method", default="all", help=f"{', '.join(METHODS)}, several with commas, or all")
    ap.add_argument("--repeats", type=int, default=3 if sim else 20)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    args.methods = METHODS if args.method == "all" else tuple(args.method.split(","))
    bad = [m for m in args.methods if m not in METHODS]
    if bad:
        ap.error(f"--method: expected {', '.join(METHODS)} or all, got {', '.join(bad)}")
    return args


def _shard(args, hkv, start, end, s):
    """Shard s of the cache, drawn from its own seed: a rank makes only its own (rank 0 all,
    for the oracle)."""
    rng = np.random.default_rng((args.seed, s + 1))
    shape = (args.batch, hkv, end - start, args.d)
    return (rng.standard_normal(shape).astype(args.kv_dtype), rng.standard_normal(shape).astype(args.kv_dtype))


def main(argv=None):
    """The command line: every method on this cache, rank 0 prints the table."""
    args = _parse(sys.argv[1:] if argv is None else argv)
    from mpi4py import MPI

    from kernels import reference as ref

    engine = MpiEngine()
    world, p, r = engine.comm, engine.size, engine.rank
    device = bind_device(r)
    hkv = args.kv_heads
    B, hq, nq, d, n = args.batch, args.heads, args.nq, args.d, args.n
    q = np.random.default_rng((args.seed, 0)).standard_normal((B, hq, nq, d)).astype(np.float32)
    bounds = shard_bounds(n, p)
    start, end = bounds[r]
    k_s, v_s = _shard(args, hkv, start, end, r)
    if not on_simulator():                 # the shard lives on this rank's GPU
        k_s, v_s = to_device(k_s, "k_shard"), to_device(v_s, "v_shard")
    exact = None
    if r == 0:                             # the single-process oracle on the whole cache
        shards = [_shard(args, hkv, a, b, s) for s, (a, b) in enumerate(bounds)]
        k, v = (np.concatenate([x[i] for x in shards], axis=2) for i in (0, 1))
        exact = ref.decode_attention(q, k, v, None, args.causal, None)
        del k, v, shards
    rows, itemsize = B * hq * nq, 4
    methods = args.methods
    if r == 0:
        print(f"{p} ranks; rank 0 on {device}; B={B} Hq={hq} Hkv={hkv} Nq={nq} N={n} d={d} "
              f"causal={args.causal} kv={args.kv_dtype}; shard of rank 0: {end - start} keys")
        print(f"{'method':10} {'max err O':>10} {'max err L':>10} {'payload B':>10} {'sent B/rank':>12} "
              f"{'formula':>12} {'recv B/rank':>12} {'msgs':>5} {'step ms':>9} {'reduce ms':>9}")

    def timed(fn):                         # the slowest rank's time, median over repeats
        times = []
        for _ in range(args.repeats):
            world.Barrier()
            t0 = time.perf_counter()
            fn()
            times.append(world.allreduce(time.perf_counter() - t0, op=MPI.MAX))
        return statistics.median(times) * 1e3

    for method in methods:
        engine.traffic.reset()
        if method == "ring":
            o, l = ring_attention(engine, q, k_s, v_s, bounds, causal=args.causal)
            formula = ring_bytes(bounds, r, B, hkv, d, np.dtype(args.kv_dtype).itemsize)
            hops = []
            step_ms = timed(lambda: ring_attention(engine, q, k_s, v_s, bounds, causal=args.causal, step_times=hops))
            reduce_ms = statistics.median(hops) * 1e3           # one hop: a partial, a merge, a wait
        else:
            o_s, l_s = local_partial(q, k_s, v_s, start, n_max=n, causal=args.causal)
            o, l = REDUCTIONS[method](engine, o_s, l_s)
            formula = tree_bytes(method, rows, d, p, itemsize)
            step_ms = timed(lambda: tree_decode(engine, q, k_s, v_s, start, method=method, n_max=n,
                                                causal=args.causal))
            reduce_ms = timed(lambda: REDUCTIONS[method](engine, o_s, l_s))
        first = engine.traffic.calls[:formula["messages"]] if method != "ring" else engine.traffic.calls[:p - 1]
        payload, sent, received = (sum(c[i] for c in first) for i in (1, 2, 3))
        results = world.gather((o, l), root=0)
        sent_all = world.gather((sent, received, formula["sent"]), root=0)
        if r == 0:
            err_o = max(float(np.max(np.abs(oo - exact[0]), initial=0.0)) for oo, _ in results)
            fin = np.isfinite(exact[1])
            err_l = max(float(np.max(np.abs(ll[fin] - exact[1][fin]), initial=0.0)) for _, ll in results)
            s_max = max(x[0] for x in sent_all)
            rcv_max = max(x[1] for x in sent_all)
            f_max = max(x[2] for x in sent_all)
            print(f"{method:10} {err_o:10.2e} {err_l:10.2e} {payload:10d} {s_max:12.0f} {f_max:12.0f} {rcv_max:12.0f} "
                  f"{len(first):5d} {step_ms:9.3f} {reduce_ms:9.3f}")
    if r == 0:
        print("payload: rank 0's messages; sent/recv: the largest over ranks, all-reduces counted as "
              "reduce-scatter + all-gather (2(p-1)/p of the message; MPI picks its own algorithm).\n"
              "step: the partial and the reduction (ring: p partials, p - 1 hops), the slowest rank, median; "
              "reduce: the reduction alone (ring: one hop, its partial included).")


if __name__ == "__main__":
    main()
