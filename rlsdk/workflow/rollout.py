"""Rollout: a batch of generated samples with their behaviour versions, and later their rewards.

Layout: ``G`` prompts (``rows``), each sampled ``group_size`` times; samples of one group are contiguous, so
``B = G * group_size``. Prompts are left-padded to ``P`` tokens, completions right-padded to ``C`` tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class Rollout:
    """Generated samples. Tensors are on CPU; see the module docstring for the shape names.

    - ``rows``: the ``G`` prompt records (dicts with at least ``prompt``; other columns go to rewards).
    - ``completions``: decoded completion text per sample (``B`` strings, EOS removed).
    - ``versions_B_C``: weight version that produced each token (-1 on padding).
    - ``rewards_B``: float32 rewards, ``None`` until :meth:`Session.reward` has run.
    - ``attention_mask_B_C``: bool, the completion tokens in the model's context: ``None`` means
      ``completion_mask_B_C``. Multi-turn workflows set it True on tool-output tokens too, which are in the
      context but not trained on (``completion_mask_B_C`` False there).
    """

    rows: list[dict[str, Any]]
    group_size: int
    prompt_ids_B_P: torch.Tensor
    prompt_mask_B_P: torch.Tensor
    completion_ids_B_C: torch.Tensor
    completion_mask_B_C: torch.Tensor
    logprobs_B_C: torch.Tensor
    versions_B_C: torch.Tensor
    completions: list[str]
    rewards_B: torch.Tensor | None = None
    info: dict[str, Any] = field(default_factory=dict)
    attention_mask_B_C: torch.Tensor | None = None

    def __post_init__(self) -> None:
        batch = self.completion_ids_B_C.shape[0]
        if batch != len(self.rows) * self.group_size:
            raise ValueError(f"Rollout has {batch} samples but {len(self.rows)} rows x group_size {self.group_size}")
        shape_B_C = tuple(self.completion_ids_B_C.shape)
        for name in ("completion_mask_B_C", "logprobs_B_C", "versions_B_C"):
            if tuple(getattr(self, name).shape) != shape_B_C:
                raise ValueError(f"Rollout.{name} has shape {tuple(getattr(self, name).shape)}, want {shape_B_C}")
        if self.attention_mask_B_C is not None and tuple(self.attention_mask_B_C.shape) != shape_B_C:
            raise ValueError(
                f"Rollout.attention_mask_B_C has shape {tuple(self.attention_mask_B_C.shape)}, want {shape_B_C}"
            )
        if tuple(self.prompt_mask_B_P.shape) != tuple(self.prompt_ids_B_P.shape):
            raise ValueError("Rollout.prompt_mask_B_P must have the shape of prompt_ids_B_P")
        if len(self.completions) != batch:
            raise ValueError(f"Rollout.completions has {len(self.completions)} entries, want {batch}")
        if self.rewards_B is not None and tuple(self.rewards_B.shape) != (batch,):
            raise ValueError(f"Rollout.rewards_B has shape {tuple(self.rewards_B.shape)}, want ({batch},)")

    @property
    def num_samples(self) -> int:
        return self.completion_ids_B_C.shape[0]

    @property
    def behaviour_versions_B(self) -> torch.Tensor:
        """The oldest version that produced each sample (the one staleness is measured against)."""
        big = torch.iinfo(torch.int64).max
        masked = torch.where(self.completion_mask_B_C, self.versions_B_C, torch.full_like(self.versions_B_C, big))
        return masked.min(dim=1).values

    @property
    def versions(self) -> list[int]:
        """The distinct weight versions that produced tokens of this rollout."""
        return sorted(int(v) for v in torch.unique(self.versions_B_C[self.completion_mask_B_C]))

    def columns(self) -> dict[str, list[Any]]:
        """Each prompt-row column repeated per sample (length ``B``), for reward functions."""
        keys = self.rows[0].keys() if self.rows else ()
        return {key: [row[key] for row in self.rows for _ in range(self.group_size)] for key in keys}

    def with_rewards(self, rewards_B: torch.Tensor) -> Rollout:
        return dataclasses.replace(self, rewards_B=rewards_B)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "samples": self.num_samples,
            "groups": len(self.rows),
            "group_size": self.group_size,
            "versions": self.versions,
            "mean_completion_tokens": float(self.completion_mask_B_C.sum(dim=1).float().mean()),
        }
        if self.rewards_B is not None:
            out["reward_mean"] = float(self.rewards_B.mean())
        return out

    def __repr__(self) -> str:
        s = self.summary()
        reward = f", reward_mean={s['reward_mean']:.3f}" if "reward_mean" in s else ", unrewarded"
        return (
            f"Rollout({s['samples']} samples = {s['groups']} prompts x {s['group_size']}, "
            f"versions={s['versions']}, mean_tokens={s['mean_completion_tokens']:.1f}{reward})"
        )


def normalize_rows(prompts: Any) -> list[dict[str, Any]]:
    """Accept strings, dicts with a ``prompt`` key, or a ``datasets`` batch dict of columns."""
    if isinstance(prompts, Mapping):
        if "prompt" not in prompts:
            raise ValueError(f"prompts batch needs a 'prompt' column; got columns {sorted(prompts)}")
        keys = list(prompts)
        prompts = [dict(zip(keys, values)) for values in zip(*(prompts[k] for k in keys))]
    rows: list[dict[str, Any]] = []
    for index, item in enumerate(prompts):
        if isinstance(item, str):
            rows.append({"prompt": item})
        elif isinstance(item, Mapping):
            if "prompt" not in item:
                raise ValueError(f"prompts[{index}] has no 'prompt' key; keys: {sorted(item)}")
            rows.append(dict(item))
        else:
            raise TypeError(f"prompts[{index}] is a {type(item).__name__}; allowed: str or a dict with 'prompt'")
    for index, row in enumerate(rows):
        if not isinstance(row["prompt"], str) or not row["prompt"]:
            raise ValueError(f"prompts[{index}]['prompt'] must be a non-empty string, got {row['prompt']!r}")
    return rows
