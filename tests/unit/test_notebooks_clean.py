"""Notebooks are committed without outputs: CI executes them (tests/distributed/test_notebook.py)."""

import json
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).parents[2] / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert [p.name for p in NOTEBOOKS] == ["finetune_minilm.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_has_no_outputs(path):
    nb = json.loads(path.read_text())
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [], f"{path.name} cell {i} has outputs: clear them before committing"
            assert cell["execution_count"] is None, f"{path.name} cell {i} has an execution count"
    assert "widgets" not in nb["metadata"], f"{path.name} carries saved widget state"
