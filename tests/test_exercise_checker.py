"""The notebooks' exercise checker bites: chapter 1's checkers reject the mistakes a first
attempt makes, every run, and pass the right answers.

Each planted mistake is checked over several independent runs (the checker draws afresh
each run, whatever test profile is loaded): a mistake caught by most runs but not all
would leave a learner with a wrong answer and a "passed".
"""

import numpy as np
import pytest

from kernels import reference as ref
from kernels.base.testing import HOST_EXAMPLES, KERNEL_EXAMPLES, check_exercise
from kernels.naive_attention import check_mask, check_softmax_row, mask_cases, softmax_row_cases

RUNS = 10


# --------------------------------------------------------------------------- answers

def allowed(i, j, nq, nk):
    """The bottom-right causal mask."""
    return j <= i + (nk - nq)


def allowed_clamped(i, j, nq, nk):
    """Wrong only when Nq > Nk: the shift Nk - Nq clamped at 0 (the top-left mask there)."""
    return j <= i + max(nk - nq, 0)


def softmax_row(x):
    """The safe softmax of one float32 row: zeros for a row with no finite entry."""
    if x.size == 0 or not np.isfinite(x).any():
        return np.zeros_like(x)
    e = np.exp(x - x.max())
    return e / e.sum()


def softmax_row_no_max(x):
    """Without the max subtracted: exp overflows above about 88.7 and underflows to 0 below
    about -103, and the row turns NaN or zero."""
    e = np.exp(x)
    total = e.sum()
    return e / total if total > 0 else np.zeros_like(x)


def softmax_row_float64(x):
    """The safe softmax computed, and returned, in float64 (asked: float32)."""
    return ref.softmax(x)


def mask_check(fn):
    return lambda case: check_mask(fn, case)


def softmax_check(fn):
    return lambda x: check_softmax_row(fn, x)


PLANTED = {
    "mask wrong only when Nq > Nk": (mask_check(allowed_clamped), mask_cases),
    "softmax without the max subtracted": (softmax_check(softmax_row_no_max), softmax_row_cases),
    "softmax returning float64": (softmax_check(softmax_row_float64), softmax_row_cases),
}


@pytest.mark.parametrize("name", list(PLANTED))
def test_planted_mistake_fails_every_run(name, capsys):
    prop, cases = PLANTED[name]
    results = [check_exercise(prop, cases(), host=True) for _ in range(RUNS)]
    out = capsys.readouterr().out
    assert not any(results), f"{name}: passed the checker in {sum(results)} of {RUNS} runs\n{out}"
    assert out.count("not yet: smallest failing case") == RUNS


@pytest.mark.parametrize("prop, cases", [(mask_check(allowed), mask_cases),
                                         (softmax_check(softmax_row), softmax_row_cases)],
                         ids=["mask", "softmax"])
def test_right_answer_passes(prop, cases, capsys):
    assert check_exercise(prop, cases(), host=True), capsys.readouterr().out


def test_host_exercises_draw_hundreds_kernel_exercises_few(capsys):
    from hypothesis import strategies as st

    calls = []
    assert check_exercise(calls.append, st.integers(0, 10**9), host=True)
    assert len(calls) == HOST_EXAMPLES >= 300
    calls.clear()
    assert check_exercise(calls.append, st.integers(0, 10**9))
    assert len(calls) == KERNEL_EXAMPLES
    assert f"passed: {KERNEL_EXAMPLES} drawn cases" in capsys.readouterr().out


def test_a_small_strategy_is_checked_whole(capsys):
    """The mask's 13 x 13 size pairs are fewer than the host count: all of them run."""
    seen = set()
    assert check_exercise(lambda case: seen.add(case), mask_cases(), host=True)
    assert seen == {(a, b) for a in range(13) for b in range(13)}
