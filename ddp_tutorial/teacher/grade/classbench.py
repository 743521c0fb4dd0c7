"""``python -m ddp_tutorial.bench --grade``: a generated class (solutions, the catalogued mistakes of
``tests/exercise_mistakes/``, skeletons), graded from an empty cache once per ``--jobs`` value."""

from __future__ import annotations

import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Dict, List, Sequence

from ddp_tutorial.teacher import grade
from ddp_tutorial.exercises import EXERCISES, NAMES
from ddp_tutorial.lessons.table import text_table

MISTAKES_DIR = grade.KIT_ROOT / "tests" / "exercise_mistakes"


def make_class(folder: Path, learners: int) -> Dict[str, int]:
    """``learners`` folders of every exercise under ``folder``; returns how many files of each kind."""
    mistakes = {name: sorted(MISTAKES_DIR.glob(f"{name}_*.py")) for name in NAMES}
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
    rows = []
    with tempfile.TemporaryDirectory(prefix="ddp-grade-bench-", ignore_cleanup_errors=True) as tmp:
        root = Path(tmp)
        kinds = make_class(root / "class", learners)
        print(f"a class of {learners} learners x {len(NAMES)} exercises: {kinds}", flush=True)
        for n in jobs:
            t0 = time.monotonic()
            result = grade.grade(root / "class", root / f"grades-{n}", jobs=n, timeout=timeout)
            rows.append({"jobs": n, "seconds": time.monotonic() - t0, "checks": learners * len(NAMES),
                         "statuses": Counter(o.status for o in result["outcomes"])})
    return rows


def format_rows(rows: List[Dict]) -> str:
    return text_table(["jobs", "wall s", "s per check", "statuses"], [
        (r["jobs"], f"{r['seconds']:.0f}", f"{r['seconds'] / r['checks']:.1f}",
         ", ".join(f"{k}: {v}" for k, v in sorted(r["statuses"].items()))) for r in rows])
