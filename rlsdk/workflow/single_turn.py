"""Single-turn episodes: one prompt in, ``group_size`` sampled completions out, as one batched engine call."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from rlsdk.engine.inference.protocol import InferenceEngine, SamplingParams
from rlsdk.engine.inference.sampling import left_pad
from rlsdk.workflow.rollout import Rollout


class RolloutWorkflow(Protocol):
    """Turns prompt rows into a :class:`Rollout` using an inference engine.

    ``seed`` makes the sampling reproducible (the Session derives one per rollout from ``SessionConfig.seed``);
    ``None`` leaves it to the engine.
    """

    async def arun_batch(
        self, engine: InferenceEngine, rows: Sequence[dict[str, Any]], group_size: int, *, seed: int | None = None
    ) -> Rollout: ...


class SingleTurnWorkflow:
    """Tokenise each prompt, sample ``group_size`` completions from the engine, decode them."""

    def __init__(self, tokenizer: Any, params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params

    async def arun_batch(
        self, engine: InferenceEngine, rows: Sequence[dict[str, Any]], group_size: int, *, seed: int | None = None
    ) -> Rollout:
        prompt_ids = [list(self.tokenizer(row["prompt"])["input_ids"]) for row in rows]
        repeated = [ids for ids in prompt_ids for _ in range(group_size)]
        params = self.params if seed is None else dataclasses.replace(self.params, seed=seed)
        result = await engine.generate(repeated, params)
        pad = self.tokenizer.pad_token_id
        # each prompt padded once, then repeated: the same tensors as padding every repeated row
        prompt_ids_B_P, prompt_mask_B_P = (t.repeat_interleave(group_size, dim=0) for t in left_pad(prompt_ids, pad))
        completions = self.tokenizer.batch_decode(
            torch.where(result.completion_mask_B_C, result.completion_ids_B_C, pad).tolist(),
            skip_special_tokens=True,
        )
        return Rollout(
            rows=[dict(row) for row in rows],
            group_size=group_size,
            prompt_ids_B_P=prompt_ids_B_P,
            prompt_mask_B_P=prompt_mask_B_P,
            completion_ids_B_C=result.completion_ids_B_C,
            completion_mask_B_C=result.completion_mask_B_C,
            logprobs_B_C=result.logprobs_B_C,
            versions_B_C=result.versions_B_C,
            completions=completions,
        )
