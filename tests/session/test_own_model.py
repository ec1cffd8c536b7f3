"""A Llama-architecture model with a locally trained byte-level BPE tokenizer, no pad token and three EOS ids,
through a real Session on the embedded and colocated engines (the vLLM suite runs the same scenario): generation
stops at each EOS id and at a stop string, identically; the update and sync run without error."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from rlsdk import Session
from rlsdk.testing.llama import build_llama_policy, check_stop_scenario, run_stop_scenario, stop_scenario_config

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_llama_policy(tmp_path_factory.mktemp("llama") / "model")


@pytest.mark.parametrize("engine", ["embedded", "colocated"])
def test_session_own_llama_without_pad_stops_at_each_eos_id_and_at_stop_string(
    llama_dir: Path, tmp_path: Path, engine: str
) -> None:
    config = stop_scenario_config(llama_dir, tmp_path / "out", engine)

    async def scenario() -> dict:
        async with await Session.start(config) as session:
            return await run_stop_scenario(session)

    out = asyncio.run(scenario())

    check_stop_scenario(out)
