"""How published trainer weights reach a vLLM server: a small interface with a CPU (file) and two GPU paths.

CPU (:class:`FileWeightTransfer`): the trainer publishes weights with ``TrainEngine.export_weights`` (a safetensors
file under ``/dev/shm`` on this machine) and every server worker reads that file. GPU (:class:`NcclWeightTransfer`):
trainer rank 0 broadcasts its tensors over NCCL into every server worker (the rank and worker halves are in
:mod:`rlsdk.engine.inference.nccl_sync`); on a card the server shares with the rank (:class:`IpcWeightTransfer`),
rank 0 hands the worker a CUDA IPC handle of its packed weights (:mod:`rlsdk.engine.inference.ipc_sync`). Either
way a transfer reports the checksum of what the server loaded, and the engine brackets every push with pause/resume
and the version update; a transfer only moves bytes.
:func:`select_weight_transfer` picks one from the launch topology.

This module imports neither torch's CUDA parts nor vLLM: the controller builds transfers on any machine.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

from rlsdk.engine.inference.worker_results import CollectiveRpc, check_worker_results
from rlsdk.versioning import WeightMismatchError

if TYPE_CHECKING:
    from rlsdk.config import LaunchConfig
    from rlsdk.engine.inference.inplace_transfer import InPlaceWeightTransfer

# VLLMConfig.weight_transfer (inference.vllm.weight_transfer)
WeightTransferChoice = Literal["auto", "reload", "inplace"]


class WeightTransfer(Protocol):
    """Moves a published weight file into every worker of a vLLM server."""

    name: str

    def server_args(self) -> Sequence[str]:
        """Extra server command-line arguments the transfer needs (e.g. a worker extension)."""
        ...

    async def push(self, rpc: CollectiveRpc, path: str, version: int, timeout_s: float) -> dict[str, Any]:
        """Load the weights published at ``path`` into the served model; return the first worker's result
        (``checksum`` of the loaded state dict, ``bytes``, timings). Raises on any worker's failure."""
        ...


class FileWeightTransfer:
    """CPU path: each server worker reads the published safetensors file itself (shared memory, same host).

    The worker extension (:mod:`rlsdk.engine.inference.vllm_worker`) reads the file, checksums it under the
    trainer's names and calls vLLM's ``reload_weights(weights_iterator=...)``. Needs the file on a filesystem
    the server can read (``/dev/shm`` or the output root on the same machine).
    """

    name = "file"
    SERVER_ARGS: tuple[str, ...] = ()

    def server_args(self) -> Sequence[str]:
        return self.SERVER_ARGS

    async def push(self, rpc: CollectiveRpc, path: str, version: int, timeout_s: float) -> dict[str, Any]:
        results = await rpc("rlsdk_load_weights", {"path": path}, timeout_s)
        return check_worker_results("rlsdk_load_weights", version, results)


NCCL_WORKER_EXTENSION = "rlsdk.engine.inference.nccl_sync.NcclWeightSyncExtension"

# The rank command (rlsdk.worker) that runs trainer rank 0's half of the GPU path.
NCCL_RANK_COMMAND = "broadcast_weights_nccl"


class WeightSyncTimeoutError(TimeoutError):
    """A side of an NCCL weight sync did not finish in time (a peer died or never joined)."""


@dataclass(frozen=True)
class NcclRendezvous:
    """Where the trainer<->workers NCCL group meets: trainer rank 0's host and a free port there, and its size.

    ``world_size`` = 1 (trainer rank 0) + every vLLM worker of every replica
    (``inference_replicas x inference_tensor_parallel_size``).
    """

    master_address: str
    master_port: int
    world_size: int

    def __post_init__(self) -> None:
        if self.world_size < 2:
            raise ValueError(f"world_size {self.world_size}: needs the trainer plus at least one vLLM worker")


class TrainerEndpoint(Protocol):
    """The controller's handle on trainer rank 0's :class:`~rlsdk.engine.inference.nccl_sync.NcclWeightSender`."""

    async def address(self, timeout_s: float) -> tuple[str, int]:
        """Trainer rank 0's address as the vLLM workers reach it, and a port free there now."""
        ...

    async def join(self, rendezvous: NcclRendezvous, timeout_s: float) -> None:
        """Trainer rank 0 joins the NCCL group as rank 0."""
        ...

    async def layout(self, version: int, timeout_s: float) -> list[dict[str, Any]]:
        """``[{name, dtype, shape}]`` of the weights of ``version`` in broadcast order (gathers them on rank 0)."""
        ...

    async def broadcast(self, version: int, timeout_s: float) -> dict[str, Any]:
        """Broadcast ``version``'s tensors; returns ``{"version", "checksum", "bytes"}`` of what was sent."""
        ...


class RankCommandTrainer:
    """A :class:`TrainerEndpoint` over the control channel: each call is one :data:`NCCL_RANK_COMMAND` on every
    rank (every rank takes part in gathering the weights with ``train.parallelism='fsdp2'``; rank 0 answers).

    ``call(body, timeout_s)`` sends the command to every rank and returns their results (index = rank), e.g.
    ``lambda body, t: session._broadcast("broadcast_weights_nccl", body, timeout_s=t)``.
    """

    def __init__(self, call: Callable[[dict[str, Any], float], Awaitable[list[Any]]]) -> None:
        self._call = call

    async def _rank0(self, body: dict[str, Any], timeout_s: float) -> Any:
        return (await self._call(body, timeout_s))[0]

    async def address(self, timeout_s: float) -> tuple[str, int]:
        found = await self._rank0({"step": "address"}, timeout_s)
        return str(found["host"]), int(found["port"])

    async def join(self, rendezvous: NcclRendezvous, timeout_s: float) -> None:
        body = {
            "step": "join",
            "master_address": rendezvous.master_address,
            "master_port": rendezvous.master_port,
            "world_size": rendezvous.world_size,
            "timeout_s": timeout_s,
        }
        await self._rank0(body, timeout_s)

    async def layout(self, version: int, timeout_s: float) -> list[dict[str, Any]]:
        return list((await self._rank0({"step": "layout", "version": version}, timeout_s))["layout"])

    async def broadcast(self, version: int, timeout_s: float) -> dict[str, Any]:
        return dict(await self._rank0({"step": "send", "version": version, "timeout_s": timeout_s}, timeout_s))


class NcclWeightTransfer:
    """GPU path: trainer rank 0 broadcasts its tensors over NCCL into every vLLM worker; a :class:`WeightTransfer`.

    ``push`` forms the group on first use (trainer rank 0's address and a free port there, from the trainer
    unless ``rendezvous`` is given; the group size is 1 + the workers that answer), asks the trainer for the
    layout of ``version``, then runs the worker receive (a ``/collective_rpc`` to ``rlsdk_nccl_receive`` of
    :class:`~rlsdk.engine.inference.nccl_sync.NcclWeightSyncExtension`) and the trainer send concurrently, bounded
    by ``timeout_s``. ``path`` is ignored: nothing goes through files. :attr:`last_sent` keeps what the trainer
    sent (``version``, ``checksum``, ``bytes``) for the Session's own verification.

    Raises :class:`WeightSyncTimeoutError` when either side does not finish within ``timeout_s`` (the group is
    formed anew on the next push), ``RuntimeError`` when a worker reports an error, and
    :class:`~rlsdk.versioning.WeightMismatchError` when the trainer sent another version than ``version`` or a
    worker's checksum differs from the trainer's.
    """

    name = "nccl"
    direct = True  # no published file: the engine verifies against last_sent
    SERVER_ARGS: tuple[str, ...] = ("--worker-extension-cls", NCCL_WORKER_EXTENSION)

    def __init__(self, trainer: TrainerEndpoint, rendezvous: NcclRendezvous | None = None) -> None:
        self.trainer = trainer
        self.rendezvous = rendezvous
        self._fixed_rendezvous = rendezvous is not None
        self._joined = False
        self.last_sent: dict[str, Any] = {}

    def server_args(self) -> Sequence[str]:
        return self.SERVER_ARGS

    async def _bounded(self, what: str, timeout_s: float, *steps: Awaitable[Any]) -> list[Any]:
        try:
            return list(await asyncio.wait_for(asyncio.gather(*steps), timeout=timeout_s))
        except TimeoutError:
            self._joined = False
            raise WeightSyncTimeoutError(
                f"{what} did not finish within {timeout_s:.1f} s (trainer rank 0 or a vLLM worker died or never "
                "joined); the NCCL group is re-initialised on the next sync"
            ) from None

    async def init(self, rpc: CollectiveRpc, timeout_s: float) -> None:
        """Form the trainer<->workers NCCL group (both sides rendezvous at once)."""
        if not self._fixed_rendezvous:
            workers, (host, port) = await self._bounded(
                "NCCL rendezvous set-up",
                timeout_s,
                rpc("rlsdk_weight_info", {}, timeout_s),
                self.trainer.address(timeout_s),
            )
            self.rendezvous = NcclRendezvous(host, port, world_size=1 + len(workers))
        r = self.rendezvous
        assert r is not None
        kwargs = {
            "master_address": r.master_address,
            "master_port": r.master_port,
            "world_size": r.world_size,
            "timeout_s": timeout_s,
        }
        results, _ = await self._bounded(
            "NCCL group init", timeout_s, rpc("rlsdk_nccl_init", kwargs, timeout_s), self.trainer.join(r, timeout_s)
        )
        _raise_worker_errors(results)
        self._joined = True

    async def push(self, rpc: CollectiveRpc, path: str, version: int, timeout_s: float) -> dict[str, Any]:
        start = time.perf_counter()
        if not self._joined:
            await self.init(rpc, timeout_s)
        layout = await self.trainer.layout(version, timeout_s)
        receive = rpc("rlsdk_nccl_receive", {"layout": layout, "version": version, "timeout_s": timeout_s}, timeout_s)
        results, sent = await self._bounded(
            f"NCCL weight sync of v{version}", timeout_s, receive, self.trainer.broadcast(version, timeout_s)
        )
        self.last_sent = dict(sent)
        return _verified_load(f"NCCL weight sync of v{version}", "sent", version, sent, results, start)


IPC_WORKER_EXTENSION = "rlsdk.engine.inference.ipc_sync.IpcWeightSyncExtension"

# The rank command (rlsdk.worker) that runs the train ranks' half of the shared-card path.
IPC_RANK_COMMAND = "share_weights_ipc"


class IpcWeightTransfer:
    """GPU path on a shared card (one GPU: the train rank and vLLM on it, ``DevicePlan.shares_gpu``): trainer
    rank 0 packs its weights into one CUDA buffer and the vLLM worker on the same GPU maps it through a CUDA IPC
    handle and loads it (:mod:`rlsdk.engine.inference.ipc_sync`); a :class:`WeightTransfer`.

    ``call(body, timeout_s)`` sends :data:`IPC_RANK_COMMAND` to every rank and returns their results (index =
    rank). ``push`` exports (every rank gathers with 'fsdp2'; rank 0 answers), runs the worker's
    ``rlsdk_ipc_receive``, then always asks rank 0 to release the buffer, all within ``timeout_s``. ``path`` is
    ignored: nothing goes through files. :attr:`last_sent` keeps what the trainer exported (``version``,
    ``checksum``, ``bytes``) for the Session's own verification.

    Raises :class:`WeightSyncTimeoutError` when the sync does not finish within ``timeout_s``, ``RuntimeError``
    when a worker reports an error (the weights it serves may then be partly new; its recorded checksum is
    cleared, so the next verification fails), and :class:`~rlsdk.versioning.WeightMismatchError` when rank 0
    exported another version than ``version`` or a worker's checksum differs from the trainer's.
    """

    name = "ipc"
    direct = True  # no published file: the engine verifies against last_sent
    SERVER_ARGS: tuple[str, ...] = ("--worker-extension-cls", IPC_WORKER_EXTENSION)

    def __init__(self, call: Callable[[dict[str, Any], float], Awaitable[list[Any]]]) -> None:
        self._call = call
        self.last_sent: dict[str, Any] = {}

    def server_args(self) -> Sequence[str]:
        return self.SERVER_ARGS

    async def push(self, rpc: CollectiveRpc, path: str, version: int, timeout_s: float) -> dict[str, Any]:
        start = time.perf_counter()
        try:
            return await asyncio.wait_for(self._push(rpc, version, timeout_s, start), timeout=timeout_s)
        except TimeoutError:
            raise WeightSyncTimeoutError(
                f"CUDA IPC weight sync of v{version} did not finish within {timeout_s:.1f} s (trainer rank 0 or the "
                "vLLM worker is stuck or died)"
            ) from None

    async def _push(self, rpc: CollectiveRpc, version: int, timeout_s: float, start: float) -> dict[str, Any]:
        exported = (await self._call({"step": "export"}, timeout_s))[0]
        if not isinstance(exported, dict) or "handle" not in exported:
            raise RuntimeError(f"{IPC_RANK_COMMAND} 'export': trainer rank 0 returned {exported!r}")
        self.last_sent = {k: exported[k] for k in ("version", "checksum", "bytes")}
        try:
            body = {"handle": exported["handle"], "layout": exported["layout"], "version": version}
            results = await rpc("rlsdk_ipc_receive", body, timeout_s)
        finally:
            await self._call({"step": "release"}, timeout_s)
        return _verified_load(f"CUDA IPC weight sync of v{version}", "exported", version, exported, results, start)


def _verified_load(
    what: str, verb: str, version: int, sent: Mapping[str, Any], results: Sequence[Any], start: float
) -> dict[str, Any]:
    """The first worker's result of a GPU sync (with ``sync_s`` since ``start``), once every worker answered
    without error, trainer rank 0 ``verb`` (sent/exported) ``version`` and every worker loaded its checksum.

    Raises:
        RuntimeError: a worker reported an error, or answered something other than a dict.
        WeightMismatchError: another version, or another checksum on a worker."""
    _raise_worker_errors(results)
    if sent.get("version", version) != version:
        raise WeightMismatchError(
            f"{what}: trainer rank 0 {verb} v{sent['version']} (checksum {sent['checksum'][:12]})"
        )
    checksums = {r["checksum"] for r in results}
    if checksums != {sent["checksum"]}:
        raise WeightMismatchError(
            f"{what}: trainer {verb} checksum {sent['checksum'][:12]}, workers loaded "
            f"{sorted(c[:12] for c in checksums)}"
        )
    loaded = dict(results[0])
    loaded["sync_s"] = time.perf_counter() - start
    return loaded


def _raise_worker_errors(results: Sequence[Any]) -> None:
    errors = [r["error"] for r in results if isinstance(r, dict) and r.get("error")]
    if errors:
        raise RuntimeError("; ".join(errors))
    if not results or not all(isinstance(r, dict) for r in results):
        raise RuntimeError(f"vLLM workers returned {results!r}; expected one dict per worker")


def weight_transfer_class(
    launch: LaunchConfig, choice: WeightTransferChoice = "auto", *, shares_gpu: bool = False
) -> type[FileWeightTransfer] | type[NcclWeightTransfer] | type[IpcWeightTransfer] | type[InPlaceWeightTransfer]:
    """The transfer for ``inference.vllm.weight_transfer`` = ``choice`` on this topology: 'auto' is
    :class:`IpcWeightTransfer` when the server shares the train rank's GPU (``shares_gpu``, from the device plan:
    NCCL cannot put two ranks on one GPU), :class:`NcclWeightTransfer` when the nodes have GPUs
    (``launch.gpus_per_node > 0``), else :class:`FileWeightTransfer` (shared memory on one host); 'reload' is
    :class:`FileWeightTransfer` and 'inplace' :class:`~rlsdk.engine.inference.inplace_transfer.InPlaceWeightTransfer`
    (CPU). Its ``SERVER_ARGS`` are what a server started elsewhere (a Slurm replica) needs."""
    if choice == "inplace":
        from rlsdk.engine.inference.inplace_transfer import InPlaceWeightTransfer

        return InPlaceWeightTransfer
    if choice == "reload":
        return FileWeightTransfer
    if shares_gpu:
        return IpcWeightTransfer
    return NcclWeightTransfer if launch.gpus_per_node > 0 else FileWeightTransfer


def select_weight_transfer(
    launch: LaunchConfig,
    trainer: TrainerEndpoint,
    choice: WeightTransferChoice = "auto",
    *,
    shares_gpu: bool = False,
    rank_call: Callable[[str, dict[str, Any], float], Awaitable[list[Any]]] | None = None,
) -> WeightTransfer:
    """The transfer :func:`weight_transfer_class` picks, built; ``trainer`` reaches trainer rank 0 (NCCL),
    ``rank_call(command, body, timeout_s)`` sends a rank command to every rank (CUDA IPC)."""
    cls = weight_transfer_class(launch, choice, shares_gpu=shares_gpu)
    if cls is NcclWeightTransfer:
        return NcclWeightTransfer(trainer)
    if cls is IpcWeightTransfer:
        if rank_call is None:
            raise ValueError("the CUDA IPC weight transfer (a server sharing the rank's GPU) needs rank_call")
        call = rank_call
        return IpcWeightTransfer(lambda body, timeout_s: call(IPC_RANK_COMMAND, body, timeout_s))
    return cls()  # type: ignore[call-arg]
