"""policy_loss against a plain-Python per-element reference; chunk additivity of every aggregation; GSPO."""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import torch
from _loss_options import policy_loss_with_options

from rlsdk.algorithms import grpo_loss, kl_penalty, policy_loss

MAX_LEN = 7


def reference_policy_loss(data: dict[str, Any], opts: dict[str, Any]) -> float:
    """The whole-batch loss of ``policy_loss`` with one Python loop per element."""
    logp, old, adv, mask = data["logprobs"], data["old"], data["advantages"], data["mask"]
    lo, hi = opts["clip_eps_low"], opts["clip_eps_high"]
    per_seq: list[float] = []
    lengths: list[int] = []
    for b, row in enumerate(logp):
        n = sum(mask[b])
        seq_ratio = math.exp(sum(row[t] - old[b][t] for t in range(len(row)) if mask[b][t]) / max(n, 1))
        total = 0.0
        for t, lp in enumerate(row):
            if not mask[b][t]:
                continue
            ratio = seq_ratio if opts["ratio_level"] == "sequence" else math.exp(lp - old[b][t])
            pg = -min(ratio * adv[b], min(max(ratio, 1 - lo), 1 + hi) * adv[b])
            if opts["behaviour"]:
                w = math.exp(old[b][t] - data["behaviour"][b][t])
                if opts["is_cap"] is not None and w > opts["is_cap"]:
                    w = opts["is_cap"] if opts["is_cap_mode"] == "truncate" else 0.0
                pg *= w
            log_r = data["ref"][b][t] - lp
            kl = {"k1": -log_r, "k2": log_r * log_r / 2, "k3": math.exp(log_r) - log_r - 1}[opts["kl_estimator"]]
            total += pg + opts["kl_coef"] * kl - opts["entropy_coef"] * data["entropy"][b][t]
        per_seq.append(total)
        lengths.append(n)
    if opts["loss_agg"] == "token_mean":
        return sum(per_seq) / max(sum(lengths), 1)
    if opts["loss_agg"] == "seq_mean_token_mean":
        return sum(s / max(n, 1) for s, n in zip(per_seq, lengths)) / len(per_seq)
    return sum(per_seq) / (len(per_seq) * MAX_LEN)


def _batch(seed: int = 0, lengths: tuple[int, ...] = (5, 3, 1, 4, 5, 2, 0, 7)) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    batch, width = len(lengths), MAX_LEN

    def noise(scale: float) -> torch.Tensor:
        return torch.randn(batch, width, generator=generator, dtype=torch.float64) * scale

    old_B_C = -torch.rand(batch, width, generator=generator, dtype=torch.float64) * 3
    return {
        "logprobs_B_C": old_B_C + noise(0.3),
        "old_logprobs_B_C": old_B_C,
        "advantages_B": torch.randn(batch, generator=generator, dtype=torch.float64),
        "mask_B_C": torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1),
        "ref_logprobs_B_C": old_B_C + noise(0.2),
        "behaviour_logprobs_B_C": old_B_C + noise(0.4),
        "entropy_B_C": torch.rand(batch, width, generator=generator, dtype=torch.float64) * 2,
    }


def _options(**overrides: Any) -> dict[str, Any]:
    opts = {
        "clip_eps_low": 0.2,
        "clip_eps_high": 0.28,
        "loss_agg": "token_mean",
        "ratio_level": "token",
        "kl_coef": 0.1,
        "kl_estimator": "k3",
        "entropy_coef": 0.01,
        "behaviour": False,
        "is_cap": None,
        "is_cap_mode": "truncate",
    }
    opts.update(overrides)
    return opts


def _call(data: dict[str, torch.Tensor], opts: dict[str, Any], **normalisers: Any) -> tuple[torch.Tensor, dict]:
    return policy_loss_with_options(
        data["logprobs_B_C"],
        data["old_logprobs_B_C"],
        data["advantages_B"],
        data["mask_B_C"],
        opts,
        ref_logprobs_B_C=data["ref_logprobs_B_C"],
        entropy_B_C=data["entropy_B_C"],
        behaviour_logprobs_B_C=data["behaviour_logprobs_B_C"] if opts["behaviour"] else None,
        max_len=MAX_LEN,
        **normalisers,
    )


def _as_lists(data: dict[str, torch.Tensor]) -> dict[str, Any]:
    return {
        "logprobs": data["logprobs_B_C"].tolist(),
        "old": data["old_logprobs_B_C"].tolist(),
        "advantages": data["advantages_B"].tolist(),
        "mask": data["mask_B_C"].tolist(),
        "ref": data["ref_logprobs_B_C"].tolist(),
        "behaviour": data["behaviour_logprobs_B_C"].tolist(),
        "entropy": data["entropy_B_C"].tolist(),
    }


OPTION_GRID = [
    _options(loss_agg=agg, ratio_level=level, kl_estimator=kl, behaviour=behaviour, is_cap=cap, is_cap_mode=mode)
    for agg, level, kl, (behaviour, cap, mode) in itertools.product(
        ["token_mean", "seq_mean_token_mean", "seq_sum_fixed_len"],
        ["token", "sequence"],
        ["k1", "k2", "k3"],
        [(False, None, "truncate"), (True, None, "truncate"), (True, 1.1, "truncate"), (True, 1.1, "mask")],
    )
]


@pytest.mark.parametrize("opts", OPTION_GRID, ids=lambda o: "-".join(str(v) for v in o.values()))
def test_policy_loss_option_grid_matches_python_reference(opts: dict[str, Any]) -> None:
    data = _batch()

    loss, metrics = _call(data, opts)

    expected = reference_policy_loss(_as_lists(data), opts)
    torch.testing.assert_close(loss, torch.tensor(expected, dtype=torch.float64), rtol=1e-10, atol=1e-12)
    assert all(value.dim() == 0 for value in metrics.values())


@pytest.mark.parametrize("opts", OPTION_GRID[::5], ids=lambda o: "-".join(str(v) for v in o.values()))
def test_policy_loss_chunks_with_global_normalisers_sum_to_whole_batch_loss_and_grad(opts: dict[str, Any]) -> None:
    data = _batch(seed=3)
    logprobs_B_C = data["logprobs_B_C"].clone().requires_grad_(True)
    whole = {**data, "logprobs_B_C": logprobs_B_C}
    normalisers = {
        "num_tokens": data["mask_B_C"].sum().double(),
        "num_sequences": float(data["advantages_B"].shape[0]),
    }

    whole_loss, _ = _call(whole, opts)
    (whole_grad,) = torch.autograd.grad(whole_loss, logprobs_B_C)
    chunk_losses = [
        _call({k: v[rows] for k, v in whole.items()}, opts, **normalisers)[0]
        for rows in (slice(0, 3), slice(3, 4), slice(4, 8))
    ]
    chunked_loss = torch.stack(chunk_losses).sum()
    (chunked_grad,) = torch.autograd.grad(chunked_loss, logprobs_B_C)

    torch.testing.assert_close(chunked_loss, whole_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(chunked_grad, whole_grad, rtol=1e-12, atol=1e-12)


def test_policy_loss_defaults_equal_grpo_loss() -> None:
    data = _batch()

    loss, metrics = policy_loss(
        data["logprobs_B_C"],
        data["old_logprobs_B_C"],
        data["advantages_B"],
        data["mask_B_C"],
        clip_eps_low=0.2,
        clip_eps_high=0.28,
        kl_coef=0.1,
        ref_logprobs_B_C=data["ref_logprobs_B_C"],
    )
    expected_loss, expected_metrics = grpo_loss(
        data["logprobs_B_C"],
        data["old_logprobs_B_C"],
        data["advantages_B"],
        data["mask_B_C"],
        clip_eps_low=0.2,
        clip_eps_high=0.28,
        kl_coef=0.1,
        ref_logprobs_B_C=data["ref_logprobs_B_C"],
    )

    torch.testing.assert_close(loss, expected_loss, rtol=0, atol=0)
    for key, value in expected_metrics.items():
        torch.testing.assert_close(metrics[key], value, rtol=0, atol=0)


def test_policy_loss_gspo_seq_mean_gradient_equals_sequence_level_objective_gradient() -> None:
    # GSPO's objective -1/B sum_i min(s_i A_i, clip(s_i) A_i), written directly with s_i in the graph.
    data = _batch(seed=5, lengths=(5, 3, 1, 4))
    logprobs_B_C = data["logprobs_B_C"].clone().requires_grad_(True)
    mask_B_C = data["mask_B_C"]
    opts = _options(loss_agg="seq_mean_token_mean", ratio_level="sequence", kl_coef=0.0, entropy_coef=0.0)
    opts.update(clip_eps_low=0.05, clip_eps_high=0.05)

    loss, metrics = _call({**data, "logprobs_B_C": logprobs_B_C}, opts)
    (grad,) = torch.autograd.grad(loss, logprobs_B_C)
    log_s_B = torch.where(mask_B_C, logprobs_B_C - data["old_logprobs_B_C"], 0.0).sum(1) / mask_B_C.sum(1)
    s_B = log_s_B.exp()
    adv_B = data["advantages_B"]
    direct = -torch.minimum(s_B * adv_B, s_B.clamp(0.95, 1.05) * adv_B).mean()
    (direct_grad,) = torch.autograd.grad(direct, logprobs_B_C)

    torch.testing.assert_close(loss, direct, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, direct_grad, rtol=1e-12, atol=1e-12)
    assert 0 < metrics["clipped_tokens"] < metrics["tokens"]  # the range above clips some sequences, not all


def test_policy_loss_single_token_completions_sequence_ratio_equals_token_ratio() -> None:
    data = _batch(seed=2, lengths=(1, 1, 1))

    token_loss, _ = _call(data, _options(ratio_level="token", loss_agg="seq_mean_token_mean"))
    seq_loss, _ = _call(data, _options(ratio_level="sequence", loss_agg="seq_mean_token_mean"))

    torch.testing.assert_close(seq_loss, token_loss, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean", "seq_sum_fixed_len"])
@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_policy_loss_masked_garbage_does_not_leak_into_loss_or_grad(loss_agg: str, ratio_level: str) -> None:
    data = _batch()
    logprobs_B_C = data["logprobs_B_C"].clone()
    logprobs_B_C[~data["mask_B_C"]] = float("nan")
    for key in ("old_logprobs_B_C", "ref_logprobs_B_C", "behaviour_logprobs_B_C", "entropy_B_C"):
        data[key] = data[key].masked_fill(~data["mask_B_C"], float("inf"))
    logprobs_B_C.requires_grad_(True)

    loss, metrics = _call(
        {**data, "logprobs_B_C": logprobs_B_C},
        _options(loss_agg=loss_agg, ratio_level=ratio_level, behaviour=True, is_cap=2.0),
    )
    loss.backward()

    assert torch.isfinite(loss)
    assert all(torch.isfinite(value) for value in metrics.values())
    assert logprobs_B_C.grad is not None
    assert torch.isfinite(logprobs_B_C.grad).all()
    assert (logprobs_B_C.grad[~data["mask_B_C"]] == 0).all()


def test_policy_loss_truncated_is_metrics_count_capped_tokens() -> None:
    data = _batch()
    mask = data["mask_B_C"]
    weight = (data["old_logprobs_B_C"] - data["behaviour_logprobs_B_C"]).exp()

    _, metrics = _call(data, _options(behaviour=True, is_cap=1.1))

    capped = (weight > 1.1) & mask
    assert 0 < int(capped.sum()) < int(mask.sum())
    torch.testing.assert_close(metrics["is_capped_tokens"], capped.sum().float(), rtol=0, atol=0)
    torch.testing.assert_close(
        metrics["is_weight_sum"], weight.clamp(max=1.1)[mask].sum().float(), rtol=1e-6, atol=1e-6
    )


def test_policy_loss_masked_is_metrics_count_dropped_tokens_and_sum_kept_weights() -> None:
    data = _batch()
    mask = data["mask_B_C"]
    weight = (data["old_logprobs_B_C"] - data["behaviour_logprobs_B_C"]).exp()

    _, metrics = _call(data, _options(behaviour=True, is_cap=1.1, is_cap_mode="mask"))

    dropped = (weight > 1.1) & mask
    assert 0 < int(dropped.sum()) < int(mask.sum())
    torch.testing.assert_close(metrics["is_capped_tokens"], dropped.sum().float(), rtol=0, atol=0)
    torch.testing.assert_close(metrics["is_weight_sum"], weight[mask & ~dropped].sum().float(), rtol=1e-6, atol=1e-6)


def test_policy_loss_without_behaviour_logprobs_has_unit_weights() -> None:
    data = _batch()

    _, metrics = _call(data, _options())

    torch.testing.assert_close(metrics["is_weight_sum"], metrics["tokens"], rtol=0, atol=0)
    torch.testing.assert_close(metrics["is_capped_tokens"], torch.tensor(0.0), rtol=0, atol=0)


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean", "seq_sum_fixed_len"])
def test_policy_loss_empty_mask_gives_zero_loss(loss_agg: str) -> None:
    data = _batch()
    data["mask_B_C"] = torch.zeros_like(data["mask_B_C"])

    loss, metrics = _call(data, _options(loss_agg=loss_agg))

    torch.testing.assert_close(loss, torch.zeros((), dtype=torch.float64), rtol=0, atol=0)
    torch.testing.assert_close(metrics["tokens"], torch.tensor(0.0), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("estimator", "formula"),
    [
        ("k1", lambda lr: -lr),
        ("k2", lambda lr: lr * lr / 2),
        ("k3", lambda lr: math.exp(lr) - lr - 1),
    ],
)
def test_kl_penalty_each_estimator_matches_schulman_formula(estimator: str, formula: Any) -> None:
    generator = torch.Generator().manual_seed(4)
    logprobs_B_C = -torch.rand(3, 4, generator=generator, dtype=torch.float64)
    ref_B_C = -torch.rand(3, 4, generator=generator, dtype=torch.float64)

    kl_B_C = kl_penalty(logprobs_B_C, ref_B_C, estimator)  # type: ignore[arg-type]

    expected = [
        [formula(r - lp) for lp, r in zip(row, ref_row)]
        for row, ref_row in zip(logprobs_B_C.tolist(), ref_B_C.tolist())
    ]
    torch.testing.assert_close(kl_B_C, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"loss_agg": "sum"}, "loss_agg='sum' is invalid"),
        ({"ratio_level": "chunk"}, "ratio_level='chunk' is invalid"),
        ({"is_cap_mode": "clip"}, "is_cap_mode='clip' is invalid"),
        ({"is_cap": 0.0}, "is_cap=0.0 is invalid"),
        ({"entropy_coef": -1.0}, "entropy_coef=-1.0 is invalid"),
        ({"kl_estimator": "k4"}, "estimator='k4' is invalid"),
    ],
)
def test_policy_loss_bad_option_raises_value_error_naming_it(overrides: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _call(_batch(), _options(**overrides))


def test_policy_loss_fixed_len_without_max_len_and_bonus_without_entropy_raise() -> None:
    data = _batch()
    args = (data["logprobs_B_C"], data["old_logprobs_B_C"], data["advantages_B"], data["mask_B_C"])

    with pytest.raises(ValueError, match="max_len=None is invalid for loss_agg='seq_sum_fixed_len'"):
        policy_loss(*args, clip_eps_low=0.2, clip_eps_high=0.2, loss_agg="seq_sum_fixed_len")
    with pytest.raises(ValueError, match=r"entropy_coef=0\.1 > 0 needs entropy_B_C"):
        policy_loss(*args, clip_eps_low=0.2, clip_eps_high=0.2, entropy_coef=0.1)
    with pytest.raises(ValueError, match=r"behaviour_logprobs_B_C has shape \(7"):
        policy_loss(*args, clip_eps_low=0.2, clip_eps_high=0.2, behaviour_logprobs_B_C=data["old_logprobs_B_C"][:-1])
    with pytest.raises(ValueError, match="num_sequences=0 is invalid"):
        policy_loss(*args, clip_eps_low=0.2, clip_eps_high=0.2, loss_agg="seq_mean_token_mean", num_sequences=0)
