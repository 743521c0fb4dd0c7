"""The teacher's grader: a class of right answers, typical mistakes and hostile files, graded once.

One module-scoped grading run (2 checks at a time) of a small generated class; every test below
asserts one guarantee of docs/grading.md on its output. The hostile files report what they could
do by raising ``RuntimeError("PROBE {...}")``: the check quotes the traceback, so the report carries it.
The class-sized run (30 learners x 7 exercises) is a benchmark: ``python -m ddp_tutorial.bench --grade``.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from contextlib import redirect_stdout
from pathlib import Path

import psutil
import pytest

from ddp_tutorial.teacher import grade
from ddp_tutorial.exercises import SOLUTIONS_DIR

MISTAKES = Path(__file__).parent / "exercise_mistakes"
TIMEOUT = 30.0  # lets the hostile file's probes (a 1 GiB write, a fork loop) finish in a busy suite: 15 s did not
JOBS = 2
#: A fork loop: fork until refused, each child exiting at once (unreaped, it still counts), then say when.
FORK_LOOP = ("import json, os\nn = 0\nwhile True:\n    try:\n        pid = os.fork()\n"
             "    except OSError as exc:\n        print(json.dumps([n, type(exc).__name__]))\n        break\n"
             "    if pid == 0:\n        os._exit(0)\n    n += 1\n")
#: A command line no other process has: the detached child of learner "setsid" runs it.
DAEMON = "sleep 3617.25"

pytestmark = pytest.mark.skipif(grade.sandbox_problem() is not None,
                                reason=f"the grader's sandbox cannot run here: {grade.sandbox_problem()}")


def probe(body: str) -> bytes:
    """A submission that tries something, then raises its findings (a dict ``found``) for the report."""
    return ("import json, os, socket, sys\nfound = {}\n" + body
            + "\nraise RuntimeError('PROBE ' + json.dumps(found, sort_keys=True))\n").encode()


def attempt(label: str, code: str) -> str:
    """Lines that run ``code`` and record in ``found[label]`` "ok" or the error's name."""
    return (f"try:\n    {code}\n    found[{label!r}] = 'ok'\n"
            f"except Exception as exc:\n    found[{label!r}] = type(exc).__name__\n")


def tree_hash(folder: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        digest.update(str(path.relative_to(folder)).encode())
        if path.is_symlink():
            digest.update(os.readlink(path).encode())
        elif path.is_file():
            digest.update(path.read_bytes())
    return digest.hexdigest()


def leftovers() -> list:
    """Live processes of the sandboxes' uids, or the detached child's command line."""
    found = []
    for p in psutil.process_iter(["uids", "cmdline", "status"]):
        uid, cmdline = p.info["uids"], " ".join(p.info["cmdline"] or [])
        if uid is None or p.info["status"] in (None, psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
            continue  # gone meanwhile, or dead and waiting for its parent
        if grade.UID_BASE <= uid.real < grade.UID_BASE + 64 or DAEMON in cmdline:
            found.append((p.pid, uid.real, cmdline[:100]))
    return found


@pytest.fixture(scope="module")
def graded():
    # Outside /tmp, which every sandbox replaces with a /tmp of its own: what keeps the class and the
    # report out of reach must be the grader's hiding them, not where the test happens to put them.
    base = Path(tempfile.mkdtemp(prefix="ddp-grade-class-", dir="/var/tmp"))
    base.chmod(0o755)  # as a teacher's folder usually is: any user may look in, so the hiding is what is tested
    subs, out = base / "submissions", base / "grades"
    outside = base / "outside"  # the teacher's files, visible (read-only) in the sandbox
    outside.mkdir()
    home = outside / "home"
    home.mkdir()
    (outside / "precious.txt").write_text("the teacher's file\n")
    victim = subs / "ana" / "init.py"
    report = out / "report.html"
    kit_file = grade.PACKAGE_ROOT / "__init__.py"
    # A folder on sys.path under /tmp, as a kit or venv cloned into a temporary folder is: the sandbox
    # gives the check a /tmp of its own, and must bind such a folder back into it.
    kept_dir = Path(tempfile.mkdtemp(prefix="ddp-grade-kept-", dir="/tmp"))
    kept_file = kept_dir / "kept.txt"
    kept_file.write_text("kept")
    kept_dir.chmod(0o755)
    sys.path.append(str(kept_dir))
    files = {
        "ana/init.py": (SOLUTIONS_DIR / "init.py").read_bytes(),
        "ana/wrap.py": (SOLUTIONS_DIR / "wrap.py").read_bytes(),
        "ana/notes.txt": b"not an exercise\n",
        "Zoë Müller/init.py": (SOLUTIONS_DIR / "init.py").read_bytes(),
        "Zoë Müller/init (1).py": b"print('an older copy')\n",
        "ben/init.py": (MISTAKES / "init_no_destroy.py").read_bytes(),
        # Rank 0 prints a gigabyte, then loops; rank 1 waits for it (as a peer in a collective would):
        # both ignore SIGTERM. The loop sleeps: a spinning one would take a core from the rest of the
        # suite for the whole timeout, and the grader stops either the same way.
        "loops/init.py": (b"import os, signal, sys, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                          b"if os.environ.get('RANK') != '0':\n    time.sleep(3600)\n"
                          b"line = 'x' * (1 << 20) + '\\n'\nfor _ in range(1024):\n    sys.stdout.write(line)\n"
                          b"while True:\n    time.sleep(1)\n"),
        # One probe for what a check must not reach, rank 0 alone (rank 1 waits): each guarantee below
        # reads its own keys. First what the rank had imported before the learner's first line (an
        # init check's fork server skips torch._dynamo: DDP's constructor would import it); the fork
        # loop last, as it uses up the processes. It runs in a small process of its own: forking a
        # rank (torch imported) 500 times is slow.
        "hostile/init.py": probe(
            "found['dynamo'] = 'torch._dynamo' in sys.modules\nfound['torch'] = 'torch' in sys.modules\n"
            "import subprocess, time\nif os.environ.get('RANK') != '0':\n    time.sleep(3600)\n"
            + attempt("1 GiB file", "open('big.bin', 'wb').write(b'y' * (1 << 30))")
            + "found['kept size'] = os.path.getsize('big.bin')\n"
            + attempt("8 GiB", "block = bytearray(8 << 30)")
            + attempt("write other learner", f"open({str(victim)!r}, 'w').write('stolen')")
            + attempt("write report", f"open({str(report)!r}, 'w').write('forged')")
            + attempt("write teacher home", f"open({str(home / 'was-here')!r}, 'w').write('x')")
            + attempt("write root home", "open('/root/.ddp-grade-probe', 'w').write('x')")
            + attempt("write kit", f"open({str(kit_file)!r}, 'a').write('# x')")
            + attempt("write tmp", "open('/tmp/ddp-grade-probe', 'w').write('x')")
            + attempt("read other learner", f"found['read'] = open({str(victim)!r}).read()[:20]")
            + attempt("list class", f"found['ls'] = os.listdir({str(subs)!r})")
            + attempt("kept under /tmp", f"found['kept'] = open({str(kept_file)!r}).read()")
            + attempt("remove precious", f"os.remove({str(outside / 'precious.txt')!r})")
            + attempt("remove other learner", f"os.remove({str(victim)!r})")
            + attempt("remove report", f"os.remove({str(report)!r})")
            + attempt("remove kit", f"os.remove({str(kit_file)!r})")
            + "found['interfaces'] = sorted(n for _, n in socket.if_nameindex())\n"
            + attempt("bind all", "socket.socket().bind(('0.0.0.0', 0))")
            + "child = subprocess.Popen(['setsid', 'sh', '-c', 'exec " + DAEMON + "'])\n"
            "found['daemon'] = child.pid\n"
            f"loop = {FORK_LOOP!r}\n"
            "out = subprocess.run([sys.executable, '-c', loop], capture_output=True, text=True)\n"
            "found['stopped_after'], found['error'] = json.loads(out.stdout)\n"),
        "syntax/init.py": b"def broken(:\n    pass\n",
        "binary/init.py": bytes(range(256)) * 4,
        "empty/init.py": b"",
    }
    for name, data in files.items():
        path = subs / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    (subs / "linker").mkdir()
    (subs / "linker" / "init.py").symlink_to("/etc/passwd")
    with zipfile.ZipFile(subs / "cleo.zip", "w") as archive:  # a platform's export: one folder inside
        archive.writestr("cleo-week3/init.py", (MISTAKES / "init_hardcoded_port.py").read_bytes())
        archive.writestr("cleo-week3/README.md", "my notes")
    (subs / "gradebook.xlsx").write_bytes(b"not a learner")
    before = tree_hash(subs)
    printed = io.StringIO()
    old_home = os.environ.get("HOME")
    os.environ["HOME"] = str(home)
    try:
        with redirect_stdout(printed):
            result = grade.grade(subs, out, jobs=JOBS, timeout=TIMEOUT)
    finally:
        os.environ["HOME"] = old_home or "/root"
        sys.path.remove(str(kept_dir))
    after = tree_hash(subs)
    left = leftovers()
    # A rerun with one file changed checks only that file.
    (subs / "empty" / "init.py").write_bytes((SOLUTIONS_DIR / "init.py").read_bytes())
    again = io.StringIO()
    with redirect_stdout(again):
        rerun = grade.grade(subs, out, jobs=JOBS, timeout=TIMEOUT)
    yield {"result": result, "out": out, "subs": subs, "before": before, "after": after, "left": left,
           "printed": printed.getvalue(), "outside": outside, "home": home, "rerun": rerun,
           "again": again.getvalue(), "kit_file": kit_file}
    shutil.rmtree(base, ignore_errors=True)
    shutil.rmtree(kept_dir, ignore_errors=True)
    Path("/root/.ddp-grade-probe").unlink(missing_ok=True)


def outcome(graded, learner, exercise="init"):
    return next(o for o in graded["result"]["outcomes"] if o.learner == learner and o.exercise == exercise)


def probed(graded, learner) -> dict:
    o = outcome(graded, learner)
    text = "\n".join(detail for _, _, detail in o.criteria)
    match = re.search(r"PROBE (\{.*?\})\s*$", text, re.M)
    assert match, f"{learner}: no probe in {o.status}: {text[:600]}"
    return json.loads(match.group(1))


LEARNERS = ["ana", "ben", "binary", "cleo", "empty", "hostile", "linker", "loops", "syntax", "Zoë Müller"]


def test_the_report_is_written_with_a_row_for_every_learner(graded):
    out = graded["out"]
    with open(out / "report.csv", encoding="utf-8") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["learner", "init", "wrap", "sampler", "no_sync", "teardown", "capstone", "shard", "my_ddp"]
    assert sorted(r[0] for r in rows[1:]) == sorted(LEARNERS)
    page = (out / "report.html").read_text(encoding="utf-8")
    assert "<title>Exercise results: 10 learners</title>" in page and "forged" not in page
    for learner in LEARNERS:
        assert f'id="learner-{grade.report._id(learner)}"' in page
    assert "Content-Security-Policy" in page and "<script" not in page
    assert "init: 2 of 10 pass" in graded["printed"]  # ana, Zoë Müller
    assert "graded 10 learners in" in graded["printed"] and "[10/10]" in graded["printed"]


def test_right_answers_pass_and_mistakes_are_named(graded):
    assert outcome(graded, "ana").status == "passed" and outcome(graded, "ana", "wrap").status == "passed"
    assert outcome(graded, "Zoë Müller").status == "passed"  # a name with a space and non-ASCII
    assert outcome(graded, "ana", "sampler").status == "not submitted"
    ben = outcome(graded, "ben")
    assert ben.status == "failed" and ben.summary.startswith("destroy_process_group called on every rank")
    cleo = outcome(graded, "cleo")  # from a zip with one folder inside; the harness stops a hard-coded port
    skipped = next(s for s in graded["result"]["submissions"] if s.learner == "cleo").skipped
    assert cleo.status == "crashed" and "init_method='tcp://127.0.0.1:29500'" in cleo.summary
    assert "cleo-week3/README.md (not an exercise file)" in skipped


def test_files_that_are_not_exercises_are_skipped_and_said(graded):
    printed = graded["printed"]
    assert "skipped ana/notes.txt (not an exercise file)" in printed
    assert "skipped Zoë Müller/init (1).py (not an exercise file)" in printed
    assert "gradebook.xlsx (not a folder or a .zip)" in printed


def test_broken_files_crash_or_fail_with_what_went_wrong(graded):
    syntax = outcome(graded, "syntax")
    assert syntax.status == "crashed" and "SyntaxError" in syntax.summary
    binary = outcome(graded, "binary")
    assert binary.status == "crashed" and "null bytes" in binary.summary
    empty = outcome(graded, "empty")
    assert empty.status == "failed" and "init_process_group was never called" in empty.summary
    linker = outcome(graded, "linker")
    assert linker.status == "not graded" and "symbolic link (to /etc/passwd)" in linker.summary
    assert "root:" not in (graded["out"] / "results.json").read_text()  # its target was never read


def test_an_init_checks_ranks_start_with_torch_but_not_what_only_ddp_needs(graded):
    found = probed(graded, "hostile")  # the harness imported torch; nothing imported dynamo
    assert (found["dynamo"], found["torch"]) == (False, True)


def test_an_endless_loop_that_ignores_sigterm_times_out_and_is_gone(graded):
    loops = outcome(graded, "loops")
    assert loops.status == "timed out" and loops.summary.startswith("runs to the end on every rank: did not finish")
    assert loops.seconds < grade.wall_limit("init", TIMEOUT)


def test_nothing_the_grading_started_is_left_running(graded):
    assert graded["left"] == []  # the detached child (setsid), the fork loop's children, SIGTERM-proof ranks
    assert isinstance(probed(graded, "hostile")["daemon"], int)  # the child was started


def test_a_gigabyte_of_output_is_bounded(graded):
    loud = outcome(graded, "loops")  # a gigabyte printed: that check's time and memory, no one else's
    assert loud.status in ("crashed", "timed out")
    assert len(loud.log) <= grade.Limits().output_bytes + 200
    assert (graded["out"] / "results.json").stat().st_size < (1 << 20)
    assert sum(p.stat().st_size for p in graded["out"].rglob("*") if p.is_file()) < (4 << 20)
    found = probed(graded, "hostile")  # a gigabyte written: the file stops at the limit
    assert (found["1 GiB file"], found["kept size"]) == ("OSError", grade.Limits().file_bytes)


def test_a_fork_loop_stops_at_the_process_limit(graded):
    found = probed(graded, "hostile")
    assert found["error"] == "BlockingIOError" and 0 < found["stopped_after"] < grade.Limits().processes


def test_a_memory_hog_is_refused(graded):
    assert probed(graded, "hostile")["8 GiB"] == "MemoryError"


def test_no_file_outside_the_check_can_be_written(graded):
    found = probed(graded, "hostile")
    hidden = ("FileNotFoundError", "OSError")  # under an empty read-only folder: not there, cannot be made
    assert found["write other learner"] == "FileNotFoundError"
    assert {found[f"write {k}"] for k in ("report", "teacher home", "root home")} <= set(hidden)
    refused = ("OSError", "PermissionError")  # EROFS (read-only), or EACCES (root's, and we are not root)
    assert found["write kit"] in refused
    assert found["write tmp"] == "ok"  # its own /tmp, gone with the sandbox
    assert not Path("/tmp/ddp-grade-probe").exists() and not Path("/root/.ddp-grade-probe").exists()
    assert not (graded["home"] / "was-here").exists()
    assert graded["before"] == graded["after"]  # every learner's files as they were
    assert "# x" not in graded["kit_file"].read_text()


def test_another_learners_submission_cannot_be_read(graded):
    found = probed(graded, "hostile")
    assert found["read other learner"] == "FileNotFoundError" and "read" not in found
    assert found["list class"] == "ok" and found["ls"] == []  # the class's folder is there, and empty
    assert found["kept under /tmp"] == "ok" and found["kept"] == "kept"  # what the kit needs stays readable


def test_deleting_files_fails_everywhere(graded):
    found = probed(graded, "hostile")
    assert {found["remove precious"], found["remove kit"]} <= {"OSError", "PermissionError"}
    assert found["remove other learner"] == "FileNotFoundError"
    assert found["remove report"] in ("FileNotFoundError", "OSError")
    assert (graded["outside"] / "precious.txt").read_text() == "the teacher's file\n"
    assert outcome(graded, "ana").status == "passed"  # its result untouched by the others


def test_nothing_listens_beyond_loopback(graded):
    found = probed(graded, "hostile")
    assert found["interfaces"] == ["lo"] and found["bind all"] == "ok"  # 0.0.0.0 there is loopback only


def test_a_rerun_checks_only_what_changed(graded):
    again = graded["again"]
    assert again.count("(unchanged: from the cache)") == 9 and "[10/10] empty · init: ✓" in again
    assert next(o for o in graded["rerun"]["outcomes"] if o.learner == "empty" and o.exercise == "init").status == "passed"


@pytest.mark.parametrize("layout, message", [
    ({"init.py": b"x"}, "found exercise files directly in"),
    ({"ana/notes.txt": b"x"}, "found no exercise file in any learner's folder. Found: ana/ (notes.txt"),
    ({}, "found no exercise file"),
])
def test_other_layouts_are_refused_saying_what_was_expected(tmp_path, layout, message):
    root = tmp_path / "subs"
    root.mkdir()
    for name, data in layout.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    with pytest.raises(grade.LayoutError, match="expected .*/<learner>/") as err:
        grade.grade(root, tmp_path / "out")
    assert message in str(err.value)
    assert not (tmp_path / "out").exists()


def test_the_grade_command_exits_with_the_grader_s_code(tmp_path):
    # `python -m ddp_tutorial.grade` is a command module in front of teacher/grade/: a refused layout is exit 2.
    done = subprocess.run([sys.executable, "-m", "ddp_tutorial.grade", str(tmp_path / "none"), "--out",
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "is not a folder" in done.stderr, (done.returncode, done.stderr)


def test_a_missing_bubblewrap_is_said_in_one_line(tmp_path):
    (tmp_path / "subs" / "ana").mkdir(parents=True)
    (tmp_path / "subs" / "ana" / "init.py").write_bytes((SOLUTIONS_DIR / "init.py").read_bytes())
    done = subprocess.run([sys.executable, "-m", "ddp_tutorial.grade", str(tmp_path / "subs"), "--out",
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PATH": str(tmp_path)})  # no bwrap on this PATH
    assert done.returncode == 3, (done.returncode, done.stderr)
    assert done.stderr.splitlines() == ["error: the grader's sandbox needs bwrap (Debian's bubblewrap: "
                                        "apt-get install bubblewrap), which is not installed"]
