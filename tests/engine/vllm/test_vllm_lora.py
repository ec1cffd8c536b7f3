"""LoRA on a real vLLM server: a sync loads only the trainer's adapter, verified by checksum, and vLLM serves it.

The suite's shared server serves full weights; a LoRA run needs a server started with ``--enable-lora``, so this
module uses its own Session (``vllm_lora_session``: one more server while this module runs, closed at its end).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from rlsdk.rewards import reverse_reward

pytest.importorskip("peft", reason="LoRA needs peft: install the lora extra")

# The suite's LoopSession (see conftest.py): ``.session`` and ``.run(coro)`` on the Session's own event loop.
LoopSession = Any


def _base_logprobs(model_dir: Path, rollout: object) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    from rlsdk.algorithms import completion_logprobs

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        logprobs_B_C, _ = completion_logprobs(
            model,
            rollout.prompt_ids_B_P,  # type: ignore[attr-defined]
            rollout.prompt_mask_B_P,  # type: ignore[attr-defined]
            rollout.completion_ids_B_C,  # type: ignore[attr-defined]
            rollout.completion_mask_B_C,  # type: ignore[attr-defined]
        )
    return logprobs_B_C


def test_vllm_lora_sync_loads_only_the_adapter_verified_by_checksum_and_serves_it(
    vllm_lora_session: LoopSession, vllm_model_dir: Path
) -> None:
    session = vllm_lora_session.session

    async def steps(count: int) -> list[dict[str, float]]:
        stats = []
        for _ in range(count):
            rollout = await session.reward(await session.rollout(), reverse_reward)
            stats.append(await session.update(rollout))
            await session.sync_weights()
        return stats

    vllm_lora_session.run(steps(3))
    last_sync = dict(session.engine.last_sync)
    trainer = vllm_lora_session.run(session.call("weight_info"))[0]
    served = vllm_lora_session.run(session.engine.weight_info())
    ledger_checksum = session.versions.engine_checksum
    rollout = vllm_lora_session.run(session.rollout())
    rollout = vllm_lora_session.run(session.reward(rollout, reverse_reward))
    stats = vllm_lora_session.run(session.update(rollout))
    vllm_lora_session.run(session.sync_weights())

    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(vllm_model_dir)
    full_bytes = sum(t.numel() * t.element_size() for t in base.state_dict().values())
    linears = [m for name, m in base.model.layers.named_modules() if isinstance(m, torch.nn.Linear)]
    # fp32 lora_A (r x in) and lora_B (out x r) of every linear of the decoder layers, nothing else
    assert last_sync["bytes"] == sum(8 * (m.in_features + m.out_features) * 4 for m in linears)
    assert last_sync["bytes"] * 5 < full_bytes
    # the engine's checksum is the worker's, of the adapter it loaded, and equals the trainer's
    assert served.version == trainer["version"] == 3
    assert served.checksum == trainer["checksum"] == ledger_checksum
    # vLLM samples with the adapter: its logprobs are the trainer's (base + adapter), not the base model's
    mask_B_C = rollout.completion_mask_B_C
    base_diff_B_C = (_base_logprobs(vllm_model_dir, rollout) - rollout.logprobs_B_C).abs() * mask_B_C
    assert float(base_diff_B_C.sum() / mask_B_C.sum()) > 1e-2
    assert stats["agreement/logprob_absdiff_max"] < 1e-4


def test_vllm_lora_engine_reports_the_checksum_of_the_adapter_it_loaded_not_the_published_one(
    vllm_lora_session: LoopSession, tmp_path: Path
) -> None:
    from safetensors.torch import load_file, save_file

    from rlsdk.engine.lora import ADAPTER_WEIGHTS

    session = vllm_lora_session.session
    version = session.versions.trainer_version
    results = vllm_lora_session.run(session.call("export_weights", {"publish_dir": str(tmp_path / "pub"), "src": 0}))
    good = Path(results[0]["path"])
    tampered = tmp_path / "tampered"
    shutil.copytree(good, tampered)
    tensors = load_file(str(tampered / ADAPTER_WEIGHTS))
    name = sorted(k for k in tensors if "lora_B" in k)[0]
    tensors[name] = tensors[name] + 0.5
    save_file(tensors, str(tampered / ADAPTER_WEIGHTS), metadata={"format": "pt"})

    info = vllm_lora_session.run(session.engine.load_weights(str(tampered), version))
    restored = vllm_lora_session.run(session.engine.load_weights(str(good), version))

    assert info.checksum != results[0]["checksum"]
    assert restored.checksum == results[0]["checksum"] == session.versions.engine_checksum
