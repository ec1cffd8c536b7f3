"""Every config field documents itself right under its declaration, and the reference and ``--help`` show it."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import pytest

from rlsdk.compat.surface import config_fields
from rlsdk.config import LaunchConfig, ModelConfig, SessionConfig, SlurmConfig, parse_cli
from rlsdk.config.cli import _field_docs_as_attributes
from rlsdk.config.docs import field_docs


def _config_classes() -> list[type]:
    return sorted({info.owner for info in config_fields(SessionConfig)}, key=lambda cls: cls.__name__)


@pytest.mark.parametrize("cls", _config_classes(), ids=lambda cls: cls.__name__)
def test_every_config_field_has_a_docstring_under_it(cls: type) -> None:
    docs = field_docs(cls)

    missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name, "").strip()]

    assert not missing, f"{cls.__name__}: add a docstring right under each of {missing} (what it does, values allowed)"


@pytest.mark.parametrize("cls", _config_classes(), ids=lambda cls: cls.__name__)
def test_config_class_docstring_has_no_attributes_list(cls: type) -> None:
    assert "Attributes:" not in (cls.__doc__ or ""), f"{cls.__name__}: document fields under the fields instead"


def test_field_docs_of_a_class_joins_lines_and_skips_undocumented_fields() -> None:
    @dataclass
    class Example:
        documented: int = 1
        """First line,
        second line."""
        bare: int = 2

    assert field_docs(Example) == {"documented": "First line, second line."}


def test_config_fields_reports_the_field_docstring_for_nested_sections() -> None:
    docs = {info.path: info.doc for info in config_fields(SessionConfig)}

    assert docs["inference.vllm.kv_cache_gib"].startswith("KV-cache size in GiB")
    assert docs["launch.slurm.partition"].startswith("sbatch --partition")
    assert docs["train.lr"] == "Learning rate, > 0."


def test_parse_cli_help_shows_each_nested_field_doc_and_restores_the_class_docs(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "110")  # one column, as docs/reference/cli.md shows it
    before = {cls: cls.__doc__ for cls in _config_classes()}

    with pytest.raises(SystemExit):
        parse_cli(SessionConfig(model=ModelConfig(path="m")), ["--help"])

    text = " ".join(re.sub(r"[\u2500-\u257f]", " ", capsys.readouterr().out).split())
    assert "--inference.vllm.kv-cache-gib INT KV-cache size in GiB (VLLM_CPU_KVCACHE_SPACE), an int >= 1." in text
    assert "--launch.slurm.partition" in text and field_docs(SlurmConfig)["partition"] in text
    assert field_docs(LaunchConfig)["host"] in text
    assert {cls: cls.__doc__ for cls in _config_classes()} == before


def test_field_docs_reach_tyro_as_one_line_per_field_during_parse_cli() -> None:
    import docstring_parser

    # tyro keeps each source line of a docstring under a field as a line of the help (an indented line starts a new
    # paragraph for it); handed over as an Attributes section, each field's text is one paragraph.
    with _field_docs_as_attributes(SessionConfig):
        params = {p.arg_name: p.description for p in docstring_parser.parse_from_object(LaunchConfig).params}

    assert params["host"] == field_docs(LaunchConfig)["host"]
    assert "\n" not in params["host"]
