"""Memory traffic of chapters 5 and 6 as Nsight Compute counts it, next to the IO models.

Chapter 4 has its own (``python -m kernels.bench.flash_forward --ncu/--dram``); this module
does the same for the backward (chapter 5, atomic and separate dQ) and for block-sparse
attention (chapter 6, forward and backward at several kept fractions rho), at the
reference configuration B=4 H=16 N=4096 d=64 fp32.

On a GPU with Nsight Compute, one command profiles the cases and writes the tables:

    python -m kernels.bench.traffic profile CASE... [--out DIR] [--raw-dir DIR]

It runs ``run CASE`` for each case under ``kernels.bench.ncu.profile`` (DRAM bytes and,
where this ncu has it, the L2 -> SM read metric; ncu's CSV kept as ``ncu_CASE.csv`` in
``--raw-dir``), then ``table``. The two steps apart:

    python -m kernels.bench.traffic run CASE      # the program ncu watches
    python -m kernels.bench.traffic table ncu_*.csv

``run CASE`` compiles and warms up the kernels, then runs them once between
cuProfilerStart and cuProfilerStop, so only that call is profiled. CASE is ``bwd-atomic``,
``bwd-separate``, ``bs-fwd-RHO`` or ``bs-bwd-RHO`` (RHO the mask density, e.g. 0.125).
Chapter 10's cases (its bench's shapes, B=1 H=16 N=4096): ``order-kv-outer`` and
``order-q-outer`` (the two loop orders at Br = Bc = 64), ``small-cache-256`` and
``small-cache-128`` (the M < d^2 algorithm).
``table`` sums each file's kernels and writes ``flash_backward_dram.csv``,
``block_sparse_dram.csv`` and ``io_theory_dram.csv`` (into workbook/results, or ``--out``): per case the DRAM bytes,
the bytes the SMs read from L2 (sectors x 32 B), the IO model's bytes, and a
per-kernel breakdown in ``extra``. The IO models assume nothing between on-chip memory and
HBM, so they predict the L2 -> SM traffic; the 50 MB L2 keeps most re-reads from HBM.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import numpy as np

import kernels  # noqa: F401  (GPU or simulator first)
from kernels.bench import ncu
from kernels.bench.harness import Result
from kernels.base.runtime import on_simulator

REFERENCE = (4, 16, 4096, 64)
BLOCK = 128                       # chapter 6's bench masks: 128 x 128 blocks
L2_READ = ncu.L2_READ


def _case(name, build=True):
    """(function to profile or None, chapter, description, IO model bytes) for a case name;
    ``build=False`` skips the inputs (what ``table`` needs)."""
    from kernels.flash_backward import flash_attention_backward
    from kernels.flash_backward import io_model_bytes as backward_model

    if name.startswith(("order-", "small-cache-")):
        return _chapter10_case(name, build)
    b, h, n, d = REFERENCE
    if build:
        from numba import cuda

        rng = np.random.default_rng(900)
        q, k, v, do = (cuda.to_device(rng.standard_normal((b, h, n, d)).astype(np.float32)) for _ in range(4))
    if name in ("bwd-atomic", "bwd-separate"):
        mode = name.split("-")[1]
        fn = None
        if build:
            from kernels.flash_forward import flash_attention

            o, lse = flash_attention(q, k, v, products="fma")
            fn = lambda: flash_attention_backward(q, k, v, o, lse, do, dq_mode=mode, products="fma")  # noqa: E731
        return fn, 5, f"backward, {mode} dQ", backward_model(b, h, n, n, d, dq_mode=mode)
    match = re.fullmatch(r"bs-(fwd|bwd)-([0-9.]+)", name)
    if not match:
        raise SystemExit(f"unknown case {name!r}: bwd-atomic, bwd-separate, bs-fwd-RHO, bs-bwd-RHO, "
                         f"{', '.join(CHAPTER10)}")
    from kernels.bench.block_sparse import _mask
    from kernels.block_sparse import block_sparse_attention, forward_tiles, tile_lists
    from kernels.block_sparse import io_model_bytes as sparse_forward_model
    from kernels.block_sparse_backward import backward_tiles, block_sparse_attention_backward
    from kernels.block_sparse_backward import io_model_bytes as sparse_backward_model

    part, density = match.group(1), float(match.group(2))
    mask = _mask(n, BLOCK, density)
    ftiles, _ = forward_tiles(d, mask)
    flists = tile_lists(mask, n, n, Br=ftiles.Br, Bc=ftiles.Bc, batch=b, heads=h)
    if part == "fwd":
        fn = (lambda: block_sparse_attention(q, k, v, mask, lists=flists)) if build else None
        return (fn, 6, f"block-sparse forward, density {density:g}",
                sparse_forward_model(b, h, n, n, d, Br=ftiles.Br, rho=flists.kept_fraction))
    cfg = backward_tiles(d, mask)                # the dK/dV kernel's lists (atomic dQ)
    lists = tile_lists(mask, n, n, Br=cfg.Br, Bc=cfg.Bc, batch=b, heads=h)
    fn = None
    if build:
        o, lse = block_sparse_attention(q, k, v, mask, lists=flists)
        fn = lambda: block_sparse_attention_backward(q, k, v, o, lse, do, mask, lists=lists)  # noqa: E731
    return (fn, 6, f"block-sparse backward (atomic dQ), density {density:g}",
            sparse_backward_model(b, h, n, n, d, Br=cfg.dq_Br, Bc=cfg.Bc, rho=lists.kept_fraction))


CHAPTER10 = {"order-kv-outer": (1, 16, 4096, 64), "order-q-outer": (1, 16, 4096, 64),
             "small-cache-256": (1, 16, 4096, 256), "small-cache-128": (1, 16, 4096, 128)}


def _shape(name):
    return CHAPTER10.get(name, REFERENCE)


def _chapter10_case(name, build):
    """Chapter 10's cases, at its bench's shapes: the two loop orders at Br = Bc = 64
    (``order-kv-outer``: Algorithm 1's kernel; ``order-q-outer``: chapter 4's rung 2) with
    their closed forms, and the M < d^2 algorithm (``small-cache-D``) with its count."""
    if name not in CHAPTER10:
        raise SystemExit(f"unknown case {name!r}: {', '.join(CHAPTER10)}")
    b, h, n, d = CHAPTER10[name]
    if name.startswith("order-"):
        from kernels.flash_forward import query_tile_attention
        from kernels.kv_outer_forward import hbm_elements, kv_outer_attention

        order = name[len("order-"):]
        count = hbm_elements(n, n, d, 64, 64, order)
        launch = kv_outer_attention if order == "kv-outer" else query_tile_attention
        what = ("Algorithm 1 order (kv-outer)" if order == "kv-outer" else "FlashAttention-2 order (ch 4 rung 2)")
    else:
        from kernels.small_cache_attention import default_tile, hbm_elements, small_cache_attention

        tile = default_tile()
        count = hbm_elements(n, n, d, tile)
        launch, what = small_cache_attention, f"small-cache (S in HBM, b x b products) d={d} b={tile}"
    model = 4.0 * b * h * (count["read"] + count["written"])
    fn = None
    if build:
        from numba import cuda

        rng = np.random.default_rng(n + d)
        q, k, v = (cuda.to_device(rng.standard_normal((b, h, n, d)).astype(np.float32)) for _ in range(3))
        kw = {"tiles": (64, 64)} if name.startswith("order-") else {}
        fn = lambda: launch(q, k, v, **kw)  # noqa: E731
    return fn, 10, what, model


def run_case(name):
    from numba import cuda

    fn, *_ = _case(name)
    fn()                        # compile and warm up
    cuda.synchronize()
    cuda.profile_start()
    fn()
    cuda.synchronize()
    cuda.profile_stop()


def profile(cases, *, out=None, raw_dir=None):
    """Each case once under Nsight Compute (``run_case`` in a child process), then ``table``."""
    import tempfile

    metrics = ncu.DRAM + ncu.l2_read()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(raw_dir) if raw_dir else Path(tmp)
        paths = []
        for case in cases:
            _case(case, build=False)                   # an unknown case fails here, before ncu runs
            path = folder / f"ncu_{case}.csv"
            ncu.profile("kernels.bench.traffic:run_case", metrics, args=(case,), from_start=False, raw=path)
            paths.append(path)
        table(paths, out)


def _short(kernel_name):
    """'cudapy::kernels::flash_backward::make_dkdv::<locals>::dkdv[abi:...](...)' -> 'dkdv'."""
    base = kernel_name.split("(")[0].split("[")[0]
    return base.split("::")[-1] or kernel_name[:40]


def table(paths, out=None):
    from kernels.bench import harness

    rows = {5: [], 6: [], 10: []}
    for path in paths:
        name = re.sub(r"^ncu_|\.csv$", "", Path(path).name)
        _, chapter, what, model = _case(name, build=False)
        b, h, n, d = _shape(name)
        launches = [(launch["kernel"], launch["metrics"]) for launch in harness.read_ncu(path)]
        dram = sum(m.get("dram__bytes_read.sum", 0) + m.get("dram__bytes_write.sum", 0) for _, m in launches)
        l2 = sum(m.get(L2_READ, float("nan")) for _, m in launches)
        writes = sum(m.get("dram__bytes_write.sum", 0) for _, m in launches)
        per_kernel = ",".join(f"{_short(k)}:{(m.get('dram__bytes_read.sum', 0) + m.get('dram__bytes_write.sum', 0)) / 1e9:.3f}"
                              f"/{m.get(L2_READ, float('nan')) / 1e9:.3f}" for k, m in launches)
        compulsory = b * h * 4 * (4 * n * d + n) * (2 if "bwd" in name else 1)
        note = (f"DRAM {dram / 1e9:.3f} GB = {dram / model:.2f} x the IO model; SM reads from L2 "
                f"{l2 / 1e9:.2f} GB, with the writes {(l2 + writes) / model:.2f} x it; {len(launches)} kernels")
        rows[chapter].append(Result(chapter, f"{what} (Nsight Compute)", f"B={b} H={h} N={n} d={d} fp32 causal=False",
                                    float("nan"), float("nan"), float("nan"), float("nan"), model, float("nan"),
                                    float("nan"), float("nan"), float("nan"), False, note,
                                    {"case": name, "dram_total_bytes": dram, "dram_write_bytes": writes,
                                     "l2_read_bytes": l2, "model_bytes": model, "compulsory_bytes": compulsory,
                                     "kernels_dram_GB/l2_GB": per_kernel, "part": "ncu"}))
    out = harness.results_folder(out)
    env = harness.environment()
    for chapter, fname in ((5, "flash_backward_dram.csv"), (6, "block_sparse_dram.csv"), (10, "io_theory_dram.csv")):
        if rows[chapter]:
            harness.write_csv(out / fname, rows[chapter], env)
            for r in rows[chapter]:
                print(f"{r.kernel:<60} {r.note}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernels.bench.traffic")
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run", help="run one case once, between cuProfilerStart/Stop")
    p_run.add_argument("case")
    p_table = sub.add_parser("table", help="ncu --csv outputs -> *_dram.csv")
    p_table.add_argument("paths", nargs="+")
    p_table.add_argument("--out", default=None)
    p_prof = sub.add_parser("profile", help="run each case under Nsight Compute, then table")
    p_prof.add_argument("cases", nargs="+")
    p_prof.add_argument("--out", default=None)
    p_prof.add_argument("--raw-dir", default=None, help="keep ncu's CSV output (ncu_CASE.csv) here")
    args = parser.parse_args(argv)
    if args.command == "run":
        if on_simulator():
            raise SystemExit("traffic run: needs a GPU and Nsight Compute")
        run_case(args.case)
    elif args.command == "profile":
        try:
            profile(args.cases, out=args.out, raw_dir=args.raw_dir)
        except (ncu.NcuMissing, ncu.NcuError) as err:
            raise SystemExit(f"traffic profile: {err}")
    else:
        table(args.paths, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
