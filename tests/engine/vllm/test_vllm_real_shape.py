"""A Qwen2.5-0.5B-shaped policy (S2 of the shape ladder, 494M parameters, 151,936-token vocabulary) served by a real
bf16 vLLM server: float32 weights published by the trainer's path reach it, verified, and it generates with them."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


@pytest.mark.timeout(1800)
def test_vllm_bf16_server_syncs_a_half_billion_parameter_policy_and_generates_with_it(tmp_path: Path) -> None:
    import psutil
    import torch
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM

    from rlsdk.data.shapes import SHAPES, build_shape_policy
    from rlsdk.engine.inference.protocol import SamplingParams
    from rlsdk.engine.inference.vllm import VLLMEngine
    from rlsdk.engine.weights import state_dict_checksum

    if psutil.virtual_memory().available < 10 * 2**30:
        pytest.skip("needs ~10 GiB free: a 2 GB float32 policy in this process, its published file and a vLLM server")
    model_dir = build_shape_policy(tmp_path / "S2", "S2", seed=0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():  # "trained" weights: every parameter moved, so a stale load cannot pass
        for param in model.parameters():
            param.add_(1e-3)
    published = Path("/dev/shm") / f"rlsdk-test-s2-{os.getpid()}.safetensors"
    save_model(model, str(published))
    checksum = state_dict_checksum(model.state_dict())
    nbytes = published.stat().st_size
    del model

    async def scenario() -> tuple[object, object, object, float]:
        engine = await VLLMEngine.start(
            str(model_dir), dtype="bfloat16", max_model_len=512, kv_cache_gib=2, start_timeout_s=900.0,
            sync_timeout_s=600.0,
        )  # fmt: skip
        try:
            start = asyncio.get_running_loop().time()
            info = await engine.load_weights(str(published), version=1)
            seconds = asyncio.get_running_loop().time() - start
            result = await engine.generate([[1, 2, 3, 4] * 32] * 4, SamplingParams(max_new_tokens=32, seed=0))
            return info, result, await engine.weight_info(), seconds
        finally:
            await engine.close()

    try:
        info, result, served, seconds = asyncio.run(scenario())
    finally:
        published.unlink(missing_ok=True)

    assert SHAPES["S2"].parameters() * 4 <= nbytes < SHAPES["S2"].parameters() * 4 + 2**20  # float32, tied once
    assert (info.version, info.checksum) == (1, checksum) and (served.version, served.checksum) == (1, checksum)
    assert result.completion_ids_B_C.shape[0] == 4 and result.completion_mask_B_C.sum() > 0
    assert (result.versions_B_C[result.completion_mask_B_C] == 1).all()
    assert seconds < 600
