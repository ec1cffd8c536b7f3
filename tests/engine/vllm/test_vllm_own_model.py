"""The scripted Llama (no pad token, three EOS ids) through a Session on a real vLLM server: the same scenario
as tests/session/test_own_model.py on the embedded and colocated engines, the same expected tokens, texts and
finish reasons (vLLM stops on every EOS id passed as stop_token_ids, and on the stop string)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from rlsdk import Session
from rlsdk.testing.llama import build_llama_policy, check_stop_scenario, run_stop_scenario, stop_scenario_config


def test_vllm_session_own_llama_without_pad_stops_at_each_eos_id_and_at_stop_string(tmp_path: Path) -> None:
    model_dir = build_llama_policy(tmp_path / "model")  # head_dim 64 / 2 = 32: served by vLLM's CPU attention
    config = stop_scenario_config(model_dir, tmp_path / "out", "vllm")

    async def scenario() -> dict:
        async with await Session.start(config) as session:
            return await run_stop_scenario(session)

    out = asyncio.run(scenario())

    check_stop_scenario(out)
