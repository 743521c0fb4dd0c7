"""Which rank failed first, and where each rank was when a deadline passed.

A rank's exit can come long after its failure (a slow traceback, atexit handlers),
so ``launch`` orders failures by the moment each rank noted its own; and at a
deadline every rank writes its Python stack before it stops.
"""

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from conftest import processes_of_run
from test_hardening import child_processes
from ddp_tutorial import LaunchTimeout, WorkerError, launch, runfolder, stacks
from ddp_tutorial.launcher import STACKS_WAIT_S

SCRIPTS = Path(__file__).parent / "scripts"


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
@pytest.mark.parametrize("first", [0, 1])
def test_the_rank_that_failed_first_is_named_even_when_it_exits_last(first, warm):
    second = 1 - first
    for _ in range(4 if warm else 1):
        with pytest.raises(WorkerError) as info:
            launch(str(SCRIPTS / "fail_in_order.py"), 2, ["--first", str(first)], timeout=60,
                   echo="none", warm=warm)
        err = info.value
        assert err.rank == first, str(err)
        assert f"RuntimeError: rank {first} fails first" in err.traceback
        assert err.failed_after == [second]
        assert f"rank {first} failed first" in str(err) and f"rank {second} failed after it" in str(err)
        assert not processes_of_run(err.run.run_dir)


def test_a_rank_killed_by_a_signal_leaves_no_note_and_is_still_named():
    with pytest.raises(WorkerError) as info:
        launch(str(SCRIPTS / "killed_by_signal.py"), 2, timeout=60, echo="none")
    err = info.value
    assert err.rank == 1 and err.exit_code == -9 and err.failed_after == []
    assert "killed by SIGKILL" in str(err) and "stopped the other ranks still running (0)" in str(err)


def _first_record(run_dir: Path, rank: int, phase: str):
    try:
        return next((r for r in runfolder.read_jsonl(run_dir / f"rank{rank}.jsonl") if r.get("phase") == phase), None)
    except OSError:  # not written yet
        return None


def _rank0_wrote_its_stack(run_dir: Path) -> bool:
    try:
        return stacks.wrote_script_stack(runfolder.stacks_file(run_dir, 0, 0).read_text())
    except OSError:
        return False


def _when(condition, launch_over: threading.Event, limit_s: float = 60.0) -> bool:
    """Look for ``condition`` until it holds (True), the launch is over or ``limit_s`` passed (False)."""
    end = time.monotonic() + limit_s
    while not launch_over.is_set() and time.monotonic() < end:
        if condition():
            return True
        launch_over.wait(0.01)  # what is looked for is a file being written: nothing to wake on
    return False


def _hold_rank1_off_the_cpu(run_dir: Path, launch_over: threading.Event) -> None:
    """From the moment rank 1 is inside its all_reduce, keep it stopped (SIGSTOP) until rank 0 has
    written its stack or was stopped: if the launcher stopped rank 0 first, rank 1 (which could not
    answer while held) would show its all_reduce failing, as a starved rank on a busy core did."""
    if not _when(lambda: _first_record(run_dir, 0, "joined") and _first_record(run_dir, 1, "inside all_reduce"),
                 launch_over):
        return
    rank1 = _first_record(run_dir, 1, "joined")["pid"]
    os.kill(rank1, signal.SIGSTOP)
    try:
        _when(lambda: _rank0_wrote_its_stack(run_dir) or _first_record(run_dir, 0, "stopped"), launch_over)
    finally:
        os.kill(rank1, signal.SIGCONT)


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
def test_a_deadline_shows_each_ranks_stack_written_before_any_rank_is_stopped(warm, capsys, tmp_path):
    run_dir = tmp_path / "run"
    launch_over = threading.Event()
    holder = threading.Thread(target=_hold_rank1_off_the_cpu, args=(run_dir, launch_over))
    holder.start()
    try:
        with pytest.raises(LaunchTimeout) as info:
            # Long enough for both ranks to join and reach their waits on a busy machine (cold ranks
            # import torch first).
            launch(str(SCRIPTS / "wait_for_missing_peer.py"), 2, timeout=8 if warm else 12, warm=warm,
                   run_dir=run_dir)
    finally:
        launch_over.set()
        holder.join()
    err = info.value
    # Rank 1 was held off the CPU until rank 0 had answered: its stack was still asked for, and
    # taken, before SIGTERM reached rank 0 (which reports what it found then).
    assert [r["rank1_stack_written"] for r in err.run.results(0) if r["phase"] == "stopped"] == [True]
    assert set(err.stacks) == {0, 1}
    assert err.waiting_in == {0: None, 1: "all_reduce"}
    assert "in all_reduce" in err.stacks[1] and "wait_for_missing_peer.py" in err.stacks[1]
    assert "in rank0_keeps_computing" in err.stacks[0] and "all_reduce" not in err.stacks[0]
    # What a learner reads: the script's frames only, not the machinery that started the rank.
    assert "bootstrap.py" not in err.stacks[1] and "runpy" not in err.stacks[1]
    # The message stays short; the stacks are printed once.
    assert "all_reduce" not in str(err) and ".stacks" in str(err)
    out = capsys.readouterr().out
    assert out.count("deadline passed; where each rank was") == 1
    assert "rank 1, inside torch.distributed.all_reduce" in out
    assert "rank 0, not inside a torch.distributed call" in out
    assert not processes_of_run(err.run.run_dir)


def test_a_rank_that_ignores_sigterm_still_shows_where_it_was_and_is_killed_after_grace():
    """Rank 1 ignores the signal that asks for its stacks too: the deadline waits for its answer
    only so long (``STACKS_WAIT_S``), and says why it has none."""
    t0 = time.monotonic()
    with pytest.raises(LaunchTimeout) as info:
        launch(str(SCRIPTS / "ignore_sigterm.py"), 2, ["--and-the-stacks-signal-on", "1"], timeout=3,
               grace=0.5, echo="none")
    err = info.value
    # deadline 3 s + the wait for rank 1's stack + grace 0.5 s + reaping; generous for a loaded machine
    assert time.monotonic() - t0 < 3 + STACKS_WAIT_S + 10
    assert "in <module>" in err.stacks[0] and "ignore_sigterm.py" in err.stacks[0]
    assert "no stack" in err.stacks[1] and err.waiting_in == {0: None, 1: None}
    assert err.run.exit_codes == {0: -9, 1: -9}
    assert not processes_of_run(err.run.run_dir) and not child_processes()


def test_stacks_are_read_from_faulthandlers_words():
    dump = '''Thread 0x00007f0000000001 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 320 in wait
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

Current thread 0x00007f0000000002 (most recent call first):
  File "/x/site-packages/torch/distributed/distributed_c10d.py", line 2810 in all_reduce
  File "/x/site-packages/torch/distributed/c10d_logger.py", line 81 in wrapper
  File "/home/me/train.py", line 40 in main
  File "/home/me/train.py", line 50 in <module>
  File "<frozen runpy>", line 88 in _run_code
  File "/x/ddp_tutorial/rank/bootstrap.py", line 340 in run_script
  File "/x/ddp_tutorial/rank/bootstrap.py", line 300 in run_rank
  File "/x/ddp_tutorial/rank/bootstrap.py", line 360 in <module>
'''
    assert stacks.waiting_in(dump) == "all_reduce"
    shown = stacks.script_stack(dump)
    assert shown.splitlines()[0].endswith("in all_reduce") and shown.splitlines()[-1].endswith("in <module>")
    assert "bootstrap.py" not in shown and "threading.py" not in shown
    assert stacks.waiting_in(dump.replace("distributed_c10d.py", "other.py").replace(
        "c10d_logger.py", "x.py").replace("torch/distributed", "torch/nn")) is None


@pytest.mark.parametrize("line, waits", [("    work.wait()", stacks.ASYNC_WAIT),
                                         ("    handle.wait(timeout=timedelta(seconds=5))", stacks.ASYNC_WAIT),
                                         ("    os.wait()", None), ("    x = compute()", None)])
def test_a_rank_blocked_on_an_async_handle_is_said_to_wait_on_it(tmp_path, line, waits):
    """Work.wait() is C++: the innermost Python frame is the script's line that calls it."""
    script = tmp_path / "my_ddp.py"
    script.write_text("import os\n\ndef finish(work):\n" + line + "\n")
    dump = (f'Current thread 0x00007f0000000002 (most recent call first):\n'
            f'  File "{script}", line 4 in finish\n  File "{script}", line 9 in <module>\n'
            f'  File "/x/ddp_tutorial/rank/bootstrap.py", line 360 in <module>\n')
    assert stacks.waiting_in(dump) == waits


def test_a_failure_that_says_a_peer_went_away_comes_after_the_failure_that_caused_it():
    from ddp_tutorial.launcher import failure_order

    notes = {0: {"failed_at": 10.002, "peer_gone": False},   # timed out, noted late (still unwinding)
             1: {"failed_at": 10.001, "peer_gone": True}}    # "Connection closed by peer", noted first
    assert failure_order({0: 10.3, 1: 10.1}, {0, 1}, notes) == [0, 1]
    assert failure_order({}, {0, 1}, {0: {"failed_at": 2.0}, 1: {"failed_at": 1.0}}) == [1, 0]
    # a rank killed by a signal (no note) is placed by when its exit was seen
    assert failure_order({2: 1.5}, {2}, {0: {"failed_at": 2.0}}) == [2, 0]


def test_the_bootstrap_notes_an_error_that_says_a_peer_went_away(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("_bootstrap_under_test",
                                                  Path(ddp_tutorial_dir(), "rank", "bootstrap.py"))
    bootstrap = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bootstrap)
    previous = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR2)
    try:
        notes = bootstrap.RankNotes(str(tmp_path), rank=1, attempt=0)
        notes.failed(5.0, 1, RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1"))
        notes.close()
    finally:
        signal.signal(signal.SIGTERM, previous[0])
        signal.signal(signal.SIGUSR2, previous[1])
    record = runfolder.failure_notes(tmp_path, 0)[1]  # written by the bootstrap, read by launch
    assert record["peer_gone"] is True and record["failed_at"] == 5.0
    assert not runfolder.stacks_file(tmp_path, 0, 1).exists()  # nothing asked: no stacks note


def ddp_tutorial_dir() -> Path:
    import ddp_tutorial

    return Path(ddp_tutorial.__file__).parent
