"""Every notebook is committed without outputs and matches its jupytext py:percent pair.

The .py file is what a reviewer reads in a diff; the .ipynb is what a learner opens.
They must say the same thing, cell for cell.
"""

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


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_matches_its_py_percent_pair(notebook):
    pair = notebook.with_suffix(".py")
    if not pair.exists():
        pytest.fail(f"{notebook.name}: no {pair.name}")
    from_py = jupytext.read(pair)
    committed = jupytext.read(notebook)
    got, expected = _cells(committed), _cells(from_py)
    for i, (a, b) in enumerate(zip(got, expected)):
        assert a == b, (f"{notebook.name} cell {i} differs from {pair.name}; run "
                        f"`jupytext --to ipynb {pair.relative_to(WORKBOOK.parent)}` (or --sync)\n"
                        f"ipynb: {a[1][:200]!r}\npy:    {b[1][:200]!r}")
    assert len(got) == len(expected), f"{notebook.name}: {len(got)} cells, {pair.name}: {len(expected)}"
    tags_py = [sorted(c.metadata.get("tags", [])) for c in from_py.cells]
    tags_nb = [sorted(c.metadata.get("tags", [])) for c in committed.cells]
    assert tags_nb == tags_py, f"{notebook.name}: cell tags differ from {pair.name}"


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_stripped(notebook):
    nb = nbformat.read(notebook, as_version=4)
    dirty = [i for i, c in enumerate(nb.cells)
             if c.cell_type == "code" and (c.get("outputs") or c.get("execution_count") is not None)]
    assert not dirty, f"{notebook.name}: cells {dirty} have outputs; run `nbstripout {notebook.relative_to(WORKBOOK.parent)}`"
