"""The network side of a launch: loopback only, and a port no one can take first.

``launch`` binds the rendezvous store's socket on 127.0.0.1 itself (``listen_socket``)
and hands it to rank 0, whose bootstrap hosts the store on it; gloo and nccl are
pinned to the loopback interface (``loopback_interface``). Standard library only.
"""

from __future__ import annotations

import random
import socket
from typing import Optional

import psutil

LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK) -> int:
    """A port that is free right now, chosen at random outside the OS's ephemeral range.

    For a server you start yourself (e.g. a torchrun rendezvous endpoint): ports the OS hands
    out for outgoing connections (gloo opens many) come from the ephemeral range, and one of
    them could take a port picked from there first. ``launch`` needs none of this: it binds
    its store's socket itself (``listen_socket``) and hands it to rank 0.
    """
    with listen_socket(host) as sock:
        return sock.getsockname()[1]


def candidate_ports(tries: int = 100):
    """Up to ``tries`` random ports outside the ephemeral range: below it from 20000 up (clear of
    well-known services) if that leaves 1000 ports, else above it, else from 1024 up, else none."""
    low, high = ephemeral_range()
    room = [(a, b) for a, b in ((20000, low), (high + 1, 65536), (1024, low)) if b - a >= 1000]
    rng = random.SystemRandom()  # concurrent launches must not share a sequence
    for _ in range(tries if room else 0):
        yield rng.randrange(*room[0])


#: IANA's ephemeral range, macOS's default (sysctl net.inet.ip.portrange.first/last), and Windows'.
IANA_EPHEMERAL = (49152, 65535)


def ephemeral_range():
    """The OS's range for outgoing connections' ports, ``(low, high)`` inclusive.

    Linux keeps it in a kernel setting (a file, Linux only: its default is 32768-60999); every other
    OS, and a Linux where the file cannot be read, gets IANA's range.
    """
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", "rb") as f:  # Linux only, with the fallback below
            low, high = (int(v) for v in f.read().split())
        return low, high
    except (OSError, ValueError):
        return IANA_EPHEMERAL


def listen_socket(host: str = LOOPBACK) -> socket.socket:
    """A TCP socket listening on ``host`` (127.0.0.1) at a free port: the store's, for rank 0.

    Bound before any rank starts, so no other program can take the port in
    between, and ranks that connect before rank 0 hosts the store wait in the
    backlog instead of being refused and backing off. The port is outside the
    ephemeral range, and SO_REUSEADDR is set as TCPStore sets it, so once the
    run ends the port can be listened on again (no outgoing connection takes it,
    and the store's closed connections in TIME_WAIT do not block it).
    """
    for port in [*candidate_ports(), 0]:  # 0: the OS picks, if the range leaves no room
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(socket.SOMAXCONN)
            return sock
        except OSError:
            sock.close()
            if port == 0:  # the last try: nothing was free
                raise


def loopback_interface() -> Optional[str]:
    """The name of this machine's loopback network interface (``lo`` on Linux, ``lo0`` on macOS), or None.

    gloo otherwise picks its interface from the host name, which on a Mac is an mDNS ``.local``
    name that often does not resolve.
    """
    try:
        stats = psutil.net_if_stats()
    except (OSError, psutil.Error):
        stats = {}
    for name, st in stats.items():
        if "loopback" in getattr(st, "flags", "").split(","):
            return name
    return next((n for n in stats if n in ("lo", "lo0")), None)
