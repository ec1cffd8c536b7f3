"""Command-line overrides through tyro, and --config files."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from rlsdk.config import ConfigError, ModelConfig, SessionConfig, parse_cli


@pytest.fixture
def default() -> SessionConfig:
    return SessionConfig(model=ModelConfig(path="models/tiny"))


def _stderr_text(capsys: pytest.CaptureFixture[str]) -> str:
    """tyro's error box as one line: border characters dropped, wrapped lines joined."""
    err = capsys.readouterr().err
    return " ".join(re.sub(r"[\u2500-\u257f]", " ", err).split())


def test_parse_cli_nested_flags_override_default(default: SessionConfig) -> None:
    cfg = parse_cli(
        default,
        [
            "--train.lr",
            "3e-4",
            "--rollout.stale-policy",
            "drop",
            "--train.betas",
            "0.8",
            "0.9",
            "--seed",
            "3",
        ],
    )

    assert cfg.train.lr == pytest.approx(3e-4)
    assert cfg.rollout.stale_policy == "drop"
    assert cfg.train.betas == (0.8, 0.9)
    assert cfg.seed == 3
    assert cfg.model.path == "models/tiny"


def test_parse_cli_bool_and_optional_flags_parse(default: SessionConfig) -> None:
    cfg = parse_cli(default, ["--observe.no-tensorboard", "--train.max-grad-norm", "None"])

    assert cfg.observe.tensorboard is False
    assert cfg.train.max_grad_norm is None


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--inference.colocated.lookahead", "false"], False),
        (["--inference.colocated.lookahead", "False"], False),
        (["--inference.colocated.lookahead=no"], False),
        (["--inference.colocated.lookahead", "off"], False),
        (["--inference.colocated.lookahead", "0"], False),
        (["--inference.colocated.no-lookahead"], False),
        (["--inference.colocated.lookahead", "true"], True),
        (["--inference.colocated.lookahead=YES"], True),
        (["--inference.colocated.lookahead"], True),
    ],
)
def test_parse_cli_bool_flag_with_a_value_means_the_same_as_the_flag_pair(
    default: SessionConfig, args: list[str], expected: bool
) -> None:
    default = parse_cli(default, ["--inference.colocated.no-lookahead"] if expected else [])

    cfg = parse_cli(default, [*args, "--seed", "4"])

    assert cfg.inference.colocated.lookahead is expected
    assert cfg.seed == 4


def test_parse_cli_bool_flag_with_a_non_bool_value_exits_naming_the_value(
    default: SessionConfig, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse_cli(default, ["--inference.colocated.lookahead", "maybe"])

    assert "maybe" in _stderr_text(capsys)


def test_parse_cli_no_args_returns_equal_default(default: SessionConfig) -> None:
    assert parse_cli(default, []) == default


def test_parse_cli_bad_literal_choice_exits_with_message_naming_choices(
    default: SessionConfig, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        parse_cli(default, ["--rollout.stale-policy", "ignore"])

    assert info.value.code == 2
    err = _stderr_text(capsys)
    assert "'raise'" in err
    assert "'drop'" in err


def test_parse_cli_value_rejected_by_config_class_exits_with_config_error_message(
    default: SessionConfig, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        parse_cli(default, ["--train.lr", "-1"])

    assert info.value.code == 2
    err = _stderr_text(capsys)
    assert "TrainConfig.lr=-1.0" in err
    assert "allowed a finite float > 0" in err


def test_parse_cli_config_file_applied_then_flags_win(default: SessionConfig, tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  lr: 0.01\n  max_steps: 7\nrollout:\n  group_size: 4\n")

    cfg = parse_cli(default, ["--config", str(path), "--train.lr", "0.5"])

    assert cfg.train.lr == pytest.approx(0.5)
    assert cfg.train.max_steps == 7
    assert cfg.rollout.group_size == 4


def test_parse_cli_config_equals_form_is_applied(default: SessionConfig, tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("seed: 11\n")

    assert parse_cli(default, [f"--config={path}"]).seed == 11


def test_parse_cli_config_file_unknown_key_raises_config_error(default: SessionConfig, tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  max_step: 7\n")

    with pytest.raises(ConfigError) as info:
        parse_cli(default, ["--config", str(path)])

    assert info.value.field == "train.max_step"
    assert "did you mean 'max_steps'?" in str(info.value)
    assert str(path) in str(info.value)


def test_parse_cli_missing_config_file_raises_file_not_found(default: SessionConfig, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"absent\.yaml"):
        parse_cli(default, ["--config", str(tmp_path / "absent.yaml")])


def test_import_rlsdk_config_does_not_import_tyro() -> None:
    code = "import sys, rlsdk.config; assert 'tyro' not in sys.modules"

    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)

    assert result.returncode == 0, result.stderr
