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

In-place updates (:meth:`WeightSyncExtension.rlsdk_update_weights_inplace`, used by
:class:`~rlsdk.engine.inference.inplace_transfer.InPlaceWeightTransfer`): when the server's workers run
:class:`~rlsdk.engine.inference.vllm_plain_worker.PlainWeightSyncExtension`, :func:`keep_plain_cpu_weights` patched
vLLM's CPU GEMM dispatch before the model loaded, so every linear layer keeps its plain ``weight`` and runs
``torch.nn.functional.linear``. New weights then go through the model's own ``load_weights`` (its weight loaders
copy each tensor into its slice of the fused qkv/gate_up parameters) at memcpy speed, with no
``process_weights_after_loading`` pass.
"""

from __future__ import annotations

from typing import Any

# Whether keep_plain_cpu_weights() patched vLLM in this process, and the layers its patch left to vLLM (non-2-D
# weights, which vLLM may still repack: an in-place update refuses to run when there are any).
_PLAIN_WEIGHTS: dict[str, Any] = {"active": False, "delegated": []}


def keep_plain_cpu_weights() -> bool:
    """Make vLLM's CPU linear layers keep plain weights (``F.linear``) instead of oneDNN/SGL-packed copies.

    Replaces ``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm`` (called from the
    ``process_weights_after_loading`` of ``UnquantizedLinearMethod`` and ``UnquantizedEmbeddingMethod``, which
    import it from that module at call time) with a version that, for every 2-D weight, sets
    ``layer.cpu_linear = torch.nn.functional.linear`` and keeps ``layer.weight``, as vLLM's own fallback and its
    ``_cpu_skip_gemm_dispatch`` path do. Other layers go to vLLM's function unchanged and are recorded. Must run
    in the worker process before the model loads (vLLM imports the worker extension in ``init_worker``, before
    ``load_model``). Idempotent; returns False (and patches nothing) when vLLM is not installed or the platform
    is not CPU.
    """
    if _PLAIN_WEIGHTS["active"]:
        return True
    try:
        import torch
        import vllm.model_executor.layers.utils as layer_utils
        from vllm.platforms import current_platform
    except ImportError:
        return False
    if not current_platform.is_cpu():
        return False
    original = layer_utils.dispatch_cpu_unquantized_gemm

    def dispatch_plain(layer: Any, remove_weight: bool) -> None:
        weight = layer.weight
        if weight.is_meta or weight.ndim != 2:
            if not weight.is_meta:
                _PLAIN_WEIGHTS["delegated"].append(type(layer).__name__)
            original(layer, remove_weight)
            return
        layer.cpu_linear = torch.nn.functional.linear

    dispatch_plain.__wrapped__ = original  # type: ignore[attr-defined]
    layer_utils.dispatch_cpu_unquantized_gemm = dispatch_plain
    _PLAIN_WEIGHTS["active"] = True
    return True


def plain_weights_problem(model: Any) -> str | None:
    """Why new weights cannot be copied into ``model`` in place, or None when they can.

    In place needs :func:`keep_plain_cpu_weights` active before the model loaded, no layer left to vLLM's packing,
    every linear layer on ``F.linear`` and no emptied (packed-away) parameter.
    """
    import torch

    if not _PLAIN_WEIGHTS["active"]:
        return (
            "the server keeps packed weights (start it with --worker-extension-cls "
            "rlsdk.engine.inference.vllm_plain_worker.PlainWeightSyncExtension)"
        )
    if _PLAIN_WEIGHTS["delegated"]:
        return f"layers with non-2-D weights were left to vLLM's packing: {sorted(set(_PLAIN_WEIGHTS['delegated']))}"
    for name, module in model.named_modules():
        linear = module.__dict__.get("cpu_linear")
        if linear is not None and linear is not torch.nn.functional.linear:
            return f"{name} runs {getattr(linear, '__name__', linear)!r}, not F.linear on its plain weight"
    for name, param in model.named_parameters():
        if param.numel() == 0:
            return f"parameter {name} is empty (its weight was packed away)"
    return None


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

    def rlsdk_update_weights_inplace(self, path: str) -> dict[str, Any]:
        """Copy the weights in the safetensors file at ``path`` into the served model's parameters, in place.

        The model's own ``load_weights`` (vLLM's weight loaders: fused qkv/gate_up slices, tied embeddings) copies
        every tensor into the existing parameter; nothing is re-processed. Needs plain weights
        (:func:`plain_weights_problem`); the checksum of what was read runs on a second thread meanwhile.
        Returns what :meth:`rlsdk_load_weights` returns. Never raises: ``{"error": ..., "loaded": bool}``, where
        ``loaded`` False means the served weights were not touched (e.g. the server keeps packed weights) and
        True that they may be partly new (the recorded checksum is then cleared).
        """
        import time
        from concurrent.futures import ThreadPoolExecutor

        import torch

        from rlsdk.engine.weights import state_dict_checksum

        start = time.perf_counter()
        try:
            model = self.model_runner.get_model()  # type: ignore[attr-defined]
            problem = plain_weights_problem(model)
        except Exception as exc:
            problem = f"{type(exc).__name__}: {exc}"
        if problem is not None:
            return {"error": f"in-place update of {path} unavailable: {problem}", "loaded": False, "unsupported": True}
        try:
            tensors, state_dict = read_published_weights(path)
        except Exception as exc:
            return {"error": f"reading {path}: {type(exc).__name__}: {exc}", "loaded": False}
        read_s = time.perf_counter() - start
        expected = {name for name, _ in model.named_parameters()}
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlsdk-checksum") as pool:
            pending = pool.submit(state_dict_checksum, state_dict)
            try:
                from vllm.config import set_current_vllm_config

                with torch.no_grad(), set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
                    loaded = model.load_weights(iter(state_dict.items()))
                missing = expected - set(loaded or ())
                if missing:
                    raise RuntimeError(f"{len(missing)} parameters not in the file: {sorted(missing)[:5]}")
            except Exception as exc:
                self._rlsdk_checksum = None
                pending.cancel()
                return {"error": f"in-place load_weights from {path}: {type(exc).__name__}: {exc}", "loaded": True}
            load_s = time.perf_counter() - start - read_s
            try:
                checksum = pending.result()
            except Exception as exc:
                self._rlsdk_checksum = None
                return {"error": f"checksum of {path}: {type(exc).__name__}: {exc}", "loaded": True}
        self._rlsdk_checksum = checksum
        self._rlsdk_path = path
        return {
            "checksum": checksum,
            "path": path,
            "bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
            "read_s": read_s,
            "load_s": load_s,
            "checksum_s": time.perf_counter() - start - read_s,
            "inplace": True,
        }

    def rlsdk_weight_info(self) -> dict[str, Any]:
        """The checksum of the last weights loaded through :meth:`rlsdk_load_weights` (None before the first)."""
        return {"checksum": getattr(self, "_rlsdk_checksum", None), "path": getattr(self, "_rlsdk_path", None)}
