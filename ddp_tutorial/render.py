"""Render every notebook, executed, to HTML: results a teacher can project and learners compare.

    python -m ddp_tutorial.render                       # notebooks/*.ipynb -> rendered/*.html
    python -m ddp_tutorial.render --out /tmp/class notebooks/04_no_sync_accumulation.ipynb

Each notebook runs top to bottom in a fresh kernel started in its own folder
(as in JupyterLab), with nbconvert's executor; only the HTML is written, so the
notebooks in git stay without outputs. A notebook with a failing cell is still
rendered, past that cell, and the command names the cell and exits 1.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence


def unexpected_errors(nb) -> List[str]:
    """The errors of cells not tagged ``raises-exception`` (the cells meant to show one), as lines."""
    found = []
    for index, cell in enumerate(nb.cells):
        if "raises-exception" in cell.get("metadata", {}).get("tags", []):
            continue
        for output in cell.get("outputs", []):
            if output.get("output_type") == "error":
                found.append(f"cell {index}: {output['ename']}: {output['evalue']}"[:300])
    return found


def render(notebooks: Sequence[Path], out: Path, timeout_per_cell: int = 300) -> List[Dict]:
    """Execute each notebook and write ``<out>/<name>.html``; returns one row per notebook.

    Args:
        notebooks: the .ipynb files, run in this order, each in a fresh kernel in its own folder.
        out: the folder for the HTML files (made if missing).
        timeout_per_cell: seconds one cell may run before it is stopped (the launches
            in the notebooks have deadlines of their own, well below this).

    Returns:
        Rows of ``notebook``, ``html`` (the path), ``seconds``, ``ok`` (no unexpected
        error) and ``errors`` (each unexpected error, by cell).
    """
    import nbformat  # nbconvert and nbformat come with jupyterlab
    from nbconvert import HTMLExporter
    from nbconvert.preprocessors import ExecutePreprocessor

    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for path in map(Path, notebooks):
        print(f"rendering {path.name} ...", flush=True)
        t0 = time.perf_counter()
        nb = nbformat.read(path, as_version=4)
        # allow_errors: a failing cell still gives a page up to and past it, and is reported below.
        runner = ExecutePreprocessor(timeout=timeout_per_cell, allow_errors=True)
        try:
            runner.preprocess(nb, {"metadata": {"path": str(path.resolve().parent)}})
            errors = unexpected_errors(nb)
        except Exception as exc:  # a cell past its timeout, a dead kernel: render what ran
            errors = [f"{type(exc).__name__}: {exc}"[:300]]
        html = out / f"{path.stem}.html"
        body, _ = HTMLExporter().from_notebook_node(nb)
        html.write_text(body, encoding="utf-8")
        row = {"notebook": path.name, "html": str(html), "seconds": time.perf_counter() - t0,
               "ok": not errors, "errors": errors}
        print(f"  {'ok' if row['ok'] else 'FAILED'} in {row['seconds']:.0f} s -> {html}", flush=True)
        for line in errors:
            print(f"  {line}", flush=True)
        rows.append(row)
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddp_tutorial.render", description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=Path,
                        help="notebooks to render (default: every notebooks/*.ipynb, in order)")
    parser.add_argument("--out", type=Path, default=Path("rendered"), help="folder for the HTML (default: rendered)")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per cell (default: 300)")
    args = parser.parse_args(argv)
    notebooks = args.notebooks or sorted(Path("notebooks").glob("[0-9]*.ipynb"))
    if not notebooks:
        parser.error("no notebooks given, and none in ./notebooks")
    missing = [str(nb) for nb in notebooks if not Path(nb).is_file()]
    if missing:
        parser.error(f"not found: {', '.join(missing)}")
    rows = render(notebooks, args.out, args.timeout)
    failed = [r["notebook"] for r in rows if not r["ok"]]
    total = sum(r["seconds"] for r in rows)
    print(f"{len(rows) - len(failed)} of {len(rows)} notebooks rendered to {args.out} in {total:.0f} s"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
