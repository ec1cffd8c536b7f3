"""Rendezvous of the train ranks on one machine through files in the session's private runtime directory.

``accelerate launch`` starts the ranks through torchrun, whose default ("static") rendezvous opens a ``TCPStore`` in
the launcher process: it listens on every interface (torch's store cannot bind one), takes no credentials, and the
ranks then meet through it (``env://``). Anyone who can reach the port can read and write its keys: hand the ranks
the address of a shared-memory segment, break the rendezvous, or learn the gloo addresses. On one machine nothing
needs a port for this, so rlsdk replaces that store with files in the Session's 0700 runtime directory:

- The launcher (torchrun's agent) uses :class:`FileRendezvousHandler`, registered under :data:`BACKEND` with
  torch's public ``rendezvous_handler_registry`` by ``python -m rlsdk.launch.accelerate_entry`` (which then runs
  ``accelerate launch``, here with ``--rdzv_backend rlsdk-file``): a ``FileStore`` in ``$RLSDK_RENDEZVOUS_DIR``.
- Each rank builds its default process group on another ``FileStore`` there (:func:`rank_store`), never ``env://``.
- Gloo's transport is bound to the loopback interface (:func:`loopback_interface`, ``GLOO_SOCKET_IFNAME``).

No other user can open a file in that directory. Several machines (the slurm and ray schedulers) keep torchrun's
static rendezvous: the store of machine rank 0 listens on ``launch.main_process_port`` for the other machines,
inside the job's network (docs/security.md says what that exposes).
"""

from __future__ import annotations

import datetime
import os
from typing import Any

BACKEND = "rlsdk-file"
"""The ``--rdzv_backend`` name of :class:`FileRendezvousHandler`."""
RLSDK_RENDEZVOUS_DIR = "RLSDK_RENDEZVOUS_DIR"
"""Environment variable naming the private directory that holds the rendezvous files (the Session's runtime
directory); unset = torch's ``env://`` rendezvous (several machines)."""
_AGENT_STORE = "rendezvous-agents"
_RANK_STORE = "rendezvous-ranks"


def _directory() -> str:
    directory = os.environ.get(RLSDK_RENDEZVOUS_DIR, "")
    if not directory:
        raise RuntimeError(f"{RLSDK_RENDEZVOUS_DIR} is not set: this process was not started by an rlsdk Session")
    from rlsdk.control.controller import check_private_dir

    check_private_dir(directory)  # never a store another user could have placed or can read
    return directory


class FileRendezvousHandler:
    """torchrun's rendezvous for the one machine of a run: a ``FileStore`` in the private runtime directory.

    Implements ``torch.distributed.elastic.rendezvous.RendezvousHandler`` (the agent calls exactly these methods).
    No bootstrap TCP store exists: the ranks build their group on :func:`rank_store`, so ``use_agent_store`` is
    false and the ``MASTER_ADDR``/``MASTER_PORT`` torchrun still exports are loopback and unused.
    """

    def __init__(self, run_id: str, timeout_s: float) -> None:
        self._run_id = run_id
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._store: Any = None
        self._closed = False

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return False

    def next_rendezvous(self) -> Any:
        import torch.distributed as dist
        from torch.distributed.elastic.rendezvous import RendezvousInfo, RendezvousStoreInfo

        if self._store is None:
            store = dist.FileStore(os.path.join(_directory(), _AGENT_STORE), 1)
            store.set_timeout(self._timeout)
            self._store = dist.PrefixStore(self._run_id, store)
        return RendezvousInfo(self._store, 0, 1, RendezvousStoreInfo("127.0.0.1", 0))

    def is_closed(self) -> bool:
        return self._closed

    def set_closed(self) -> None:
        self._closed = True

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return self._run_id

    def shutdown(self) -> bool:
        return True


def create_handler(params: Any) -> FileRendezvousHandler:
    """The registry's creator: ``params`` is torch's ``RendezvousParameters``; one machine only.

    Raises:
        ValueError: more than one machine (``--num_machines``) asks for this rendezvous.
    """
    if params.max_nodes != 1:
        raise ValueError(
            f"rendezvous backend {BACKEND!r} serves one machine; {params.max_nodes} machines need the static "
            "rendezvous of torchrun"
        )
    return FileRendezvousHandler(params.run_id, float(params.config.get("timeout", 600)))


def register() -> None:
    """Register :data:`BACKEND` with torch's rendezvous registry (in the launcher process; idempotent)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(BACKEND, create_handler)


def rank_store(world_size: int, timeout: datetime.timedelta | None = None) -> Any:
    """The store the ranks build their default process group on: a ``FileStore`` in ``$RLSDK_RENDEZVOUS_DIR``,
    or ``None`` when that is unset (torch's ``env://``).

    Raises:
        ControlError: the directory is not a private directory of this user.
    """
    if not os.environ.get(RLSDK_RENDEZVOUS_DIR):
        return None
    import torch.distributed as dist

    store = dist.FileStore(os.path.join(_directory(), _RANK_STORE), world_size)
    if timeout is not None:
        store.set_timeout(timeout)
    return store


def loopback_interface() -> str | None:
    """The name of the network interface holding 127.0.0.1 (``lo`` on Linux), for ``GLOO_SOCKET_IFNAME``; None
    when there is none (gloo then binds what the hostname resolves to)."""
    import socket

    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(address.family == socket.AF_INET and address.address == "127.0.0.1" for address in addresses):
            return name
    return None


def control_host(launch: Any) -> str | None:
    """The TCP host the control channel binds for ``launch`` (a ``LaunchConfig``), or ``None`` for a Unix socket in
    the Session's runtime directory: TCP (with CURVE) only where ranks may run on other machines (scheduler 'slurm'
    or 'ray') or the user asked for it (``launch.allow_remote``)."""
    if launch.scheduler != "local" or launch.allow_remote:
        return str(launch.host)
    return None


def one_machine_environment(directory: str) -> dict[str, str]:
    """Environment for ranks that all run on this machine: rendezvous files in ``directory`` (a private runtime
    directory) and gloo bound to the loopback interface."""
    env = {RLSDK_RENDEZVOUS_DIR: directory}
    interface = loopback_interface()
    if interface is not None:
        env["GLOO_SOCKET_IFNAME"] = interface
    return env
