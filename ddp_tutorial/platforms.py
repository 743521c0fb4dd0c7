"""Where the kit runs (docs/platforms.md), and one line at import where it cannot: native Windows,
which lacks POSIX process groups and signals (``WINDOWS_REFUSAL``); WSL2 is Linux, and runs it all.
"""

import sys
from typing import Optional

#: What importing the kit says on native Windows, in one line.
WINDOWS_REFUSAL = (
    "ddp_tutorial does not run on native Windows: its launcher needs POSIX process groups and "
    "signals (os.killpg, SIGUSR2), and its grader Linux namespaces. It runs under WSL2, which is "
    "Linux: in PowerShell run `wsl --install`, then inside WSL `pip install -r requirements.txt` "
    "(docs/platforms.md).")


def refuse_native_windows(platform: Optional[str] = None) -> None:
    """ImportError (``WINDOWS_REFUSAL``) if ``platform`` (else ``sys.platform`` now) is win32."""
    if (sys.platform if platform is None else platform) == "win32":
        raise ImportError(WINDOWS_REFUSAL)
