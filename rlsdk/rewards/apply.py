"""Apply a reward function to a Rollout, with checks that name the function and the bad value.

A reward function takes keyword arguments — ``completions`` (list of ``B`` strings), ``prompts`` and every other
prompt-row column, each repeated per sample — and returns ``B`` numbers (list or tensor). It may be ``async``.
Sync functions run in a worker thread so the event loop keeps serving heartbeats and logs.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import Any

import torch

from rlsdk.workflow.rollout import Rollout

RewardFn = Callable[..., Any]


class RewardError(RuntimeError):
    """A reward function failed or returned something unusable; the rollout itself is kept intact."""


def _name(fn: RewardFn) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


async def compute_rewards(rollout: Rollout, reward_fn: RewardFn, *, timeout_s: float | None = None) -> torch.Tensor:
    """Call ``reward_fn`` on ``rollout``; returns ``rewards_B`` (float32). Raises :class:`RewardError`."""
    rewards_B, _ = await compute_reward_breakdown(rollout, reward_fn, timeout_s=timeout_s)
    return rewards_B


async def compute_reward_breakdown(
    rollout: Rollout, reward_fn: RewardFn, *, timeout_s: float | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Like :func:`compute_rewards`, and also the per-component values, name -> float32 ``(B,)``.

    The components come from a result with a ``components`` mapping (a
    :class:`~rlsdk.rewards.combine.RewardBreakdown`, as :func:`~rlsdk.rewards.combine.combine_rewards` returns);
    for any other result the dict is empty. Raises :class:`RewardError`, also for a bad component.
    """
    columns = rollout.columns()
    kwargs: dict[str, Any] = {("prompts" if k == "prompt" else k): v for k, v in columns.items()}
    kwargs["completions"] = rollout.completions
    name = _name(reward_fn)
    try:
        if inspect.iscoroutinefunction(reward_fn):
            call = reward_fn(**kwargs)
        else:
            call = asyncio.to_thread(reward_fn, **kwargs)
        raw = await asyncio.wait_for(call, timeout=timeout_s)
    except TimeoutError as exc:
        raise RewardError(f"reward function {name} did not return within {timeout_s} s") from exc
    except Exception as exc:
        raise RewardError(f"reward function {name} raised {type(exc).__name__}: {exc}") from exc
    try:
        rewards_B = torch.as_tensor(raw, dtype=torch.float32).reshape(-1)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise RewardError(
            f"reward function {name} returned {type(raw).__name__}; "
            f"allowed: a sequence of {rollout.num_samples} numbers"
        ) from exc
    if rewards_B.numel() != rollout.num_samples:
        raise RewardError(
            f"reward function {name} returned {rewards_B.numel()} rewards for {rollout.num_samples} samples"
        )
    bad = ~torch.isfinite(rewards_B)
    if bool(bad.any()):
        index = int(bad.nonzero()[0])
        raise RewardError(
            f"reward function {name} returned a non-finite reward {float(rewards_B[index])} for sample {index} "
            f"(completion {rollout.completions[index]!r}); rewards must be finite numbers"
        )
    components: dict[str, torch.Tensor] = {}
    for key, values in (getattr(raw, "components", None) or {}).items():
        try:
            values_B = torch.as_tensor(values, dtype=torch.float32).reshape(-1)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise RewardError(f"reward function {name} returned an unusable component {key!r}: {exc}") from exc
        if values_B.numel() != rollout.num_samples or not bool(torch.isfinite(values_B).all()):
            raise RewardError(
                f"reward function {name} returned component {key!r} with {values_B.numel()} values for "
                f"{rollout.num_samples} samples or a non-finite value; allowed: {rollout.num_samples} finite numbers"
            )
        components[str(key)] = values_B
    return rewards_B, components
