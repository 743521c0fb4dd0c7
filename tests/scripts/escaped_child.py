"""Start a child in a session of its own that keeps this rank's output open, print its pid, exit 0.

The child is out of the rank's process group, so no kill of the group reaches it:
the launcher must stop waiting for the end of the output on its own.
"""

import subprocess
import sys

child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
print(f"child {child.pid}", flush=True)
