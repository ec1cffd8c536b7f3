"""Generated sbatch scripts and per-node launch commands, snapshot-tested for 1, 2 and 16 nodes, with and without
vLLM replicas on nodes of their own."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from rlsdk.config import InferenceConfig, LaunchConfig, ModelConfig, SessionConfig, SlurmConfig, VLLMConfig
from rlsdk.engine.inference.factory import replica_server
from rlsdk.launch.slurm import SlurmJobSpec, VllmReplicaSpec, node_command, parse_job_id, sbatch_script

SNAPSHOTS = Path(__file__).parent / "snapshots"

# Deterministic inputs: the port and paths are passed in, never read from this machine.
CASES = {
    1: LaunchConfig(
        scheduler="slurm", num_nodes=1, num_ranks=2, threads_per_rank=4, host="10.0.0.5", allow_remote=True
    ),
    2: LaunchConfig(
        scheduler="slurm", num_nodes=2, num_ranks=2, simulate_nodes_on_loopback=True, slurm=SlurmConfig(time="00:30:00")
    ),
    16: LaunchConfig(
        scheduler="slurm",
        num_nodes=16,
        num_ranks=64,
        ranks_per_node=4,
        gpus_per_node=4,
        host="10.0.0.5",
        allow_remote=True,
        slurm=SlurmConfig(partition="gpu", account="rl-team", time="2-00:00:00", cpus_per_task=32),
    ),
}


def _spec(num_nodes: int) -> SlurmJobSpec:
    return SlurmJobSpec.from_config(
        CASES[num_nodes],
        main_process_port=29511,
        output_path="/runs/exp/launch/slurm/slurm-%j.out",
        python="/opt/venv/bin/python",
    )


@pytest.mark.parametrize("num_nodes", [1, 2, 16])
def test_sbatch_script_for_n_nodes_matches_its_snapshot(num_nodes: int) -> None:
    spec = _spec(num_nodes)

    script = sbatch_script(spec)

    expected = (SNAPSHOTS / f"train_{num_nodes}_nodes.sbatch").read_text()
    assert script == expected


@pytest.mark.parametrize("num_nodes", [1, 2, 16])
def test_node_command_for_n_nodes_matches_its_snapshot(num_nodes: int) -> None:
    spec = _spec(num_nodes)

    command = node_command(spec)

    expected = (SNAPSHOTS / f"node_command_{num_nodes}_nodes.txt").read_text()
    assert command + "\n" == expected


def test_node_command_takes_machine_rank_and_main_ip_from_the_allocation_not_from_generation_time() -> None:
    spec = _spec(16)

    command = node_command(spec)

    assert '--machine_rank "$SLURM_NODEID"' in command
    assert '--main_process_ip "$RLSDK_MAIN_PROCESS_IP"' in command
    assert "--num_processes 64 --num_machines 16" in command
    assert "--main_process_port 29511" in command


def test_sbatch_script_without_partition_or_account_leaves_the_cluster_defaults() -> None:
    spec = _spec(2)

    script = sbatch_script(spec)

    assert "--partition" not in script and "--account" not in script and "--gpus-per-node" not in script


def test_job_spec_cpus_per_task_defaults_to_threads_times_ranks_per_node() -> None:
    launch = LaunchConfig(scheduler="slurm", num_ranks=4, threads_per_rank=3, simulate_nodes_on_loopback=True)

    spec = SlurmJobSpec.from_config(launch, main_process_port=1, output_path="o", python="p")

    assert spec.cpus_per_task == 12 and spec.ranks_per_node == 4


@pytest.mark.parametrize(("line", "job_id"), [("4242\n", "4242"), ("4242;cluster-a\n", "4242")])
def test_parse_job_id_reads_sbatch_parsable_output(line: str, job_id: str) -> None:
    assert parse_job_id(line) == job_id


def test_parse_job_id_rejects_an_error_message() -> None:
    with pytest.raises(RuntimeError, match="expected a job id"):
        parse_job_id("sbatch: error: Batch job submission failed\n")


def _vllm_config(num_nodes: int) -> SessionConfig:
    """The session config of CASES[num_nodes] with the vLLM engine; 16 nodes: 2 GPU replicas of 4 GPUs each."""
    launch = CASES[num_nodes]
    if num_nodes == 16:
        launch = dataclasses.replace(launch, inference_replicas=2, inference_tensor_parallel_size=4)
    return SessionConfig(
        model=ModelConfig(path="/models/policy"),
        launch=launch,
        inference=InferenceConfig(
            engine="vllm", vllm=VLLMConfig(kv_cache_gib=4, max_model_len=2048, server_start_timeout_s=600.0)
        ),
    )


def _replica_spec(config: SessionConfig, *, endpoint_dir: str, python: str) -> VllmReplicaSpec:
    """The replicas the Session's Slurm job runs for ``config``: the vLLM engine's server, as the launcher gets it."""
    server = replica_server(config, python=python)
    assert server is not None
    return VllmReplicaSpec.from_server(server, endpoint_dir=endpoint_dir)


def _vllm_spec(num_nodes: int) -> SlurmJobSpec:
    vllm = _replica_spec(
        _vllm_config(num_nodes), endpoint_dir="/runs/exp/launch/slurm/endpoints", python="/opt/venv/bin/python"
    )
    return SlurmJobSpec.from_config(
        CASES[num_nodes] if num_nodes != 16 else _vllm_config(16).launch,
        main_process_port=29511,
        output_path="/runs/exp/launch/slurm/slurm-%j.out",
        python="/opt/venv/bin/python",
        vllm=vllm,
    )


@pytest.mark.parametrize("num_nodes", [1, 2, 16])
def test_sbatch_script_with_vllm_replicas_for_n_train_nodes_matches_its_snapshot(num_nodes: int) -> None:
    spec = _vllm_spec(num_nodes)

    script = sbatch_script(spec)

    expected = (SNAPSHOTS / f"train_{num_nodes}_nodes_vllm.sbatch").read_text()
    assert script == expected


def test_sbatch_script_with_one_vllm_replica_allocates_a_node_after_the_train_nodes() -> None:
    spec = _vllm_spec(2)

    script = sbatch_script(spec)

    assert "#SBATCH --nodes=3" in script
    assert 'RLSDK_VLLM_NODE_0="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 3p)"' in script
    assert '--host "$RLSDK_VLLM_NODE_0"' in script
    assert "--endpoint-file /runs/exp/launch/slurm/endpoints/replica-0.json" in script
    assert 'srun --nodes=2 --nodelist="$RLSDK_TRAIN_NODES"' in script


def test_vllm_replica_command_uses_the_local_launchers_server_flags_without_host_or_port() -> None:
    from rlsdk.engine.inference.vllm_server import server_command

    local = server_command("/models/policy", 8000, max_model_len=2048, python="/opt/venv/bin/python")

    replica = _replica_spec(_vllm_config(2), endpoint_dir="e", python="/opt/venv/bin/python")

    command = list(replica.server_command)
    assert command[0] == "env" and "VLLM_SERVER_DEV_MODE=1" in command and "VLLM_CPU_KVCACHE_SPACE=4" in command
    assert command[command.index("/opt/venv/bin/python") :] == [
        a for a in local if a not in ("--host", "127.0.0.1", "--port", "8000")
    ]


def test_vllm_replicas_on_gpu_nodes_load_the_nccl_worker_extension_with_their_tensor_parallel_size() -> None:
    replica = _replica_spec(_vllm_config(16), endpoint_dir="e", python="p")

    command = " ".join(replica.server_command)

    assert replica.replicas == 2
    assert "--worker-extension-cls rlsdk.engine.inference.nccl_sync.NcclWeightSyncExtension" in command
    assert "--tensor-parallel-size 4" in command


def test_replica_server_for_an_attached_vllm_or_another_engine_is_none() -> None:
    attached = dataclasses.replace(
        _vllm_config(2), inference=InferenceConfig(engine="vllm", vllm=VLLMConfig(url="http://h:8000"))
    )
    embedded = dataclasses.replace(_vllm_config(2), inference=InferenceConfig(engine="embedded"))

    assert replica_server(attached) is None
    assert replica_server(embedded) is None
