"""Session.start checks the configured data set before any process starts."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import psutil
import pytest

from rlsdk import Session
from rlsdk.config import ConfigError, DataConfig, ModelConfig, ObserveConfig, SessionConfig


def _children() -> set[int]:
    return {p.pid for p in psutil.Process(os.getpid()).children(recursive=True)}


@pytest.mark.parametrize(
    ("data", "field"),
    [
        (lambda tmp: DataConfig(task="file", path=str(tmp / "missing.jsonl")), "data.path"),
        (
            lambda tmp: DataConfig(task="file", path=str(tmp / "p.jsonl"), prompt_column="question"),
            "data.prompt_column",
        ),
        (lambda tmp: DataConfig(chat_template=True), "data.chat_template"),  # the tiny tokenizer has no template
        (lambda tmp: DataConfig(max_prompt_tokens=2), "data.max_prompt_tokens"),  # reverse prompts are 4 tokens
    ],
    ids=["missing-path", "absent-column", "no-chat-template", "budget-keeps-nothing"],
)
def test_session_start_bad_data_raises_config_error_naming_field_before_any_process(
    tiny_model_dir: Path, tmp_path: Path, data: object, field: str
) -> None:
    (tmp_path / "p.jsonl").write_text('{"prompt": "12>"}\n')
    config = SessionConfig(
        model=ModelConfig(path=str(tiny_model_dir)),
        data=data(tmp_path),  # type: ignore[operator]
        observe=ObserveConfig(output_dir=str(tmp_path / "out"), console=False),
    )
    before = _children()

    with pytest.raises(ConfigError) as info:
        asyncio.run(Session.start(config))

    assert info.value.field == field
    assert _children() <= before
    assert not (tmp_path / "out").exists()
