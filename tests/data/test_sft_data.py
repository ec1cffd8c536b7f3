"""SFT data: rows -> token ids -> batches. Chat rows train only on what the template writes for the assistant, up
to its end-of-turn EOS; prompts are tokenised as the rollout workflow tokenises them; padding sides are those of a
rollout; bad rows name themselves."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from rlsdk.data.reasoning import IM_END, ReasoningTask, build_reasoning_tokenizer
from rlsdk.data.sft import SFT_BATCH_KEYS, SFTBatches, SFTExample, check_sft_batch, collate_sft, tokenize_sft


@pytest.fixture(scope="module")
def tokenizer():
    return build_reasoning_tokenizer(ReasoningTask(num_sft=50, num_rl=50, num_test=10))


def _row(question: str, answer: str) -> dict:
    return {
        "prompt": [{"role": "user", "content": question}],
        "completion": [{"role": "assistant", "content": answer}],
    }


def test_tokenize_sft_chat_row_trains_on_the_assistant_turn_up_to_its_eos_only(tokenizer) -> None:
    row = _row("What is 1 + 2?", "<think>\n1+2+0=3 -> 3\n</think>\nThe answer is 3.")

    (example,) = tokenize_sft([row], tokenizer)

    prompt_text = tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
    assert example.prompt_ids == tokenizer(prompt_text)["input_ids"]  # as the rollout workflow tokenises it
    eos = tokenizer.convert_tokens_to_ids(IM_END)
    assert example.completion_ids[-1] == eos and example.completion_ids.count(eos) == 1  # the "\n" after it: cut
    assert tokenizer.decode(example.completion_ids[:-1]) == row["completion"][0]["content"]  # no prompt token
    whole = tokenizer.apply_chat_template(row["prompt"] + row["completion"], tokenize=False)
    assert tokenizer.decode(example.prompt_ids + example.completion_ids) == whole.removesuffix("\n")


def test_tokenize_sft_text_row_gets_the_eos_appended_and_chat_template_flag_wraps_it(tokenizer) -> None:
    plain, templated = (
        tokenize_sft([{"prompt": "What is 1 + 2?", "completion": " 3"}], tokenizer, chat_template=flag)[0]
        for flag in (False, True)
    )

    eos = tokenizer.eos_token_id
    assert plain.prompt_ids == tokenizer("What is 1 + 2?")["input_ids"]
    assert plain.completion_ids == [*tokenizer(" 3", add_special_tokens=False)["input_ids"], eos]
    assert tokenizer.decode(templated.prompt_ids).startswith("<|im_start|>user\nWhat is 1 + 2?")
    assert templated.completion_ids[-1] == eos


def test_tokenize_sft_drops_rows_over_max_length_and_logs_the_count(tokenizer, caplog) -> None:
    rows = [_row("What is 1 + 2?", "3"), _row("What is 1 + 2?", "3" * 80)]

    with caplog.at_level(logging.INFO, logger="rlsdk"):
        examples = tokenize_sft(rows, tokenizer, max_length=40)

    assert len(examples) == 1
    assert "dropped 1 of 2 SFT rows longer than max_length=40" in caplog.text


@pytest.mark.parametrize(
    ("rows", "kwargs", "match"),
    [
        ([{"prompt": "x"}], {}, "'completion' column"),
        ([{"prompt": "x", "completion": "y"}, {"prompt": "", "completion": "y"}], {}, "SFT row 1"),
        ([{"prompt": [{"role": "user", "content": "x"}], "completion": "y"}], {}, "both be text or both"),
        ([{"prompt": "x", "completion": "y"}], {"max_length": 0}, "max_length=0"),
        ([{"prompt": "x", "completion": "y" * 50}], {"max_length": 5}, "keeps no SFT row"),
    ],
)
def test_tokenize_sft_bad_rows_raise_naming_row_or_field(tokenizer, rows, kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        tokenize_sft(rows, tokenizer, **kwargs)


def test_collate_sft_left_pads_prompts_and_right_pads_completions_with_masks() -> None:
    batch = collate_sft([SFTExample([5, 6, 7], [8, 1]), SFTExample([9], [10, 11, 1])], pad_token_id=0)

    assert set(batch) == set(SFT_BATCH_KEYS)
    assert batch["prompt_ids_B_P"].tolist() == [[5, 6, 7], [0, 0, 9]]
    assert batch["prompt_mask_B_P"].tolist() == [[True, True, True], [False, False, True]]
    assert batch["completion_ids_B_C"].tolist() == [[8, 1, 0], [10, 11, 1]]
    assert batch["completion_mask_B_C"].tolist() == [[True, True, False], [True, True, True]]


def test_sft_batches_from_file_resume_from_state_dict_with_the_same_batches(tokenizer, tmp_path: Path) -> None:
    import json

    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(_row(f"What is {i} + 1?", f"{i + 1}")) + "\n" for i in range(10)))
    first = SFTBatches.from_file(str(path), tokenizer, 4, seed=3)
    first.next_batch()
    state = first.state_dict()
    expected = [first.next_batch() for _ in range(3)]

    second = SFTBatches.from_file(str(path), tokenizer, 4, seed=3)
    second.load_state_dict(state)
    resumed = [second.next_batch() for _ in range(3)]

    for a, b in zip(expected, resumed, strict=True):
        assert all(torch.equal(a[k], b[k]) for k in SFT_BATCH_KEYS)
    assert len(first) == 10 and first.epoch > 1.0


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda b: b.pop("prompt_mask_B_P"), "exactly the keys"),
        (lambda b: b.__setitem__("completion_ids_B_C", b["completion_ids_B_C"].float()), "integer token ids"),
        (lambda b: b.__setitem__("completion_mask_B_C", torch.zeros(2, 3, dtype=torch.bool)), "no trained token"),
        (lambda b: b.__setitem__("prompt_mask_B_P", torch.ones(2, 5, dtype=torch.bool)), "shape"),
        (lambda b: b.__setitem__("completion_ids_B_C", [[1]]), "2-D torch tensor"),
    ],
)
def test_check_sft_batch_bad_batch_raises_naming_the_key(change, match) -> None:
    batch = collate_sft([SFTExample([5, 6], [8, 1]), SFTExample([9], [10, 11, 1])], pad_token_id=0)
    change(batch)

    with pytest.raises(ValueError, match=match):
        check_sft_batch(batch)


def test_sft_batches_from_file_bad_path_or_column_raises_naming_the_argument(tokenizer, tmp_path: Path) -> None:
    import json

    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps({"prompt": "x", "answer": "y"}) + "\n")

    with pytest.raises(ValueError, match=r"SFT data path=.*missing\.jsonl"):
        SFTBatches.from_file(str(tmp_path / "missing.jsonl"), tokenizer, 2)
    with pytest.raises(ValueError, match=r"completion_column='completion'.*\['prompt', 'answer'\]"):
        SFTBatches.from_file(str(path), tokenizer, 2)
    with pytest.raises(ValueError, match="batch_size=0"):
        SFTBatches.from_rows([{"prompt": "x", "completion": "y"}], tokenizer, 0)
