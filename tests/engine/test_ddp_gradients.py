"""DDP on 2 real gloo ranks gives the gradient of the single-process global-batch loss, for each aggregation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlsdk.config import AlgorithmConfig, ModelConfig, SessionConfig, TrainConfig
from rlsdk.testing.distributed import run_gloo_ranks

pytestmark = pytest.mark.distributed


def _make_batch(model_dir: str, batch: int = 12, seed: int = 0, group_size: int = 1) -> dict[str, torch.Tensor]:
    """A synthetic update batch: real prompts, random completions of mixed lengths, perturbed old logprobs.

    ``group_size > 1``: every prompt repeats that many times in a row, as in a GRPO rollout (the ranks' forward
    then runs each distinct prompt once, ``train.share_prompt_prefix``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlsdk.algorithms import completion_logprobs
    from rlsdk.engine.inference.sampling import left_pad

    gen = torch.Generator().manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [f"{int(n):03d}>" for n in torch.randint(0, 1000, (batch // group_size,), generator=gen)]
    prompts[0] = "12>"  # a shorter prompt exercises left padding
    prompts = [p for p in prompts for _ in range(group_size)]
    prompt_ids_B_P, prompt_mask_B_P = left_pad([tokenizer(p)["input_ids"] for p in prompts], tokenizer.pad_token_id)
    digits = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)]
    completion_ids_B_C = torch.tensor(digits)[torch.randint(0, 10, (batch, 5), generator=gen)]
    lengths_B = torch.randint(1, 6, (batch,), generator=gen)
    completion_mask_B_C = torch.arange(5)[None, :] < lengths_B[:, None]
    completion_ids_B_C = torch.where(completion_mask_B_C, completion_ids_B_C, tokenizer.pad_token_id)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        logprobs_B_C, _ = completion_logprobs(
            model, prompt_ids_B_P, prompt_mask_B_P, completion_ids_B_C, completion_mask_B_C
        )
    old_B_C = (logprobs_B_C + 0.3 * torch.randn(logprobs_B_C.shape, generator=gen)) * completion_mask_B_C
    return {
        "prompt_ids_B_P": prompt_ids_B_P,
        "prompt_mask_B_P": prompt_mask_B_P,
        "completion_ids_B_C": completion_ids_B_C,
        "completion_mask_B_C": completion_mask_B_C,
        "logprobs_B_C": old_B_C,
        "advantages_B": torch.randn(batch, generator=gen),
    }


ALGORITHMS = {
    "dr_grpo": AlgorithmConfig(name="dr_grpo"),
    # Sequence-mean aggregation, sequence-level ratio, truncated IS, entropy bonus and a k1 KL penalty at once.
    "gspo_tis_entropy_kl": AlgorithmConfig(
        name="gspo", off_policy="tis", is_cap=1.2, entropy_coef=0.01, kl_coef=0.05, kl_estimator="k1"
    ),
}


def _config(model_dir: str, algorithm: AlgorithmConfig | None = None) -> SessionConfig:
    return SessionConfig(
        model=ModelConfig(path=model_dir),
        train=TrainConfig(micro_batch_size=4),
        algorithm=algorithm or AlgorithmConfig(),
    )


def _rank_gradients(
    rank: int, world_size: int, model_dir: str, batch: dict, num_tokens: int, algorithm: AlgorithmConfig | None = None
) -> dict:
    from accelerate import Accelerator

    from rlsdk.engine.train.engine import TrainEngine

    engine = TrainEngine(_config(model_dir, algorithm), Accelerator(cpu=True))
    per_rank = batch["advantages_B"].shape[0] // world_size
    shard = {k: v[rank * per_rank : (rank + 1) * per_rank] for k, v in batch.items()}
    engine.accumulate_gradients(shard, num_tokens)
    return {name: p.grad.clone() for name, p in engine.unwrapped.named_parameters()}


def _reference_gradients(model_dir: str, batch: dict) -> dict:
    from transformers import AutoModelForCausalLM

    from rlsdk.algorithms import completion_logprobs, grpo_loss

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    logprobs_B_C, _ = completion_logprobs(
        model,
        batch["prompt_ids_B_P"],
        batch["prompt_mask_B_P"],
        batch["completion_ids_B_C"],
        batch["completion_mask_B_C"],
    )
    loss, _ = grpo_loss(
        logprobs_B_C,
        batch["logprobs_B_C"],
        batch["advantages_B"],
        batch["completion_mask_B_C"],
        clip_eps_low=0.2,
        clip_eps_high=0.2,
    )
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("group_size", [1, 3])
def test_ddp_two_gloo_ranks_gradients_equal_single_process_global_token_mean(
    tiny_model_dir: Path, group_size: int
) -> None:
    # group_size 3: micro-batches of 4 on 6-sequence shards split groups; the reference runs one forward per row
    model_dir = str(tiny_model_dir)
    batch = _make_batch(model_dir, group_size=group_size)
    num_tokens = int(batch["completion_mask_B_C"].sum())
    expected = _reference_gradients(model_dir, batch)

    per_rank = run_gloo_ranks(_rank_gradients, 2, model_dir, batch, num_tokens)

    assert set(per_rank[0]) == set(expected)
    for rank_grads in per_rank:
        for name, grad in expected.items():
            torch.testing.assert_close(rank_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def _reference_policy_gradients(model_dir: str, batch: dict, algorithm: AlgorithmConfig, max_len: int) -> dict:
    """Single process, whole batch, ``policy_loss`` with its default (whole-batch) normalisers."""
    from transformers import AutoModelForCausalLM

    from rlsdk.algorithms import completion_logprobs, policy_loss

    algo = algorithm.resolved()
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    ref_model = AutoModelForCausalLM.from_pretrained(model_dir)
    inputs = (
        batch["prompt_ids_B_P"],
        batch["prompt_mask_B_P"],
        batch["completion_ids_B_C"],
        batch["completion_mask_B_C"],
    )
    logprobs_B_C, entropy_B_C = completion_logprobs(model, *inputs, with_entropy=True, entropy_grad=True)
    with torch.no_grad():
        ref_logprobs_B_C, _ = completion_logprobs(ref_model, *inputs)
    correct = algo.off_policy != "none"
    loss, _ = policy_loss(
        logprobs_B_C,
        logprobs_B_C.detach() if correct else batch["logprobs_B_C"],
        batch["advantages_B"],
        batch["completion_mask_B_C"],
        clip_eps_low=algo.clip_eps_low,
        clip_eps_high=algo.clip_eps_high,
        loss_agg=algo.loss_agg or "token_mean",
        ratio_level=algo.ratio_level or "token",
        kl_coef=algo.kl_coef,
        kl_estimator=algo.kl_estimator,
        ref_logprobs_B_C=ref_logprobs_B_C if algo.kl_coef > 0 else None,
        entropy_coef=algo.entropy_coef,
        entropy_B_C=entropy_B_C,
        behaviour_logprobs_B_C=batch["logprobs_B_C"] if correct else None,
        is_cap=algo.is_cap if correct else None,
        max_len=max_len,
    )
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("algorithm", ["dr_grpo", "gspo_tis_entropy_kl"])
def test_ddp_two_gloo_ranks_algorithm_options_equal_single_process_global_loss(
    tiny_model_dir: Path, algorithm: str
) -> None:
    model_dir = str(tiny_model_dir)
    batch = _make_batch(model_dir, group_size=2)  # repeated prompts: the policy and reference forwards share them
    num_tokens = int(batch["completion_mask_B_C"].sum())
    config = ALGORITHMS[algorithm]
    expected = _reference_policy_gradients(model_dir, batch, config, _config(model_dir).rollout.max_new_tokens)

    per_rank = run_gloo_ranks(_rank_gradients, 2, model_dir, batch, num_tokens, config)

    for rank_grads in per_rank:
        for name, grad in expected.items():
            torch.testing.assert_close(rank_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def _collectives_in_one_update(rank: int, world_size: int, model_dir: str, batch: dict, num_tokens: int) -> dict:
    from accelerate import Accelerator
    from torch.profiler import profile

    from rlsdk.engine.train.engine import TrainEngine

    engine = TrainEngine(_config(model_dir), Accelerator(cpu=True))
    per_rank = batch["advantages_B"].shape[0] // world_size
    shard = {k: v[rank * per_rank : (rank + 1) * per_rank] for k, v in batch.items()}
    for _ in range(2):  # warm-up: DDP rebuilds its gradient buckets once, in the second iteration (a broadcast)
        engine.update(shard, num_tokens)
    with profile() as prof:
        engine.update(shard, num_tokens)
    counts: dict[str, int] = {}
    for event in prof.key_averages():
        if event.key.startswith("c10d::"):
            counts[event.key] = counts.get(event.key, 0) + event.count
    return counts


def test_ddp_update_two_gloo_ranks_all_reduces_gradients_without_per_forward_buffer_broadcast(
    tiny_model_dir: Path,
) -> None:
    # DDP's default re-broadcasts buffers before every forward (2 micro-batches x 2 calls with shared prompts);
    # the engine turns that off: a causal LM's buffers are constants.
    model_dir = str(tiny_model_dir)
    batch = _make_batch(model_dir, group_size=3)

    per_rank = run_gloo_ranks(_collectives_in_one_update, 2, model_dir, batch, int(batch["completion_mask_B_C"].sum()))

    for counts in per_rank:
        assert not any("broadcast" in name for name in counts), counts
        assert any("allreduce" in name for name in counts), counts  # the gradients (and the profiler sees c10d)
