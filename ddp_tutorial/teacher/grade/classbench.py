"""A generated class, graded one check at a time and a few at once: ``python -m ddp_tutorial.bench --grade``.

Each learner submits every exercise: mostly the reference solution, some the kit's
catalogued mistakes (``tests/exercise_mistakes/``, in a clone), some the untouched
skeleton. The class is graded once per ``--jobs`` value, each time from an empty
cache, and the wall times are printed side by side.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Sequence

from ddp_tutorial.teacher import grade
from ddp_tutorial.exercises import EXERCISES, NAMES

MISTAKES_DIR = grade.KIT_ROOT / "tests" / "exercise_mistakes"


def make_class(folder: Path, learners: int) -> Dict[str, int]:
    """``learners`` folders of every exercise under ``folder``; returns how many files of each kind."""
    mistakes = {name: sorted(MISTAKES_DIR.glob(f"{name}_*.py")) if MISTAKES_DIR.is_dir() else [] for name in NAMES}
    kinds = {"solution": 0, "mistake": 0, "skeleton": 0}
    for i in range(learners):
        mine = folder / f"learner{i + 1:02d}"
        mine.mkdir(parents=True)
        for j, name in enumerate(NAMES):
            pick = (3 * i + j) % 8  # 5 of 8 right, 2 a mistake, 1 the skeleton as given
            if pick < 5 or (pick < 7 and not mistakes[name]):
                source, kind = EXERCISES[name].solution, "solution"
            elif pick < 7:
                source, kind = mistakes[name][(i + pick) % len(mistakes[name])], "mistake"
            else:
                source, kind = EXERCISES[name].skeleton, "skeleton"
            (mine / f"{name}.py").write_bytes(source.read_bytes())
            kinds[kind] += 1
    return kinds


def run(learners: int = 30, jobs: Sequence[int] = (1, 2), timeout: float = 60.0) -> List[Dict]:
    """Grade a generated class once per value of ``jobs``; returns one row per run."""
    root = Path(tempfile.mkdtemp(prefix="ddp-grade-bench-"))
    rows = []
    try:
        kinds = make_class(root / "class", learners)
        print(f"a class of {learners} learners x {len(NAMES)} exercises: {kinds}", flush=True)
        for n in jobs:
            t0 = time.monotonic()
            result = grade.grade(root / "class", root / f"grades-{n}", jobs=n, timeout=timeout)
            statuses: Dict[str, int] = {}
            for outcome in result["outcomes"]:
                statuses[outcome.status] = statuses.get(outcome.status, 0) + 1
            rows.append({"jobs": n, "seconds": time.monotonic() - t0, "checks": learners * len(NAMES),
                         "statuses": statuses})
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return rows


def format_rows(rows: List[Dict]) -> str:
    lines = ["jobs  wall time   per check  statuses"]
    for row in rows:
        lines.append(f"{row['jobs']:>4}  {row['seconds']:>7.0f} s  {row['seconds'] / row['checks']:>7.1f} s  "
                     + ", ".join(f"{k}: {v}" for k, v in sorted(row["statuses"].items())))
    return "\n".join(lines)
