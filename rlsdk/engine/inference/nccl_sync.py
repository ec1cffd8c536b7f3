"""GPU weight sync: trainer rank 0 broadcasts its state dict over NCCL into every vLLM worker.

Three parts, one per process, plugged into the same :class:`~rlsdk.engine.inference.weight_transfer.WeightTransfer`
interface as the CPU file path:

- :class:`~rlsdk.engine.inference.weight_transfer.NcclWeightTransfer` (controller, in ``weight_transfer.py`` and
  re-exported here): ``push`` runs the worker receive (a ``/collective_rpc`` to ``rlsdk_nccl_receive``) and the
  trainer send concurrently, bounded by ``timeout_s``, then verifies the version and that every worker's checksum
  equals the trainer's, exactly as :class:`FileWeightTransfer` does. The Session selects it when
  ``launch.gpus_per_node > 0`` (:func:`~rlsdk.engine.inference.weight_transfer.select_weight_transfer`) and
  reaches the trainer through the rank command ``broadcast_weights_nccl``
  (:class:`~rlsdk.engine.inference.weight_transfer.RankCommandTrainer`).
- :class:`NcclRankSide` (every train rank, behind that command) and :class:`NcclWeightSender` (trainer rank 0):
  every rank takes part in gathering the full state dict; rank 0 copies it to its CUDA device, joins the
  trainer<->workers NCCL group as rank 0 through vLLM's
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

Import-safe on CPU: torch's CUDA parts and vLLM are imported inside the functions that use them. Not run here:
these machines have no GPU, so only the controller half, the rank command's steps (CUDA parts replaced by fakes)
and the timeout helper are tested (tests/launch/test_nccl_sync.py, tests/launch/test_weight_transfer_select.py);
the GPU tests are marked ``gpu`` and skipped with that reason. Train ranks on CPU (``launch.device='cpu'``, see
:mod:`rlsdk.config.device`) have rank 0 copy the gathered weights to its GPU before each broadcast.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from rlsdk.engine.inference.vllm_worker import WeightSyncExtension
from rlsdk.engine.inference.weight_transfer import (
    NCCL_RANK_COMMAND,
    NCCL_WORKER_EXTENSION,
    NcclRendezvous,
    NcclWeightTransfer,
    RankCommandTrainer,
    TrainerEndpoint,
    WeightSyncTimeoutError,
)
from rlsdk.observe.logging import get_logger

__all__ = [
    "NCCL_RANK_COMMAND",
    "NCCL_WORKER_EXTENSION",
    "NcclRankSide",
    "NcclRendezvous",
    "NcclWeightSender",
    "NcclWeightSyncExtension",
    "NcclWeightTransfer",
    "RankCommandTrainer",
    "TrainerEndpoint",
    "WeightSyncTimeoutError",
    "call_with_timeout",
    "cuda_state_dict",
    "layout_bytes",
    "rank_zero_address",
    "tensor_layout",
]

logger = get_logger(__name__)

T = TypeVar("T")


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


def cuda_state_dict(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """``state_dict`` on this process's CUDA device (a no-op for tensors already there).

    Raises RuntimeError when this process sees no CUDA device (``launch.gpus_per_node > 0`` declared GPUs the
    trainer rank does not have).
    """
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError(
            "the NCCL weight sync (launch.gpus_per_node > 0) needs a CUDA device on trainer rank 0; this rank sees "
            "none (torch.cuda.is_available() is False). On CPU-only nodes set gpus_per_node=0 (file transfer)"
        )
    device = torch.device("cuda", torch.cuda.current_device())
    return {name: tensor.detach().to(device).contiguous() for name, tensor in state_dict.items()}


def rank_zero_address() -> str:
    """Trainer rank 0's address as other nodes reach it: accelerate's ``MASTER_ADDR`` (the rendezvous host of
    machine rank 0, i.e. this node), else loopback (one machine)."""
    return os.environ.get("MASTER_ADDR") or "127.0.0.1"


class NcclRankSide:
    """The train ranks' half of the GPU path, behind the rank command :data:`NCCL_RANK_COMMAND`.

    One instance per rank (the worker keeps it between commands). ``handle(engine, body)`` runs
    ``body["step"]``, in the order the controller's :class:`NcclWeightTransfer` sends them:

    - ``'address'``: rank 0 returns ``{"host", "port"}`` (:func:`rank_zero_address`, a port free now);
    - ``'join'``: rank 0 joins the group (``master_address``, ``master_port``, ``world_size``, ``timeout_s``),
      aborting a previous one;
    - ``'layout'``: every rank takes part in gathering the full state dict (a collective with 'fsdp2'); rank 0
      copies it to CUDA, keeps it for 'send' and returns ``{"version", "layout"}`` (:func:`tensor_layout`);
    - ``'send'``: rank 0 broadcasts what 'layout' kept and returns ``{"version", "checksum", "bytes"}``.

    Other ranks return None. ``sender_factory`` builds the :class:`NcclWeightSender` (tests pass a fake).
    """

    def __init__(self, rank: int, sender_factory: Callable[[], Any] | None = None) -> None:
        self.rank = rank
        self.sender: Any = None
        self._sender_factory = sender_factory or NcclWeightSender
        self._pending: tuple[int, dict[str, Any]] | None = None

    def handle(self, engine: Any, body: Mapping[str, Any]) -> dict[str, Any] | None:
        step = body.get("step")
        if step == "layout":
            # Every rank: with 'fsdp2' the gather is a collective.
            state_dict = engine.full_state_dict(keep=self.rank == 0)
            if self.rank != 0:
                return None
            self._pending = (int(engine.version), cuda_state_dict(state_dict))
            return {"version": self._pending[0], "layout": tensor_layout(self._pending[1])}
        if step not in ("address", "join", "send"):
            raise ValueError(f"{NCCL_RANK_COMMAND}: unknown step {step!r}; expected address, join, layout or send")
        if self.rank != 0:
            return None
        if step == "address":
            from rlsdk.procutil import free_port

            host = rank_zero_address()
            return {"host": host, "port": free_port()}
        if step == "join":
            if self.sender is not None:
                self.sender.abort()
            self.sender = self._sender_factory()
            rendezvous = NcclRendezvous(
                str(body["master_address"]), int(body["master_port"]), world_size=int(body["world_size"])
            )
            self.sender.join(rendezvous, float(body["timeout_s"]))
            return {"joined": True}
        if self.sender is None or self._pending is None:
            raise RuntimeError(f"{NCCL_RANK_COMMAND} 'send' before 'join' and 'layout' on trainer rank 0")
        version, state_dict = self._pending
        self._pending = None
        sent = self.sender.broadcast(state_dict, float(body["timeout_s"]))
        return {**sent, "version": version}


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
