"""The notebooks execute top to bottom (CPU, small models), so they cannot rot; they are stored without outputs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="pip install nbformat nbclient ipykernel")
nbclient = pytest.importorskip("nbclient", reason="pip install nbformat nbclient ipykernel")
pytest.importorskip("transformers", reason="the notebooks use transformers models")

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = {
    # notebook -> lines its outputs must contain (the notebooks assert exactness themselves)
    "01_quickstart.ipynb": ["gradients bitwise equal: True, outputs equal: True, buffers equal: True", "loaded plan:"],
    "02_tradeoffs.ipynb": ["solvers:", "measured memory monotone in the budget", "least memory from",
                           "noise: the model against itself", "budget 0.25:",
                           "ours over budget: none"],
}


def _read(name: str):
    return nbformat.read(ROOT / "notebooks" / name, as_version=4)


def test_every_notebook_is_tested():
    assert sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb")) == sorted(NOTEBOOKS)


@pytest.mark.parametrize("name", sorted(NOTEBOOKS))
def test_stored_without_outputs(name):
    code = [c for c in _read(name).cells if c.cell_type == "code"]
    assert code
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in code)


@pytest.mark.slow  # a kernel per notebook, every cell run: minutes on 2 cores
@pytest.mark.parametrize("name", sorted(NOTEBOOKS))
def test_notebook_executes(name, monkeypatch):
    nb = _read(name)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    # No cell timeout: a loaded machine makes a cell slower, not wrong (the test's own runner may bound the run).
    client = nbclient.NotebookClient(nb, timeout=None, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}})
    client.execute()  # raises CellExecutionError, naming the cell, when any cell fails
    text = "\n".join(
        out.get("text", "") if out.get("output_type") == "stream" else str(out.get("data", {}).get("text/plain", ""))
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
    )
    for expected in NOTEBOOKS[name]:
        assert expected in text, f"{name}: no output line containing {expected!r}"
