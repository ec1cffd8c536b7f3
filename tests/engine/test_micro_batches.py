"""Token-budget micro-batches: the packing, and the engine's gradient equal to the whole-batch loss's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

# Same directory, imported as pytest's rootdir-relative path puts it (prepend import mode).
from test_ddp_gradients import _make_batch, _reference_gradients

from rlsdk.config import ModelConfig, SessionConfig, TrainConfig
from rlsdk.engine.train import micro_batches
from rlsdk.testing.distributed import run_gloo_ranks


def test_plan_packs_longest_first_within_the_token_budget() -> None:
    prompts = [4, 4, 3, 4, 4, 2]
    completions = [1, 5, 2, 5, 3, 1]

    plan = micro_batches.plan(prompts, completions, max_tokens=20, max_sequences=8)

    assert sorted(r for rows in plan for r in rows) == list(range(6))
    assert plan[0][:2] == [1, 3]  # the two 9-token rows first
    for rows in plan:
        padded = len(rows) * (max(prompts[r] for r in rows) + max(completions[r] for r in rows))
        assert padded <= 20, (rows, padded)


def test_plan_row_longer_than_budget_forms_its_own_micro_batch_and_rows_are_capped() -> None:
    plan = micro_batches.plan([10, 1, 1, 1], [10, 1, 1, 1], max_tokens=5, max_sequences=2)

    assert plan == [[0], [1, 2], [3]]


def test_equalize_splits_the_largest_micro_batch_until_the_count_is_reached() -> None:
    prompts, completions = [2] * 6, [1, 1, 1, 8, 8, 1]
    plan = [[3, 4], [0, 1, 2, 5]]  # 20 and 12 padded tokens

    equal = micro_batches.equalize(plan, 3, prompts, completions)

    assert equal == [[3], [4], [0, 1, 2, 5]]
    with pytest.raises(ValueError, match="cannot make 7 micro-batches"):
        micro_batches.equalize(plan, 7, prompts, completions)


def test_take_trims_left_padded_prompts_and_right_padded_completions() -> None:
    shard = {
        "prompt_ids_B_P": torch.tensor([[0, 0, 5, 6], [7, 8, 9, 5]]),
        "prompt_mask_B_P": torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]], dtype=torch.bool),
        "completion_ids_B_C": torch.tensor([[1, 2, 0, 0], [3, 0, 0, 0]]),
        "completion_mask_B_C": torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool),
        "logprobs_B_C": torch.zeros(2, 4),
        "advantages_B": torch.tensor([0.5, -0.5]),
    }
    prompts, completions = micro_batches.row_lengths(shard)

    micro = micro_batches.take(shard, [0], max(prompts[:1]), max(completions[:1]))

    assert (prompts, completions) == ([2, 4], [2, 1])
    assert micro["prompt_ids_B_P"].tolist() == [[5, 6]]
    assert micro["completion_ids_B_C"].tolist() == [[1, 2]] and micro["logprobs_B_C"].shape == (1, 2)
    assert micro["advantages_B"].tolist() == [0.5]


def test_row_lengths_counts_context_columns_up_to_the_last_attended_one() -> None:
    # multi-turn: a tool output (attended, not trained) after the trained tokens
    shard = {
        "prompt_mask_B_P": torch.ones(1, 3, dtype=torch.bool),
        "completion_mask_B_C": torch.tensor([[1, 0, 0, 1, 0]], dtype=torch.bool),
        "completion_attention_mask_B_C": torch.tensor([[1, 1, 1, 1, 0]], dtype=torch.bool),
    }

    assert micro_batches.row_lengths(shard) == ([3], [4])


def _engine_gradients(model_dir: str, batch: dict, **train: object) -> dict[str, torch.Tensor]:
    from accelerate import Accelerator

    from rlsdk.engine.train.engine import TrainEngine

    config = SessionConfig(model=ModelConfig(path=model_dir), train=TrainConfig(**train))  # type: ignore[arg-type]
    engine = TrainEngine(config, Accelerator(cpu=True))
    engine.accumulate_gradients(batch, int(batch["completion_mask_B_C"].sum()))
    return {name: p.grad.clone() for name, p in engine.unwrapped.named_parameters()}


@pytest.mark.parametrize("budget", [8, 20, 1000])
def test_engine_token_budget_micro_batches_give_the_whole_batch_gradient(tiny_model_dir: Path, budget: int) -> None:
    # budget 8: one or two rows per micro-batch; 20: a few rows each; 1000: the whole shard in one
    model_dir = str(tiny_model_dir)
    batch = _make_batch(model_dir, group_size=3)
    expected = _reference_gradients(model_dir, batch)

    grads = _engine_gradients(model_dir, batch, max_tokens_per_micro_batch=budget, micro_batch_size=16)

    assert set(grads) == set(expected)
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


# Each entry runs on the same 2 gloo ranks, one engine after the other (one process-group start-up).
RANK_CONFIGS: dict[str, dict[str, object]] = {
    # rank 0's rows repeat their prompts, rank 1's do not: ranks pack different micro-batch counts (equalised by
    # the all-reduce), and with FSDP2 the prompt pass runs on both anyway (uniform_calls), else they would hang
    "ddp_budget": {"parallelism": "ddp", "max_tokens_per_micro_batch": 14},
    "fsdp2_budget": {"parallelism": "fsdp2", "max_tokens_per_micro_batch": 14},
    "fsdp2_budget_checkpointing": {
        "parallelism": "fsdp2", "max_tokens_per_micro_batch": 30, "gradient_checkpointing": True,
    },
    "ddp_bf16": {"parallelism": "ddp", "mixed_precision": "bf16", "micro_batch_size": 4},
    "fsdp2_bf16_checkpointing": {
        "parallelism": "fsdp2", "mixed_precision": "bf16", "gradient_checkpointing": True, "micro_batch_size": 4,
    },
}  # fmt: skip


def _rank_runs(rank: int, world_size: int, model_dir: str, batch: dict, num_tokens: int) -> dict:
    from accelerate import Accelerator
    from torch.distributed.tensor import DTensor

    from rlsdk.engine.train.engine import TrainEngine

    per_rank = batch["advantages_B"].shape[0] // world_size
    shard = {k: v[rank * per_rank : (rank + 1) * per_rank] for k, v in batch.items()}
    results = {}
    for name, train in RANK_CONFIGS.items():
        engine = TrainEngine(
            SessionConfig(model=ModelConfig(path=model_dir), train=TrainConfig(**train)),  # type: ignore[arg-type]
            Accelerator(cpu=True),
        )
        engine.accumulate_gradients(shard, num_tokens)
        grads = {}
        for param_name, param in engine.unwrapped.named_parameters():
            grad = param.grad
            grads[param_name] = (grad.full_tensor() if isinstance(grad, DTensor) else grad).clone()
        dtypes = {str(p.dtype) for p in engine.unwrapped.parameters()}
        results[name] = {"grads": grads, "param_dtypes": dtypes, "micro_batches": len(engine._micro_batches(shard))}
    return results


@pytest.mark.distributed
def test_two_gloo_ranks_budgets_checkpointing_and_bf16_give_the_whole_batch_gradient(tiny_model_dir: Path) -> None:
    model_dir = str(tiny_model_dir)
    grouped, distinct = _make_batch(model_dir, seed=1, group_size=3), _make_batch(model_dir, seed=2, group_size=1)
    batch = {k: torch.cat([grouped[k], distinct[k]]) for k in grouped}  # rank 0: grouped rows, rank 1: distinct
    num_tokens = int(batch["completion_mask_B_C"].sum())
    expected = _reference_gradients(model_dir, batch)

    ranks = run_gloo_ranks(_rank_runs, 2, model_dir, batch, num_tokens, timeout_s=300.0)

    for rank, results in enumerate(ranks):
        for name, result in results.items():
            assert result["param_dtypes"] == {"torch.float32"}, name  # master weights stay float32
            assert result["micro_batches"] == ranks[0][name]["micro_batches"], name  # the ranks agree on the count
            if "bf16" in name:
                # bf16 matmuls: the gradient's direction and size agree with float32's to bf16 rounding
                got = torch.cat([g.flatten() for g in result["grads"].values()])
                want = torch.cat([expected[n].flatten() for n in result["grads"]])
                cosine = torch.nn.functional.cosine_similarity(got, want, dim=0)
                assert cosine > 0.99, (rank, name, float(cosine))
                assert abs(got.norm() / want.norm() - 1) < 0.05, (rank, name)
                continue
            for param_name, grad in expected.items():
                torch.testing.assert_close(
                    result["grads"][param_name], grad, rtol=1e-4, atol=1e-6, msg=f"rank {rank} {name} {param_name}"
                )
    assert ranks[0]["ddp_budget"]["micro_batches"] > 1
