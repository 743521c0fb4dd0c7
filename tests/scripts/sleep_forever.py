"""Every rank prints, then sleeps until killed (for interrupt and orphan tests)."""

import os
import subprocess
import sys
import time

print(f"ready {os.environ['RANK']}", flush=True)
# A grandchild too: stopping a rank must stop what it started.
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
print(f"child {child.pid}", flush=True)
while True:
    time.sleep(3600)
