"""Adding an inference engine is one module and one registration: a test-only "replay" engine, registered from
this test through rlsdk.engine.inference.register_engine, runs a real Session (real gloo ranks) that knows nothing
of it. It answers each generation with the one a recording run sampled for the same prompts and params, and a
weight sync reaches it as any engine's: the trainer publishes, it loads, the Session verifies version and checksum.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch

from rlsdk import Session, SessionConfig
from rlsdk.engine.inference import EngineContext, EngineLifecycle, EngineSpec, register_engine
from rlsdk.engine.inference.protocol import GenerateResult, SamplingParams, WeightInfo
from rlsdk.rewards import reverse_reward

pytestmark = pytest.mark.distributed

Request = tuple[tuple[tuple[int, ...], ...], SamplingParams]


def _request(prompt_ids: Sequence[Sequence[int]], params: SamplingParams) -> Request:
    return tuple(tuple(int(t) for t in ids) for ids in prompt_ids), params


class ReplayEngine(EngineLifecycle):
    """Returns recorded generations (keyed by prompts and params); loads published weights to checksum them."""

    def __init__(self, recording: dict[Request, GenerateResult]) -> None:
        self.recording = recording
        self.replayed = 0
        self.version, self.checksum = 0, ""

    async def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams) -> GenerateResult:
        recorded = self.recording[_request(prompt_ids, params)]  # KeyError: a request the recording never saw
        self.replayed += 1
        mask_B_C = recorded.completion_mask_B_C
        return dataclasses.replace(recorded, versions_B_C=torch.where(mask_B_C, self.version, -1))

    async def load_weights(self, path: str, version: int) -> WeightInfo:
        from rlsdk.engine.inference.vllm_worker import read_published_weights
        from rlsdk.engine.weights import state_dict_checksum

        _, state_dict = await asyncio.to_thread(read_published_weights, path)
        self.version, self.checksum = version, state_dict_checksum(state_dict)
        return WeightInfo(self.version, self.checksum)

    async def weight_info(self) -> WeightInfo:
        return WeightInfo(self.version, self.checksum)

    async def close(self) -> None:
        return None


@pytest.fixture()
def use_engine() -> Iterator[Callable[[Callable[[EngineContext], Any]], None]]:
    """``use_engine(builder)``: the Session builds ``inference.engine='embedded'`` with ``builder`` until the test
    ends. (A new engine name must also be a choice of ``InferenceConfig.engine``, which the ranks validate.)"""
    replaced: list[EngineSpec] = []

    def use(builder: Callable[[EngineContext], Any]) -> None:
        previous = register_engine("embedded", builder, replace=True)
        assert previous is not None
        replaced.append(previous)

    yield use
    for previous in reversed(replaced):
        register_engine(previous.name, previous.builder, preflight=previous.preflight, replace=True)


async def _one_step(config: SessionConfig) -> dict[str, Any]:
    async with await Session.start(config) as session:
        out: dict[str, Any] = {"start": (session.versions.engine_version, session.versions.trainer_checksum)}
        rollout = await session.rollout()
        stats = await session.update(await session.reward(rollout, reverse_reward))
        out.update(
            engine=session.engine,
            ids=rollout.completion_ids_B_C,
            logprobs=rollout.logprobs_B_C,
            versions=rollout.versions,
            loss=stats["train/loss"],
            info=await session.sync_weights(),
            trainer_checksum=session.versions.trainer_checksum,
        )
        return out


def test_replay_engine_registered_from_a_test_runs_a_session_step_and_its_sync_is_verified_by_checksum(
    small_config: SessionConfig, use_engine: Callable[[Callable[[EngineContext], Any]], None]
) -> None:
    # Arrange: a recording run with the real embedded engine, every generation kept.
    from rlsdk.engine.inference.embedded import EmbeddedEngine

    recording: dict[Request, GenerateResult] = {}

    async def recording_engine(context: EngineContext) -> Any:
        engine = await EmbeddedEngine.build(context)
        sample = engine.generate

        async def generate(prompt_ids: Sequence[Sequence[int]], params: SamplingParams) -> GenerateResult:
            recording[_request(prompt_ids, params)] = result = await sample(prompt_ids, params)
            return result

        engine.generate = generate  # type: ignore[method-assign]
        return engine

    async def replay_engine(context: EngineContext) -> Any:
        return ReplayEngine(recording)

    def run(builder: Callable[[EngineContext], Any], name: str) -> dict[str, Any]:
        use_engine(builder)
        observe = dataclasses.replace(small_config.observe, output_dir=f"{small_config.observe.output_dir}-{name}")
        return asyncio.run(_one_step(dataclasses.replace(small_config, observe=observe)))

    recorded = run(recording_engine, "record")

    # Act: the same configuration (same prompts, same seeds) on the replay engine.
    replayed = run(replay_engine, "replay")

    # Assert
    engine = replayed["engine"]
    assert isinstance(engine, ReplayEngine) and engine.replayed == 1 and len(recording) == 1
    torch.testing.assert_close(replayed["ids"], recorded["ids"], rtol=0, atol=0)
    torch.testing.assert_close(replayed["logprobs"], recorded["logprobs"], rtol=0, atol=0)
    # Its v0 came by a sync (it loaded nothing of its own), verified against the trainer's checksum.
    assert replayed["start"] == (0, recorded["start"][1])
    assert replayed["versions"] == [0]
    # The same batch trained the same initial weights: the same loss and v1; the engine serves v1, verified.
    assert replayed["loss"] == pytest.approx(recorded["loss"], rel=1e-6, abs=1e-9)
    assert (replayed["info"].version, replayed["info"].checksum) == (1, replayed["trainer_checksum"])
    assert (engine.version, engine.checksum) == (1, replayed["trainer_checksum"])
    assert replayed["info"].bytes is not None and replayed["info"].bytes > 0


def test_register_engine_under_a_taken_name_without_replace_raises_naming_it() -> None:
    async def builder(context: EngineContext) -> Any:
        raise AssertionError("never built")

    with pytest.raises(ValueError, match="'embedded' is registered already"):
        register_engine("embedded", builder)
