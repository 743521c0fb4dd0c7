"""Every rank ignores SIGTERM and sleeps: only SIGKILL, after the launcher's grace, stops it."""

import signal
import time

signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ignoring SIGTERM", flush=True)
while True:
    time.sleep(3600)
