"""Fields moved into per-backend sections keep their old flat spellings, each warning, until the release that
removes them: constructor keyword, attribute, positional order, YAML/dict key and command-line flag."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any

import pytest

from rlsdk.config import (
    ConfigDeprecationWarning,
    ConfigError,
    InferenceConfig,
    LaunchConfig,
    ModelConfig,
    SessionConfig,
    SlurmConfig,
    VLLMConfig,
    config_from_dict,
    config_to_dict,
    load_config,
    merge_overrides,
    parse_cli,
)
from rlsdk.config.aliases import moves_of
from rlsdk.config.deprecations import deprecations

# Every move: (class, old name, section, field in the section, a valid value other than the default)
MOVES = [
    (LaunchConfig, "slurm_partition", "slurm", "partition", "gpu"),
    (LaunchConfig, "slurm_account", "slurm", "account", "rl-team"),
    (LaunchConfig, "slurm_time", "slurm", "time", "2-00:00:00"),
    (LaunchConfig, "slurm_cpus_per_task", "slurm", "cpus_per_task", 32),
    (LaunchConfig, "ray_address", "ray", "address", "ray://head:10001"),
    (InferenceConfig, "num_threads", "embedded", "num_threads", 3),
    (InferenceConfig, "url", "vllm", "url", "http://10.0.0.9:8000"),
    (InferenceConfig, "kv_cache_gib", "vllm", "kv_cache_gib", 4),
    (InferenceConfig, "max_model_len", "vllm", "max_model_len", 2048),
    (InferenceConfig, "server_start_timeout_s", "vllm", "server_start_timeout_s", 900.0),
    (InferenceConfig, "sync_timeout_s", "vllm", "sync_timeout_s", 60.0),
    (InferenceConfig, "request_timeout_s", "vllm", "request_timeout_s", 30.0),
    (InferenceConfig, "extra_server_args", "vllm", "extra_server_args", ("--seed", "1")),
    (InferenceConfig, "weight_transfer", "vllm", "weight_transfer", "reload"),
    (InferenceConfig, "lookahead", "colocated", "lookahead", False),
]
IDS = [f"{cls.__name__}.{old}" for cls, old, *_ in MOVES]
PREFIX = {LaunchConfig: "launch", InferenceConfig: "inference"}


def _engine_for(old: str) -> dict[str, Any]:
    return {"engine": "vllm"} if old == "url" else {}  # a vLLM URL needs the vLLM engine


def _session(**sections: Any) -> SessionConfig:
    return SessionConfig(model=ModelConfig(path="m"), **sections)


def test_moves_table_covers_every_declared_move() -> None:
    declared = {(cls, move.old, move.new) for cls in PREFIX for move in moves_of(cls)}

    assert declared == {(cls, old, f"{section}.{leaf}") for cls, old, section, leaf, _ in MOVES}
    assert all(move.remove_in == "0.3" for cls in PREFIX for move in moves_of(cls))


@pytest.mark.parametrize(("cls", "old", "section", "leaf", "value"), MOVES, ids=IDS)
def test_old_keyword_sets_the_section_field_and_warns_naming_the_new_spelling(
    cls: type, old: str, section: str, leaf: str, value: Any
) -> None:
    with pytest.warns(ConfigDeprecationWarning, match=rf"use {cls.__name__}\({section}=.*{leaf}=.*rlsdk 0\.3"):
        cfg = cls(**{old: value, **_engine_for(old)})

    assert getattr(getattr(cfg, section), leaf) == value
    assert type(getattr(getattr(cfg, section), leaf)) is type(value)


@pytest.mark.parametrize(("cls", "old", "section", "leaf", "value"), MOVES, ids=IDS)
def test_old_attribute_reads_and_assigns_the_section_field_with_a_warning(
    cls: type, old: str, section: str, leaf: str, value: Any
) -> None:
    cfg = cls(**_engine_for(old))

    with pytest.warns(ConfigDeprecationWarning, match=rf"use {cls.__name__}\.{section}\.{leaf} instead.*rlsdk 0\.3"):
        setattr(cfg, old, value)
    with pytest.warns(ConfigDeprecationWarning):
        read = getattr(cfg, old)

    assert read == value == getattr(getattr(cfg, section), leaf)


@pytest.mark.parametrize(("cls", "old", "section", "leaf", "value"), MOVES, ids=IDS)
def test_old_yaml_key_loads_into_the_section_with_a_warning(
    tmp_path: Path, cls: type, old: str, section: str, leaf: str, value: Any
) -> None:
    prefix = PREFIX[cls]
    data = config_to_dict(_session())
    data[prefix].pop(section)
    data[prefix].update({old: value, **_engine_for(old)})
    path = tmp_path / "config.yaml"
    import yaml

    path.write_text(yaml.safe_dump(data))

    with pytest.warns(ConfigDeprecationWarning, match=rf"'{prefix}\.{old}'.*'{prefix}\.{section}\.{leaf}'.*0\.3"):
        cfg = load_config(path)

    assert getattr(getattr(getattr(cfg, prefix), section), leaf) == value


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--inference.kv-cache-gib", "4"], ("vllm", "kv_cache_gib", 4)),
        (["--inference.kv_cache_gib=4"], ("vllm", "kv_cache_gib", 4)),
        (["--inference.weight-transfer", "reload"], ("vllm", "weight_transfer", "reload")),
        (["--inference.extra-server-args", "a", "b"], ("vllm", "extra_server_args", ("a", "b"))),
        (["--inference.num-threads", "3"], ("embedded", "num_threads", 3)),
        (["--inference.no-lookahead"], ("colocated", "lookahead", False)),
        (["--inference.lookahead", "false"], ("colocated", "lookahead", False)),
        (["--launch.slurm-time", "00:30:00"], ("slurm", "time", "00:30:00")),
        (["--launch.ray-address", "auto"], ("ray", "address", "auto")),
    ],
)
def test_old_flag_applies_to_the_section_field_with_a_warning(args: list[str], expected: tuple[str, str, Any]) -> None:
    section, leaf, value = expected

    with pytest.warns(ConfigDeprecationWarning, match=r"flag '(inference|launch)\.[a-z_]+' is deprecated.*0\.3"):
        cfg = parse_cli(_session(inference=InferenceConfig(engine="vllm")), args)

    owner = cfg.launch if section in ("slurm", "ray") else cfg.inference
    assert getattr(getattr(owner, section), leaf) == value


def test_old_dotted_override_merges_into_the_section_with_a_warning() -> None:
    with pytest.warns(ConfigDeprecationWarning, match="'inference.vllm.kv_cache_gib'"):
        cfg = merge_overrides(_session(), {"inference.kv_cache_gib": 5})

    assert cfg.inference.vllm.kv_cache_gib == 5


def test_old_keyword_and_section_with_different_values_raise_naming_both() -> None:
    with pytest.warns(ConfigDeprecationWarning), pytest.raises(ConfigError) as info:
        InferenceConfig(kv_cache_gib=2, vllm=VLLMConfig(kv_cache_gib=3))

    assert info.value.field == "InferenceConfig.kv_cache_gib"
    assert "'kv_cache_gib' (deprecated) and vllm.kv_cache_gib (= 3)" in str(info.value)


def test_old_keyword_with_a_section_leaving_that_field_default_fills_it_in() -> None:
    with pytest.warns(ConfigDeprecationWarning):
        cfg = LaunchConfig(slurm_time="00:10:00", slurm=SlurmConfig(partition="gpu"))

    assert cfg.slurm == SlurmConfig(partition="gpu", time="00:10:00")


def test_old_and_new_yaml_keys_together_raise_naming_both() -> None:
    data = {"model": {"path": "m"}, "inference": {"kv_cache_gib": 2, "vllm": {"kv_cache_gib": 3}}}

    with pytest.warns(ConfigDeprecationWarning), pytest.raises(ConfigError) as info:
        config_from_dict(SessionConfig, data)

    assert "'inference.kv_cache_gib' (deprecated) and 'inference.vllm.kv_cache_gib'" in str(info.value)


def test_old_and_new_flags_together_raise_naming_both() -> None:
    args = ["--inference.kv-cache-gib", "2", "--inference.vllm.kv-cache-gib", "3"]

    with pytest.warns(ConfigDeprecationWarning), pytest.raises(ConfigError) as info:
        parse_cli(_session(), args)

    assert "--inference.kv_cache_gib (deprecated) and --inference.vllm.kv_cache_gib" in str(info.value)


def test_old_keyword_with_a_bad_value_raises_naming_the_new_field() -> None:
    with pytest.warns(ConfigDeprecationWarning), pytest.raises(ConfigError) as info:
        InferenceConfig(kv_cache_gib=0)

    assert info.value.field == "InferenceConfig.vllm.kv_cache_gib"


def test_positional_arguments_in_the_old_order_keep_their_meaning_with_a_warning() -> None:
    # InferenceConfig's order before the move: engine, num_threads, max_batch_size, url, logprob_warn_threshold, ...
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = InferenceConfig("embedded", 2, 8, None, 0.5)

    assert [type(w.message) for w in caught] == [ConfigDeprecationWarning]  # one warning for the call
    message = str(caught[0].message)
    assert "positional arguments after 'engine'" in message and "rlsdk 0.3" in message
    assert "num_threads -> embedded.num_threads, max_batch_size, url -> vllm.url, logprob_warn_threshold" in message

    assert (cfg.engine, cfg.embedded.num_threads, cfg.max_batch_size, cfg.logprob_warn_threshold) == (
        "embedded",
        2,
        8,
        0.5,
    )


# LaunchConfig's parameters in their order before the Slurm and Ray options moved (rlsdk 0.1.0): the contract that
# positional callers relied on.
OLD_LAUNCH_ORDER = (
    "num_ranks", "backend", "threads_per_rank", "start_timeout_s", "heartbeat_interval_s", "heartbeat_timeout_s",
    "command_timeout_s", "host", "allow_remote", "tracer", "hang_timeout_s", "hang_policy", "pg_timeout_s",
    "scheduler", "num_nodes", "ranks_per_node", "data_parallel_size", "tensor_parallel_size",
    "context_parallel_size", "inference_replicas", "inference_tensor_parallel_size", "gpus_per_node",
    "main_process_port", "slurm_partition", "slurm_account", "slurm_time", "slurm_cpus_per_task", "ray_address",
    "simulate_nodes_on_loopback", "shm_allreduce", "trace_poll_s",
)  # fmt: skip


def test_launch_positional_arguments_in_the_old_order_reach_the_sections_and_the_fields_after_them() -> None:
    defaults = LaunchConfig()
    values = {name: getattr(defaults, name) for name in OLD_LAUNCH_ORDER if not name.startswith(("slurm_", "ray_"))}
    values.update(slurm_partition="gpu", slurm_account=None, slurm_time="00:05:00", slurm_cpus_per_task=None)
    values.update(ray_address="auto", trace_poll_s=2.5)

    with pytest.warns(ConfigDeprecationWarning, match="positional arguments after"):
        cfg = LaunchConfig(*(values[name] for name in OLD_LAUNCH_ORDER))

    assert cfg.slurm == SlurmConfig(partition="gpu", time="00:05:00")
    assert cfg.ray.address == "auto"
    assert cfg.trace_poll_s == 2.5


def test_too_many_positional_arguments_raise_type_error() -> None:
    with pytest.raises(TypeError, match="at most"):
        InferenceConfig(*range(30))


def test_first_positional_argument_and_keywords_of_current_fields_do_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigDeprecationWarning)
        cfg = InferenceConfig("vllm", vllm=VLLMConfig(kv_cache_gib=2))
        LaunchConfig(4)

    assert cfg.vllm.kv_cache_gib == 2


def test_library_defaults_round_trip_and_cli_raise_no_deprecation_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigDeprecationWarning)
        cfg = _session()
        restored = config_from_dict(SessionConfig, config_to_dict(cfg))
        parsed = parse_cli(cfg, ["--inference.vllm.kv-cache-gib", "2", "--inference.colocated.no-lookahead"])
        replaced = dataclasses.replace(cfg.inference, engine="colocated")

    assert restored == cfg
    assert (parsed.inference.vllm.kv_cache_gib, parsed.inference.colocated.lookahead) == (2, False)
    assert replaced.engine == "colocated"


def test_deprecations_list_every_move_with_its_dotted_keys() -> None:
    keys = {dep.old: dep.new for dep in deprecations(SessionConfig)}

    assert keys["inference.kv_cache_gib"] == "inference.vllm.kv_cache_gib"
    assert keys["launch.slurm_partition"] == "launch.slurm.partition"
    assert keys["launch.ray_address"] == "launch.ray.address"
