"""Runs pytest in fresh child processes that start warm: forks of one process that has
already imported what every child imports (NumPy, Numba and its simulator, Hypothesis,
pytest), about a second of each child's start.

``tests/test_planted_bugs.py`` runs each planted bug's tests in a child of its own (the
bug is planted at import, so the kernels must be imported fresh); with ~80 bugs, starting
Python and importing those libraries again each time was a large share of the suite.

Protocol (this file run as a script): one JSON request a line on stdin,
``{"args": [...], "env": {...}, "cwd": "...", "log": "...", "timeout": s}``; for each, a fork
takes the environment and folder, sends its output to the log file and exits with
``pytest.main(args)``'s status, killed by SIGALRM past ``timeout``; one JSON reply a line,
``{"rc": exit status}`` (negative: the signal that killed it). Plugins imported before the
fork cannot be rewritten for assertions, which pytest notes in a warning:
``-W ignore::pytest.PytestAssertRewriteWarning`` silences it.

Only third-party libraries are imported before the fork: the course's modules are imported
by each child, after its conftest has planted the bug.
"""

import json
import os
import sys


def _preload(env):
    os.environ.update(env)             # the simulator switch must be set before Numba is imported
    import hypothesis  # noqa: F401
    import hypothesis.extra.numpy  # noqa: F401
    import numba  # noqa: F401
    import numba.cuda  # noqa: F401
    import numpy  # noqa: F401
    import pytest  # noqa: F401
    import _pytest.python  # noqa: F401
    import _pytest.terminal  # noqa: F401
    from importlib.metadata import entry_points

    for plugin in entry_points(group="pytest11"):      # the installed plugins (hypothesis, anyio, ...)
        plugin.load()


def _child(request):
    import signal

    import pytest

    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    signal.alarm(int(request["timeout"]))
    rc = 3
    try:
        rc = int(pytest.main(request["args"]))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)


def main():
    first = sys.stdin.readline()
    if not first:
        return
    _preload(json.loads(first)["env"])
    line = first
    while line:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)
        line = sys.stdin.readline()


class ForkRunner:
    """The parent's side: ``run(args, env, cwd, log, timeout)`` returns the child's exit status.
    Where there is no ``fork`` (Windows), each child is a new ``python -m pytest``."""

    def __init__(self):
        import subprocess

        self._proc = None
        if hasattr(os, "fork"):
            self._proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, text=True)

    def run(self, args, env, cwd, log, timeout):
        if self._proc is None:
            import subprocess

            with open(log, "w") as out:
                try:
                    return subprocess.run([sys.executable, "-m", "pytest", *args], cwd=cwd, env=env,
                                          stdout=out, stderr=subprocess.STDOUT, timeout=timeout).returncode
                except subprocess.TimeoutExpired:
                    return -14
        request = dict(args=list(args), env=dict(env), cwd=str(cwd), log=str(log), timeout=timeout)
        self._proc.stdin.write(json.dumps(request) + "\n")
        self._proc.stdin.flush()
        reply = self._proc.stdout.readline()
        if not reply:
            raise RuntimeError(f"the fork runner died (exit {self._proc.wait()})")
        return json.loads(reply)["rc"]

    def close(self):
        if self._proc is None:
            return
        self._proc.stdin.close()
        self._proc.wait(timeout=60)


if __name__ == "__main__":
    main()
