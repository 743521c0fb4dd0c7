"""Loopback only, and a port no one can take first: ``launch`` binds the store's socket on
127.0.0.1 and hands it to rank 0, which hosts the store on it; gloo and nccl stay on loopback."""

from __future__ import annotations

import random
import socket
from typing import List, Optional

import psutil

LOOPBACK = "127.0.0.1"
#: Below every common ephemeral range (Linux 32768-60999; macOS, Windows, IANA 49152-65535), so no
#: outgoing connection (gloo opens many) gets one, and above most machines' registered services.
PORTS = range(20000, 32768)


def candidate_ports() -> List[int]:
    """100 random ports from ``PORTS`` (``SystemRandom``: concurrent launches share no sequence)."""
    return random.SystemRandom().sample(PORTS, 100)


def listen_socket(host: str = LOOPBACK) -> socket.socket:
    """A TCP socket listening on ``host`` at a free port from ``PORTS`` (else one the OS picks).
    Bound before any rank starts: no one takes the port in between, and ranks that connect before
    rank 0 hosts the store wait in the backlog. SO_REUSEADDR (create_server) as TCPStore sets it."""
    for port in [*candidate_ports(), 0]:
        try:
            return socket.create_server((host, port), backlog=socket.SOMAXCONN)
        except OSError:
            if port == 0:  # the last try: nothing was free
                raise


def free_port(host: str = LOOPBACK) -> int:
    """A port free right now, from ``PORTS``, for a server you start yourself (torchrun's
    rendezvous endpoint); ``launch`` needs none."""
    with listen_socket(host) as sock:
        return sock.getsockname()[1]


def loopback_interface() -> Optional[str]:
    """The loopback interface (``lo``, ``lo0`` on macOS), or None. gloo otherwise picks one from
    the host name, which on a Mac is an mDNS name that may not resolve."""
    try:
        stats = psutil.net_if_stats()
    except (OSError, psutil.Error):
        stats = {}
    for name, st in stats.items():
        if "loopback" in getattr(st, "flags", "").split(","):
            return name
    return next((n for n in stats if n in ("lo", "lo0")), None)
