"""vLLM replicas on Slurm nodes of their own: the endpoint hand-back through the fake Slurm with a stand-in server
(a real vLLM server starts too slowly for CI), the replica spec start_launcher builds, and the one-replica limit."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sys
import textwrap
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import pytest

from rlsdk import SessionConfig
from rlsdk.config import ConfigError, InferenceConfig, LaunchConfig
from rlsdk.engine.inference.factory import replica_server
from rlsdk.launch import slurm
from rlsdk.launch.select import start_launcher
from rlsdk.launch.slurm import SlurmLauncher, VllmReplicaSpec, endpoint_path
from rlsdk.testing.fake_slurm import install_fake_slurm

# Stands in for `python -m vllm.entrypoints.openai.api_server`: takes the --host/--port the replica wrapper
# appends, answers GET /health after a short start-up, or exits at once with --die. Like rlsdk's token middleware,
# every other path answers 200 only with `Authorization: Bearer $VLLM_API_KEY`, else 401.
FAKE_SERVER = textwrap.dedent(
    """
    import argparse, http.server, os, sys, time

    parser = argparse.ArgumentParser()
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    parser.add_argument("--die", action="store_true")
    args, _ = parser.parse_known_args()
    if args.die:
        print("fake vllm: cannot load the model", flush=True)
        sys.exit(3)
    time.sleep(0.5)

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            token = os.environ.get("VLLM_API_KEY")
            authorized = bool(token) and self.headers.get("Authorization") == f"Bearer {token}"
            self.send_response(200 if self.path == "/health" or authorized else 401)
            self.end_headers()

        def log_message(self, *args):
            pass

    http.server.HTTPServer((args.host, args.port), Health).serve_forever()
    """
)

LAUNCH = LaunchConfig(scheduler="slurm", num_nodes=2, num_ranks=2, simulate_nodes_on_loopback=True)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _fake_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *server_args: str) -> tuple[Path, VllmReplicaSpec]:
    bin_dir = install_fake_slurm(tmp_path / "fake-slurm-bin")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    # The train step is not under test here: each "node" just waits to be cancelled.
    monkeypatch.setattr(slurm, "node_command", lambda spec, machine_rank_var="SLURM_NODEID": "exec sleep 300")
    server = tmp_path / "fake_vllm_server.py"
    server.write_text(FAKE_SERVER)
    job_dir = tmp_path / "out" / "launch" / "slurm"
    replica = VllmReplicaSpec(
        replicas=1,
        server_command=(sys.executable, str(server), *server_args),
        endpoint_dir=str(job_dir / slurm.ENDPOINTS_DIR),
        start_timeout_s=30.0,
    )
    return job_dir, replica


def test_slurm_job_with_a_vllm_replica_hands_its_healthy_endpoint_back_and_stop_ends_the_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job_dir, replica = _fake_cluster(tmp_path, monkeypatch)

    async def scenario() -> dict[str, Any]:
        launcher = await SlurmLauncher.start(LAUNCH, dict(os.environ), job_dir=job_dir, vllm=replica)
        try:
            url = await launcher.wait_for_endpoint(0, timeout_s=60.0)
            with urllib.request.urlopen(f"{url}/health", timeout=5.0) as response:
                status = response.status
            record = json.loads(endpoint_path(replica.endpoint_dir, 0).read_text())
        finally:
            await launcher.stop(grace_s=5.0)
        return {"url": url, "status": status, "record": record, "replicas": launcher.vllm_replicas}

    out = asyncio.run(scenario())

    assert out["url"] == f"http://127.0.0.1:{out['record']['port']}"
    assert out["status"] == 200
    assert out["record"]["job_id"] == "1000" and out["record"]["replica"] == 0
    assert out["replicas"] == 1
    assert "#SBATCH --nodes=3" in (job_dir / "train.sbatch").read_text()
    assert not _alive(out["record"]["pid"])


@pytest.mark.security
def test_slurm_vllm_replica_gets_the_jobs_token_through_its_environment_and_never_in_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job_dir, replica = _fake_cluster(tmp_path, monkeypatch)

    def status(url: str, headers: dict[str, str]) -> int:
        try:
            with urllib.request.urlopen(urllib.request.Request(f"{url}/is_paused", headers=headers), timeout=5.0) as r:
                return int(r.status)
        except urllib.error.HTTPError as exc:
            return exc.code

    async def scenario() -> tuple[int, int, str | None]:
        launcher = await SlurmLauncher.start(LAUNCH, dict(os.environ), job_dir=job_dir, vllm=replica)
        try:
            url = await launcher.wait_for_endpoint(0, timeout_s=60.0)
            token = launcher.vllm_token
            assert token is not None
            return status(url, {}), status(url, {"Authorization": f"Bearer {token}"}), token
        finally:
            await launcher.stop(grace_s=5.0)

    anonymous, authorized, token = asyncio.run(scenario())

    assert (anonymous, authorized) == (401, 200)
    assert token == replica.token and token not in repr(replica)
    for path in job_dir.rglob("*"):  # the script, the endpoint file, the job's output
        if path.is_file():
            assert token not in path.read_text(errors="replace"), path


def test_wait_for_endpoint_when_the_replicas_server_dies_at_start_raises_at_once_with_its_last_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job_dir, replica = _fake_cluster(tmp_path, monkeypatch, "--die")

    async def scenario() -> None:
        launcher = await SlurmLauncher.start(LAUNCH, dict(os.environ), job_dir=job_dir, vllm=replica)
        try:
            await launcher.wait_for_endpoint(0, timeout_s=60.0)
        finally:
            await launcher.stop(grace_s=5.0)

    with pytest.raises(RuntimeError, match=r"replica 0 of slurm job 1000 failed: the server exited .* code 3") as info:
        asyncio.run(scenario())

    assert "cannot load the model" in str(info.value)


def test_start_launcher_for_slurm_and_vllm_gives_the_job_one_replica_reporting_under_the_output_dir(
    small_config: SessionConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, Any] = {}

    async def start(cls: Any, launch: LaunchConfig, env: Any, **kwargs: Any) -> str:
        seen.update(kwargs)
        return "launcher"

    monkeypatch.setattr(SlurmLauncher, "start", classmethod(start))
    config = dataclasses.replace(small_config, launch=LAUNCH, inference=InferenceConfig(engine="vllm"))

    asyncio.run(start_launcher(LAUNCH, {}, output_dir=tmp_path, replica_server=replica_server(config)))

    replica = seen["vllm"]
    assert replica.replicas == 1
    assert replica.endpoint_dir == str(tmp_path / "launch" / "slurm" / "endpoints")
    assert "vllm.entrypoints.openai.api_server" in replica.server_command
    assert "--host" not in replica.server_command and "--port" not in replica.server_command


def test_start_launcher_with_two_inference_replicas_raises_config_error_before_submitting(tmp_path: Path) -> None:
    launch = dataclasses.replace(LAUNCH, inference_replicas=2)

    with pytest.raises(ConfigError, match=r"inference_replicas.*routing requests over several vLLM replicas"):
        asyncio.run(start_launcher(launch, {}, output_dir=tmp_path))

    assert not (tmp_path / "launch").exists()
