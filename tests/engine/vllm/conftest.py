"""One real vLLM server for the whole suite: a Session with ``inference.engine='vllm'`` on its own event loop.

Every test in this folder is marked ``vllm`` and skips, with the import error as the reason, where vLLM is not
installed (``pip install -e '.[vllm]'``, see docs/howto/vllm.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from rlsdk.config import (
    DataConfig,
    InferenceConfig,
    LaunchConfig,
    ModelConfig,
    ObserveConfig,
    RolloutConfig,
    SessionConfig,
    TrainConfig,
    VLLMConfig,
)

_T = TypeVar("_T")


def vllm_import_error() -> str | None:
    """Why ``import vllm`` fails here (None when it works). Tried in a subprocess: importing vLLM changes
    process-wide state (logging, environment) that the rest of the test run should not inherit."""
    import importlib.util
    import subprocess
    import sys

    spec = importlib.util.find_spec("vllm")
    # This test folder is itself named vllm: without vLLM installed it can look like a namespace package.
    if spec is None or spec.origin in (None, "namespace"):
        return "ModuleNotFoundError: No module named 'vllm'"
    proc = subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:  # e.g. the torchvision operator error of an install that kept the CUDA packages
        lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
        return lines[-1] if lines else f"exit code {proc.returncode}"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    ours = [item for item in items if here in Path(str(item.fspath)).parents]
    if not ours:
        return
    error = vllm_import_error()
    for item in ours:
        item.add_marker(pytest.mark.vllm)
        if error is not None:
            item.add_marker(pytest.mark.skip(reason=f"vllm: `import vllm` failed ({error}); install the vllm extra"))


class LoopSession:
    """A Session on a dedicated event loop that outlives each test; ``run(coro)`` runs a coroutine on it."""

    def __init__(self, config: SessionConfig) -> None:
        from rlsdk import Session

        self.loop = asyncio.new_event_loop()
        self.session = self.run(Session.start(config))

    def run(self, coro: Coroutine[Any, Any, _T], timeout_s: float = 600.0) -> _T:
        return self.loop.run_until_complete(asyncio.wait_for(coro, timeout_s))

    def close(self) -> None:
        try:
            self.run(self.session.close())
        finally:
            self.loop.close()


@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rlsdk.data import build_tiny_policy

    # head_dim 32: vLLM's CPU attention has no kernel for the default tiny policy's head_dim 16.
    return build_tiny_policy(tmp_path_factory.mktemp("tiny-policy-vllm") / "model", seed=0, num_heads=2)


@pytest.fixture(scope="session")
def vllm_config(vllm_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> SessionConfig:
    return SessionConfig(
        model=ModelConfig(path=str(vllm_model_dir)),
        launch=LaunchConfig(num_ranks=2, start_timeout_s=300.0, heartbeat_interval_s=0.5, heartbeat_timeout_s=30.0),
        inference=InferenceConfig(engine="vllm", vllm=VLLMConfig(server_start_timeout_s=300.0, sync_timeout_s=60.0)),
        train=TrainConfig(lr=1e-3, micro_batch_size=16),
        rollout=RolloutConfig(group_size=4, max_new_tokens=5),
        data=DataConfig(prompts_per_step=4, num_examples=64),
        observe=ObserveConfig(output_dir=str(tmp_path_factory.mktemp("vllm-session") / "out"), console=False),
    )


@pytest.fixture(scope="session")
def vllm_session(vllm_config: SessionConfig) -> Iterator[LoopSession]:
    """The suite's one Session (2 gloo ranks + one vLLM server), started once and closed at the end."""
    handle = LoopSession(vllm_config)
    try:
        yield handle
    finally:
        handle.close()


@pytest.fixture(scope="module")
def vllm_lora_session(vllm_config: SessionConfig, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoopSession]:
    """A LoRA run's Session (``train.lora_rank=8``): its server is started with ``--enable-lora``, so it is not
    the suite's shared one; module-scoped, so its ~3 GB are held only while the module that uses it runs."""
    import dataclasses

    config = dataclasses.replace(
        vllm_config,
        # a large learning rate: a few updates move the adapter's policy well away from the base's
        train=dataclasses.replace(vllm_config.train, lora_rank=8, lora_alpha=32.0, lr=2e-2),
        observe=dataclasses.replace(vllm_config.observe, output_dir=str(tmp_path_factory.mktemp("lora") / "out")),
    )
    handle = LoopSession(config)
    try:
        yield handle
    finally:
        handle.close()
