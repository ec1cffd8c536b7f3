"""Local prompt files: every format round-trips its columns; bad paths and columns raise naming the field."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import datasets
import pytest

from rlsdk.config import ConfigError
from rlsdk.data import load_prompt_dataset

ROWS = {
    "question": ["What is 2+2?", "Name a prime."],
    "answer": ["4", "7"],
    "id": [10, 11],
    "tags": [["easy"], ["easy", "primes"]],
}


def _write_jsonl(path: Path) -> Path:
    path = path / "prompts.jsonl"
    rows = [dict(zip(ROWS, values)) for values in zip(*ROWS.values())]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _write_parquet(path: Path) -> Path:
    datasets.Dataset.from_dict(ROWS).to_parquet(str(path / "prompts.parquet"))
    return path / "prompts.parquet"


def _write_arrow_stream(path: Path) -> Path:
    datasets.Dataset.from_dict(ROWS).save_to_disk(str(path / "saved"))
    (arrow,) = (path / "saved").glob("*.arrow")
    return arrow


def _write_arrow_file(path: Path) -> Path:
    import pyarrow as pa
    import pyarrow.feather

    pyarrow.feather.write_feather(pa.table(ROWS), str(path / "prompts.arrow"))
    return path / "prompts.arrow"


def _write_save_to_disk(path: Path) -> Path:
    datasets.Dataset.from_dict(ROWS).save_to_disk(str(path / "saved"))
    return path / "saved"


def _write_dataset_dict(path: Path) -> Path:
    splits = {"train": datasets.Dataset.from_dict(ROWS), "test": datasets.Dataset.from_dict(ROWS).select([0])}
    datasets.DatasetDict(splits).save_to_disk(str(path / "saved_dict"))
    return path / "saved_dict"


@pytest.mark.parametrize(
    "write",
    [_write_jsonl, _write_parquet, _write_arrow_stream, _write_arrow_file, _write_save_to_disk, _write_dataset_dict],
    ids=["jsonl", "parquet", "arrow-stream", "arrow-file", "save_to_disk", "dataset_dict"],
)
def test_load_prompt_dataset_each_format_round_trips_all_columns(tmp_path: Path, write: Callable[[Path], Path]) -> None:
    path = write(tmp_path)

    dataset = load_prompt_dataset(path, prompt_column="question")

    assert {name: dataset[name] for name in ROWS} == ROWS
    assert sorted(dataset.column_names) == sorted(ROWS)


def test_load_prompt_dataset_dataset_dict_split_selects_split(tmp_path: Path) -> None:
    dataset = load_prompt_dataset(_write_dataset_dict(tmp_path), prompt_column="question", split="test")

    assert dataset["question"] == ROWS["question"][:1]


def test_load_prompt_dataset_writes_nothing_next_to_the_data(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path)
    before = sorted(tmp_path.rglob("*"))

    load_prompt_dataset(path, prompt_column="question")

    assert sorted(tmp_path.rglob("*")) == before


def test_load_prompt_dataset_missing_path_raises_config_error_naming_data_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"

    with pytest.raises(ConfigError) as info:
        load_prompt_dataset(missing)

    assert info.value.field == "data.path"
    assert str(missing) in str(info.value)
    assert ".parquet" in info.value.allowed


def test_load_prompt_dataset_unsupported_suffix_raises_config_error_listing_formats(tmp_path: Path) -> None:
    path = tmp_path / "prompts.csv"
    path.write_text("prompt\nhi\n")

    with pytest.raises(ConfigError, match=r"\.jsonl, \.parquet or \.arrow.*got suffix '\.csv'") as info:
        load_prompt_dataset(path)

    assert info.value.field == "data.path"


def test_load_prompt_dataset_directory_without_saved_dataset_raises_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no state\.json or dataset_dict\.json") as info:
        load_prompt_dataset(tmp_path)

    assert info.value.field == "data.path"


def test_load_prompt_dataset_malformed_jsonl_raises_config_error_naming_data_path(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a"}\nnot json\n')

    with pytest.raises(ConfigError, match=r"a readable \.jsonl file") as info:
        load_prompt_dataset(path)

    assert info.value.field == "data.path"


def test_load_prompt_dataset_absent_prompt_column_error_lists_columns_found(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_prompt_dataset(_write_jsonl(tmp_path), prompt_column="prompt")

    assert info.value.field == "data.prompt_column"
    assert "['question', 'answer', 'id', 'tags']" in info.value.allowed


def test_load_prompt_dataset_unknown_split_error_lists_splits(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_prompt_dataset(_write_dataset_dict(tmp_path), prompt_column="question", split="validation")

    assert info.value.field == "data.split"
    assert "['test', 'train']" in info.value.allowed


def test_load_prompt_dataset_empty_file_raises_config_error(tmp_path: Path) -> None:
    path = tmp_path / "empty.parquet"
    features = datasets.Features({"prompt": datasets.Value("string")})
    datasets.Dataset.from_dict({"prompt": []}, features=features).to_parquet(str(path))

    with pytest.raises(ConfigError, match="at least one row") as info:
        load_prompt_dataset(path)

    assert info.value.field == "data.path"
