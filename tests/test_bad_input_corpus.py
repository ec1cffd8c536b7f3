"""The bad-input corpus: every kind of bad input a run can be given gets one clear error before any process starts.

Each case names the check that runs before ``Session.start`` launches anything (the config classes and loaders,
the command-line parser, ``check_model_dir``, ``check_data``, ``load_resume_state``, the reward helper that
``Session.reward`` calls) and expects one error type whose message names the field or thing and what is allowed.
Bad configs (wrong types, out-of-range values, unknown keys in mappings, YAML files and flags, contradictory
options, more ranks than allowed), bad data (missing paths, unsupported or unreadable files, wrong columns, empty
files, empty or non-text prompts, prompts over ``data.max_prompt_tokens``), bad rewards (raise, NaN, wrong length,
too slow) and bad model paths. A failing reward leaves the rollout it was given intact and rewardable.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from rlsdk.config import (
    ConfigError,
    DataConfig,
    ModelConfig,
    RolloutConfig,
    SessionConfig,
    TrainConfig,
    config_from_dict,
    load_config,
    merge_overrides,
    parse_cli,
)
from rlsdk.engine.inference.sampling import left_pad
from rlsdk.rewards import RewardError, combine_rewards
from rlsdk.rewards.apply import compute_reward_breakdown
from rlsdk.session import check_data, check_model_dir, check_model_files, load_resume_state
from rlsdk.workflow.rollout import Rollout


@dataclass(frozen=True)
class BadInput:
    """One corpus entry: ``make(tmp_path, model_dir)`` must raise ``error`` whose message (with what the CLI
    wrote to stderr) contains every string of ``names``; a ConfigError must name ``field``."""

    id: str
    make: Callable[[Path, Path], object]
    error: type[BaseException]
    names: tuple[str, ...]
    field: str | None = None


# ---------------------------------------------------------------------------------------------- builders
def _mapping(sections: dict[str, Any]) -> SessionConfig:
    """A SessionConfig from a mapping, as a YAML file gives it (a model path added)."""
    return config_from_dict(SessionConfig, {"model": {"path": "models/tiny"}, **sections})


def _default() -> SessionConfig:
    return SessionConfig(model=ModelConfig(path="models/tiny"))


def _yaml(tmp: Path, text: str) -> Path:
    path = tmp / "run.yaml"
    path.write_text(text)
    return path


def _file(tmp: Path, name: str, text: str) -> Path:
    path = tmp / name
    path.write_text(text)
    return path


def _jsonl(tmp: Path, rows: list[dict[str, Any]], name: str = "prompts.jsonl") -> Path:
    return _file(tmp, name, "".join(json.dumps(row) + "\n" for row in rows))


def _parquet(tmp: Path, columns: dict[str, list[Any]], name: str = "prompts.parquet") -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp / name
    pq.write_table(pa.table({k: pa.array(v, pa.string()) for k, v in columns.items()}), path)
    return path


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json")


def _model_copy(tmp: Path, model: Path, *, drop: tuple[str, ...] = (), config_json: str | None = None) -> SessionConfig:
    """A config whose model.path is a copy of the tiny model without ``drop`` (or with another config.json)."""
    import shutil

    copy = tmp / "model-copy"
    shutil.copytree(model, copy)
    for name in drop:
        (copy / name).unlink(missing_ok=True)
    if config_json is not None:
        (copy / "config.json").write_text(config_json)
    return SessionConfig(model=ModelConfig(path=str(copy)))


def _check_file(model: Path, path: Path | str, **data: Any) -> object:
    """``check_data`` (what ``Session.start`` runs before launching) on a local prompt file."""
    config = SessionConfig(model=ModelConfig(path=str(model)), data=DataConfig(task="file", path=str(path), **data))
    return check_data(config)


def _saved_dataset_dict(tmp: Path) -> Path:
    import datasets

    path = tmp / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"prompt": ["12>"]})}).save_to_disk(str(path))
    return path


def _rollout() -> Rollout:
    """Two prompts x two samples, as a Session's rollout would hold them (no Session needed)."""
    prompt_ids_B_P, prompt_mask_B_P = left_pad([[1, 2]] * 4, pad_token_id=0)
    return Rollout(
        rows=[{"prompt": "12>", "answer": "21"}, {"prompt": "34>", "answer": "43"}],
        group_size=2,
        prompt_ids_B_P=prompt_ids_B_P,
        prompt_mask_B_P=prompt_mask_B_P,
        completion_ids_B_C=torch.ones(4, 2, dtype=torch.long),
        completion_mask_B_C=torch.ones(4, 2, dtype=torch.bool),
        logprobs_B_C=torch.zeros(4, 2),
        versions_B_C=torch.zeros(4, 2, dtype=torch.long),
        completions=["21", "12", "43", "4"],
    )


def _reward(fn: Callable[..., Any], timeout_s: float | None = None) -> object:
    """The batched call ``Session.reward`` makes, on a rollout."""
    return asyncio.run(compute_reward_breakdown(_rollout(), fn, timeout_s=timeout_s))


# ---------------------------------------------------------------------------------------------- bad rewards
def raises_key_error(completions: list[str], **_: Any) -> list[float]:
    raise KeyError("answer_text")


async def raises_async(completions: list[str], **_: Any) -> list[float]:
    raise RuntimeError("judge unavailable")


def returns_nan(completions: list[str], **_: Any) -> list[float]:
    return [1.0, math.nan, 0.0, 0.0]


def returns_inf(completions: list[str], **_: Any) -> list[float]:
    return [0.0, 0.0, math.inf, 0.0]


def returns_too_few(completions: list[str], **_: Any) -> list[float]:
    return [1.0] * (len(completions) - 1)


def returns_too_many(completions: list[str], **_: Any) -> list[float]:
    return [1.0] * (len(completions) * 2)


def returns_none(completions: list[str], **_: Any) -> None:
    return None


def returns_text(completions: list[str], **_: Any) -> list[str]:
    return ["good"] * len(completions)


async def never_returns(completions: list[str], **_: Any) -> list[float]:
    await asyncio.sleep(60)
    return [0.0] * len(completions)


def slow_sync(completions: list[str], **_: Any) -> list[float]:
    time.sleep(0.5)  # a worker thread cannot be cancelled: keep it short, the timeout is what is checked
    return [0.0] * len(completions)


def exact(completions: list[str], answer: list[str], **_: Any) -> list[float]:
    return [float(c == a) for c, a in zip(completions, answer)]


def needs_missing_column(completions: list[str], solution: list[str], **_: Any) -> list[float]:
    return [float(c == s) for c, s in zip(completions, solution)]


_COMBINED_FAILING = combine_rewards({"exact": (exact, 1.0), "judge": (raises_key_error, 0.5)})

FAILING_REWARDS: list[tuple[str, Callable[..., Any], float | None, tuple[str, ...]]] = [
    ("raises", raises_key_error, None, ("raises_key_error", "raised KeyError", "answer_text")),
    ("async-raises", raises_async, None, ("raises_async", "raised RuntimeError", "judge unavailable")),
    ("nan", returns_nan, None, ("returns_nan", "non-finite reward nan for sample 1", "must be finite")),
    ("inf", returns_inf, None, ("returns_inf", "non-finite reward inf for sample 2", "must be finite")),
    ("too-few", returns_too_few, None, ("returns_too_few", "returned 3 rewards for 4 samples")),
    ("too-many", returns_too_many, None, ("returns_too_many", "returned 8 rewards for 4 samples")),
    ("none", returns_none, None, ("returns_none", "returned NoneType", "allowed: a sequence of 4 numbers")),
    ("text", returns_text, None, ("returns_text", "returned list", "allowed: a sequence of 4 numbers")),
    ("async-too-slow", never_returns, 0.05, ("never_returns", "did not return within 0.05 s")),
    ("sync-too-slow", slow_sync, 0.05, ("slow_sync", "did not return within 0.05 s")),
    ("missing-column", needs_missing_column, None, ("needs_missing_column", "raised TypeError", "solution")),
    ("combined-component-raises", _COMBINED_FAILING, None, ("'judge'", "raises_key_error", "raised KeyError")),
]

# ---------------------------------------------------------------------------------------------- the corpus
CORPUS: list[BadInput] = [
    # --- configs: wrong types (a mapping, as YAML gives it; errors name the dotted field)
    BadInput("type/train.lr-string", lambda t, m: _mapping({"train": {"lr": "fast"}}), ConfigError,
             ("train.lr", "a finite float"), "train.lr"),
    BadInput("type/launch.num_ranks-bool", lambda t, m: _mapping({"launch": {"num_ranks": True}}), ConfigError,
             ("launch.num_ranks", "an int"), "launch.num_ranks"),
    BadInput("type/launch.num_ranks-float", lambda t, m: _mapping({"launch": {"num_ranks": 2.0}}), ConfigError,
             ("launch.num_ranks", "an int"), "launch.num_ranks"),
    BadInput("type/observe.tensorboard-string", lambda t, m: _mapping({"observe": {"tensorboard": "yes"}}),
             ConfigError, ("observe.tensorboard", "a bool"), "observe.tensorboard"),
    BadInput("type/train.betas-one-value", lambda t, m: _mapping({"train": {"betas": [0.9]}}), ConfigError,
             ("train.betas", "a list of 2 values"), "train.betas"),
    BadInput("type/rollout.group_size-null", lambda t, m: _mapping({"rollout": {"group_size": None}}),
             ConfigError, ("rollout.group_size", "an int"), "rollout.group_size"),
    BadInput("type/model.path-int", lambda t, m: config_from_dict(SessionConfig, {"model": {"path": 3}}),
             ConfigError, ("model.path", "a string"), "model.path"),
    BadInput("type/inference.vllm.extra_server_args-string",
             lambda t, m: _mapping({"inference": {"vllm": {"extra_server_args": "--seed 1"}}}), ConfigError,
             ("inference.vllm.extra_server_args", "a list of any length, each a string"),
             "inference.vllm.extra_server_args"),
    BadInput("type/train-section-not-mapping", lambda t, m: _mapping({"train": 5}), ConfigError,
             ("train", "a mapping of TrainConfig fields"), "train"),
    BadInput("type/train.lr-constructor", lambda t, m: TrainConfig(lr="1e-3"),  # type: ignore[arg-type]
             ConfigError, ("TrainConfig.lr", "a finite float"), "TrainConfig.lr"),
    # --- configs: out-of-range values
    BadInput("range/train.lr-zero", lambda t, m: _mapping({"train": {"lr": 0}}), ConfigError,
             ("train.lr", "> 0"), "train.lr"),
    BadInput("range/train.lr-nan", lambda t, m: _mapping({"train": {"lr": math.nan}}), ConfigError,
             ("train.lr", "a finite float"), "train.lr"),
    BadInput("range/train.betas-one", lambda t, m: _mapping({"train": {"betas": [0.9, 1.0]}}), ConfigError,
             ("train.betas", "each in [0, 1)"), "train.betas"),
    BadInput("range/train.keep_checkpoints-zero", lambda t, m: _mapping({"train": {"keep_checkpoints": 0}}),
             ConfigError, ("train.keep_checkpoints", ">= 1"), "train.keep_checkpoints"),
    BadInput("range/rollout.top_p-above-one", lambda t, m: _mapping({"rollout": {"top_p": 1.5}}), ConfigError,
             ("rollout.top_p", "in (0, 1]"), "rollout.top_p"),
    BadInput("range/rollout.temperature-zero", lambda t, m: _mapping({"rollout": {"temperature": 0}}),
             ConfigError, ("rollout.temperature", "> 0"), "rollout.temperature"),
    BadInput("range/rollout.max_staleness-negative", lambda t, m: _mapping({"rollout": {"max_staleness": -1}}),
             ConfigError, ("rollout.max_staleness", ">= 0"), "rollout.max_staleness"),
    BadInput("range/algorithm.clip_eps_low-one", lambda t, m: _mapping({"algorithm": {"clip_eps_low": 1.0}}),
             ConfigError, ("algorithm.clip_eps_low", "in (0, 1)"), "algorithm.clip_eps_low"),
    BadInput("range/data.countdown_numbers-seven", lambda t, m: _mapping({"data": {"countdown_numbers": 7}}),
             ConfigError, ("data.countdown_numbers", "in [2, 6]"), "data.countdown_numbers"),
    BadInput("range/data.max_prompt_tokens-zero", lambda t, m: _mapping({"data": {"max_prompt_tokens": 0}}),
             ConfigError, ("data.max_prompt_tokens", "None or an int >= 1"), "data.max_prompt_tokens"),
    BadInput("range/seed-negative", lambda t, m: _mapping({"seed": -1}), ConfigError, ("seed", ">= 0"), "seed"),
    BadInput("range/launch.num_ranks-zero", lambda t, m: _mapping({"launch": {"num_ranks": 0}}), ConfigError,
             ("launch.num_ranks", "in [1, 64]"), "launch.num_ranks"),
    # --- configs: more ranks than allowed
    BadInput("ranks/launch.num_ranks-above-64", lambda t, m: _mapping({"launch": {"num_ranks": 65}}), ConfigError,
             ("launch.num_ranks", "in [1, 64]"), "launch.num_ranks"),
    BadInput("ranks/more-ranks-than-samples-per-step",
             lambda t, m: _mapping({"launch": {"num_ranks": 4}, "data": {"prompts_per_step": 1},
                                    "rollout": {"group_size": 2}}),
             ConfigError, ("launch.num_ranks", "data.prompts_per_step x rollout.group_size = 1 x 2 = 2"),
             "launch.num_ranks"),
    # --- configs: bounded choices
    BadInput("choice/model.dtype", lambda t, m: _mapping({"model": {"path": "m", "dtype": "fp16"}}), ConfigError,
             ("model.dtype", "one of 'float32', 'bfloat16', 'float16'"), "model.dtype"),
    BadInput("choice/rollout.stale_policy", lambda t, m: _mapping({"rollout": {"stale_policy": "ignore"}}),
             ConfigError, ("rollout.stale_policy", "one of 'raise', 'drop'"), "rollout.stale_policy"),
    BadInput("choice/inference.engine", lambda t, m: _mapping({"inference": {"engine": "sglang"}}), ConfigError,
             ("inference.engine", "one of 'embedded', 'vllm'"), "inference.engine"),
    BadInput("choice/observe.log_level-lowercase", lambda t, m: _mapping({"observe": {"log_level": "debug"}}),
             ConfigError, ("observe.log_level", "'DEBUG'"), "observe.log_level"),
    # --- configs: unknown and missing keys
    BadInput("key/unknown-section", lambda t, m: _mapping({"trian": {"lr": 1e-3}}), ConfigError,
             ("trian", "did you mean 'train'?", "valid keys"), "trian"),
    BadInput("key/unknown-field", lambda t, m: _mapping({"rollout": {"groupsize": 4}}), ConfigError,
             ("rollout.groupsize", "did you mean 'group_size'?"), "rollout.groupsize"),
    BadInput("key/unknown-dotted-override", lambda t, m: merge_overrides(_default(), {"train.learning_rate": 1}),
             ConfigError, ("train.learning_rate", "a known key", "valid keys: lr"), "train.learning_rate"),
    BadInput("key/missing-model", lambda t, m: config_from_dict(SessionConfig, {"train": {"lr": 1e-3}}),
             ConfigError, ("model", "model is required"), "model"),
    BadInput("key/missing-model.path", lambda t, m: config_from_dict(SessionConfig, {"model": {}}), ConfigError,
             ("model.path", "path is required"), "model.path"),
    # --- configs: contradictory options
    BadInput("contradiction/system_prompt-without-chat_template",
             lambda t, m: _mapping({"data": {"system_prompt": "Be brief."}}), ConfigError,
             ("data.system_prompt", "None unless chat_template=True"), "data.system_prompt"),
    BadInput("contradiction/url-with-embedded-engine",
             lambda t, m: _mapping({"inference": {"vllm": {"url": "http://127.0.0.1:8000"}}}), ConfigError,
             ("inference.vllm.url", "None unless engine='vllm'"), "inference.vllm.url"),
    BadInput("contradiction/max_digits-below-min_digits",
             lambda t, m: _mapping({"data": {"min_digits": 4, "max_digits": 3}}), ConfigError,
             ("data.max_digits", "min_digits (= 4)"), "data.max_digits"),
    BadInput("contradiction/heartbeat-timeout-below-interval",
             lambda t, m: _mapping({"launch": {"heartbeat_interval_s": 5.0, "heartbeat_timeout_s": 2.0}}),
             ConfigError, ("launch.heartbeat_timeout_s", "heartbeat_interval_s (= 5.0)"), "launch.heartbeat_timeout_s"),
    BadInput("contradiction/data.path-with-generated-task", lambda t, m: _mapping({"data": {"path": "p.jsonl"}}),
             ConfigError, ("data.path", "when task='file', else None"), "data.path"),
    BadInput("contradiction/file-task-without-path", lambda t, m: _mapping({"data": {"task": "file"}}),
             ConfigError, ("data.path", "a non-empty local path when task='file'"), "data.path"),
    BadInput("contradiction/prompt_column-with-generated-task",
             lambda t, m: _mapping({"data": {"prompt_column": "question"}}), ConfigError,
             ("data.prompt_column", "'prompt' unless task='file'"), "data.prompt_column"),
    BadInput("contradiction/mixed-precision-with-bfloat16-weights",
             lambda t, m: _mapping({"model": {"path": "m", "dtype": "bfloat16"}, "train": {"mixed_precision": "bf16"}}),
             ConfigError, ("model.dtype", "'float32' when train.mixed_precision='bf16'"), "model.dtype"),
    BadInput("contradiction/inplace-transfer-with-other-served-dtype",
             lambda t, m: _mapping({"inference": {"engine": "vllm", "vllm": {"weight_transfer": "inplace"},
                                                  "dtype": "bfloat16"}}),
             ConfigError, ("inference.dtype", "when inference.vllm.weight_transfer='inplace'"), "inference.dtype"),
    BadInput("contradiction/rloo-with-one-sample",
             lambda t, m: _mapping({"algorithm": {"name": "rloo"}, "rollout": {"group_size": 1}}), ConfigError,
             ("rollout.group_size", ">= 2 when algorithm.advantage is 'rloo'"), "rollout.group_size"),
    BadInput("contradiction/preset-fixed-field",
             lambda t, m: _mapping({"algorithm": {"name": "dr_grpo", "advantage": "grpo"}}), ConfigError,
             ("algorithm.advantage", "(AlgorithmConfig.name='dr_grpo' fixes it)"), "algorithm.advantage"),
    BadInput("contradiction/remote-host-without-allow_remote",
             lambda t, m: _mapping({"launch": {"host": "0.0.0.0"}}), ConfigError,
             ("launch.host", "a loopback address", "unless allow_remote=True"), "launch.host"),
    # --- configs: YAML files
    BadInput("yaml/unknown-key", lambda t, m: load_config(_yaml(t, "model: {path: m}\ntrain:\n  lrr: 0.1\n")),
             ConfigError, ("train.lrr", "did you mean 'lr'?"), "train.lrr"),
    BadInput("yaml/wrong-type", lambda t, m: load_config(_yaml(t, "model: {path: m}\nlaunch:\n  num_ranks: two\n")),
             ConfigError, ("launch.num_ranks", "'two'", "an int"), "launch.num_ranks"),
    BadInput("yaml/duplicate-key", lambda t, m: load_config(_yaml(t, "model: {path: m}\nseed: 1\nseed: 2\n")),
             ConfigError, ("run.yaml:3", "valid YAML", "duplicate key 'seed'")),
    BadInput("yaml/syntax-error", lambda t, m: load_config(_yaml(t, "model: {path: m}\ntrain: [lr: 1\n")),
             ConfigError, ("run.yaml", "valid YAML")),
    BadInput("yaml/top-level-list", lambda t, m: load_config(_yaml(t, "- model\n- train\n")), ConfigError,
             ("run.yaml", "a YAML mapping of config sections")),
    BadInput("yaml/missing-file", lambda t, m: load_config(t / "nowhere.yaml"), FileNotFoundError,
             ("config file not found", "nowhere.yaml")),
    # --- configs: command-line flags (tyro writes the message to stderr and exits 2)
    BadInput("cli/unknown-flag", lambda t, m: parse_cli(_default(), ["--train.lrr", "1"]), SystemExit,
             ("Unrecognized options: --train.lrr", "Perhaps you meant", "--train.lr FLOAT")),
    BadInput("cli/unparsable-value", lambda t, m: parse_cli(_default(), ["--train.lr", "abc"]), SystemExit,
             ("--train.lr", "could not convert string to float: 'abc'")),
    BadInput("cli/out-of-range-value", lambda t, m: parse_cli(_default(), ["--train.lr", "-1"]), SystemExit,
             ("train", "TrainConfig.lr=-1.0", "allowed a finite float > 0")),
    BadInput("cli/bad-choice", lambda t, m: parse_cli(_default(), ["--model.dtype", "fp8"]), SystemExit,
             ("'fp8'", "--model.dtype", "('float32', 'bfloat16', 'float16')")),
    BadInput("cli/too-many-ranks", lambda t, m: parse_cli(_default(), ["--launch.num-ranks", "65"]), SystemExit,
             ("launch", "LaunchConfig.num_ranks=65", "an int in [1, 64]")),
    BadInput("cli/config-without-path", lambda t, m: parse_cli(_default(), ["--config", "--seed", "1"]),
             ConfigError, ("--config", "a path to a YAML file"), "--config"),
    BadInput("cli/config-file-unknown-key",
             lambda t, m: parse_cli(_default(), ["--config", str(_yaml(t, "rollout: {group_sise: 4}\n"))]),
             ConfigError, ("rollout.group_sise", "did you mean 'group_size'?", "[in --config"), "rollout.group_sise"),
    # --- model paths (check_model_dir: Session.start's first check)
    BadInput("contradiction/async-without-staleness-bound", lambda t, m: RolloutConfig(mode="async", max_staleness=0),
             ConfigError, ("max_staleness=0", "an int >= 1 when mode='async'"), "RolloutConfig.max_staleness"),
    BadInput("model/missing-dir", lambda t, m: check_model_dir(str(t / "no-such-model")), ConfigError,
             ("model.path", "no-such-model", "an existing local directory"), "model.path"),
    BadInput("model/dir-without-config.json", lambda t, m: check_model_dir(str(t)), ConfigError,
             ("model.path", "a directory with config.json"), "model.path"),
    BadInput("model/file-not-dir", lambda t, m: check_model_dir(str(_file(t, "model.safetensors", "x"))),
             ConfigError, ("model.path", "model.safetensors", "an existing local directory"), "model.path"),
    BadInput("model/no-tokenizer-files", lambda t, m: check_model_files(_model_copy(t, m, drop=TOKENIZER_FILES)),
             ConfigError, ("model.path", "tokenizer files", "no vocabulary"), "model.path"),
    BadInput("model/broken-config.json", lambda t, m: check_model_files(_model_copy(t, m, config_json="{")),
             ConfigError, ("model.path", "config.json transformers can load", "not a valid JSON"), "model.path"),
    BadInput("model/empty-path", lambda t, m: ModelConfig(path="  "), ConfigError,
             ("ModelConfig.path", "a non-empty path"), "ModelConfig.path"),
    # --- checkpoints to resume from (load_resume_state, before any process)
    BadInput("resume/missing-dir",
             lambda t, m: load_resume_state(merge_overrides(_default(), {"train.resume_from": str(t / "step_3")})),
             ConfigError, ("train.resume_from", "an existing step_N checkpoint directory"), "train.resume_from"),
    BadInput("resume/latest-without-checkpoints",
             lambda t, m: load_resume_state(
                 merge_overrides(_default(), {"train.resume_from": "latest", "observe.output_dir": str(t)})),
             ConfigError, ("train.resume_from", "'latest' needs a complete step_N checkpoint"), "train.resume_from"),
    BadInput("resume/dir-without-manifest",
             lambda t, m: load_resume_state(merge_overrides(_default(), {"train.resume_from": str(t)})),
             ConfigError, ("train.resume_from", "with manifest.json"), "train.resume_from"),
    # --- data (check_data: built before any process starts)
    BadInput("data/missing-path", lambda t, m: _check_file(m, t / "missing.jsonl"), ConfigError,
             ("data.path", "missing.jsonl", "an existing local path"), "data.path"),
    BadInput("data/unsupported-suffix", lambda t, m: _check_file(m, _file(t, "p.csv", "prompt\n12>\n")),
             ConfigError, ("data.path", "a .jsonl, .parquet or .arrow file", "got suffix '.csv'"), "data.path"),
    BadInput("data/empty-jsonl", lambda t, m: _check_file(m, _file(t, "p.jsonl", "")), ConfigError,
             ("data.path", "a readable .jsonl file"), "data.path"),
    BadInput("data/blank-lines-jsonl", lambda t, m: _check_file(m, _file(t, "p.jsonl", "\n\n")), ConfigError,
             ("data.path", "at least one row"), "data.path"),
    BadInput("data/not-json", lambda t, m: _check_file(m, _file(t, "p.jsonl", "12> -> 21\n")), ConfigError,
             ("data.path", "a readable .jsonl file", "JSON parse error"), "data.path"),
    BadInput("data/mixed-types-jsonl",
             lambda t, m: _check_file(m, _file(t, "p.jsonl", '{"prompt": "12>"}\n{"prompt": 5}\n')), ConfigError,
             ("data.path", "a readable .jsonl file", "prompt"), "data.path"),
    BadInput("data/empty-parquet-file", lambda t, m: _check_file(m, _file(t, "p.parquet", "")), ConfigError,
             ("data.path", "a readable .parquet file"), "data.path"),
    BadInput("data/parquet-without-rows", lambda t, m: _check_file(m, _parquet(t, {"prompt": []})), ConfigError,
             ("data.path", "at least one row"), "data.path"),
    BadInput("data/jsonl-wrong-column", lambda t, m: _check_file(m, _jsonl(t, [{"question": "12>"}])),
             ConfigError, ("data.prompt_column", "'prompt'", "columns found", "['question']"), "data.prompt_column"),
    BadInput("data/parquet-wrong-column", lambda t, m: _check_file(m, _parquet(t, {"text": ["12>"]})),
             ConfigError, ("data.prompt_column", "columns found", "['text']"), "data.prompt_column"),
    BadInput("data/configured-column-absent",
             lambda t, m: _check_file(m, _jsonl(t, [{"prompt": "12>"}]), prompt_column="question"), ConfigError,
             ("data.prompt_column", "'question'", "['prompt']"), "data.prompt_column"),
    BadInput("data/directory-not-a-dataset", lambda t, m: _check_file(m, t), ConfigError,
             ("data.path", "no state.json or dataset_dict.json"), "data.path"),
    BadInput("data/missing-split", lambda t, m: _check_file(m, _saved_dataset_dict(t), split="test"), ConfigError,
             ("data.split", "'test'", "['train']"), "data.split"),
    BadInput("data/empty-prompt", lambda t, m: _check_file(m, _jsonl(t, [{"prompt": "12>"}, {"prompt": ""}])),
             ConfigError, ("data.prompt_column", "non-empty strings", "row 1 holds ''"), "data.prompt_column"),
    BadInput("data/whitespace-prompt", lambda t, m: _check_file(m, _jsonl(t, [{"prompt": "  \n"}])), ConfigError,
             ("data.prompt_column", "non-empty strings", "row 0"), "data.prompt_column"),
    BadInput("data/null-prompt", lambda t, m: _check_file(m, _jsonl(t, [{"prompt": None}])), ConfigError,
             ("data.prompt_column", "row 0 holds None"), "data.prompt_column"),
    BadInput("data/number-prompt", lambda t, m: _check_file(m, _jsonl(t, [{"prompt": 5}])), ConfigError,
             ("data.prompt_column", "row 0 holds 5"), "data.prompt_column"),
    BadInput("data/messages-without-chat_template",
             lambda t, m: _check_file(m, _jsonl(t, [{"prompt": [{"role": "user", "content": "12>"}]}])),
             ConfigError, ("data.chat_template", "True: column 'prompt' holds chat messages"), "data.chat_template"),
    BadInput("data/chat_template-without-template",
             lambda t, m: _check_file(m, _jsonl(t, [{"prompt": "12>"}]), chat_template=True), ConfigError,
             ("data.chat_template", "a model whose tokenizer has a chat template"), "data.chat_template"),
    BadInput("data/every-prompt-over-max_prompt_tokens",
             lambda t, m: _check_file(m, _jsonl(t, [{"prompt": "1234567>"}, {"prompt": "98765>"}]),
                                      max_prompt_tokens=3),
             ConfigError, ("data.max_prompt_tokens", "keeps at least one prompt", "the shortest of 2 has"),
             "data.max_prompt_tokens"),
    # --- rewards (the helper Session.reward calls; RewardError names the function and the problem)
    *[BadInput(f"reward/{name}", lambda t, m, fn=fn, timeout=timeout: _reward(fn, timeout), RewardError, names)
      for name, fn, timeout, names in FAILING_REWARDS],
]  # fmt: skip


def _stderr_text(capsys: pytest.CaptureFixture[str]) -> str:
    """What was written to stderr as one line: tyro's box borders dropped, wrapped lines joined."""
    return " ".join(re.sub(r"[\u2500-\u257f]", " ", capsys.readouterr().err).split())


def test_corpus_has_at_least_forty_distinct_cases() -> None:
    ids = [case.id for case in CORPUS]

    assert len(ids) >= 40
    assert len(set(ids)) == len(ids)


@pytest.mark.parametrize("case", CORPUS, ids=[case.id for case in CORPUS])
def test_bad_input_raises_one_error_naming_the_field_and_what_is_allowed(
    case: BadInput, tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(case.error) as info:
        case.make(tmp_path, tiny_model_dir)

    message = " ".join(f"{info.value} {_stderr_text(capsys)}".split())
    for name in case.names:
        assert name in message, f"{name!r} not in {message!r}"
    if isinstance(info.value, SystemExit):
        assert info.value.code == 2
    if case.field is not None:
        assert isinstance(info.value, ConfigError) and info.value.field == case.field


@pytest.mark.parametrize(
    ("fn", "timeout_s"), [(fn, timeout) for _, fn, timeout, _ in FAILING_REWARDS], ids=[r[0] for r in FAILING_REWARDS]
)
def test_failing_reward_leaves_rollout_intact_and_rewardable_again(fn: Callable[..., Any], timeout_s: float) -> None:
    rollout = _rollout()
    before = (rollout.completions.copy(), rollout.completion_ids_B_C.clone(), rollout.logprobs_B_C.clone())

    with pytest.raises(RewardError):
        asyncio.run(compute_reward_breakdown(rollout, fn, timeout_s=timeout_s))
    rewards_B, _ = asyncio.run(compute_reward_breakdown(rollout, exact))

    assert rollout.rewards_B is None
    assert rollout.completions == before[0]
    torch.testing.assert_close(rollout.completion_ids_B_C, before[1], rtol=0, atol=0)
    torch.testing.assert_close(rollout.logprobs_B_C, before[2], rtol=0, atol=0)
    torch.testing.assert_close(rollout.with_rewards(rewards_B).rewards_B, torch.tensor([1.0, 0.0, 1.0, 0.0]))
