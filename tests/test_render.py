"""The teachers' render command: every notebook executed into HTML, the notebooks left clean."""

import json
import subprocess
import sys

from ddp_tutorial import render


def notebook(path, cells):
    """A minimal notebook of code cells: (source, tags) pairs."""
    nb = {"nbformat": 4, "nbformat_minor": 5, "metadata": {"kernelspec": {"name": "python3",
          "display_name": "Python 3", "language": "python"}},
          "cells": [{"cell_type": "code", "execution_count": None, "id": f"c{i}", "metadata": {"tags": tags},
                     "outputs": [], "source": source} for i, (source, tags) in enumerate(cells)]}
    path.write_text(json.dumps(nb))
    return path


def test_render_executes_into_html_and_leaves_the_notebook_clean(tmp_path):
    good = notebook(tmp_path / "00_good.ipynb", [("print(6 * 7)", []),
                                                  ("raise ValueError('shown on purpose')", ["raises-exception"]),
                                                  ("import os; print(os.getcwd())", [])])
    bad = notebook(tmp_path / "01_bad.ipynb", [("1 / 0", []), ("print('after')", [])])
    before = good.read_text()
    rows = render.render([good, bad], tmp_path / "html", timeout_per_cell=60)
    assert [r["ok"] for r in rows] == [True, False]
    page = (tmp_path / "html" / "00_good.html").read_text()
    assert "42" in page and "shown on purpose" in page and str(tmp_path) in page  # ran in its own folder
    assert rows[1]["errors"] == ["cell 0: ZeroDivisionError: division by zero"]
    assert "after" in (tmp_path / "html" / "01_bad.html").read_text()  # rendered past the failing cell
    assert good.read_text() == before  # no outputs written back


def test_render_command_exits_1_on_a_failing_notebook_and_refuses_missing_files(tmp_path):
    bad = notebook(tmp_path / "bad.ipynb", [("assert False, 'claim does not hold'", [])])
    done = subprocess.run([sys.executable, "-m", "ddp_tutorial.render", "--out", str(tmp_path / "o"), str(bad)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "claim does not hold" in done.stdout and "0 of 1" in done.stdout
    missing = subprocess.run([sys.executable, "-m", "ddp_tutorial.render", str(tmp_path / "nope.ipynb")],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "not found" in missing.stderr
