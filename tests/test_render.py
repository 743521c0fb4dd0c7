"""The teachers' render command: every notebook executed into HTML, the notebooks left clean."""

import html
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ddp_tutorial.teacher import render

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


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
    done = subprocess.run([sys.executable, "-m", "ddp_tutorial.teacher.render", "--out", str(tmp_path / "o"), str(bad)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "claim does not hold" in done.stdout and "0 of 1" in done.stdout
    missing = subprocess.run([sys.executable, "-m", "ddp_tutorial.teacher.render", str(tmp_path / "nope.ipynb")],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "not found" in missing.stderr


# -- Reference pages: no answers, a title, offline math (one small notebook, rendered once) ----------
FORMULA = r"$$t(n, p) = 2(p-1)\,\alpha + \frac{2(p-1)}{p}\cdot\frac{n}{B}$$"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--host-resolver-rules=MAP * ~NOTFOUND"]  # no name resolves: the machine is offline


def mixed_notebook(path):
    nb = {"nbformat": 4, "nbformat_minor": 5, "metadata": {"kernelspec": {"name": "python3",
          "display_name": "Python 3", "language": "python"}}, "cells": [
        {"cell_type": "markdown", "id": "m0", "metadata": {}, "source": "# The α-β model, *offline*\n\nSome text."},
        {"cell_type": "markdown", "id": "m1", "metadata": {},
         "source": f"The ring all-reduce:\n\n{FORMULA}\n\nfor $p$ ranks; `$HOME` stays code."},
        {"cell_type": "code", "id": "c0", "execution_count": None, "metadata": {}, "outputs": [],
         "source": "from ddp_tutorial import exercises\nexercises.start('init')"},
        {"cell_type": "code", "id": "c1", "execution_count": None, "metadata": {"tags": ["answer"]},
         "outputs": [], "source": "exercises.hint('init')"}]}
    path.write_text(json.dumps(nb))
    return path


@pytest.fixture(scope="module")
def reference_page(tmp_path_factory):
    folder = tmp_path_factory.mktemp("reference")
    my_work = Path("notebooks/my_work")
    before = sorted(p.name for p in my_work.iterdir()) if my_work.is_dir() else None
    rows = render.render([mixed_notebook(folder / "07_tiny.ipynb")], folder / "html", timeout_per_cell=120)
    after = sorted(p.name for p in my_work.iterdir()) if my_work.is_dir() else None
    return {"row": rows[0], "page": Path(rows[0]["html"]), "my_work": (before, after)}


def test_reference_pages_give_no_answer_and_touch_no_learner_folder(reference_page):
    from ddp_tutorial import exercises

    page = reference_page["page"].read_text(encoding="utf-8")
    assert reference_page["row"]["ok"] and reference_page["row"]["left_out"] == 1
    assert str(exercises.hint("init"))[:40] not in page and "left out of the reference page" in page
    started = re.search(r"wrote (\S+/init\.py)", page)
    assert started and "ddp-tutorial-render-" in started.group(1)  # a scratch folder, not my_work/
    assert not Path(started.group(1)).exists()  # removed once rendered
    before, after = reference_page["my_work"]
    assert before == after
    assert os.environ.get("DDP_TUTORIAL_MY_WORK") != str(Path(started.group(1)).parent)  # restored


def test_answers_stay_when_asked_for():
    import nbformat

    answer = {"tags": ["answer"]}
    new = nbformat.v4.new_code_cell
    nb = nbformat.v4.new_notebook(cells=[new("exercises.hint('init')", metadata=answer),
                                         new("exercises.check('init')", metadata=answer),
                                         new("exercises.check('capstone', path)"),
                                         new("exercises.start('init')")])
    for cell in nb.cells:
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="the answer\n")]
    assert render.leave_out_answers(nb) == 2  # the tagged: the hint, the check of the own file
    assert [c.outputs[0]["text"] == "the answer\n" for c in nb.cells] == [False, False, True, True]


def test_the_notebooks_answer_cells_are_tagged():
    """A reference page leaves out the cells tagged "answer": in the notebooks as committed, every
    hint, solution, and check of the learner's own untouched file by name alone."""
    import nbformat

    calls = re.compile(r"exercises\.(hint|solution)\(|exercises\.check\(\s*[\"'][a-z_]+[\"']\s*\)")
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        for cell in nbformat.read(path, as_version=4).cells:
            if cell.cell_type == "code" and calls.search(cell.source):
                tags = cell.metadata.get("tags", [])
                assert render.ANSWER_TAG in tags, f"{path.name}: {cell.source[:60]}"


def test_the_page_has_a_title_and_loads_no_script(reference_page):
    page = reference_page["page"].read_text(encoding="utf-8")
    assert "<title>The α-β model, offline</title>" in page
    assert not re.search(r"<script[^>]*\bsrc=", page) and "cdnjs" not in page and "mathjax" not in page.lower()
    assert page.count("<math ") == 2 and "<mfrac>" in page and "<code>$HOME</code>" in page


def chromium_dom(page: Path, tmp_path: Path, name: str):
    """The DOM after Chromium loaded ``page`` with no network, and the http(s) requests the page made."""
    log = tmp_path / f"{name}.netlog.json"
    done = subprocess.run([CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / (name + '-profile')}",
                           f"--log-net-log={log}", "--dump-dom", page.as_uri()],
                          capture_output=True, text=True, timeout=120)
    events = json.loads(log.read_text())["events"]
    # The browser's own requests (update checks, ...) have no page behind them: "not an origin".
    made = sorted({e["params"]["url"] for e in events if "url" in e.get("params", {})
                   and e.get("params", {}).get("initiator", "not an origin") != "not an origin"})
    return done.stdout, made


@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (.ci/run installs Debian's chromium)")
def test_the_formula_renders_offline_in_a_browser_and_the_page_requests_nothing(reference_page, tmp_path):
    # The page as rendered, plus a probe that writes how the browser laid the fraction out.
    probe = ("<script>const f = document.querySelector('mfrac'), i = document.querySelector('mi');"
             "document.body.dataset.probe = JSON.stringify({frac: f.getBoundingClientRect().height, "
             "mi: i.getBoundingClientRect().height, mathml: typeof MathMLElement});</script></body>")
    probed = tmp_path / "probed.html"
    probed.write_text(reference_page["page"].read_text(encoding="utf-8").replace("</body>", probe),
                      encoding="utf-8")
    dom, made = chromium_dom(probed, tmp_path, "page")
    layout = json.loads(html.unescape(re.search(r'data-probe="([^"]*)"', dom).group(1)))
    assert layout["mathml"] == "function" and layout["frac"] > 1.5 * layout["mi"] > 0  # a stacked fraction
    assert made == []
    # The detector sees a page that does load from a CDN (as nbconvert's default template does).
    cdn = tmp_path / "cdn.html"
    cdn.write_text('<html><head><script src="https://cdnjs.cloudflare.com/ajax/libs/mathjax/2.7.7/latest.js">'
                   "</script></head><body>x</body></html>")
    _, made = chromium_dom(cdn, tmp_path, "cdn")
    assert made == ["https://cdnjs.cloudflare.com/ajax/libs/mathjax/2.7.7/latest.js"]
