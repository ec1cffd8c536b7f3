"""Prompt data sets from local files: JSON Lines, Parquet, Arrow, and ``datasets.save_to_disk`` directories.

Nothing is downloaded and nothing is written: JSON Lines and Parquet are read with pyarrow straight into an
in-memory ``datasets.Dataset`` (``datasets``' own builders would write a cache under ``~/.cache``), Arrow files and
``save_to_disk`` directories are memory-mapped by ``datasets``. Errors are :class:`~rlsdk.config.ConfigError`
naming the :class:`~rlsdk.config.DataConfig` field (``data.path``, ``data.prompt_column``, ``data.split``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from rlsdk.config.errors import ConfigError

if TYPE_CHECKING:
    import datasets

SUPPORTED_SUFFIXES = (".jsonl", ".parquet", ".arrow")
SUPPORTED_TEXT = "a .jsonl, .parquet or .arrow file, or a directory written by datasets' save_to_disk"


def _read_file(path: Path) -> datasets.Dataset:
    import datasets
    import pyarrow as pa

    suffix = path.suffix.lower()
    if suffix == ".arrow":
        try:
            return datasets.Dataset.from_file(str(path))  # the stream format that datasets writes
        except (pa.ArrowInvalid, OSError):
            import pyarrow.ipc

            with pa.memory_map(str(path)) as source:  # the random-access (Feather v2) format
                return datasets.Dataset(pyarrow.ipc.open_file(source).read_all())
    if suffix == ".parquet":
        import pyarrow.parquet

        return datasets.Dataset(pyarrow.parquet.read_table(path))
    import pyarrow.json

    return datasets.Dataset(pyarrow.json.read_json(path))


def _read_directory(path: Path, split: str) -> datasets.Dataset:
    import datasets

    if not ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file()):
        raise ConfigError(
            "data.path", str(path), f"{SUPPORTED_TEXT} (this directory has no state.json or dataset_dict.json)"
        )
    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise ConfigError("data.split", split, f"one of the splits found in {path}: {sorted(loaded)}")
        return loaded[split]
    return loaded


def load_prompt_dataset(path: str | Path, *, prompt_column: str = "prompt", split: str = "train") -> datasets.Dataset:
    """The rows of a local data set, every column kept; checks that ``prompt_column`` exists and rows exist.

    Formats, by suffix: ``.jsonl`` (one JSON object per line), ``.parquet``, ``.arrow`` (Arrow stream as written
    by ``datasets``, or Arrow/Feather v2 file), or a directory written by ``Dataset.save_to_disk`` (or
    ``DatasetDict.save_to_disk``, then ``split`` picks the split). Columns other than the prompt reach reward
    functions as keyword columns.

    Raises:
        ConfigError: ``data.path`` missing, of an unsupported format or unreadable; ``data.split`` not in a
            ``DatasetDict``; ``data.prompt_column`` absent (the message lists the columns found); no rows.
    """
    import pyarrow as pa

    source = Path(path)
    if not source.exists():
        raise ConfigError("data.path", str(path), f"an existing local path: {SUPPORTED_TEXT}")
    if source.is_dir():
        dataset = _read_directory(source, split)
    elif source.suffix.lower() in SUPPORTED_SUFFIXES:
        try:
            dataset = _read_file(source)
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise ConfigError("data.path", str(path), f"a readable {source.suffix} file ({exc})") from exc
    else:
        raise ConfigError("data.path", str(path), f"{SUPPORTED_TEXT} (got suffix {source.suffix!r})")
    # Rows first: a file of blank lines has no columns either, and "no column 'prompt'" would mislead.
    if len(dataset) == 0:
        raise ConfigError("data.path", str(path), "a data set with at least one row")
    if prompt_column not in dataset.column_names:
        raise ConfigError(
            "data.prompt_column", prompt_column, f"one of the columns found in {path}: {dataset.column_names}"
        )
    return dataset
