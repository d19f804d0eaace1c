"""Whether something answers at an address: the one probe behind the checks that a cluster, a
tracking server or a database is there before a run starts (their own clients retry for minutes)."""

from __future__ import annotations

import socket

CONNECT_TIMEOUT_S = 10  # a service that has not taken a connection by then is not there


def no_answer(host: str, port: int) -> str | None:
    """Why nothing took a TCP connection at ``host:port`` within ``CONNECT_TIMEOUT_S``; None if it did."""
    try:
        socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S).close()
    except (OSError, ValueError) as err:  # ValueError: a port out of range
        return getattr(err, "strerror", None) or str(err)
    return None
