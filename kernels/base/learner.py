"""Your kernels, graded by the chapter's own tests.

A chapter module lists the kernels a learner may write in place of the course's in
``EXERCISES``: {name of a kernel factory: the tests that exercise it (a ``pytest -k``
expression)}. The chapter's launchers look their factories up by name at every call, so a
factory replaced in the module is the one every launcher, and every test, then uses.

A learner's file names the chapter it answers and defines some of those factories, with
the course's signatures (the notebook's exercise says what each takes and returns):

    # my_gpu_basics.py
    CHAPTER = "gpu_basics"

    from numba import cuda

    def make_copy(items=1):
        @cuda.jit
        def copy_kernel(src, dst):
            ...
        return copy_kernel

Then the chapter's tests run on them:

    WORKBOOK_LEARNER=my_gpu_basics.py python -m pytest tests/test_gpu_basics.py -k copy

(``tests/conftest.py`` calls ``install`` before any test imports the chapter), or, from a
notebook, ``grade("my_gpu_basics.py")``: the same tests in a fresh process, reporting
"passed" or the smallest failing case Hypothesis found and the assertion that caught it.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

ENV = "WORKBOOK_LEARNER"
ROOT = Path(__file__).resolve().parents[2]


def my_file(name: str, template: str) -> Path:
    """The learner's file ``mine/<name>`` (beside the notebook), written from ``template``
    the first time; the learner's edits are kept. Prints where it is."""
    mine = Path("mine") / name
    if not mine.exists():
        mine.parent.mkdir(exist_ok=True)
        mine.write_text(template)
    print(f"your kernels: {mine.resolve()}")
    return mine


def load(path):
    """The learner's module at ``path``, the chapter module it answers, and the names of
    the chapter's ``EXERCISES`` it defines. Errors name what is missing."""
    path = Path(path).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"{ENV}: no file {path}")
    spec = importlib.util.spec_from_file_location(f"learner_{path.stem}", path)
    mine = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mine)
    chapter_name = getattr(mine, "CHAPTER", None)
    if not isinstance(chapter_name, str):
        raise ValueError(f"{path.name}: expected CHAPTER = \"<chapter module>\" (for example \"gpu_basics\")")
    chapter = importlib.import_module(f"kernels.{chapter_name}")
    slots = getattr(chapter, "EXERCISES", None)
    if not slots:
        raise ValueError(f"{path.name}: chapter {chapter_name!r} has no kernel exercises (EXERCISES)")
    names = [name for name in slots if callable(getattr(mine, name, None))]
    if not names:
        raise ValueError(f"{path.name}: defines none of chapter {chapter_name!r}'s exercises: {', '.join(slots)}")
    return mine, chapter, names


def install(path) -> tuple[str, list[str]]:
    """Put the learner's factories in place of the chapter's (in the chapter module).
    Returns (chapter name, names replaced)."""
    mine, chapter, names = load(path)
    for name in names:
        setattr(chapter, name, getattr(mine, name))
    return chapter.__name__.rsplit(".", 1)[1], names


def grade(path, *, timeout: int = 900) -> bool:
    """Run the chapter's tests of the exercises ``path`` answers, on the learner's kernels,
    in a fresh process (simulator or GPU, like the notebook). Prints the verdict: the
    number of tests passed, or the first failing test, the smallest case it failed on and
    the assertion's message. Returns True when every selected test passed."""
    mine, chapter, names = load(path)
    chapter_name = chapter.__name__.rsplit(".", 1)[1]
    select = " or ".join(f"({chapter.EXERCISES[name]})" for name in names)
    env = dict(os.environ, **{ENV: str(Path(path).resolve())})
    for name in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_ADDOPTS", "WORKBOOK_MUTANT"):
        env.pop(name, None)
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "--tb=short", "--color=no", "-p", "no:cacheprovider", "-p", "no:nbmake",
           "-p", "no:xdist", "-o", "addopts=", f"tests/test_{chapter_name}.py", "-k", select]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    summary = out.strip().splitlines()[-1] if out.strip() else "(no output)"
    print(f"{', '.join(names)} from {Path(path).name}, graded by tests/test_{chapter_name}.py -k \"{select}\":")
    if proc.returncode == 0:
        print(f"  passed: {summary.strip('= ')}")
        return True
    print(f"  not yet: {summary.strip('= ')}")
    for line in _failure(out):
        print("  " + line)
    return False


def _failure(out: str) -> list[str]:
    """The lines of a pytest failure a learner needs: which test, the smallest drawn case,
    and the error. Hypothesis prints the case as "Falsifying (explicit) example: ..." on its
    own lines (older versions) or as "Failing test case: ..." / "Failing explicit example:
    ..." inside the error (E-prefixed; newer ones); either way it is printed here after
    "smallest failing case:". Several distinct
    failures come as an exception group, its lines prefixed with "| ": stripped."""
    lines = [re.sub(r"^\s*(\|\s?)+", "", line) if re.match(r"^\s*\|", line) else line
             for line in out.splitlines()]
    plain = [re.sub(r"^E(\s|$)", "", line) for line in lines]          # the E prefix off
    keep = [line for line in lines if line.startswith("FAILED ")][:1]
    error = next((line.strip() for line in plain
                  if re.match(r"^\s*[\w.]*(Error|Exception|Failed)\b:?", line)), None)
    start = next((i for i, line in enumerate(plain)
                  if re.match(r"^\s*(Falsifying|Failing)( explicit)? (example|test case)", line)), None)
    if start is not None:
        keep.append("smallest failing case:")
        header = plain[start].strip()
        keep.append("  " + header.split(":", 1)[1].strip() if ":" in header else header)
        indent = len(plain[start]) - len(plain[start].lstrip())
        for line in plain[start + 1:start + 12]:
            keep.append("  " + line[indent:] if line[:indent].strip() == "" else line)
            if line.strip() == ")":
                break
    if error:
        keep.append(error)
    elif start is None:
        keep += [line[1:].strip() for line in lines if re.match(r"^E\s", line)][:8]
    return keep
