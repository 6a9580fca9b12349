"""Hypothesis strategies shared by the chapters' tests.

Shapes, magnitudes and seeds are drawn by Hypothesis (so failures shrink to the smallest
shape); the array values come from a NumPy generator seeded by the drawn seed, which is
far faster than drawing every element and still never zeros.
"""

from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st

from kernels.runtime import on_simulator

# The simulator runs every thread in Python: keep sizes small there.
MAX_N = 64 if on_simulator() else 512
MAX_D = 32 if on_simulator() else 128
MAX_BH = 2 if on_simulator() else 4


def random_array(rng, shape, magnitude=1.0, dtype=np.float32):
    """Normal(0, magnitude) values; never all zeros."""
    return (rng.standard_normal(shape) * magnitude).astype(dtype)


@dataclass
class AttentionCase:
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    causal: bool
    scale: float | None

    def __repr__(self):
        return (
            f"AttentionCase(q={self.q.shape}, k={self.k.shape}, dtype={self.q.dtype}, "
            f"causal={self.causal}, scale={self.scale}, |q|max={np.abs(self.q).max() if self.q.size else 0:.3g})"
        )


@st.composite
def attention_cases(draw, *, max_n=MAX_N, max_d=MAX_D, head_dims=None, dtypes=(np.float32,),
                    allow_causal=True, allow_empty=True, magnitudes=(0.1, 1.0, 3.0, 30.0)):
    """q (B, H, Nq, d), k and v (B, H, Nk, d), causal, scale: Nq != Nk, ragged N, odd d,
    and logits from small to very large."""
    b = draw(st.integers(1, MAX_BH))
    h = draw(st.integers(1, MAX_BH))
    lo = 0 if allow_empty else 1
    nq = draw(st.integers(lo, max_n))
    nk = draw(st.integers(lo, max_n))
    d = draw(st.sampled_from(head_dims) if head_dims else st.integers(1, max_d))
    dtype = draw(st.sampled_from(dtypes))
    causal = draw(st.booleans()) if allow_causal else False
    scale = draw(st.one_of(st.none(), st.floats(0.01, 2.0)))
    magnitude = draw(st.sampled_from(magnitudes))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    q = random_array(rng, (b, h, nq, d), magnitude, dtype)
    k = random_array(rng, (b, h, nk, d), magnitude, dtype)
    v = random_array(rng, (b, h, nk, d), 1.0, dtype)
    return AttentionCase(q, k, v, causal, scale)


def case_with(q_shape, k_shape, *, causal=False, scale=None, magnitude=1.0, seed=0, dtype=np.float32):
    """A fixed case for ``@example``: the awkward shapes every chapter pins."""
    rng = np.random.default_rng(seed)
    q = random_array(rng, q_shape, magnitude, dtype)
    k = random_array(rng, k_shape, magnitude, dtype)
    v = random_array(rng, k_shape, 1.0, dtype)
    return AttentionCase(q, k, v, causal, scale)
