"""Every environment variable the kit passes between its processes, named once (and its one signal).
The kernel sets them for the ranks, the ranks read them; a learner may set the first three.
"""

import os
import signal

# -- Set by a learner (or a test) to change a default ----------------------------
#: "0" starts every rank as a new process (cold); "1" forks ranks from a server that has imported
#: torch (warm). Unset: warm on Linux, cold elsewhere (docs/platforms.md says why).
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
#: The read end of a pipe only the launching process can write to: end-of-file means the
#: launcher is gone, however it ended, and the rank then kills its group.
LAUNCHER_FD = "DDP_TUTORIAL_LAUNCHER_FD"
#: How rank 0's bootstrap hosts the rendezvous store: "fd:N" (the socket launch bound), "bind"
#: (bind MASTER_PORT itself), "join" (the other ranks). Removed before the script runs.
STORE = "DDP_TUTORIAL_STORE"
#: Rank 0's alone: a socket that reads end-of-file once every other rank has exited; rank 0 keeps
#: the store until then, as torchrun's agent keeps its store (``rank/store.py``).
PEERS_FD = "DDP_TUTORIAL_PEERS_FD"

# -- Set by an exercise check for the ranks --------------------------------------
#: The rank (as text) that ``task.loss_fn`` makes raise (the teardown check's second run).
EXERCISE_FAIL_RANK = "DDP_EXERCISE_FAIL_RANK"
#: The folder ``task.checkpoint_path()`` points into (the check's run folder).
EXERCISE_OUT = "DDP_EXERCISE_OUT"

# -- torchrun's contract (set by torchrun, or by launch in its place) ------------
#: Where a rank is: every one of these describes one particular launch.
TORCHRUN_CONTRACT = ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                     "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
#: 0 for the first attempt, then one more per restart the agent counted.
RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
#: How many restarts the agent allows.
MAX_RESTARTS = "TORCHELASTIC_MAX_RESTARTS"
#: "True": env:// joins the store its launcher hosts (torchrun's agent, or launch's rank 0).
USE_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
#: "1" gives every rendezvous round a store of its own (multi-node restarts need it).
FRESH_RDZV_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def stacks_signal() -> int:
    """The signal with which ``launch`` asks a rank to write its Python stacks and carry on:
    SIGUSR2, on every POSIX system. torch forwards it only when torchrun is told to
    (``--signals-to-handle``, torch/distributed/run.py), SLURM when a job asks (``--signal``)."""
    return signal.SIGUSR2


def restart_attempt() -> int:
    """This process's ``RESTART_COUNT`` (0 when not restarted, or not a number); agents may
    disagree (``rank.restarts.group_attempt`` agrees on one)."""
    try:
        return max(0, int(os.environ.get(RESTART_COUNT, 0)))
    except ValueError:
        return 0
