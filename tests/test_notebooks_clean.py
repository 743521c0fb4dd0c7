"""The notebooks are committed clean and follow the ladder's rules (nbmake executes them)."""

from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def test_the_ladder_is_there():
    names = [p.name for p in NOTEBOOKS]
    assert names[:6] == ["00_overview.ipynb", "01_init_process_group.ipynb", "02_ddp_wrap.ipynb",
                         "03_distributed_sampler.ipynb", "04_no_sync_accumulation.ipynb",
                         "05_teardown.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{path.name}: a code cell holds outputs"
            assert cell.execution_count is None, f"{path.name}: a code cell holds an execution count"
    assert nb.metadata["kernelspec"]["name"] == "python3"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_explains_first_launches_through_the_kit_and_asserts(path):
    nb = nbformat.read(path, as_version=4)
    assert nb.cells[0].cell_type == "markdown"
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert "ddp_tutorial" in code
    assert "mp.spawn" not in code and "os.fork" not in code  # workers run from script files
    assert sum("assert " in c.source for c in nb.cells if c.cell_type == "code") >= 2
