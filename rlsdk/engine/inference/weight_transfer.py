"""How published trainer weights reach a vLLM server: a small interface with a CPU (file) and a GPU (NCCL) path.

The trainer publishes weights with ``TrainEngine.export_weights`` (a safetensors file under ``/dev/shm`` on this
machine). A :class:`WeightTransfer` moves them into the server and reports the checksum of what the server
loaded. The engine brackets every push with pause/resume and the version update; a transfer only moves bytes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

# (method, kwargs, timeout_s) -> one result per server worker
CollectiveRpc = Callable[[str, dict[str, Any], float], Awaitable[list[Any]]]


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

    def server_args(self) -> Sequence[str]:
        return ()

    async def push(self, rpc: CollectiveRpc, path: str, version: int, timeout_s: float) -> dict[str, Any]:
        results = await rpc("rlsdk_load_weights", {"path": path}, timeout_s)
        errors = [r["error"] for r in results if isinstance(r, dict) and r.get("error")]
        if errors:
            raise RuntimeError("; ".join(errors))
        if not results or not all(isinstance(r, dict) and r.get("checksum") for r in results):
            raise RuntimeError(f"rlsdk_load_weights returned {results!r}; expected one checksum per worker")
        checksums = {r["checksum"] for r in results}
        if len(checksums) != 1:
            raise RuntimeError(f"server workers loaded different weights for v{version}: checksums {checksums}")
        return dict(results[0])


class NcclWeightTransfer:
    """GPU path (not implemented): broadcast the trainer's tensors over NCCL into the server's workers.

    The plan: vLLM's weight-transfer engine (``--weight-transfer-config``, ``/init_weight_transfer_engine``,
    ``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``) or a worker extension joining a
    process group with trainer rank 0, which broadcasts each tensor; the worker feeds them to
    ``reload_weights(weights_iterator=...)`` and checksums them as the file path does. Its backends are GPU-only,
    so it cannot be built or tested on the CPU machines this project runs on.
    """

    name = "nccl"

    def __init__(self) -> None:
        raise NotImplementedError(
            "NcclWeightTransfer (GPU weight sync over NCCL through vLLM's weight-transfer engine) is not "
            "implemented; on CPU use FileWeightTransfer"
        )

    def server_args(self) -> Sequence[str]:  # pragma: no cover - cannot be constructed
        raise NotImplementedError

    async def push(
        self, rpc: CollectiveRpc, path: str, version: int, timeout_s: float
    ) -> dict[str, Any]:  # pragma: no cover
        raise NotImplementedError
