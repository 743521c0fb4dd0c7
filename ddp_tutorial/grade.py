"""``python -m ddp_tutorial.grade SUBMISSIONS [--out DIR] [--jobs N] [--timeout S]``: grade a class
with ``teacher/grade/`` (docs/grading.md). Exit 0 done, 2 layout refused, 3 no sandbox here."""

import argparse
import sys
from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    from ddp_tutorial.teacher import grade
    from ddp_tutorial.teacher.grade.collect import FILES

    parser = argparse.ArgumentParser(prog="python -m ddp_tutorial.grade",
                                     description=grade.__doc__.splitlines()[0])
    add = parser.add_argument
    add("submissions", help="one folder (or .zip) per learner, named for the learner, with any of "
                            + ", ".join(FILES))
    add("--out", default="grades", help="for report.html, report.csv and the cache (default: grades)")
    add("--jobs", type=int, default=1, help="checks run at once, each in its own sandbox (default: 1)")
    add("--timeout", type=float, default=60.0, help="seconds one run of a file may take (default: 60)")
    args = parser.parse_args(argv)
    if args.jobs < 1 or args.timeout <= 0:
        parser.error("--jobs must be at least 1 and --timeout above 0")
    try:
        result = grade.grade(args.submissions, args.out, jobs=args.jobs, timeout=args.timeout)
    except (grade.LayoutError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, grade.LayoutError) else 3
    return 0 if result["outcomes"] else 1


if __name__ == "__main__":
    sys.exit(main())
