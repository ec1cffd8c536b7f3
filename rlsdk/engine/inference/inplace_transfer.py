"""CPU weight sync at memcpy speed: copy the published weights into the served parameters in place.

:class:`InPlaceWeightTransfer` is a :class:`~rlsdk.engine.inference.weight_transfer.WeightTransfer` for one host
(the published safetensors file under ``/dev/shm``), like
:class:`~rlsdk.engine.inference.weight_transfer.FileWeightTransfer`, but each server worker copies the new tensors
into its existing parameters through the model's own ``load_weights``
(:meth:`~rlsdk.engine.inference.vllm_worker.WeightSyncExtension.rlsdk_update_weights_inplace`) instead of running
vLLM's ``reload_weights``, which on CPU re-runs ``process_weights_after_loading`` and repacks every linear weight
into oneDNN/SGL form (the cost that bounds the file path's throughput; benchmarks/vllm_sync.py measures both).

That needs a server whose linear layers keep plain weights: :meth:`InPlaceWeightTransfer.server_args` selects the
worker extension :class:`~rlsdk.engine.inference.vllm_plain_worker.PlainWeightSyncExtension`, whose import patches
vLLM's CPU GEMM dispatch to ``torch.nn.functional.linear`` before the model loads. A server started without it
(e.g. attached by URL) answers that in-place is unavailable without touching its weights; the transfer then
logs why and uses the reload path for that and every later push. A failure after the copy began also falls back
to a full reload (which rewrites every weight). Every plain copy the model's loaders make reads the file straight
into the parameter slice, and the checksum is computed from those served slices (from the file only for a tensor
no loader copied whole, e.g. a tied alias), under the trainer's names: see
:meth:`~rlsdk.engine.inference.vllm_worker.WeightSyncExtension.rlsdk_update_weights_inplace`.

This module imports neither torch nor vLLM: the controller builds transfers on any machine.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from rlsdk.engine.inference.worker_results import CollectiveRpc, check_worker_results
from rlsdk.observe.logging import get_logger

logger = get_logger(__name__)

PLAIN_WORKER_EXTENSION = "rlsdk.engine.inference.vllm_plain_worker.PlainWeightSyncExtension"


class InPlaceWeightTransfer:
    """CPU path, in place: every server worker copies the published file's tensors into its served parameters.

    Falls back to the reload path (``rlsdk_load_weights``, as :class:`FileWeightTransfer`) when a worker reports
    in-place unavailable (server without plain weights: remembered, later pushes reload directly) or fails after
    it began copying; the reason is logged as a warning. :attr:`last_method` says which path the last push took.
    """

    name = "inplace"
    SERVER_ARGS: tuple[str, ...] = ("--worker-extension-cls", PLAIN_WORKER_EXTENSION)

    def __init__(self) -> None:
        self.unavailable: str | None = None  # why in-place cannot run on this server (then every push reloads)
        self.last_method: str | None = None

    def server_args(self) -> Sequence[str]:
        return self.SERVER_ARGS

    async def push(self, rpc: CollectiveRpc, path: str, version: int, timeout_s: float) -> dict[str, Any]:
        start = time.perf_counter()
        if self.unavailable is None:
            results = await rpc("rlsdk_update_weights_inplace", {"path": path}, timeout_s)
            failures = [r for r in results if not isinstance(r, dict) or r.get("error")]
            if not failures:
                self.last_method = "inplace"
                return check_worker_results("rlsdk_update_weights_inplace", version, results)
            reason = "; ".join(str(r.get("error") if isinstance(r, dict) else r) for r in failures)
            if all(isinstance(r, dict) and r.get("unsupported") for r in failures):
                self.unavailable = reason
                logger.warning("in-place weight update unavailable, reloading instead from now on: %s", reason)
            else:
                logger.warning("in-place weight update of v%d failed, reloading all weights: %s", version, reason)
        remaining = max(1.0, timeout_s - (time.perf_counter() - start))
        results = await rpc("rlsdk_load_weights", {"path": path}, remaining)
        self.last_method = "reload"
        loaded = check_worker_results("rlsdk_load_weights", version, results)
        loaded["fallback"] = self.unavailable or "in-place update failed"
        return loaded
