"""The parts of the vLLM engine that need no vLLM: config, server command line, checksum of published weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from rlsdk.config import ConfigError, InferenceConfig, SessionConfig, VLLMConfig, config_from_dict, config_to_dict


def test_inference_config_accepts_vllm_with_server_options_and_round_trips_through_dict() -> None:
    vllm = VLLMConfig(kv_cache_gib=2, max_model_len=64, extra_server_args=["--seed", "1"])  # type: ignore[arg-type]
    config = InferenceConfig(engine="vllm", vllm=vllm)

    assert config.vllm.extra_server_args == ("--seed", "1")
    restored = config_from_dict(SessionConfig, {"model": {"path": "m"}, "inference": config_to_dict(config)})
    assert restored.inference == config


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"engine": "vllm", "vllm": {"url": "127.0.0.1:8000"}}, "inference.vllm.url"),
        ({"engine": "embedded", "vllm": {"url": "http://127.0.0.1:8000"}}, "inference.vllm.url"),
        ({"engine": "vllm", "vllm": {"kv_cache_gib": 0}}, "inference.vllm.kv_cache_gib"),
        ({"engine": "vllm", "vllm": {"max_model_len": 0}}, "inference.vllm.max_model_len"),
        ({"engine": "vllm", "vllm": {"sync_timeout_s": 0.0}}, "inference.vllm.sync_timeout_s"),
        ({"logprob_warn_threshold": 0.0}, "inference.logprob_warn_threshold"),
        ({"vllm": {"extra_server_args": ["--seed", 1]}}, "inference.vllm.extra_server_args"),
        ({"engine": "sglang"}, "inference.engine"),
    ],
)
def test_inference_config_with_bad_value_raises_config_error_naming_the_field(data: dict, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict(SessionConfig, {"model": {"path": "m"}, "inference": data})

    assert info.value.field == field


def test_server_command_serves_fp32_token_in_out_with_rlsdk_worker_extension() -> None:
    from rlsdk.engine.inference.vllm_server import WORKER_EXTENSION, server_command, server_environment

    cmd = server_command("/m", 1234, max_model_len=64, extra_args=["--seed", "1"])
    env = server_environment({"PATH": "/bin"}, kv_cache_gib=3)

    assert cmd[1:3] == ["-m", "rlsdk.launch.pdeathsig"]
    assert "vllm.entrypoints.openai.api_server" in cmd
    for flag in ("--no-enable-chunked-prefill", "--enforce-eager", "--enable-scale-out"):
        assert flag in cmd
    for flag, value in (("--dtype", "float32"), ("--host", "127.0.0.1"), ("--port", "1234"),
                        ("--max-model-len", "64"), ("--logprobs-mode", "processed_logprobs"),
                        ("--worker-extension-cls", WORKER_EXTENSION)):  # fmt: skip
        assert cmd[cmd.index(flag) + 1] == value
    assert cmd[-2:] == ["--seed", "1"]
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert env["HF_HUB_OFFLINE"] == "1" and env["VLLM_NO_USAGE_STATS"] == "1" and env["PATH"] == "/bin"


def test_published_weights_checksum_in_the_server_equals_the_trainers_state_dict_checksum_with_tied_weights(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM

    from rlsdk.engine.inference.vllm_worker import read_published_weights
    from rlsdk.engine.weights import state_dict_checksum

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    path = tmp_path / "v1.safetensors"
    save_model(model, str(path))  # stores one of the tied embedding/lm_head names, the other in its metadata

    tensors, state_dict = read_published_weights(str(path))

    assert len(tensors) == len(model.state_dict()) - 1
    assert set(state_dict) == set(model.state_dict())
    assert state_dict_checksum(state_dict) == state_dict_checksum(model.state_dict())


def test_cpu_head_size_check_rejects_the_default_tiny_policy_and_names_the_fix(tiny_model_dir: Path) -> None:
    from rlsdk.engine.inference.vllm import check_cpu_head_size

    head_dim = json.loads((tiny_model_dir / "config.json").read_text())["hidden_size"] // 4

    with pytest.raises(ValueError, match=rf"head_dim={head_dim}.*num_heads=2"):
        check_cpu_head_size(tiny_model_dir)


def test_session_start_with_vllm_and_an_unsupported_head_size_raises_config_error_before_any_process(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import asyncio
    import os

    import psutil

    import rlsdk.engine.inference.vllm as vllm_engine
    from rlsdk.config import ModelConfig, ObserveConfig
    from rlsdk.session import Session

    monkeypatch.setattr(vllm_engine, "_cuda_available", lambda: False)  # the check is the CPU server's
    config = SessionConfig(
        model=ModelConfig(path=str(tiny_model_dir)),
        inference=InferenceConfig(engine="vllm"),
        observe=ObserveConfig(output_dir=str(tmp_path / "out")),
    )
    children_before = {p.pid for p in psutil.Process(os.getpid()).children(recursive=True)}

    with pytest.raises(ConfigError) as info:
        asyncio.run(Session.start(config))

    assert info.value.field == "model.path"
    assert "head_dim=16" in str(info.value) and "num_heads=2" in str(info.value)
    assert {p.pid for p in psutil.Process(os.getpid()).children(recursive=True)} <= children_before


def test_server_command_serves_the_dtype_it_is_told() -> None:
    from rlsdk.engine.inference.vllm_server import server_command

    cmd = server_command("/m", 1234, dtype="bfloat16")

    assert cmd[cmd.index("--dtype") + 1] == "bfloat16"


def test_session_config_with_vllm_inplace_transfer_and_another_served_dtype_raises_naming_inference_dtype() -> None:
    from rlsdk.config import ModelConfig

    SessionConfig(model=ModelConfig(path="m", dtype="bfloat16"), inference=InferenceConfig(engine="vllm"))  # allowed
    with pytest.raises(ConfigError) as info:
        SessionConfig(
            model=ModelConfig(path="m"),
            inference=InferenceConfig(engine="vllm", dtype="bfloat16", vllm=VLLMConfig(weight_transfer="inplace")),
        )

    assert info.value.field == "inference.dtype" and "inplace" in str(info.value)


def _failed_sync(handler: Any, version: int, sync_timeout_s: float) -> Any:
    """Run ``VLLMEngine.load_weights`` of ``/dev/shm/v{version}.safetensors`` against a mock server answering with
    ``handler``; return the ``WeightSyncError`` it must raise."""
    import asyncio

    httpx = pytest.importorskip("httpx", reason="httpx comes with the vllm extra")
    from rlsdk.engine.inference.vllm import VLLMEngine, WeightSyncError

    async def scenario() -> WeightSyncError:
        engine = VLLMEngine("http://127.0.0.1:9", pad_token_id=0, sync_timeout_s=sync_timeout_s)
        engine._client = httpx.AsyncClient(base_url=engine.url, transport=httpx.MockTransport(handler))
        try:
            with pytest.raises(WeightSyncError) as info:
                await engine.load_weights(f"/dev/shm/v{version}.safetensors", version)
        finally:
            await engine.close()
        return info.value

    return asyncio.run(scenario())


def test_vllm_sync_that_times_out_raises_naming_version_server_and_cause_and_still_resumes() -> None:
    httpx = pytest.importorskip("httpx", reason="httpx comes with the vllm extra")

    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if request.url.path == "/collective_rpc":
            raise httpx.ReadTimeout("no answer", request=request)
        return httpx.Response(200, json={})

    error = _failed_sync(handler, 7, sync_timeout_s=0.5)

    assert "v7" in str(error) and "http://127.0.0.1:9" in str(error) and "timed out" in str(error)
    # Paused at level-0 sleep (vLLM's /pause adds a fixed 20 ms sleep), the prefix cache reset alongside the
    # transfer, then resumed: /wake_up did not answer "awake", so /resume too.
    assert calls[0] == "/sleep" and sorted(calls[1:3]) == ["/collective_rpc", "/reset_prefix_cache"]
    assert calls[3:] == ["/wake_up", "/resume"]


def test_vllm_sync_whose_prefix_cache_reset_fails_raises_naming_the_step_and_resumes_without_a_new_version() -> None:
    httpx = pytest.importorskip("httpx", reason="httpx comes with the vllm extra")

    calls: list[str] = []
    checksum = "blake3:" + "a" * 64

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if request.url.path == "/collective_rpc":
            return httpx.Response(200, json={"results": [{"checksum": checksum, "bytes": 8}]})
        if request.url.path == "/reset_prefix_cache":
            return httpx.Response(200, json={"success": False})
        if request.url.path == "/wake_up":
            return httpx.Response(200, json={"status": "awake", "tags": ["scheduling"]})
        return httpx.Response(200, json={})

    error = _failed_sync(handler, 3, sync_timeout_s=5.0)

    assert "v3" in str(error) and "reset_prefix_cache" in str(error) and "success" in str(error)
    assert "/update_weight_version" not in calls and calls[-1] == "/wake_up"


def test_request_seeds_of_consecutive_rollouts_do_not_share_sample_streams() -> None:
    from rlsdk.engine.inference.vllm import request_seed

    group, groups, rollouts = 16, 16, 50
    streams = [
        {request_seed(seed, g * group) + i for g in range(groups) for i in range(group)}
        for seed in range(1000, 1000 + rollouts)
    ]  # vLLM seeds sample i of a request with request seed + i

    assert all(len(stream) == group * groups for stream in streams)  # distinct within a rollout
    assert len(set().union(*streams)) == group * groups * rollouts  # and across rollouts
    assert all(0 <= request_seed(s, r) < 2**63 for s in (0, 2**62, -5) for r in (0, 1, 255))
    assert request_seed(7, 16) == request_seed(7, 16)


def test_shm_leftovers_of_a_killed_process_tree_are_removed_and_unrelated_files_kept(tmp_path: Path) -> None:
    import os
    import signal
    import subprocess
    import sys
    import time

    from rlsdk.engine.inference.vllm_server import ShmLeftovers

    used, held, unrelated = tmp_path / "psm_used", tmp_path / "psm_held", tmp_path / "psm_other"
    unrelated.write_bytes(b"x" * 4096)
    # A child maps one file (as vLLM's engine core maps its queues) and its grandchild holds another open.
    grandchild = f"import time\nf = open({str(held)!r}, 'wb')\ntime.sleep(60)\n"
    script = tmp_path / "child.py"
    script.write_text(
        "import mmap, subprocess, sys, time\n"
        f"f = open({str(used)!r}, 'w+b')\nf.write(b'0' * 4096)\nf.flush()\n"
        "m = mmap.mmap(f.fileno(), 4096)\n"
        f"subprocess.Popen([sys.executable, '-c', {grandchild!r}])\n"
        "print('ready', flush=True)\ntime.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, start_new_session=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
    leftovers = ShmLeftovers(root=str(tmp_path))
    deadline = time.monotonic() + 10
    while len(leftovers.paths) < 2 and time.monotonic() < deadline:
        leftovers.record(proc.pid)
        time.sleep(0.05)

    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    removed = leftovers.remove()

    assert sorted(removed) == sorted([str(used), str(held)])
    assert not used.exists() and unrelated.exists()


def _recorded_engine(handler: Any, **kwargs: Any) -> Any:
    """A VLLMEngine whose HTTP client answers with ``handler`` (no server)."""
    httpx = pytest.importorskip("httpx", reason="httpx comes with the vllm extra")
    from rlsdk.engine.inference.vllm import VLLMEngine

    engine = VLLMEngine("http://127.0.0.1:9", pad_token_id=0, sync_timeout_s=5.0, **kwargs)
    engine._client = httpx.AsyncClient(base_url=engine.url, transport=httpx.MockTransport(handler))
    return engine


def test_vllm_engine_sharing_the_gpu_sleeps_before_an_update_and_wakes_before_the_next_sync() -> None:
    import asyncio

    httpx = pytest.importorskip("httpx", reason="httpx comes with the vllm extra")
    calls: list[tuple[str, str]] = []
    checksum = "xxh3:" + "a" * 32

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append((request.url.path, str(request.url.query, "ascii")))
        if request.url.path == "/collective_rpc":
            return httpx.Response(200, json={"results": [{"checksum": checksum, "bytes": 8}]})
        if request.url.path == "/wake_up":
            return httpx.Response(200, json={"status": "awake"})
        return httpx.Response(200, json={})

    async def scenario() -> None:
        engine = _recorded_engine(handler, sleep_during_train=True)
        try:
            await engine.prepare_train()
            await engine.prepare_train()  # already asleep: no second request
            calls.append(("-- update --", ""))
            await engine.load_weights("/dev/shm/v1.safetensors", 1)
        finally:
            await engine.close()

    # Act
    asyncio.run(scenario())

    # Assert: level-1 sleep (weights to host, KV cache freed) once, then a full wake-up before the sync's own
    # level-0 pause
    paths = [path for path, _ in calls]
    assert calls[0] == ("/sleep", "level=1&mode=wait")
    assert paths[1:3] == ["-- update --", "/wake_up"] and calls[2][1] == ""
    assert calls[3] == ("/sleep", "level=0&mode=wait")


def test_vllm_engine_without_a_shared_gpu_sends_nothing_before_an_update() -> None:
    import asyncio

    httpx = pytest.importorskip("httpx", reason="httpx comes with the vllm extra")
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        return httpx.Response(200, json={})

    async def scenario() -> int:
        engine = _recorded_engine(handler)
        try:
            await engine.prepare_train()
            return engine.sleeps
        finally:
            await engine.close()

    assert asyncio.run(scenario()) == 0 and calls == []


def test_vllm_engine_whose_server_does_not_sleep_raises_naming_the_server() -> None:
    import asyncio

    httpx = pytest.importorskip("httpx", reason="httpx comes with the vllm extra")

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(404, text="Not Found")  # started without --enable-sleep-mode / dev mode

    async def scenario() -> None:
        engine = _recorded_engine(handler, sleep_during_train=True)
        try:
            await engine.prepare_train()
        finally:
            await engine.close()

    with pytest.raises(RuntimeError, match=r"vLLM server at http://127\.0\.0\.1:9 did not go to sleep.*HTTP 404"):
        asyncio.run(scenario())
