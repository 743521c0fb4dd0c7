"""The notebooks are committed clean and follow the ladder's rules (nbmake executes them)."""

import re
from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def test_the_ladder_is_there():
    names = [p.name for p in NOTEBOOKS]
    assert names == ["00_overview.ipynb", "01_init_process_group.ipynb", "02_ddp_wrap.ipynb",
                     "03_distributed_sampler.ipynb", "04_no_sync_accumulation.ipynb", "05_teardown.ipynb",
                     "06_capstone_port_a_script.ipynb", "07_performance_lab.ipynb",
                     "08_beyond_one_machine.ipynb", "09_pitfalls.ipynb", "10_beyond_ddp_sharding.ipynb",
                     "11_build_your_own_ddp.ipynb"]


def test_every_notebook_ends_with_a_recap_and_a_link_to_the_next():
    # The last one links back to the start: the overview or the README.
    for path, following in zip(NOTEBOOKS, NOTEBOOKS[1:] + [None]):
        last = nbformat.read(path, as_version=4).cells[-1]
        assert last.cell_type == "markdown" and "Recap" in last.source, path.name
        if following is None:
            assert f"]({NOTEBOOKS[0].name})" in last.source or "](../README.md)" in last.source, path.name
        else:
            assert f"]({following.name})" in last.source, f"{path.name} should link to {following.name}"


def test_notebooks_01_to_05_ask_to_predict_and_end_with_an_exercise():
    for path in NOTEBOOKS[1:6]:
        code = [c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
        asked = [s for s in code if s.startswith("exercises.ask(")]
        revealed = [s for s in code if s.startswith("exercises.reveal(")]
        assert asked and len(asked) == len(revealed), path.name
        assert any("exercises.start(" in s for s in code) and any("exercises.check(" in s for s in code)


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


HINT_OR_SOLUTION = re.compile(r"\b(?:hint|solution)\(")


def live_hint_calls(cells) -> list:
    """(cell index, line) of each uncommented code line that calls ``hint(`` or ``solution(``."""
    return [(i, line) for i, cell in enumerate(cells) if cell.cell_type == "code"
            for line in cell.source.splitlines()
            if HINT_OR_SOLUTION.search(line) and not line.lstrip().startswith("#")]


def test_live_hint_calls_are_found():
    cells = [nbformat.v4.new_code_cell("exercises.hint('shard')"),
             nbformat.v4.new_code_cell("# exercises.hint('shard')\n  exercises.solution(\"shard\")"),
             nbformat.v4.new_markdown_cell("exercises.hint('shard') in prose is fine")]
    assert live_hint_calls(cells) == [(0, "exercises.hint('shard')"), (1, '  exercises.solution("shard")')]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_run_all_prints_no_hint_and_no_solution(path):
    # A hint or a solution shows only when the learner asks: its line is commented out until then.
    cells = nbformat.read(path, as_version=4).cells
    assert live_hint_calls(cells) == [], f"{path.name}: comment these lines out"
