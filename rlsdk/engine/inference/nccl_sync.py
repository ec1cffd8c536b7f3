"""GPU weight sync: trainer rank 0 broadcasts its state dict over NCCL into every vLLM worker.

Three parts, one per process, plugged into the same :class:`~rlsdk.engine.inference.weight_transfer.WeightTransfer`
interface as the CPU file path:

- :class:`NcclWeightTransfer` (controller): ``push`` runs the worker receive (a ``/collective_rpc`` to
  ``rlsdk_nccl_receive``) and the trainer send concurrently, bounded by ``timeout_s``, then verifies that every
  worker's checksum equals the trainer's, exactly as :class:`FileWeightTransfer` does.
- :class:`NcclWeightSender` (trainer rank 0): joins the trainer<->workers NCCL group as rank 0 through vLLM's
  ``vllm.distributed.weight_transfer.nccl_common.trainer_init`` (a ``StatelessProcessGroup`` rendezvous on
  ``master_address:master_port``, then a ``PyNcclCommunicator``) and broadcasts each tensor in sorted name order.
- :class:`NcclWeightSyncExtension` (vLLM worker, ``--worker-extension-cls``): joins as rank ``1 + worker rank``
  through vLLM's ``worker_init_process_group`` (unique across data-parallel replicas), receives the tensors into
  fresh CUDA buffers, checksums them with :func:`rlsdk.engine.weights.state_dict_checksum` under the trainer's
  names while ``reload_weights(weights_iterator=...)`` loads them, like the file path's extension.

A broken peer cannot hang a sync: every blocking wait (rendezvous, broadcast completion) is bounded; on a timeout
the communicator is aborted (``PyNcclCommunicator.destroy`` calls ``ncclCommAbort``), the call raises (trainer)
or returns ``{"error": ...}`` (worker; an exception would kill vLLM's engine core), and the next sync must
re-initialise the group.

Why not vLLM's own ``NCCLWeightTransferEngine`` (``--weight-transfer-config '{"backend": "nccl"}'`` with
``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``): it
receives and loads the same way, but reports nothing about what it loaded, so the sync could not be verified by
checksum. The extension uses its building blocks (``worker_init_process_group``, ``NCCLWeightTransferInitInfo``,
``trainer_init``) and adds the checksum. The receive here is unpacked (one broadcast per tensor); vLLM's packed
producer/consumer is the next step for models with many small tensors.

Import-safe on CPU: torch, CUDA and vLLM are imported inside the functions that use them. Not run here: these
machines have no GPU, so only the controller half and the timeout helper are tested (tests/launch/
test_nccl_sync.py); the GPU tests are marked ``gpu`` and skipped with that reason.

TODO(issue 9): the trainer half needs a worker command (``rlsdk.worker``) that calls
:meth:`NcclWeightSender.broadcast`, and the Session must build :class:`NcclWeightTransfer` when
``launch.gpus_per_node > 0``; both live in files outside this change.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from rlsdk.engine.inference.vllm_worker import WeightSyncExtension
from rlsdk.engine.inference.weight_transfer import CollectiveRpc
from rlsdk.observe.logging import get_logger
from rlsdk.versioning import WeightMismatchError

logger = get_logger(__name__)

NCCL_WORKER_EXTENSION = "rlsdk.engine.inference.nccl_sync.NcclWeightSyncExtension"

T = TypeVar("T")


class WeightSyncTimeoutError(TimeoutError):
    """A side of an NCCL weight sync did not finish in time (a peer died or never joined)."""


@dataclass(frozen=True)
class NcclRendezvous:
    """Where the trainer<->workers NCCL group meets: the trainer's host and a free port, and its size.

    ``world_size`` = 1 (trainer rank 0) + every vLLM worker of every replica
    (``inference_replicas x inference_tensor_parallel_size``).
    """

    master_address: str
    master_port: int
    world_size: int

    def __post_init__(self) -> None:
        if self.world_size < 2:
            raise ValueError(f"world_size {self.world_size}: needs the trainer plus at least one vLLM worker")


def tensor_layout(state_dict: Mapping[str, Any]) -> list[dict[str, Any]]:
    """``[{name, dtype, shape}]`` in sorted name order: the broadcast order both sides follow.

    ``dtype`` is the torch dtype's name without ``torch.`` (``'bfloat16'``); ``shape`` a list of ints.
    """
    return [
        {
            "name": name,
            "dtype": str(state_dict[name].dtype).removeprefix("torch."),
            "shape": list(state_dict[name].shape),
        }
        for name in sorted(state_dict)
    ]


def layout_bytes(layout: Sequence[Mapping[str, Any]]) -> int:
    """Bytes one broadcast of ``layout`` moves (per receiver)."""
    import torch

    total = 0
    for entry in layout:
        numel = 1
        for size in entry["shape"]:
            numel *= int(size)
        total += numel * getattr(torch, entry["dtype"]).itemsize
    return total


def call_with_timeout(fn: Callable[[], T], timeout_s: float, what: str, on_timeout: Callable[[], None]) -> T:
    """Run ``fn`` on a helper thread; if it has not returned after ``timeout_s``, call ``on_timeout`` (abort the
    communicator) and raise :class:`WeightSyncTimeoutError` naming ``what``. ``fn``'s own exception propagates."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=run, name=f"rlsdk-nccl-{what}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        on_timeout()
        raise WeightSyncTimeoutError(f"{what} did not finish within {timeout_s:.1f} s (a peer died or never joined)")
    if "error" in box:
        raise box["error"]
    return box["value"]


class TrainerEndpoint(Protocol):
    """The controller's handle on trainer rank 0's :class:`NcclWeightSender` (through the control channel)."""

    async def join(self, rendezvous: NcclRendezvous, timeout_s: float) -> None:
        """Trainer rank 0 joins the NCCL group as rank 0."""
        ...

    async def layout(self, version: int) -> list[dict[str, Any]]:
        """:func:`tensor_layout` of the weights of ``version`` (cheap: metadata only)."""
        ...

    async def broadcast(self, version: int, timeout_s: float) -> dict[str, Any]:
        """Broadcast ``version``'s tensors; returns ``{"checksum", "bytes"}`` of what was sent."""
        ...


class NcclWeightTransfer:
    """Controller half of the GPU path; a :class:`~rlsdk.engine.inference.weight_transfer.WeightTransfer`.

    ``path`` in :meth:`push` is ignored (nothing goes through files). Raises :class:`WeightSyncTimeoutError` when
    either side does not finish within ``timeout_s``, ``RuntimeError`` when a worker reports an error, and
    :class:`~rlsdk.versioning.WeightMismatchError` when a worker's checksum differs from the trainer's.
    """

    name = "nccl"

    def __init__(self, trainer: TrainerEndpoint, rendezvous: NcclRendezvous) -> None:
        self.trainer = trainer
        self.rendezvous = rendezvous
        self._joined = False

    def server_args(self) -> Sequence[str]:
        return ("--worker-extension-cls", NCCL_WORKER_EXTENSION)

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
        r = self.rendezvous
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
        layout = await self.trainer.layout(version)
        receive = rpc("rlsdk_nccl_receive", {"layout": layout, "version": version, "timeout_s": timeout_s}, timeout_s)
        results, sent = await self._bounded(
            f"NCCL weight sync of v{version}", timeout_s, receive, self.trainer.broadcast(version, timeout_s)
        )
        _raise_worker_errors(results)
        checksums = {r["checksum"] for r in results}
        if checksums != {sent["checksum"]}:
            raise WeightMismatchError(
                f"NCCL weight sync of v{version}: trainer sent checksum {sent['checksum'][:12]}, workers loaded "
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


class NcclWeightSender:
    """Trainer rank 0's half: join the group as NCCL rank 0 and broadcast state dicts. CUDA and vLLM only."""

    def __init__(self) -> None:
        self._comm: Any = None

    def join(self, rendezvous: NcclRendezvous, timeout_s: float) -> None:
        """Rendezvous with the workers (they call ``rlsdk_nccl_init`` at the same time); bounded by timeout_s."""
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        def create() -> Any:
            return trainer_init(
                {
                    "master_address": rendezvous.master_address,
                    "master_port": rendezvous.master_port,
                    "world_size": rendezvous.world_size,
                },
                rank=0,
            )

        self._comm = call_with_timeout(create, timeout_s, "NCCL group init (trainer)", on_timeout=lambda: None)

    def broadcast(self, state_dict: Mapping[str, Any], timeout_s: float) -> dict[str, Any]:
        """Broadcast every tensor (sorted names) from rank 0; return the checksum and bytes of what was sent."""
        import torch

        from rlsdk.engine.weights import state_dict_checksum

        if self._comm is None:
            raise RuntimeError("NcclWeightSender.broadcast before join()")
        comm = self._comm
        names = sorted(state_dict)

        def send() -> None:
            stream = torch.cuda.current_stream()
            for name in names:
                comm.broadcast(state_dict[name].detach().contiguous(), src=0, stream=stream)
            stream.synchronize()

        call_with_timeout(send, timeout_s, "NCCL broadcast (trainer)", on_timeout=self.abort)
        return {
            "checksum": state_dict_checksum(state_dict),
            "bytes": sum(t.numel() * t.element_size() for t in state_dict.values()),
        }

    def abort(self) -> None:
        """Abort the communicator (unblocks a stuck broadcast); the next sync joins a new group."""
        comm, self._comm = self._comm, None
        if comm is not None:
            comm.destroy()


class NcclWeightSyncExtension(WeightSyncExtension):
    """vLLM worker extension for the GPU path; ``self`` is vLLM's GPU worker. Keeps the file path's methods."""

    def rlsdk_nccl_init(
        self, master_address: str, master_port: int, world_size: int, timeout_s: float
    ) -> dict[str, Any]:
        """Join the trainer's NCCL group as rank 1 + this worker's global rank. Never raises."""
        try:
            from vllm.distributed.weight_transfer.nccl_common import (
                NCCLWeightTransferInitInfo,
                worker_init_process_group,
            )

            info = NCCLWeightTransferInitInfo(
                master_address=master_address, master_port=master_port, rank_offset=1, world_size=world_size
            )
            parallel = self.vllm_config.parallel_config  # type: ignore[attr-defined]
            self._rlsdk_comm = call_with_timeout(
                lambda: worker_init_process_group(info, parallel),
                timeout_s,
                "NCCL group init (vLLM worker)",
                on_timeout=lambda: None,
            )
        except Exception as exc:
            return {"error": f"NCCL group init: {type(exc).__name__}: {exc}"}
        return {"ok": True}

    def rlsdk_nccl_receive(self, layout: list[dict[str, Any]], version: int, timeout_s: float) -> dict[str, Any]:
        """Receive the broadcast into new CUDA tensors, load them, checksum them. Never raises (see the file path)."""
        import torch

        from rlsdk.engine.weights import state_dict_checksum

        comm = getattr(self, "_rlsdk_comm", None)
        if comm is None:
            return {"error": "rlsdk_nccl_receive before rlsdk_nccl_init (or after an aborted sync)"}
        start = time.perf_counter()
        device = torch.device("cuda", torch.cuda.current_device())
        tensors = {e["name"]: torch.empty(e["shape"], dtype=getattr(torch, e["dtype"]), device=device) for e in layout}

        def receive() -> None:
            stream = torch.cuda.current_stream()
            for entry in layout:
                comm.broadcast(tensors[entry["name"]], src=0, stream=stream)
            stream.synchronize()

        def abort() -> None:
            self._rlsdk_comm = None
            comm.destroy()

        try:
            call_with_timeout(receive, timeout_s, f"NCCL receive of v{version} (vLLM worker)", on_timeout=abort)
        except Exception as exc:
            self._rlsdk_checksum = None
            return {"error": f"{type(exc).__name__}: {exc}"}
        receive_s = time.perf_counter() - start
        try:
            checksum = state_dict_checksum(tensors)
            self.reload_weights(weights_iterator=iter(tensors.items()), is_checkpoint_format=True)  # type: ignore[attr-defined]
        except Exception as exc:
            self._rlsdk_checksum = None
            return {"error": f"loading v{version}: {type(exc).__name__}: {exc}"}
        self._rlsdk_checksum = checksum
        self._rlsdk_path = f"nccl:v{version}"
        return {
            "checksum": checksum,
            "path": self._rlsdk_path,
            "bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
            "read_s": receive_s,
            "load_s": time.perf_counter() - start - receive_s,
        }
