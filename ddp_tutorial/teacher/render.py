"""``python -m ddp_tutorial.teacher.render [--out rendered] [--answers] [NOTEBOOK ...]``: every
notebook executed (nbconvert, a fresh kernel, exercises in a scratch folder) to a page that stands
alone offline (MathML, no CDN). A failing cell is named, the page rendered past it, the exit 1;
the outputs of cells tagged ``answer`` are left out unless ``--answers``."""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from unittest import mock
from pathlib import Path
from typing import Dict, List, Optional, Sequence

#: The tag of cells whose output gives an answer away: a hint, a solution, a check of the own file.
ANSWER_TAG = "answer"
LEFT_OUT = ("(left out of the reference page: run this cell in the notebook; "
            "python -m ddp_tutorial.teacher.render --answers includes it)")
#: The lab template without the scripts it loads from CDNs (MathJax, require.js, widgets, mermaid).
OFFLINE_TEMPLATE = """{%- extends 'lab/index.html.j2' -%}
{% block html_head_js_requirejs %}{% endblock html_head_js_requirejs %}
{% block jupyter_widgets %}{% endblock jupyter_widgets %}
{% block html_head_js_mathjax %}{% endblock html_head_js_mathjax %}
{% block html_head_js_mermaidjs %}{% endblock html_head_js_mermaidjs %}
"""
DISPLAY_MATH = re.compile(r"\$\$(.+?)\$\$", re.S)
INLINE_MATH = re.compile(r"(?<![\\$])\$(?!\s)([^$\n]+?)(?<!\s)\$(?!\$)")


def unexpected_errors(nb) -> List[str]:
    """The errors of cells not tagged ``raises-exception`` (the cells meant to show one), as lines."""
    return [f"cell {index}: {output['ename']}: {output['evalue']}"[:300]
            for index, cell in enumerate(nb.cells)
            if "raises-exception" not in cell.get("metadata", {}).get("tags", [])
            for output in cell.get("outputs", []) if output.get("output_type") == "error"]


def title(nb) -> str:
    """The notebook's first heading, as plain text (the page's <title>)."""
    heading = next((line for cell in nb.cells if cell.cell_type == "markdown"
                    for line in cell.source.splitlines() if line.startswith("#")), "Notebook")
    text = re.sub(r"[`*_]", "", heading.lstrip("#").strip())
    return re.sub(r"\[([^]]*)\]\([^)]*\)", r"\1", text)


def math_to_mathml(markdown: str) -> str:
    """``$$...$$`` and ``$...$`` in a markdown cell as MathML, outside code spans and fenced code."""
    from latex2mathml.converter import convert

    def convert_text(text: str) -> str:
        text = DISPLAY_MATH.sub(lambda m: "\n\n" + convert(m.group(1).strip(), display="block") + "\n\n", text)
        return INLINE_MATH.sub(lambda m: convert(m.group(1)), text)

    parts = re.split(r"(```.*?```|`[^`\n]*`)", markdown, flags=re.S)
    return "".join(part if part.startswith("`") else convert_text(part) for part in parts)


def leave_out_answers(nb) -> int:
    """Replace the outputs of the cells tagged ``ANSWER_TAG`` with one line saying so; how many.
    (nbconvert's ``TagRemovePreprocessor`` would remove them without a word.)"""
    import nbformat

    answers = [c for c in nb.cells if ANSWER_TAG in c.metadata.get("tags", []) and c.get("outputs")]
    for cell in answers:
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=LEFT_OUT + "\n")]
    return len(answers)


def to_html(nb) -> str:
    """The offline page: titled, math as MathML, no script from anywhere."""
    from jinja2 import DictLoader
    from nbconvert import HTMLExporter

    for cell in nb.cells:
        if cell.cell_type == "markdown" and "$" in cell.source:
            cell.source = math_to_mathml(cell.source)
    exporter = HTMLExporter(extra_loaders=[DictLoader({"offline.html.j2": OFFLINE_TEMPLATE})],
                            template_file="offline.html.j2")
    body, _ = exporter.from_notebook_node(nb, resources={"metadata": {"name": title(nb)}})
    return body


def render(notebooks: Sequence[Path], out: Path, timeout_per_cell: int = 300,
           answers: bool = False) -> List[Dict]:
    """Execute each notebook and write ``<out>/<name>.html``; one row per notebook: ``notebook``,
    ``html``, ``seconds``, ``ok``, ``errors`` (each unexpected error, by cell), ``left_out``."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ddp-tutorial-render-",
                                     ignore_cleanup_errors=True) as tmp:
        return [_render_one(Path(path), out, timeout_per_cell, answers, Path(tmp) / Path(path).stem)
                for path in notebooks]


def _render_one(path: Path, out: Path, timeout_per_cell: int, answers: bool, scratch: Path) -> Dict:
    import nbformat  # nbconvert and nbformat come with jupyterlab
    from nbconvert.preprocessors import ExecutePreprocessor

    print(f"rendering {path.name} ...", flush=True)
    t0 = time.perf_counter()
    nb = nbformat.read(path, as_version=4)
    # allow_errors: a failing cell still gives a page up to and past it, and is reported below.
    runner = ExecutePreprocessor(timeout=timeout_per_cell, allow_errors=True)
    try:  # the kernel inherits this environment: the exercises start from fresh skeletons
        with mock.patch.dict(os.environ, DDP_TUTORIAL_MY_WORK=str(scratch / "my_work"),
                             DDP_TUTORIAL_RUNS=str(scratch / "runs")):
            runner.preprocess(nb, {"metadata": {"path": str(path.resolve().parent)}})
        errors = unexpected_errors(nb)
    except Exception as exc:  # a cell past its timeout, a dead kernel: render what ran
        errors = [f"{type(exc).__name__}: {exc}"[:300]]
    left_out = 0 if answers else leave_out_answers(nb)
    page = out / f"{path.stem}.html"
    page.write_text(to_html(nb), encoding="utf-8")
    row = {"notebook": path.name, "html": str(page), "seconds": time.perf_counter() - t0,
           "ok": not errors, "errors": errors, "left_out": left_out}
    print(f"  {'ok' if row['ok'] else 'FAILED'} in {row['seconds']:.0f} s -> {page}"
          + (f" ({left_out} hint/solution/check outputs left out)" if left_out else ""), flush=True)
    for line in errors:
        print(f"  {line}", flush=True)
    return row


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddp_tutorial.teacher.render",
                                     description="Every notebook, executed, to an HTML page.")
    add = parser.add_argument
    add("notebooks", nargs="*", type=Path, help="default: every notebooks/*.ipynb, in order")
    add("--out", type=Path, default=Path("rendered"), help="default: rendered")
    add("--timeout", type=int, default=300, help="seconds per cell (default: 300)")
    add("--answers", action="store_true", help="keep the answer cells' outputs (a teacher's key)")
    args = parser.parse_args(argv)
    notebooks = args.notebooks or sorted(Path("notebooks").glob("[0-9]*.ipynb"))
    if not notebooks:
        parser.error("no notebooks given, and none in ./notebooks")
    if missing := [str(nb) for nb in notebooks if not Path(nb).is_file()]:
        parser.error(f"not found: {', '.join(missing)}")
    rows = render(notebooks, args.out, args.timeout, answers=args.answers)
    failed = [r["notebook"] for r in rows if not r["ok"]]
    total = sum(r["seconds"] for r in rows)
    print(f"{len(rows) - len(failed)} of {len(rows)} notebooks rendered to {args.out} in {total:.0f} s"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
