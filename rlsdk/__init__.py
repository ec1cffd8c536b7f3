"""rlsdk: an interactive research SDK for distributed RL post-training of language models.

``import rlsdk`` defines things and starts nothing: no process, no process group, no heavy import. The public
API below is imported on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_PUBLIC = {
    "Session": "rlsdk.session",
    "SessionConfig": "rlsdk.config",
    "ModelConfig": "rlsdk.config",
    "LaunchConfig": "rlsdk.config",
    "SlurmConfig": "rlsdk.config",
    "RayConfig": "rlsdk.config",
    "InferenceConfig": "rlsdk.config",
    "EmbeddedConfig": "rlsdk.config",
    "VLLMConfig": "rlsdk.config",
    "ColocatedConfig": "rlsdk.config",
    "TrainConfig": "rlsdk.config",
    "AlgorithmConfig": "rlsdk.config",
    "RolloutConfig": "rlsdk.config",
    "DataConfig": "rlsdk.config",
    "ObserveConfig": "rlsdk.config",
    "ConfigError": "rlsdk.config",
    "load_config": "rlsdk.config",
    "Rollout": "rlsdk.workflow.rollout",
    "SamplingParams": "rlsdk.generation.params",
    "InferenceEngine": "rlsdk.engine.inference.protocol",
    "RolloutWorkflow": "rlsdk.workflow.single_turn",
    "RankError": "rlsdk.control.controller",
    "RewardError": "rlsdk.rewards.apply",
    "StaleRolloutError": "rlsdk.versioning",
    "WeightMismatchError": "rlsdk.versioning",
    "VersionLedger": "rlsdk.versioning",
    "InferenceServerError": "rlsdk.engine.inference.vllm_server",
    "WeightSyncError": "rlsdk.engine.inference.vllm",
    "CollectiveHangError": "rlsdk.debug.watchdog",
    "SessionClosedError": "rlsdk.session",
    "RankProcessError": "rlsdk.launch.supervised",
    "RankUnresponsiveError": "rlsdk.control.errors",
}

__all__ = sorted(_PUBLIC)

if TYPE_CHECKING:
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
        load_config,
    )
    from rlsdk.control.controller import RankError
    from rlsdk.control.errors import RankUnresponsiveError
    from rlsdk.debug.watchdog import CollectiveHangError
    from rlsdk.engine.inference.protocol import InferenceEngine
    from rlsdk.engine.inference.vllm import WeightSyncError
    from rlsdk.engine.inference.vllm_server import InferenceServerError
    from rlsdk.generation.params import SamplingParams
    from rlsdk.launch.supervised import RankProcessError
    from rlsdk.rewards.apply import RewardError
    from rlsdk.session import Session, SessionClosedError
    from rlsdk.versioning import StaleRolloutError, VersionLedger, WeightMismatchError
    from rlsdk.workflow.rollout import Rollout
    from rlsdk.workflow.single_turn import RolloutWorkflow


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'rlsdk' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])
