"""The tolerance's error model, checked against the arithmetic it models.

``kernels.base.testing.serial_sum_spread`` says how far a float32 dot product, summed term
after term as a thread sums S = Q K^T, strays from the exact value; the floors of every
attention test rest on it (with C_SERIAL, its tail). Here the sums are done in float32 on
the host, one rounding an addition (the fused multiply-add a GPU thread uses), and the
model must cover the largest error without being vacuous.
"""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from kernels.base.testing import C_SERIAL, U, serial_sum_spread


def serial_float32_dot(x, y):
    """x . y over the last axis in float32, term after term, one rounding per step (fma)."""
    acc = np.zeros(x.shape[:-1], np.float32)
    for e in range(x.shape[-1]):
        exact_step = acc.astype(np.float64) + x[..., e].astype(np.float64) * y[..., e].astype(np.float64)
        acc = exact_step.astype(np.float32)
    return acc


@given(d=st.integers(1, 128), alignment=st.sampled_from([0.0, 0.5, 0.9, 1.0]), seed=st.integers(0, 2**16))
def test_serial_sum_spread_covers_float32_sums(d, alignment, seed):
    """2000 sums: the largest error is within C_SERIAL spreads, the typical one is not far
    below one (a model that said 'huge' would pass the first check and bite nothing)."""
    rng = np.random.default_rng(seed)
    y = (rng.standard_normal((2000, d)) * 3).astype(np.float32)
    x = (alignment * y + np.sqrt(1 - alignment**2) * rng.standard_normal((2000, d)) * 3).astype(np.float32)
    exact = np.sum(x.astype(np.float64) * y.astype(np.float64), axis=-1)
    err = np.abs(serial_float32_dot(x, y) - exact)
    sigma = U * serial_sum_spread(x[:, None, :], y[:, None, :])[:, 0, 0]   # each row with its own y
    ratio = err / sigma
    assert ratio.max() <= C_SERIAL, f"largest error {ratio.max():.2f} spreads"
    assert 0.1 <= np.median(ratio) <= 1.0, f"median error {np.median(ratio):.2f} spreads"


def test_aligned_sums_err_beyond_one_u_of_the_absolute_sum():
    """Why the model has a drift term: with a key aligned to its query, the partial sums
    grow steadily and the error passes one U of sum |x y| (the older model) many times over."""
    rng = np.random.default_rng(0)
    y = (rng.standard_normal((2000, 125)) * 3).astype(np.float32)
    x = y.copy()
    exact = np.sum(x.astype(np.float64) * y.astype(np.float64), axis=-1)
    err = np.abs(serial_float32_dot(x, y) - exact)
    a = np.sum(np.abs(x.astype(np.float64) * y), axis=-1)
    assert (err / (U * a)).max() > 4.0


def test_gpu_examples_follow_the_loaded_profile():
    # A test's own GPU count where the profile allows as many, the profile's where it asks for
    # fewer (dev: 40), read from the profile the test run loaded.
    from hypothesis import settings

    from kernels.base.testing import gpu_examples

    loaded, name = settings().max_examples, settings.get_current_profile_name()
    assert gpu_examples(loaded + 100) == loaded
    assert gpu_examples(1) == 1
    try:
        for profile, expected in (("gpu", 200), ("dev", 40), ("mutants", 25)):
            settings.load_profile(profile)
            assert gpu_examples(200) == expected, profile
    finally:
        settings.load_profile(name)
    assert settings().max_examples == loaded
