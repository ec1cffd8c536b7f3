"""The reasoning-format task: traces add correctly, slips are the configured kinds and shares with answers that
follow the trace, splits are disjoint and seeded, the tokenizer splits digits and keeps <think> in decoded text,
and the rewards read the stated answer and the format."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from rlsdk.data.reasoning import (
    ReasoningTask,
    addition_trace,
    answer_reward,
    build_reasoning_policy,
    build_reasoning_tokenizer,
    carries_into_last_column,
    format_reward,
    reasoning_rows,
    stated_answer,
    write_reasoning_task,
)

TASK = ReasoningTask(num_sft=600, num_rl=200, num_test=100, seed=4)


def _operands(row: dict) -> tuple[int, int]:
    a, b = row["prompt"][0]["content"].removeprefix("What is ").removesuffix("?").split(" + ")
    return int(a), int(b)


def test_addition_trace_without_slips_states_the_sum_in_the_expected_format() -> None:
    rng = random.Random(0)
    for _ in range(300):
        a, b = rng.randint(0, 9999), rng.randint(0, 9999)
        trace = addition_trace(a, b)
        assert stated_answer(trace) == str(a + b)
        assert format_reward([trace]) == [1.0]
    assert addition_trace(472, 389).splitlines()[1:4] == ["2+9+0=11 -> 1", "7+8+1=16 -> 61", "4+3+1=8 -> 861"]


def test_addition_trace_dropped_last_carry_is_wrong_exactly_when_the_last_column_gets_a_carry() -> None:
    rng = random.Random(1)
    for _ in range(300):
        a, b = rng.randint(10, 999), rng.randint(10, 999)
        stated = int(stated_answer(addition_trace(a, b, drop_last_carry=True)) or -1)
        assert (stated != a + b) == carries_into_last_column(a, b)
    assert stated_answer(addition_trace(472, 389, drop_last_carry=True)) == "761"


def test_reasoning_rows_splits_are_disjoint_seeded_and_slips_follow_the_configured_shares() -> None:
    rows = reasoning_rows(TASK)

    problems = {split: {_operands(r) for r in rows[split]} for split in rows}
    assert [len(problems[s]) for s in ("sft", "rl", "test")] == [600, 200, 100]
    assert not (problems["sft"] & problems["test"]) and not (problems["rl"] & problems["test"])
    assert not problems["sft"] & problems["rl"]
    assert reasoning_rows(TASK) == rows  # seeded
    carrying = [r for r in rows["sft"] if carries_into_last_column(*_operands(r))]
    dropped = [r for r in carrying if r["slip"] == "carry"]
    assert 0.6 < len(dropped) / len(carrying) < 0.8  # carry_slip 0.7
    for row in rows["sft"]:
        a, b = _operands(row)
        stated = stated_answer(row["completion"][0]["content"])
        assert row["answer"] == str(a + b)  # the TRUE sum: rewards check it
        assert (stated == row["answer"]) == (row["slip"] == "")  # a slip's answer follows its trace
    assert all(set(r) == {"prompt", "answer"} for r in rows["test"])


def test_write_reasoning_task_writes_jsonl_splits_and_keeps_them_for_the_same_task(tmp_path: Path) -> None:
    paths = write_reasoning_task(tmp_path / "data", TASK)
    stamp = {split: path.stat().st_mtime_ns for split, path in paths.items()}

    again = write_reasoning_task(tmp_path / "data", TASK)

    assert set(paths) == {"sft", "rl", "test"} and again == paths
    assert {split: path.stat().st_mtime_ns for split, path in again.items()} == stamp
    assert len(paths["test"].read_text().splitlines()) == 100


def test_reasoning_tokenizer_splits_digits_keeps_think_tags_and_has_a_chatml_template() -> None:
    tokenizer = build_reasoning_tokenizer(TASK)
    trace = addition_trace(472, 389)

    ids = tokenizer(trace)["input_ids"]
    tokens = tokenizer.convert_ids_to_tokens(ids)

    assert tokenizer.decode(ids, skip_special_tokens=True) == trace  # <think> is not special: it survives
    assert {"4", "7", "2", "<think>", "</think>"} <= set(tokens) and "47" not in tokens and "472" not in tokens
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|endoftext|>")


def test_build_reasoning_policy_writes_a_model_transformers_loads_with_both_eos_ids(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    path = build_reasoning_policy(tmp_path / "m", task=TASK, hidden_size=32, num_layers=1, num_heads=2)

    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    eos = GenerationConfig.from_pretrained(path).eos_token_id
    assert model.config.model_type == "qwen2" and model.config.vocab_size == len(tokenizer)
    assert eos == tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert build_reasoning_policy(path, task=TASK) == path  # idempotent


def test_answer_and_format_rewards_read_the_stated_answer_and_the_shape() -> None:
    good = addition_trace(12, 30)
    completions = [good, good.replace("42.", "41."), "The answer is 42.", "42"]

    assert answer_reward(completions, ["42"] * 4) == [1.0, 0.0, 1.0, 0.0]
    assert format_reward(completions) == [1.0, 1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="2 items but answer has 1"):
        answer_reward(completions[:2], ["42"])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"min_digits": 3, "max_digits": 2}, "min_digits"), ({"num_test": 0}, "num_test"),
     ({"carry_slip": 1.5}, "carry_slip"), ({"min_digits": 1, "max_digits": 1, "num_sft": 100}, "too many")],
)  # fmt: skip
def test_reasoning_task_bad_field_raises_naming_it(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ReasoningTask(**kwargs)
