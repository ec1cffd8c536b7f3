"""The decode path at S1 (~25M parameters, 32k vocabulary, 8 prompts x 8 samples, 256 new tokens): its log-probs
are the trainer's (the agreement check), and its greedy completions are those of the growing-cache path it
replaced."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlsdk.algorithms import completion_logprobs
from rlsdk.generation import sampling
from rlsdk.generation.params import SamplingParams
from rlsdk.generation.sampling import left_pad, sample_completions
from rlsdk.generation.stopping import StopCriteria, resolve_special_tokens

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def s1(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, list[list[int]], tuple[int, ...], int]:
    """The S1 policy (float32), its 8 prompts of 64 tokens each repeated 8 times, its EOS ids and pad id."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlsdk.data.shapes import SHAPES, build_shape_policy, corpus_prompts

    model_dir: Path = build_shape_policy(tmp_path_factory.mktemp("s1") / "S1", "S1", seed=0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    spec = SHAPES["S1"]
    texts = corpus_prompts(tokenizer, spec.prompts_per_step, spec.prompt_tokens, seed=0)
    prompts = [tokenizer(text)["input_ids"] for text in texts for _ in range(spec.group_size)]
    special = resolve_special_tokens(model_dir, tokenizer)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, prompts, special.eos_token_ids, special.pad_token_id


def test_s1_completion_logprobs_equal_the_trainers(
    s1: tuple[torch.nn.Module, list[list[int]], tuple[int, ...], int],
) -> None:
    model, prompts, eos, pad = s1
    params = SamplingParams(max_new_tokens=256, temperature=1.0)

    ids_B_C, mask_B_C, logprobs_B_C = sample_completions(
        model, prompts, params, pad_token_id=pad, eos_token_id=eos, generator=torch.Generator().manual_seed(0)
    )
    prompt_ids_B_P, prompt_mask_B_P = left_pad(prompts, pad_token_id=pad)
    with torch.no_grad():
        trainer_B_C, _ = completion_logprobs(model, prompt_ids_B_P, prompt_mask_B_P, ids_B_C, mask_B_C)

    assert int(mask_B_C.sum()) > 64 * 200  # long completions, as the shape asks
    difference = (logprobs_B_C - trainer_B_C).abs()[mask_B_C]
    assert float(difference.mean()) < 1e-5
    torch.testing.assert_close(logprobs_B_C[mask_B_C], trainer_B_C[mask_B_C], rtol=1e-4, atol=1e-4)


def test_s1_greedy_completions_equal_the_growing_cache_paths(
    s1: tuple[torch.nn.Module, list[list[int]], tuple[int, ...], int],
) -> None:
    model, prompts, eos, pad = s1
    params = SamplingParams(max_new_tokens=64, temperature=0.0)

    ids_B_C, mask_B_C, logprobs_B_C = sample_completions(model, prompts, params, pad_token_id=pad, eos_token_id=eos)
    with torch.inference_mode():
        cache, mask_A_T, position_A_1, logits_A_1_V = sampling._prefill(model, prompts, pad, torch.device("cpu"))
        old = sampling._decode(
            model, cache, logits_A_1_V, mask_A_T, position_A_1, len(prompts), params, StopCriteria(eos),
            pad_token_id=pad, generator=None, before_step=None,
        )  # fmt: skip

    assert torch.equal(ids_B_C, old[0]) and torch.equal(mask_B_C, old[1])
    torch.testing.assert_close(logprobs_B_C, old[2], rtol=1e-5, atol=1e-5)
