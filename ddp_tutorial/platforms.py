"""Where the kit runs (docs/platforms.md), and one line at import where it cannot.

Linux and macOS run everything but the grader (Linux only); native Windows has none of what the
launcher stands on: POSIX process groups and signals (``os.killpg``, ``start_new_session``,
SIGUSR2 for a rank's stacks), and its grader needs Linux namespaces. WSL2 is Linux, and runs it all.
"""

import sys
from typing import Optional

#: What importing the kit says on native Windows, in one line.
WINDOWS_REFUSAL = (
    "ddp_tutorial does not run on native Windows: its launcher needs POSIX process groups and signals "
    "(os.killpg, SIGUSR2), and its grader Linux namespaces. It runs under WSL2, which is Linux: in "
    "PowerShell run `wsl --install`, then inside WSL `pip install -r requirements.txt` (docs/platforms.md).")


def refuse_native_windows(platform: Optional[str] = None) -> None:
    """Stop the import in one line on native Windows (``platform``, else ``sys.platform`` as it is at the
    call, is ``"win32"``).

    Raises:
        ImportError: on native Windows, with ``WINDOWS_REFUSAL``.
    """
    if (sys.platform if platform is None else platform) == "win32":
        raise ImportError(WINDOWS_REFUSAL)
