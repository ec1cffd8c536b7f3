"""The Session's rollout half: which prompts come next, each rollout's seed, the batch generating in the background
(``rollout.mode='async'``), the rows drawn ahead for the colocated engine's look-ahead, and DAPO's refill of
uninformative groups. The Session's ``rollout()``/``reward()`` delegate here; a checkpoint records
:meth:`RolloutDriver.data_position` so a resume draws and seeds exactly the same batches."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any, Protocol

from rlsdk.engine.inference.protocol import InferenceEngine, SamplingParams
from rlsdk.observe.logging import get_logger
from rlsdk.rewards.apply import RewardFn, compute_reward_breakdown
from rlsdk.tasks import cancel_quietly
from rlsdk.versioning import VersionLedger
from rlsdk.workflow.rollout import Rollout, normalize_rows
from rlsdk.workflow.single_turn import RolloutWorkflow, SingleTurnWorkflow

logger = get_logger("rlsdk.session")  # the Session's own messages, under its logger name as before


class RolloutOwner(Protocol):
    """What the driver reads from its Session (public attributes; the workflow and ledger may be replaced)."""

    config: Any
    versions: VersionLedger
    workflow: RolloutWorkflow | None
    prompt_sampler: Any
    special_tokens: Any


async def reward_rollout(rollout: Rollout, reward_fn: RewardFn, timeout_s: float | None) -> Rollout:
    """``rollout`` with ``reward_fn``'s rewards (and components, if any) on a new Rollout; the input is untouched."""
    start = time.perf_counter()
    rewards_B, components = await compute_reward_breakdown(rollout, reward_fn, timeout_s=timeout_s)
    info = {**rollout.info, "reward_seconds": time.perf_counter() - start}
    if components:
        info["reward_components"] = components
    return dataclasses.replace(rollout, rewards_B=rewards_B, info=info)


class RolloutDriver:
    """Draws, seeds and generates the Session's rollouts (see the module docstring)."""

    def __init__(self, owner: RolloutOwner) -> None:
        self.owner = owner
        self.rollouts = 0  # rollouts sampled so far; each one's seed derives from it (see seed())
        self.prefetch: asyncio.Task[Rollout] | None = None  # rollout.mode='async': the batch being generated
        self.prefetch_state: tuple[dict[str, Any], int] | None = None  # (data position, rollouts) before it
        # inference.colocated.lookahead: (the next batch's rows, the data position before them), drawn by update()
        # for the ranks to sample right after it; the next default rollout() or next_prompts() takes these rows.
        self.lookahead: tuple[list[dict[str, Any]], dict[str, Any]] | None = None

    def next_prompts(self) -> list[dict[str, Any]]:
        if self.lookahead is not None:  # drawn already, for the look-ahead (inference.colocated.lookahead)
            rows, self.lookahead = self.lookahead[0], None
            return rows
        return normalize_rows(self.owner.prompt_sampler.next_batch())

    async def next_batch(self, engine: InferenceEngine, *, progress: bool | None) -> Rollout:
        """The next default batch: async mode hands out the one generated in the background and starts the next."""
        if self.owner.config.rollout.mode != "async":
            return await self.generate(engine, self.next_prompts(), progress=progress)
        if self.prefetch is None:
            self.start_prefetch(engine, progress=progress)
        assert self.prefetch is not None
        task, self.prefetch, self.prefetch_state = self.prefetch, None, None
        rollout = await task
        self.start_prefetch(engine, progress=False)
        return rollout

    def start_prefetch(self, engine: InferenceEngine, *, progress: bool | None) -> None:
        """Start generating the next batch in the background (async mode). Remembers the data position and the
        rollout counter from before it, which a checkpoint records (the batch is regenerated on resume)."""
        self.prefetch_state = (self.owner.prompt_sampler.state_dict(), self.rollouts)
        rows = self.next_prompts()
        self.prefetch = asyncio.get_running_loop().create_task(self.generate(engine, rows, progress=progress))

    async def stop_prefetch(self) -> None:
        task, self.prefetch = self.prefetch, None
        await cancel_quietly(task)

    def data_position(self) -> tuple[dict[str, Any], int]:
        """(data position, rollouts sampled) as a checkpoint records them: a batch generating in the background
        (async mode) or rows drawn for the look-ahead are not part of the run yet, so a resume draws them again."""
        if self.prefetch_state is not None:
            return self.prefetch_state
        if self.lookahead is not None:
            return self.lookahead[1], self.rollouts
        return self.owner.prompt_sampler.state_dict(), self.rollouts

    async def generate(self, engine: InferenceEngine, rows: list[dict[str, Any]], *, progress: bool | None) -> Rollout:
        from rlsdk.observe.progress import CallProgress

        owner = self.owner
        if not rows:
            raise ValueError("rollout needs at least one prompt; got an empty prompt list")
        assert owner.workflow is not None
        start = time.perf_counter()
        seed = self.seed()
        self.rollouts += 1
        group_size = owner.config.rollout.group_size
        trainer_version = owner.versions.trainer_version
        with CallProgress(
            "rollout",
            total=len(rows) * group_size,
            unit="sample",
            postfix=lambda: f"engine v{owner.versions.engine_version}",
            enabled=progress,
        ):
            rollout = await owner.workflow.arun_batch(engine, rows, group_size, seed=seed)
        rollout.info["seconds"] = time.perf_counter() - start
        rollout.info["trainer_version"] = trainer_version
        return rollout

    def seed(self) -> int:
        """The next rollout's seed: one per rollout, derived from the session seed, so the same config replays
        the same samples."""
        return (self.owner.config.seed * 1_000_003 + self.rollouts) % (1 << 62)

    def next_request(self) -> tuple[list[list[int]], SamplingParams] | None:
        """The prompts and params the next default ``rollout()`` will ask the engine for (the data set's next rows,
        drawn now and kept for it, and the next seed), for an engine that samples them right after an update
        (the colocated engine's ``inference.colocated.lookahead``); ``None`` when they are not known yet (async mode, a
        custom workflow, no data left)."""
        owner = self.owner
        if owner.config.rollout.mode != "sequential" or type(owner.workflow) is not SingleTurnWorkflow:
            return None
        if self.lookahead is None:
            before = owner.prompt_sampler.state_dict()
            try:
                rows = normalize_rows(owner.prompt_sampler.next_batch())
            except Exception:  # the next rollout() raises it where the user asked for the rows
                logger.debug("no look-ahead: drawing the next rows failed", exc_info=True)
                owner.prompt_sampler.load_state_dict(before)
                return None
            self.lookahead = (rows, before)
        try:
            _, repeated, params = owner.workflow.request(
                self.lookahead[0], owner.config.rollout.group_size, seed=self.seed()
            )
        except Exception:  # e.g. an empty prompt: the rollout() that takes these rows raises it
            logger.debug("no look-ahead: the next batch's request is invalid", exc_info=True)
            return None
        return repeated, params

    async def fill_informative(
        self, engine: InferenceEngine, rewarded: Rollout, reward_fn: RewardFn, timeout_s: float | None
    ) -> Rollout:
        """DAPO's dynamic sampling (``rollout.dynamic_sampling``): keep the groups whose rewards differ, and
        generate and reward groups of new prompts (the next data-set rows; the rest of each refill batch is
        skipped) until the batch is full again or ``rollout.max_sampling_rounds`` rounds ran."""
        from rlsdk.workflow.dynamic_sampling import fill_informative_groups

        first: list[Rollout] = [rewarded]

        async def sample(groups: int) -> Rollout:
            if first:
                return first.pop()
            rows = self.next_prompts()[:groups]
            return await reward_rollout(await self.generate(engine, rows, progress=False), reward_fn, timeout_s)

        rollout, stats = await fill_informative_groups(
            sample,
            len(rewarded.rows),
            max_rounds=self.owner.config.rollout.max_sampling_rounds,
            pad_token_id=self.owner.special_tokens.pad_token_id,
        )
        parts = rollout.info.get("parts") or [rewarded.info]
        rollout.info["seconds"] = sum(float(part.get("seconds", 0.0)) for part in parts)
        rollout.info["trainer_version"] = rewarded.info.get("trainer_version")
        rollout.info["dynamic_sampling"] = stats
        return rollout
