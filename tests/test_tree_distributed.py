"""Chapter 9: tree attention and Ring Attention across MPI processes, against the float64 oracle.

One ``mpiexec -n 4`` run does every case: the world of 4 ranks (p = 4), and at the same time
a split of it into ranks 0-2 (p = 3, not a power of two) and rank 3 alone (p = 1). Each rank
holds a contiguous shard of the cache (ragged and empty shards, ragged cache lengths, GQA,
causal with Nq > 1, fully masked rows, logits around 1e4, an fp16 cache), runs every method
(the three reductions and the ring) and saves what it got; this process then checks every
rank's (O, L) against ``reference.decode_attention`` on the whole cache with the decode
chapter's tolerance rule (``tests/test_decode.py``: its floors, which include the merge of
partials), and the bytes each rank's collectives moved against the formulas.

The same run also runs the planted bugs (``PLANTED``: copies of ``kernels.tree_distributed``
with one snippet replaced, as ``tests/mutants.py`` makes them) on the cases that should catch
them; each must fail the same check. (``WORKBOOK_MUTANT``, the planted-bug suite's switch,
reaches the ranks too: they plant a registered mutant of this module before importing it.)

This file is also the ranks' program: ``mpiexec -n 4 python tests/test_tree_distributed.py
CASES.npz OUT_DIR`` (only NumPy, mpi4py and the module under test are imported there).
"""

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

METHODS = ("tree", "packed", "allgather", "ring")
WORLD = 4                          # mpiexec -n 4: p = 4, and 3 + 1 by a split of the world

# Planted bugs: (id, the snippet, its replacement, the cases and methods that must catch it, what it does).
PLANTED = [
    ("ch9-packed-den-not-rescaled",
     "    packed[..., d] = w                                                # denominator\n",
     "    packed[..., d] = np.isfinite(l)   # PLANTED: the denominator without exp(L_s - m)\n",
     ("ragged-gqa", "causal-masked"), ("packed",),
     "the packed SUM adds 1 for every non-empty shard instead of exp(L_s - m)"),
    ("ch9-no-inf-guard",
     "    return np.exp(l - np.where(m == -np.inf, np.float32(0), m))\n",
     "    return np.exp(l - m)   # PLANTED: exp(-inf - (-inf)) = NaN on rows that see no key\n",
     ("all-masked", "causal-masked"), ("tree", "packed"),
     "the weights exp(L_s - m) without the guard for m = -inf: NaN on fully masked rows"),
    ("ch9-ring-own-offset",
     "        o_s, l_s = local_partial(q, held[0], held[1], bounds[origin][0], cache_lengths=cache_lengths,\n",
     "        o_s, l_s = local_partial(q, held[0], held[1], bounds[r][0], cache_lengths=cache_lengths,  # PLANTED\n",
     ("ragged-gqa",), ("ring",),
     "Ring Attention places each visiting shard at the rank's own offset (wrong lengths)"),
    ("ch9-causal-local-mask",
     "    rows = [(slice(None), lengths)] if not causal or nq <= 1 else \\\n",
     "    rows = [(slice(None), lengths)] if True else \\\n",
     ("causal-masked",), ("tree",),
     "causal ignored on shards: every key before the end is seen by every query (no per-row lengths)"),
]
PLANTED_IDS = [p[0] for p in PLANTED]


# --------------------------------------------------------------------------- the ranks' program

def _load_module(planted_id=None):
    """kernels.tree_distributed, or a copy with one planted bug (tests/mutants.py's Mutant)."""
    import importlib

    if planted_id is None:
        return importlib.import_module("kernels.tree_distributed")
    import mutants   # tests/mutants.py (this file's folder is on sys.path when it runs as a script)

    _, snippet, replacement, _, _, bug = next(p for p in PLANTED if p[0] == planted_id)
    mutant = mutants.Mutant(planted_id, 9, "kernels.tree_distributed", ((snippet, replacement),), (), "", bug)
    module = type(sys)(f"kernels.tree_distributed_{planted_id.replace('-', '_')}")
    sys.modules[module.__name__] = module                  # (dataclasses look their module up)
    exec(compile(mutant.mutated_source(), str(mutant.path), "exec"), module.__dict__)
    return module


def run_ranks(cases_path, out_dir):
    """Every case on the ranks of its communicator, every method; each rank saves its results."""
    import inspect

    planted = os.environ.get("WORKBOOK_MUTANT")
    if planted:                        # the planted-bug suite's switch: a registered mutant of this module
        import mutants

        if planted in mutants.BY_ID:
            mutants.install(planted)
    from mpi4py import MPI

    td = _load_module()
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    groups = {WORLD: world, 3: world.Split(0 if rank < 3 else 1, rank)}
    if rank == 3:
        groups = {WORLD: world, 1: groups.pop(3)}
    data = np.load(cases_path)
    specs = json.loads(str(data["specs"]))
    out, t0 = {}, time.perf_counter()

    def save(tag, cid, method, engine, o, l):
        out[f"{tag}|{cid}|{method}|o"], out[f"{tag}|{cid}|{method}|l"] = o, l
        out[f"{tag}|{cid}|{method}|traffic"] = np.array([engine.traffic.payload, engine.traffic.sent,
                                                         engine.traffic.received, engine.traffic.messages])
        engine.traffic.reset()

    variants = [(None, td)] + [(p[0], _load_module(p[0])) for p in PLANTED]
    for cid, spec in specs.items():
        comm = groups.get(spec["p"])
        if comm is None:
            continue
        q, k, v = data[f"{cid}|q"], data[f"{cid}|k"], data[f"{cid}|v"]
        lengths = data[f"{cid}|lengths"]
        bounds = [tuple(b) for b in spec["bounds"]]
        r = comm.Get_rank()
        k_s, v_s = np.ascontiguousarray(k[:, :, slice(*bounds[r])]), np.ascontiguousarray(v[:, :, slice(*bounds[r])])
        opts = dict(cache_lengths=lengths, causal=spec["causal"], scale=spec["scale"])
        partial = None
        for planted_id, mod in variants:
            methods = METHODS if planted_id is None else next(p[4] for p in PLANTED if p[0] == planted_id)
            if planted_id is not None and cid not in next(p[3] for p in PLANTED if p[0] == planted_id):
                continue
            tag = planted_id or "real"
            engine = mod.MpiEngine(comm)
            # the partial is the real module's unless the planted bug is in local_partial
            own_partial = planted_id is not None and next(p[1] for p in PLANTED if p[0] == planted_id) in \
                inspect.getsource(td.local_partial)
            for method in methods:
                if method == "ring":
                    o, l = mod.ring_attention(engine, q, k_s, v_s, bounds, **opts)
                else:
                    if own_partial or partial is None:
                        o_s, l_s = mod.local_partial(q, k_s, v_s, bounds[r][0], n_max=k.shape[2], **opts)
                        if not own_partial:
                            partial = (o_s, l_s)
                    else:
                        o_s, l_s = partial
                    o, l = mod.REDUCTIONS[method](engine, o_s, l_s)
                save(tag, cid, method, engine, o, l)
    out["seconds"] = np.array(time.perf_counter() - t0)
    np.savez(Path(out_dir) / f"rank{rank}.npz", **out)
    world.Barrier()


if __name__ == "__main__":
    run_ranks(sys.argv[1], sys.argv[2])
    sys.exit(0)


# --------------------------------------------------------------------------- the checks (pytest)

import importlib.util  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402

import pytest  # noqa: E402

from kernels import reference as ref  # noqa: E402
from kernels.base.testing import assert_close  # noqa: E402
from test_decode import decode_floors, make_case  # noqa: E402  (the decode chapter's cases and floors)

if importlib.util.find_spec("mpi4py") is None:
    pytest.skip("mpi4py is not installed (pip install -r requirements.txt brings mpi4py and the MPICH wheel)",
                allow_module_level=True)

from kernels.tree_distributed import ring_bytes, shard_bounds, tree_bytes  # noqa: E402

# id: (p, bounds or None for shard_bounds, make_case's arguments)
CASES = {
    # ragged shards, one empty; ragged cache lengths; GQA (2 query heads a KV head)
    "ragged-gqa": (4, [(0, 3), (3, 3), (3, 9), (9, 10)],
                   dict(b=1, hkv=1, group=2, n_max=10, d=6, lengths=[8], seed=1)),
    # causal with Nq = 2 and a cache of 1 key: query 0 sees nothing (L = -inf); a shard of
    # one key; the second sequence's end in the middle of rank 1's shard
    "causal-masked": (4, [(0, 4), (4, 9), (9, 10), (10, 12)],
                      dict(b=2, hkv=1, nq=2, n_max=12, d=4, lengths=[1, 7], causal=True, seed=2)),
    # logits around 1e4, odd head dim, an fp16 cache (the ring sends half the bytes)
    "large-logits": (4, None, dict(b=1, hkv=1, group=2, n_max=11, d=5, logit_std=1e4, kv_dtype=np.float16,
                                   seed=3)),
    # every row sees nothing (every cache empty): m = -inf on every rank
    "all-masked": (4, None, dict(b=1, hkv=1, group=2, n_max=6, d=4, lengths=[0], seed=4)),
    # p = 3 (not a power of two): causal, GQA, the cache ending in the middle shard (the last one empty)
    "p3-causal": (3, None, dict(b=1, hkv=1, group=2, nq=2, n_max=8, d=4, lengths=[5], causal=True,
                                scale=0.7, seed=5)),
    # p = 1: the reductions and the ring are the identity
    "p1": (1, None, dict(b=1, hkv=1, group=2, n_max=5, d=4, seed=6)),
}


def _cases():
    built = {}
    for cid, (p, bounds, kwargs) in CASES.items():
        case = make_case(**kwargs)
        built[cid] = (p, bounds or shard_bounds(case.k.shape[2], p), case)
    return built


def _ranks_of(p):
    """World ranks that ran a case of p ranks, in the case's communicator's order."""
    return {WORLD: [0, 1, 2, 3], 3: [0, 1, 2], 1: [3]}[p]


def _mpi_env(path, **extra):
    """The environment of a process that runs MPI: ``path`` first on PYTHONPATH, and Open MPI's
    two variables (where its mpiexec is the one found, it refuses to run as root, as containers
    do, without them; MPICH ignores them)."""
    return dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", **extra,
                PYTHONPATH=os.pathsep.join(filter(None, [str(path), os.environ.get("PYTHONPATH")])))


def _mpiexec():
    for path in (Path(sys.executable).parent / "mpiexec", shutil.which("mpiexec")):
        if path and Path(path).exists():
            return str(path)
    pytest.fail("mpi4py is installed but mpiexec is not (requirements.txt's mpich wheel brings it)")


@pytest.fixture(scope="module")
def mpi_run(tmp_path_factory):
    """One ``mpiexec -n 4`` run of every case and planted bug; under pytest-xdist the first
    worker to get here runs it and the other reuses its results (a lock in the run's folder)."""
    import fcntl

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    folder = root / "tree_distributed_mpi"
    folder.mkdir(exist_ok=True)
    built = _cases()
    with open(folder / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / "done").exists():
            arrays = {"specs": json.dumps({cid: dict(p=p, bounds=[list(b) for b in bounds], causal=case.causal,
                                                     scale=case.scale)
                                           for cid, (p, bounds, case) in built.items()})}
            for cid, (p, bounds, case) in built.items():
                lengths = np.full(case.q.shape[0], case.k.shape[2]) if case.lengths is None else case.lengths
                arrays.update({f"{cid}|q": case.q, f"{cid}|k": case.k, f"{cid}|v": case.v,
                               f"{cid}|lengths": np.asarray(lengths, np.int64)})
            np.savez(folder / "cases.npz", **arrays)
            # (heavy yield: a rank waiting in a collective sleeps instead of spinning, leaving
            # the CPU to the ranks that compute: 4 processes share CI's 2 cores)
            env = _mpi_env(Path(__file__).parent, MPIR_CVAR_ENABLE_HEAVY_YIELD="1")
            t0 = time.perf_counter()
            proc = subprocess.run([_mpiexec(), "-n", str(WORLD), sys.executable, __file__,
                                   str(folder / "cases.npz"), str(folder)],
                                  capture_output=True, text=True, timeout=240, env=env)
            assert proc.returncode == 0, f"mpiexec failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
            (folder / "done").write_text(f"{time.perf_counter() - t0:.2f}")
    results = [dict(np.load(folder / f"rank{r}.npz")) for r in range(WORLD)]
    return built, results


def _failures(built, results, tag, cases=None, methods=METHODS):
    """Every (case, method, rank) whose (O, L) misses the tolerance rule: their messages."""
    failures = []
    for cid, (p, bounds, case) in built.items():
        if cases is not None and cid not in cases:
            continue
        exact_o, exact_l = ref.decode_attention(case.q, case.k, case.v, case.lengths, case.causal, case.scale)
        base_o, base_l = ref.decode_attention(case.q, case.k, case.v, case.lengths, case.causal, case.scale,
                                              dtype=np.float32)
        f_o, f_l = decode_floors(case)
        for method in methods:
            for world_rank in _ranks_of(p):
                got = results[world_rank]
                where = f"{cid} ({case!r}), p={p}, bounds={bounds}, {method}, rank {world_rank}"
                try:
                    o, l = got[f"{tag}|{cid}|{method}|o"], got[f"{tag}|{cid}|{method}|l"]
                    assert o.dtype == np.float32 and l.dtype == np.float32, f"dtypes {o.dtype}, {l.dtype}"
                    assert_close(o, exact_o, base_o, name="O", floor=f_o)
                    assert_close(l, exact_l, base_l, name="L", floor=f_l)
                except AssertionError as e:
                    failures.append(f"{where}: {e}")
    return failures


def test_every_method_on_every_rank_matches_the_oracle(mpi_run):
    built, results = mpi_run
    failures = _failures(built, results, "real")
    assert not failures, "\n".join(failures)


def test_bytes_match_the_formulas(mpi_run):
    """The payload and bytes each rank's collectives moved (counted in MpiEngine from the
    buffers it was given) equal the formulas: 2(p-1)/p (R d + 2R) floats for the all-reduces,
    (p-1) R (d+1) for the all-gather, K and V of every shard but one for the ring."""
    built, results = mpi_run
    for cid, (p, bounds, case) in built.items():
        B, hq, nq, d = case.q.shape
        for method in METHODS:
            for r, world_rank in enumerate(_ranks_of(p)):
                payload, sent, received, messages = results[world_rank][f"real|{cid}|{method}|traffic"]
                if method == "ring":
                    f = ring_bytes(bounds, r, B, case.k.shape[1], d, case.k.dtype.itemsize)
                    assert (sent, received, messages) == (f["sent"], f["received"], f["messages"]), (cid, r)
                    assert payload == sent
                else:
                    f = tree_bytes(method, B * hq * nq, d, p)
                    assert (payload, messages) == (f["payload"], f["messages"]), (cid, method, r)
                    assert sent == pytest.approx(f["sent"], rel=1e-12) and received == sent, (cid, method, r)


@pytest.mark.parametrize("planted", PLANTED, ids=PLANTED_IDS)
def test_planted_bug_is_caught(mpi_run, planted):
    planted_id, _, _, cases, methods, bug = planted
    built, results = mpi_run
    failures = _failures(built, results, planted_id, cases, methods)
    assert failures, f"planted bug {planted_id} ({bug}) passed the oracle check on {cases} x {methods}"


def test_formulas():
    """The formulas themselves: the all-reduce's 2(p-1)/p, the all-gather's p/2 times as
    much, the ring's bytes summed over ranks (sent = received) and growing with N."""
    for p in (1, 2, 3, 4, 8):
        t, a = tree_bytes("tree", 6, 8, p), tree_bytes("allgather", 6, 8, p)
        assert t["sent"] == pytest.approx(2 * (p - 1) / p * 6 * 10 * 4)
        assert a["sent"] == (p - 1) * 6 * 9 * 4
        bounds = shard_bounds(13, p)
        rows = [ring_bytes(bounds, r, 2, 1, 8) for r in range(p)]
        assert sum(x["sent"] for x in rows) == sum(x["received"] for x in rows) == 2 * 2 * 8 * 4 * 13 * (p - 1)
    ten_times = ring_bytes(shard_bounds(1000, 4), 0, 1, 1, 8)["sent"]
    assert ten_times == 10 * ring_bytes(shard_bounds(100, 4), 0, 1, 1, 8)["sent"]
    with pytest.raises(ValueError, match="method"):
        tree_bytes("ring", 1, 1, 2)


_EXCHANGE_TO_SELF = """
import sys, numpy as np
from mpi4py import MPI
from kernels.tree_distributed import MpiEngine
engine = MpiEngine(MPI.COMM_SELF)
rng = np.random.default_rng(0)
send = [rng.standard_normal((2, 3, 5)).astype(np.float16),
        np.frombuffer(rng.bytes(3 * 7), dtype="V3")]             # a dtype no MPI datatype names
recv = [np.empty_like(a) for a in send]
engine.wait(engine.exchange(send, 0, recv, 0))
assert all(a.tobytes() == b.tobytes() for a, b in zip(send, recv)), "exchange: received bytes differ"
try:
    engine.exchange(send[:1], 0, [np.empty((3, 2, 5), np.float16).transpose(1, 0, 2)], 0)
except TypeError as exc:
    assert "recv[0]" in str(exc), exc
else:
    raise AssertionError("exchange: a non-contiguous receive buffer was accepted")
print("exchanged")
"""


def test_exchange_moves_any_dtype_as_bytes():
    """The ring's send/receive moves a shard's memory as it is, whatever its dtype: an fp16
    cache through an MPI that names no float16 datatype (Open MPI's), and a dtype that no MPI
    names at all, from rank 0 to itself (one process, ``COMM_SELF``); a receive buffer it
    cannot fill in place is refused by name."""
    import subprocess

    proc = subprocess.run([sys.executable, "-c", _EXCHANGE_TO_SELF], capture_output=True, text=True,
                          timeout=120, env=_mpi_env(Path(__file__).parents[1]))
    assert proc.returncode == 0 and "exchanged" in proc.stdout, f"{proc.stdout}\n{proc.stderr}"
