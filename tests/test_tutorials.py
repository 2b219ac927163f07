"""Every tutorial runs from top to bottom and its asserted facts hold.

A tutorial is a jupytext percent-format script under docs/tutorials/; it is turned into a notebook
and executed in a Jupyter kernel, as the documentation build executes it, so an error or a failed
`assert` in any cell fails here. The ones that train a model are marked slow (`make test-slow`).
"""

from __future__ import annotations

from pathlib import Path

import pytest

jupytext = pytest.importorskip("jupytext")
nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")

TUTORIALS = Path(__file__).resolve().parents[1] / "docs" / "tutorials"
# Tutorials that take more than about a minute on 2 CPU cores.
SLOW = {"02_pixel_attention_and_vit.py", "03_dot_product_to_translation.py", "04_captioning_with_attention.py"}


def _params():
    for path in sorted(TUTORIALS.glob("[0-9][0-9]_*.py")):
        marks = [pytest.mark.slow] if path.name in SLOW else []
        yield pytest.param(path, id=path.stem, marks=marks)


def test_every_tutorial_is_collected():
    names = [p.name for p in TUTORIALS.glob("[0-9][0-9]_*.py")]
    assert "01_attention_from_scratch.py" in names
    assert SLOW <= set(names), f"SLOW names a tutorial that does not exist: {SLOW - set(names)}"


@pytest.mark.parametrize("path", list(_params()))
def test_tutorial_runs(path: Path, tmp_path: Path):
    notebook = jupytext.read(path)
    client = nbclient.NotebookClient(
        notebook, timeout=900, kernel_name="python3", allow_errors=False,
        resources={"metadata": {"path": str(tmp_path)}},  # files a tutorial writes land here
    )
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as e:
        pytest.fail(f"{path.name} failed:\n{e}")
    finally:
        # the executed notebook, outputs and all, to read when a number moves
        nbformat.write(notebook, tmp_path / f"{path.stem}.ipynb")
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert any(o.get("output_type") == "stream" for o in outputs), "a tutorial prints its results"
    assert any("image/png" in o.get("data", {}) for o in outputs), "a tutorial shows at least one figure"
