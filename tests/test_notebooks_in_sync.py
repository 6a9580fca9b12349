"""Every notebook matches its jupytext py:percent pair, cell source for cell source.

The .py file is what a reviewer reads in a diff; the .ipynb is what a learner opens.
They must say the same thing, cell for cell. Outputs are not compared: a learner who saves
a notebook with its outputs still passes the README's test command. That the committed
notebooks carry no outputs is repository hygiene, checked by .ci/run (nbstripout --verify).
"""

import shutil
from pathlib import Path

import jupytext
import nbformat
import pytest

WORKBOOK = Path(__file__).resolve().parents[1] / "workbook"
NOTEBOOKS = sorted(WORKBOOK.glob("[0-9][0-9]_*.ipynb"))
PAIRS = sorted(WORKBOOK.glob("[0-9][0-9]_*.py"))


def _cells(nb):
    return [(c.cell_type, c.source.strip()) for c in nb.cells]


def test_every_notebook_has_its_pair_and_back():
    ipynb = {p.stem for p in NOTEBOOKS}
    py = {p.stem for p in PAIRS}
    assert ipynb == py, f"notebooks without a .py pair: {sorted(ipynb - py)}; .py without a notebook: {sorted(py - ipynb)}"


def _assert_in_sync(notebook, pair):
    """The notebook's cells say what its py:percent pair says: type, source and tags."""
    from_py = jupytext.read(pair)
    committed = jupytext.read(notebook)
    got, expected = _cells(committed), _cells(from_py)
    for i, (a, b) in enumerate(zip(got, expected)):
        assert a == b, (f"{notebook.name} cell {i} differs from {pair.name}; run "
                        f"`jupytext --to ipynb workbook/{pair.name}` (or --sync)\n"
                        f"ipynb: {a[1][:200]!r}\npy:    {b[1][:200]!r}")
    assert len(got) == len(expected), f"{notebook.name}: {len(got)} cells, {pair.name}: {len(expected)}"
    tags_py = [sorted(c.metadata.get("tags", [])) for c in from_py.cells]
    tags_nb = [sorted(c.metadata.get("tags", [])) for c in committed.cells]
    assert tags_nb == tags_py, f"{notebook.name}: cell tags differ from {pair.name}"


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_matches_its_py_percent_pair(notebook):
    pair = notebook.with_suffix(".py")
    if not pair.exists():
        pytest.fail(f"{notebook.name}: no {pair.name}")
    _assert_in_sync(notebook, pair)


def test_a_notebook_saved_with_outputs_is_still_in_sync(tmp_path):
    """What Jupyter writes when a learner runs a chapter and saves it: outputs, execution
    counts, the kernel's language_info. A copy, so the committed notebook stays stripped."""
    notebook = NOTEBOOKS[0]
    nb = nbformat.read(notebook, as_version=4)
    count = 0
    for cell in nb.cells:
        if cell.cell_type == "code":
            count += 1
            cell.execution_count = count
            cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="device: simulator\n"),
                            nbformat.v4.new_output("execute_result", {"text/plain": "42"}, execution_count=count)]
    nb.metadata["language_info"] = {"name": "python", "version": "3.12.3"}
    saved = tmp_path / notebook.name
    nbformat.write(nb, saved)
    shutil.copy(notebook.with_suffix(".py"), tmp_path)
    assert count and all(c.outputs for c in nbformat.read(saved, as_version=4).cells if c.cell_type == "code")
    _assert_in_sync(saved, saved.with_suffix(".py"))
