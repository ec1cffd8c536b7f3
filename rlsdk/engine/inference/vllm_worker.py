"""rlsdk's vLLM worker extension: load published weights inside the server and checksum what was loaded.

Passed to the server as ``--worker-extension-cls rlsdk.engine.inference.vllm_worker.WeightSyncExtension``; vLLM
mixes it into its worker class, and the client calls its methods through the dev-mode ``/collective_rpc``
endpoint. This module is imported inside the vLLM worker process; it must not import vLLM at module level (the
controller imports it without vLLM) nor anything heavy from rlsdk.

What the checksum covers (see docs/vllm.md): :func:`rlsdk.engine.weights.state_dict_checksum` over the tensors the
worker read from the published safetensors file and handed to vLLM's ``reload_weights``, under the trainer's
parameter names, tied-weight aliases restored from the file's metadata exactly as ``safetensors.torch.load_model``
restores them; it is recorded only after ``reload_weights`` returned. So equal checksums prove the server loaded
bit-identical bytes of the trainer's state dict. It cannot hash the in-memory served parameters: on CPU, vLLM
fuses projections (qkv, gate_up) and repacks every linear weight into an opaque oneDNN/SGL handle, leaving an
empty ``weight`` parameter behind. The per-update trainer-vs-engine logprob agreement metric is the end-to-end
check of the served weights.
"""

from __future__ import annotations

from typing import Any


def read_published_weights(path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(tensors, state_dict)`` of a file written by ``safetensors.torch.save_model``.

    ``tensors`` holds what the file stores; ``state_dict`` adds the tied names that ``save_model`` dropped (its
    metadata maps each dropped name to the name kept), so it has the keys of the trainer's ``state_dict()``.
    """
    from safetensors import safe_open

    tensors: dict[str, Any] = {}
    with safe_open(path, framework="pt") as handle:
        metadata = handle.metadata() or {}
        for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
            tensors[name] = handle.get_tensor(name)
    state_dict = dict(tensors)
    for dropped, kept in metadata.items():
        if dropped not in state_dict and kept in tensors:
            state_dict[dropped] = tensors[kept]
    return tensors, state_dict


class WeightSyncExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker (``reload_weights``, ``model_runner``, ...)."""

    def rlsdk_load_weights(self, path: str) -> dict[str, Any]:
        """Load the safetensors file at ``path`` into the served model; return the checksum of what was loaded.

        Never raises: an exception inside a collective RPC kills vLLM's engine core, so a failure comes back as
        ``{"error": ...}``. A failure after loading began clears the recorded checksum (the served weights may
        be partly new), so the next verification fails instead of passing on stale bookkeeping.
        """
        import time
        from concurrent.futures import ThreadPoolExecutor

        from rlsdk.engine.weights import state_dict_checksum

        start = time.perf_counter()
        try:
            tensors, state_dict = read_published_weights(path)
        except Exception as exc:
            return {"error": f"reading {path}: {type(exc).__name__}: {exc}"}
        read_s = time.perf_counter() - start
        # The checksum runs on a second thread while vLLM loads (hashlib releases the GIL): sync latency is
        # max(hash, load) instead of their sum. Recorded only when both succeeded.
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlsdk-checksum") as pool:
            pending = pool.submit(state_dict_checksum, state_dict)
            try:
                # Both tied names (e.g. lm_head.weight and model.embed_tokens.weight): vLLM then reports every
                # parameter as loaded instead of warning that the tied one was not.
                self.reload_weights(weights_iterator=iter(state_dict.items()), is_checkpoint_format=True)  # type: ignore[attr-defined]
            except Exception as exc:
                self._rlsdk_checksum = None
                return {"error": f"reload_weights from {path}: {type(exc).__name__}: {exc}"}
            load_s = time.perf_counter() - start - read_s
            try:
                checksum = pending.result()
            except Exception as exc:
                self._rlsdk_checksum = None
                return {"error": f"checksum of {path}: {type(exc).__name__}: {exc}"}
        self._rlsdk_checksum = checksum
        self._rlsdk_path = path
        return {
            "checksum": checksum,
            "path": path,
            "bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
            "read_s": read_s,
            "load_s": load_s,
            "checksum_s": time.perf_counter() - start - read_s,
        }

    def rlsdk_weight_info(self) -> dict[str, Any]:
        """The checksum of the last weights loaded through :meth:`rlsdk_load_weights` (None before the first)."""
        return {"checksum": getattr(self, "_rlsdk_checksum", None), "path": getattr(self, "_rlsdk_path", None)}
