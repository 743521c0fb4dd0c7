"""``python -m ddp_tutorial.teacher.grade.checkone EXERCISE TIMEOUT FD < FILE``, in the sandbox:
``exercises.check`` the file, the result as JSON on pipe FD, which the ranks do not inherit."""

from __future__ import annotations

import fcntl
import json
import os
import sys
from pathlib import Path

from ddp_tutorial.teacher.grade.sandbox import CHECK_DIR


def main(argv) -> int:
    exercise, timeout, fd = argv[0], float(argv[1]), int(argv[2])
    fcntl.fcntl(fd, fcntl.F_SETFD, fcntl.FD_CLOEXEC)
    result_pipe = os.fdopen(fd, "w", encoding="utf-8")
    for folder in (CHECK_DIR, f"{CHECK_DIR}/home", f"{CHECK_DIR}/runs"):
        os.mkdir(folder, 0o700)
    path = f"{CHECK_DIR}/{exercise}.py"
    Path(path).write_bytes(sys.stdin.buffer.read())
    os.chdir(CHECK_DIR)
    from ddp_tutorial import exercises, launcher

    # torch is imported once, by the forkserver, before the first run's deadline starts: on a busy
    # machine the import alone can take most of a short deadline.
    launcher.warm_ready()
    result = exercises.check(exercise, path, timeout=timeout)
    json.dump({"passed": result.passed, "criteria": [list(c) for c in result.criteria],
               "message": result.message, "seconds": result.seconds}, result_pipe)
    result_pipe.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
