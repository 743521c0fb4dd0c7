"""``python -m ddp_tutorial.grade``: the teacher's grader, which lives in ``teacher/grade/`` (docs/grading.md)."""

if __name__ == "__main__":
    import sys

    from ddp_tutorial.teacher.grade.__main__ import main

    sys.exit(main())
