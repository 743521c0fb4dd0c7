"""Run a command in this process group, and kill the group once the launching process is gone.

``python -I -S guard.py FD COMMAND...``: FD is the ranks' end of the launcher's watch socket
(``start.launcher_watch``), at end-of-file once the launcher is gone, however it ended. Otherwise
the guard exits as the command did. SIGTERM is for the command: the guard outlives it. Standard
library only, so that it starts at once.
"""

import contextlib
import os
import signal
import subprocess
import sys
import threading


def _kill_group_at_eof(fd: int) -> None:
    with contextlib.suppress(OSError):
        while os.read(fd, 1):
            pass
    os.killpg(0, signal.SIGKILL)


def main() -> None:
    fd = int(sys.argv[1])
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the terminal's Ctrl-C is for the launcher
    threading.Thread(target=_kill_group_at_eof, args=(fd,), daemon=True).start()
    # The command gets the default handlers back (exec resets handled signals, not ignored ones).
    command = subprocess.Popen(sys.argv[2:], restore_signals=True,
                               preexec_fn=lambda: [signal.signal(s, signal.SIG_DFL)
                                                   for s in (signal.SIGTERM, signal.SIGINT)])
    code = command.wait()
    if code < 0:  # die of the same signal, so the launcher reads the same exit status
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    main()
