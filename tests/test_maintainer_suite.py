"""The self-check that tests another torch or runs the suite many times: its parsing and its table
(no real suite runs here)."""

import os
import re
import sys
from pathlib import Path

import pytest

from ddp_tutorial.maintainer import __main__ as maintainer_main
from ddp_tutorial.maintainer import pythons, record, suite

ROOT = Path(__file__).resolve().parents[1]


# -- the maintainer's checks: another torch, and the suite many times (parsing and reporting only) --------------
def test_the_readme_test_command_is_the_one_the_maintainer_runs():
    readme = (ROOT / "README.md").read_text()
    assert f"pip install -r requirements.txt && {' '.join(suite.README_TEST_COMMAND)}\n" in readme


def test_the_suite_reads_the_torch_requirements_txt_pins():
    pinned = suite.pinned_torch((ROOT / "requirements.txt").read_text())
    assert pinned is not None and re.fullmatch(r"\d+\.\d+\.\d+", pinned), pinned  # no "; marker"


def test_requirements_get_the_asked_torch_and_keep_the_rest():
    text = "# a comment\ntorch==2.13.0\nmatplotlib\ntorchvision\npytest\n-e .\n"
    assert pythons.requirements_with_torch(text, "2.6.0") == ["torch==2.6.0", "matplotlib", "torchvision",
                                                            "pytest", "-e ."]
    assert pythons.requirements_with_torch("torch>=2.6\n", "2.15.0") == ["torch==2.15.0"]
    assert pythons.same_release("2.13.0+cpu", "2.13.0") and not pythons.same_release("2.13.1", "2.13.0")
    assert not pythons.same_release(None, "2.13.0")


JUNIT = '''<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="1" failures="1" skipped="1" tests="5" time="12.0">
<testcase classname="tests.test_warm" name="test_ok" time="1.5"/>
<testcase classname="tests.test_warm" name="test_bad[1-warm]" time="2.0"><failure message="AssertionError: rank 1 fails first">long
traceback
here</failure><system-out>[launch] deadline passed; where each rank was:
--- rank 1, inside torch.distributed.all_reduce</system-out></testcase>
<testcase classname="tests.test_slurm" name="test_cluster" time="0.1"><skipped message="no slurm"/></testcase>
<testcase classname="tests.test_launcher" name="test_setup" time="0.1"><error message="">fixture failed
ProcessLookupError: [Errno 3] No such process
x
y</error></testcase>
<testcase classname="notebooks.00_overview.ipynb" name="00_overview.ipynb" time="9.0"/>
</testsuite></testsuites>
'''


def test_a_junit_report_becomes_each_tests_outcome_and_first_lines(tmp_path):
    report = tmp_path / "junit.xml"
    report.write_text(JUNIT)
    cases = suite.junit_cases(report)
    assert {t: c["outcome"] for t, c in cases.items()} == {
        "tests/test_warm.py::test_ok": "passed", "tests/test_warm.py::test_bad[1-warm]": "failed",
        "tests/test_slurm.py::test_cluster": "skipped", "tests/test_launcher.py::test_setup": "error",
        "notebooks/00_overview.ipynb": "passed"}
    assert cases["tests/test_warm.py::test_bad[1-warm]"]["message"] == "AssertionError: rank 1 fails first\nlong\ntraceback"
    assert cases["tests/test_launcher.py::test_setup"]["message"].splitlines() == [
        "fixture failed", "ProcessLookupError: [Errno 3] No such process", "x"]
    # The whole report and what the test printed (a deadline's stacks) are kept for the --json file.
    bad = cases["tests/test_warm.py::test_bad[1-warm]"]["report"]
    assert bad.startswith("AssertionError: rank 1 fails first\nlong\ntraceback\nhere\n--- printed ---\n")
    assert bad.endswith("--- rank 1, inside torch.distributed.all_reduce")
    assert "report" not in cases["tests/test_warm.py::test_ok"] and "report" not in cases["tests/test_slurm.py::test_cluster"]


def test_the_suite_table_counts_failures_per_test_and_shows_each_runs_wall_time(tmp_path):
    report = tmp_path / "junit.xml"
    report.write_text(JUNIT)
    failing = suite.junit_cases(report)
    passing = {t: {**c, "outcome": "passed" if c["outcome"] != "skipped" else "skipped", "message": ""}
               for t, c in failing.items()}
    runs = [{"busy_core": False, "seconds": 301.4, "returncode": 0, "cases": passing, "tail": []},
            {"busy_core": False, "seconds": 320.0, "returncode": 1, "cases": failing, "tail": []},
            {"busy_core": True, "seconds": 388.6, "returncode": 2, "cases": {}, "tail": ["INTERNALERROR> boom"]}]
    text = suite.format_suite({"runs": runs, "commit": "0123456789abcdef", "torch": "2.13.0+cpu",
                               "tests": ["tests/test_warm.py"]})
    lines = text.splitlines()
    assert lines[0] == ("`pytest tests/test_warm.py` 3 times on fresh clones of 0123456789 (1 beside a busy core), "
                        "torch 2.13.0+cpu")
    assert lines[2].split() == ["1", "no", "4", "0", "0", "1", "301", "0"]
    assert lines[3].split() == ["2", "no", "2", "1", "1", "1", "320", "1"]
    assert lines[4].split() == ["3", "yes", "0", "0", "0", "0", "389", "2"]
    assert "tests/test_launcher.py::test_setup: failed in 1 of 3 runs" in lines
    assert "    run 2: AssertionError: rank 1 fails first" in lines
    assert "run 3 left no report (exit 2); its last lines:" in lines and "    INTERNALERROR> boom" in lines
    assert suite.failures_per_test(runs[:1]) == {}
    clean = suite.format_suite({"runs": runs[:1], "commit": "ab", "torch": "x", "tests": []})
    assert clean.splitlines()[-1] == "no test failed in 1 runs"


def test_the_command_says_what_it_needs(capsys):
    with pytest.raises(SystemExit):
        maintainer_main.main([])
    assert "say what to run: --torch VERSION, --suite N or --notebooks N" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        maintainer_main.main(["--suite", "0"])
    assert "--suite needs N >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        maintainer_main.main(["--notebooks", "2", "--torch", "2.6.0"])
    assert "--torch VERSION --tests notebooks" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        maintainer_main.main(["--download-only"])
    assert "--download-only goes with --torch VERSION alone" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        maintainer_main.main(["--torch", "2.15.0", "--download-only", "--suite", "2"])
    assert "--download-only goes with --torch VERSION alone" in capsys.readouterr().err


@pytest.mark.parametrize("downloaded", ["complete", "complete-but-fails", "half", "none"])
def test_the_venv_installs_from_downloaded_wheels_only_when_the_download_finished(tmp_path, monkeypatch,
                                                                                 downloaded):
    """pip's commands recorded, not run: a finished download installs without the network, the kit last."""
    (tmp_path / "requirements.txt").write_text("torch==2.13.0\nmatplotlib\n-e .\n")
    wheels = pythons.wheels_folder("2.15.0", tmp_path)
    if downloaded != "none":
        wheels.mkdir()
        (wheels / "torch-2.15.0-cp311-none-linux_x86_64.whl").write_bytes(b"")
    if downloaded.startswith("complete"):
        (wheels / pythons.COMPLETE).write_text("torch==2.15.0\nmatplotlib\n")
    commands, installed = [], []

    def run(cmd, **kwargs):
        cmd = [str(c) for c in cmd]
        if "-r" in cmd:  # the requirements come on stdin
            cmd.append("FILE:" + ",".join(kwargs["input"].split()))
        commands.append(cmd)
        if downloaded == "complete-but-fails" and "--no-index" in cmd:
            return pythons.subprocess.CompletedProcess(cmd, 1)  # a wheel missing, say: pip exits 1
        if cmd[1:4] == ["-m", "pip", "install"]:
            installed.append(True)
        return pythons.subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(pythons.subprocess, "run", run)
    monkeypatch.setattr(pythons, "torch_in", lambda python: "2.15.0+cu132" if installed else None)
    pythons.torch_venv("2.15.0", tmp_path, echo=lambda *_: None)
    pips = [c[c.index("pip"):] for c in commands if "pip" in c]
    if downloaded == "complete":
        assert pips[0][:5] == ["pip", "install", "--quiet", "--no-index", "--find-links"]
        assert pips[0][5] == str(wheels) and pips[0][-1] == "FILE:torch==2.15.0,matplotlib"  # no "-e ."
        assert pips[1] == ["pip", "install", "--quiet", "--no-deps", "-e", str(tmp_path)]
        assert not wheels.exists()  # a download cache only
    elif downloaded == "complete-but-fails":  # then from the registry, as without a download
        assert pips[0][3] == "--no-index" and len(pips) == 2
        assert pips[1] == ["pip", "install", "--quiet", "-r", pips[1][4], "FILE:torch==2.15.0,matplotlib,-e,."]
    else:
        assert pips == [["pip", "install", "--quiet", "-r", pips[0][4], "FILE:torch==2.15.0,matplotlib,-e,."]]
        assert wheels.exists() == (downloaded == "half")


def test_a_run_of_many_shows_only_pytests_progress_lines_each_after_its_run(tmp_path, capsys):
    # A stand-in for the venv's python: it prints what pytest prints, and writes no report.
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho '============ test session starts ============'\necho 'collected 3 items'\n"
                    "echo '..F                                  [ 66%]'\necho '.                                    [100%]'\n"
                    "echo 'FAILED tests/test_x.py::test_y - AssertionError'\necho '1 failed, 3 passed in 2.00s'\n"
                    "exit 1\n")
    fake.chmod(0o755)
    result = suite.run_tests(fake, tmp_path, echo=False, progress="run 2/6: ")
    assert capsys.readouterr().out.splitlines() == ["run 2/6: ..F                                  [ 66%]",
                                                    "run 2/6: .                                    [100%]"]
    assert result["returncode"] == 1 and result["summary"] == "1 failed, 3 passed in 2.00s" and result["cases"] == {}
    suite.run_tests(fake, tmp_path, echo=False)  # neither: nothing printed
    assert capsys.readouterr().out == ""


def test_a_python_that_is_not_there_is_named():
    with pytest.raises(SystemExit, match=r"no Python 2\.99 found"):
        pythons.base_python("2.99")
    assert pythons.base_python(f"{sys.version_info[0]}.{sys.version_info[1]}").exists()


def test_a_python_on_path_is_asked_its_version_so_pyenv_s_shim_for_an_unselected_one_is_passed_over(
        tmp_path, monkeypatch):
    shim = tmp_path / "python3.77"
    shim.write_text("#!/bin/sh\necho 'pyenv: python3.77: command not found' >&2\nexit 127\n")
    shim.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    with pytest.raises(SystemExit, match=r"no Python 3\.77 found"):
        pythons.base_python("3.77")
    shim.write_text("#!/bin/sh\necho 3 77 1\n")
    assert pythons.base_python("3.77") == shim
    assert pythons.base_python("3.77.1") == shim
    with pytest.raises(SystemExit, match=r"no Python 3\.77\.2 found"):
        pythons.base_python("3.77.2")


def test_record_writes_what_a_command_printed_into_its_own_section(tmp_path, capsys):
    measured = tmp_path / "measured.md"
    measured.write_text("# Measured\n\nwritten by hand\n")
    with record.recording(str(measured), ["ddp_tutorial.bench", "--quick", "--record", "X"]):
        print("first table")
    assert "first table" in capsys.readouterr().out  # printed as usual too
    record.record(measured, ["ddp_tutorial.maintainer", "--suite", "1"], "suite table\n")
    record.record(measured, ["ddp_tutorial.bench", "--quick", "--record=X"], "second table\n")
    text = measured.read_text()
    assert text.startswith("# Measured\n\nwritten by hand\n")
    assert text.count("### `python -m ddp_tutorial.bench --quick`") == 1  # replaced, not added
    assert "second table" in text and "first table" not in text and "suite table" in text
    assert text.index("bench --quick") < text.index("maintainer --suite 1")  # in its place
    assert f"commit {record.commit()}" in text
