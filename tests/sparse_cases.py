"""Chapter 6's drawn cases, shared by the forward and backward test modules: shapes
(ragged, Nq != Nk), causal, scale, logit magnitude, the mask's block size, its layout
(shared, per head, per batch and head), its density or pattern, and the kernel tiles."""

import numpy as np
from hypothesis import strategies as st

from kernels import reference as ref
from kernels import sparsity_patterns as sp
from kernels.base.runtime import on_simulator
from kernels.base.testing import MAX_BH, MAX_D, random_array

DQ_MODES = ("atomic", "separate")
# Sequence lengths: the simulator runs every thread in Python, keep them small there.
MAX_N = 40 if on_simulator() else 512
BLOCKS = (4, 8, 16) if on_simulator() else (16, 64, 128)
# Explicit kernel tiles (block_m, block_n) the tests draw, besides the launcher's choice.
# Each distinct tile configuration is a compile on the GPU: keep the set small there.
TILE_CHOICES = (4, 8, 16) if on_simulator() else (16,)
PATTERN_NAMES = ["random", "sliding window", "global + local", "strided", "butterfly", "dense", "empty"]


def make_mask(kind, layout, nq, nk, bq, bk, b, h, density, seed):
    """A BlockMask of the given kind with flags (Tq, Tk), (H, Tq, Tk) or (B, H, Tq, Tk)."""
    tq, tk = -(-nq // bq), -(-nk // bk)
    shape = {"shared": (tq, tk), "head": (h, tq, tk), "batch-head": (b, h, tq, tk)}[layout]
    if kind == "random":
        flags = np.random.default_rng(seed).random(shape) < density
    elif kind == "dense":
        flags = np.ones(shape, bool)
    elif kind == "empty":
        flags = np.zeros(shape, bool)
    else:  # a named pattern (square blocks): shared by every head
        flags = np.broadcast_to(sp.PATTERNS[kind](nq, nk, bq).flags, shape).copy()
    return ref.BlockMask(flags, bq, bk)


@st.composite
def sparse_cases(draw, max_n=MAX_N, max_d=MAX_D):
    b = draw(st.integers(1, MAX_BH))
    h = draw(st.integers(1, MAX_BH))
    nq = draw(st.integers(0, max_n))
    nk = draw(st.integers(0, max_n))
    d = draw(st.integers(1, max_d))
    causal = draw(st.booleans())
    scale = draw(st.one_of(st.none(), st.floats(0.05, 2.0)))
    magnitude = draw(st.sampled_from((0.3, 1.0, 3.0)))
    kind = draw(st.sampled_from(PATTERN_NAMES))
    bq = draw(st.sampled_from(BLOCKS))
    bk = bq if kind not in ("random", "dense", "empty") else draw(st.sampled_from(BLOCKS))
    layout = draw(st.sampled_from(("shared", "head", "batch-head")))
    density = draw(st.floats(0.0, 1.0))
    seed = draw(st.integers(0, 2**32 - 1))
    # kernel tiles: the launcher's choice, or an explicit divisor of the mask block
    bm = draw(st.one_of(st.none(), st.sampled_from([t for t in TILE_CHOICES if bq % t == 0])))
    bn = draw(st.one_of(st.none(), st.sampled_from([t for t in TILE_CHOICES if bk % t == 0])))
    dq_mode = draw(st.sampled_from(DQ_MODES))
    return dict(b=b, h=h, nq=nq, nk=nk, d=d, causal=causal, scale=scale, magnitude=magnitude, kind=kind,
                bq=bq, bk=bk, layout=layout, density=density, seed=seed, block_m=bm, block_n=bn, dq_mode=dq_mode)


def build(c):
    rng = np.random.default_rng(c["seed"])
    q = random_array(rng, (c["b"], c["h"], c["nq"], c["d"]), c["magnitude"])
    k = random_array(rng, (c["b"], c["h"], c["nk"], c["d"]), c["magnitude"])
    v = random_array(rng, (c["b"], c["h"], c["nk"], c["d"]))
    mask = make_mask(c["kind"], c["layout"], c["nq"], c["nk"], c["bq"], c["bk"], c["b"], c["h"],
                     c["density"], c["seed"])
    return q, k, v, mask


def case(b=1, h=1, nq=8, nk=8, d=4, causal=False, scale=None, magnitude=1.0, kind="random", bq=4, bk=4,
         layout="shared", density=0.5, seed=0, block_m=None, block_n=None, dq_mode="atomic"):
    return dict(b=b, h=h, nq=nq, nk=nk, d=d, causal=causal, scale=scale, magnitude=magnitude, kind=kind,
                bq=bq, bk=bk, layout=layout, density=density, seed=seed, block_m=block_m, block_n=block_n,
                dq_mode=dq_mode)
