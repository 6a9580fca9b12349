"""The tolerance rule, as FlashAttention's own tests state it.

A kernel's error against the float64 oracle must be at most twice the error that a plain
float32 NumPy computation of the same thing makes, plus a small floor (for the cases
where float32 NumPy happens to be exact). A fixed ``atol=1e-2`` would hide real bugs.
"""

import numpy as np

FLOAT32_EPS = float(np.finfo(np.float32).eps)


def assert_close(got, exact, baseline, *, name="output", factor=2.0, floor_ulps=8.0):
    """Check ``got`` against ``exact`` (float64 oracle) with the float32 ``baseline``'s error as yardstick.

    Non-finite entries (e.g. L = -inf on fully masked rows) must match exactly.
    """
    got = np.asarray(got, dtype=np.float64)
    exact = np.asarray(exact, dtype=np.float64)
    baseline = np.asarray(baseline, dtype=np.float64)
    assert got.shape == exact.shape, f"{name}: shape {got.shape}, expected {exact.shape}"
    assert not np.isnan(got).any(), f"{name}: {int(np.isnan(got).sum())} NaN entries"
    finite = np.isfinite(exact)
    mismatch = ~finite & (got != exact)
    assert not mismatch.any(), (
        f"{name}: non-finite entries differ at {np.argwhere(mismatch)[:5].tolist()}: "
        f"got {got[mismatch][:5]}, expected {exact[mismatch][:5]}"
    )
    assert np.isfinite(got[finite]).all(), f"{name}: non-finite values where the oracle is finite"
    if not finite.any():
        return
    err = np.max(np.abs(got[finite] - exact[finite]))
    err_f32 = np.max(np.abs(baseline[finite] - exact[finite]))
    scale = max(1.0, float(np.max(np.abs(exact[finite]))))
    bound = factor * err_f32 + floor_ulps * FLOAT32_EPS * scale
    worst = np.unravel_index(np.argmax(np.where(finite, np.abs(got - exact), -1)), got.shape)
    assert err <= bound, (
        f"{name}: max error {err:.3e} > bound {bound:.3e} (float32 NumPy error {err_f32:.3e}); "
        f"worst at {tuple(int(i) for i in worst)}: got {got[worst]!r}, expected {exact[worst]!r}"
    )
