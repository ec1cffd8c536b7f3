"""Exec a command with ``PR_SET_PDEATHSIG`` set, so it gets SIGTERM when its parent dies.

Usage: ``python -m rlsdk.launch.pdeathsig COMMAND [ARGS...]``. The setting survives ``execve`` (Linux), so the
``accelerate launch`` process started through this wrapper dies with the controller even when the controller is
SIGKILLed, and torchrun then takes its ranks down.
"""

from __future__ import annotations

import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def set_parent_death_signal(sig: int = signal.SIGTERM) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent exits. Linux only; returns success."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit("usage: python -m rlsdk.launch.pdeathsig COMMAND [ARGS...]")
    parent = os.getppid()
    set_parent_death_signal()
    if os.getppid() != parent:  # the parent died before prctl took effect
        raise SystemExit(1)
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main(sys.argv[1:])
