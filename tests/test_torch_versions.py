"""The torch a learner already has: the range checked at import."""

import subprocess
import sys
from pathlib import Path

import pytest

from ddp_tutorial import torch_version

ROOT = Path(__file__).resolve().parents[1]


def import_with_torch(tmp_path, version: str, cuda: str = "None"):
    """``import ddp_tutorial`` in a new interpreter whose ``import torch`` would load a fake torch ``version``."""
    fake = tmp_path / f"fake-{version}" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise RuntimeError('the check must not import torch')\n")
    (fake / "version.py").write_text(f"__version__ = '{version}'\ncuda: Optional[str] = {cuda}\n")
    code = "import ddp_tutorial; print(ddp_tutorial.torch_version.versions_line())"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{fake.parent}:{ROOT}"})


@pytest.mark.parametrize("version", ["2.8.0", "2.6.0+cu124", "1.13.0"])
def test_an_older_torch_is_refused_at_import_in_one_line_naming_it_and_the_fix(tmp_path, version):
    out = import_with_torch(tmp_path, version)
    assert out.returncode == 1 and out.stdout == ""
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: ddp_tutorial needs torch >= 2.9, but found torch " + version), last
    assert last.endswith(": pip install 'torch>=2.9,<2.16'"), last
    assert str(tmp_path) in last  # where that torch is: a learner may have two


def test_a_newer_torch_is_named_in_one_line_and_the_kit_still_imports(tmp_path):
    out = import_with_torch(tmp_path, "2.99.0", cuda="'13.0'")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith("torch 2.99.0 (CUDA 13.0 build), Python ")
    [line] = out.stderr.strip().splitlines()
    assert "torch 2.99.0 is newer than the newest tested (2.15)" in line
    assert "python -m ddp_tutorial.maintainer --torch 2.99.0" in line


@pytest.mark.parametrize("version", ["2.9.0", "2.13.0+cpu", "2.15.0"])
def test_a_torch_in_the_range_imports_without_a_word(tmp_path, version):
    out = import_with_torch(tmp_path, version)
    assert (out.returncode, out.stderr) == (0, "")
    assert out.stdout.startswith(f"torch {version} (CPU only), Python ")


def test_the_range_stated_in_pyproject_and_readme_is_the_one_checked():
    floor = ".".join(map(str, torch_version.FLOOR))
    newest = ".".join(map(str, torch_version.NEWEST_TESTED))
    assert f'"torch>={floor}"' in (ROOT / "pyproject.toml").read_text()  # no upper cap: newer is warned, not refused
    readme = (ROOT / "README.md").read_text()
    assert f"torch {floor} to {newest}" in readme
    assert torch_version.refusal("2.8.9", "/x") and not torch_version.refusal(f"{floor}.0", "/x")
    assert torch_version.refusal(None, None).startswith("ddp_tutorial needs torch >= 2.9, but none is installed")
    assert torch_version.parse("2.10.0a0+git123") == (2, 10) and torch_version.parse("nightly") is None
