"""Test set-up: GPU or simulator, and the Hypothesis profiles.

``import kernels`` chooses the GPU when one works and the Numba CUDA simulator otherwise
(``WORKBOOK_DEVICE=gpu|sim`` forces it); it must happen before anything imports Numba.

Profiles (``HYPOTHESIS_PROFILE`` picks one; the default follows the device):
  ci   simulator, few examples, no deadline: what CI runs on a machine with no GPU
  dev  40 examples a property test, for working on a chapter (on a GPU too: each test's own
       GPU count, ``kernels.base.testing.gpu_examples(n)``, is capped at the profile's, so a
       dev run on a GPU finishes in minutes)
  gpu  the real device, hundreds of examples (each test's own count), production tile sizes
  mutants  what tests/test_planted_bugs.py runs a mutant's tests with: a fixed, derandomized
       set of examples and no shrinking (a caught mutant needs one failure, not the smallest)

``WORKBOOK_LEARNER=<file.py>`` puts a learner's kernel factories in place of the chapter's
before any test imports it (``kernels.base.learner``): the chapter's tests grade them.

``WORKBOOK_MUTANT=<id>`` plants one of the bugs of ``tests/mutants.py`` before anything
imports the kernels: the named kernel module is loaded from its source with the mutant's
snippets replaced.
"""

import os

if os.environ.get("WORKBOOK_MUTANT"):
    import mutants  # tests/mutants.py (pytest puts tests/ on sys.path for this conftest)

    mutants.install(os.environ["WORKBOOK_MUTANT"])

import kernels  # noqa: F401  (GPU-or-simulator switch, before Numba)
from kernels.base.runtime import on_simulator

if os.environ.get("WORKBOOK_LEARNER"):          # a learner's kernels in place of the chapter's
    from kernels.base import learner

    LEARNER = learner.install(os.environ["WORKBOOK_LEARNER"])
else:
    LEARNER = None

from hypothesis import HealthCheck, Phase, settings

_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# ci: 5 drawn cases a test, derandomized (the same cases every run), besides each test's
# explicit examples: the simulator runs every thread in Python, and CI has 2 cores (the
# gpu profile draws hundreds).
settings.register_profile("ci", max_examples=5, derandomize=True, print_blob=True, **_common)
settings.register_profile("dev", max_examples=40, print_blob=True, **_common)
settings.register_profile("gpu", max_examples=300, print_blob=True, **_common)
settings.register_profile("mutants", max_examples=25, derandomize=True, database=None, print_blob=False,
                          phases=(Phase.explicit, Phase.generate), report_multiple_bugs=False, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if on_simulator() else "gpu"))


def pytest_report_header(config):
    from kernels.base.runtime import device_name

    mutant = os.environ.get("WORKBOOK_MUTANT")
    planted = f"; planted bug: {mutant}" if mutant else ""
    mine = f"; the learner's {', '.join(LEARNER[1])} in kernels.{LEARNER[0]}" if LEARNER else ""
    return f"workbook device: {device_name()}; hypothesis profile: {settings._current_profile}{planted}{mine}"


def pytest_collection_modifyitems(session, config, items):
    """The PTX checks of the kernel modules first (``tests/test_ptx.py``), the rest in their
    usual order. Under ``--dist worksteal`` each worker starts on a contiguous share of this
    list and an idle worker takes the end of another's: so the long compiles start at once,
    on one worker, in one checker process that compiles the device functions the chapters
    share once (``kernels.base.ptx_check --serve``), instead of running last, split between
    workers. Only the order changes: every test runs, and runs the same."""
    ptx = [item for item in items if item.path.name == "test_ptx.py"]
    if ptx:
        rest = [item for item in items if item.path.name != "test_ptx.py"]
        items[:] = ptx + rest
