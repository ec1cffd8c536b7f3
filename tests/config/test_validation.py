"""Construction-time validation of every config dataclass."""

from __future__ import annotations

from typing import Any

import pytest

from rlsdk.config import (
    AlgorithmConfig,
    ColocatedConfig,
    ConfigError,
    DataConfig,
    EmbeddedConfig,
    InferenceConfig,
    LaunchConfig,
    ModelConfig,
    ObserveConfig,
    RayConfig,
    RolloutConfig,
    SessionConfig,
    SlurmConfig,
    TrainConfig,
    VLLMConfig,
)


def _build(cls: type, kwargs: dict[str, Any]) -> Any:
    if cls is ModelConfig:
        kwargs = {"path": "models/tiny", **kwargs}
    if cls is SessionConfig:
        kwargs = {"model": ModelConfig(path="models/tiny"), **kwargs}
    return cls(**kwargs)


# (class, constructor kwargs, the field the error must name, the bad value it must show)
BAD_VALUES = [
    (ModelConfig, {"path": ""}, "path", ""),
    (ModelConfig, {"path": 3}, "path", 3),
    (ModelConfig, {"dtype": "fp8"}, "dtype", "fp8"),
    (ModelConfig, {"trust_remote_code": 1}, "trust_remote_code", 1),
    (LaunchConfig, {"num_ranks": 0}, "num_ranks", 0),
    (LaunchConfig, {"num_ranks": 65}, "num_ranks", 65),
    (LaunchConfig, {"num_ranks": True}, "num_ranks", True),
    (LaunchConfig, {"num_ranks": 2.0}, "num_ranks", 2.0),
    (LaunchConfig, {"backend": "nccl"}, "backend", "nccl"),
    (LaunchConfig, {"threads_per_rank": 0}, "threads_per_rank", 0),
    (LaunchConfig, {"start_timeout_s": 0.0}, "start_timeout_s", 0.0),
    (LaunchConfig, {"heartbeat_interval_s": -1.0}, "heartbeat_interval_s", -1.0),
    (LaunchConfig, {"heartbeat_timeout_s": 0.5}, "heartbeat_timeout_s", 0.5),
    (LaunchConfig, {"command_timeout_s": 0.0}, "command_timeout_s", 0.0),
    (LaunchConfig, {"host": "0.0.0.0"}, "host", "0.0.0.0"),
    (LaunchConfig, {"host": "10.1.2.3"}, "host", "10.1.2.3"),
    (LaunchConfig, {"host": "", "allow_remote": True}, "host", ""),
    (LaunchConfig, {"allow_remote": "yes"}, "allow_remote", "yes"),
    (LaunchConfig, {"trace_poll_s": 0.0}, "trace_poll_s", 0.0),
    (LaunchConfig, {"trace_poll_s": -1.0}, "trace_poll_s", -1.0),
    (LaunchConfig, {"trace_poll_s": float("inf")}, "trace_poll_s", float("inf")),
    (InferenceConfig, {"engine": "sglang"}, "engine", "sglang"),
    (InferenceConfig, {"decode_step": "jit"}, "decode_step", "jit"),
    (EmbeddedConfig, {"num_threads": 0}, "num_threads", 0),
    (VLLMConfig, {"kv_cache_gib": 0}, "kv_cache_gib", 0),
    (VLLMConfig, {"weight_transfer": "nccl"}, "weight_transfer", "nccl"),
    (SlurmConfig, {"time": "1h"}, "time", "1h"),
    (SlurmConfig, {"partition": "a b"}, "partition", "a b"),
    (SlurmConfig, {"cpus_per_task": 0}, "cpus_per_task", 0),
    (RayConfig, {"address": ""}, "address", ""),
    (ColocatedConfig, {"lookahead": "yes"}, "lookahead", "yes"),
    (InferenceConfig, {"max_batch_size": 0}, "max_batch_size", 0),
    (TrainConfig, {"lr": -1.0}, "lr", -1.0),
    (TrainConfig, {"lr": 0.0}, "lr", 0.0),
    (TrainConfig, {"lr": float("inf")}, "lr", float("inf")),
    (TrainConfig, {"lr": "1e-3"}, "lr", "1e-3"),
    (TrainConfig, {"weight_decay": -0.1}, "weight_decay", -0.1),
    (TrainConfig, {"betas": (0.9, 1.0)}, "betas", (0.9, 1.0)),
    (TrainConfig, {"betas": (0.9,)}, "betas", (0.9,)),
    (TrainConfig, {"max_grad_norm": 0.0}, "max_grad_norm", 0.0),
    (TrainConfig, {"micro_batch_size": 0}, "micro_batch_size", 0),
    (TrainConfig, {"max_steps": 0}, "max_steps", 0),
    (TrainConfig, {"target_reward": "high"}, "target_reward", "high"),
    (TrainConfig, {"checkpoint_every": -1}, "checkpoint_every", -1),
    (TrainConfig, {"keep_checkpoints": 0}, "keep_checkpoints", 0),
    (TrainConfig, {"parallelism": "fsdp"}, "parallelism", "fsdp"),
    (AlgorithmConfig, {"name": "ppo"}, "name", "ppo"),
    (AlgorithmConfig, {"clip_eps_low": 0.0}, "clip_eps_low", 0.0),
    (AlgorithmConfig, {"clip_eps_low": 1.0}, "clip_eps_low", 1.0),
    (AlgorithmConfig, {"clip_eps_high": 0.0}, "clip_eps_high", 0.0),
    (AlgorithmConfig, {"kl_coef": -0.1}, "kl_coef", -0.1),
    (AlgorithmConfig, {"scale_rewards": "yes"}, "scale_rewards", "yes"),
    (AlgorithmConfig, {"adv_eps": 0.0}, "adv_eps", 0.0),
    (AlgorithmConfig, {"advantage": "gae"}, "advantage", "gae"),
    (AlgorithmConfig, {"loss_agg": "sum"}, "loss_agg", "sum"),
    (AlgorithmConfig, {"ratio_level": "chunk"}, "ratio_level", "chunk"),
    (AlgorithmConfig, {"kl_estimator": "k4"}, "kl_estimator", "k4"),
    (AlgorithmConfig, {"entropy_coef": -0.01}, "entropy_coef", -0.01),
    (AlgorithmConfig, {"off_policy": "vtrace"}, "off_policy", "vtrace"),
    (AlgorithmConfig, {"is_cap": 0.0}, "is_cap", 0.0),
    (AlgorithmConfig, {"name": "dapo", "scale_rewards": False}, "scale_rewards", False),
    (AlgorithmConfig, {"name": "rloo", "advantage": "grpo"}, "advantage", "grpo"),
    (RolloutConfig, {"group_size": 0}, "group_size", 0),
    (RolloutConfig, {"max_new_tokens": 0}, "max_new_tokens", 0),
    (RolloutConfig, {"temperature": 0.0}, "temperature", 0.0),
    (RolloutConfig, {"top_p": 0.0}, "top_p", 0.0),
    (RolloutConfig, {"top_p": 1.5}, "top_p", 1.5),
    (RolloutConfig, {"top_k": -1}, "top_k", -1),
    (RolloutConfig, {"max_staleness": -1}, "max_staleness", -1),
    (RolloutConfig, {"stale_policy": "ignore"}, "stale_policy", "ignore"),
    (DataConfig, {"task": "math"}, "task", "math"),
    (DataConfig, {"prompts_per_step": 0}, "prompts_per_step", 0),
    (DataConfig, {"min_digits": 0}, "min_digits", 0),
    (DataConfig, {"max_digits": 2}, "max_digits", 2),
    (DataConfig, {"num_examples": 0}, "num_examples", 0),
    (DataConfig, {"task": "file"}, "path", None),
    (DataConfig, {"task": "file", "path": " "}, "path", " "),
    (DataConfig, {"path": "data.jsonl"}, "path", "data.jsonl"),
    (DataConfig, {"task": "file", "path": "d.jsonl", "prompt_column": ""}, "prompt_column", ""),
    (DataConfig, {"prompt_column": "question"}, "prompt_column", "question"),
    (DataConfig, {"chat_template": "yes"}, "chat_template", "yes"),
    (DataConfig, {"max_prompt_tokens": 0}, "max_prompt_tokens", 0),
    (DataConfig, {"system_prompt": "Be brief."}, "system_prompt", "Be brief."),
    (DataConfig, {"split": ""}, "split", ""),
    (DataConfig, {"countdown_numbers": 1}, "countdown_numbers", 1),
    (DataConfig, {"countdown_numbers": 7}, "countdown_numbers", 7),
    (ObserveConfig, {"output_dir": ""}, "output_dir", ""),
    (ObserveConfig, {"log_level": "TRACE"}, "log_level", "TRACE"),
    (ObserveConfig, {"tensorboard": 0}, "tensorboard", 0),
    (ObserveConfig, {"console": None}, "console", None),
    (ObserveConfig, {"moving_average": 0}, "moving_average", 0),
    (ObserveConfig, {"output_mode": "0600"}, "output_mode", "0600"),  # the owner cannot enter its directories
    (ObserveConfig, {"output_mode": "0777"}, "output_mode", "0777"),  # others could write
    (ObserveConfig, {"output_mode": "rwx"}, "output_mode", "rwx"),
    (ObserveConfig, {"output_mode": 0o700}, "output_mode", 0o700),  # a string, not an int
    (SessionConfig, {"seed": -1}, "seed", -1),
    (SessionConfig, {"run_name": 5}, "run_name", 5),
    (SessionConfig, {"train": {"lr": 1e-4}}, "train", {"lr": 1e-4}),
]


@pytest.mark.parametrize(
    ("cls", "kwargs", "name", "bad"),
    BAD_VALUES,
    ids=[f"{c.__name__}.{n}={b!r}" for c, _, n, b in BAD_VALUES],
)
def test_config_bad_value_raises_error_naming_field_and_value(
    cls: type, kwargs: dict[str, Any], name: str, bad: Any
) -> None:
    with pytest.raises(ConfigError) as info:
        _build(cls, kwargs)

    field = f"{cls.__name__}.{name}"
    assert info.value.field == field
    assert field in str(info.value)
    assert repr(bad) in str(info.value)
    assert info.value.allowed in str(info.value)


@pytest.mark.parametrize(
    "cls",
    [
        ModelConfig,
        LaunchConfig,
        InferenceConfig,
        TrainConfig,
        AlgorithmConfig,
        RolloutConfig,
        DataConfig,
        ObserveConfig,
        SessionConfig,
    ],
)
def test_config_defaults_construct_without_error(cls: type) -> None:
    assert isinstance(_build(cls, {}), cls)


def test_train_config_negative_lr_raises_error_naming_field() -> None:
    with pytest.raises(ConfigError) as info:
        TrainConfig(lr=-1.0)

    assert info.value.field == "TrainConfig.lr"
    assert info.value.allowed == "a finite float > 0"


def test_literal_field_bad_choice_error_lists_choices() -> None:
    with pytest.raises(ConfigError) as info:
        RolloutConfig(stale_policy="ignore")  # type: ignore[arg-type]

    assert "'raise'" in info.value.allowed
    assert "'drop'" in info.value.allowed


def test_float_field_int_value_is_stored_as_float() -> None:
    cfg = TrainConfig(lr=1, max_grad_norm=2)

    assert type(cfg.lr) is float
    assert type(cfg.max_grad_norm) is float


def test_tuple_field_list_value_is_stored_as_tuple() -> None:
    cfg = TrainConfig(betas=[0.8, 0.95])  # type: ignore[arg-type]

    assert cfg.betas == (0.8, 0.95)


def test_optional_fields_none_is_accepted() -> None:
    assert TrainConfig(max_grad_norm=None, target_reward=None).max_grad_norm is None
    assert EmbeddedConfig(num_threads=None).num_threads is None
    assert LaunchConfig(command_timeout_s=None).command_timeout_s is None


def test_launch_config_heartbeat_timeout_error_names_both_fields() -> None:
    with pytest.raises(ConfigError) as info:
        LaunchConfig(heartbeat_interval_s=5.0, heartbeat_timeout_s=5.0)

    assert "heartbeat_timeout_s" in str(info.value)
    assert "heartbeat_interval_s" in str(info.value)


def test_data_config_max_digits_below_min_error_names_both_fields() -> None:
    with pytest.raises(ConfigError) as info:
        DataConfig(min_digits=4, max_digits=3)

    assert info.value.field == "DataConfig.max_digits"
    assert "min_digits" in str(info.value)


@pytest.mark.parametrize("host", ["127.0.0.1", "127.3.2.1", "::1", "localhost"])
def test_launch_config_loopback_host_is_accepted(host: str) -> None:
    assert LaunchConfig(host=host).host == host


def test_launch_config_remote_host_with_allow_remote_is_accepted() -> None:
    assert LaunchConfig(host="0.0.0.0", allow_remote=True).host == "0.0.0.0"


@pytest.mark.parametrize("task", ["reverse_digits", "arithmetic", "countdown"])
def test_data_config_generated_task_defaults_construct_without_path(task: str) -> None:
    cfg = DataConfig(task=task)  # type: ignore[arg-type]

    assert (cfg.path, cfg.prompt_column, cfg.chat_template, cfg.max_prompt_tokens) == (None, "prompt", False, None)


def test_data_config_file_task_with_path_and_options_is_accepted() -> None:
    cfg = DataConfig(
        task="file", path="prompts.jsonl", prompt_column="question", chat_template=True, system_prompt="Be brief."
    )

    assert (cfg.path, cfg.prompt_column, cfg.system_prompt) == ("prompts.jsonl", "question", "Be brief.")


@pytest.mark.parametrize(
    ("sections", "field", "value"),
    [
        ({"train": TrainConfig(parallelism="fsdp2")}, "train.parallelism", "fsdp2"),
        ({"rollout": RolloutConfig(mode="async", max_staleness=1)}, "rollout.mode", "async"),
    ],
)
def test_colocated_engine_with_fsdp2_or_async_raises_error_naming_both_fields(
    sections: dict[str, Any], field: str, value: str
) -> None:
    with pytest.raises(ConfigError) as info:
        SessionConfig(model=ModelConfig(path="models/tiny"), inference=InferenceConfig(engine="colocated"), **sections)

    assert info.value.field == field and info.value.value == value
    assert "inference.engine='colocated'" in str(info.value)


def test_colocated_engine_with_ddp_and_sequential_rollouts_is_accepted() -> None:
    config = SessionConfig(model=ModelConfig(path="models/tiny"), inference=InferenceConfig(engine="colocated"))

    assert config.inference.engine == "colocated" and config.train.parallelism == "ddp"


def test_rollout_config_stop_with_an_empty_string_raises_naming_stop() -> None:
    with pytest.raises(ConfigError) as info:
        RolloutConfig(stop=("</answer>", ""))

    assert info.value.field == "RolloutConfig.stop"
    assert "non-empty" in info.value.allowed
    assert RolloutConfig(stop=("</answer>",)).stop == ("</answer>",)


@pytest.mark.parametrize("mode", ["0700", "700", "0750", "0755"])
def test_observe_config_output_mode_with_owner_rwx_and_no_write_for_others_is_accepted(mode: str) -> None:
    assert ObserveConfig(output_mode=mode).output_mode == mode


def test_train_config_keeping_fsdp_layers_gathered_with_ddp_raises_error_naming_the_field() -> None:
    with pytest.raises(ConfigError) as info:
        TrainConfig(parallelism="ddp", fsdp_reshard_after_forward=False)

    assert info.value.field == "TrainConfig.fsdp_reshard_after_forward"
    assert "fsdp2" in str(info.value)


def test_train_config_keeping_fsdp_layers_gathered_with_fsdp2_is_accepted() -> None:
    config = TrainConfig(parallelism="fsdp2", fsdp_reshard_after_forward=False)

    assert config.fsdp_reshard_after_forward is False
