"""The decode path over a preallocated key/value cache: the same completions as the growing cache it replaced and
as a cache-free loop, with no per-step cache copy; every EOS id ends a row; large vocabularies and long completions
work; the compiled decode step gives the eager one's tokens."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rlsdk.algorithms import completion_logprobs
from rlsdk.data.models import seeded_qwen2, small_qwen2_config
from rlsdk.generation import sampling
from rlsdk.generation.kv_cache import PreallocatedLayer
from rlsdk.generation.params import SamplingParams
from rlsdk.generation.sampling import left_pad, sample_completions
from rlsdk.generation.stopping import StopCriteria

# A GRPO batch: three prompts of different lengths, each repeated (group size 3), interleaved as a workflow sends them.
PROMPTS = [[5, 6, 7, 14], [9, 14], [3, 3, 3, 3, 3, 14]] * 3


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    """A 2-layer Qwen2 with grouped key/value heads (4 query, 2 key/value) and 300 positions."""
    config = small_qwen2_config(32, 32, 2, 4, 64, 320, num_kv_heads=2)
    return seeded_qwen2(config, seed=5).eval()


def _dynamic_cache_path(
    model: torch.nn.Module, prompts: list[list[int]], params: SamplingParams, eos: list[int], seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The decode loop over transformers' growing ``DynamicCache`` (``capacity=0``): the path before the
    preallocated cache, kept as the reference."""
    with torch.inference_mode():
        cache, mask_A_T, position_A_1, logits_A_1_V = sampling._prefill(model, prompts, 0, torch.device("cpu"))
        return sampling._decode(
            model, cache, logits_A_1_V, mask_A_T, position_A_1, len(prompts), params, StopCriteria(eos),
            pad_token_id=0, generator=torch.Generator().manual_seed(seed), before_step=None,
        )  # fmt: skip


def _no_cache_greedy(model: torch.nn.Module, prompts: list[list[int]], steps: int) -> torch.Tensor:
    """Greedy tokens from one forward over the whole sequence per step (no cache at all)."""
    ids_B_P, mask_B_P = left_pad(prompts, pad_token_id=0)
    tokens_B_C = torch.zeros((len(prompts), 0), dtype=torch.long)
    with torch.no_grad():
        for _ in range(steps):
            ids_B_T = torch.cat([ids_B_P, tokens_B_C], dim=1)
            mask_B_T = torch.cat([mask_B_P.long(), torch.ones_like(tokens_B_C)], dim=1)
            logits_B_V = model(
                input_ids=ids_B_T,
                attention_mask=mask_B_T,
                position_ids=(mask_B_T.cumsum(1) - 1).clamp(min=0),
                logits_to_keep=1,
            ).logits[:, -1]
            tokens_B_C = torch.cat([tokens_B_C, logits_B_V.argmax(-1, keepdim=True)], dim=1)
    return tokens_B_C


def test_greedy_completions_equal_the_growing_cache_path_and_a_cache_free_loop(model: torch.nn.Module) -> None:
    params = SamplingParams(max_new_tokens=24, temperature=0.0)

    ids_B_C, mask_B_C, logprobs_B_C = sample_completions(model, PROMPTS, params, pad_token_id=0, eos_token_id=[31])
    old_ids_B_C, old_mask_B_C, old_logprobs_B_C = _dynamic_cache_path(model, PROMPTS, params, [31], seed=0)

    assert torch.equal(ids_B_C, old_ids_B_C) and torch.equal(mask_B_C, old_mask_B_C)
    torch.testing.assert_close(logprobs_B_C, old_logprobs_B_C, rtol=1e-6, atol=1e-6)
    assert torch.equal(ids_B_C[mask_B_C], _no_cache_greedy(model, PROMPTS, ids_B_C.shape[1])[mask_B_C])


def test_seeded_sampling_draws_the_growing_cache_paths_tokens_with_finished_rows_leaving(
    model: torch.nn.Module,
) -> None:
    # several EOS ids, a long generation: rows end at different steps and leave the batch
    params = SamplingParams(max_new_tokens=60, temperature=1.0)
    eos = [1, 13, 21]

    ids_B_C, mask_B_C, logprobs_B_C = sample_completions(
        model, PROMPTS, params, pad_token_id=0, eos_token_id=eos, generator=torch.Generator().manual_seed(4)
    )
    old_ids_B_C, old_mask_B_C, old_logprobs_B_C = _dynamic_cache_path(model, PROMPTS, params, eos, seed=4)

    lengths_B = mask_B_C.sum(dim=1)
    assert lengths_B.min() < lengths_B.max()  # rows ended at different steps
    assert torch.equal(ids_B_C, old_ids_B_C) and torch.equal(mask_B_C, old_mask_B_C)
    torch.testing.assert_close(logprobs_B_C, old_logprobs_B_C, rtol=1e-6, atol=1e-6)
    for row in range(len(PROMPTS)):
        tokens = ids_B_C[row, : int(lengths_B[row])].tolist()
        assert not set(eos) & set(tokens[:-1])
        assert int(lengths_B[row]) == params.max_new_tokens or tokens[-1] in eos


def test_decode_steps_write_into_one_buffer_per_layer_without_copying_the_cache(model: torch.nn.Module) -> None:
    seen: list[tuple[type, int, int]] = []

    def record(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        cache = kwargs["past_key_values"]
        if kwargs["input_ids"].shape[1] == 1:  # a decode step (the prefill passes whole prompts)
            layer = cache.layers[0]
            seen.append((type(layer), layer._key_buffer.data_ptr(), layer.get_seq_length()))

    handle = model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        sample_completions(
            model, PROMPTS, SamplingParams(max_new_tokens=20, temperature=0.0), pad_token_id=0, eos_token_id=[99]
        )
    finally:
        handle.remove()

    assert {kind for kind, _, _ in seen} == {PreallocatedLayer}
    assert len({pointer for _, pointer, _ in seen}) == 1  # no row left (no EOS): the same buffer every step
    assert [length for _, _, length in seen] == list(range(6, 6 + len(seen)))  # longest prompt 6, one column a step


def test_preallocated_layer_copies_each_rows_prompt_and_keeps_only_chosen_rows() -> None:
    keys_U_H_T_D = torch.arange(2 * 2 * 3 * 4, dtype=torch.float32).reshape(2, 2, 3, 4)
    rows_B = torch.tensor([1, 0, 1])
    layer = PreallocatedLayer(keys_U_H_T_D, -keys_U_H_T_D, rows_B, capacity=5)

    new_B_H_1_D = torch.full((3, 2, 1, 4), 7.0)
    keys_B_H_T_D, values_B_H_T_D = layer.update(new_B_H_1_D, -new_B_H_1_D)
    layer.batch_select_indices(torch.tensor([2, 0]))

    assert keys_B_H_T_D.shape == (3, 2, 4, 4) and layer.capacity == 5
    assert torch.equal(keys_B_H_T_D[:, :, :3], keys_U_H_T_D[rows_B]) and torch.equal(
        keys_B_H_T_D[:, :, 3:], new_B_H_1_D
    )
    assert torch.equal(values_B_H_T_D, -keys_B_H_T_D)
    assert layer.keys.shape == (2, 2, 4, 4) and torch.equal(layer.keys, keys_B_H_T_D[[2, 0]])


def test_preallocated_layer_grows_when_a_step_passes_its_capacity() -> None:
    layer = PreallocatedLayer(torch.ones(1, 1, 2, 2), torch.ones(1, 1, 2, 2), None, capacity=2)

    keys_B_H_T_D, _ = layer.update(torch.full((1, 1, 1, 2), 3.0), torch.full((1, 1, 1, 2), 3.0))

    assert layer.capacity >= 3 and layer.get_seq_length() == 3
    assert torch.equal(keys_B_H_T_D[0, 0], torch.tensor([[1.0, 1.0], [1.0, 1.0], [3.0, 3.0]]))


def test_large_vocabulary_long_completions_without_pad_token_end_at_each_eos_id() -> None:
    # a 151,936-token vocabulary (Qwen2.5's), completions of hundreds of tokens, pad = an EOS id (no pad token)
    vocab = 151_936
    model = seeded_qwen2(small_qwen2_config(vocab, 16, 1, 2, 32, 512), seed=2).eval()
    prompts = [[100, 200, 300], [150_000, 7], [150_000, 7]]
    eos = [151_643, 151_645]
    params = SamplingParams(max_new_tokens=200, temperature=1.0)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 16-wide model: ops too small to split, and a loaded machine makes a split slow
    try:
        ids_B_C, mask_B_C, logprobs_B_C = sample_completions(
            model, prompts, params, pad_token_id=eos[0], eos_token_id=eos, generator=torch.Generator().manual_seed(0)
        )
    finally:
        torch.set_num_threads(threads)

    assert ids_B_C.shape[1] == 200 and int(ids_B_C.max()) < vocab  # a random policy rarely samples an EOS
    # the trainer's logprobs of what was sampled
    prompt_ids_B_P, prompt_mask_B_P = left_pad(prompts, pad_token_id=eos[0])
    with torch.no_grad():
        trainer_B_C, _ = completion_logprobs(model, prompt_ids_B_P, prompt_mask_B_P, ids_B_C, mask_B_C)
    torch.testing.assert_close(logprobs_B_C[mask_B_C], trainer_B_C[mask_B_C], rtol=1e-4, atol=1e-4)


def test_an_eos_id_ends_the_row_and_later_columns_are_padding() -> None:
    # every EOS id of the list ends a row: a model made to sample each one in turn
    model = seeded_qwen2(small_qwen2_config(32, 16, 1, 2, 32, 64), seed=0).eval()
    for eos_id in (3, 17, 30):
        forced = _ForceToken(model, eos_id, after=2)
        ids_B_C, mask_B_C, _ = sample_completions(
            forced, [[1, 2], [4]], SamplingParams(max_new_tokens=10, temperature=0.0), pad_token_id=0,
            eos_token_id=[3, 17, 30],
        )  # fmt: skip

        assert ids_B_C.shape[1] == 3 and mask_B_C.all() and torch.equal(ids_B_C[:, -1], torch.tensor([eos_id] * 2))


class _ForceToken(torch.nn.Module):
    """Wraps a causal LM: its logits put all mass on ``token`` from the ``after``-th decode step on, else on 5."""

    def __init__(self, model: torch.nn.Module, token: int, after: int) -> None:
        super().__init__()
        self.inner, self.token, self.after, self.calls = model, token, after, 0

    def forward(self, **kwargs: Any) -> Any:
        output = self.inner(**kwargs)
        logits = torch.full_like(output.logits, -1e4)
        logits[..., self.token if self.calls >= self.after else 5] = 0.0
        self.calls += 1
        output.logits = logits
        return output


@pytest.mark.slow
def test_compiled_decode_step_gives_the_eager_steps_tokens(model: torch.nn.Module) -> None:
    params = SamplingParams(max_new_tokens=40, temperature=1.0)
    eos = [1, 13, 21]

    eager = sample_completions(
        model, PROMPTS, params, pad_token_id=0, eos_token_id=eos, generator=torch.Generator().manual_seed(6)
    )
    compiled = sample_completions(
        model, PROMPTS, params, pad_token_id=0, eos_token_id=eos, generator=torch.Generator().manual_seed(6),
        decode_step="compile",
    )  # fmt: skip

    assert torch.equal(eager[0], compiled[0]) and torch.equal(eager[1], compiled[1])
    torch.testing.assert_close(eager[2], compiled[2], rtol=1e-4, atol=1e-4)


def test_unknown_decode_step_is_refused_naming_the_value(model: torch.nn.Module) -> None:
    with pytest.raises(ValueError, match="decode_step='jit' is invalid: allowed 'eager' or 'compile'"):
        sample_completions(
            model, PROMPTS, SamplingParams(max_new_tokens=2), pad_token_id=0, eos_token_id=[1],
            decode_step="jit",  # type: ignore[arg-type]
        )  # fmt: skip
