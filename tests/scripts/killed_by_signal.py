"""Rank 1 is killed by SIGKILL (it leaves no failure note); rank 0 keeps running until stopped."""

import os
import signal
import time

if os.environ["RANK"] == "1":
    os.kill(os.getpid(), signal.SIGKILL)
while True:
    time.sleep(3600)  # stopped by launch once rank 1 is seen dead
