"""``Session.evaluate``'s parts: the held-out prompts, the evaluation workflow and its seed.

An evaluation samples ``n`` completions per prompt with the session's workflow (greedy: temperature 0, one
sample; or the rollout's sampling settings), scores them with a reward function and reports ``eval/reward_mean``
and ``eval/pass@1`` (see :func:`rlsdk.observe.rollout_metrics.pass_metrics`). It never touches the training data
position or the rollout seeds, so a run's training samples are the same with or without evaluations.

TODO(eval): a configured evaluation split (``data.eval_path`` or an ``EvalConfig``) lands with the SFT/reasoning
task work (issue 24); until then a generated task holds out a freshly seeded sample of the same task, and a file
data set needs the prompts passed explicitly.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from rlsdk.config import SessionConfig

# A seed stream of its own: the evaluation prompts and sampling never reuse the training seeds' values.
_EVAL_SEED_OFFSET = 0x5EED_E7A1


def held_out_prompts(config: SessionConfig, tokenizer: Any, num_prompts: int) -> list[dict[str, Any]]:
    """``num_prompts`` rows of the configured generated task, drawn with a seed the training set does not use (a
    procedurally generated task may still repeat a training prompt: 'reverse 3 digits' has 1,000), after the same
    preparation as the training set (chat template, ``data.max_prompt_tokens``).

    Raises:
        ValueError: ``data.task='file'`` (pass the evaluation prompts explicitly), or ``num_prompts < 1``.
    """
    from rlsdk.data.prepare import build_prompt_dataset

    if num_prompts < 1:
        raise ValueError(f"num_prompts={num_prompts!r} is invalid: allowed an int >= 1")
    if config.data.task == "file":
        raise ValueError(
            "evaluate() needs prompts with data.task='file': pass held-out rows (strings, dicts with 'prompt', or a "
            "datasets.Dataset), e.g. session.evaluate(load_dataset(...)['test'], reward_fn)"
        )
    seed = (config.seed + _EVAL_SEED_OFFSET) % (1 << 31)
    examples = num_prompts
    for _ in range(6):  # data.max_prompt_tokens may drop rows: generate more until num_prompts are kept
        dataset = build_prompt_dataset(
            dataclasses.replace(config.data, num_examples=examples), seed=seed, tokenizer=tokenizer
        )
        if len(dataset) >= num_prompts:
            break
        examples *= 4
    return [dict(row) for row in dataset.select(range(min(num_prompts, len(dataset))))]


def eval_seed(config: SessionConfig, step: int) -> int:
    """The sampling seed of an evaluation at ``step``: fixed per step, disjoint from the rollout seeds' stream."""
    return (config.seed * 1_000_003 + _EVAL_SEED_OFFSET + step * 7919) % (1 << 62)


def eval_workflow(workflow: Any, *, greedy: bool) -> Any:
    """The workflow to evaluate with: ``workflow`` itself when sampling, else a shallow copy whose sampling params
    have temperature 0 (greedy on every engine). A workflow without a ``params`` attribute (a custom one) is used
    as it is, sampling as it does in training.

    Raises:
        ValueError: ``greedy`` with a workflow whose sampling cannot be changed (no ``params``).
    """
    params = getattr(workflow, "params", None)
    if not greedy:
        return workflow
    if params is None or not dataclasses.is_dataclass(params):
        raise ValueError(
            f"greedy evaluation needs a workflow with SamplingParams at .params; {type(workflow).__name__} has none "
            "(pass greedy=False to sample as in training)"
        )
    greedy_workflow = copy.copy(workflow)
    greedy_workflow.params = dataclasses.replace(params, temperature=0.0)
    return greedy_workflow
