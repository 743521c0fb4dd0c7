"""The exercises' checks are honest: every solution passes, every skeleton and wrong answer fails, by name.

Each check launches real ranks (2, gloo on CPU). The wrong answers live in
``tests/exercise_mistakes/<exercise>_<mistake>.py``; each test asserts the
criterion that must fail and words of the message that name the mistake, and
that the criteria a wrong answer gets right still pass (a judge that fails
everything would not pass these tests).
"""

import os
import time
from pathlib import Path

import pytest

from ddp_tutorial import envvars, exercises
from ddp_tutorial.exercises import judge, runs
from ddp_tutorial.launcher import warm_ready
from conftest import pid_alive, processes_of_run

MISTAKES = Path(__file__).resolve().parent / "exercise_mistakes"
#: Right answers shaped otherwise than the solutions: each must pass.
RIGHT_ANSWERS = Path(__file__).resolve().parent / "exercise_right_answers"
#: The learner's-folder override the test configuration set (read before a fixture removes it).
PLUGIN_FOLDER = os.environ.get(envvars.MY_WORK)
#: Seconds one run of a script may take: generous, ranks import torch in 2-6 s on a loaded machine.
TIMEOUT = 90


@pytest.fixture(autouse=True)
def in_tmp_folder(tmp_path, monkeypatch):
    """Every test works in a fresh folder: ``start`` writes my_work/ there, the checks' runs go there."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DDP_TUTORIAL_RUNS", str(tmp_path / "runs"))
    monkeypatch.delenv(envvars.MY_WORK, raising=False)  # here my_work/ is under tmp_path: a learner's default
    return tmp_path


def failed(result, criterion_start: str) -> str:
    """The detail of the failed criterion whose name starts with ``criterion_start`` (asserts it failed)."""
    matches = [(name, passed, detail) for name, passed, detail in result.criteria
               if name.startswith(criterion_start)]
    assert matches, f"no criterion {criterion_start!r} in:\n{result.message}"
    name, passed, detail = matches[0]
    assert not passed, f"{name!r} passed, but should fail:\n{result.message}"
    return detail


def passed_names(result):
    return {name for name, passed, _ in result.criteria if passed}


def processes_under(folder: Path):
    """Live processes of any run under ``folder``: ranks (and torchrun) of a check."""
    return processes_of_run(folder, prefix=True)


def run_records(tmp_path: Path, name: str, mode: str = "run"):
    """Every rank's harness records of the one check of ``name`` run under ``tmp_path`` (its ``mode`` folder)."""
    import ddp_tutorial

    [folder] = (tmp_path / "runs").glob(f"*-exercise-{name}-*")
    run = ddp_tutorial.Run(folder / mode, exercises.WORLD_SIZE)
    return {rank: run.results(rank) for rank in range(exercises.WORLD_SIZE)}


def assert_nothing_left(result, tmp_path):
    assert result.pids, "the check reported no processes"
    assert [pid for pid in result.pids if pid_alive(pid)] == []
    assert processes_under(tmp_path / "runs") == []


# -- The kernel-side API, without launching anything ---------------------------
def test_names_and_an_unknown_name():
    assert exercises.NAMES == ("init", "wrap", "sampler", "no_sync", "teardown", "capstone", "shard", "my_ddp")
    for call in (exercises.check, exercises.start, exercises.hint, exercises.solution):
        with pytest.raises(ValueError, match="init, wrap, sampler, no_sync, teardown, capstone"):
            call("nosync")


def test_start_writes_the_skeleton_once_and_keeps_the_learners_work(tmp_path, capsys):
    path = exercises.start("no_sync")
    assert path == Path("my_work") / "no_sync.py"
    assert "TODO" in path.read_text()
    assert "exercises.check('no_sync')" in capsys.readouterr().out
    path.write_text("# my work\n")
    assert exercises.start("no_sync") == path
    assert path.read_text() == "# my work\n"
    assert "keeping your work" in capsys.readouterr().out
    with pytest.raises(ValueError, match="inside the ddp_tutorial package"):
        exercises.start("init", folder=exercises.SOLUTIONS_DIR)


def test_hint_and_solution_print_what_they_return(capsys):
    assert "no_sync()" in exercises.hint("no_sync")
    assert "forward" in capsys.readouterr().out
    source = exercises.solution("teardown")
    assert "finally:" in source and "destroy_process_group" in source
    assert source == (exercises.SOLUTIONS_DIR / "teardown.py").read_text()
    assert "destroy_process_group" in capsys.readouterr().out


def test_start_and_check_use_the_folder_the_tests_set_and_leave_my_work_alone(tmp_path, monkeypatch, capsys):
    elsewhere = tmp_path / "scratch"
    monkeypatch.setenv(envvars.MY_WORK, str(elsewhere))
    path = exercises.start("init")
    assert path == elsewhere / "init.py" and path.read_text() == (exercises.SKELETONS_DIR / "init.py").read_text()
    assert f"wrote {path}" in capsys.readouterr().out
    result = exercises.check("wrap")  # no path: looks where start writes
    assert f"no file at {elsewhere / 'wrap.py'}" in " ".join(result.message.split())  # a long path wraps
    assert not (tmp_path / "my_work").exists()


def test_the_test_configuration_keeps_notebook_runs_out_of_the_learners_folder():
    """pyproject's plugin set the folder for the whole run; a kernel in notebooks/ (as nbmake's) writes there."""
    from nbclient import NotebookClient
    import nbformat

    import ddp_tutorial

    assert PLUGIN_FOLDER and Path(PLUGIN_FOLDER).is_dir(), "pyproject's -p ddp_tutorial.exercises.pytest_plugin"
    notebooks = Path(ddp_tutorial.__file__).resolve().parent.parent / "notebooks"
    learners = notebooks / "my_work"
    assert Path(PLUGIN_FOLDER).resolve() != learners.resolve()
    before = sorted(learners.rglob("*")) if learners.exists() else None
    start_cell = next(c.source for c in nbformat.read(notebooks / "05_teardown.ipynb", as_version=4).cells
                      if c.cell_type == "code" and "exercises.start(" in c.source)  # the notebook's own exercise cell
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in (
        "from ddp_tutorial import exercises", start_cell, "print(path.resolve())")])
    env = {**os.environ, envvars.MY_WORK: PLUGIN_FOLDER}  # the environment pytest started with
    NotebookClient(nb, timeout=60, kernel_name="python3", resources={"metadata": {"path": str(notebooks)}}).execute(env=env)
    written = Path(nb.cells[2].outputs[0].text.strip())
    try:
        assert written.parent == Path(PLUGIN_FOLDER).resolve() and written.is_file()
        assert (sorted(learners.rglob("*")) if learners.exists() else None) == before
    finally:
        written.unlink()


@pytest.mark.skipif(os.name != "posix", reason="jupyter_client's ipc transport needs Unix sockets")
@pytest.mark.parametrize("runner", ["nbmake", "nbconvert"])  # the notebooks; teacher/render.py
def test_notebook_kernels_start_when_every_tcp_port_is_taken(runner, tmp_path, monkeypatch):
    """pyproject's plugin puts the tests' kernels on Unix sockets: a kernel whose TCP port another
    process took dies at start (in CI: "Kernel didn't respond in 60 seconds")."""
    import socket

    import nbformat
    from jupyter_client.connect import LocalPortCache

    taken = socket.create_server(("127.0.0.1", 0))  # as a rank's connection holds a port
    monkeypatch.setattr(LocalPortCache, "find_available_port", lambda self, ip: taken.getsockname()[1])
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print('kernel up')")])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, tmp_path / "up.ipynb")
    with taken:
        if runner == "nbmake":
            from nbmake.nb_run import NotebookRun

            result = NotebookRun(tmp_path / "up.ipynb", 60).execute()
            assert result.error is None, result.error.summary
            nb = result.nb
        else:
            from nbconvert.preprocessors import ExecutePreprocessor

            ExecutePreprocessor(timeout=60).preprocess(nb, {"metadata": {"path": str(tmp_path)}})
    assert nb.cells[0].outputs[0].text == "kernel up\n"


def test_a_missing_script_says_to_start_first():
    result = exercises.check("wrap")
    assert not result.passed
    assert "no file at my_work/wrap.py" in result.message and "exercises.start('wrap')" in result.message


# -- Every reference solution passes -------------------------------------------
@pytest.mark.parametrize("name", exercises.NAMES)
def test_the_solution_passes(name, tmp_path):
    result = exercises.check(name, exercises.EXERCISES[name].solution, timeout=TIMEOUT)
    assert result.passed, result.message
    assert all(passed for _, passed, _ in result.criteria)
    assert result.message.count("✓") == len(result.criteria) and "✗" not in result.message
    if name in ("no_sync", "capstone"):  # rank 0 reports what it measured before it computes the references
        events = [r.get("event") for r in run_records(tmp_path, name, "launch" if name == "capstone" else "run")[0]]
        assert events.index("final") < events.index("references")
    if name == "capstone":  # torchrun's own files stay in the check's folder, not one more in /tmp
        [folder] = (tmp_path / "runs").glob("*-exercise-capstone-*")
        assert list((folder / "torchrun" / runs.TORCHRUN_LOG_DIR).iterdir())
    assert_nothing_left(result, tmp_path)


# -- Every untouched skeleton fails, and says why ------------------------------
SKELETON_FAILS = {
    "init": ("joins one group", "init_process_group was never called"),
    "wrap": ("the model is wrapped", "built no DistributedDataParallel"),
    "sampler": ("a DistributedSampler gives", "iterated no DistributedSampler"),
    "no_sync": ("one gradient all-reduce", "no_sync() was never used"),
    "teardown": ("destroy_process_group called", "never called destroy_process_group"),
    "capstone": ("one gradient all-reduce", "built no DDP model"),
    "shard": ("Adam's state is sharded", "every rank holds Adam's whole state"),
}  # my_ddp's: test_exercise_my_ddp.py, which asserts every criterion of it


def test_every_skeleton_is_checked():
    assert set(SKELETON_FAILS) | {"my_ddp"} == set(exercises.NAMES)


@pytest.mark.parametrize("name", list(SKELETON_FAILS))
def test_the_untouched_skeleton_fails(name):
    exercises.start(name)
    result = exercises.check(name, timeout=TIMEOUT)  # runs my_work/<name>.py
    assert not result.passed
    criterion, words = SKELETON_FAILS[name]
    assert words in failed(result, criterion)
    assert f"exercises.hint({name!r})" in result.message
    if name == "shard":  # the ✗ names what is missing, it does not write the answer's line
        assert "ZeroRedundancyOptimizer(" not in result.message and "optimizer_class=" not in result.message


# -- Typical wrong answers fail with a message that names the mistake ----------
# (exercise, file in exercise_mistakes/, {criterion that fails: words its message must say},
#  the criterion, or criteria, the wrong answer still gets right)
WRONG_ANSWERS = [
    ("init", "init_hardcoded_port",
     {"meets at the launcher's": ["hard-codes port 29500", "drop init_method"]}, None),
    ("init", "init_world_size_one",
     {"joins one group": ["init_process_group(rank=0, world_size=1)", "Leave rank= and world_size= out"]},
     "meets at the launcher's"),
    # Rank 1 skips the all_reduce and exits; rank 0's all_reduce then fails on the closed connection.
    ("init", "init_one_rank_all_reduce",
     {"runs to the end": ["rank 1 never called all_reduce (rank 0 did): every rank must make the same "
                          "collective calls in the same order"],
      "all_reduce of rank + 1": ["rank 1 never called all_reduce (rank 0 did)"]},
     "joins one group"),
    ("init", "init_assigns_all_reduce",
     {"runs to the end": ["all_reduce works in place and returns None (or a Work with async_op=True)",
                          "'NoneType' object has no attribute 'item'"]},
     "all_reduce of rank + 1"),
    ("init", "init_no_destroy",
     {"destroy_process_group called on every rank": ["rank 0 never called destroy_process_group",
                                                     "in finally, on every path"]},
     "all_reduce of rank + 1"),
    # async_op=True without wait(): the harness used to wait for the script, and the answer passed.
    ("init", "init_async_no_wait",
     {"all_reduce of rank + 1": ["called all_reduce(async_op=True) and never called wait()"]},
     "joins one group"),
    ("wrap", "wrap_module_forward",
     {"parameters identical on every rank after every optimizer step": [
         "no forward went through the wrapper", "not ddp_model.module(x)"]},
     "parameters identical on every rank right after"),
    # A crash: whichever rank fails first is named (the launcher then stops the other).
    ("wrap", "wrap_device_ids",
     {"runs to the end": ["failed (exit code 1) at wrap_device_ids.py, line 11", "ValueError", "device_ids"],
      "the model is wrapped": []}, None),
    # The optimizer steps a second model's parameters: nothing trains, so the ranks stayed "identical" (it passed).
    ("wrap", "wrap_optimizer_other_model",
     {"parameters identical on every rank after every optimizer step": [
         "not those of the model DDP wraps", "staying identical shows nothing"]},
     "the model is wrapped"),
    ("sampler", "sampler_no_set_epoch",
     {"a new order every epoch": ["repeated epoch 0's order", "sampler.set_epoch(epoch)"]},
     "a DistributedSampler gives"),
    # World size and ranks right, seeds differ: it said to let the sampler read the world size and rank.
    ("sampler", "sampler_seed_per_rank",
     {"a DistributedSampler gives": ["rank 0: seed=0, rank 1: seed=1", "the same seed"]},
     "a new order every epoch"),
    ("sampler", "sampler_per_rank_data",
     {"every rank builds the same dataset": ["different datasets", "per-rank random data"]},
     "a new order every epoch"),
    ("no_sync", "no_sync_forward_outside",
     {"one gradient all-reduce": ["14 bucket all-reduces for 4 optimizer steps",
                                  "the forward ran outside no_sync()"]},
     "final parameters equal one process"),
    ("no_sync", "no_sync_loss_not_divided",
     {"final parameters equal one process": ["they match one process whose loss was not divided by K"]},
     "one gradient all-reduce"),
    # 7 micro-batches per epoch on each rank: a window of 4, then the tail of 3.
    ("no_sync", "no_sync_tail_left_in_grad",
     {"an optimizer step after every K": ["the last 3 micro-batches of epoch 0", "stayed in .grad",
                                          "joined epoch 1's first optimizer step", "the epoch's tail"],
      "final parameters equal one process": ["they match a run that stepped only after every K-th",
                                             "tail"]},
     "one gradient all-reduce"),
    ("no_sync", "no_sync_tail_divided_by_k",
     {"final parameters equal one process": ["divided the last, shorter window's losses by K"]},
     "an optimizer step after every K"),
    # zero_grad() before every micro-batch: it said only "differ by up to 0.13".
    ("no_sync", "no_sync_zero_grad_each_micro",
     {"final parameters equal one process": ["zero_grad() ran after forwards [1, 2, 3, 5, 6, 8, 9, 10]",
                                             "inside a window", "Zero the gradients only right after each"]},
     "one gradient all-reduce"),
    ("teardown", "teardown_no_finally",
     {"a rank that raises mid-training": ["rank 1 raised InjectedFailure", "No finally"]},
     "destroy_process_group called on every rank"),
    ("teardown", "teardown_rank0_only",
     {"destroy_process_group called on every rank": ["rank 1 never called destroy_process_group",
                                                     "not only some"]},
     "a clean exit"),
    # Two mistakes in each capstone answer (a capstone check runs three ways): each named, in its
    # own criteria, while the criteria neither touches still pass.
    ("capstone", "capstone_every_rank_saves_tail_left",
     {"only rank 0 writes the checkpoint": ["rank 1 also called torch.save", "rank == 0"],
      "an optimizer step after every K": ["the last 3 micro-batches of epoch 0", "stayed in .grad"],
      "final parameters equal one process": ["they match a run that stepped only after every K-th"],
      "runs under torchrun": ["stepped only after every K-th"]},
     ("one gradient all-reduce", "a DistributedSampler gives", "a new order every epoch",
      "runs unchanged as one plain process")),
    # The judge recomputes one process's result with and without set_epoch, and names the one that matches.
    ("capstone", "capstone_ddp_state_dict_no_set_epoch",
     {"a new order every epoch": ["repeated epoch 0's order", "set_epoch"],
      "final parameters equal one process": ["they match a run that reused epoch 0's order"],
      "runs under torchrun": ["reused epoch 0's order"],
      "the checkpoint (under launch and under torchrun) loads strictly": [
          "under launch and under torchrun, capstone_model.pt does not load into task.make_model()",
          'its keys start with "module."', "module.0.weight"]},
     ("runs unchanged as one plain process", "one gradient all-reduce", "an optimizer step after every K",
      "only rank 0 writes the checkpoint", "a DistributedSampler gives")),
]


@pytest.mark.parametrize("name, mistake, failing, still_passing", WRONG_ANSWERS,
                         ids=[w[1] for w in WRONG_ANSWERS])
def test_a_wrong_answer_fails_naming_the_mistake(name, mistake, failing, still_passing, tmp_path):
    result = exercises.check(name, MISTAKES / f"{mistake}.py", timeout=TIMEOUT)
    assert not result.passed
    for criterion, words in failing.items():
        detail = failed(result, criterion)
        for word in words:
            assert word in detail, f"{word!r} not in {detail!r}"
    for criterion in ([still_passing] if isinstance(still_passing, str) else still_passing or ()):
        assert any(n.startswith(criterion) for n in passed_names(result)), result.message
    assert_nothing_left(result, tmp_path)


# (exercise, file in exercise_right_answers/): shaped otherwise than the solution, and right.
RIGHT_SHAPES = [
    ("wrap", "wrap_optimizer_first"),  # the optimizer built on the model before wrapping: the same tensors
    ("no_sync", "no_sync_own_hook"),  # a comm hook of its own: the harness used to crash on it (one hook per DDP)
]


@pytest.mark.parametrize("name, answer", RIGHT_SHAPES, ids=[r[1] for r in RIGHT_SHAPES])
def test_a_right_answer_in_another_shape_passes(name, answer, tmp_path):
    result = exercises.check(name, RIGHT_ANSWERS / f"{answer}.py", timeout=TIMEOUT)
    assert result.passed, result.message
    assert_nothing_left(result, tmp_path)


# -- Hangs and crashes ---------------------------------------------------------
def test_a_hanging_script_fails_within_the_deadline_and_leaves_no_process(tmp_path):
    # Warm ranks reach the hang in about a second; cold ones (macOS's default) import torch first.
    deadline = 7 if warm_ready() else 30
    t0 = time.monotonic()
    result = exercises.check("init", MISTAKES / "init_hang.py", timeout=deadline)
    assert time.monotonic() - t0 < deadline + 20  # the deadline, plus stopping the ranks and reading their reports
    detail = failed(result, "runs to the end")
    assert f"did not finish within {deadline} s" in detail
    assert ("Collective call #1 differs: rank 0 called all_reduce, rank 1 called barrier: every rank must make "
            "the same collective calls in the same order") in detail
    assert_nothing_left(result, tmp_path)


def test_after_a_crash_what_could_not_be_measured_is_not_measured_not_a_false_cross(tmp_path):
    result = exercises.check("sampler", MISTAKES / "sampler_crash.py", timeout=TIMEOUT)
    detail = failed(result, "runs to the end")
    assert "TypeError" in detail and "shufle" in detail
    shards = failed(result, "a DistributedSampler gives")
    assert shards.startswith("not measured:") and "whole dataset" not in shards
    assert "  · a DistributedSampler gives" in result.message and "✗ a DistributedSampler" not in result.message
    assert result.message.count("✗") == 1 and "not measured. A hint" in result.message
    assert_nothing_left(result, tmp_path)


def test_a_rank_stopped_before_its_all_reduce_is_not_said_to_have_skipped_it():
    """Rank 0 failed after its async all_reduce; the launcher stopped rank 1 before it got there (records by hand)."""
    from ddp_tutorial.exercises.runs import HarnessRun

    enter = {"event": "collective_enter", "op": "all_reduce", "n": 1, "input": [1.0], "async": True}
    run = HarnessRun("launch", 2, 30.0, records={0: [enter], 1: []})
    run.failed_rank, run.failure = 0, "rank 0 failed (exit code -6)"
    (name, passed, detail), = [c for c in judge.judge_init(run) if c[0] == judge.ALL_REDUCE_SUM]
    assert not passed and detail.startswith("not measured:") and "rank 1 stopped before calling all_reduce" in detail
    assert "never called" not in detail
    # The same records, rank 1's script having ended on its own: then it did skip it.
    run = HarnessRun("launch", 2, 30.0, records={0: [enter], 1: [{"event": "final", "error": None}]})
    run.failed_rank, run.failure = 0, "rank 0 failed (exit code -6)"
    (name, passed, detail), = [c for c in judge.judge_init(run) if c[0] == judge.ALL_REDUCE_SUM]
    assert "rank 1 never called all_reduce (rank 0 did)" in detail


def test_a_crashing_script_fails_naming_the_rank_and_the_error(tmp_path):
    result = exercises.check("init", MISTAKES / "init_crash.py", timeout=TIMEOUT)
    detail = failed(result, "runs to the end")
    assert "rank 1 failed (exit code 1) at init_crash.py, line 10" in detail
    assert "ZeroDivisionError" in detail
    assert judge.ALL_REDUCE_SUM in passed_names(result)  # measured before the crash
    assert_nothing_left(result, tmp_path)


# -- The solutions follow the kit's own advice ---------------------------------
def drops_before_destroy(source: str) -> bool:
    """Where the script leaves the group, the statements before it drop the DDP model (``model = None``)."""
    import ast

    found = False
    for node in ast.walk(ast.parse(source)):
        for block in (getattr(node, "body", None), getattr(node, "finalbody", None)):
            if not isinstance(block, list):
                continue
            for i, statement in enumerate(block):
                line = ast.unparse(statement)
                if isinstance(statement, ast.Expr) and ("destroy_process_group(" in line or line == "teardown()"):
                    found = True
                    if not any(ast.unparse(s).startswith(("model = ", "del model")) for s in block[:i]):
                        return False
    return found


@pytest.mark.parametrize("name", ["wrap", "no_sync", "teardown", "capstone"])
def test_a_solution_with_a_ddp_model_drops_it_before_destroy_process_group(name):
    assert drops_before_destroy((exercises.EXERCISES[name].solution).read_text()), name


def test_train_main_drops_the_model_before_teardown():
    import ast

    import ddp_tutorial

    tree = ast.parse((Path(ddp_tutorial.__file__).parent / "train.py").read_text())
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    assert drops_before_destroy(ast.unparse(main))


def test_check_without_a_path_finds_the_file_from_the_repository_root_too(tmp_path, monkeypatch):
    monkeypatch.delenv(envvars.MY_WORK, raising=False)  # as a learner has it: no folder set
    monkeypatch.chdir(tmp_path)  # a repository root: notebooks/my_work/ below it, no my_work/ here
    (tmp_path / "notebooks" / "my_work").mkdir(parents=True)
    learner = tmp_path / "notebooks" / "my_work" / "init.py"
    learner.write_text("raise SystemExit('the learner file ran')\n")
    assert exercises.default_script("init") == Path("notebooks") / "my_work" / "init.py"
    result = exercises.check("init", echo="none", timeout=TIMEOUT)
    assert "the learner file ran" in result.message
    missing = exercises.check("wrap", echo="none")
    assert f"looked in {(tmp_path / 'my_work').resolve()}" in " ".join(missing.message.split())
