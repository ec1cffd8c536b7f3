"""From DataConfig to prompts: chat template, token budget (count logged), bad prompts, deterministic resume."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import datasets
import pytest

from rlsdk.config import ConfigError, DataConfig
from rlsdk.data import (
    PromptSampler,
    build_prompt_dataset,
    build_tokenizer,
    prepare_prompts,
    reverse_digits_dataset,
)

# Renders to characters outside the tiny vocabulary too; those become <unk>, one token per character.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}|{{ m['content'] }}>{% endfor %}"
    "{% if add_generation_prompt %}a|{% endif %}"
)


def _chat_tokenizer() -> Any:
    tokenizer = build_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_build_prompt_dataset_default_reverse_task_is_unchanged() -> None:
    dataset = build_prompt_dataset(DataConfig(num_examples=20, min_digits=2, max_digits=4), seed=3)

    assert dataset[:] == reverse_digits_dataset(20, min_digits=2, max_digits=4, seed=3)[:]


@pytest.mark.parametrize(
    ("task", "columns"),
    [("arithmetic", ["prompt", "answer"]), ("countdown", ["prompt", "numbers", "target", "solution"])],
)
def test_build_prompt_dataset_generated_task_is_seeded(task: str, columns: list[str]) -> None:
    config = DataConfig(task=task, num_examples=8, min_digits=1, max_digits=2)  # type: ignore[arg-type]

    first, again, other = (build_prompt_dataset(config, seed=s) for s in (0, 0, 1))

    assert first.column_names == columns
    assert first[:] == again[:]
    assert first[:] != other[:]


def test_build_prompt_dataset_file_task_renames_prompt_column_and_keeps_others(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "d.jsonl", [{"question": "12>", "answer": "21"}, {"question": "34>", "answer": "43"}])

    dataset = build_prompt_dataset(DataConfig(task="file", path=str(path), prompt_column="question"), seed=0)

    assert dataset["prompt"] == ["12>", "34>"]
    assert dataset["question"] == ["12>", "34>"]
    assert dataset["answer"] == ["21", "43"]


def test_prepare_prompts_chat_template_wraps_text_as_user_message_with_system_prompt() -> None:
    dataset = datasets.Dataset.from_dict({"prompt": ["12>"], "answer": ["21"]})

    prepared = prepare_prompts(dataset, tokenizer=_chat_tokenizer(), chat_template=True, system_prompt="be brief")

    assert prepared["prompt"] == ["s|be brief>u|12>>a|"]
    assert prepared["answer"] == ["21"]


def test_prepare_prompts_messages_column_uses_messages_as_given(tmp_path: Path) -> None:
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "12>"}]
    path = _jsonl(tmp_path / "chat.jsonl", [{"messages": messages, "answer": "21"}])
    config = DataConfig(task="file", path=str(path), prompt_column="messages", chat_template=True, system_prompt="X")

    dataset = build_prompt_dataset(config, seed=0, tokenizer=_chat_tokenizer())

    assert dataset["prompt"] == ["s|S>u|12>>a|"]  # the row's own system message wins over system_prompt


def test_prepare_prompts_messages_without_chat_template_raises_naming_chat_template() -> None:
    dataset = datasets.Dataset.from_dict({"messages": [[{"role": "user", "content": "hi"}]]})

    with pytest.raises(ConfigError) as info:
        prepare_prompts(dataset, prompt_column="messages")

    assert info.value.field == "data.chat_template"


def test_prepare_prompts_tokenizer_without_chat_template_raises_naming_chat_template() -> None:
    dataset = datasets.Dataset.from_dict({"prompt": ["12>"]})

    with pytest.raises(ConfigError, match=r"has none") as info:
        prepare_prompts(dataset, tokenizer=build_tokenizer(), chat_template=True)

    assert info.value.field == "data.chat_template"


@pytest.mark.parametrize(
    "values",
    [["ok", ""], ["ok", "   "], ["ok", None], [[{"role": "user", "content": "hi"}], []]],
    ids=["empty", "whitespace", "null", "empty-messages"],
)
def test_prepare_prompts_empty_prompt_raises_naming_prompt_column_and_row(values: list[Any]) -> None:
    dataset = datasets.Dataset.from_dict({"q": values})

    with pytest.raises(ConfigError, match="row 1 holds") as info:
        prepare_prompts(dataset, prompt_column="q", tokenizer=_chat_tokenizer(), chat_template=True)

    assert info.value.field == "data.prompt_column"


def test_prepare_prompts_non_text_prompt_raises_naming_prompt_column() -> None:
    with pytest.raises(ConfigError, match="row 0 holds 1") as info:
        prepare_prompts(datasets.Dataset.from_dict({"q": [1, 5]}), prompt_column="q")

    assert info.value.field == "data.prompt_column"


def test_prepare_prompts_long_prompts_are_dropped_and_count_logged(caplog: pytest.LogCaptureFixture) -> None:
    dataset = datasets.Dataset.from_dict({"prompt": ["1>", "1234>", "12>", "123456>"], "answer": ["a", "b", "c", "d"]})

    with caplog.at_level(logging.INFO, logger="rlsdk"):
        kept = prepare_prompts(dataset, tokenizer=build_tokenizer(), max_prompt_tokens=3)

    assert kept["prompt"] == ["1>", "12>"]
    assert kept["answer"] == ["a", "c"]
    assert "dropped 2 of 4 prompts longer than data.max_prompt_tokens=3 tokens" in caplog.text


def test_prepare_prompts_budget_counts_chat_template_tokens() -> None:
    dataset = datasets.Dataset.from_dict({"prompt": ["1>", "12345>"]})

    kept = prepare_prompts(dataset, tokenizer=_chat_tokenizer(), chat_template=True, max_prompt_tokens=8)

    assert kept["prompt"] == ["u|1>>a|"]  # 7 tokens kept; the other renders to 11


def test_prepare_prompts_budget_keeping_nothing_raises_naming_max_prompt_tokens() -> None:
    dataset = datasets.Dataset.from_dict({"prompt": ["123>", "12345>"]})

    with pytest.raises(ConfigError, match="the shortest of 2 has 4 tokens") as info:
        prepare_prompts(dataset, tokenizer=build_tokenizer(), max_prompt_tokens=2)

    assert info.value.field == "data.max_prompt_tokens"


def test_prompt_sampler_on_rebuilt_filtered_file_data_resumes_mid_epoch_with_same_batches(tmp_path: Path) -> None:
    rows = [{"question": str(n) * (1 + n % 5) + ">", "answer": str(n)} for n in range(10)]
    config = DataConfig(task="file", path=str(_jsonl(tmp_path / "d.jsonl", rows)), prompt_column="question",
                        max_prompt_tokens=4, prompts_per_step=3)  # fmt: skip
    sampler = PromptSampler(build_prompt_dataset(config, seed=0, tokenizer=build_tokenizer()), 3, seed=7)
    sampler.next_batch()  # mid-epoch: 3 of the 6 kept rows
    state = json.loads(json.dumps(sampler.state_dict()))  # as the checkpoint stores it
    expected = [sampler.next_batch() for _ in range(4)]

    resumed = PromptSampler(build_prompt_dataset(config, seed=0, tokenizer=build_tokenizer()), 3, seed=7)
    resumed.load_state_dict(state)

    assert state["position"] == 3
    assert [resumed.next_batch() for _ in range(4)] == expected


def test_prompt_sampler_state_from_data_set_of_other_size_raises_value_error() -> None:
    state = PromptSampler(reverse_digits_dataset(8), 2).state_dict()

    with pytest.raises(ValueError, match="num_rows=8 differs"):
        PromptSampler(reverse_digits_dataset(9), 2).load_state_dict(state)
