"""Planted bugs: every mutant of ``tests/mutants.py`` must be caught by its chapter's tests.

A tolerance is honest when it catches real bugs and passes the real kernels with margin.
For each mutant (a dropped rescale, a shifted diagonal, a skipped ragged tile, a wrong L,
a P rounded to fp16, a P only 4x less accurate than float32's, ...) this runs the
chapter's own property tests in a child process (a fork of a warm one: ``tests/fork_runner.py``) with the bug planted
(``WORKBOOK_MUTANT=<id>``, see ``tests/conftest.py``) and the ``mutants`` Hypothesis
profile (the pinned examples, then a fixed set of drawn ones, no shrinking), and asserts
that they fail with an assertion error: not an import or syntax error of a stale mutant,
not a crash, not a pass.

In the simulator (CI) every mutant but the GPU-only ones runs; on a GPU only those run
(WORKBOOK_MUTANTS_ON_GPU=all: every one, each compiling its chapter's kernels). A mutant
marked ``escapes`` is a known gap of the chapter's tests, expected to escape (strictly).
"""

import os
import re
import pytest

from kernels.base.runtime import on_simulator
from fork_runner import ForkRunner
from mutants import MUTANTS, ROOT, MutantError

# A child runs a few seconds: the chapter's tests up to the first failing example. A mutant
# the tests cannot see runs them all (25 examples each). Past this the child is killed.
TIMEOUT_S = 300


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.id)
def test_each_snippet_occurs_exactly_once(mutant):
    """A refactor that moves the code a mutant targets must fail here, loudly: a mutant
    whose snippet is gone would plant nothing and pass for the wrong reason."""
    source = mutant.path.read_text()
    for snippet, replacement in mutant.edits:
        assert source.count(snippet) == 1, f"{mutant.id}: snippet not found exactly once in {mutant.module}"
        assert snippet != replacement
    assert mutant.mutated_source() != source
    compile(mutant.mutated_source(), str(mutant.path), "exec")    # the mutant itself is valid Python


@pytest.fixture(scope="module")
def fork_runner():
    """Children forked from one warm process (``tests/fork_runner.py``): each starts with
    NumPy, Numba, Hypothesis and pytest imported, and imports the kernels itself."""
    runner = ForkRunner()
    yield runner
    runner.close()


def run_with_mutant(mutant, runner, log):
    env = dict(os.environ, WORKBOOK_MUTANT=mutant.id, HYPOTHESIS_PROFILE="mutants")
    for name in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_ADDOPTS", "WORKBOOK_TOLERANCE_LOG"):
        env.pop(name, None)
    args = ["-x", "-q", "--tb=short", "-p", "no:cacheprovider", "-p", "no:nbmake", "-p", "no:xdist",
            "-W", "ignore::pytest.PytestAssertRewriteWarning", "-o", "addopts=", *mutant.tests, "-k", mutant.select]
    rc = runner.run(args, env, ROOT, log, TIMEOUT_S)
    return rc, log.read_text()


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.id)
def test_mutant_is_caught(mutant, request, fork_runner, tmp_path):
    if mutant.gpu_only and on_simulator():
        pytest.skip(f"needs a GPU: {mutant.gpu_only}")
    if not on_simulator() and not mutant.gpu_only and os.environ.get("WORKBOOK_MUTANTS_ON_GPU") != "all":
        pytest.skip("caught in the simulator (CI); on a GPU only the GPU-only bugs are planted "
                    "(WORKBOOK_MUTANTS_ON_GPU=all plants them all)")
    if mutant.escapes:                    # a known gap, written down; strict: a catch must remove the note
        request.applymarker(pytest.mark.xfail(strict=True, reason=f"known gap: {mutant.escapes}"))
    try:
        mutant.mutated_source()
    except MutantError as exc:
        pytest.fail(str(exc))
    rc, out = run_with_mutant(mutant, fork_runner, tmp_path / "pytest.log")
    tail = "\n".join(out.strip().splitlines()[-25:])
    summary = out.strip().splitlines()[-1] if out.strip() else ""
    assert rc != 0, f"planted bug {mutant.id} ({mutant.bug}) was NOT caught by {mutant.select}:\n{tail}"
    assert rc == 1 and re.search(r"\b1 failed\b", summary) and "error" not in summary, (
        f"planted bug {mutant.id}: the tests did not run to a failure (exit {rc}):\n{tail}")
    assert re.search(r"^E\s+(AssertionError\b|assert\b)", out, re.M), (
        f"planted bug {mutant.id}: the tests failed, but not on an assertion (a crash is not a catch):\n{tail}")
