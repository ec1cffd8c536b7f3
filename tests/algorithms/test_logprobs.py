"""token_logprobs / token_entropy against direct formulas; completion_logprobs against per-sequence forwards."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlsdk.algorithms import completion_logprobs, token_entropy, token_logprobs
from rlsdk.algorithms.logprobs import distinct_rows


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from rlsdk.data import build_tiny_policy

    path: Path = build_tiny_policy(tmp_path_factory.mktemp("logprobs") / "model", seed=3)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_token_logprobs_temperature_matches_log_softmax_gather() -> None:
    generator = torch.Generator().manual_seed(0)
    logits_B_T_V = torch.randn(2, 3, 7, generator=generator)
    tokens_B_T = torch.randint(0, 7, (2, 3), generator=generator)

    logprobs_B_T = token_logprobs(logits_B_T_V, tokens_B_T, temperature=0.7)

    expected = torch.empty(2, 3)
    for b in range(2):
        for t in range(3):
            expected[b, t] = torch.log_softmax(logits_B_T_V[b, t] / 0.7, dim=-1)[tokens_B_T[b, t]]
    torch.testing.assert_close(logprobs_B_T, expected, rtol=1e-6, atol=1e-6)


def test_token_entropy_uniform_logits_gives_log_vocab() -> None:
    entropy_B_T = token_entropy(torch.zeros(2, 4, 16))

    torch.testing.assert_close(
        entropy_B_T, torch.full((2, 4), float(torch.log(torch.tensor(16.0)))), rtol=1e-6, atol=1e-6
    )


def test_token_logprobs_shape_mismatch_raises_naming_tensors() -> None:
    with pytest.raises(ValueError, match=r"logits_B_T_V shape \(2, 3, 5\) does not match tokens_B_T shape \(2, 4\)"):
        token_logprobs(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))


def test_token_logprobs_zero_temperature_raises_value_error() -> None:
    with pytest.raises(ValueError, match="temperature=0"):
        token_logprobs(torch.zeros(1, 1, 5), torch.zeros(1, 1, dtype=torch.long), temperature=0)


def test_completion_logprobs_padded_batch_matches_unpadded_per_sequence_forward(tiny_model: torch.nn.Module) -> None:
    # Two prompts of different lengths (left-padded) and completions of different lengths (right-padded).
    prompts = [[5, 6, 7, 14], [9, 14]]
    completions = [[8, 4, 1], [6, 1]]
    prompt_ids_B_P = torch.tensor([[5, 6, 7, 14], [0, 0, 9, 14]])
    prompt_mask_B_P = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]], dtype=torch.bool)
    completion_ids_B_C = torch.tensor([[8, 4, 1], [6, 1, 0]])
    completion_mask_B_C = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)

    with torch.no_grad():
        logprobs_B_C, entropy_B_C = completion_logprobs(
            tiny_model,
            prompt_ids_B_P,
            prompt_mask_B_P,
            completion_ids_B_C,
            completion_mask_B_C,
            temperature=0.9,
            with_entropy=True,
        )
        for row, (prompt, completion) in enumerate(zip(prompts, completions)):
            sequence = torch.tensor([prompt + completion])
            logits_T_V = tiny_model(input_ids=sequence).logits[0, len(prompt) - 1 : -1] / 0.9
            expected = torch.log_softmax(logits_T_V, dim=-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]
            torch.testing.assert_close(logprobs_B_C[row, : len(completion)], expected, rtol=1e-5, atol=1e-5)
            expected_entropy = -(logits_T_V.softmax(-1) * logits_T_V.log_softmax(-1)).sum(-1)
            torch.testing.assert_close(entropy_B_C[row, : len(completion)], expected_entropy, rtol=1e-5, atol=1e-5)


def test_completion_logprobs_with_grad_backpropagates_to_parameters(tiny_model: torch.nn.Module) -> None:
    prompt_ids_B_P = torch.tensor([[5, 6, 14]])
    completion_ids_B_C = torch.tensor([[6, 5, 1]])

    logprobs_B_C, entropy_B_C = completion_logprobs(
        tiny_model,
        prompt_ids_B_P,
        torch.ones_like(prompt_ids_B_P),
        completion_ids_B_C,
        torch.ones_like(completion_ids_B_C),
    )
    logprobs_B_C.sum().backward()

    assert entropy_B_C is None
    assert logprobs_B_C.shape == (1, 3)
    grads = [p.grad for p in tiny_model.parameters() if p.grad is not None]
    assert grads and any(g.abs().sum() > 0 for g in grads)
    tiny_model.zero_grad(set_to_none=True)


def test_completion_logprobs_mismatched_completion_mask_raises_naming_tensors(tiny_model: torch.nn.Module) -> None:
    with pytest.raises(ValueError, match=r"completion_ids_B_C shape .* completion_mask_B_C shape"):
        completion_logprobs(
            tiny_model,
            torch.ones(2, 3, dtype=torch.long),
            torch.ones(2, 3, dtype=torch.bool),
            torch.ones(2, 4, dtype=torch.long),
            torch.ones(2, 3, dtype=torch.bool),
        )


def _grouped_batch(completion_len: int) -> tuple[torch.Tensor, ...]:
    """Three prompts (one left-padded; one same ids as another but a different mask), each repeated, and
    completions of mixed lengths, rows interleaved so that the shared rows are not contiguous."""
    generator = torch.Generator().manual_seed(1)
    prompts = torch.tensor([[5, 6, 7, 14], [0, 0, 9, 14], [5, 6, 7, 14], [0, 6, 7, 14]])
    masks = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1], [1, 1, 1, 1], [0, 1, 1, 1]], dtype=torch.bool)
    rows = torch.tensor([0, 1, 3, 2, 0, 1, 0, 3, 1, 2])  # prompt 2 == prompt 0: same ids, same mask
    completion_ids_B_C = torch.randint(2, 16, (rows.numel(), completion_len), generator=generator)
    lengths_B = torch.randint(1, completion_len + 1, (rows.numel(),), generator=generator)
    completion_mask_B_C = torch.arange(completion_len)[None, :] < lengths_B[:, None]
    return prompts[rows], masks[rows], torch.where(completion_mask_B_C, completion_ids_B_C, 0), completion_mask_B_C


def _logprobs_entropy_grads(
    model: torch.nn.Module, inputs: tuple[torch.Tensor, ...], share: bool, **kwargs: object
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    logprobs_B_C, entropy_B_C = completion_logprobs(
        model, *inputs, with_entropy=True, entropy_grad=True, share_prompts=share, **kwargs
    )
    assert entropy_B_C is not None
    mask_B_C = inputs[3]
    ((logprobs_B_C * mask_B_C).sum() + 0.1 * (entropy_B_C * mask_B_C).sum()).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return logprobs_B_C.detach() * mask_B_C, entropy_B_C.detach() * mask_B_C, grads


@pytest.mark.parametrize("completion_len", [1, 2, 5])
def test_completion_logprobs_share_prompts_repeated_prompts_equal_one_call_logprobs_entropy_and_grads(
    tiny_model: torch.nn.Module, completion_len: int
) -> None:
    inputs = _grouped_batch(completion_len)

    plain = _logprobs_entropy_grads(tiny_model, inputs, share=False)
    shared = _logprobs_entropy_grads(tiny_model, inputs, share=True)

    torch.testing.assert_close(shared[0], plain[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(shared[1], plain[1], rtol=1e-5, atol=1e-5)
    assert set(shared[2]) == set(plain[2])
    for name, grad in plain[2].items():
        torch.testing.assert_close(shared[2][name], grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("max_logits_bytes", [None, 64], ids=["materialised", "fused-head"])
def test_completion_logprobs_with_host_prompt_groups_equal_the_groups_found_from_the_ids(
    tiny_model: torch.nn.Module, max_logits_bytes: int | None
) -> None:
    # Arrange: the labels TrainEngine.with_prompt_groups finds on the CPU copy of a shard
    inputs = _grouped_batch(5)
    mask_B_P = inputs[1].long()
    _, groups_B = torch.unique(torch.cat([inputs[0] * mask_B_P, mask_B_P], dim=1), dim=0, return_inverse=True)

    # Act
    from_ids = _logprobs_entropy_grads(tiny_model, inputs, share=True, max_logits_bytes=max_logits_bytes)
    from_groups = _logprobs_entropy_grads(
        tiny_model, inputs, share=True, max_logits_bytes=max_logits_bytes, prompt_groups_B=groups_B
    )

    # Assert
    torch.testing.assert_close(from_groups[0], from_ids[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(from_groups[1], from_ids[1], rtol=1e-5, atol=1e-5)
    for name, grad in from_ids[2].items():
        torch.testing.assert_close(from_groups[2][name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_completion_logprobs_with_prompt_groups_off_the_cpu_raises_naming_them(tiny_model: torch.nn.Module) -> None:
    inputs = _grouped_batch(2)
    groups_B = torch.zeros(inputs[0].shape[0], dtype=torch.long, device="meta")

    with pytest.raises(ValueError, match=r"prompt_groups_B must be on the CPU"):
        completion_logprobs(tiny_model, *inputs, share_prompts=True, prompt_groups_B=groups_B)


def test_completion_logprobs_share_prompts_with_context_mask_equals_one_call(tiny_model: torch.nn.Module) -> None:
    # multi-turn: tokens in context (a tool output) but not trained on
    prompt_ids_B_P, prompt_mask_B_P, completion_ids_B_C, completion_mask_B_C = _grouped_batch(5)
    attention_mask_B_C = completion_mask_B_C.clone()
    completion_mask_B_C = completion_mask_B_C.clone()
    completion_mask_B_C[:, 1:3] = False
    inputs = (prompt_ids_B_P, prompt_mask_B_P, completion_ids_B_C, completion_mask_B_C)

    plain = _logprobs_entropy_grads(tiny_model, inputs, share=False, attention_mask_B_C=attention_mask_B_C)
    shared = _logprobs_entropy_grads(tiny_model, inputs, share=True, attention_mask_B_C=attention_mask_B_C)

    torch.testing.assert_close(shared[0], plain[0], rtol=1e-5, atol=1e-5)
    for name, grad in plain[2].items():
        torch.testing.assert_close(shared[2][name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_completion_logprobs_share_prompts_without_repeats_runs_one_model_call(tiny_model: torch.nn.Module) -> None:
    calls: list[int] = []
    handle = tiny_model.register_forward_pre_hook(lambda module, args: calls.append(1))
    prompt_ids_B_P = torch.tensor([[5, 6, 14], [6, 5, 14]])
    completion_ids_B_C = torch.tensor([[6, 5, 1], [7, 1, 0]])
    try:
        with torch.no_grad():
            completion_logprobs(
                tiny_model,
                prompt_ids_B_P,
                torch.ones_like(prompt_ids_B_P),
                completion_ids_B_C,
                torch.ones_like(completion_ids_B_C),
                share_prompts=True,
            )
            completion_logprobs(
                tiny_model,
                prompt_ids_B_P[[0, 0]],
                torch.ones_like(prompt_ids_B_P),
                completion_ids_B_C,
                torch.ones_like(completion_ids_B_C),
                share_prompts=True,
            )
    finally:
        handle.remove()

    assert len(calls) == 3  # distinct prompts: the one-call path; a repeated prompt: prompt pass + completions


def test_distinct_rows_gives_first_occurrences_in_order_and_merges_repeats_that_are_not_adjacent() -> None:
    # Arrange
    rows = [[1, 2], [3, 4], [1, 2], [5, 6], [3, 4], [1, 2]]

    # Act
    first, inverse = distinct_rows(rows)

    # Assert
    assert first == [0, 1, 3]
    assert inverse == [0, 1, 0, 2, 1, 0]
    assert [rows[first[slot]] for slot in inverse] == rows
