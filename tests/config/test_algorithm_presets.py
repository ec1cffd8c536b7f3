"""AlgorithmConfig presets: what each fixes, contradictions rejected naming both fields, resolved() values."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from rlsdk.config import AlgorithmConfig, ConfigError, ModelConfig, RolloutConfig, SessionConfig


def test_algorithm_config_default_resolves_to_pre_preset_behaviour() -> None:
    resolved = AlgorithmConfig().resolved()

    assert (resolved.advantage, resolved.loss_agg, resolved.ratio_level) == ("grpo", "token_mean", "token")
    assert (resolved.kl_estimator, resolved.entropy_coef, resolved.off_policy) == ("k3", 0.0, "none")
    assert resolved.scale_rewards is True


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("grpo", {"advantage": "grpo", "loss_agg": "token_mean", "ratio_level": "token"}),
        ("dr_grpo", {"advantage": "dr_grpo", "loss_agg": "seq_sum_fixed_len", "ratio_level": "token"}),
        ("dapo", {"advantage": "grpo", "loss_agg": "token_mean", "ratio_level": "token"}),
        ("rloo", {"advantage": "rloo", "loss_agg": "token_mean", "ratio_level": "token"}),
        ("reinforce_pp", {"advantage": "reinforce_pp", "loss_agg": "token_mean"}),
        ("reinforce_pp_baseline", {"advantage": "reinforce_pp_baseline", "loss_agg": "token_mean"}),
        ("gspo", {"advantage": "grpo", "loss_agg": "seq_mean_token_mean", "ratio_level": "sequence"}),
    ],
)
def test_algorithm_config_preset_resolves_the_fields_it_fixes(name: str, expected: dict[str, Any]) -> None:
    resolved = AlgorithmConfig(name=name).resolved()  # type: ignore[arg-type]

    assert {k: getattr(resolved, k) for k in expected} == expected
    assert resolved.name == name
    assert AlgorithmConfig(**dataclasses.asdict(resolved)) == resolved  # a resolved config re-validates


def test_algorithm_config_preset_keeps_none_fields_so_a_changed_name_re_resolves() -> None:
    cfg = AlgorithmConfig(name="rloo")

    switched = dataclasses.replace(cfg, name="gspo")

    assert cfg.advantage is None
    assert switched.resolved().advantage == "grpo"


def test_algorithm_config_preset_accepts_an_explicit_equal_value_and_unfixed_fields() -> None:
    cfg = AlgorithmConfig(name="gspo", ratio_level="sequence", kl_estimator="k2", off_policy="tis", entropy_coef=0.01)

    assert cfg.resolved().ratio_level == "sequence"
    assert cfg.resolved().off_policy == "tis"


@pytest.mark.parametrize(
    ("kwargs", "field", "fixed"),
    [
        ({"name": "dr_grpo", "loss_agg": "token_mean"}, "loss_agg", "'seq_sum_fixed_len'"),
        ({"name": "dapo", "kl_coef": 0.1}, "kl_coef", "0.0"),
        ({"name": "gspo", "ratio_level": "token"}, "ratio_level", "'sequence'"),
        ({"name": "reinforce_pp", "advantage": "rloo"}, "advantage", "'reinforce_pp'"),
    ],
)
def test_algorithm_config_preset_contradiction_raises_naming_field_and_preset(
    kwargs: dict[str, Any], field: str, fixed: str
) -> None:
    with pytest.raises(ConfigError) as info:
        AlgorithmConfig(**kwargs)

    assert info.value.field == f"AlgorithmConfig.{field}"
    assert fixed in info.value.allowed
    assert f"AlgorithmConfig.name={kwargs['name']!r}" in info.value.allowed


@pytest.mark.parametrize("algorithm", [AlgorithmConfig(name="rloo"), AlgorithmConfig(advantage="rloo")])
def test_session_config_rloo_with_group_size_1_raises_naming_group_size(algorithm: AlgorithmConfig) -> None:
    with pytest.raises(ConfigError) as info:
        SessionConfig(model=ModelConfig(path="models/tiny"), algorithm=algorithm, rollout=RolloutConfig(group_size=1))

    assert info.value.field == "rollout.group_size"
    assert "algorithm.advantage is 'rloo'" in info.value.allowed


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "dapo", "gspo", "reinforce_pp_baseline"])
def test_session_config_group_relative_advantage_with_group_size_1_raises_naming_group_size(name: str) -> None:
    with pytest.raises(ConfigError) as info:
        SessionConfig(
            model=ModelConfig(path="models/tiny"),
            algorithm=AlgorithmConfig(name=name),
            rollout=RolloutConfig(group_size=1),
        )

    assert info.value.field == "rollout.group_size"
    assert "an int >= 2 when algorithm.advantage is" in info.value.allowed
    assert "reinforce_pp" in info.value.allowed  # the estimator that works with one sample per prompt


def test_session_config_reinforce_pp_with_group_size_1_is_allowed() -> None:
    config = SessionConfig(
        model=ModelConfig(path="models/tiny"),
        algorithm=AlgorithmConfig(name="reinforce_pp"),
        rollout=RolloutConfig(group_size=1),
    )

    assert config.rollout.group_size == 1
