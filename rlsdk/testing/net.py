"""What a run listens on: the listening sockets of a process tree, for tests of the threat model (docs/security.md).

``tree_listeners(pid)`` lists every TCP/UDP socket in the LISTEN state (and every bound UDP socket) of ``pid`` and
all its descendants, with the process that owns it; ``not_loopback(listeners)`` keeps those another machine could
reach. A test starts a run, then asserts on both, e.g. that the controller has no TCP listener at all and that
whatever remains (gloo's transport) is bound to loopback. It works for any run: the embedded engine, or a vLLM
server started as a child of the controller.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass

__all__ = ["Listener", "not_loopback", "tree_listeners"]


@dataclass(frozen=True)
class Listener:
    """One listening (or bound UDP) socket of a process."""

    pid: int
    process: str
    """The process's command line, shortened (for messages)."""
    kind: str
    """``"tcp"`` or ``"udp"``."""
    address: str
    port: int

    @property
    def loopback(self) -> bool:
        """Whether only this machine can reach it (127.0.0.0/8, ::1, or an IPv4-mapped loopback address)."""
        try:
            ip = ipaddress.ip_address(self.address.split("%", 1)[0])
        except ValueError:
            return False
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return ip.is_loopback

    def __str__(self) -> str:
        return f"{self.kind} {self.address}:{self.port} (pid {self.pid}: {self.process})"


def tree_listeners(pid: int) -> list[Listener]:
    """The listening TCP sockets and bound UDP sockets of ``pid`` and all its live descendants.

    Processes that exit while they are inspected are skipped. Needs permission to read the processes' sockets
    (the same user, or root).

    Raises:
        psutil.NoSuchProcess: ``pid`` does not exist.
    """
    import psutil

    root = psutil.Process(pid)
    out: list[Listener] = []
    for process in [root, *root.children(recursive=True)]:
        try:
            command = " ".join(process.cmdline())[:120]
            connections = process.net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        for conn in connections:
            if not conn.laddr:
                continue
            is_tcp = conn.type == socket.SOCK_STREAM
            if is_tcp and conn.status != psutil.CONN_LISTEN:
                continue
            if not is_tcp and conn.raddr:
                continue  # a connected UDP socket only talks to its peer
            out.append(Listener(process.pid, command, "tcp" if is_tcp else "udp", conn.laddr.ip, conn.laddr.port))
    return out


def not_loopback(listeners: list[Listener]) -> list[Listener]:
    """The listeners another machine could reach (bound to a non-loopback or a wildcard address)."""
    return [listener for listener in listeners if not listener.loopback]
