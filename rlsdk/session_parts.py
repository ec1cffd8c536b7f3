"""The controller-side parts a Session builds while its ranks start (beside the inference engine): the tokenizer and
its special tokens, the default single-turn workflow, the prompt sampler over the data set and the metrics writer.
Each is a small function the Session's start-up calls in order."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from rlsdk.config import SessionConfig
from rlsdk.engine.inference.protocol import SamplingParams
from rlsdk.observe.metrics import MetricsWriter
from rlsdk.preflight import check_special_tokens
from rlsdk.runtime_dir import output_modes
from rlsdk.workflow.single_turn import SingleTurnWorkflow


async def load_tokenizer(config: SessionConfig, tokenizer: Any, special_tokens: Any) -> tuple[Any, Any]:
    """The model's tokenizer and its pad/EOS ids, each loaded only when start()'s pre-start checks have not yet."""
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = await asyncio.to_thread(
            AutoTokenizer.from_pretrained, config.model.path, trust_remote_code=config.model.trust_remote_code
        )
    if special_tokens is None:
        special_tokens = await asyncio.to_thread(check_special_tokens, config, tokenizer)
    return tokenizer, special_tokens


def default_workflow(config: SessionConfig, tokenizer: Any, special_tokens: Any) -> SingleTurnWorkflow:
    """The single-turn workflow sampling with the config's ``rollout`` settings."""
    rollout = config.rollout
    params = SamplingParams(
        max_new_tokens=rollout.max_new_tokens,
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        top_k=rollout.top_k,
        stop=rollout.stop,
    )
    return SingleTurnWorkflow(tokenizer, params, eos_token_ids=special_tokens.eos_token_ids)


async def prompt_sampler(config: SessionConfig, dataset: Any, tokenizer: Any) -> Any:
    """The seeded, epoch-shuffled sampler over ``dataset`` (built from ``config.data`` when start() has not)."""
    from rlsdk.data import PromptSampler
    from rlsdk.data.prepare import build_prompt_dataset

    if dataset is None:
        dataset = await asyncio.to_thread(build_prompt_dataset, config.data, seed=config.seed, tokenizer=tokenizer)
    return PromptSampler(dataset, config.data.prompts_per_step, seed=config.seed)


def metrics_writer(config: SessionConfig, output_dir: Path) -> MetricsWriter:
    """The run's metrics (TensorBoard under ``output_dir/tensorboard`` when ``observe.tensorboard``)."""
    dir_mode, file_mode = output_modes(config.observe.output_mode)
    return MetricsWriter(
        output_dir / "tensorboard", tensorboard=config.observe.tensorboard, dir_mode=dir_mode, file_mode=file_mode
    )
