"""Rank 0 hosts the rendezvous store on the loopback socket ``launch`` bound, once the script has
imported torch; every rank's env:// joins it (TORCHELASTIC_USE_AGENT_STORE=True), as torchrun's
ranks join their agent's: no store listens on other interfaces."""

import contextlib
import importlib.util
import os
import signal
import sys

from ddp_tutorial import envvars

#: Rank 0's store (kept alive until the process exits), and its end of the peers socket.
_STORE = []
_PEERS = []


def store_socket(spec: str):
    """(descriptor, port) of the store's socket: ``spec`` ``fd:N``, the socket ``launch`` bound,
    or ``bind``: bind MASTER_ADDR:MASTER_PORT here (OSError if taken)."""
    import socket  # rank 0 only

    if spec.startswith("fd:"):
        sock = socket.socket(fileno=int(spec[3:]))
    else:
        address = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
        try:  # SO_REUSEADDR, as TCPStore sets it: an earlier run's TIME_WAIT does not block
            sock = socket.create_server(address, backlog=socket.SOMAXCONN)
        except OSError as exc:
            msg = f"rank 0 cannot host the rendezvous store: {exc.strerror}"
            raise OSError(exc.errno, msg) from None
    port = sock.getsockname()[1]
    fd = sock.detach()
    os.set_inheritable(fd, False)  # the store's, not for processes the script starts
    return fd, port


def host_store(fd: int, port: int) -> None:
    """Host the store on the listening socket ``fd`` for the rest of this process (the libuv
    server takes one from torch 2.8 on: pytorch/pytorch#150215)."""
    import datetime

    from torch.distributed import TCPStore

    _STORE.append(TCPStore(os.environ["MASTER_ADDR"], port, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(minutes=30), master_listen_fd=fd))


class _AfterTorchImport:
    """A ``sys.meta_path`` finder that runs ``callback`` right after ``import torch`` finished."""

    def __init__(self, callback):
        self.callback = callback

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torch":
            return None
        sys.meta_path.remove(self)  # once: the usual finders find torch
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            exec_module = spec.loader.exec_module
            spec.loader.exec_module = lambda module: (exec_module(module), self.callback())
        return spec


def prepare_store() -> None:
    """Rank 0 under ``launch``: take the store's socket now, host the store once torch is in."""
    spec = os.environ.pop(envvars.STORE, None)  # the script's children must not see it
    peers = os.environ.pop(envvars.PEERS_FD, None)
    if peers is not None:
        os.set_inheritable(int(peers), False)
        _PEERS.append(int(peers))
    if spec in (None, "", "join"):
        return
    try:
        fd, port = store_socket(spec)
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        os._exit(1)
    if "torch" in sys.modules:  # a warm rank: torch is in already
        host_store(fd, port)
    else:
        sys.meta_path.insert(0, _AfterTorchImport(lambda: host_store(fd, port)))


def keep_store_until_peers_exit() -> None:
    """Rank 0, its script done and successful: keep the store until the others exited, as
    torchrun's agent keeps it for the whole run. One byte tells ``launch`` the script is done;
    ``launch`` closes the other end once the other ranks exited. Stopped meanwhile, it exits 0."""
    if not (_STORE and _PEERS):
        return
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    with contextlib.suppress(OSError):
        os.write(_PEERS[0], b"0")
        os.read(_PEERS[0], 1)  # end-of-file: the others are gone
