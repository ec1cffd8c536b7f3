"""The vLLM inference engine: a client of a real vLLM server, behind the same protocol as the embedded engine.

Token ids in, token ids + per-token logprobs + per-token weight versions out, through vLLM's token-in/out
endpoint ``/inference/v1/generate`` (no detokenise/retokenise round trip). The server either runs under
:class:`~rlsdk.engine.inference.vllm_server.VLLMServer` (started by :meth:`VLLMEngine.start`) or is already
running (:meth:`VLLMEngine.attach`).

A weight sync (:meth:`VLLMEngine.load_weights`) is: ``/sleep?level=0&mode=wait`` (vLLM's scheduler pause:
in-flight requests finish on the old weights, new ones queue; ``/pause`` adds a fixed 20 ms sleep) -> the weight
transfer (by default :class:`FileWeightTransfer`: the worker extension reloads the published file; opt-in
:class:`~rlsdk.engine.inference.inplace_transfer.InPlaceWeightTransfer` writes it into plain served parameters;
both checksum what they load) with ``/reset_prefix_cache`` alongside -> ``/update_weight_version`` ->
``/wake_up?tags=scheduling`` (resume), and the resume runs whatever happened before it. Every step has a
timeout; a failure raises :class:`WeightSyncError` naming the version, the server and the cause.

Requires ``httpx`` (installed with the ``vllm`` extra); imported when an engine is built.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from rlsdk.engine.inference.embedded import model_token_ids
from rlsdk.engine.inference.protocol import GenerateResult, SamplingParams, WeightInfo
from rlsdk.engine.inference.sampling import _validate_params
from rlsdk.engine.inference.vllm_server import SERVED_MODEL_NAME, InferenceServerError, VLLMServer
from rlsdk.engine.inference.weight_transfer import FileWeightTransfer, WeightTransfer
from rlsdk.observe.logging import get_logger

logger = get_logger(__name__)

# Head sizes vLLM 0.32's CPU attention backend supports (CPUAttentionBackend.get_supported_head_sizes).
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


_MASK64 = (1 << 64) - 1


def request_seed(seed: int, row: int) -> int:
    """The vLLM seed of the request whose first sample is row ``row`` of a seeded ``generate`` call: a splitmix64
    hash of ``(seed, row)``, in ``[0, 2**63)``.

    Not ``seed + row``: vLLM seeds a request's ``n`` samples with ``seed + 0 .. n-1``, and the Session's per-rollout
    seeds are consecutive, so additive seeds make rollout ``r + 1`` replay rollout ``r``'s random streams shifted
    by one sample (the same exploration noise every step).
    """
    z = (seed * 0x9E3779B97F4A7C15 + row + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


class WeightSyncError(RuntimeError):
    """A weight sync to the vLLM server failed or timed out; the server was resumed (never left paused)."""

    def __init__(self, version: int, url: str, cause: str) -> None:
        self.version = version
        self.url = url
        self.cause = cause
        super().__init__(f"weight sync of v{version} to the vLLM server at {url} failed: {cause}")


def check_cpu_head_size(path: str | Path) -> None:
    """Raise ValueError before a server starts when vLLM's CPU attention cannot serve the model's head size."""
    import json

    config = json.loads((Path(path) / "config.json").read_text())
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    head_dim = config.get("head_dim") or (hidden // heads if hidden and heads else None)
    if head_dim is not None and head_dim not in CPU_HEAD_SIZES:
        raise ValueError(
            f"model {path} has head_dim={head_dim}; vLLM's CPU attention supports head sizes {list(CPU_HEAD_SIZES)} "
            "(the tiny policy needs build_tiny_policy(path, num_heads=2) for head_dim 32)"
        )


def _parse_version(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return -1  # "default": the server never had a version set by rlsdk


class VLLMEngine:
    """An :class:`~rlsdk.engine.inference.protocol.InferenceEngine` over a vLLM server's HTTP API.

    Build it with :meth:`start` (launch and supervise a server) or :meth:`attach` (use a running one). Token
    versions come from the server (``weight_versions`` spans per output token), so a generation that spans a
    sync reports both versions.
    """

    def __init__(
        self,
        url: str,
        *,
        pad_token_id: int,
        server: VLLMServer | None = None,
        transfer: WeightTransfer | None = None,
        request_timeout_s: float = 600.0,
        sync_timeout_s: float = 120.0,
    ) -> None:
        import httpx

        self.url = url.rstrip("/")
        self.server = server
        self.transfer: WeightTransfer = transfer if transfer is not None else FileWeightTransfer()
        self._pad_token_id = int(pad_token_id)
        self._request_timeout_s = request_timeout_s
        self._sync_timeout_s = sync_timeout_s
        self._client = httpx.AsyncClient(
            base_url=self.url,
            timeout=httpx.Timeout(request_timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=64),
        )
        self._sync_lock = asyncio.Lock()
        self._closed = False
        self.last_sync: dict[str, Any] = {}

    # ------------------------------------------------------------------ construction
    @classmethod
    async def start(
        cls,
        model_path: str,
        *,
        kv_cache_gib: int = 1,
        max_model_len: int | None = None,
        extra_server_args: Sequence[str] = (),
        start_timeout_s: float = 300.0,
        request_timeout_s: float = 600.0,
        sync_timeout_s: float = 120.0,
        on_line: Callable[[str], None] | None = None,
        transfer: WeightTransfer | None = None,
        dtype: str = "float32",
    ) -> VLLMEngine:
        """Start a vLLM server for ``model_path`` on 127.0.0.1 (free port) and return an engine serving v0, in
        ``dtype`` ('float32', 'bfloat16' or 'float16').

        Raises:
            ValueError: the model's head size is not supported by vLLM's CPU attention (checked before start).
            InferenceServerError: the server exited during start-up or was not healthy in ``start_timeout_s``.
        """
        check_cpu_head_size(model_path)
        # Default: vLLM's reload (oneDNN-packed weights: fastest generation). InPlaceWeightTransfer syncs faster but
        # its plain F.linear weights generate ~2x slower on CPU (docs/howto/vllm.md, "Measured here").
        transfer = transfer if transfer is not None else FileWeightTransfer()
        pad_token_id, _ = model_token_ids(model_path)
        server = await VLLMServer.start(
            model_path,
            kv_cache_gib=kv_cache_gib,
            max_model_len=max_model_len,
            extra_args=[*transfer.server_args(), *extra_server_args],
            timeout_s=start_timeout_s,
            on_line=on_line,
            dtype=dtype,
        )
        engine = cls(
            server.url,
            pad_token_id=pad_token_id,
            server=server,
            transfer=transfer,
            request_timeout_s=request_timeout_s,
            sync_timeout_s=sync_timeout_s,
        )
        try:
            await engine._post("/update_weight_version", json={"new_version": "0"}, timeout_s=sync_timeout_s)
        except BaseException:
            await engine.close()
            raise
        return engine

    @classmethod
    async def attach(
        cls,
        url: str,
        model_path: str,
        *,
        request_timeout_s: float = 600.0,
        sync_timeout_s: float = 120.0,
        transfer: WeightTransfer | None = None,
    ) -> VLLMEngine:
        """Use a running server at ``url`` (started with VLLM_SERVER_DEV_MODE=1, ``--enable-scale-out``,
        ``--logprobs-mode processed_logprobs`` and ``--worker-extension-cls`` rlsdk's extension; see
        :func:`~rlsdk.engine.inference.vllm_server.server_command`). Closing the engine leaves the server running.

        Raises:
            RuntimeError: the server does not answer, is not in dev mode, or lacks rlsdk's worker extension.
        """
        pad_token_id, _ = model_token_ids(model_path)
        engine = cls(
            url,
            pad_token_id=pad_token_id,
            transfer=transfer,
            request_timeout_s=request_timeout_s,
            sync_timeout_s=sync_timeout_s,
        )
        try:
            await engine._get("/health", timeout_s=10.0)
            await engine._rpc("rlsdk_weight_info", {}, 30.0)
        except BaseException as exc:
            await engine.close()
            raise RuntimeError(
                f"cannot attach to the vLLM server at {url}: {exc}. It must run in dev mode "
                "(VLLM_SERVER_DEV_MODE=1) with --worker-extension-cls "
                "rlsdk.engine.inference.vllm_worker.WeightSyncExtension"
            ) from exc
        return engine

    # ------------------------------------------------------------------ HTTP helpers
    @property
    def pad_token_id(self) -> int:
        return self._pad_token_id

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("VLLMEngine is closed")
        if self.server is not None and self.server.returncode is not None:
            raise self.server.error("exited")

    async def _request(self, method: str, path: str, *, timeout_s: float, **kwargs: Any) -> Any:
        import httpx

        self._check_open()
        try:
            response = await self._client.request(method, path, timeout=timeout_s, **kwargs)
        except httpx.TimeoutException as exc:
            raise TimeoutError(f"{method} {self.url}{path} timed out after {timeout_s:.0f} s") from exc
        except httpx.HTTPError as exc:
            if self.server is not None:
                # A dropped connection is often a server shutting down (its graceful exit takes seconds):
                # report the exit code and last log lines rather than the bare connection error.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.server.wait_exit(0.05), timeout=15.0)
                if self.server.returncode is not None:
                    raise self.server.error("exited") from exc
            raise ConnectionError(f"{method} {self.url}{path} failed: {type(exc).__name__}: {exc}") from exc
        if response.status_code != 200:
            raise RuntimeError(
                f"{method} {self.url}{path} answered HTTP {response.status_code}: {response.text[:1000]}"
            )
        if not response.content:
            return None
        return response.json()

    async def _get(self, path: str, *, timeout_s: float, **kwargs: Any) -> Any:
        return await self._request("GET", path, timeout_s=timeout_s, **kwargs)

    async def _post(self, path: str, *, timeout_s: float, **kwargs: Any) -> Any:
        return await self._request("POST", path, timeout_s=timeout_s, **kwargs)

    async def _rpc(self, method: str, kwargs: dict[str, Any], timeout_s: float) -> list[Any]:
        body = await self._post(
            "/collective_rpc",
            json={"method": method, "kwargs": kwargs, "timeout": timeout_s},
            timeout_s=timeout_s + 5.0,
        )
        return list((body or {}).get("results") or [])

    # ------------------------------------------------------------------ generation
    async def _generate_group(
        self, prompt: Sequence[int], count: int, params: SamplingParams, seed: int | None
    ) -> list[dict[str, Any]]:
        sampling: dict[str, Any] = {
            "n": count,
            "max_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k,
            "logprobs": 0,
        }
        if seed is not None:
            sampling["seed"] = seed  # vLLM gives the n children seeds seed, seed + 1, ...
        body = await self._post(
            "/inference/v1/generate",
            json={"model": SERVED_MODEL_NAME, "token_ids": list(prompt), "sampling_params": sampling},
            timeout_s=self._request_timeout_s,
        )
        choices = sorted(body["choices"], key=lambda choice: choice["index"])
        if len(choices) != count:
            raise RuntimeError(f"vLLM server at {self.url} returned {len(choices)} completions, asked for {count}")
        return choices

    async def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams) -> GenerateResult:
        """Sample one completion per prompt on the server; same contract as the embedded engine's ``generate``.

        Consecutive identical prompts go out as one request with ``n`` samples. With ``params.seed`` set, the
        request starting at row ``i`` uses seed :func:`request_seed` ``(params.seed, i)`` (vLLM gives its ``n``
        samples that seed + 0 .. n-1): reproducible on the same server and weights.
        ``logprobs_B_C`` are vLLM's ``processed_logprobs``: ``log_softmax(logits / temperature)``, equal to the
        trainer's recomputation when top-k/top-p are off (with them on, vLLM renormalises over the kept tokens).

        Raises:
            ValueError: empty prompt list or prompt, or invalid sampling parameters.
            InferenceServerError: the supervised server exited (exit code and last log lines).
            RuntimeError / TimeoutError / ConnectionError: the server rejected or did not answer a request.
        """
        _validate_params(params.max_new_tokens, params.temperature, params.top_k, params.top_p)
        prompts = [list(ids) for ids in prompt_ids]
        if not prompts:
            raise ValueError("prompt_ids is empty: need at least one prompt")
        for index, ids in enumerate(prompts):
            if not ids:
                raise ValueError(f"prompt_ids[{index}] is empty: every prompt needs at least one token")
        groups: list[tuple[int, int]] = []  # (first row, count) of runs of identical prompts
        for row, ids in enumerate(prompts):
            if groups and prompts[groups[-1][0]] == ids:
                groups[-1] = (groups[-1][0], groups[-1][1] + 1)
            else:
                groups.append((row, 1))
        from rlsdk.observe.progress import progress_sink

        sink = progress_sink()

        async def group(first: int, count: int) -> list[dict[str, Any]]:
            choices = await self._generate_group(
                prompts[first], count, params, None if params.seed is None else request_seed(params.seed, first)
            )
            if sink is not None:
                sink(count)
            return choices

        results = await asyncio.gather(*(group(first, count) for first, count in groups))
        choices = [choice for group in results for choice in group]
        width = max(len(choice["token_ids"]) for choice in choices)
        batch = len(choices)
        ids_B_C = torch.full((batch, width), self._pad_token_id, dtype=torch.long)
        mask_B_C = torch.zeros((batch, width), dtype=torch.bool)
        logprobs_B_C = torch.zeros((batch, width), dtype=torch.float32)
        versions_B_C = torch.full((batch, width), -1, dtype=torch.long)
        for row, choice in enumerate(choices):
            tokens = choice["token_ids"]
            n = len(tokens)
            if n == 0:
                continue
            content = (choice.get("logprobs") or {}).get("content") or []
            if len(content) != n:
                raise RuntimeError(f"vLLM server at {self.url} returned {len(content)} logprobs for {n} tokens")
            ids_B_C[row, :n] = torch.as_tensor(tokens, dtype=torch.long)
            mask_B_C[row, :n] = True
            logprobs_B_C[row, :n] = torch.as_tensor([entry["logprob"] for entry in content], dtype=torch.float32)
            for span in choice.get("weight_versions") or []:
                versions_B_C[row, span["start"] : span["end"]] = _parse_version(span["version"])
        if bool(((versions_B_C < 0) & mask_B_C).any()):
            raise RuntimeError(
                f"vLLM server at {self.url} returned tokens without an rlsdk weight version "
                "(was /update_weight_version ever called? the engine sets it at start and on every sync)"
            )
        return GenerateResult(
            completion_ids_B_C=ids_B_C,
            completion_mask_B_C=mask_B_C,
            logprobs_B_C=logprobs_B_C,
            versions_B_C=versions_B_C,
        )

    # ------------------------------------------------------------------ weights
    async def load_weights(self, path: str, version: int) -> WeightInfo:
        """Load the weights published at ``path`` and serve them as ``version``; returns what the server serves.

        Pauses the server's scheduler (``/sleep?level=0&mode=wait``: requests in flight complete on the old
        weights, later ones queue and run on the new ones after the resume), pushes the weights through the
        transfer while clearing the prefix cache (checked: vLLM answers ``success``), sets the version and ALWAYS
        resumes, also on failure.

        Raises:
            WeightSyncError: any step failed or took longer than ``sync_timeout_s``; names the version, the
                server and the cause.
        """
        async with self._sync_lock:
            start = time.perf_counter()
            timeout = self._sync_timeout_s
            step = "pause"
            paused_s = float("nan")
            marks: dict[str, float] = {}  # when each step ended, for last_sync's breakdown
            loaded: dict[str, Any] = {}
            failure: tuple[str, Exception] | None = None
            resume_failure: Exception | None = None
            try:
                try:
                    # vLLM's /pause?mode=wait ends with a fixed 20 ms asyncio.sleep (AsyncLLM.pause_generation,
                    # "not required for correctness"): most of an idle pause. /sleep?level=0&mode=wait runs the
                    # same engine-core pause (pause_scheduler, mode "wait": in-flight requests finish on the old
                    # weights, new ones queue) without it and without clearing caches, which this sync does itself
                    # below. Token weight versions are stamped in the engine core, so no output is mislabelled.
                    await self._post("/sleep", params={"level": 0, "mode": "wait"}, timeout_s=timeout)
                    paused_s = time.perf_counter() - start
                    step = f"weight transfer ({self.transfer.name}) of {path}"
                    # The prefix-cache reset (KV blocks computed with the old weights must not be reused) runs
                    # while the weights load: nothing is scheduled while paused, so no new block can be cached
                    # between the two. Only the rlsdk token-in/out text endpoint is served: no multimodal or
                    # encoder cache to clear.
                    pushed, reset = await asyncio.gather(
                        self.transfer.push(self._rpc, path, version, timeout),
                        self._post("/reset_prefix_cache", timeout_s=timeout),
                        return_exceptions=True,
                    )
                    if isinstance(pushed, BaseException):
                        raise pushed
                    loaded = pushed
                    marks["transfer"] = time.perf_counter()
                    step = "reset_prefix_cache"
                    if isinstance(reset, BaseException):
                        raise reset
                    if isinstance(reset, dict) and reset.get("success") is False:
                        raise RuntimeError(f"POST {self.url}/reset_prefix_cache answered {reset}")
                    step = "update_weight_version"
                    await self._post("/update_weight_version", json={"new_version": str(version)}, timeout_s=timeout)
                    marks["version"] = time.perf_counter()
                except Exception as exc:
                    failure = (step, exc)
            finally:  # also on cancellation: never leave the server paused
                try:
                    await self._resume(timeout)
                    marks["resume"] = time.perf_counter()
                except Exception as exc:
                    resume_failure = exc
            for error in (failure[1] if failure else None, resume_failure):
                if isinstance(error, InferenceServerError):
                    raise error  # the server died: its exit code and last log lines say more than the step
            if failure is not None or resume_failure is not None:
                parts = [f"{failure[0]}: {type(failure[1]).__name__}: {failure[1]}"] if failure else []
                if resume_failure is not None:
                    parts.append(f"resume: {type(resume_failure).__name__}: {resume_failure}")
                raise WeightSyncError(version, self.url, "; then ".join(parts)) from (
                    failure[1] if failure else resume_failure
                )
            info = await self.weight_info()
            end = time.perf_counter()
            self.last_sync = {
                "version": version,
                "seconds": end - start,
                "pause_s": paused_s,
                # The steps after the pause: the transfer (with the prefix-cache reset alongside), the version,
                # resume, and the read-back.
                "transfer_s": marks["transfer"] - start - paused_s,
                "version_s": marks["version"] - marks["transfer"],
                "resume_s": marks["resume"] - marks["version"],
                "verify_s": end - marks["resume"],
                "bytes": loaded.get("bytes"),
                "load_s": loaded.get("load_s"),
                "read_s": loaded.get("read_s"),
                "checksum_s": loaded.get("checksum_s"),
                "inplace": bool(loaded.get("inplace")),
                "fallback": loaded.get("fallback"),
            }
            logger.info(
                "vLLM server at %s serves v%d (checksum %s, sync %.3f s)",
                self.url,
                info.version,
                info.checksum[:12],
                self.last_sync["seconds"],
            )
            return info

    async def _resume(self, timeout_s: float) -> None:
        """End the level-0 sleep of :meth:`load_weights`: ``/wake_up?tags=scheduling`` resumes the scheduler and
        marks the engine awake in vLLM's metrics. ``/resume`` (unconditional) when that did not leave it awake,
        e.g. because someone put the executor to sleep meanwhile: a sync never leaves the server paused."""
        body = await self._post("/wake_up", params={"tags": "scheduling"}, timeout_s=timeout_s)
        if not (isinstance(body, dict) and body.get("status") == "awake"):
            await self._post("/resume", timeout_s=timeout_s)

    async def weight_info(self) -> WeightInfo:
        """The version the server reports (``/weight_info``) and the checksum of the weights its worker loaded
        last through rlsdk (empty string before the first sync)."""
        body, results = await asyncio.gather(
            self._get("/weight_info", timeout_s=self._sync_timeout_s),
            self._rpc("rlsdk_weight_info", {}, self._sync_timeout_s),
        )
        checksums = {(r or {}).get("checksum") for r in results}
        if len(checksums) != 1:
            raise RuntimeError(f"vLLM server workers at {self.url} report different weights: {checksums}")
        return WeightInfo(version=_parse_version(body.get("weight_version")), checksum=checksums.pop() or "")

    async def close(self) -> None:
        """Close the HTTP client and stop the server if this engine started it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        await self._client.aclose()
        if self.server is not None:
            await self.server.stop()
