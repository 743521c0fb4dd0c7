"""The tests' two changes: $DDP_TUTORIAL_MY_WORK points at a temporary folder, and notebook kernels
talk over Unix sockets.

``pyproject.toml`` loads this plugin for every ``pytest`` run; kernels inherit the environment, so
``exercises.start`` and ``check`` write there, not into ``notebooks/my_work/``, until the run ends.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from ddp_tutorial.envvars import MY_WORK

_made = []


def pytest_configure(config) -> None:
    if not os.environ.get(MY_WORK):  # one set by whoever runs pytest is theirs to keep
        _made.append(tempfile.mkdtemp(prefix="ddp-tutorial-my-work-"))
        os.environ[MY_WORK] = _made[-1]
    kernels_on_unix_sockets()


def pytest_unconfigure(config) -> None:
    while _made:
        os.environ.pop(MY_WORK, None)
        shutil.rmtree(_made.pop(), ignore_errors=True)


def kernels_on_unix_sockets() -> None:
    """Kernels started in the tests talk over Unix sockets (jupyter_client's ``ipc`` transport)
    where zmq has them.

    Over TCP, jupyter_client picks five free ports, closes them and starts the kernel, which binds
    each once (ipykernel's ``_bind_socket``: one attempt for a given port). Meanwhile the suite's
    ranks open loopback connections, each on an ephemeral port; one that took a kernel's port killed
    it at start in CI ("Kernel didn't respond in 60 seconds": its iopub port). A Unix socket is a
    file with a name of its own: nothing to take."""
    import zmq
    if os.name != "posix" or not zmq.has("ipc"):
        return
    import uuid

    import jupyter_client
    from jupyter_core.paths import jupyter_runtime_dir
    from traitlets import default

    class UnixSocketKernelManager(jupyter_client.AsyncKernelManager):
        @default("transport")
        def _unix_sockets(self):
            return "ipc"

        @default("ip")
        def _absolute_path(self):
            # jupyter_client's default, "kernel-ipc", is relative to each process's working folder,
            # and the kernel starts in the notebook's folder, not the client's.
            os.makedirs(jupyter_runtime_dir(), exist_ok=True)
            return os.path.join(jupyter_runtime_dir(), f"kernel-{uuid.uuid4().hex[:16]}-ipc")

    # nbclient's NotebookClient (nbmake's, and nbconvert's ExecutePreprocessor in teacher/render.py)
    # takes this name from jupyter_client when it starts a kernel (its _kernel_manager_class_default).
    jupyter_client.AsyncKernelManager = UnixSocketKernelManager
