"""sample_completions at length: finished rows leave the batch without changing any row's tokens, and several
end-of-sequence ids each end a row."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlsdk.algorithms import completion_logprobs
from rlsdk.data import build_tiny_policy
from rlsdk.engine.inference.protocol import SamplingParams
from rlsdk.generation.sampling import _draw, left_pad, sample_completions


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    path: Path = build_tiny_policy(tmp_path_factory.mktemp("sampling") / "model", seed=1)
    return AutoModelForCausalLM.from_pretrained(path).eval()


PROMPTS = [[5, 6, 7, 14], [9, 14], [5, 6, 7, 14], [3, 3, 14], [8, 14], [5, 6, 7, 14]]


def _reference_sample(
    model: torch.nn.Module, prompt_ids: list[list[int]], max_new_tokens: int, eos: set[int], seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain loop: every row stays in the batch to the end (one forward over the whole sequence per step, no
    cache), drawing for every row with the sampler's draw: what compaction must reproduce."""
    generator = torch.Generator().manual_seed(seed)
    ids_B_P, mask_B_P = left_pad(prompt_ids, pad_token_id=0)
    batch = len(prompt_ids)
    tokens_B_C = torch.zeros((batch, max_new_tokens), dtype=torch.long)
    done_B = torch.zeros(batch, dtype=torch.bool)
    columns = 0
    with torch.no_grad():
        for step in range(max_new_tokens):
            ids_B_T = torch.cat([ids_B_P, tokens_B_C[:, :step]], dim=1)
            mask_B_T = torch.cat([mask_B_P.long(), torch.ones(batch, step, dtype=torch.long)], dim=1)
            logits_B_V = model(
                input_ids=ids_B_T, attention_mask=mask_B_T, position_ids=(mask_B_T.cumsum(1) - 1).clamp(min=0)
            ).logits[:, -1]
            token_B = _draw(logits_B_V.softmax(-1), None, batch, generator)
            tokens_B_C[:, step] = torch.where(done_B, 0, token_B)
            done_B |= torch.isin(token_B, torch.tensor(sorted(eos)))
            columns = step + 1
            if done_B.all():
                break
    return tokens_B_C[:, :columns], done_B


def test_draw_after_compaction_takes_the_whole_batchs_tokens_of_the_remaining_rows() -> None:
    probs_B_V = torch.softmax(torch.randn(32, 500, generator=torch.Generator().manual_seed(0)), dim=-1)
    rows_A = torch.tensor([1, 4, 5, 30])
    full, compact = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)

    for _ in range(5):
        expected = _draw(probs_B_V, None, 32, full)[rows_A]
        assert torch.equal(_draw(probs_B_V[rows_A], rows_A, 32, compact), expected)


def test_draw_frequencies_match_the_probabilities_and_never_take_a_zero_weight() -> None:
    # unnormalised weights with zeros (what top-k/top-p filtering leaves): 200,000 draws of 4 rows
    weights_A_V = torch.tensor([[0.0, 1.0, 3.0, 0.0, 6.0], [5.0, 0.0, 0.0, 0.0, 5.0], [0.0, 0.0, 0.0, 0.0, 2.0],
                                [1.0, 1.0, 1.0, 1.0, 1.0]])  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    draws = 50_000

    counts_A_V = torch.zeros_like(weights_A_V)
    for _ in range(draws // 1000):
        tokens_N_A = torch.stack([_draw(weights_A_V, None, 4, generator) for _ in range(1000)])
        counts_A_V += torch.nn.functional.one_hot(tokens_N_A, 5).sum(dim=0)

    expected_A_V = weights_A_V / weights_A_V.sum(dim=1, keepdim=True)
    assert torch.all(counts_A_V[weights_A_V == 0] == 0)
    torch.testing.assert_close(counts_A_V / draws, expected_A_V, rtol=0.0, atol=0.01)


def test_long_generation_finished_rows_leave_the_batch_and_tokens_equal_the_plain_loop(
    model: torch.nn.Module,
) -> None:
    # EOS ids chosen so rows end at different steps of a 40-token generation
    eos = {1, 13}
    batch_sizes: list[int] = []
    handle = model.register_forward_pre_hook(
        lambda module, args, kwargs: batch_sizes.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    try:
        ids_B_C, mask_B_C, logprobs_B_C = sample_completions(
            model, PROMPTS, SamplingParams(max_new_tokens=40), pad_token_id=0, eos_token_id=sorted(eos),
            generator=torch.Generator().manual_seed(3),
        )  # fmt: skip
    finally:
        handle.remove()
    expected_B_C, ended_B = _reference_sample(model, PROMPTS, 40, eos, seed=3)

    lengths_B = mask_B_C.sum(dim=1)
    assert ended_B.any() and lengths_B.min() < ids_B_C.shape[1]  # some rows ended early ...
    decode_sizes = batch_sizes[1:]  # batch_sizes[0]: the prefill of the distinct prompts
    assert decode_sizes == sorted(decode_sizes, reverse=True) and decode_sizes[-1] < len(PROMPTS)  # ... and left
    assert torch.equal(ids_B_C, expected_B_C[:, : ids_B_C.shape[1]])
    for row in range(len(PROMPTS)):
        tokens = ids_B_C[row, : int(lengths_B[row])].tolist()
        assert not eos & set(tokens[:-1]) and (int(lengths_B[row]) == ids_B_C.shape[1] or tokens[-1] in eos)
    # the logprobs are the model's, as the trainer recomputes them
    prompt_ids_B_P, prompt_mask_B_P = left_pad(PROMPTS, pad_token_id=0)
    with torch.no_grad():
        trainer_B_C, _ = completion_logprobs(model, prompt_ids_B_P, prompt_mask_B_P, ids_B_C, mask_B_C)
    torch.testing.assert_close(logprobs_B_C[mask_B_C], trainer_B_C[mask_B_C], rtol=1e-5, atol=1e-5)


def test_short_generation_keeps_the_batch_whole(model: torch.nn.Module) -> None:
    # 3 new tokens: a row ending at step 1 would save 1 row-step, less than copying the cache is worth
    batch_sizes: list[int] = []
    handle = model.register_forward_pre_hook(
        lambda module, args, kwargs: batch_sizes.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    try:
        sample_completions(
            model, PROMPTS * 4, SamplingParams(max_new_tokens=3), pad_token_id=0, eos_token_id=[1, 13],
            generator=torch.Generator().manual_seed(0),
        )  # fmt: skip
    finally:
        handle.remove()

    assert batch_sizes[1:] == [len(PROMPTS) * 4] * (len(batch_sizes) - 1)
