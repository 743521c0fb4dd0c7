"""A real SLURM cluster here (``python -m ddp_tutorial.maintainer.slurm start|demo|stop``): munged,
slurmctld and two slurmd on 127.0.0.1 (Debian's ``slurm-wlm``, ``munge``), as root, all in one
folder, no cgroups needed; node names do not resolve (docs/clusters.md)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import psutil

from ddp_tutorial.launcher import free_port
from ddp_tutorial.launcher.net import candidate_ports
from ddp_tutorial.lessons import port_can_be_bound
from ddp_tutorial.lessons.beyond_one_machine.slurm import SBATCH_SCRIPT

#: Where ``start`` puts a learner's cluster unless told otherwise.
DEFAULT_FOLDER = Path(tempfile.gettempdir()) / f"ddp-tutorial-slurm-{os.getuid()}"
NODES = ("node1", "node2")
PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "sinfo")
SBIN = ("/usr/sbin", "/sbin")

#: Settings where 22.05's defaults do (root, munge, backfill, no accounting) are left out.
SLURM_CONF = """\
ClusterName=ddptutorial
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
AuthInfo=socket={folder}/munge.socket
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool-%n
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd-%n.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
KillWait=5
MinJobAge=4
SlurmdTimeout=60
NodeName=node[1-2] NodeHostname=localhost NodeAddr=127.0.0.1 Port={node_ports} CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


class ClusterError(RuntimeError):
    """The local cluster could not start, or a command against it failed."""


def which(program: str) -> Optional[str]:
    """Where ``program`` is, on PATH or in /usr/sbin (root's daemons are there)."""
    return shutil.which(program) or shutil.which(program, path=os.pathsep.join(SBIN))


def missing() -> Optional[str]:
    """Why a local SLURM cluster cannot run here, or None when it can."""
    absent = [p for p in PROGRAMS if which(p) is None]
    if absent:
        return (f"SLURM is not installed here ({', '.join(absent)} not found); "
                "as root: apt-get install slurm-wlm munge")
    if os.geteuid() != 0:
        return ("the local SLURM cluster runs its daemons as root (SlurmUser=root), "
                "and this is not root")
    return None


class LocalCluster:
    """A controller and two nodes on 127.0.0.1, all of its files in ``folder``."""

    def __init__(self, folder=None):
        self.folder = Path(folder or DEFAULT_FOLDER).resolve()
        self.conf = self.folder / "slurm.conf"
        self.pid_file = self.folder / "daemons.json"
        self._procs: List[subprocess.Popen] = []  # started here: reaped by stop()

    @property
    def env(self) -> Dict[str, str]:
        """This environment plus SLURM_CONF: how sbatch, squeue and scancel find the cluster."""
        return dict(os.environ, SLURM_CONF=str(self.conf))

    def job_env(self, **extra: str) -> Dict[str, str]:
        """``env`` with this Python's torchrun and checkout, one thread per rank, a free ``RDZV_PORT``
        and ``extra``: what to submit a job from."""
        env = self.env
        checkout = str(Path(__file__).resolve().parents[3])
        env.update(PATH=os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")]),
                   PYTHONPATH=os.pathsep.join(filter(None, [checkout, env.get("PYTHONPATH")])),
                   OMP_NUM_THREADS="1", RDZV_PORT=str(free_port()), **extra)
        return env

    def pids(self) -> Dict[str, int]:
        """The daemons ``start`` wrote down that still run, by name: not a reused pid, as each
        one's start time is written down too."""
        try:
            written = json.loads(self.pid_file.read_text())
        except (FileNotFoundError, ValueError):
            return {}
        running = {}
        for name, (pid, started) in written.items():
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(pid)
                if proc.create_time() == started and proc.status() != psutil.STATUS_ZOMBIE:
                    running[name] = pid
        return running

    def is_up(self) -> bool:
        """Every daemon it started is alive."""
        return len(self.pids()) == 2 + len(NODES)

    def start(self, timeout: float = 60.0) -> "LocalCluster":
        """Start the daemons (an earlier cluster in the folder stopped and cleared first) and wait
        until both nodes are idle; ClusterError, with the logs' ends, if not within ``timeout``."""
        if why := missing():
            raise ClusterError(why)
        self.stop()
        shutil.rmtree(self.folder, ignore_errors=True)
        (self.folder / "state").mkdir(parents=True)
        f = self.folder
        key = f / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        ctld = free_port()
        node1 = node_port_pair(ctld)
        self.conf.write_text(SLURM_CONF.format(folder=f, ctld_port=ctld, cpus=os.cpu_count() or 1,
                                               node_ports=f"{node1}-{node1 + 1}"))
        commands = {
            "munged": [which("munged"), "--foreground", "--force", f"--socket={f}/munge.socket",
                       f"--key-file={key}", f"--pid-file={f}/munged.pid",
                       f"--log-file={f}/munged.log", f"--seed-file={f}/munged.seed"],
            "slurmctld": [which("slurmctld"), "-D", "-c", "-f", str(self.conf)],
            **{f"slurmd-{n}": [which("slurmd"), "-D", "-f", self.conf, "-N", n] for n in NODES},
        }
        pids = {}
        try:
            for name, cmd in commands.items():
                with open(f / f"{name}.out", "wb") as out:
                    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True,
                                            env=self.env)
                self._procs.append(proc)
                pids[name] = [proc.pid, psutil.Process(proc.pid).create_time()]
                self.pid_file.write_text(json.dumps(pids))
                if name == "munged":
                    wait_for(lambda: (f / "munge.socket").exists(), timeout, "munged's socket")
            wait_for(lambda: self.idle_nodes() == list(NODES), timeout, "both nodes idle")
        except ClusterError as exc:
            logs = self.log_tails()
            self.stop()
            raise ClusterError(f"{exc}\n{logs}") from None
        return self

    def stop(self, timeout: float = 15.0) -> List[str]:
        """Stop every daemon ``start`` started, by its pid: SIGTERM, then SIGKILL; their names."""
        pids = self.pids()
        procs = []
        for pid in pids.values():
            with contextlib.suppress(psutil.Error):
                procs.append(psutil.Process(pid))
                procs[-1].terminate()
        for proc in psutil.wait_procs(procs, timeout=timeout)[1]:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        for proc in self._procs:  # a learner's stop runs in another process: init reaps those
            proc.wait()
        self._procs = []
        self.pid_file.unlink(missing_ok=True)  # nothing of it runs now
        return list(pids)

    def run(self, *cmd: str, timeout: float = 30.0, check: bool = True, env=None, cwd=None):
        """A SLURM command (``sinfo``, ``squeue``, ...) against this cluster."""
        result = subprocess.run([which(cmd[0]) or cmd[0], *cmd[1:]], env=env or self.env, cwd=cwd,
                                capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise ClusterError(f"{cmd[0]} exited {result.returncode}: {result.stderr.strip()}")
        return result

    def idle_nodes(self) -> List[str]:
        """The nodes the controller reports idle."""
        result = self.run("sinfo", "--noheader", "--Node", "--format=%N %t", check=False,
                          timeout=10)
        return sorted(n for n, state in (line.split() for line in result.stdout.splitlines())
                      if state == "idle")

    def squeue(self) -> str:
        """``squeue``'s table of this cluster's jobs."""
        return self.run("squeue", "--format=%.8i %.12j %.8T %.6D %R").stdout

    def submit(self, args: Sequence[str], cwd, env: Optional[Dict[str, str]] = None,
               options: Sequence[str] = ()) -> str:
        """Submit the kit's sbatch script with train.py flags ``args`` from ``cwd`` (sbatch
        ``options`` before the script, ``env`` passed on); the job id."""
        done = self.run("sbatch", "--parsable", *options, SBATCH_SCRIPT, *map(str, args),
                        env=env, cwd=cwd)
        return done.stdout.strip().split(";")[0]

    def wait_gone(self, job: str, timeout: float) -> None:
        """Wait until ``job`` has left the queue (ended, its processes reaped by slurmd)."""
        wait_for(lambda: not self.run("squeue", "-h", "-j", job, check=False).stdout.strip(),
                 timeout, f"job {job} gone from the queue")

    def log_tails(self, lines: int = 8) -> str:
        """The last lines of each daemon's log (what to read when it does not start)."""
        parts = []
        for log in sorted(self.folder.glob("*.log")) + sorted(self.folder.glob("*.out")):
            text = log.read_text(errors="replace").splitlines()[-lines:]
            if text:
                parts.append(f"--- {log.name} ---\n" + "\n".join(text))
        return "\n".join(parts)


def node_port_pair(ctld: int) -> int:
    """The first of two consecutive free ports, not ``ctld``: the slurmd's ``SlurmdPort`` range.
    A free port's neighbour may be another's listener: other pairs are tried, not given up."""
    for node1 in candidate_ports():
        if ctld not in (node1, node1 + 1) and all(map(port_can_be_bound, (node1, node1 + 1))):
            return node1
    raise ClusterError("found no two consecutive free ports for the nodes on 127.0.0.1")


def wait_for(ready, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise ClusterError(f"the local cluster did not reach '{what}' within {timeout:.0f} s")
        time.sleep(0.2)  # polling the daemons' state; they signal nothing


def demo_job(cluster=None, folder=None, timeout: float = 120.0) -> str:
    """If the cluster is up, a small 2-node x 2-rank job of train.py (run in ``folder``, by default
    new under ``runs/``): its queue entry and output; else why not, and how to start it."""
    if why := missing():
        return f"No local SLURM cluster here: {why}."
    cluster = cluster or LocalCluster()
    if not cluster.is_up():
        return ("The local SLURM cluster is not running. Start it (as root) with\n"
                "    python -m ddp_tutorial.maintainer.slurm start\n"
                "and run `demo` again; stop it afterwards with `stop`.")
    Path("runs").mkdir(exist_ok=True)
    folder = Path(folder or tempfile.mkdtemp(prefix="08-slurm-", dir="runs")).resolve()
    env = cluster.job_env()
    job = cluster.submit(["--dataset-size", "128", "--batch-size", "8", "--accum-steps", "2", "--epochs", "2",
                          "--out", "run"], cwd=folder, env=env, options=["--output", "job.out"])
    wait_for(lambda: "PENDING" not in cluster.squeue(), timeout, f"job {job} started")
    queue = cluster.squeue()  # while it runs: one job on node[1-2]
    cluster.wait_gone(job, timeout)
    output = (folder / "job.out").read_text() if (folder / "job.out").exists() else "(no output)"
    return f"$ squeue  (while the job runs)\n{queue}\n$ cat job.out  (job {job}, ended)\n{output}"
