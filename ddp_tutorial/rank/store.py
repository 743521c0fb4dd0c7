"""Rank 0 hosts the rendezvous store on the loopback socket ``launch`` bound; every rank joins it.

Under ``launch`` (DDP_TUTORIAL_STORE): ``fd:N``, the listening socket ``launch`` bound on
127.0.0.1 and passed down; ``bind``, bind MASTER_ADDR:MASTER_PORT here (a fixed ``master_port``);
``join`` for the other ranks. The store starts as soon as the script has imported torch, so a
script that never imports it pays nothing; every rank's env:// joins it as a client
(TORCHELASTIC_USE_AGENT_STORE=True), as torchrun's ranks join their agent's store, so no store
listens on other interfaces. Standard library only until torch is in.
"""

import os
import sys

from ddp_tutorial import envvars

#: Keeps rank 0's store (and so its server) alive until the process exits.
_STORE = []
#: Rank 0's end of the socket that reads end-of-file once every other rank has exited.
_PEERS = []


def store_socket(spec: str):
    """(descriptor, port) of the store's listening socket for ``spec`` (``fd:N`` or ``bind``).

    Raises:
        OSError: ``bind``, and MASTER_ADDR:MASTER_PORT is taken (EADDRINUSE) or not allowed.
    """
    import socket  # rank 0 only: the other ranks start without it

    if spec.startswith("fd:"):
        sock = socket.socket(fileno=int(spec[3:]))
    else:
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        # As TCPStore does: connections of an earlier run lingering in TIME_WAIT do not block.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
            sock.listen(socket.SOMAXCONN)
        except OSError as exc:
            sock.close()
            raise OSError(exc.errno, f"rank 0 cannot host the rendezvous store on {host}:{port}: "
                                     f"{exc.strerror}") from None
    port = sock.getsockname()[1]
    fd = sock.detach()
    os.set_inheritable(fd, False)  # the store's, not for processes the script starts
    return fd, port


def host_store(fd: int, port: int) -> None:
    """Host the rendezvous store on the listening socket ``fd`` for the rest of this process.

    The store's default server (libuv, from torch 2.4 on) takes a listening socket only
    from torch 2.8 on; before, it refuses with NotImplementedError before touching ``fd``,
    and the classic server (``use_libuv=False``), which always could, hosts it instead.
    What the installed torch does decides, not its version string. Clients are the same
    for both servers: the other ranks join either.
    """
    import datetime

    from torch.distributed import TCPStore

    args = (os.environ["MASTER_ADDR"], port, None, True, datetime.timedelta(minutes=30))
    # The refusal also logs an error line to stderr (C10D_ERROR) that would land in rank 0's
    # output on every launch: stderr points at /dev/null for this one call, the exception keeps the text.
    stderr, quiet = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(quiet, 2)
    try:
        store = TCPStore(*args, wait_for_workers=False, master_listen_fd=fd)
    except NotImplementedError:
        store = None
    finally:
        os.dup2(stderr, 2)
        os.close(stderr)
        os.close(quiet)
    if store is None:
        store = TCPStore(*args, wait_for_workers=False, master_listen_fd=fd, use_libuv=False)
    _STORE.append(store)


class _AfterTorchImport:
    """A ``sys.meta_path`` finder that runs ``callback`` right after ``import torch`` has finished.

    (Not an ``importlib.abc.MetaPathFinder``: importing that module costs a worker 0.1 s.)
    """

    def __init__(self, callback):
        self.callback = callback

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torch":
            return None
        sys.meta_path.remove(self)  # once, and let the usual finders find torch
        spec = next(filter(None, (getattr(f, "find_spec", lambda *a: None)(fullname, path, target)
                                  for f in sys.meta_path)), None)
        if spec is None or spec.loader is None:
            return spec
        exec_module, callback = spec.loader.exec_module, self.callback

        def exec_then_call(module):
            exec_module(module)
            callback()

        spec.loader.exec_module = exec_then_call
        return spec


def prepare_store() -> None:
    """Under ``launch``: rank 0 takes the store's socket now, and hosts the store once torch is in."""
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
    """Rank 0, its script done and successful: keep the store it hosts until every other rank has exited.

    torchrun's agent hosts its ranks' store for the whole run, so a rank that finishes first never
    takes the store from a peer still joining or leaving the group. Here rank 0 hosts it, and so
    stays: it tells ``launch`` its script is done (one byte, so it does not count as still running),
    then waits until ``launch`` closes the other end, once the other ranks have exited. If ``launch``
    stops it meanwhile (another rank failed), it exits 0 all the same: its script succeeded.
    """
    if not (_STORE and _PEERS):
        return
    import signal

    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    try:
        os.write(_PEERS[0], b"0")
        os.read(_PEERS[0], 1)  # end-of-file: the others are gone
    except OSError:
        pass
