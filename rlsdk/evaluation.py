"""``Session.evaluate``'s parts: the held-out prompts, the evaluation workflow and its seed.

An evaluation samples ``n`` completions per prompt with the session's workflow (greedy: temperature 0, one
sample; or the rollout's sampling settings), scores them with a reward function and reports ``eval/reward_mean``
and ``eval/pass@1`` (see :func:`rlsdk.observe.rollout_metrics.pass_metrics`). It never touches the training data
position or the rollout seeds, so a run's training samples are the same with or without evaluations.

The held-out prompts of ``Session.evaluate(None, ...)``: the rows of ``data.eval_path`` when it is set (a local
file prepared exactly as the training prompts are), else a freshly seeded sample of the configured generated task;
a file data set without ``data.eval_path`` needs the prompts passed explicitly.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

from rlsdk.config import SessionConfig
from rlsdk.observe.logging import get_logger

logger = get_logger("rlsdk.session")  # the evaluation's summary line, under the Session's logger name as before

# A seed stream of its own: the evaluation prompts and sampling never reuse the training seeds' values.
_EVAL_SEED_OFFSET = 0x5EED_E7A1


DEFAULT_NUM_PROMPTS = 64
"""Rows of a generated task :func:`held_out_prompts` draws when ``num_prompts`` is None."""


def eval_file_dataset(config: SessionConfig, tokenizer: Any) -> Any:
    """The rows of ``data.eval_path`` (split ``data.eval_split`` of a saved DatasetDict), prepared as the training
    prompts are: ``data.prompt_column`` copied to ``prompt``, ``data.chat_template``, ``data.system_prompt``,
    ``data.max_prompt_tokens``. ``Session.start`` builds it before any process starts.

    Raises:
        ConfigError: naming ``data.eval_path`` or ``data.eval_split`` (missing, unreadable, no rows, no prompt
            column, a prompt that cannot be prepared).
    """
    from rlsdk.config import ConfigError
    from rlsdk.data.prepare import build_prompt_dataset

    data = config.data
    assert data.eval_path is not None
    try:
        # the training set's pipeline on the held-out file: the same columns, template and token budget
        held_out = dataclasses.replace(data, task="file", path=data.eval_path, split=data.eval_split)
        return build_prompt_dataset(held_out, seed=config.seed, tokenizer=tokenizer)
    except ConfigError as exc:
        if exc.field == "data.split":
            raise ConfigError("data.eval_split", data.eval_split, exc.allowed) from exc
        if exc.field == "data.path":
            raise ConfigError("data.eval_path", data.eval_path, exc.allowed) from exc
        raise ConfigError("data.eval_path", data.eval_path, f"held-out rows that pass {exc}") from exc


def held_out_prompts(config: SessionConfig, tokenizer: Any, num_prompts: int | None) -> list[dict[str, Any]]:
    """The held-out rows :meth:`Session.evaluate` scores when it is given no prompts.

    With ``data.eval_path``: its rows (:func:`eval_file_dataset`), all of them or the first ``num_prompts``.
    Otherwise ``num_prompts`` (None: :data:`DEFAULT_NUM_PROMPTS`) rows of the configured generated task, drawn
    with a seed the training set does not use (a procedurally generated task may still repeat a training prompt:
    'reverse 3 digits' has 1,000), after the same preparation as the training set (chat template,
    ``data.max_prompt_tokens``).

    Raises:
        ValueError: ``data.task='file'`` without ``data.eval_path`` (pass the evaluation prompts explicitly), or
            ``num_prompts < 1``.
        ConfigError: a ``data.eval_path`` that cannot be read (see :func:`eval_file_dataset`).
    """
    from rlsdk.data.prepare import build_prompt_dataset

    if num_prompts is not None and num_prompts < 1:
        raise ValueError(f"num_prompts={num_prompts!r} is invalid: allowed None or an int >= 1")
    if config.data.eval_path is not None:
        rows = eval_file_dataset(config, tokenizer)
        count = len(rows) if num_prompts is None else min(num_prompts, len(rows))
        return [dict(row) for row in rows.select(range(count))]
    if config.data.task == "file":
        raise ValueError(
            "evaluate() needs prompts with data.task='file' and no data.eval_path: set data.eval_path to a held-out "
            "file, or pass held-out rows (strings, dicts with 'prompt', or a datasets.Dataset), e.g. "
            "session.evaluate(load_dataset(...)['test'], reward_fn)"
        )
    num_prompts = DEFAULT_NUM_PROMPTS if num_prompts is None else num_prompts
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


def check_eval_args(n: int, greedy: bool, prefix: str) -> None:
    """Raise ``ValueError`` for ``n < 1``, ``greedy`` with ``n > 1`` (greedy samples are equal) or a ``prefix``
    that is empty or holds '/' (it is the metrics' namespace)."""
    if n < 1 or (greedy and n != 1):
        raise ValueError(f"n={n!r} is invalid: allowed an int >= 1, and 1 with greedy=True (samples are equal)")
    if not prefix or "/" in prefix:
        raise ValueError(f"prefix={prefix!r} is invalid: allowed a non-empty metric namespace without '/'")


def eval_metrics(
    rollout: Any,
    *,
    n: int,
    pass_threshold: float,
    max_new_tokens: int,
    eos_token_ids: Any,
    engine_version: int,
    seconds: float,
    prefix: str = "eval",
) -> dict[str, float]:
    """An evaluation's metrics from its rewarded ``rollout`` (``n`` samples per prompt): ``PREFIX/reward_mean``,
    ``PREFIX/reward_std``, ``PREFIX/pass@1`` (samples whose reward >= ``pass_threshold``), ``PREFIX/pass@n``
    (n > 1), the ``PREFIX/completion/*`` lengths and rates, ``PREFIX/num_prompts``, ``PREFIX/engine_version``
    (the oldest version that sampled, else ``engine_version``) and ``PREFIX/seconds``."""
    from rlsdk.observe.rollout_metrics import completion_metrics, pass_metrics, reward_metrics

    metrics = {
        **{k.replace("reward/", "eval/reward_", 1): v for k, v in reward_metrics(rollout).items()},
        **pass_metrics(rollout.rewards_B, n, threshold=pass_threshold),
        **completion_metrics(
            rollout, max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids, prefix="eval/completion"
        ),
        "eval/num_prompts": float(len(rollout.rows)),
        "eval/engine_version": float(min(rollout.versions) if rollout.versions else engine_version),
        "eval/seconds": seconds,
    }
    if prefix != "eval":
        metrics = {prefix + key[len("eval") :]: value for key, value in metrics.items()}
    return metrics


async def eval_rows(
    prompts: Any, config: SessionConfig, tokenizer: Any, num_prompts: int | None, cache: dict[int | None, Any]
) -> list[dict[str, Any]]:
    """The rows an evaluation scores: ``prompts`` normalized, or (``None``) the held-out rows, drawn once per
    ``num_prompts`` and kept in ``cache`` so every evaluation of a session scores the same rows. Raises
    ``ValueError`` for no prompts."""
    import asyncio

    from rlsdk.workflow.rollout import normalize_rows

    if prompts is None:
        rows = cache.get(num_prompts)
        if rows is None:  # the same held-out rows at every evaluation of this session
            rows = await asyncio.to_thread(held_out_prompts, config, tokenizer, num_prompts)
            cache[num_prompts] = rows
    else:
        rows = normalize_rows(prompts)
    if not rows:
        raise ValueError("evaluate needs at least one prompt; got an empty prompt list")
    return rows


async def evaluate_policy(
    session: Any,
    engine: Any,
    rows: list[dict[str, Any]],
    reward: Callable[[Any], Awaitable[Any]],
    *,
    n: int,
    greedy: bool,
    threshold: float,
    prefix: str,
) -> dict[str, float]:
    """Sample ``n`` completions per row from ``engine`` with the session's workflow (greedy or sampled, see
    :func:`eval_workflow`), score them with ``reward`` (a rollout -> rewarded rollout call), and log and return
    :func:`eval_metrics` (``threshold``: its ``pass_threshold``) to the session's metrics at its step, with sample
    completions under ``PREFIX/samples``. ``session``: the Session (its public ``workflow``, ``config``, ``step``,
    ``versions``, ``special_tokens`` and ``metrics``)."""
    import time

    from rlsdk.observe.rollout_metrics import samples_markdown

    config, step, versions, metrics_writer = session.config, session.step, session.versions, session.metrics
    eos_token_ids = session.special_tokens.eos_token_ids
    workflow = eval_workflow(session.workflow, greedy=greedy)
    start = time.perf_counter()
    rollout = await workflow.arun_batch(engine, rows, n, seed=eval_seed(config, step))
    rollout = await reward(rollout)
    metrics = eval_metrics(
        rollout,
        n=n,
        pass_threshold=threshold,
        max_new_tokens=getattr(getattr(workflow, "params", None), "max_new_tokens", 0) or 1 << 30,
        eos_token_ids=eos_token_ids,
        engine_version=versions.engine_version,
        seconds=time.perf_counter() - start,
        prefix=prefix,
    )
    if metrics_writer is not None:
        metrics_writer.log(step, metrics)
        metrics_writer.log_text(step, f"{prefix}/samples", samples_markdown(rollout))
    logger.info(
        "evaluation at step %d (engine v%d, %d prompts x %d, %s): reward %.3f, pass@1 %.3f",
        step,
        int(metrics[f"{prefix}/engine_version"]),
        len(rows),
        n,
        "greedy" if greedy else "sampled",
        metrics[f"{prefix}/reward_mean"],
        metrics[f"{prefix}/pass@1"],
    )
    return metrics
