"""Write the DDP steps yourself, and have each one checked on real ranks.

    from ddp_tutorial import exercises
    exercises.start("no_sync")      # writes my_work/no_sync.py: a skeleton with TODOs
    exercises.check("no_sync")      # runs it on 2 ranks and reports, one line per criterion
    exercises.hint("no_sync")       # a nudge
    exercises.solution("no_sync")   # the reference solution's source
    exercises.ask("04-allreduces")  # predict first; exercises.reveal(...) after the measurement

A check runs the script under a harness (``workers/harness.py``) that observes the torch calls
it makes, and judges only what it measured: any correct script passes, whatever its shape; a
wrong, crashing, hanging or missing one gets a report, never an exception. ``EXERCISES`` is the
one table of the exercises. Importing this module does not import torch: only the ranks do.
"""

from __future__ import annotations

import importlib
import os
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

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


def _lesson_judge(module: str, name: str) -> Callable[..., List[judge.Criterion]]:
    """Notebooks 10's and 11's judges, imported when a check needs them (they import ours)."""
    return lambda *harness_runs: getattr(importlib.import_module(module), name)(*harness_runs)


@dataclass(frozen=True)
class Exercise:
    """One exercise: ``judge(*runs)`` of the runs ``run`` gives (in order), the ``harness`` on the
    ranks, ``skeleton`` and ``solution`` (default ``skeletons/<name>.py``, ``solutions/<name>.py``)."""

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
    Exercise("shard", _lesson_judge("ddp_tutorial.lessons.sharding.shard_judge", "judge_shard"),
             skeleton=SHARD / "shard_skeleton.py",
             solution=SHARD / "shard_solution.py", hint=(
        "optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, "
        "lr=shard.LR): it builds an Adam of its own for this rank's share of the parameters and "
        "passes lr= on to it. Before saving: optimizer.consolidate_state_dict(to=0) on every rank "
        "(it is a collective: each rank other than 0 broadcasts its shard, and every rank takes "
        "part in each broadcast), then optimizer.state_dict() on rank 0 only.")),
    Exercise("my_ddp", _lesson_judge("ddp_tutorial.lessons.build_ddp.my_ddp_judge", "judge_my_ddp"),
             harness=MY_DDP / "my_ddp_harness.py",
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
    """What ``check`` found: ``criteria`` are (criterion, passed, detail), ``message`` the printed
    report, ``pids`` every process the check started (all gone once it returns)."""

    name: str
    passed: bool
    message: str
    criteria: List[Tuple[str, bool, str]]
    pids: List[int] = field(default_factory=list)
    seconds: float = 0.0

    def __repr__(self) -> str:
        ok = sum(1 for _, passed, _ in self.criteria if passed)
        return (f"CheckResult({self.name!r}, passed={self.passed}, "
                f"{ok} of {len(self.criteria)} criteria)")


def _known(name: str) -> str:
    if name not in NAMES:
        raise ValueError(f"no exercise {name!r}: the exercises are {', '.join(NAMES)}")
    return name


def my_work() -> str:
    """The folder ``start`` and ``check`` use by default: $DDP_TUTORIAL_MY_WORK, else ``my_work``."""
    return os.environ.get(envvars.MY_WORK) or DEFAULT_FOLDER


def default_script(name: str) -> Path:
    """``<my_work()>/<name>.py`` (a notebook's folder is ``notebooks/``); from the repository root,
    ``notebooks/my_work/<name>.py`` where only that exists."""
    script = Path(my_work()) / f"{name}.py"
    beside_notebooks = Path("notebooks") / DEFAULT_FOLDER / f"{name}.py"
    if not script.is_file() and not os.environ.get(envvars.MY_WORK) and beside_notebooks.is_file():
        return beside_notebooks
    return script


def start(name: str, folder=None) -> Path:
    """Write exercise ``name``'s skeleton to ``<folder>/<name>.py`` (default folder ``my_work()``)
    and return that path; an existing file is never overwritten: it is your work."""
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


def check(name: str, path=None, timeout: float = DEFAULT_TIMEOUT_S,
          echo: str = "none") -> CheckResult:
    """Run the script (default ``default_script(name)``) on real ranks under the harness, judge
    what was measured, print the report and return it as a ``CheckResult``.

    ``timeout``: seconds one run may take before it counts as a hang; ``echo``: the ranks' own
    output under launch ("none", "rank0" or "all"). ValueError for an unknown ``name``.
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
    ran = [run.world_size for run in harness_runs if run.mode == "launch"]
    result = _result(exercise, script, criteria, pids, time.monotonic() - t0, ran)
    print(result.message)
    return result


def _run_folder(name: str) -> Path:
    """A new folder for this check's runs, under the runs folder ``launch`` uses."""
    root = Path(os.environ.get(envvars.RUNS_ROOT, "runs"))
    root.mkdir(parents=True, exist_ok=True)
    prefix = f"{time.strftime('%Y%m%d-%H%M%S')}-exercise-{name}-"
    return Path(tempfile.mkdtemp(prefix=prefix, dir=root))


def _result(exercise: Exercise, script: Path, criteria: List[judge.Criterion], pids: List[int],
            seconds: float, ran: Sequence[int] = ()) -> CheckResult:
    name, later = exercise.name, [w for w in exercise.world_sizes if ran and w not in ran]
    ranks = " and ".join(map(str, [w for w in exercise.world_sizes if w not in later]))
    wait = f"; {' and '.join(map(str, later))} once these pass" if later else ""
    lines = [f"exercise {name!r}: {script}, on {ranks} ranks{wait} ({seconds:.1f} s)"]
    unknown = 0
    for criterion in criteria:
        if criterion.passed or criterion.detail.startswith(judge.NOT_MEASURED):
            unknown += not criterion.passed  # no evidence either way: a "·", no ✗ and no reason
            lines.append(f"  {'✓' if criterion.passed else '·'} {criterion.name}: {criterion.detail}")
            continue
        lines.append(f"  ✗ {criterion.name}")
        for line in criterion.detail.splitlines():  # quoted output (a traceback) stays as it was
            lines.append("      " + line if line[:1].isspace() else textwrap.fill(
                line, 110, initial_indent="      ", subsequent_indent="      ",
                break_long_words=False, break_on_hyphens=False))
    ok = sum(c.passed for c in criteria)
    passed = ok == len(criteria)
    lines.append(f"passed: all {len(criteria)} criteria." if passed else
                 f"not yet: {ok} of {len(criteria)} criteria pass"
                 + (f", {unknown} not measured" if unknown else "")
                 + f". A hint: exercises.hint({name!r})")
    return CheckResult(name, passed, "\n".join(lines), [tuple(c) for c in criteria], pids, seconds)


__all__ = ["EXERCISES", "Exercise", "NAMES", "SOLUTIONS_DIR", "SKELETONS_DIR", "CheckResult",
           "start", "check", "hint", "solution", "ask", "reveal"]
