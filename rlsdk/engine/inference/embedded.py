"""The embedded inference engine: a transformers model in this process, served from one worker thread.

The default backend on CPU (no server to start). Generation and weight loads run on one dedicated thread, so
the model is never used by two threads and the asyncio event loop stays free while they run. A weight load that
arrives during a generation is applied by that generation between two decode steps (a partial rollout: the
tokens before carry the old version, the tokens after the new one), as vLLM does for requests in flight across
a weight update; it never waits for the whole generation.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch

from rlsdk.engine.inference.protocol import EngineContext, EngineLifecycle, GenerateResult, SamplingParams, WeightInfo
from rlsdk.engine.weights import state_dict_checksum
from rlsdk.generation.sampling import DecodeStep, sample_completions
from rlsdk.generation.stopping import SpecialTokens, StopCriteria, resolve_special_tokens, token_id_list

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

Dtype = Literal["float32", "bfloat16", "float16"]
_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def model_token_ids(path: str | Path) -> tuple[int, int]:
    """``(pad_token_id, eos_token_id)`` of a model directory: the pad id and the first EOS id of
    :func:`~rlsdk.generation.stopping.resolve_special_tokens` (which every engine uses; this pair is for
    code that knows one EOS id).

    Raises:
        ValueError: no eos id in the generation config or tokenizer.
    """
    special = resolve_special_tokens(path)
    return special.pad_token_id, special.eos_token_id


def single_thread_caller() -> Callable[[], None]:
    """Run the calling thread's own torch ops on one intra-op thread; returns the function that restores its
    previous count (call it on the same thread).

    Why a Session does this on its event-loop thread while it runs: torch's CPU ops run on GNU OpenMP, which gives
    every thread that runs a multi-threaded op a team of its own, and a team's workers spin-wait on their core
    after every op (libgomp's default spin count: milliseconds). The controller's own tensor work (advantages,
    masks, indexing of a rollout) is small, but each such op left a worker spinning on a core the train ranks
    needed. Two teams are worse: once the process holds more OpenMP threads than the machine has cores, libgomp
    stops spin-waiting (its "throttled" spin count) and every op pays a sleep/wake-up, the embedded engine's
    generation included, from the controller's first small tensor op on (a version mask). With one
    intra-op thread this thread creates no team. OpenMP keeps the count per thread, so the embedded engine's
    thread (``inference.embedded.num_threads``, set on that thread) and the ranks (other processes) keep theirs; a
    thread torch starts later begins with the count set last (1).
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)

    def restore() -> None:
        torch.set_num_threads(previous)

    return restore


class EmbeddedEngine(EngineLifecycle):
    """An :class:`~rlsdk.engine.inference.protocol.InferenceEngine` over an in-process transformers model.

    Build it with :meth:`from_pretrained`. All model work runs on one dedicated worker thread (a single-thread
    executor). A ``load_weights`` that arrives while a ``generate`` runs is applied by that generation before
    its next decode step (or its next chunk of prompts), and ``versions_B_C`` records, per token, the version
    that produced it; without overlapping calls every token of one ``generate`` carries the same version.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        pad_token_id: int,
        eos_token_id: int | Sequence[int],
        max_batch_size: int = 1024,
        version: int = 0,
        num_threads: int | None = None,
        tokenizer: Any = None,
        decode_step: DecodeStep = "eager",
    ) -> None:
        """Serve ``model`` (put in eval mode) as ``version``. ``eos_token_id``: the id, or every id, that ends a
        completion. ``tokenizer``: decodes completions to match ``SamplingParams.stop`` strings (a request with
        stop strings and no tokenizer raises ValueError). ``decode_step``: 'eager' or 'compile'
        (``inference.decode_step``; see :func:`~rlsdk.generation.sampling.decode_forward`).

        Raises:
            ValueError: ``max_batch_size < 1``, ``num_threads < 1`` or an unknown ``decode_step``.
        """
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size!r} is invalid: allowed >= 1")
        if num_threads is not None and num_threads < 1:
            raise ValueError(f"num_threads={num_threads!r} is invalid: allowed >= 1 or None")
        if decode_step not in ("eager", "compile"):
            raise ValueError(f"decode_step={decode_step!r} is invalid: allowed 'eager' or 'compile'")
        self._decode_step: DecodeStep = decode_step
        self._model = model.eval()
        self._pad_token_id = int(pad_token_id)
        self._eos_token_ids = tuple(token_id_list(eos_token_id))
        if not self._eos_token_ids:
            raise ValueError("eos_token_id is empty: need at least one id that ends a completion")
        self._tokenizer = tokenizer
        self._tokenizer_path: Path | None = None  # from_pretrained's directory: its tokenizer, loaded when needed
        self._max_batch_size = max_batch_size
        self._version = version
        self._checksum = state_dict_checksum(self._model.state_dict())
        self._generator = torch.Generator(device=next(self._model.parameters()).device)
        self._generator.seed()
        self._closed = False
        self._serves_model_as_trained = False  # see build() and verify_initial()
        # A load requested while a generation runs: (path, version); the generation applies it between decode
        # steps. _applied is the last (path, version) loaded, so the queued load job does not load it twice.
        self._pending_lock = threading.Lock()
        self._pending_load: tuple[str, int] | None = None
        self._applied: tuple[str, int] | None = None
        # The worker thread's intra-op thread count: OpenMP keeps it per thread (torch starts a new thread with
        # the count set last, by any thread), so it is set on the worker thread itself, to ``num_threads`` or
        # else to the count the constructing thread has now.
        self._num_threads = num_threads if num_threads is not None else torch.get_num_threads()
        self._executor = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="rlsdk-embedded-engine",
            initializer=torch.set_num_threads,
            initargs=(self._num_threads,),
        )

    @property
    def num_threads(self) -> int:
        """torch intra-op threads the engine's worker thread generates with."""
        return self._num_threads

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        dtype: Dtype = "float32",
        num_threads: int | None = None,
        max_batch_size: int = 1024,
        version: int = 0,
        special_tokens: SpecialTokens | None = None,
        tokenizer: Any = None,
        decode_step: DecodeStep = "eager",
    ) -> EmbeddedEngine:
        """Load a causal LM saved with ``save_pretrained`` at ``path`` (CPU, eval mode).

        The pad and EOS ids are ``special_tokens``, else :func:`~rlsdk.generation.stopping.resolve_special_tokens`
        of ``path`` (every EOS id of ``generation_config.json`` and the tokenizer; pad = EOS when there is no pad).
        ``tokenizer`` (else the directory's, loaded on the first request with stop strings) decodes completions to
        match stop strings. ``num_threads`` (default: the calling thread's
        ``torch.get_num_threads()``) is applied with ``torch.set_num_threads`` on the engine's worker thread; with
        torch's OpenMP backend that count is the worker thread's own, other threads keep theirs (see
        :func:`single_thread_caller`).

        Raises:
            ValueError: unknown ``dtype``, or no eos id in the generation config or tokenizer.
        """
        from transformers import AutoModelForCausalLM

        if dtype not in _DTYPES:
            raise ValueError(f"dtype={dtype!r} is invalid: allowed {sorted(_DTYPES)}")
        path = Path(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=_DTYPES[dtype])
        special = special_tokens if special_tokens is not None else resolve_special_tokens(path, tokenizer)
        logger.info("embedded engine serving %s (dtype %s) as version %d", path, dtype, version)
        engine = cls(
            model,
            pad_token_id=special.pad_token_id,
            eos_token_id=special.eos_token_ids,
            max_batch_size=max_batch_size,
            version=version,
            num_threads=num_threads,
            tokenizer=tokenizer,
            decode_step=decode_step,
        )
        engine._tokenizer_path = path
        return engine

    @classmethod
    async def build(cls, context: EngineContext) -> EmbeddedEngine:
        """The Session's embedded engine (``inference.engine='embedded'``): ``model.path`` in ``inference.dtype``,
        loaded on a worker thread."""
        cfg = context.config
        inference = cfg.inference
        engine = await asyncio.to_thread(
            cls.from_pretrained,
            cfg.model.path,
            dtype=inference.dtype or cfg.model.dtype,
            num_threads=inference.embedded.num_threads or context.num_threads,  # None: the Session's default
            max_batch_size=inference.max_batch_size,
            special_tokens=context.special_tokens,
            decode_step=inference.decode_step,
        )
        # Loaded from model.path in the trainer's dtype, full weights: its checksum is comparable with the
        # trainer's v0 as it is, so the start needs no sync (see verify_initial).
        engine._serves_model_as_trained = (inference.dtype or cfg.model.dtype) == cfg.model.dtype
        return engine

    async def verify_initial(self, trainer: Any, *, resumed: bool) -> WeightInfo | None:
        """Check the weights loaded from ``model.path`` against the trainer's v0 without a sync. A resumed
        trainer is at the checkpoint's version, which this engine is not; with LoRA it serves the base alone
        until it loads the trainer's v0 adapter (the base both sides loaded is checked here); an engine serving
        another dtype checksums the published bytes it loads. Those are synced (None)."""
        from rlsdk.versioning import WeightMismatchError

        served = await self.weight_info()
        if trainer.get("base_checksum") is not None:
            # LoRA: the adapter sync verifies only the adapter; the base both sides loaded is checked here.
            if served.checksum != trainer["base_checksum"]:
                raise WeightMismatchError(
                    f"LoRA base weights differ: trainer {trainer['base_checksum'][:12]}, engine {served.checksum[:12]}"
                )
            return None
        if resumed or not self._serves_model_as_trained:
            return None
        if served.checksum != trainer["checksum"] or served.version != trainer["version"]:
            raise WeightMismatchError(
                f"initial weights differ: trainer v{trainer['version']} checksum {trainer['checksum'][:12]}, "
                f"engine v{served.version} checksum {served.checksum[:12]}"
            )
        return served

    @property
    def pad_token_id(self) -> int:
        """Id that pads completions past their end."""
        return self._pad_token_id

    @property
    def eos_token_id(self) -> int:
        """The first id that ends a completion."""
        return self._eos_token_ids[0]

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends a completion."""
        return self._eos_token_ids

    def _stop_criteria(self, params: SamplingParams) -> StopCriteria:
        """On the worker thread: the EOS ids, and ``params.stop`` matched on text decoded by the tokenizer."""
        if params.stop and self._tokenizer is None:
            if self._tokenizer_path is None:
                raise ValueError("stop strings need the engine's tokenizer: build it with tokenizer=...")
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self._tokenizer_path)
        tokenizer = self._tokenizer

        def decode(ids: list[int]) -> str:
            return tokenizer.decode(ids, skip_special_tokens=True)

        return StopCriteria(self._eos_token_ids, params.stop, decode if params.stop else None)

    @property
    def version(self) -> int:
        """Weight version served now (changes only when a ``load_weights`` completes)."""
        return self._version

    @property
    def model(self) -> torch.nn.Module:
        """The served model. Mutating it outside :meth:`load_weights` bypasses versioning."""
        return self._model

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("EmbeddedEngine is closed")

    async def _run(self, fn: Callable[..., _T], *args: Any) -> _T:
        self._check_open()
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _generate_sync(
        self,
        prompt_ids: Sequence[Sequence[int]],
        params: SamplingParams,
        on_samples: Callable[[int], None] | None = None,
    ) -> GenerateResult:
        if params.seed is not None:
            generator = torch.Generator(device=self._generator.device).manual_seed(params.seed)
        else:
            generator = self._generator
        stop_criteria = self._stop_criteria(params)
        chunks = []
        for start in range(0, len(prompt_ids), self._max_batch_size):
            self._apply_pending_load()
            switches = [(0, self._version)]  # (first token column, version) of this chunk

            def before_step(column: int, switches: list[tuple[int, int]] = switches) -> None:
                if self._apply_pending_load():
                    switches.append((column, self._version))

            ids_B_C, mask_B_C, logprobs_B_C = sample_completions(
                self._model,
                prompt_ids[start : start + self._max_batch_size],
                params,
                pad_token_id=self._pad_token_id,
                eos_token_id=self._eos_token_ids,
                generator=generator,
                before_step=before_step,
                stop_criteria=stop_criteria,
                decode_step=self._decode_step,
            )
            versions_B_C = torch.full_like(ids_B_C, -1)
            for column, version in switches:
                versions_B_C[:, column:] = version
            chunks.append((ids_B_C, mask_B_C, logprobs_B_C, torch.where(mask_B_C, versions_B_C, -1)))
            if on_samples is not None:
                on_samples(ids_B_C.shape[0])
        width = max(chunk[0].shape[1] for chunk in chunks)

        def pad_right(tensor: torch.Tensor, value: float | int | bool) -> torch.Tensor:
            return torch.nn.functional.pad(tensor, (0, width - tensor.shape[1]), value=value)

        return GenerateResult(
            completion_ids_B_C=torch.cat([pad_right(c[0], self._pad_token_id) for c in chunks]).cpu(),
            completion_mask_B_C=torch.cat([pad_right(c[1], False) for c in chunks]).cpu(),
            logprobs_B_C=torch.cat([pad_right(c[2], 0.0) for c in chunks]).float().cpu(),
            versions_B_C=torch.cat([pad_right(c[3], -1) for c in chunks]).cpu(),
        )

    def _apply_pending_load(self) -> bool:
        """On the worker thread, inside a generation: load the weights a concurrent ``load_weights`` asked for.
        Returns whether it loaded."""
        with self._pending_lock:
            request, self._pending_load = self._pending_load, None
        if request is None:
            return False
        self._load_weights_sync(*request)
        logger.debug("applied v%d during a generation (partial rollout)", request[1])
        return True

    async def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams) -> GenerateResult:
        """Sample one completion per prompt (see :func:`~rlsdk.generation.sampling.sample_completions`).

        Prompts are processed in chunks of ``max_batch_size``; the result is right-padded to the longest
        completion ``C`` of all chunks. With ``params.seed`` set, the call is reproducible for the same
        prompts, parameters, weights and ``max_batch_size``; without it, draws come from the engine's own
        generator. ``versions_B_C`` is the served version where the mask is True, else -1.

        Raises:
            ValueError: empty prompt list or prompt, or invalid sampling parameters.
            RuntimeError: the engine is closed.
        """
        from rlsdk.observe.progress import progress_sink

        return await self._run(self._generate_sync, list(prompt_ids), params, progress_sink())

    def _load_weights_sync(self, path: str, version: int) -> WeightInfo:
        from safetensors.torch import load_model

        if Path(path).is_dir():
            self._load_adapter_sync(path)
        elif self._casts(path):
            from rlsdk.engine.inference.vllm_worker import read_published_weights

            # Served in another dtype than published (inference.dtype): the served tensors cannot match the
            # trainer's checksum, so the checksum is of what was read, the trainer's bytes (as vLLM's worker).
            _, state_dict = read_published_weights(path)
            self._model.load_state_dict(state_dict, strict=True)
            self._checksum = state_dict_checksum(state_dict)
        else:
            load_model(self._model, path, strict=True)
            self._checksum = state_dict_checksum(self._model.state_dict())
        self._version = version
        self._applied = (path, version)
        logger.info("embedded engine loaded %s as version %d (checksum %s)", path, version, self._checksum[:12])
        return WeightInfo(version=self._version, checksum=self._checksum)

    def _load_adapter_sync(self, path: str) -> None:
        """LoRA (``train.lora_rank``): apply the peft adapter directory at ``path`` to the served base weights,
        unmerged (the forward adds the low-rank path, as the trainer's does, so both compute the same logprobs);
        the first adapter wraps the model with peft. The checksum is of the adapter tensors the model now holds."""
        from rlsdk.engine.lora import load_adapter

        self._model, self._checksum = load_adapter(self._model, path)
        self._model.eval()

    def _casts(self, path: str) -> bool:
        """Whether the file's floating tensors are stored in another dtype than the served parameters'."""
        from safetensors import safe_open

        served = next(self._model.parameters()).dtype
        codes = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}
        with safe_open(path, framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                stored = codes.get(handle.get_slice(name).get_dtype())
                if stored is not None:
                    return stored != served
        return False

    async def load_weights(self, path: str, version: int) -> WeightInfo:
        """Load weights saved by ``safetensors.torch.save_model(model, path)``, or the LoRA adapter directory at
        ``path`` (:func:`~rlsdk.engine.lora.publish_adapter`, applied to the served base weights); serve them as
        ``version``.

        A generation running now applies them before its next decode step (its later tokens carry
        ``version``); otherwise they load on the worker thread at once. Returns when they are served. The
        returned checksum is ``state_dict_checksum`` of the loaded weights (of the adapter's tensors for an
        adapter); when the engine serves another dtype than the file stores (``inference.dtype``), of the file's
        tensors as read (tied names restored), which are what the trainer checksummed.

        Raises:
            FileNotFoundError: ``path`` does not exist.
            RuntimeError: missing or unexpected tensors (strict load), or the engine is closed.
        """
        if not (Path(path).is_file() or Path(path).is_dir()):
            raise FileNotFoundError(f"no weights file or adapter directory at {path}")
        self._check_open()
        request = (str(path), version)
        with self._pending_lock:
            self._pending_load = request
        return await self._run(self._finish_load, request)

    def _finish_load(self, request: tuple[str, int]) -> WeightInfo:
        """The queued half of a load: load now unless a generation already applied this very request."""
        with self._pending_lock:
            if self._pending_load == request:
                self._pending_load = None
            elif self._applied == request:
                return WeightInfo(version=self._version, checksum=self._checksum)
        return self._load_weights_sync(*request)

    async def weight_info(self) -> WeightInfo:
        """The version and checksum served now (after any pending load submitted before this call)."""
        return await self._run(lambda: WeightInfo(version=self._version, checksum=self._checksum))

    async def close(self) -> None:
        """Wait for submitted work, then stop the worker thread. Idempotent; other calls then raise."""
        if self._closed:
            return
        self._closed = True
        await asyncio.get_running_loop().run_in_executor(None, self._executor.shutdown, True)
