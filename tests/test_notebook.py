"""docs/quickstart.ipynb, executed as a reader runs it: every cell in order, in a fresh Jupyter kernel of
this Python (nbclient), on the embedded model. What it prints and draws is what the reader reads."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

NOTEBOOK = Path(__file__).resolve().parents[1] / "docs" / "quickstart.ipynb"
PLOTLY = "application/vnd.plotly.v1+json"


def test_the_notebook_is_committed_without_outputs():
    """Outputs are made by running it; committed ones would go stale (and bloat diffs)."""
    import nbformat

    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.outputs == [] and c.execution_count is None for c in code)


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """The notebook after a run (HEADSCOPE_HOME: an empty folder, as tests/conftest.py sets; the converted
    model is read from the shared HEADSCOPE_MODEL_CACHE). A cell that raises fails the fixture, with the cell."""
    import nbformat
    from nbclient import NotebookClient

    folder = tmp_path_factory.mktemp("notebook")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(folder)}}).execute()
    return nb


def printed(nb) -> str:
    return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                   for o in c.outputs if o.output_type == "stream" and o.name == "stdout")


def figures(nb) -> list[dict]:
    """The plotly figures the notebook displays, in order, as the reader's Jupyter receives them."""
    found = []
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            data = o.get("data", {})
            if PLOTLY in data:
                found.append(data[PLOTLY] if isinstance(data[PLOTLY], dict) else json.loads(data[PLOTLY]))
    return found


@pytest.mark.integration
@pytest.mark.slow  # a Jupyter kernel that runs every cell
def test_the_notebook_finds_the_induction_heads_it_draws(executed):
    out = printed(executed)
    # the model copies the second copy of the words: its loss falls far below the first copy's
    first, second = map(float, re.search(r"first copy: ([\d.]+); second copy: ([\d.]+)", out).groups())
    assert second < first - 3, out
    # the strongest induction head, printed, is the grid's highest cell and outlined there, and the heatmap's head
    found = re.search(r"strongest induction head: layer (\d+), head (\d+) \(score ([\d.]+)\)", out)
    assert found, out
    layer, head, score = int(found[1]), int(found[2]), float(found[3])
    grid, heatmap, sinks = figures(executed)
    z = np.array([[np.nan if v is None else v for v in row] for row in grid["data"][0]["z"]], dtype=float)
    assert z.shape == (30, 9)
    assert np.unravel_index(np.nanargmax(z), z.shape) == (layer, head)
    assert score == pytest.approx(np.nanmax(z), abs=0.005) and score > 0.2  # a head that really copies
    assert grid["layout"]["title"]["text"] == "Induction score per head"
    outline = grid["layout"]["shapes"][0]
    assert (outline["y0"] + 0.5, outline["x0"] + 0.5) == (layer, head)
    assert heatmap["layout"]["title"]["text"] == f"Attention of layer {layer}, head {head}"
    assert sinks["layout"]["title"]["text"].startswith("Attention received per key")
    # ablating the top three induction heads breaks the copying; three random heads do far less
    clean, ablated, low, high = map(float, re.search(
        r"clean ([\d.]+), top-3 induction heads ablated ([\d.]+), 3 random heads ablated ([\d.]+) to ([\d.]+)", out).groups())
    assert ablated > clean + 1 and ablated > high > 0 and low <= high, out
