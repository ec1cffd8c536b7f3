"""Where a completion ends: one pad rule, every EOS id, stop strings with vLLM's semantics (embedded engine here;
the Session tests run the same model on every engine)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from rlsdk.engine.inference.embedded import EmbeddedEngine
from rlsdk.engine.inference.protocol import SamplingParams
from rlsdk.engine.inference.stopping import (
    SpecialTokens,
    StopCriteria,
    apply_pad_rule,
    cut_at_stop,
    resolve_special_tokens,
)
from rlsdk.testing.llama import EOM, EOS, EOT, build_llama_policy


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_llama_policy(tmp_path_factory.mktemp("llama") / "model")


def _tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def test_resolve_special_tokens_when_tokenizer_has_no_pad_gives_pad_eos_and_every_eos_id(llama_dir: Path) -> None:
    tokenizer = _tokenizer(llama_dir)
    assert tokenizer.pad_token_id is None

    special = resolve_special_tokens(llama_dir, tokenizer)

    ids = tokenizer.convert_tokens_to_ids([EOS, EOT, EOM])
    assert special == SpecialTokens(pad_token_id=ids[0], eos_token_ids=tuple(ids))


def test_apply_pad_rule_when_tokenizer_has_no_pad_sets_the_resolved_pad(llama_dir: Path) -> None:
    tokenizer = _tokenizer(llama_dir)
    special = resolve_special_tokens(llama_dir, tokenizer)

    apply_pad_rule(tokenizer, special)

    assert tokenizer.pad_token_id == special.pad_token_id == tokenizer.eos_token_id


def test_resolve_special_tokens_when_tokenizer_has_a_pad_keeps_it(tiny_model_dir: Path) -> None:
    special = resolve_special_tokens(tiny_model_dir)

    assert special == SpecialTokens(pad_token_id=0, eos_token_ids=(1,))


def test_cut_at_stop_when_several_strings_occur_cuts_before_the_earliest() -> None:
    assert cut_at_stop("12 ab; cd", ["cd", ";"]) == ("12 ab", True)
    assert cut_at_stop("12 ab", ["cd"]) == ("12 ab", False)


def test_stop_criteria_when_stop_strings_without_decode_raises() -> None:
    with pytest.raises(ValueError, match="decode"):
        StopCriteria([1], ["x"])
    with pytest.raises(ValueError, match=r"stop\[0\]"):
        StopCriteria([1], [""], decode=str)


def test_stop_criteria_ends_rows_on_any_eos_id_and_on_a_completed_stop_string() -> None:
    criteria = StopCriteria([7, 8], ["bc"], decode=lambda ids: "".join("abcdefgh"[i] for i in ids if i < 7))
    tokens_B_T = torch.tensor([[0, 7], [0, 8], [1, 2], [0, 1]])
    running_B = torch.tensor([True, True, True, True])

    ended_B = criteria.ended_B(tokens_B_T, running_B)

    assert ended_B.tolist() == [True, True, True, False]


@pytest.mark.parametrize(("prompt", "eos"), [("p", EOS), ("q", EOT), ("r", EOM)])
def test_embedded_engine_when_model_samples_any_eos_id_stops_after_it(llama_dir: Path, prompt: str, eos: str) -> None:
    tokenizer = _tokenizer(llama_dir)
    engine = EmbeddedEngine.from_pretrained(llama_dir)

    async def run():
        try:
            return await engine.generate([tokenizer(prompt)["input_ids"]], SamplingParams(max_new_tokens=6, seed=0))
        finally:
            await engine.close()

    result = asyncio.run(run())

    assert result.completion_mask_B_C.sum().item() == 1
    assert result.completion_ids_B_C[0, 0].item() == tokenizer.convert_tokens_to_ids(eos)


def test_embedded_engine_with_stop_string_keeps_the_completing_token_and_masks_the_rest(llama_dir: Path) -> None:
    tokenizer = _tokenizer(llama_dir)
    engine = EmbeddedEngine.from_pretrained(llama_dir)
    prompts = [tokenizer("s")["input_ids"], tokenizer("p")["input_ids"]]

    async def run():
        try:
            free = await engine.generate(prompts, SamplingParams(max_new_tokens=8, seed=0))
            stopped = await engine.generate(prompts, SamplingParams(max_new_tokens=8, seed=0, stop=("cd",)))
            return free, stopped
        finally:
            await engine.close()

    free, stopped = asyncio.run(run())

    assert tokenizer.decode(free.completion_ids_B_C[0]) == "abcdeabc"  # runs to max_new_tokens without a stop
    assert stopped.completion_mask_B_C.sum(dim=1).tolist() == [4, 1]
    assert tokenizer.decode(stopped.completion_ids_B_C[0, :4]) == "abcd"
    torch.testing.assert_close(stopped.logprobs_B_C[0, :4], free.logprobs_B_C[0, :4], rtol=0, atol=1e-6)
    assert stopped.logprobs_B_C[0, 4:].abs().sum().item() == 0.0
