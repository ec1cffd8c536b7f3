"""The colocated engine: the train ranks generate with the weights they train (``inference.engine='colocated'``).

TRL's default ``GRPOTrainer`` and veRL's "hybrid engine" work this way: no separate inference server, no
weights to move. Each rank samples its share of the prompts on its own model replica (DDP keeps the replicas
equal), so on a CPU machine the generation runs on every rank's cores at once instead of on the controller's,
and a weight sync moves nothing: it asks every rank for its version and weight checksum and checks they agree.

The trade-off: generation and training run one after the other on the same processes, so ``rollout.mode='async'``
(generation overlapped with training) has nothing to overlap and is refused by the config; with 'fsdp2' every
rank would have to run the same number of decode steps (its forward all-gathers), also refused.

Look-ahead (``inference.colocated.lookahead``): the engine's own business. Its :meth:`ColocatedEngine.train_fields` asks
the ranks to sample the next default rollout's batch inside the ``update`` command
(:meth:`ColocatedEngine.lookahead_bodies`), and :meth:`ColocatedEngine.after_train` keeps their results
(:meth:`ColocatedEngine.hold`), so the next ``generate`` of exactly those prompts and params is answered without a
round trip to the ranks.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Awaitable, Callable, Sequence
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
from rlsdk.generation.sampling import validate_params
from rlsdk.generation.stopping import check_stop_strings, token_id_list
from rlsdk.observe.logging import get_logger

logger = get_logger(__name__)

RankBroadcast = Callable[[str, list[dict[str, Any]] | dict[str, Any]], Awaitable[list[Any]]]
"""``broadcast(command, body_or_bodies)``: send a command to every rank (one body each, or one for all) and
return the results by rank (the Session's ``_broadcast`` with its command timeout)."""


def pack_prompts(prompts: Sequence[Sequence[int]]) -> dict[str, torch.Tensor]:
    """A rank's share of prompts as three int64 tensors (raw bytes on the control channel, not one list node per
    token): the distinct prompts concatenated (``prompt_tokens``), where each one ends (``prompt_ends``), and
    which distinct prompt each row is (``prompt_rows``; a GRPO group repeats its prompt). :func:`unpack_prompts`
    inverts it."""
    distinct: dict[tuple[int, ...], int] = {}
    rows = [distinct.setdefault(tuple(ids), len(distinct)) for ids in prompts]
    tokens = [token for ids in distinct for token in ids]
    ends = list(itertools.accumulate(len(ids) for ids in distinct))
    return {
        "prompt_tokens": torch.tensor(tokens, dtype=torch.long),
        "prompt_ends": torch.tensor(ends, dtype=torch.long),
        "prompt_rows": torch.tensor(rows, dtype=torch.long),
    }


def unpack_prompts(body: dict[str, torch.Tensor]) -> list[list[int]]:
    """The rows :func:`pack_prompts` packed (rows of the same prompt share one list)."""
    tokens, ends = body["prompt_tokens"].tolist(), body["prompt_ends"].tolist()
    distinct = [tokens[start:end] for start, end in zip([0, *ends[:-1]], ends)]
    return [distinct[row] for row in body["prompt_rows"].tolist()]


class ColocatedEngine(EngineLifecycle):
    """An :class:`~rlsdk.engine.inference.protocol.InferenceEngine` whose generations run on the train ranks.

    ``generate`` splits the prompts into ``num_ranks`` contiguous, near-equal shares (a GRPO group stays on one
    rank when the group size divides the share, so its prompt is prefilled once) and sends each rank its share
    (rank command ``generate``); ranks sample in chunks of ``max_batch_size``. ``load_weights`` moves no data.
    """

    def __init__(
        self,
        broadcast: RankBroadcast,
        num_ranks: int,
        *,
        pad_token_id: int,
        eos_token_id: int | Sequence[int],
        max_batch_size: int = 1024,
        version: int = 0,
        checksum: str = "",
    ) -> None:
        """``eos_token_id``: the id, or every id, that ends a completion (stop strings are matched on the ranks with
        the model's tokenizer). Raises ValueError for ``num_ranks < 1`` or ``max_batch_size < 1``."""
        if num_ranks < 1:
            raise ValueError(f"num_ranks={num_ranks!r} is invalid: allowed >= 1")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size!r} is invalid: allowed >= 1")
        self._broadcast = broadcast
        self._num_ranks = num_ranks
        self._pad_token_id = int(pad_token_id)
        self._eos_token_ids = token_id_list(eos_token_id)
        self._max_batch_size = max_batch_size
        self._version = version
        self._checksum = checksum
        self._closed = False
        # look-ahead (see lookahead_bodies / hold): (prompts, params) planned, and then (prompts, params, results)
        self._planned: tuple[list[list[int]], SamplingParams] | None = None
        self._held: tuple[list[list[int]], SamplingParams, list[dict[str, Any]]] | None = None
        self.lookahead_hits = 0  # generate calls answered from a look-ahead result
        self.lookahead = False  # inference.colocated.lookahead: sample the next batch inside each update (see build())
        # After an update: (trainer.commands_sent then, every rank's new version and checksum from it); the next
        # sync verifies these instead of asking again if no rank command ran in between.
        self._trained: tuple[int, list[dict[str, Any]]] | None = None

    @classmethod
    def build(cls, context: EngineContext) -> ColocatedEngine:
        """The Session's colocated engine (``inference.engine='colocated'``): generations run on its ranks."""
        cfg = context.config
        trainer = context.trainer
        engine = cls(
            lambda command, body: trainer.broadcast(command, body, timeout_s=cfg.launch.command_timeout_s),
            cfg.launch.num_ranks,
            pad_token_id=context.special_tokens.pad_token_id,
            eos_token_id=context.special_tokens.eos_token_ids,
            max_batch_size=cfg.inference.max_batch_size,
        )
        engine.lookahead = bool(cfg.inference.colocated.lookahead)
        return engine

    @property
    def version(self) -> int:
        """Version of the weights the ranks served at the last generate or sync."""
        return self._version

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("ColocatedEngine is closed")

    async def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams) -> GenerateResult:
        """Sample one completion per prompt on the ranks; right-padded to the longest completion ``C``.

        With ``params.seed`` each rank seeds its share with a hash of ``(seed, rank)``: the call is reproducible
        for the same prompts, weights, ``num_ranks`` and ``max_batch_size``. Returns the look-ahead result kept
        by :meth:`hold` without a rank command when it was sampled for exactly these prompts and params; any other
        request keeps that result for its own.

        Raises:
            ValueError: empty prompt list or prompt, or invalid sampling parameters.
            RuntimeError: the ranks report different weight versions, or the engine is closed.
        """
        prompts = self._check_request(prompt_ids, params)
        held = self._held
        if held is not None and held[0] == prompts and held[1] == params:
            self._held = None
            self.lookahead_hits += 1
            return self._assemble(held[2])
        # Another request (a held-out evaluation, explicit prompts) leaves the held result for the rollout it was
        # sampled for: the weights have not changed since (before_train drops it when they are about to).
        return self._assemble(await self._broadcast("generate", self._bodies(prompts, params)))

    def lookahead_bodies(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams) -> list[dict[str, Any]]:
        """The per-rank ``generate`` bodies of ``generate(prompt_ids, params)`` for a rank command that samples
        after its own work (the Session's look-ahead: ``update`` with ``then_generate``). Drops any result kept
        before; pass the ranks' results to :meth:`hold`.

        Raises:
            ValueError: as :meth:`generate`.
        """
        prompts = self._check_request(prompt_ids, params)
        self._held = None
        self._planned = (prompts, params)
        return self._bodies(prompts, params)

    def hold(self, results: Sequence[dict[str, Any]] | None) -> None:
        """Keep the ranks' results (index = rank) for the bodies of the last :meth:`lookahead_bodies`: the next
        :meth:`generate` of the same prompts and params returns them. ``None`` drops them (a rank's look-ahead
        failed)."""
        planned, self._planned = self._planned, None
        self._held = None if results is None or planned is None else (planned[0], planned[1], list(results))

    def discard_lookahead(self) -> None:
        """Forget a planned or kept look-ahead result (the ranks' weights are about to change)."""
        self._planned = self._held = None

    def _check_request(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams) -> list[list[int]]:
        self._check_open()
        prompts = [list(map(int, ids)) for ids in prompt_ids]
        if not prompts:
            raise ValueError("generate needs at least one prompt; got an empty prompt list")
        empty = [i for i, ids in enumerate(prompts) if not ids]
        if empty:
            raise ValueError(f"prompt {empty[0]} is empty: every prompt needs at least one token")
        validate_params(params.max_new_tokens, params.temperature, params.top_k, params.top_p)
        check_stop_strings(params.stop)
        return prompts

    def _bodies(self, prompts: list[list[int]], params: SamplingParams) -> list[dict[str, Any]]:
        from rlsdk.engine.inference.vllm import request_seed

        fields = dataclasses.asdict(params)
        fields.pop("seed")
        fields["stop"] = list(params.stop)
        n, world = len(prompts), self._num_ranks
        bounds = [n * rank // world for rank in range(world + 1)]
        return [
            {
                **pack_prompts(prompts[bounds[rank] : bounds[rank + 1]]),
                "params": fields,
                "pad_token_id": self._pad_token_id,
                "eos_token_id": self._eos_token_ids,
                "max_batch_size": self._max_batch_size,
                "seed": None if params.seed is None else request_seed(params.seed, rank),
            }
            for rank in range(world)
        ]

    def _assemble(self, results: Sequence[dict[str, Any]]) -> GenerateResult:
        versions = {int(r["version"]) for r in results}
        if len(versions) != 1:
            raise RuntimeError(f"ranks generated with different weight versions: {sorted(versions)}")
        version = versions.pop()
        shares = [r for r in results if r["completion_ids"].shape[0] > 0]
        width = max(r["completion_ids"].shape[1] for r in shares)

        def cat(key: str, value: float | int | bool) -> torch.Tensor:
            return torch.cat(
                [torch.nn.functional.pad(r[key], (0, width - r[key].shape[1]), value=value) for r in shares]
            )

        mask_B_C = cat("completion_mask", False)
        self._version = version
        return GenerateResult(
            completion_ids_B_C=cat("completion_ids", self._pad_token_id),
            completion_mask_B_C=mask_B_C,
            logprobs_B_C=cat("logprobs", 0.0),
            versions_B_C=torch.where(mask_B_C, version, -1),
        )

    async def load_weights(self, path: str, version: int) -> WeightInfo:
        """Nothing to load (``path`` is ignored): the ranks already hold the trained weights. Asks every rank for
        its version and weight checksum and returns rank 0's.

        Raises:
            WeightMismatchError: a rank serves another version than ``version``, or the ranks' replicas differ.
        """
        self._check_open()
        return self.verify(version, await self._broadcast("weight_info", {}))

    def verify(self, version: int, infos: Sequence[dict[str, Any]]) -> WeightInfo:
        """Serve ``version`` if every rank's ``{"version", "checksum"}`` (index = rank; what ``weight_info``
        answers, or what an ``update`` returned with ``with_checksum``) is ``version`` with rank 0's checksum;
        returns rank 0's. Raises WeightMismatchError otherwise (as :meth:`load_weights`)."""
        from rlsdk.versioning import WeightMismatchError

        results = list(infos)
        wrong = {rank: int(r["version"]) for rank, r in enumerate(results) if int(r["version"]) != version}
        if wrong:
            raise WeightMismatchError(f"colocated sync of v{version}: ranks serve other versions {wrong}")
        checksum = results[0]["checksum"]
        differ = {rank: r["checksum"][:12] for rank, r in enumerate(results) if r["checksum"] != checksum}
        if differ:
            raise WeightMismatchError(
                f"colocated sync of v{version}: rank weights differ from rank 0's (checksum {checksum[:12]}): {differ}"
            )
        self._version, self._checksum = version, checksum
        return WeightInfo(version=version, checksum=checksum)

    async def sync(self, trainer: TrainerHandle, version: int) -> WeightInfo:
        """Nothing moves: the ranks generate with the weights they train. Verifies that every rank serves
        ``version`` with rank 0's checksum (the trainer's), from the checksums the update returned when no rank
        command ran since, else by asking the ranks."""
        trained, self._trained = self._trained, None
        if trained is not None and trained[0] == trainer.commands_sent:
            info = self.verify(version, trained[1])
        else:
            info = await self.load_weights("", version)
        return check_synced(info, {"version": info.version, "checksum": info.checksum}, version)

    def before_train(self) -> None:
        self.discard_lookahead()  # sampled with the weights the update replaces
        self._trained = None

    def train_fields(
        self, world: int, next_request: Callable[[], tuple[Sequence[Sequence[int]], SamplingParams] | None]
    ) -> list[dict[str, Any]]:
        """Every rank returns its new checksum with the update (the next sync verifies them without a round trip)
        and, with ``inference.colocated.lookahead``, samples ``next_request()``'s batch right after it
        (:meth:`hold`)."""
        request = next_request() if self.lookahead else None
        bodies = None
        if request is not None:
            try:
                bodies = self.lookahead_bodies(*request)
            except Exception:  # e.g. an empty prompt: the rollout() that takes these rows raises it
                logger.debug("no look-ahead: the next batch's request is invalid", exc_info=True)
        return [
            {"with_checksum": True, **({"then_generate": bodies[rank]} if bodies is not None else {})}
            for rank in range(world)
        ]

    def after_train(self, results: list[dict[str, Any]], trainer: TrainerHandle) -> None:
        """Keep the ranks' new checksums for the next sync and their look-ahead samples for the next generate."""
        if self._planned is not None:
            generated = [r.pop("then_generate", None) for r in results]
            errors = [r.pop("then_generate_error", None) for r in results]
            if any(error is not None for error in errors):
                logger.debug("look-ahead generation failed on the ranks (the next rollout retries): %s", errors)
            self.hold(None if any(g is None for g in generated) else generated)
        self._trained = (trainer.commands_sent, [{"version": r["version"], "checksum": r["checksum"]} for r in results])

    async def weight_info(self) -> WeightInfo:
        """The version and checksum of the last sync (or of the start)."""
        self._check_open()
        return WeightInfo(version=self._version, checksum=self._checksum)

    async def close(self) -> None:
        """Idempotent; later calls raise. The ranks belong to the Session."""
        self._closed = True
