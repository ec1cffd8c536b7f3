"""Nobody but the Session reaches the vLLM server it started (the suite's real server, see conftest.py): it listens
on a Unix socket in a 0700 directory and on no TCP port, refuses every caller without its token, and loads weights
only from the session's publish directory."""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import os
import socket
import stat
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from rlsdk.engine.inference.vllm_server import http_client

pytestmark = pytest.mark.security

# The suite's LoopSession (see conftest.py): ``.session`` and ``.run(coro)`` on the Session's own event loop.
LoopSession = Any
NOBODY = 65534


def _group(pgid: int) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(process.pid) == pgid:
                found.append(process)
        except (ProcessLookupError, PermissionError):
            continue
    return found


def _tcp_listeners(pids: set[int]) -> list[Any]:
    return [c for c in psutil.net_connections(kind="tcp") if c.pid in pids and c.status == psutil.CONN_LISTEN]


def test_vllm_server_of_a_running_session_listens_on_a_unix_socket_in_a_private_dir_and_on_no_tcp_port(
    vllm_session: LoopSession,
) -> None:
    session = vllm_session.session
    server = session.engine.server
    sampled: list[list[Any]] = []

    async def rollout_while_sampling() -> None:
        rollout = asyncio.ensure_future(session.rollout())
        while not rollout.done():  # the listeners while requests are in flight
            sampled.append(_tcp_listeners({p.pid for p in _group(server.pid)}))
            await asyncio.sleep(0.05)
        await rollout

    vllm_session.run(rollout_while_sampling())

    directory = os.lstat(os.path.dirname(server.socket_path))
    assert server.url == f"unix:{server.socket_path}"
    assert stat.S_ISSOCK(os.lstat(server.socket_path).st_mode)
    assert stat.S_ISDIR(directory.st_mode) and stat.S_IMODE(directory.st_mode) == 0o700
    assert directory.st_uid == os.getuid()
    assert sampled
    for listeners in sampled:
        # The API server (HTTP) and the engine core: no TCP listener at all. vLLM's CPU worker forms gloo groups
        # (world size 1, nobody ever connects) whose transport listens: on loopback only.
        assert not [c for c in listeners if c.pid == server.pid]
        assert all(ipaddress.ip_address(c.laddr.ip).is_loopback for c in listeners), listeners


@pytest.mark.parametrize("token", [None, "not-the-token"])
def test_vllm_server_refuses_weight_loading_and_every_dev_endpoint_to_a_caller_without_its_token(
    vllm_session: LoopSession, vllm_model_dir: Path, token: str | None
) -> None:
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM

    session = vllm_session.session
    engine = session.engine
    before = vllm_session.run(engine.weight_info())
    # Someone else's policy, in the very directory the server loads from: only the token stands in the way.
    model = AutoModelForCausalLM.from_pretrained(vllm_model_dir, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(-1.0)
    swapped = Path(session._run.publish_dir) / "attacker.safetensors"
    save_model(model, str(swapped))
    calls = [
        ("POST", "/collective_rpc", {"method": "rlsdk_load_weights", "kwargs": {"path": str(swapped)}}),
        ("POST", "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(vllm_model_dir)}}),
        ("POST", "/update_weight_version", {"new_version": "999"}),
        ("POST", "/sleep", None),
        ("POST", "/pause", None),
        ("GET", "/is_paused", None),
        ("POST", "/inference/v1/generate", {"model": "policy", "token_ids": [1, 2], "sampling_params": {}}),
        ("POST", "/v1/completions", {"model": "policy", "prompt": [1, 2], "max_tokens": 2}),
    ]

    async def attack() -> list[int]:
        async with http_client(engine.url, token=token, timeout=30.0) as client:
            return [(await client.request(method, path, json=body)).status_code for method, path, body in calls]

    try:
        statuses = vllm_session.run(attack())
    finally:
        swapped.unlink()

    assert statuses == [401] * len(calls)
    assert vllm_session.run(engine.weight_info()) == before
    assert vllm_session.run(engine._get("/is_paused", timeout_s=10)) == {"is_paused": False}


@pytest.mark.skipif(os.getuid() != 0, reason="another user's process needs root to switch uid (setuid)")
def test_vllm_server_socket_cannot_be_connected_to_by_another_user(vllm_session: LoopSession) -> None:
    path = vllm_session.session.engine.server.socket_path
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the other user: drop to nobody, then try the socket
        code = 0
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.connect(path)
        except OSError as exc:
            code = exc.errno or 255
        finally:
            os.write(write_end, str(code).encode())
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        result = int(pipe.read() or "-1")
    os.waitpid(pid, 0)

    assert result == errno.EACCES  # the 0700 directory: connect() never reaches the socket


def test_vllm_worker_refuses_weights_outside_the_publish_dir_even_from_the_session(
    vllm_session: LoopSession, tmp_path: Path
) -> None:
    from safetensors.torch import save_model
    from torch import nn

    session = vllm_session.session
    engine = session.engine
    before = vllm_session.run(engine.weight_info())
    outside = tmp_path / "v1.safetensors"
    save_model(nn.Linear(2, 2), str(outside))
    link = Path(session._run.publish_dir) / "v1000.safetensors"
    link.symlink_to(outside)

    try:
        results = [vllm_session.run(engine._rpc("rlsdk_load_weights", {"path": str(p)}, 30.0)) for p in (outside, link)]
    finally:
        link.unlink()

    for result in results:
        assert len(result) == 1 and "outside" in result[0]["error"]
        assert os.path.realpath(session._run.publish_dir) in result[0]["error"]
    assert vllm_session.run(engine.weight_info()) == before
