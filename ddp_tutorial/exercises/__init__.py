"""Write the DDP steps yourself, and have each one checked on real ranks.

    from ddp_tutorial import exercises
    exercises.start("no_sync")      # writes my_work/no_sync.py: a skeleton with TODOs
    exercises.check("no_sync")      # runs it on 2 ranks and reports, one line per criterion
    exercises.hint("no_sync")       # a nudge
    exercises.solution("no_sync")   # the reference solution's source
    exercises.ask("04-allreduces")  # predict first; exercises.reveal(...) after the measurement

A check runs your script under a harness (``workers/harness.py``) that
observes the torch calls it makes (init_process_group, all_reduce, DDP and
its gradient all-reduces, DistributedSampler, no_sync, optimizer steps,
torch.save, destroy_process_group) and judges only what it measured: any
correct script passes, whatever its shape. It never raises for a wrong,
crashing, hanging or missing script; it reports. The scripts share one fixed
task (``workers/task.py``: model, data, loss, settings), so a check can compute what
one process would have computed, and the results of typical mistakes.

Each exercise is one row of ``EXERCISES``: its hint, how its check runs the script,
the harness on the ranks and the judge; its skeleton and solution are
``skeletons/<name>.py`` and ``solutions/<name>.py``, or, for an exercise that belongs to one
lesson, in that lesson's folder with the rest of it (notebook 10's ``shard`` in ``lessons/sharding/``,
notebook 11's ``my_ddp`` in ``lessons/build_ddp/``: skeleton, solution, harness and judge). Importing this module does not
import torch: only the ranks do. The scripts the ranks run (the harness, the task,
the references) are in ``workers/``.
"""

from __future__ import annotations

import os
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from ddp_tutorial import envvars
from ddp_tutorial.exercises import judge, runs
from ddp_tutorial.lessons.predict import Printed, ask, reveal

PACKAGE_DIR = Path(__file__).resolve().parent
SKELETONS_DIR = PACKAGE_DIR / "skeletons"
#: The reference solutions: ``check("no_sync", SOLUTIONS_DIR / "no_sync.py")`` passes.
SOLUTIONS_DIR = PACKAGE_DIR / "solutions"
#: Notebooks 10's and 11's rank scripts, their exercises' among them.
SHARD = PACKAGE_DIR.parent / "lessons" / "sharding" / "workers"
MY_DDP = PACKAGE_DIR.parent / "lessons" / "build_ddp" / "workers"
DEFAULT_FOLDER = "my_work"
#: Seconds one run of a learner's script may take before the check calls it a hang.
DEFAULT_TIMEOUT_S = 90.0
#: Ranks every check starts (torchrun's too, in the capstone).
WORLD_SIZE = 2


# Notebooks 10's and 11's judges are kept with the rest of their lessons and imported when a check
# needs them: they import this package's judge helpers, so this package cannot import them first.
def judge_shard(run: runs.HarnessRun) -> List[judge.Criterion]:
    from ddp_tutorial.lessons.sharding.shard_judge import judge_shard as judge_it
    return judge_it(run)


def judge_my_ddp(*harness_runs: runs.HarnessRun) -> List[judge.Criterion]:
    from ddp_tutorial.lessons.build_ddp.my_ddp_judge import judge_my_ddp as judge_it
    return judge_it(*harness_runs)


@dataclass(frozen=True)
class Exercise:
    """One exercise: its ``skeleton`` and ``solution`` (by default ``skeletons/<name>.py`` and
    ``solutions/<name>.py``), how its check runs the
    script (``run``: ``runs.per_world_size``, ``runs.normal_then_failing`` or ``runs.three_ways``,
    each giving the runs in order), the ``harness`` on the ranks, and ``judge(*runs)``: the
    criteria."""

    name: str
    judge: Callable[..., List[judge.Criterion]]
    hint: str
    run: Callable[..., List[runs.HarnessRun]] = runs.per_world_size
    harness: Path = runs.HARNESS
    world_sizes: Tuple[int, ...] = (WORLD_SIZE,)
    skeleton: Optional[Path] = None
    solution: Optional[Path] = None

    def __post_init__(self):
        for kind, folder in (("skeleton", SKELETONS_DIR), ("solution", SOLUTIONS_DIR)):
            if getattr(self, kind) is None:
                object.__setattr__(self, kind, folder / f"{self.name}.py")


#: Every exercise, in the notebooks' order: what ``start``, ``check``, ``hint``, ``solution``
#: and the grader read.
EXERCISES: Dict[str, Exercise] = {e.name: e for e in (
    Exercise("init", judge.judge_init, hint=(
        "dist.init_process_group(\"gloo\") with no other arguments: its default init_method, "
        "env://, reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, which the launcher set for "
        "each process. Then rank = dist.get_rank(); dist.all_reduce(value) sums in place on every "
        "rank (SUM is the default op); and dist.destroy_process_group() at the end.")),
    Exercise("wrap", judge.judge_wrap, hint=(
        "model = DDP(model) right after building it: DDP broadcasts rank 0's parameters when it is "
        "built, and every backward through the wrapper averages the gradients. Train the wrapped "
        "model: call model(x) on the DDP object, not model.module(x). On CPU, give DDP no "
        "device_ids.")),
    Exercise("sampler", judge.judge_sampler, hint=(
        "sampler = DistributedSampler(dataset) reads the world size and rank from the process "
        "group; pass it as DataLoader(dataset, batch_size=..., sampler=sampler), without "
        "shuffle=True. Its shuffle comes from seed + epoch, so call sampler.set_epoch(epoch) at "
        "the top of every epoch.")),
    Exercise("no_sync", judge.judge_no_sync, hint=(
        "For a micro-batch that does not end its window: `with model.no_sync():` around BOTH "
        "lines, loss = task.loss_fn(model(x), y) / window and loss.backward(). DDP decides in "
        "forward whether the next backward all-reduces, so a forward outside no_sync() syncs "
        "anyway. The last micro-batch of a window runs the same two lines outside no_sync(): its "
        "backward all-reduces the window's sum once. contextlib.nullcontext() lets one `with` "
        "serve both cases. Divide by `window`, not K: the epoch's last window (its tail) is "
        "shorter, and its losses are divided by its own size.")),
    Exercise("teardown", judge.judge_teardown, run=runs.normal_then_failing, hint=(
        "Right after init_process_group: try: (all the training) finally: "
        "dist.destroy_process_group(). The rule: "
        f"{judge.TEARDOWN_RULE[:1].lower()}{judge.TEARDOWN_RULE[1:]}. destroy removes the group "
        "from torch's registries and calls the backend's shutdown where it has one; gloo has none, "
        "so its sockets and threads close when the last reference to the group goes, or at exit. "
        "Drop the DDP model (model = None) before destroy: it holds the group.")),
    Exercise("capstone", judge.judge_capstone, run=runs.three_ways, hint=(
        "Decide once: distributed = \"RANK\" in os.environ. Only then init_process_group, wrap in "
        "DDP, and try/finally around the rest with destroy_process_group. "
        "DistributedSampler(dataset, num_replicas=world_size, rank=rank) needs no process group "
        "with 1 and 0, so one code path serves both. Then set_epoch every epoch, no_sync() "
        "(forward included) on the micro-batches that do not end a window (keep the script's "
        "schedule: the epoch's tail is a shorter window), and torch.save(model.state_dict()) of "
        "the model inside DDP, only where rank == 0; drop the DDP model (= None) before "
        "destroy_process_group().")),
    Exercise("shard", judge_shard, skeleton=SHARD / "shard_skeleton.py",
             solution=SHARD / "shard_solution.py", hint=(
        "optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, "
        "lr=shard.LR): it builds an Adam of its own for this rank's share of the parameters and "
        "passes lr= on to it. Before saving: optimizer.consolidate_state_dict(to=0) on every rank "
        "(it is a collective: each rank other than 0 broadcasts its shard, and every rank takes "
        "part in each broadcast), then optimizer.state_dict() on rank 0 only.")),
    Exercise("my_ddp", judge_my_ddp, harness=MY_DDP / "my_ddp_harness.py",
             skeleton=MY_DDP / "my_ddp_skeleton.py", solution=MY_DDP / "my_ddp_solution.py",
             world_sizes=(2, 4), hint=(
        "In __init__: dist.broadcast(t, src=0) for every parameter and buffer (under "
        "torch.no_grad()). Then the buckets: walk reversed([p for p in module.parameters() if "
        "p.requires_grad]) (a list: the same order on every rank; frozen parameters get no hook) "
        "and start a new bucket when the next one would pass the cap. "
        "p.register_post_accumulate_grad_hook(fn) calls fn(p) once p.grad is complete: count the "
        "bucket's arrivals, and at its last one torch.cat its gradients, divide by the world size, "
        "and keep the handle of dist.all_reduce(flat, async_op=True). Touch flat no more until "
        "finish_gradient_synchronization() has waited for the handle; then copy its pieces back "
        "into each p.grad, and reset the counts for the next step. A bucket whose gradients did "
        "not all arrive (a parameter no forward used): raise an error there. no_sync(): a flag the "
        "hook reads.")),
)}
NAMES = tuple(EXERCISES)



@dataclass
class CheckResult:
    """What ``check`` found.

    Attributes:
        name: the exercise.
        passed: every criterion passed.
        message: the report ``check`` printed.
        criteria: (criterion, passed, detail) for each thing a correct script does.
        pids: every process the check started (all gone once ``check`` returns).
        seconds: how long the check took.
    """

    name: str
    passed: bool
    message: str
    criteria: List[Tuple[str, bool, str]]
    pids: List[int] = field(default_factory=list)
    seconds: float = 0.0

    def __repr__(self) -> str:
        ok = sum(1 for _, passed, _ in self.criteria if passed)
        return f"CheckResult({self.name!r}, passed={self.passed}, {ok} of {len(self.criteria)} criteria)"


def _known(name: str) -> str:
    if name not in NAMES:
        raise ValueError(f"no exercise {name!r}: the exercises are {', '.join(NAMES)}")
    return name


def my_work() -> str:
    """The folder ``start`` and ``check`` use by default: ``my_work`` (beside the notebook), or $DDP_TUTORIAL_MY_WORK."""
    return os.environ.get(envvars.MY_WORK) or DEFAULT_FOLDER


def default_script(name: str) -> Path:
    """The file ``check(name)`` reads without a path: ``<my_work()>/<name>.py``, relative to the current
    folder (a notebook's is ``notebooks/``); from the repository root, ``notebooks/my_work/`` as well."""
    script = Path(my_work()) / f"{name}.py"
    beside_notebooks = Path("notebooks") / DEFAULT_FOLDER / f"{name}.py"
    if not script.is_file() and not os.environ.get(envvars.MY_WORK) and beside_notebooks.is_file():
        return beside_notebooks
    return script


def start(name: str, folder=None) -> Path:
    """Write exercise ``name``'s skeleton to ``<folder>/<name>.py`` unless that file exists already.

    Args:
        name: one of ``NAMES``.
        folder: where your scripts live, relative to the current folder (a notebook's is ``notebooks/``);
            default ``my_work()``.

    Returns:
        The script's path. An existing file is never overwritten: it is your work.
    """
    path = Path(my_work() if folder is None else folder) / f"{_known(name)}.py"
    if PACKAGE_DIR.parent in path.resolve().parents:
        raise ValueError(f"{path} is inside the ddp_tutorial package: give a folder of your own")
    then = f"exercises.check({name!r}{'' if folder is None else f', {str(path)!r}'})"
    if path.exists():
        print(f"{path} exists already; keeping your work. Edit it, then run {then}.")
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(EXERCISES[name].skeleton.read_text())
    print(f"wrote {path}: fill in its TODOs, then run {then}. Stuck? exercises.hint({name!r}).")
    return path


def hint(name: str) -> Printed:
    """Print a hint for exercise ``name``; returns it (a notebook shows it once, printed)."""
    text = EXERCISES[_known(name)].hint
    print(textwrap.fill(text, 100))
    return Printed(text)


def solution(name: str) -> Printed:
    """Print the source of exercise ``name``'s reference solution; returns it (shown once, printed)."""
    source = EXERCISES[_known(name)].solution.read_text()
    print(source)
    return Printed(source)


def check(name: str, path=None, timeout: float = DEFAULT_TIMEOUT_S, echo: str = "none") -> CheckResult:
    """Run the script on real ranks under the harness, judge what was measured, print the report.

    Args:
        name: one of ``NAMES``.
        path: the script; default ``<my_work()>/<name>.py`` (where ``start(name)`` writes it).
        timeout: seconds one run may take before it counts as a hang; the teardown
            check runs the script twice, the capstone three ways at once.
        echo: the ranks' own output under launch, as ``launch`` shows it: "none", "rank0" or "all".

    Returns:
        A ``CheckResult``. A wrong, crashing, hanging or missing script gives
        failed criteria, never an exception.

    Raises:
        ValueError: ``name`` is not an exercise.
    """
    exercise = EXERCISES[_known(name)]
    t0 = time.monotonic()
    script = Path(path) if path is not None else default_script(name)
    harness_runs: List[runs.HarnessRun] = []
    if not script.is_file():
        criteria = [judge.Criterion("the script exists", False,
                                    f"no file at {script} (looked in {script.parent.resolve()}): "
                                    f"run exercises.start({name!r}) first")]
    else:
        harness_runs = exercise.run(exercise, script.resolve(), _run_folder(name), timeout, echo)
        criteria = exercise.judge(*harness_runs)
    # dict.fromkeys: a plain run reports its pid twice
    pids = list(dict.fromkeys(pid for run in harness_runs for pid in run.pids))
    result = _result(exercise, script, criteria, pids, time.monotonic() - t0)
    print(result.message)
    return result


def _run_folder(name: str) -> Path:
    """A new folder for this check's runs, under the runs folder ``launch`` uses."""
    root = Path(os.environ.get(envvars.RUNS_ROOT, "runs"))
    root.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"{time.strftime('%Y%m%d-%H%M%S')}-exercise-{name}-", dir=root))


def _result(exercise: Exercise, script: Path, criteria: List[judge.Criterion], pids: List[int],
            seconds: float) -> CheckResult:
    name, ranks = exercise.name, " and ".join(map(str, exercise.world_sizes))
    lines = [f"exercise {name!r}: {script}, on {ranks} ranks ({seconds:.1f} s)"]
    for criterion in criteria:
        if criterion.passed:
            lines.append(f"  ✓ {criterion.name}: {criterion.detail}")
            continue
        if criterion.detail.startswith(judge.NOT_MEASURED):  # no evidence either way: no ✗, no reason
            lines.append(f"  · {criterion.name}: {criterion.detail}")
            continue
        lines.append(f"  ✗ {criterion.name}")
        for line in criterion.detail.splitlines():
            if line[:1].isspace():  # quoted output (a traceback): as it was
                lines.append("      " + line)
            else:
                lines.append(textwrap.fill(line, 110, initial_indent="      ", subsequent_indent="      ",
                                           break_long_words=False, break_on_hyphens=False))
    ok = sum(1 for c in criteria if c.passed)
    unknown = sum(1 for c in criteria if not c.passed and c.detail.startswith(judge.NOT_MEASURED))
    passed = ok == len(criteria)
    lines.append(f"passed: all {len(criteria)} criteria." if passed else
                 f"not yet: {ok} of {len(criteria)} criteria pass"
                 + (f", {unknown} not measured" if unknown else "") + f". A hint: exercises.hint({name!r})")
    return CheckResult(name, passed, "\n".join(lines), [tuple(c) for c in criteria], pids, seconds)


__all__ = ["EXERCISES", "Exercise", "NAMES", "SOLUTIONS_DIR", "SKELETONS_DIR", "CheckResult",
           "start", "check", "hint", "solution", "ask", "reveal"]
