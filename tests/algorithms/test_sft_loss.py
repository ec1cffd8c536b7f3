"""The SFT loss: a token mean of the completion tokens' negative log-likelihood over the whole batch; prompt tokens
and padding are never targets, and micro-batches with the global token count add up to the one-batch loss."""

from __future__ import annotations

import pytest
import torch

from rlsdk.algorithms import completion_logprobs
from rlsdk.algorithms.sft import sft_loss


def test_sft_loss_is_the_mean_negative_logprob_of_masked_tokens_only() -> None:
    logprobs_B_C = torch.tensor([[-1.0, -2.0, -9.0], [-3.0, -5.0, -7.0]])
    mask_B_C = torch.tensor([[True, True, False], [True, False, False]])

    loss, metrics = sft_loss(logprobs_B_C, mask_B_C)

    torch.testing.assert_close(loss, torch.tensor((1.0 + 2.0 + 3.0) / 3), rtol=1e-6, atol=1e-7)
    assert float(metrics["tokens"]) == 3.0 and float(metrics["nll_sum"]) == pytest.approx(6.0)


def test_sft_loss_micro_batches_with_the_global_count_add_up_to_the_whole_batch_gradient() -> None:
    torch.manual_seed(0)
    logits_B_C = torch.randn(6, 5, requires_grad=True)
    mask_B_C = torch.rand(6, 5) > 0.3
    whole, _ = sft_loss(torch.nn.functional.logsigmoid(logits_B_C), mask_B_C)
    (whole_grad,) = torch.autograd.grad(whole, logits_B_C)

    total = mask_B_C.sum().item()
    parts = [sft_loss(torch.nn.functional.logsigmoid(logits_B_C[i : i + 2]), mask_B_C[i : i + 2], num_tokens=total)[0]
             for i in range(0, 6, 2)]  # fmt: skip
    (split_grad,) = torch.autograd.grad(sum(parts), logits_B_C)

    torch.testing.assert_close(sum(parts), whole, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(split_grad, whole_grad, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    ("logprobs", "mask", "num_tokens", "match"),
    [
        (torch.zeros(2, 3), torch.ones(2, 4, dtype=torch.bool), None, "shape"),
        (torch.zeros(3), torch.ones(3, dtype=torch.bool), None, "2-D"),
        (torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool), 0.0, "num_tokens=0.0"),
        (torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool), torch.ones(2), "0-d"),
    ],
)
def test_sft_loss_bad_input_raises_naming_it(logprobs: torch.Tensor, mask: torch.Tensor, num_tokens, match) -> None:
    with pytest.raises(ValueError, match=match):
        sft_loss(logprobs, mask, num_tokens=num_tokens)


def test_sft_loss_over_completion_logprobs_equals_the_labels_masked_cross_entropy_without_prompt_tokens() -> None:
    """TRL's completion-only loss: the causal-LM cross-entropy with the prompt positions' labels at -100. Ours
    equals it, and differs from the loss over every token (the prompt's included)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(
        Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                    num_key_value_heads=2, max_position_embeddings=32)
    )  # fmt: skip
    prompt_ids_B_P = torch.tensor([[0, 5, 6, 7], [8, 9, 10, 11]])  # left-padded with 0
    prompt_mask_B_P = torch.tensor([[False, True, True, True], [True, True, True, True]])
    completion_ids_B_C = torch.tensor([[12, 13, 14], [15, 16, 0]])  # right-padded with 0
    completion_mask_B_C = torch.tensor([[True, True, True], [True, True, False]])

    logprobs_B_C, _ = completion_logprobs(
        model, prompt_ids_B_P, prompt_mask_B_P, completion_ids_B_C, completion_mask_B_C
    )
    ours, _ = sft_loss(logprobs_B_C, completion_mask_B_C)

    input_ids = torch.cat([prompt_ids_B_P, completion_ids_B_C], dim=1)
    attention = torch.cat([prompt_mask_B_P, completion_mask_B_C], dim=1).long()
    positions = (attention.cumsum(dim=1) - 1).clamp(min=0)
    labels = input_ids.masked_fill(attention == 0, -100)
    completion_only = labels.clone()
    completion_only[:, : prompt_ids_B_P.shape[1]] = -100
    reference = model(input_ids=input_ids, attention_mask=attention, position_ids=positions, labels=completion_only)
    every_token = model(input_ids=input_ids, attention_mask=attention, position_ids=positions, labels=labels)

    torch.testing.assert_close(ours, reference.loss, rtol=1e-5, atol=1e-6)
    assert abs(float(ours.detach()) - float(every_token.loss.detach())) > 1e-3
