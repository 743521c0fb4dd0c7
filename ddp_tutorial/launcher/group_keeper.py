"""The group keeper: when the launching process dies, kill every rank's process group it still had.

A rank dies with its launcher (the parent-death signal), but what the rank started
(a subprocess, a tool, a DataLoader worker) does not: the kernel sends that signal to
the direct child only. So ``launch`` starts this small process once, in a session of
its own, and tells it over a pipe which process groups are running::

    +<pgid>   a rank's process group started (cold: ``start_new_session``; warm: ``setsid``)
    -<pgid>   that group was swept and its leader is about to be reaped

When the pipe closes (the launcher exited, or was killed by SIGKILL: no code of its
runs then, but the kernel closes its end), the keeper sends SIGKILL to every group
still listed and exits. A process that started a session of its own (``setsid``)
has left its rank's group: nothing here reaches it.

Standard library only; run as ``python -I -S group_keeper.py``, so it starts in
about 20 ms and imports nothing of the kit or of torch.
"""

import os
import signal
import sys


def main() -> None:
    groups = set()
    for line in sys.stdin.buffer:  # returns at EOF: the launcher is gone
        text = line.strip().decode("ascii", "replace")
        if len(text) > 1 and text[1:].isdigit():
            (groups.add if text[0] == "+" else groups.discard)(int(text[1:]))
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # already empty
            pass


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the terminal's Ctrl-C is for the launcher
    main()
