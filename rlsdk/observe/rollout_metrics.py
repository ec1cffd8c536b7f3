"""The per-step metrics users look for, as small pure functions returning namespaced dicts (tinker-cookbook's
``rl/metrics.py`` style): ``Session.update`` merges them into its statistics, ``Session.evaluate`` into its own.

- :func:`reward_metrics`: ``reward/mean``, ``reward/std`` and one ``reward/NAME`` per reward component.
- :func:`completion_metrics`: ``completion/len_{mean,max,min}`` (generated tokens), ``completion/eos_rate``,
  ``completion/stop_rate`` (a stop string) and ``completion/truncated_rate`` (hit ``max_new_tokens``).
- :func:`throughput_metrics`: ``throughput/{rollout,update}_tokens_per_s``.
- :func:`pass_metrics`: ``pass@1`` and ``pass@n`` of a batch of ``n`` samples per prompt.
- :func:`samples_markdown`: a few prompts, completions and rewards as a Markdown table (TensorBoard's text tab,
  the dashboard).
- :func:`sft_metrics`: ``sft/loss``, ``sft/perplexity``, ``sft/tokens`` and the rest of an SFT step
  (``Session.sft_update``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from rlsdk.workflow.rollout import Rollout


def reward_metrics(rollout: Rollout, prefix: str = "reward") -> dict[str, float]:
    """Mean and (sample) std of ``rollout.rewards_B``, and the unweighted mean of each component a
    :func:`~rlsdk.rewards.combine_rewards` reward left in ``info["reward_components"]``. Empty without rewards."""
    rewards_B = rollout.rewards_B
    if rewards_B is None:
        return {}
    return {
        f"{prefix}/mean": float(rewards_B.mean()),
        f"{prefix}/std": float(rewards_B.std()) if rewards_B.numel() > 1 else 0.0,
        **{f"{prefix}/{name}": float(v.mean()) for name, v in rollout.info.get("reward_components", {}).items()},
    }


def finish_reasons(rollout: Rollout, *, max_new_tokens: int, eos_token_ids: Sequence[int]) -> list[str]:
    """Why each sample ended: ``"eos"``, ``"stop"`` (a stop string) or ``"length"``. The workflow's
    ``info["finish_reasons"]`` when it recorded them (the default single-turn workflow does); else from the
    tokens: ``"eos"`` when the last generated token is an EOS id, ``"length"`` when ``max_new_tokens`` were
    generated, ``"stop"`` otherwise (a custom workflow cut it)."""
    recorded = rollout.info.get("finish_reasons")
    if recorded is not None and len(recorded) == rollout.num_samples:
        return list(recorded)
    mask_B_C = rollout.completion_mask_B_C
    lengths_B = mask_B_C.sum(dim=1)
    # the last generated (masked-in) position of each row; multi-turn tool tokens are masked out
    positions_B_C = torch.arange(mask_B_C.shape[1]).expand_as(mask_B_C)
    last_B = torch.where(mask_B_C, positions_B_C, -1).max(dim=1).values.clamp(min=0)
    last_token_B = rollout.completion_ids_B_C.gather(1, last_B.unsqueeze(1)).squeeze(1)
    eos_B = torch.isin(last_token_B, torch.tensor(list(eos_token_ids), dtype=torch.long)) & (lengths_B > 0)
    return [
        "eos" if eos else ("length" if length >= max_new_tokens else "stop")
        for eos, length in zip(eos_B.tolist(), lengths_B.tolist())
    ]


def completion_metrics(
    rollout: Rollout, *, max_new_tokens: int, eos_token_ids: Sequence[int], prefix: str = "completion"
) -> dict[str, float]:
    """Length statistics of the generated tokens (``completion_mask_B_C``) and the share of samples ended by an
    EOS id, a stop string, or truncated at ``max_new_tokens`` (see :func:`finish_reasons`)."""
    lengths_B = rollout.completion_mask_B_C.sum(dim=1).float()
    reasons = finish_reasons(rollout, max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids)
    count = max(len(reasons), 1)
    return {
        f"{prefix}/len_mean": float(lengths_B.mean()),
        f"{prefix}/len_max": float(lengths_B.max()),
        f"{prefix}/len_min": float(lengths_B.min()),
        f"{prefix}/eos_rate": reasons.count("eos") / count,
        f"{prefix}/stop_rate": reasons.count("stop") / count,
        f"{prefix}/truncated_rate": reasons.count("length") / count,
    }


def throughput_metrics(
    *, rollout_tokens: float, rollout_s: float, update_tokens: float, update_s: float
) -> dict[str, float]:
    """Tokens per second of each phase: generated tokens over the rollout's seconds, trained completion tokens
    over the update's. NaN where a phase's time is unknown or zero (the metrics writer drops NaN)."""

    def rate(tokens: float, seconds: float) -> float:
        return tokens / seconds if seconds > 0 and math.isfinite(seconds) else math.nan

    return {
        "throughput/rollout_tokens_per_s": rate(rollout_tokens, rollout_s),
        "throughput/update_tokens_per_s": rate(update_tokens, update_s),
    }


def current_rows_B_C(rollout: Rollout, trainer_version: int) -> torch.Tensor:
    """The completion tokens whose trainer and engine log-probs are comparable like with like: every generated
    token of their row came from the weights the trainer holds (``versions_B_C == trainer_version``).

    In async mode a row is mostly one version behind, or partial (later tokens from the new weights over a key/value
    cache the old ones wrote): the trainer's forward on its own weights differs from such a row's log-probs by the
    policy's lag, not by a fault, and would read as corrupted weights."""
    mask_B_C = rollout.completion_mask_B_C.bool()
    whole_B = ((rollout.versions_B_C == trainer_version) | ~mask_B_C).all(dim=1)
    return mask_B_C & whole_B[:, None]


def agreement_metrics(totals: Mapping[str, float], maxima: Mapping[str, float]) -> dict[str, float]:
    """Trainer-vs-engine agreement of an update, from the ranks' summed ``agreement_tokens``,
    ``logprob_absdiff_sum``, ``ratio_dev_sq_sum`` and their ``logprob_absdiff_max``, ``ratio_max`` and
    ``neg_ratio_min`` (the ratio minimum negated): over the rows the trainer's own weights sampled
    (:func:`current_rows_B_C`).

    ``agreement/tokens`` counts them; with none (an async batch entirely one version behind) every other entry is
    NaN, which no threshold check fires on: there was nothing like-for-like to compare."""
    tokens = float(totals["agreement_tokens"])
    if tokens <= 0:
        nan = float("nan")
        return {"agreement/tokens": 0.0, **{f"agreement/{k}": nan for k in _AGREEMENT_STATS}}
    return {
        "agreement/tokens": tokens,
        "agreement/logprob_absdiff_mean": float(totals["logprob_absdiff_sum"]) / tokens,
        "agreement/logprob_absdiff_max": float(maxima["logprob_absdiff_max"]),
        "agreement/ratio_rms_dev": (float(totals["ratio_dev_sq_sum"]) / tokens) ** 0.5,  # sqrt(mean((ratio-1)^2))
        "agreement/ratio_min": -float(maxima["neg_ratio_min"]),
        "agreement/ratio_max": float(maxima["ratio_max"]),
    }


_AGREEMENT_STATS = ("logprob_absdiff_mean", "logprob_absdiff_max", "ratio_rms_dev", "ratio_min", "ratio_max")


def pass_metrics(
    rewards_B: torch.Tensor, group_size: int, *, threshold: float = 1.0, prefix: str = "eval"
) -> dict[str, float]:
    """``pass@1`` (the share of samples whose reward is >= ``threshold``: the unbiased pass@1 estimate with
    ``group_size`` samples per prompt) and, for ``group_size > 1``, ``pass@{group_size}`` (the share of prompts
    with at least one such sample)."""
    passed_G_S = (rewards_B >= threshold).view(-1, group_size)
    out = {f"{prefix}/pass@1": float(passed_G_S.float().mean())}
    if group_size > 1:
        out[f"{prefix}/pass@{group_size}"] = float(passed_G_S.any(dim=1).float().mean())
    return out


def samples_markdown(rollout: Rollout, count: int = 4, *, max_chars: int = 300) -> str:
    """The first sample of each of the first ``count`` prompts as a Markdown table (prompt, completion, reward);
    text cut at ``max_chars``."""

    def cell(text: object) -> str:
        value = str(text)
        if len(value) > max_chars:
            value = value[:max_chars] + "…"
        return value.replace("|", "\\|").replace("\n", "⏎")

    lines = ["| prompt | completion | reward |", "| --- | --- | --- |"]
    for g, row in enumerate(rollout.rows[:count]):
        b = g * rollout.group_size
        reward = "" if rollout.rewards_B is None else f"{float(rollout.rewards_B[b]):.3f}"
        lines.append(f"| {cell(row.get('prompt', ''))} | {cell(rollout.completions[b])} | {reward} |")
    return "\n".join(lines)


def sft_metrics(results: Sequence[dict[str, float]], *, seconds: float) -> dict[str, float]:
    """An SFT step's metrics from every rank's ``sft_update`` result (sums over its shard): ``sft/loss`` (mean
    negative log-likelihood per completion token, nats), ``sft/perplexity``, ``sft/tokens``, ``sft/sequences``,
    ``sft/grad_norm`` (before clipping), ``sft/lr``, ``time/sft_s`` and ``throughput/sft_tokens_per_s``."""
    tokens = sum(float(r["tokens"]) for r in results)
    loss = sum(float(r["nll_sum"]) for r in results) / max(tokens, 1.0)
    return {
        "sft/loss": loss,
        "sft/perplexity": math.exp(min(loss, 50.0)),
        "sft/tokens": tokens,
        "sft/sequences": float(sum(int(r["sequences"]) for r in results)),
        "sft/grad_norm": float(results[0]["grad_norm"]),
        "sft/lr": float(results[0]["lr"]),
        "time/sft_s": seconds,
        "throughput/sft_tokens_per_s": tokens / seconds if seconds > 0 else math.nan,
    }


_UPDATE_SUMS = (
    "loss_sum", "clipped_tokens", "ratio_sum", "kl_sum", "entropy_sum", "tokens", "logprob_absdiff_sum",
    "ratio_dev_sq_sum", "objective", "is_weight_sum", "is_capped_tokens", "agreement_tokens", "ratio_limited_tokens",
)  # fmt: skip


def update_metrics(results: Sequence[dict[str, float]], *, world: int) -> dict[str, float]:
    """An RL update's ``train/*`` and ``agreement/*`` metrics from every rank's ``update`` result (sums over its
    shard), means over the completion tokens, and ``time/rank_update_s`` (the slowest rank).

    ``agreement/*`` compares the trainer's log-probabilities with the engine's behaviour log-probabilities on the
    rows the trainer's weights sampled wholly (:func:`agreement_metrics`)."""
    totals = {k: sum(float(r[k]) for r in results) for k in _UPDATE_SUMS}
    maxima = {k: max(float(r[k]) for r in results) for k in ("logprob_absdiff_max", "ratio_max", "neg_ratio_min")}
    tokens = max(totals["tokens"], 1.0)
    return {
        "train/loss": totals["loss_sum"] / tokens,
        # The aggregated loss actually differentiated (per algorithm.loss_agg); each rank's share is scaled by the
        # world size because DDP averages gradients.
        "train/objective": totals["objective"] / world,
        "train/is_weight_mean": totals["is_weight_sum"] / tokens,
        "train/is_capped_fraction": totals["is_capped_tokens"] / tokens,
        # Tokens whose log-ratio lay beyond algorithm.losses.LOG_RATIO_LIMIT (the overflow guard engaged): 0 in a
        # healthy run; anything else means trainer and engine log-probs disagree wildly.
        "train/ratio_limited_fraction": totals["ratio_limited_tokens"] / tokens,
        "train/clip_fraction": totals["clipped_tokens"] / tokens,
        "train/ratio_mean": totals["ratio_sum"] / tokens,
        "train/kl": totals["kl_sum"] / tokens,
        "train/entropy": totals["entropy_sum"] / tokens,
        "train/grad_norm": float(results[0]["grad_norm"]),
        "train/lr": float(results[0]["lr"]),
        "train/optimizer_steps": float(results[0]["optimizer_steps"]),
        "train/tokens": totals["tokens"],
        **agreement_metrics(totals, maxima),
        "time/rank_update_s": max(float(r["seconds"]) for r in results),
    }
