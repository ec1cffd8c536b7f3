"""The vLLM inference engine: a client of a real vLLM server, behind the same protocol as the embedded engine.

Token ids in, token ids + per-token logprobs + per-token weight versions out, through vLLM's token-in/out
endpoint ``/inference/v1/generate`` (no detokenise/retokenise round trip). The server either runs under
:class:`~rlsdk.engine.inference.vllm_server.VLLMServer` (started by :meth:`VLLMEngine.start`, on a Unix socket in a
private directory) or is already running (:meth:`VLLMEngine.attach`). Every request carries the server's bearer
token (:mod:`rlsdk.engine.inference.vllm_auth`): a started server's own, or the one the user gave an attached one.

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
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from rlsdk.engine.inference.protocol import (
    EngineContext,
    EngineLifecycle,
    GenerateResult,
    SamplingParams,
    TrainerHandle,
    WeightInfo,
    check_synced,
)
from rlsdk.engine.inference.vllm_auth import TOKEN_ENV
from rlsdk.engine.inference.vllm_server import SERVED_MODEL_NAME, InferenceServerError, VLLMServer, http_client
from rlsdk.engine.inference.weight_transfer import FileWeightTransfer, WeightTransfer, check_worker_results
from rlsdk.generation.sampling import validate_params
from rlsdk.generation.stopping import SpecialTokens, check_stop_strings, resolve_special_tokens
from rlsdk.observe.logging import get_logger

logger = get_logger(__name__)

# Head sizes vLLM 0.32's CPU attention backend supports (CPUAttentionBackend.get_supported_head_sizes).
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


_MASK64 = (1 << 64) - 1

# LoRA (train.lora_rank > 0): the name the trainer's adapter is served under, and the ranks vLLM's
# --max-lora-rank accepts (vllm.config.lora.MaxLoRARanks).
LORA_NAME = "rlsdk-lora"
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_server_args(lora_rank: int) -> list[str]:
    """Server arguments that let it serve one LoRA adapter of rank ``lora_rank`` (the smallest
    ``--max-lora-rank`` vLLM accepts that is >= it).

    Raises:
        ValueError: ``lora_rank`` is above vLLM's largest LoRA rank.
    """
    fitting = [rank for rank in VLLM_LORA_RANKS if rank >= lora_rank]
    if not fitting:
        raise ValueError(f"train.lora_rank={lora_rank}: vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}")
    return ["--enable-lora", "--max-lora-rank", str(fitting[0]), "--max-loras", "1", "--max-cpu-loras", "1"]


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


def check_before_start(config: Any) -> None:
    """What :meth:`VLLMEngine.start` would refuse, checked before any process of a Session starts.

    Only for a server the Session starts on this machine (no ``inference.vllm.url``, scheduler 'local') without a CUDA
    device, where vLLM's CPU attention serves: a head size it does not support fails the server only once its
    model is loaded, long after the train ranks started.

    Raises:
        ConfigError: naming ``model.path`` (its head size, the sizes allowed and how to build a model that fits).
    """
    from rlsdk.config import ConfigError

    if config.inference.vllm.url is not None or config.launch.scheduler != "local" or _cuda_available():
        return
    try:
        check_cpu_head_size(config.model.path)
    except ValueError as exc:
        raise ConfigError("model.path", config.model.path, f"a model vLLM's CPU attention can serve: {exc}") from None


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _parse_version(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return -1  # "default": the server never had a version set by rlsdk


class VLLMEngine(EngineLifecycle):
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
        eos_token_ids: Sequence[int] = (),
        server: VLLMServer | None = None,
        transfer: WeightTransfer | None = None,
        request_timeout_s: float = 600.0,
        sync_timeout_s: float = 120.0,
        token: str | None = None,
        lora_rank: int = 0,
        sleep_during_train: bool = False,
    ) -> None:
        import httpx

        self.url = url.rstrip("/")
        # LoRA: syncs load the trainer's adapter (_load_lora) and generation asks for it by name once loaded.
        self.lora_name: str | None = LORA_NAME if lora_rank > 0 else None
        self._adapter_loaded = False
        self.server = server
        self.transfer: WeightTransfer = transfer if transfer is not None else FileWeightTransfer()
        self._pad_token_id = int(pad_token_id)
        # Sent as every request's stop_token_ids: vLLM's own EOS handling reads the tokenizer's one id (and the
        # generation config only with --generation-config auto), so the model's other EOS ids are named here.
        self._eos_token_ids = [int(i) for i in eos_token_ids]
        self._request_timeout_s = request_timeout_s
        self._sync_timeout_s = sync_timeout_s
        self._client = http_client(
            self.url,
            token=token,
            timeout=httpx.Timeout(request_timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=64),
        )
        self._sync_lock = asyncio.Lock()
        self._closed = False
        self.last_sync: dict[str, Any] = {}
        # A server sharing its GPU with a train rank (started with --enable-sleep-mode) frees its KV cache and
        # moves its weights to host memory while the ranks update (prepare_train), and is woken by the next call
        # that needs it (_wake): the update gets the card's memory, the server keeps its process and CUDA state.
        self.sleep_during_train = bool(sleep_during_train)
        self._asleep = False
        self.sleeps = 0  # level-1 sleeps around updates so far

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
        runtime_dir: str | None = None,
        weights_dir: str | None = None,
        special_tokens: SpecialTokens | None = None,
        lora_rank: int = 0,
        dtype: str = "float32",
        server_env: Mapping[str, str] | None = None,
        sleep_during_train: bool = False,
    ) -> VLLMEngine:
        """Start a vLLM server for ``model_path`` and return an engine serving v0 in ``dtype``
        ('float32', 'bfloat16' or 'float16').

        The server listens on a Unix socket in ``runtime_dir`` (a private 0700 directory: the Session's
        :class:`~rlsdk.runtime_dir.SessionRuntimeDir`; None = one of its own) and opens no TCP port; its token is
        fresh. ``weights_dir``: the only directory it loads published weights from (the Session's publish
        directory; None = any private rlsdk publish directory of this user). See
        :meth:`~rlsdk.engine.inference.vllm_server.VLLMServer.start`. ``special_tokens``: the pad and EOS ids
        (default: resolved from ``model_path``, see :func:`~rlsdk.engine.inference.stopping.resolve_special_tokens`);
        every EOS id stops a completion. ``server_env``: variables added to the server's environment (its GPUs:
        :meth:`rlsdk.config.device.DevicePlan.server_environment`). ``sleep_during_train``: the server sleeps
        (level 1) while the ranks update (:meth:`prepare_train`); ``extra_server_args`` must then hold
        ``--enable-sleep-mode`` (:meth:`~rlsdk.config.device.DevicePlan.server_args` adds it with a shared GPU).

        ``lora_rank > 0`` (``train.lora_rank``): the server also serves one LoRA adapter of that rank
        (``--enable-lora``, runtime adapter loading), and every sync loads the trainer's adapter instead of
        full weights.

        Raises:
            ValueError: the model's head size is not supported by vLLM's CPU attention (checked before start).
            InferenceServerError: the server exited during start-up or was not healthy in ``start_timeout_s``.
        """
        if not _cuda_available():  # vLLM's CPU attention serves: only some head sizes
            check_cpu_head_size(model_path)
        # Default: vLLM's reload (oneDNN-packed weights: fastest generation). InPlaceWeightTransfer syncs faster but
        # its plain F.linear weights generate slower on CPU (docs/howto/vllm.md has the measured trade-off).
        transfer = transfer if transfer is not None else FileWeightTransfer()
        special = special_tokens if special_tokens is not None else resolve_special_tokens(model_path)
        lora_args = lora_server_args(lora_rank) if lora_rank > 0 else []
        server = await VLLMServer.start(
            model_path,
            kv_cache_gib=kv_cache_gib,
            max_model_len=max_model_len,
            extra_args=[*transfer.server_args(), *lora_args, *extra_server_args],
            timeout_s=start_timeout_s,
            on_line=on_line,
            runtime_dir=runtime_dir,
            weights_dir=weights_dir,
            # /v1/load_lora_adapter exists only with this; only a LoRA run's server enables it.
            env={
                **os.environ,
                **(server_env or {}),
                **({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"} if lora_rank > 0 else {}),
            },
            dtype=dtype,
        )
        engine = cls(
            server.url,
            pad_token_id=special.pad_token_id,
            eos_token_ids=special.eos_token_ids,
            server=server,
            transfer=transfer,
            request_timeout_s=request_timeout_s,
            sync_timeout_s=sync_timeout_s,
            token=server.token,
            lora_rank=lora_rank,
            sleep_during_train=sleep_during_train,
        )
        try:
            await engine._post("/update_weight_version", json={"new_version": "0"}, timeout_s=sync_timeout_s)
        except BaseException:
            await engine.close()
            raise
        return engine

    @classmethod
    async def build(cls, context: EngineContext) -> VLLMEngine:
        """The Session's vLLM engine (``inference.engine='vllm'``): attached to ``inference.vllm.url`` or to the
        replica a Slurm job started, else a server started on a Unix socket in the Session's runtime directory,
        loading weights only from its publish directory. ``inference.vllm.weight_transfer`` 'auto': NCCL broadcast
        from trainer rank 0 on GPU nodes, else the file reload."""
        from rlsdk.engine.inference.weight_transfer import (
            NCCL_RANK_COMMAND,
            RankCommandTrainer,
            select_weight_transfer,
        )

        cfg, options, ranks = context.config, context.config.inference.vllm, context.trainer
        trainer = RankCommandTrainer(lambda body, t: ranks.broadcast(NCCL_RANK_COMMAND, body, timeout_s=t))
        plan = context.device_plan  # on CUDA: the server's GPUs; sharing the rank's card, a memory cap and sleep mode
        transfer = select_weight_transfer(
            cfg.launch,
            trainer,
            options.weight_transfer,
            # a server this Session starts on the rank's own card (an attached or Slurm one never shares it)
            shares_gpu=bool(plan is not None and plan.shares_gpu and options.url is None),
            rank_call=lambda command, body, t: ranks.broadcast(command, body, timeout_s=t),
        )
        url, token = options.url, None  # an attached server's token: VLLM_API_KEY (attach)
        launcher = context.launcher
        if url is None and getattr(launcher, "vllm_replicas", 0) > 0:
            # The Slurm job runs the replica on a node of its own; its endpoint comes back once it is healthy.
            url = await launcher.wait_for_endpoint(
                0, timeout_s=cfg.launch.start_timeout_s + options.server_start_timeout_s
            )
            token = launcher.vllm_token
        common: dict[str, Any] = {
            "lora_rank": cfg.train.lora_rank,
            "request_timeout_s": options.request_timeout_s,
            "sync_timeout_s": options.sync_timeout_s,
            "transfer": transfer,
            "special_tokens": context.special_tokens,
        }
        if url is not None:
            return await cls.attach(url, cfg.model.path, token=token, **common)
        # Asleep during updates only when nothing generates meanwhile: rollout.mode 'async' overlaps generation
        # with the update, which a sleeping server could not serve.
        sleep = bool(plan is not None and plan.shares_gpu and cfg.rollout.mode == "sequential")
        return await cls.start(
            cfg.model.path,
            kv_cache_gib=options.kv_cache_gib,
            max_model_len=options.max_model_len,
            extra_server_args=[*(plan.server_args() if plan else ()), *options.extra_server_args],
            server_env=plan.server_environment() if plan else None,
            start_timeout_s=options.server_start_timeout_s,
            on_line=context.on_line,
            runtime_dir=context.runtime_dir,
            weights_dir=context.publish_dir,
            dtype=cfg.inference.dtype or cfg.model.dtype,
            sleep_during_train=sleep,
            **common,
        )

    @classmethod
    async def attach(
        cls,
        url: str,
        model_path: str,
        *,
        token: str | None = None,
        request_timeout_s: float = 600.0,
        sync_timeout_s: float = 120.0,
        transfer: WeightTransfer | None = None,
        special_tokens: SpecialTokens | None = None,
        lora_rank: int = 0,
    ) -> VLLMEngine:
        """Use a running server at ``url`` (``http(s)://HOST:PORT``, or ``unix:/path/to.sock``), started with the
        flags of :func:`~rlsdk.engine.inference.vllm_server.server_command` (dev mode, ``--enable-scale-out``,
        ``--logprobs-mode processed_logprobs``, rlsdk's worker extension and its token middleware; for
        ``lora_rank > 0`` also with :func:`lora_server_args` and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True) and its
        token in ``VLLM_API_KEY``. Closing the engine leaves the server running.

        ``token``: the server's bearer token; None = this process's ``VLLM_API_KEY``. Attaching checks that the
        server refuses a request without it: a server whose development endpoints answer anyone who reaches
        them (they load weights) is refused.

        Raises:
            RuntimeError: no token; the server does not answer, answers a development endpoint without the token,
                is not in dev mode, or lacks rlsdk's worker extension.
        """
        token = token if token is not None else os.environ.get(TOKEN_ENV) or None
        how = (
            f"start it with the flags of rlsdk.engine.inference.vllm_server.server_command (among them --middleware "
            f"rlsdk.engine.inference.vllm_auth.RequireToken) and a secret token in its {TOKEN_ENV}, and give the "
            f"Session the same token in {TOKEN_ENV}"
        )
        if not token:
            raise RuntimeError(f"cannot attach to the vLLM server at {url} without its token: {how}")
        special = special_tokens if special_tokens is not None else resolve_special_tokens(model_path)
        engine = cls(
            url,
            pad_token_id=special.pad_token_id,
            eos_token_ids=special.eos_token_ids,
            transfer=transfer,
            request_timeout_s=request_timeout_s,
            sync_timeout_s=sync_timeout_s,
            token=token,
            lora_rank=lora_rank,
        )
        try:
            await engine._get("/health", timeout_s=10.0)
            async with http_client(engine.url, token=None, timeout=10.0) as anonymous:
                status = (await anonymous.get("/is_paused")).status_code
            if status != 401:
                raise RuntimeError(
                    f"it answers GET /is_paused without a token (HTTP {status}): anyone who reaches it can load "
                    f"weights into it through /collective_rpc; {how}"
                )
            await engine._rpc("rlsdk_weight_info", {}, 30.0)
        except BaseException as exc:
            await engine.close()
            raise RuntimeError(
                f"cannot attach to the vLLM server at {url}: {exc}. It must run in dev mode "
                "(VLLM_SERVER_DEV_MODE=1) with --worker-extension-cls "
                "rlsdk.engine.inference.vllm_worker.WeightSyncExtension and the token middleware"
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
        try:
            return response.json()
        except ValueError:
            return response.text  # e.g. /v1/load_lora_adapter's "Success: ..."

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
        if self._eos_token_ids:
            sampling["stop_token_ids"] = self._eos_token_ids
        if params.stop:
            # vLLM matches them on the detokenised output; the token completing one stays in token_ids (the
            # trainer trains on it), the text (not read here) would exclude the string.
            sampling["stop"] = list(params.stop)
        if seed is not None:
            sampling["seed"] = seed  # vLLM gives the n children seeds seed, seed + 1, ...
        body = await self._post(
            "/inference/v1/generate",
            json={"model": self._served_name(), "token_ids": list(prompt), "sampling_params": sampling},
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
        validate_params(params.max_new_tokens, params.temperature, params.top_k, params.top_p)
        check_stop_strings(params.stop)
        await self._wake()
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
        await self._wake()
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
                    step = f"weight transfer ({'lora' if self.lora_name else self.transfer.name}) of {path}"
                    # The prefix-cache reset (KV blocks computed with the old weights must not be reused) runs
                    # while the weights load: nothing is scheduled while paused, so no new block can be cached
                    # between the two. Only the rlsdk token-in/out text endpoint is served: no multimodal or
                    # encoder cache to clear.
                    push = self._load_lora(path, version, timeout) if self.lora_name else None
                    pushed, reset = await asyncio.gather(
                        push if push is not None else self.transfer.push(self._rpc, path, version, timeout),
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

    def _served_name(self) -> str:
        """The model name generation requests ask for: the trainer's adapter once one was loaded (LoRA), else
        the base model."""
        return LORA_NAME if self.lora_name and self._adapter_loaded else SERVED_MODEL_NAME

    async def _load_lora(self, path: str, version: int, timeout_s: float) -> dict[str, Any]:
        """LoRA: the server loads the adapter directory at ``path`` in place of the one it serves
        (``/v1/load_lora_adapter`` with ``load_inplace``: vLLM reads the directory itself); then every worker
        confirms it holds the adapter and checksums the adapter tensors under the trainer's names
        (``rlsdk_lora_loaded`` of the worker extension). ``path`` is a directory the trainer never changes once
        published (:func:`~rlsdk.engine.lora.publish_adapter`), so the bytes hashed are the bytes vLLM loaded."""
        start = time.perf_counter()
        body = {"lora_name": self.lora_name, "lora_path": path, "load_inplace": True}
        await self._post("/v1/load_lora_adapter", json=body, timeout_s=timeout_s)
        self._adapter_loaded = True
        loaded = check_worker_results(
            "rlsdk_lora_loaded", version, await self._rpc("rlsdk_lora_loaded", {"path": path}, timeout_s)
        )
        loaded["load_s"] = time.perf_counter() - start
        return loaded

    async def prepare_train(self) -> None:
        """Before the ranks update, with ``sleep_during_train``: ``/sleep?level=1&mode=wait`` (requests in flight
        finish, then vLLM discards the KV cache and moves the weights to host memory, freeing the GPU memory the
        update needs). Awaited by the Session before it sends the update; the next generation or sync wakes the
        server first (:meth:`_wake`). Nothing without ``sleep_during_train``.

        Raises:
            RuntimeError: the server did not go to sleep within ``sync_timeout_s``.
        """
        if not self.sleep_during_train or self._asleep:
            return
        async with self._sync_lock:
            try:
                await self._post("/sleep", params={"level": 1, "mode": "wait"}, timeout_s=self._sync_timeout_s)
            except Exception as exc:
                raise RuntimeError(
                    f"the vLLM server at {self.url} did not go to sleep before an update: {exc}"
                ) from exc
            self._asleep = True
            self.sleeps += 1

    async def _wake(self) -> None:
        """Wake a server :meth:`prepare_train` put to sleep (``/wake_up``: weights back on the GPU, a fresh KV
        cache, the scheduler running); nothing when it is awake."""
        if not self._asleep:
            return
        async with self._sync_lock:
            if not self._asleep:  # another call woke it while this one waited for the lock
                return
            try:
                await self._post("/wake_up", timeout_s=self._sync_timeout_s)
            except Exception as exc:
                raise RuntimeError(f"the vLLM server at {self.url} did not wake up after an update: {exc}") from exc
            self._asleep = False

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

    async def sync(self, trainer: TrainerHandle, version: int) -> WeightInfo:
        """The trainer's ``version`` to this server by its transfer, verified. NCCL or CUDA IPC (GPU, full weights):
        no file, the transfer has trainer rank 0 send and checks the workers' checksums, and what rank 0 sent is
        verified here. Otherwise rank 0 publishes a file (a LoRA run: the adapter directory) and the server loads
        it (reload or in-place)."""
        # ``direct``: the transfer moves tensors, not a file (transfers written before it: the NCCL one by name)
        if getattr(self.transfer, "direct", self.transfer.name == "nccl") and self.lora_name is None:
            info = await self.load_weights("", version)
            return check_synced(info, {"path": "", **self.transfer.last_sent}, version)  # type: ignore[attr-defined]
        return await super().sync(trainer, version)

    async def wait_failure(self) -> BaseException:
        """An unexpected exit of the server this engine started (an attached one is not supervised here)."""
        if self.server is None:
            return await super().wait_failure()
        code = await self.server.wait()
        return self.server.error(f"exited unexpectedly (exit code {code})")

    async def close(self) -> None:
        """Close the HTTP client and stop the server if this engine started it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        await self._client.aclose()
        if self.server is not None:
            await self.server.stop()
