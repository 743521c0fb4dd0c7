"""Inside the sandbox, as the sandbox's uid: ``exercises.check`` one file, the result as JSON on a pipe.

    python -m ddp_tutorial.teacher.grade.checkone EXERCISE PATH TIMEOUT FD

FD is a pipe to the grader, made close-on-exec here first, so neither the
fork server nor the ranks (the learner's code) inherit it.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys


def main(argv) -> int:
    exercise, path, timeout, fd = argv[0], argv[1], float(argv[2]), int(argv[3])
    fcntl.fcntl(fd, fcntl.F_SETFD, fcntl.FD_CLOEXEC)
    result_pipe = os.fdopen(fd, "w", encoding="utf-8")
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
