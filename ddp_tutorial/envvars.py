"""Every environment variable the kit passes between its processes, named once (and its one signal).

The kernel sets these for the ranks it starts (``launcher/start.py``), the ranks read
them (``rank/bootstrap.py``, ``runfolder.py``, the exercise workers), and a learner may
set the first few to change a default. Standard library only, so both sides import it
(``rank/bootstrap.py`` loads it by its path).
"""

import os
import signal

# -- Set by a learner (or a test) to change a default --------------------------
#: "0" turns warm launches off: every rank starts as a new process.
WARM = "DDP_TUTORIAL_WARM"
#: The folder new run folders are made in (default ``runs``).
RUNS_ROOT = "DDP_TUTORIAL_RUNS"
#: The folder ``exercises.start``/``check`` use (default ``my_work`` beside the notebook).
MY_WORK = "DDP_TUTORIAL_MY_WORK"

# -- Set by ``launch`` for each rank ---------------------------------------------
#: The run folder a rank writes its results into.
RUN_DIR = "DDP_TUTORIAL_RUN_DIR"
#: "auto", "gloo" or "nccl": train.py's default ``--backend``.
BACKEND = "DDP_TUTORIAL_BACKEND"
#: The launching process: a rank dies with it (parent-death signal).
LAUNCHER_PID = "DDP_TUTORIAL_LAUNCHER_PID"
#: How rank 0's bootstrap hosts the rendezvous store: "fd:N" (the socket launch bound),
#: "bind" (bind MASTER_PORT itself), "join" (the other ranks). The bootstrap removes it
#: before the script runs, so nothing the script starts inherits it.
STORE = "DDP_TUTORIAL_STORE"
#: Variables that belong to one run only: a fork server must not keep them between launches.
PER_RUN = (RUN_DIR, STORE)
#: Padding in the fork server's own environment, so a rank's environment fits in its place.
FORK_SERVER_ROOM = "DDP_TUTORIAL_FORK_SERVER_ROOM"
#: "0": the fork server imports torch but not ``torch._dynamo`` (about 2 s of CPU), for launches whose
#: ranks never build a DDP model (the grader's "init" checks). A rank that builds one imports it itself,
#: as a cold rank does. A startup setting: a launch gets a server started with its own value.
FORK_SERVER_DYNAMO = "DDP_TUTORIAL_FORK_SERVER_DYNAMO"

# -- Set by an exercise check for the ranks --------------------------------------
#: The rank (as text) that ``task.loss_fn`` makes raise (the teardown check's second run).
EXERCISE_FAIL_RANK = "DDP_EXERCISE_FAIL_RANK"
#: The folder ``task.checkpoint_path()`` points into (the check's run folder).
EXERCISE_OUT = "DDP_EXERCISE_OUT"

# -- torchrun's contract (set by torchrun, or by launch in its place) ---------------
#: Where a rank is: every one of these describes one particular launch.
TORCHRUN_CONTRACT = ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "ROLE_RANK",
                     "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
#: 0 for the first attempt, then one more per restart the agent counted.
RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
#: How many restarts the agent allows.
MAX_RESTARTS = "TORCHELASTIC_MAX_RESTARTS"
#: "True": env:// joins the store its launcher hosts (torchrun's agent, or launch's rank 0) as a client.
USE_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
#: "1" gives every rendezvous round a store of its own (multi-node restarts need it).
FRESH_RDZV_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


# -- The one signal the kit sends between its processes ------------------------------
def stacks_signal() -> int:
    """The signal with which ``launch`` asks a rank to write its Python stacks and carry on.

    A real-time signal that neither the kit nor torch's Python code uses (torch 2.13's sources have no
    SIGRTMIN). A rank's bootstrap ignores it until it can answer it, so asking never kills a rank.
    """
    return signal.SIGRTMIN + 3


def restart_attempt() -> int:
    """This process's restart attempt: ``RESTART_COUNT`` (0 when not restarted, or not a number).

    Several torchrun agents may disagree: only an agent whose own workers failed
    counts the restart (``rank.restarts.group_attempt`` agrees on one).
    """
    try:
        return max(0, int(os.environ.get(RESTART_COUNT, 0)))
    except ValueError:
        return 0
