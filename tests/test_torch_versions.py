"""The torch a learner already has: the range checked at import, and the store on older torch."""

import json
import os
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
    assert torch_version.refusal(None, None).startswith("ddp_tutorial needs torch >= 2.9, and none is installed")
    assert torch_version.parse("2.10.0a0+git123") == (2, 10) and torch_version.parse("nightly") is None


#: torch 2.4-2.7 as far as the store goes: the default (libuv) server refuses a listening socket.
OLD_STORE = '''
import json, os, socket, sys
import torch.distributed as dist
from ddp_tutorial.rank import store
calls, TCPStore = [], dist.TCPStore

def old_tcp_store(*args, **kwargs):
    calls.append(kwargs.get("use_libuv", "default"))
    if kwargs.get("master_listen_fd") is not None and kwargs.get("use_libuv", True):
        os.write(2, b"[c10d] logged by the refusal\\n")  # as C10D_ERROR does, before it throws
        raise NotImplementedError("The libuv TCPStore backend does not support initialization with an listen fd.")
    return TCPStore(*args, **kwargs)

dist.TCPStore = old_tcp_store
sock = socket.socket()
sock.bind(("127.0.0.1", 0))
sock.listen()
port = sock.getsockname()[1]
os.environ["MASTER_ADDR"] = "127.0.0.1"
store.host_store(sock.detach(), port)
client = TCPStore("127.0.0.1", port, None, False, wait_for_workers=False)
client.set("key", "from a client")
print(json.dumps({"calls": calls, "read": store._STORE[0].get("key").decode(),
                  "libuv": store._STORE[0].libuvBackend}))
'''


def test_where_the_default_store_refuses_a_listening_socket_the_classic_one_hosts_it_and_clients_join(tmp_path):
    script = tmp_path / "old_store.py"
    script.write_text(OLD_STORE)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert "logged by the refusal" not in out.stderr  # it would open rank 0's output on every launch
    got = json.loads(out.stdout.splitlines()[-1])
    assert got == {"calls": ["default", False], "read": "from a client", "libuv": False}
