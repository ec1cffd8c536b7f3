"""The worker extension for in-place weight updates: importing this module keeps vLLM's CPU weights plain.

Pass ``--worker-extension-cls rlsdk.engine.inference.vllm_plain_worker.PlainWeightSyncExtension`` (what
:class:`~rlsdk.engine.inference.inplace_transfer.InPlaceWeightTransfer` adds to the server's command line). vLLM
imports this module in each worker's ``init_worker`` (``vllm/v1/worker/worker_base.py``), before ``load_model``;
the import runs :func:`~rlsdk.engine.inference.vllm_worker.keep_plain_cpu_weights`, so the model loads with plain
``F.linear`` weights that :meth:`~rlsdk.engine.inference.vllm_worker.WeightSyncExtension.rlsdk_update_weights_inplace`
can overwrite at memcpy speed. Only vLLM workers should import it: it patches vLLM in the importing process (a no-op
without vLLM or off CPU).
"""

from __future__ import annotations

from rlsdk.engine.inference.vllm_worker import WeightSyncExtension, keep_plain_cpu_weights

PLAIN_WEIGHTS_ACTIVE = keep_plain_cpu_weights()


class PlainWeightSyncExtension(WeightSyncExtension):
    """:class:`~rlsdk.engine.inference.vllm_worker.WeightSyncExtension`, in a worker whose model keeps plain
    weights (this module's import patched vLLM's CPU GEMM dispatch)."""
