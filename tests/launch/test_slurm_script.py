"""Generated sbatch scripts and per-node launch commands, snapshot-tested for 1, 2 and 16 nodes."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlsdk.config import LaunchConfig
from rlsdk.launch.slurm import SlurmJobSpec, node_command, parse_job_id, sbatch_script

SNAPSHOTS = Path(__file__).parent / "snapshots"

# Deterministic inputs: the port and paths are passed in, never read from this machine.
CASES = {
    1: LaunchConfig(
        scheduler="slurm", num_nodes=1, num_ranks=2, threads_per_rank=4, host="10.0.0.5", allow_remote=True
    ),
    2: LaunchConfig(
        scheduler="slurm", num_nodes=2, num_ranks=2, simulate_nodes_on_loopback=True, slurm_time="00:30:00"
    ),
    16: LaunchConfig(
        scheduler="slurm",
        num_nodes=16,
        num_ranks=64,
        ranks_per_node=4,
        gpus_per_node=4,
        host="10.0.0.5",
        allow_remote=True,
        slurm_partition="gpu",
        slurm_account="rl-team",
        slurm_time="2-00:00:00",
        slurm_cpus_per_task=32,
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
