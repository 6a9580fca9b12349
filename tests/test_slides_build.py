"""slides/build.py names a missing Node, npm or Chromium in one line, with what to install,
instead of a traceback. Nothing is built and npm is never run here."""

import importlib.util
import sys
from pathlib import Path

import pytest

BUILD_PY = Path(__file__).resolve().parents[1] / "slides" / "build.py"


@pytest.fixture
def build(monkeypatch, tmp_path):
    spec = importlib.util.spec_from_file_location("_slides_build", BUILD_PY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no node, npm or chromium on it
    monkeypatch.delenv("CHROME_PATH", raising=False)
    monkeypatch.setattr(module, "REPO", tmp_path)        # no node_modules/ there
    monkeypatch.setattr(module, "run", lambda *a, **k: pytest.fail(f"ran {a}"))
    return module


def _message(fn, *args):
    with pytest.raises(SystemExit) as exc:
        fn(*args)
    text = str(exc.value.code)
    assert "\n" not in text and text.startswith("slides: "), text
    return text


def test_no_chromium_says_what_to_install(build, monkeypatch):
    text = _message(build.chrome_path)
    assert "no Chromium found" in text and "apt-get install -y chromium" in text and "CHROME_PATH" in text
    monkeypatch.setenv("CHROME_PATH", "/nowhere/chromium")
    text = _message(build.chrome_path)
    assert "CHROME_PATH=/nowhere/chromium is not a program" in text and "apt-get install -y chromium" in text


def test_chrome_path_that_names_a_program_is_used(build, monkeypatch):
    monkeypatch.setenv("CHROME_PATH", sys.executable)
    assert build.chrome_path() == sys.executable


def test_no_node_or_npm_says_what_to_install(build, monkeypatch, tmp_path):
    text = _message(build.marp_bin)
    assert "no Node.js found" in text and "nodejs.org" in text
    bin_dir = tmp_path / "bin"  # node, but no npm to install the Marp CLI with
    bin_dir.mkdir()
    (bin_dir / "node").write_text("#!/bin/sh\n")
    (bin_dir / "node").chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    text = _message(build.marp_bin)
    assert "no npm found" in text and "nodejs.org" in text


def test_main_names_the_missing_tool_before_building(build, monkeypatch, tmp_path):
    monkeypatch.setattr(build, "BUILD", tmp_path / "build")
    text = _message(build.main, [])
    assert "no Chromium found" in text
    assert not (tmp_path / "build").exists()
