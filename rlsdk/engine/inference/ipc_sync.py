"""GPU weight sync on a shared card: trainer rank 0 hands the vLLM worker on its own GPU a CUDA IPC handle.

On a one-GPU machine the train rank and the vLLM server share the card (:class:`rlsdk.config.device.DevicePlan`,
``shares_gpu``). NCCL refuses two ranks of one communicator on one GPU, so the broadcast of
:mod:`rlsdk.engine.inference.nccl_sync` cannot run there; the layout TRL and verl use on one card instead shares
GPU memory between the two processes. Three parts, one per process, behind the same
:class:`~rlsdk.engine.inference.weight_transfer.WeightTransfer` interface:

- :class:`~rlsdk.engine.inference.weight_transfer.IpcWeightTransfer` (controller, in ``weight_transfer.py``):
  asks the ranks to export, has the worker load from the handle, then asks rank 0 to release its buffer, all
  bounded by ``timeout_s``, and verifies the version and that the worker's checksum equals the trainer's.
- :class:`IpcRankSide` (every train rank, behind the rank command :data:`IPC_RANK_COMMAND`): every rank takes
  part in gathering the full state dict ('fsdp2': a collective); rank 0 packs it into one contiguous CUDA buffer
  (:func:`pack_state_dict`), checksums it and exports the buffer's storage (:func:`export_storage`: torch's
  ``_share_cuda_``, the call under ``torch.multiprocessing``'s CUDA tensor sharing). It keeps the buffer alive
  until the worker has loaded it ('release').
- :class:`IpcWeightSyncExtension` (vLLM worker, ``--worker-extension-cls``): opens the handle
  (:func:`open_storage`), takes a view per tensor (:func:`unpack`), checksums the views under the trainer's
  names and loads them with ``reload_weights``, then drops the mapping.

Why one packed buffer and plain-data handles rather than vLLM's own ``IPCWeightTransferEngine``: vLLM's HTTP
path sends the handles pickled and refuses them unless the server runs with
``VLLM_ALLOW_INSECURE_SERIALIZATION=1``, which lets anyone who can post to the server run code in it. Here the
handle is a few integers and byte strings (base64) in JSON: nothing is unpickled. And, as with the NCCL path,
vLLM's engine reports nothing about what it loaded, so the sync could not be verified by checksum.

Import-safe on CPU: torch's CUDA parts and vLLM are imported inside the functions that use them. On CPU the
packing, the layout and the controller's half are tested (tests/launch/test_ipc_sync.py); opening a handle needs
a CUDA device (tests marked ``gpu``).
"""

from __future__ import annotations

import base64
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rlsdk.engine.inference.vllm_worker import WeightSyncExtension
from rlsdk.engine.inference.weight_transfer import IPC_RANK_COMMAND, IPC_WORKER_EXTENSION
from rlsdk.observe.logging import get_logger

__all__ = [
    "IPC_RANK_COMMAND",
    "IPC_WORKER_EXTENSION",
    "IpcRankSide",
    "IpcWeightSyncExtension",
    "export_storage",
    "open_storage",
    "pack_state_dict",
    "unpack",
]

logger = get_logger(__name__)

_ALIGN = 256  # bytes: every tensor starts at a CUDA-friendly alignment in the packed buffer


def pack_state_dict(state_dict: Mapping[str, Any], device: Any = None) -> tuple[Any, list[dict[str, Any]]]:
    """The tensors of ``state_dict`` in sorted name order, copied into one contiguous uint8 buffer on ``device``
    (default: the tensors' own), and their layout ``[{name, dtype, shape, offset, nbytes}]`` (``offset`` in bytes,
    each a multiple of 256). Names that share one tensor (tied embeddings) are each written, as the checkpoint
    format has them, so the receiver loads exactly what a file would hold."""
    import torch

    layout: list[dict[str, Any]] = []
    offset = 0
    for name in sorted(state_dict):
        tensor = state_dict[name]
        nbytes = tensor.numel() * tensor.element_size()
        layout.append(
            {
                "name": name,
                "dtype": str(tensor.dtype).removeprefix("torch."),
                "shape": list(tensor.shape),
                "offset": offset,
                "nbytes": nbytes,
            }
        )
        offset += -(-nbytes // _ALIGN) * _ALIGN
    target = device if device is not None else (next(iter(state_dict.values())).device if state_dict else "cpu")
    buffer = torch.empty(max(offset, 1), dtype=torch.uint8, device=target)
    for entry in layout:
        source = state_dict[entry["name"]].detach().contiguous()
        end = entry["offset"] + entry["nbytes"]
        buffer[entry["offset"] : end].copy_(source.reshape(-1).view(torch.uint8))
    return buffer, layout


def unpack(buffer: Any, layout: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Views of ``buffer`` (uint8, as :func:`pack_state_dict` wrote it) by name; nothing is copied.

    Raises:
        ValueError: an entry lies outside the buffer or its size disagrees with its dtype and shape.
    """
    import torch

    tensors: dict[str, Any] = {}
    for entry in layout:
        dtype = getattr(torch, str(entry["dtype"]))
        numel = 1
        for size in entry["shape"]:
            numel *= int(size)
        start, nbytes = int(entry["offset"]), int(entry["nbytes"])
        if nbytes != numel * dtype.itemsize or start < 0 or start + nbytes > buffer.numel():
            raise ValueError(
                f"IPC layout entry {entry['name']!r}: {nbytes} bytes at offset {start} does not fit a "
                f"{entry['dtype']} tensor of shape {list(entry['shape'])} in a buffer of {buffer.numel()} bytes"
            )
        tensors[str(entry["name"])] = buffer[start : start + nbytes].view(dtype).view(list(entry["shape"]))
    return tensors


def export_storage(buffer: Any) -> dict[str, Any]:
    """A CUDA IPC handle of ``buffer``'s storage as plain JSON data (byte strings in base64).

    The fields are those of torch's ``UntypedStorage._share_cuda_()`` (what ``torch.multiprocessing`` sends
    between processes): device, memory handle, size and offset, the reference counter's handle and offset, and
    the event that orders the consumer after the producer's writes."""
    device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync = (
        buffer.untyped_storage()._share_cuda_()
    )

    def text(value: bytes | None) -> str | None:
        return None if value is None else base64.b64encode(bytes(value)).decode("ascii")

    return {
        "device": int(device),
        "handle": text(handle),
        "size": int(size),
        "offset": int(offset),
        "ref_counter_handle": text(ref_handle),
        "ref_counter_offset": int(ref_offset),
        "event_handle": text(event_handle),
        "event_sync_required": bool(event_sync),
        "numel": int(buffer.numel()),
        "storage_offset": int(buffer.storage_offset()),
    }


def open_storage(handle: Mapping[str, Any], device_index: int) -> Any:
    """The uint8 tensor a peer on this GPU exported with :func:`export_storage`, mapped into this process on
    ``device_index`` (the receiver's own index of the same card).

    Raises:
        ValueError: a field is missing or has the wrong type.
    """
    import torch

    def raw(name: str) -> bytes:
        value = handle.get(name)
        if not isinstance(value, str):
            raise ValueError(f"IPC handle field {name!r} must be a base64 string, got {type(value).__name__}")
        return base64.b64decode(value, validate=True)

    for name in ("size", "offset", "ref_counter_offset", "numel", "storage_offset"):
        if type(handle.get(name)) is not int:
            raise ValueError(f"IPC handle field {name!r} must be an int, got {handle.get(name)!r}")
    event = handle.get("event_handle")
    storage = torch.UntypedStorage._new_shared_cuda(
        device_index,
        raw("handle"),
        handle["size"],
        handle["offset"],
        raw("ref_counter_handle"),
        handle["ref_counter_offset"],
        None if event is None else raw("event_handle"),
        bool(handle.get("event_sync_required")),
    )
    tensor = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", device_index))
    tensor.set_(storage, handle["storage_offset"], (handle["numel"],), (1,))
    return tensor


class IpcRankSide:
    """The train ranks' half of the shared-card path, behind the rank command :data:`IPC_RANK_COMMAND`.

    ``handle(engine, body)`` runs ``body["step"]``:

    - ``'export'``: every rank takes part in gathering the full state dict (a collective with 'fsdp2'); rank 0
      packs it on its CUDA device, checksums it and returns ``{"version", "layout", "handle", "checksum",
      "bytes"}``, keeping the buffer alive;
    - ``'release'``: rank 0 drops the buffer after the worker loaded it (``torch.cuda.ipc_collect`` frees it once
      the worker has closed its mapping).

    Other ranks return None. ``device``: where rank 0 packs (default: its current CUDA device); ``exporter``: makes
    the handle of the packed buffer (default :func:`export_storage`; tests on CPU pass their own).
    """

    def __init__(self, rank: int, device: Any = None, exporter: Callable[[Any], dict[str, Any]] | None = None) -> None:
        self.rank = rank
        self.device = device
        self._exporter = exporter or export_storage
        self._buffer: Any = None

    def handle(self, engine: Any, body: Mapping[str, Any]) -> dict[str, Any] | None:
        step = body.get("step")
        if step == "export":
            state_dict = engine.full_state_dict(keep=self.rank == 0)
            if self.rank != 0:
                return None
            return self._export(int(engine.version), state_dict)
        if step != "release":
            raise ValueError(f"{IPC_RANK_COMMAND}: unknown step {step!r}; expected export or release")
        if self.rank != 0:
            return None
        buffer, self._buffer = self._buffer, None
        if buffer is not None and buffer.is_cuda:
            import torch

            del buffer
            torch.cuda.ipc_collect()  # frees it once the worker has closed its mapping
            return {"released": True}
        return {"released": buffer is not None}

    def _export(self, version: int, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        from rlsdk.engine.weights import state_dict_checksum

        device = self.device
        if device is None:
            import torch

            if not torch.cuda.is_available():
                raise RuntimeError(
                    "the CUDA IPC weight sync (a vLLM server sharing the rank's GPU) needs a CUDA device on trainer "
                    "rank 0; this rank sees none (torch.cuda.is_available() is False)"
                )
            device = torch.device("cuda", torch.cuda.current_device())
        self._buffer = None  # a previous export the controller never released
        buffer, layout = pack_state_dict(state_dict, device)
        checksum = state_dict_checksum(unpack(buffer, layout))
        handle = self._exporter(buffer)
        self._buffer = buffer
        return {
            "version": version,
            "layout": layout,
            "handle": handle,
            "checksum": checksum,
            "bytes": sum(int(entry["nbytes"]) for entry in layout),
        }


class IpcWeightSyncExtension(WeightSyncExtension):
    """vLLM worker extension for the shared-card path; ``self`` is vLLM's GPU worker. Keeps the file path's
    methods."""

    def rlsdk_ipc_receive(self, handle: dict[str, Any], layout: list[dict[str, Any]], version: int) -> dict[str, Any]:
        """Map the trainer's buffer, checksum its tensors, load them, unmap. Never raises (see the file path)."""
        import torch

        from rlsdk.engine.weights import state_dict_checksum

        start = time.perf_counter()
        try:
            buffer = open_storage(handle, torch.cuda.current_device())
            tensors = unpack(buffer, layout)
        except Exception as exc:
            return {"error": f"opening the IPC handle of v{version}: {type(exc).__name__}: {exc}"}
        open_s = time.perf_counter() - start
        try:
            checksum = state_dict_checksum(tensors)
            self.reload_weights(weights_iterator=iter(tensors.items()), is_checkpoint_format=True)  # type: ignore[attr-defined]
            torch.cuda.synchronize()  # the copies out of the shared buffer are done before the trainer frees it
        except Exception as exc:
            self._rlsdk_checksum = None
            return {"error": f"loading v{version}: {type(exc).__name__}: {exc}"}
        finally:
            del tensors, buffer
        self._rlsdk_checksum = checksum
        self._rlsdk_path = f"ipc:v{version}"
        return {
            "checksum": checksum,
            "path": self._rlsdk_path,
            "bytes": sum(int(entry["nbytes"]) for entry in layout),
            "read_s": open_s,
            "load_s": time.perf_counter() - start - open_s,
        }
