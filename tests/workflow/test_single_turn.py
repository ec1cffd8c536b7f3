"""SingleTurnWorkflow: batched prompt tokenisation and fast completion decoding match transformers' own calls."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from rlsdk.data import build_tiny_policy, build_tokenizer
from rlsdk.engine.inference.protocol import GenerateResult, SamplingParams, WeightInfo
from rlsdk.workflow.single_turn import SingleTurnWorkflow, decode_completions

PAD, EOS, BOS = 0, 1, 2
# digits are ids 4-13, ">" is 14, "|" is 15 (rlsdk.data.reverse.VOCAB)
COMPLETIONS = [
    [6, 5, 4, EOS, PAD, PAD],  # "210", EOS, right padding
    [EOS, PAD, PAD, PAD, PAD, PAD],  # only EOS: empty string
    [PAD, PAD, PAD, PAD, PAD, PAD],  # nothing generated: empty string
    [BOS, 13, 15, 14, 4, EOS],  # BOS in the middle of text is special, skipped
    [4, 5, 6, 7, 8, 9],  # no EOS, full width
]
PROMPTS = ["123>", "9>", "0123456789>", "1|2>", "x7>"]


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_policy(tmp_path_factory.mktemp("single-turn") / "model", seed=0)


def _word_level(model: str, *, clean_up: bool) -> Any:
    """Whitespace-joined words, no decoder: clean-up changes ``hello .`` into ``hello.``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, "hello": 3, ".": 4, ",": 5, "do": 6, "n't": 7, "?": 8}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>") if model == "word" else models.BPE(vocab, []))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=clean_up,
    )


def test_decode_completions_tiny_tokenizer_equals_batch_decode() -> None:
    tokenizer = build_tokenizer()

    decoded = decode_completions(tokenizer, COMPLETIONS)

    assert decoded == tokenizer.batch_decode(COMPLETIONS, skip_special_tokens=True)
    assert decoded == ["210", "", "", "9|>0", "012345"]


def test_decode_completions_auto_tokenizer_from_saved_policy_equals_batch_decode(policy_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(policy_dir)

    assert decode_completions(tokenizer, COMPLETIONS) == tokenizer.batch_decode(COMPLETIONS, skip_special_tokens=True)


@pytest.mark.parametrize(("model", "clean_up"), [("word", True), ("word", False), ("bpe", True), ("bpe", False)])
def test_decode_completions_with_space_clean_up_setting_equals_batch_decode(model: str, clean_up: bool) -> None:
    tokenizer = _word_level(model, clean_up=clean_up)
    ids = [[3, 4, 1, 0], [6, 7, 3, 5], [3, 8, 0, 0], [1, 0, 0, 0], []]

    decoded = decode_completions(tokenizer, ids)

    assert decoded == tokenizer.batch_decode(ids, skip_special_tokens=True)
    if model == "word":
        assert decoded[0] == ("hello." if clean_up else "hello .")


def test_decode_completions_tokenizer_without_rust_backend_uses_its_batch_decode() -> None:
    class ListTokenizer:
        def batch_decode(self, batch: Sequence[Sequence[int]], skip_special_tokens: bool = False) -> list[str]:
            return [f"{list(ids)}:{skip_special_tokens}" for ids in batch]

    assert decode_completions(ListTokenizer(), [[4, 1], []]) == ["[4, 1]:True", "[]:True"]


class FixedEngine:
    """Returns ``COMPLETIONS`` row ``i % len(COMPLETIONS)`` for prompt ``i``; records the prompts it was given."""

    def __init__(self) -> None:
        self.prompts: list[list[int]] = []

    async def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams) -> GenerateResult:
        self.prompts = [list(ids) for ids in prompt_ids]
        ids_B_C = torch.tensor([COMPLETIONS[i % len(COMPLETIONS)] for i in range(len(prompt_ids))])
        mask_B_C = torch.cumsum((ids_B_C == EOS).long(), dim=1) - (ids_B_C == EOS).long() == 0
        mask_B_C &= ids_B_C != PAD
        return GenerateResult(
            completion_ids_B_C=ids_B_C,
            completion_mask_B_C=mask_B_C,
            logprobs_B_C=torch.zeros(ids_B_C.shape),
            versions_B_C=torch.where(mask_B_C, 0, -1),
        )

    async def load_weights(self, path: str, version: int) -> WeightInfo:
        raise NotImplementedError

    async def weight_info(self) -> WeightInfo:
        return WeightInfo(version=0, checksum="")

    async def close(self) -> None:
        return None


def test_arun_batch_prompt_ids_and_completions_match_per_prompt_calls(policy_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    engine = FixedEngine()
    workflow = SingleTurnWorkflow(tokenizer, SamplingParams(max_new_tokens=6))

    rollout = asyncio.run(workflow.arun_batch(engine, [{"prompt": p} for p in PROMPTS], group_size=2))

    per_prompt = [list(tokenizer(p)["input_ids"]) for p in PROMPTS]
    assert engine.prompts == [ids for ids in per_prompt for _ in range(2)]
    masked = torch.where(rollout.completion_mask_B_C, rollout.completion_ids_B_C, tokenizer.pad_token_id)
    assert rollout.completions == tokenizer.batch_decode(masked.tolist(), skip_special_tokens=True)


def test_request_for_the_same_prompts_and_seed_tokenises_once_and_another_request_again() -> None:
    # Arrange: a tokenizer that counts its batched calls
    tokenizer = build_tokenizer()
    calls: list[list[str]] = []

    class Counting:
        pad_token_id = tokenizer.pad_token_id

        def __call__(self, texts: list[str]) -> Any:
            calls.append(list(texts))
            return tokenizer(texts)

    workflow = SingleTurnWorkflow(Counting(), SamplingParams(max_new_tokens=4))
    rows = [{"prompt": "12>"}, {"prompt": "345>"}]

    # Act
    first = workflow.request(rows, 3, seed=7)
    again = workflow.request([dict(row) for row in rows], 3, seed=7)
    other_seed = workflow.request(rows, 3, seed=8)
    other_rows = workflow.request([{"prompt": "9>"}], 3, seed=8)

    # Assert
    assert len(calls) == 3 and calls[-1] == ["9>"]
    assert again == first and first[2].seed == 7 and other_seed[2].seed == 8
    assert first[1] == [ids for ids in first[0] for _ in range(3)]
    assert other_rows[0] == [tokenizer("9>")["input_ids"]]
