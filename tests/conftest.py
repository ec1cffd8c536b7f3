"""Shared fixtures: a tiny policy built locally (nothing downloads) and a small session config."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from _shm_leaks import ShmLeakTracker

from rlsdk.config import (
    DataConfig,
    LaunchConfig,
    ModelConfig,
    ObserveConfig,
    RolloutConfig,
    SessionConfig,
    TrainConfig,
)

# A user's project with its own conftest and pytest settings; tests/testing/test_example_project.py runs it.
collect_ignore = ["example_project"]


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("RLSDK_ALLOW_SHM_LEAKS") != "1":
        config.pluginmanager.register(ShmLeakTracker(), "rlsdk-shm-leaks")


@pytest.fixture(scope="session", autouse=True)
def private_cache_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The suite signs and verifies checkpoints with a key of its own (``$XDG_CACHE_HOME/rlsdk/checkpoint.key``),
    never the key of the user running it; the ranks and servers the tests start inherit it."""
    cache = tmp_path_factory.mktemp("xdg-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(cache))
        yield cache


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rlsdk.data import build_tiny_policy

    return build_tiny_policy(tmp_path_factory.mktemp("tiny-policy") / "model", seed=0)


@pytest.fixture(scope="session")
def make_small_config(tiny_model_dir: Path) -> Callable[[Path], SessionConfig]:
    """``make_small_config(output_dir)``: the ``small_config`` of a given output directory (for wider-scoped
    fixtures)."""

    def make(output_dir: Path) -> SessionConfig:
        return SessionConfig(
            model=ModelConfig(path=str(tiny_model_dir)),
            launch=LaunchConfig(num_ranks=2, start_timeout_s=120.0, heartbeat_interval_s=0.5, heartbeat_timeout_s=20.0),
            train=TrainConfig(lr=1e-3, micro_batch_size=4),
            rollout=RolloutConfig(group_size=4, max_new_tokens=5),
            data=DataConfig(prompts_per_step=4, num_examples=64),
            observe=ObserveConfig(output_dir=str(output_dir), console=False),
        )

    return make


@pytest.fixture()
def small_config(make_small_config: Callable[[Path], SessionConfig], tmp_path: Path) -> SessionConfig:
    """2 ranks, 4 prompts x 4 samples, short timeouts: a Session that starts in seconds."""
    return make_small_config(tmp_path / "out")
