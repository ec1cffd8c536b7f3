"""One config dataclass per component. Each checks its own fields at construction and raises ConfigError.

Field order in every class: required, common optional, rare optional, internal. Each field's docstring sits right
under it (what the field does, the values allowed), as torchtitan's ``job_config.py`` does: the generated config
reference (docs/hooks.py) and ``rlsdk run RECIPE --help`` read them there, and a test fails on a field without one.
Options that only one backend reads live in that backend's own section (``inference.vllm``, ``launch.slurm``); their
old flat names (``inference.kv_cache_gib``) keep working, with a warning, until the release ``moved_fields`` names.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
import warnings
from dataclasses import dataclass
from typing import Literal

from rlsdk.config.aliases import moved_fields
from rlsdk.config.device import GLOO, NCCL, CpuBackend, DeviceChoice
from rlsdk.config.errors import ConfigError
from rlsdk.config.validate import check_types, require


@dataclass
class ModelConfig:
    """The policy model."""

    path: str
    """Local directory holding a transformers causal LM and its tokenizer (non-empty; existence is checked when the
    Session starts)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype on every rank: 'float32', 'bfloat16' or 'float16'."""
    trust_remote_code: bool = False
    """Allow the model directory's own Python code to run when loading."""

    def __post_init__(self) -> None:
        check_types(self)
        require(self, "path", self.path.strip() != "", "a non-empty path to a local model directory")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _require_name(cfg: object, name: str) -> None:
    value = getattr(cfg, name)
    ok = value is None or (value.strip() != "" and " " not in value)
    require(cfg, name, ok, "None or a non-empty name without spaces")


@dataclass
class SlurmConfig:
    """The sbatch job of ``launch.scheduler='slurm'`` (docs/howto/scaling.md): one task per node, each running
    ``accelerate launch`` for that node's ranks through srun."""

    partition: str | None = None
    """sbatch --partition; None = the cluster's default. Non-empty, without spaces."""
    account: str | None = None
    """sbatch --account; None = the user's default. Non-empty, without spaces."""
    time: str = "01:00:00"
    """sbatch --time, in a Slurm time format: 'MM', 'MM:SS', 'HH:MM:SS', 'D-HH', 'D-HH:MM' or 'D-HH:MM:SS'."""
    cpus_per_task: int | None = None
    """sbatch --cpus-per-task (one task per node); None = launch.threads_per_rank x launch.ranks_per_node, else >= 1."""

    def __post_init__(self) -> None:
        check_types(self)
        _require_name(self, "partition")
        _require_name(self, "account")
        require(
            self,
            "time",
            re.fullmatch(r"\d+|\d+:\d{2}|\d+:\d{2}:\d{2}|\d+-\d+|\d+-\d+:\d{2}|\d+-\d+:\d{2}:\d{2}", self.time)
            is not None,
            "a Slurm time: 'MM', 'MM:SS', 'HH:MM:SS', 'D-HH', 'D-HH:MM' or 'D-HH:MM:SS'",
        )
        require(self, "cpus_per_task", self.cpus_per_task is None or self.cpus_per_task >= 1, "None or an int >= 1")


@dataclass
class RayConfig:
    """The existing Ray cluster of ``launch.scheduler='ray'`` (the ``ray`` extra; docs/howto/scaling.md)."""

    address: str | None = None
    """ray.init address of the cluster ('auto', 'ray://HOST:PORT', ...); None = 'auto'. Non-empty, without spaces."""

    def __post_init__(self) -> None:
        check_types(self)
        _require_name(self, "address")


# LaunchConfig's positional parameters as they were before the Slurm and Ray options moved into their sections:
# ``LaunchConfig(2, "gloo", ...)`` keeps meaning what it meant (with a warning) until they are removed.
_LAUNCH_POSITIONAL = (
    "num_ranks", "backend", "threads_per_rank", "start_timeout_s", "heartbeat_interval_s", "heartbeat_timeout_s",
    "command_timeout_s", "host", "allow_remote", "tracer", "hang_timeout_s", "hang_policy", "pg_timeout_s",
    "scheduler", "num_nodes", "ranks_per_node", "data_parallel_size", "tensor_parallel_size",
    "context_parallel_size", "inference_replicas", "inference_tensor_parallel_size", "gpus_per_node",
    "main_process_port", "slurm_partition", "slurm_account", "slurm_time", "slurm_cpus_per_task", "ray_address",
    "simulate_nodes_on_loopback", "shm_allreduce", "trace_poll_s",
)  # fmt: skip


@moved_fields(
    remove_in="0.3",
    positional=_LAUNCH_POSITIONAL,
    slurm_partition="slurm.partition",
    slurm_account="slurm.account",
    slurm_time="slurm.time",
    slurm_cpus_per_task="slurm.cpus_per_task",
    ray_address="ray.address",
)
@dataclass
class LaunchConfig:
    """How the train ranks are started and supervised."""

    num_ranks: int = 2
    """Train ranks (processes) to start, 1..64."""
    backend: CpuBackend = GLOO
    """torch.distributed backend of CPU tensors: gloo, the only one. CUDA ranks (see device) use NCCL for CUDA
    tensors and this backend for CPU ones."""
    threads_per_rank: int = 1
    """torch intra-op threads per rank, >= 1."""
    start_timeout_s: float = 180.0
    """Seconds to wait for every rank to report ready, > 0."""
    heartbeat_interval_s: float = 1.0
    """Seconds between rank heartbeats, > 0."""
    heartbeat_timeout_s: float = 30.0
    """Seconds without a heartbeat before a rank counts as dead; > heartbeat_interval_s."""
    command_timeout_s: float | None = None
    """Seconds a rank command may run before it is reported as hung; None = no limit, else > 0."""
    host: str = "127.0.0.1"
    """TCP listen address of the control channel where TCP is used (scheduler 'slurm' or 'ray', or allow_remote); a
    loopback address (127.x.x.x, ::1, localhost) unless allow_remote is set. A local run without allow_remote uses a
    Unix socket in the session's private runtime directory and no TCP port."""
    allow_remote: bool = False
    """Allow a non-loopback host and listen on TCP (encrypted and authenticated with CURVE) even with scheduler 'local',
    e.g. for ranks you attach from another machine."""
    tracer: bool = True
    """Record every collective on the ranks (a 'traced' gloo process group; its cost per step is measured by
    benchmarks/tracer_overhead.py) so hangs and desyncs are diagnosed live; see docs/howto/debug-hang.md."""
    hang_timeout_s: float | None = 30.0
    """Seconds a command may run before the watchdog collects every rank's collective trace and stacks and analyses
    them (needs tracer); None = no watchdog, else > 0. A straggler is only logged; a desync raises CollectiveHangError
    or is logged, as hang_policy says."""
    hang_policy: Literal["raise", "wait"] = "raise"
    """What the watchdog does on a desync: 'raise' (CollectiveHangError, the ranks stay stuck until pg_timeout_s or
    close()) or 'wait' (log the report and keep waiting)."""
    pg_timeout_s: float | None = None
    """The ranks' process-group timeout in seconds: a collective stuck this long raises a catchable error on its rank;
    None = torch's default (30 min), else > 0."""
    # Cluster topology (docs/howto/scaling.md); appended so positional construction of the fields above keeps
    # working. The defaults are the single-machine behaviour.
    scheduler: Literal["local", "slurm", "ray"] = "local"
    """Where the ranks run (see docs/howto/scaling.md): 'local' (``accelerate launch`` on this machine, the
    default), 'slurm' (an sbatch allocation of num_nodes nodes, one ``accelerate launch`` per node through srun)
    or 'ray' (placement groups on an existing Ray cluster; the ``ray`` extra)."""
    num_nodes: int = 1
    """Machines the ranks span, 1..64; 'local' needs 1."""
    ranks_per_node: int | None = None
    """Train ranks per node; None = num_ranks / num_nodes (which must be whole); else num_nodes x ranks_per_node must
    equal num_ranks."""
    data_parallel_size: int | None = None
    """Data-parallel (shard) size of the device mesh; None = num_ranks / (tensor_parallel_size x context_parallel_size);
    data x context x tensor must equal num_ranks."""
    tensor_parallel_size: int = 1
    """Tensor-parallel axis of the device mesh, >= 1. Only 1 runs today (the train engine implements data parallelism
    only); larger values are checked but refused at start."""
    context_parallel_size: int = 1
    """Context-parallel axis of the device mesh, >= 1; only 1 runs today (as above)."""
    inference_replicas: int = 1
    """vLLM server replicas (data parallel), 1..64; the slurm and ray schedulers place each on its own node(s)."""
    inference_tensor_parallel_size: int = 1
    """GPUs per vLLM replica (vLLM's --tensor-parallel-size), >= 1; at most gpus_per_node when that is > 0."""
    gpus_per_node: int = 0
    """GPUs per node requested from the scheduler (``--gpus-per-node``); 0 = CPU only."""
    main_process_port: int | None = None
    """Rendezvous port of the node running machine rank 0, 1..65535; None = a free port chosen on the controller when
    the job is submitted ('local': chosen by accelerate)."""
    simulate_nodes_on_loopback: bool = False
    """Allow scheduler 'slurm' or 'ray' with a loopback host: every "node" is a process group on this machine (the fake
    Slurm of the tests, a local Ray instance). Without it those schedulers need a host the compute nodes can reach (a
    non-loopback host and allow_remote=True)."""
    shm_allreduce: bool = True
    """Ranks that share a host all-reduce CPU tensors (DDP's gradient buckets included) through a shared-memory segment
    instead of gloo's TCP loopback: every rank reduces in rank order, so all get the same bits (see
    docs/architecture.md). Ranks on different hosts, non-x86-64 machines and other collectives use gloo. False: every
    collective on gloo."""
    trace_poll_s: float | None = 1.0
    """Seconds between live checks of a running rank command's collective traces (needs tracer); the first check runs
    this long after the command starts. A certain divergence (a mismatch at one sequence number, or a collective or
    point-to-point call whose counterpart ranks finished the command, died or are blocked for good; see
    docs/howto/debug-hang.md) seen on two checks in a row is reported at once as hang_policy says, without waiting for
    hang_timeout_s. Uncertain states (a straggler) still wait for hang_timeout_s. None = no live checks; else > 0."""
    device: DeviceChoice = "auto"
    """Where the train ranks compute: 'auto' ('cuda' when the ranks would see a GPU: torch sees one on this machine
    for scheduler 'local', gpus_per_node > 0 for 'slurm' and 'ray'; else 'cpu'), 'cpu' (gloo) or 'cuda' (one GPU
    per rank, NCCL; 'slurm' and 'ray' need gpus_per_node > 0, 'local' a CUDA device, checked at start). See
    docs/howto/gpu.md."""
    slurm: SlurmConfig = dataclasses.field(default_factory=SlurmConfig)
    """The sbatch job of scheduler 'slurm' (partition, account, time limit, CPUs); unused otherwise."""
    ray: RayConfig = dataclasses.field(default_factory=RayConfig)
    """The Ray cluster of scheduler 'ray'; unused otherwise."""

    def __post_init__(self) -> None:
        if self.backend == NCCL:  # before the type check: say how NCCL is chosen, not only what backend allows
            raise ConfigError(
                "LaunchConfig.backend",
                self.backend,
                f"{GLOO!r} (the backend of CPU tensors); CUDA ranks use NCCL for CUDA tensors: set "
                "launch.device='cuda' (or 'auto' where the ranks see a GPU)",
            )
        check_types(self)
        require(self, "num_ranks", 1 <= self.num_ranks <= 64, "an int in [1, 64]")
        require(
            self,
            "device",
            self.device != "cuda" or self.scheduler == "local" or self.gpus_per_node > 0,
            f"'auto' or 'cpu' with gpus_per_node=0 and scheduler={self.scheduler!r} (the nodes get no GPU), or "
            "'cuda' with gpus_per_node >= ranks per node",
        )
        self._check_topology()
        require(self, "hang_timeout_s", self.hang_timeout_s is None or self.hang_timeout_s > 0, "None or a float > 0")
        require(self, "pg_timeout_s", self.pg_timeout_s is None or self.pg_timeout_s > 0, "None or a float > 0")
        require(
            self,
            "trace_poll_s",
            self.trace_poll_s is None or self.trace_poll_s > 0,
            "None or a finite float > 0",
        )
        require(self, "threads_per_rank", self.threads_per_rank >= 1, "an int >= 1")
        require(self, "start_timeout_s", self.start_timeout_s > 0, "a finite float > 0")
        require(self, "heartbeat_interval_s", self.heartbeat_interval_s > 0, "a finite float > 0")
        require(
            self,
            "heartbeat_timeout_s",
            self.heartbeat_timeout_s > self.heartbeat_interval_s,
            f"a finite float > heartbeat_interval_s (= {self.heartbeat_interval_s})",
        )
        require(
            self,
            "command_timeout_s",
            self.command_timeout_s is None or self.command_timeout_s > 0,
            "None or a finite float > 0",
        )
        require(self, "host", self.host.strip() != "", "a non-empty host name or address")
        require(
            self,
            "host",
            self.allow_remote or _is_loopback(self.host),
            "a loopback address (127.x.x.x, ::1, localhost) unless allow_remote=True",
        )
        require(
            self,
            "host",
            self.scheduler == "local" or not _is_loopback(self.host) or self.simulate_nodes_on_loopback,
            f"an address the compute nodes can reach (with allow_remote=True) when scheduler={self.scheduler!r} "
            "(its ranks run on other machines); a loopback host only with simulate_nodes_on_loopback=True "
            "(every node a process on this machine)",
        )

    def _check_topology(self) -> None:
        require(self, "num_nodes", 1 <= self.num_nodes <= 64, "an int in [1, 64]")
        require(
            self,
            "num_nodes",
            self.scheduler != "local" or self.num_nodes == 1,
            "1 with scheduler='local' (every rank on this machine); use scheduler='slurm' or 'ray' for more",
        )
        if self.ranks_per_node is None:
            require(
                self,
                "num_nodes",
                self.num_ranks % self.num_nodes == 0,
                f"a divisor of num_ranks: num_ranks / num_nodes = {self.num_ranks} / {self.num_nodes} is not a "
                "whole number of ranks per node",
            )
        else:
            require(self, "ranks_per_node", self.ranks_per_node >= 1, "None or an int >= 1")
            require(
                self,
                "ranks_per_node",
                self.num_nodes * self.ranks_per_node == self.num_ranks,
                f"an int with num_nodes x ranks_per_node = num_ranks: num_nodes x ranks_per_node = "
                f"{self.num_nodes} x {self.ranks_per_node} "
                f"= {self.num_nodes * self.ranks_per_node}, but num_ranks = {self.num_ranks}",
            )
        require(self, "tensor_parallel_size", self.tensor_parallel_size >= 1, "an int >= 1")
        require(self, "context_parallel_size", self.context_parallel_size >= 1, "an int >= 1")
        tp_cp = self.tensor_parallel_size * self.context_parallel_size
        if self.data_parallel_size is None:
            require(
                self,
                "tensor_parallel_size",
                self.num_ranks % tp_cp == 0,
                f"sizes whose product divides num_ranks: tensor_parallel_size x context_parallel_size = "
                f"{self.tensor_parallel_size} x {self.context_parallel_size} = {tp_cp} does not divide "
                f"num_ranks = {self.num_ranks}",
            )
        else:
            require(self, "data_parallel_size", self.data_parallel_size >= 1, "None or an int >= 1")
            product = self.data_parallel_size * tp_cp
            require(
                self,
                "data_parallel_size",
                product == self.num_ranks,
                f"an int with data x context x tensor parallel sizes = num_ranks: data_parallel_size x "
                f"context_parallel_size x tensor_parallel_size = {self.data_parallel_size} x "
                f"{self.context_parallel_size} x {self.tensor_parallel_size} = {product}, but num_ranks "
                f"= {self.num_ranks}",
            )
        require(self, "inference_replicas", 1 <= self.inference_replicas <= 64, "an int in [1, 64]")
        require(self, "gpus_per_node", self.gpus_per_node >= 0, "an int >= 0 (0 = CPU only)")
        require(
            self,
            "inference_tensor_parallel_size",
            self.inference_tensor_parallel_size >= 1
            and (self.gpus_per_node == 0 or self.inference_tensor_parallel_size <= self.gpus_per_node),
            f"an int >= 1, at most gpus_per_node (= {self.gpus_per_node}) when that is > 0",
        )
        require(
            self,
            "main_process_port",
            self.main_process_port is None or 1 <= self.main_process_port <= 65535,
            "None (a free port chosen at submit time) or an int in [1, 65535]",
        )


@dataclass
class EmbeddedConfig:
    """Options of the embedded engine (``inference.engine='embedded'``): a transformers model generating in the
    controller process."""

    num_threads: int | None = None
    """torch threads of the engine's generation thread; None = torch's default, else >= 1. The ranks
    keep ``launch.threads_per_rank``."""

    def __post_init__(self) -> None:
        check_types(self)
        require(self, "num_threads", self.num_threads is None or self.num_threads >= 1, "None or an int >= 1")


@dataclass
class VLLMConfig:
    """Options of the vLLM engine (``inference.engine='vllm'``): a real vLLM OpenAI-compatible server, started
    and supervised by the Session or attached by URL (the ``vllm`` extra; docs/howto/vllm.md)."""

    url: str | None = None
    """Attach to an already-running server at this base URL ('http://HOST:PORT' or 'https://...'; started with the flags
    of ``rlsdk.engine.inference.vllm_server.server_command`` and a secret token in its VLLM_API_KEY, which the Session
    reads from its own VLLM_API_KEY) instead of starting one; None = start one on a Unix socket in the session's private
    runtime directory (no TCP port). Needs ``inference.engine='vllm'``."""
    kv_cache_gib: int = 1
    """KV-cache size in GiB (VLLM_CPU_KVCACHE_SPACE), an int >= 1."""
    max_model_len: int | None = None
    """Longest prompt + completion in tokens; None = the model's own limit, else >= 1."""
    server_start_timeout_s: float = 300.0
    """Seconds to wait for a started server to report healthy, > 0."""
    sync_timeout_s: float = 120.0
    """Seconds each step of a weight sync (pause, load, version, resume) may take, > 0."""
    request_timeout_s: float = 600.0
    """Seconds one generation request may take, > 0."""
    extra_server_args: tuple[str, ...] = ()
    """More command-line arguments for the server (e.g. ['--seed', '1']); a list of strings."""
    weight_transfer: Literal["auto", "reload", "inplace"] = "auto"
    """How a weight sync reaches the server. 'auto' (default): an NCCL broadcast from trainer rank 0
    when ``launch.gpus_per_node > 0``, else 'reload'. 'reload': the server re-loads the published file through
    vLLM (keeps vLLM's packed CPU weights: fastest generation). 'inplace' (CPU only, so not
    with ``launch.gpus_per_node > 0``): the server keeps plain weights and the file is copied straight into them (faster
    syncs, slower generation; the measured trade-off is in docs/howto/vllm.md)."""

    def __post_init__(self) -> None:
        check_types(self)
        require(
            self,
            "url",
            self.url is None or self.url.startswith(("http://", "https://")),
            "None or a base URL starting with http:// or https://",
        )
        require(self, "kv_cache_gib", self.kv_cache_gib >= 1, "an int >= 1")
        require(self, "max_model_len", self.max_model_len is None or self.max_model_len >= 1, "None or an int >= 1")
        require(self, "server_start_timeout_s", self.server_start_timeout_s > 0, "a finite float > 0")
        require(self, "sync_timeout_s", self.sync_timeout_s > 0, "a finite float > 0")
        require(self, "request_timeout_s", self.request_timeout_s > 0, "a finite float > 0")


@dataclass
class ColocatedConfig:
    """Options of the colocated engine (``inference.engine='colocated'``): the train ranks generate with the
    weights they train (docs/howto/colocated.md)."""

    lookahead: bool = True
    """Each ``Session.update`` also samples the next batch (the data set's next rows, the next rollout's seed) on the
    ranks with the new weights, in the same rank command, and the next ``Session.rollout()`` returns it without a round
    trip to the ranks. The samples are the same as without it (same rows, seed and weights); explicit prompts, other
    sampling params or a custom workflow generate then and there. Applies with ``rollout.mode='sequential'`` and the
    default single-turn workflow; False = every rollout sends its own command."""

    def __post_init__(self) -> None:
        check_types(self)


# InferenceConfig's positional parameters before the per-engine options moved into their sections (see above).
_INFERENCE_POSITIONAL = (
    "engine", "num_threads", "max_batch_size", "url", "logprob_warn_threshold", "kv_cache_gib", "max_model_len",
    "server_start_timeout_s", "sync_timeout_s", "request_timeout_s", "extra_server_args", "weight_transfer",
    "lookahead", "dtype",
)  # fmt: skip


@moved_fields(
    remove_in="0.3",
    positional=_INFERENCE_POSITIONAL,
    num_threads="embedded.num_threads",
    url="vllm.url",
    kv_cache_gib="vllm.kv_cache_gib",
    max_model_len="vllm.max_model_len",
    server_start_timeout_s="vllm.server_start_timeout_s",
    sync_timeout_s="vllm.sync_timeout_s",
    request_timeout_s="vllm.request_timeout_s",
    extra_server_args="vllm.extra_server_args",
    weight_transfer="vllm.weight_transfer",
    lookahead="colocated.lookahead",
)
@dataclass
class InferenceConfig:
    """The inference engine that generates rollouts: the options every engine reads, then one section per
    engine kind holding the options only that engine reads (``inference.vllm.kv_cache_gib``); a section other
    than the selected engine's is ignored, so one YAML file can switch engines with a single flag."""

    # TODO(config): an engine registered under a new name (rlsdk.engine.inference.register_engine) must also be added
    # to this Literal, which the ranks re-validate. Widening it to str changes a shared field's type, and a name
    # registry inside config would have to be rebuilt in every rank process; the contract decides neither.
    engine: Literal["embedded", "vllm", "colocated"] = "embedded"
    """Engine kind: 'embedded' (a transformers model in the controller process, the default), 'vllm' (a real vLLM
    OpenAI-compatible server; needs the ``vllm`` extra, see docs/howto/vllm.md) or 'colocated' (the train ranks generate
    with the weights they train, as TRL's GRPOTrainer does: no weights move at a sync; needs ``train.parallelism='ddp'``
    and ``rollout.mode='sequential'``; see docs/howto/colocated.md)."""
    max_batch_size: int = 1024
    """Most sequences generated in one forward pass, >= 1, by the engines that generate in-process: 'embedded',
    and 'colocated' (per rank). A vLLM server schedules its own batches (its ``--max-num-seqs``,
    through ``vllm.extra_server_args``)."""
    logprob_warn_threshold: float = 0.02
    """Each update warns when the mean |trainer - engine| logprob of the batch's completion tokens exceeds
    this (nats), > 0."""
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """The dtype the engine serves the policy in: 'float32', 'bfloat16' or 'float16'; None (default) = model.dtype.
    Embedded and vLLM engines (vLLM's --dtype); a colocated engine samples with the ranks' own weights.
    Log-probabilities are float32 either way, and the per-update agreement metrics compare them with the trainer's as
    they are (a bf16 engine's rounding shows there; see docs/howto/real-shapes.md)."""
    decode_step: Literal["eager", "compile"] = "eager"
    """How the engines that generate in-process run a decode step ('embedded', and 'colocated' on every rank):
    'eager' (default) calls the model's forward op by op; 'compile' calls ``torch.compile`` of that forward (made
    once per served model, its batch dimension dynamic). The first generation pays the compilation (tens of seconds
    on a CPU; it needs a C++ compiler), later ones run fused kernels: worth it for long rollouts, not for a short
    run. Same tokens and logprobs to float rounding. A vLLM server ignores it (its own flags decide). The measured
    trade-off is on the benchmarks page (docs/benchmarks.md)."""
    embedded: EmbeddedConfig = dataclasses.field(default_factory=EmbeddedConfig)
    """Options of engine 'embedded'."""
    vllm: VLLMConfig = dataclasses.field(default_factory=VLLMConfig)
    """Options of engine 'vllm'."""
    colocated: ColocatedConfig = dataclasses.field(default_factory=ColocatedConfig)
    """Options of engine 'colocated'."""

    def __post_init__(self) -> None:
        check_types(self)
        require(self, "max_batch_size", self.max_batch_size >= 1, "an int >= 1")
        require(self, "logprob_warn_threshold", self.logprob_warn_threshold > 0, "a finite float > 0")
        if self.vllm.url is not None and self.engine != "vllm":
            raise ConfigError("InferenceConfig.vllm.url", self.vllm.url, "None unless engine='vllm'")


@dataclass
class TrainConfig:
    """The optimizer (AdamW) and the training loop."""

    lr: float = 1e-3
    """Learning rate, > 0."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay, >= 0."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW (beta1, beta2), each in [0, 1)."""
    max_grad_norm: float | None = 1.0
    """Clip the global gradient L2 norm to this; None = no clipping, else > 0."""
    micro_batch_size: int = 128
    """Sequences per rank per forward pass, >= 1."""
    max_steps: int = 1000
    """Update steps ``Session.train`` runs in total (a resumed run continues up to it), >= 1. Read by the library
    loop (``Session.train``), not by the single-step calls."""
    target_reward: float | None = None
    """``Session.train`` stops once the mean reward over the last ``observe.moving_average`` steps reaches this; None =
    never."""
    checkpoint_every: int = 0
    """``Session.train`` saves a checkpoint every N steps, >= 0, and always after its last step; 0 = only at the end."""
    keep_checkpoints: int = 2
    """Most recent checkpoints kept on disk, >= 1."""
    parallelism: Literal["ddp", "fsdp2"] = "ddp"
    """How the ranks hold the model: 'ddp' (default; every rank holds the whole model, gradients all-reduced)
    or 'fsdp2' (torch ``fully_shard`` per decoder layer and the root: parameters, gradients and optimizer state sharded
    over the ranks). Same update, same exported weights; 'fsdp2' trades all-gathers for memory."""
    resume_from: str | None = None
    """Continue a run from a checkpoint: the path of a ``step_N`` directory that ``Session.save_checkpoint``
    wrote, 'latest' (the newest complete ``step_N`` under ``observe.output_dir``/checkpoints; an error when there is
    none), or 'auto' (the same when one exists, else start from ``model.path``: verl's ``resume_mode=auto``, for a job
    that restarts itself); None (default) = start from ``model.path``. ``Session.start`` checks it before any process
    starts (ConfigError naming ``train.resume_from`` when the directory is missing, has no manifest.json or a file does
    not match its manifest checksum); the run must have the checkpoint's ``launch.num_ranks`` and ``train.parallelism``.
    See docs/howto/checkpoints.md."""
    share_prompt_prefix: bool = True
    """Run each distinct prompt of a micro-batch through the model once and reuse its key/value cache for every
    completion of that prompt (a GRPO group's ``rollout.group_size`` completions share one prompt), for the policy and
    the reference model. Same logprobs, entropies and gradients to float rounding, fewer token positions through the
    model (less forward/backward time the longer the prompt and the larger the group). False = one forward over prompt +
    completion per sequence. Models whose forward returns no transformers cache fall back to that, and so does
    gradient_checkpointing (the checkpointed layers keep no cache)."""
    eval_every: int = 0
    """``Session.train`` runs ``Session.evaluate`` (held-out prompts, greedy) every N steps and after its last
    step, >= 0; 0 = never."""
    # Appended so that positional construction of the fields above keeps working.
    lr_scheduler: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate schedule after the warm-up, from transformers' schedule functions (as TRL): 'constant' (the
    default), 'linear' (to 0) or 'cosine' (half a cosine to 0). It steps once per optimizer step; its horizon is
    max_steps x the optimizer steps of one update (ppo_epochs x mini-batches of a full batch of data.prompts_per_step x
    rollout.group_size sequences). Past the horizon 'linear' stays at 0 and 'cosine' rises again (a warning is logged
    once). Saved in checkpoints and resumed exactly."""
    warmup_steps: int = 0
    """Optimizer steps of linear warm-up from 0 to lr, >= 0; 0 = none."""
    ppo_epochs: int = 1
    """Passes over each batch (verl's ppo_epochs, TRL's num_iterations), >= 1. With more than one optimizer step per
    update the trainer first recomputes the batch's log-probs once, without gradients, on the weights the update starts
    from (the proximal "old" log-probs of algorithm.off_policy 'tis' and 'decoupled', and the trainer-vs-engine
    agreement metrics); every step of the update reuses them."""
    mini_batch_size: int | None = None
    """Sequences per optimizer step over all ranks (verl's ppo_mini_batch_size in sequences, TRL's per-device batch x
    devices); each epoch takes the batch's mini-batches in order (no shuffling), each normalised by its own global
    token/sequence count. None (default) = the whole batch, one step per epoch. A multiple of launch.num_ranks, at most
    data.prompts_per_step x rollout.group_size. One update still publishes one weight version, whatever its number of
    optimizer steps."""
    lora_rank: int = 0
    """Train LoRA adapters of this rank (``peft``, the ``lora`` extra) instead of every weight; the engines then receive
    only the adapter at a sync (see docs/howto/lora.md). 0 (default) = full fine-tuning, else >= 1. Needs
    train.parallelism 'ddp'."""
    lora_alpha: float = 16.0
    """LoRA scaling numerator (the update is scaled by lora_alpha / lora_rank), > 0."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA input, in [0, 1). Keep 0 for RL: with dropout the trainer's log-probs differ from the
    engine's (which never drops out) and the PPO ratio is no longer 1 on-policy."""
    lora_target_modules: tuple[str, ...] = ("all-linear",)
    """Module names (or suffixes) that get adapters, as peft's target_modules; ('all-linear',) (default) = every linear
    layer but the output head. Non-empty."""
    max_tokens_per_micro_batch: int | None = None
    """Token budget of one micro-batch: a rank's sequences are sorted by length and packed so that rows x (longest
    prompt + longest completion) stays within it (micro_batch_size still caps the rows), each micro-batch trimmed to its
    own longest prompt and completion; a sequence longer than the budget forms its own micro-batch. Ranks split
    micro-batches until they run the same number (one all-reduce of the count per update). None (default) =
    micro_batch_size sequences per micro-batch, padded to the batch's longest. >= 1. The gradient is the same either
    way (global loss normalisers)."""
    mixed_precision: Literal["no", "bf16"] = "no"
    """'no' (default: every op in model.dtype) or 'bf16': matmuls in bfloat16 on float32 master weights (model.dtype
    must be 'float32'); gradients, optimizer states and the loss stay float32, and log-probabilities are taken in
    float32 from the (bf16) logits. 'ddp' runs the forward under ``torch.autocast`` for the ranks' device type; 'fsdp2'
    uses FSDP2's MixedPrecisionPolicy (bf16 parameters gathered and computed with, float32 gradient reduction). See
    docs/howto/real-shapes.md."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward instead of keeping them (transformers' non-reentrant
    checkpointing): activation memory of one layer instead of all, at about one more forward's time; turns
    share_prompt_prefix off."""
    logits_chunk_mib: int | None = 32
    """Most MiB of float32 logits held at once: a micro-batch whose completion logits exceed it computes its
    log-probabilities and entropies with the LM head fused, one chunk of tokens at a time (recomputed in the backward),
    so memory no longer grows with vocabulary x tokens; the same values and gradients to float rounding. >= 1. None =
    always materialise [B, C, V] logits (for a model whose forward changes its head's output, e.g. logit
    soft-capping)."""
    fsdp_reshard_after_forward: bool = True
    """'fsdp2': free each decoder layer's gathered parameters after its forward and gather them again for its backward
    (True, the default, as torch's ``fully_shard``: the least memory). False keeps them from the forward to the
    backward: one all-gather per layer and micro-batch instead of two (and no second cast of the shard to the compute
    dtype), for the memory of every layer's parameters in the compute dtype on every rank (ZeRO-2's trade). Only
    'fsdp2' reads it."""

    def __post_init__(self) -> None:
        check_types(self)
        require(self, "lr", self.lr > 0, "a finite float > 0")
        require(
            self,
            "max_tokens_per_micro_batch",
            self.max_tokens_per_micro_batch is None or self.max_tokens_per_micro_batch >= 1,
            "None or an int >= 1",
        )
        require(
            self, "logits_chunk_mib", self.logits_chunk_mib is None or self.logits_chunk_mib >= 1, "None or an int >= 1"
        )
        require(self, "weight_decay", self.weight_decay >= 0, "a finite float >= 0")
        require(self, "betas", all(0 <= b < 1 for b in self.betas), "two floats, each in [0, 1)")
        require(
            self,
            "max_grad_norm",
            self.max_grad_norm is None or self.max_grad_norm > 0,
            "None or a finite float > 0",
        )
        require(self, "micro_batch_size", self.micro_batch_size >= 1, "an int >= 1")
        require(self, "max_steps", self.max_steps >= 1, "an int >= 1")
        require(self, "checkpoint_every", self.checkpoint_every >= 0, "an int >= 0 (0 = only at the end)")
        require(self, "keep_checkpoints", self.keep_checkpoints >= 1, "an int >= 1")
        require(
            self,
            "resume_from",
            self.resume_from is None or self.resume_from.strip() != "",
            "None, 'latest', 'auto' or the path of a step_N checkpoint directory",
        )
        require(self, "eval_every", self.eval_every >= 0, "an int >= 0 (0 = never)")
        require(self, "warmup_steps", self.warmup_steps >= 0, "an int >= 0 (0 = no warm-up)")
        require(self, "ppo_epochs", self.ppo_epochs >= 1, "an int >= 1")
        require(
            self, "mini_batch_size", self.mini_batch_size is None or self.mini_batch_size >= 1, "None or an int >= 1"
        )
        require(self, "lora_rank", self.lora_rank >= 0, "an int >= 0 (0 = full fine-tuning)")
        require(self, "lora_alpha", self.lora_alpha > 0, "a finite float > 0")
        require(self, "lora_dropout", 0 <= self.lora_dropout < 1, "a float in [0, 1)")
        require(
            self,
            "lora_target_modules",
            len(self.lora_target_modules) > 0 and all(m.strip() for m in self.lora_target_modules),
            "a non-empty tuple of non-empty module names, e.g. ('all-linear',) or ('q_proj', 'v_proj')",
        )
        require(
            self,
            "parallelism",
            self.lora_rank == 0 or self.parallelism == "ddp",
            "'ddp' when lora_rank > 0 (LoRA adapters are trained on DDP ranks only)",
        )
        require(
            self,
            "fsdp_reshard_after_forward",
            self.fsdp_reshard_after_forward or self.parallelism == "fsdp2",
            "True unless parallelism is 'fsdp2' (only FSDP2 reshards)",
        )


# What each AlgorithmConfig.name fixes. 'grpo' fixes nothing: it is the pre-preset behaviour, every field
# explicit. A preset can only fix an existing field to that field's own default (otherwise the default could
# not be told from an explicit contradiction); the new fields default to None, meaning "the preset's value".
_ALGORITHM_PRESETS: dict[str, dict[str, object]] = {
    "grpo": {},
    "dr_grpo": {"advantage": "dr_grpo", "loss_agg": "seq_sum_fixed_len"},
    "dapo": {"advantage": "grpo", "scale_rewards": True, "loss_agg": "token_mean", "kl_coef": 0.0},
    "rloo": {"advantage": "rloo"},
    "reinforce_pp": {"advantage": "reinforce_pp"},
    "reinforce_pp_baseline": {"advantage": "reinforce_pp_baseline"},
    "gspo": {"advantage": "grpo", "ratio_level": "sequence", "loss_agg": "seq_mean_token_mean"},
}
# What a None field means when the preset does not fix it: the behaviour before presets existed.
_ALGORITHM_BASE = {"advantage": "grpo", "loss_agg": "token_mean", "ratio_level": "token"}


@dataclass
class AlgorithmConfig:
    """The policy-gradient algorithm: a named preset plus explicit switches (see docs/howto/algorithms.md).

    ``name`` is a preset that fixes some of the other fields. A field the preset fixes may be left at None
    (or its default) or set to the same value; a different value raises ConfigError naming the field, its
    value and the preset. Fields a preset does not fix keep their own values. ``resolved()`` returns the
    config with every None filled in, which is what the trainer uses.

    - 'grpo' (default): fixes nothing; with every other field at its default this is the behaviour before
      presets existed: GRPO advantages (std-scaled per ``scale_rewards``), token-level PPO ratio, DAPO's
      token-level mean.
    - 'dr_grpo': advantage 'dr_grpo' (group-centred, no std), loss_agg 'seq_sum_fixed_len' (Liu et al. 2025).
    - 'dapo': advantage 'grpo' with scale_rewards True, loss_agg 'token_mean', kl_coef 0 (Yu et al. 2025).
      Clip-higher is NOT fixed (clip_eps_high's default 0.2 cannot be told from an explicit 0.2): set
      clip_eps_high=0.28 as in the paper. Dynamic sampling and overlong shaping are not implemented.
    - 'rloo': advantage 'rloo' (Ahmadian et al. 2024); needs rollout.group_size >= 2.
    - 'reinforce_pp' / 'reinforce_pp_baseline': advantage of the same name (Hu 2025).
    - 'gspo': advantage 'grpo', ratio_level 'sequence', loss_agg 'seq_mean_token_mean' (Zheng et al. 2025).
      The paper's clip range (3e-4, 4e-4) is NOT fixed: set clip_eps_low/clip_eps_high explicitly.
    """

    name: Literal["grpo", "dr_grpo", "dapo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gspo"] = "grpo"
    """Preset: 'grpo', 'dr_grpo', 'dapo', 'rloo', 'reinforce_pp', 'reinforce_pp_baseline' or 'gspo'."""
    clip_eps_low: float = 0.2
    """Lower PPO clip range: the ratio is clipped below at 1 - clip_eps_low; in (0, 1)."""
    clip_eps_high: float = 0.2
    """Upper PPO clip range: the ratio is clipped above at 1 + clip_eps_high; > 0."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the reference policy, >= 0; 0 = no penalty."""
    scale_rewards: bool = True
    """Divide group-centred rewards by the group's reward std; read by advantage 'grpo' only."""
    adv_eps: float = 1e-6
    """Added to a std before dividing by it, > 0 (internal)."""
    # Added after adv_eps (not before it, as the field-order rule would put them) so that positional
    # construction of the fields above keeps working.
    advantage: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"] | None = None
    """Advantage estimator: 'grpo', 'dr_grpo', 'rloo', 'reinforce_pp', 'reinforce_pp_baseline'; None = the
    preset's (or 'grpo')."""
    loss_agg: Literal["token_mean", "seq_mean_token_mean", "seq_sum_fixed_len"] | None = None
    """Loss aggregation: 'token_mean' (DAPO), 'seq_mean_token_mean' (GRPO paper) or 'seq_sum_fixed_len' (Dr. GRPO,
    divides by rollout.max_new_tokens); None = the preset's (or 'token_mean')."""
    ratio_level: Literal["token", "sequence"] | None = None
    """Importance ratio: 'token' (PPO) or 'sequence' (GSPO); None = the preset's (or 'token')."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator of the kl_coef penalty: 'k1', 'k2' or 'k3' (Schulman 2020). As a loss term k2's expected gradient is
    that of KL(pi||ref), k3's that of KL(ref||pi), and k1's is zero: 'k1' with kl_coef > 0 warns (UserWarning), see
    docs/howto/algorithms.md."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus subtracted from the loss, >= 0; 0 = none."""
    off_policy: Literal["none", "tis", "decoupled"] = "none"
    """Correction for sampling with the engine instead of the trainer: 'none' (the PPO ratio is taken against the
    engine's logprobs), 'tis' (ratio against the trainer's logprobs, times the importance weight trainer/engine
    truncated at is_cap) or 'decoupled' (the same weight, tokens whose weight exceeds is_cap dropped; decoupled PPO)."""
    is_cap: float = 2.0
    """Cap C of the off_policy importance weight, > 0 (TIS note: C = 2)."""

    def __post_init__(self) -> None:
        check_types(self)
        require(self, "clip_eps_low", 0 < self.clip_eps_low < 1, "a float in (0, 1)")
        require(self, "clip_eps_high", self.clip_eps_high > 0, "a finite float > 0")
        require(self, "kl_coef", self.kl_coef >= 0, "a finite float >= 0")
        require(self, "adv_eps", self.adv_eps > 0, "a finite float > 0")
        require(self, "entropy_coef", self.entropy_coef >= 0, "a finite float >= 0")
        require(self, "is_cap", self.is_cap > 0, "a finite float > 0")
        if self.kl_coef > 0 and self.kl_estimator == "k1":
            # A warning, not a ConfigError: configs that ran before keep running; the derivation is in the docs.
            warnings.warn(
                f"AlgorithmConfig.kl_estimator='k1' with kl_coef={self.kl_coef!r} > 0 penalises nothing: k1's "
                "expected gradient is zero. Use 'k2' (gradient of KL(pi||ref)) or 'k3' (gradient of KL(ref||pi)); "
                "see docs/howto/algorithms.md.",
                UserWarning,
                stacklevel=3,
            )
        for field, fixed in _ALGORITHM_PRESETS[self.name].items():
            value = getattr(self, field)
            if value is not None and value != fixed:
                raise ConfigError(
                    f"AlgorithmConfig.{field}",
                    value,
                    f"{fixed!r}{' or None' if field in _ALGORITHM_BASE else ''} "
                    f"(AlgorithmConfig.name={self.name!r} fixes it)",
                )

    def resolved(self) -> AlgorithmConfig:
        """This config with every None field set to the preset's value, or to the pre-preset behaviour."""
        preset = _ALGORITHM_PRESETS[self.name]
        filled = {f: preset.get(f, base) for f, base in _ALGORITHM_BASE.items() if getattr(self, f) is None}
        return dataclasses.replace(self, **filled) if filled else self


@dataclass
class RolloutConfig:
    """How completions are sampled, and how stale samples are treated."""

    group_size: int = 16
    """Completions sampled per prompt, >= 1."""
    max_new_tokens: int = 32
    """Most tokens generated per completion, >= 1."""
    temperature: float = 1.0
    """Sampling temperature, > 0."""
    top_p: float = 1.0
    """Nucleus-sampling mass, in (0, 1]; 1.0 = off."""
    top_k: int = 0
    """Sample from the k most likely tokens, >= 0; 0 = off."""
    max_staleness: int = 0
    """Most weight versions a sample may lag the trainer by, >= 0."""
    stale_policy: Literal["raise", "drop"] = "raise"
    """What an update does with samples staler than max_staleness: 'raise' or 'drop' (counted)."""
    mode: Literal["sequential", "async"] = "sequential"
    """'sequential' (each ``Session.rollout()`` generates its batch then and there: on-policy, the default, and the
    notebook default) or 'async' (overlapped: as soon as a batch is handed out, the next one is generated in the
    background while the ranks train, so it is one version behind; a weight sync during that generation is applied
    between decode steps and its tokens carry both versions). 'async' needs max_staleness >= 1. See
    docs/howto/async.md."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling (Yu et al. 2025): ``Session.reward`` drops the groups whose rewards are all equal (zero
    advantage: no gradient) and samples new prompts until the batch holds ``data.prompts_per_step`` informative groups,
    or max_sampling_rounds rounds ran (then the batch is smaller; see docs/howto/algorithms.md). Needs
    group_size >= 2."""
    max_sampling_rounds: int = 4
    """Most generation rounds per batch with dynamic_sampling (the first included), >= 1."""
    stop: tuple[str, ...] = ()
    """Strings that end a completion, besides the model's EOS ids (every id of its ``generation_config.eos_token_id``
    and the tokenizer's), on every engine alike, as vLLM's ``stop``: the decoded completion text (special tokens
    skipped) is matched after each token; the token that completes a stop string is the completion's last and is trained
    on like an EOS token, and the completion text a reward function reads is cut before the string. Each a non-empty
    string; () = none."""

    def __post_init__(self) -> None:
        check_types(self)
        require(self, "group_size", self.group_size >= 1, "an int >= 1")
        require(self, "stop", all(text != "" for text in self.stop), "a list of non-empty strings")
        require(self, "max_new_tokens", self.max_new_tokens >= 1, "an int >= 1")
        require(self, "temperature", self.temperature > 0, "a finite float > 0")
        require(self, "top_p", 0 < self.top_p <= 1, "a float in (0, 1]")
        require(self, "top_k", self.top_k >= 0, "an int >= 0 (0 = off)")
        require(self, "max_staleness", self.max_staleness >= 0, "an int >= 0")
        require(
            self,
            "max_staleness",
            self.mode == "sequential" or self.max_staleness >= 1,
            "an int >= 1 when mode='async' (a batch generated while the ranks train is one version behind)",
        )
        require(self, "max_sampling_rounds", self.max_sampling_rounds >= 1, "an int >= 1")
        require(
            self,
            "group_size",
            not self.dynamic_sampling or self.group_size >= 2,
            "an int >= 2 with dynamic_sampling (a group of one sample never has unequal rewards)",
        )


@dataclass
class DataConfig:
    """The prompt data set (see docs/howto/data.md)."""

    task: Literal["reverse_digits", "arithmetic", "countdown", "file"] = "reverse_digits"
    """Where prompts come from: 'reverse_digits' (generated, as in 123> -> 321), 'arithmetic' (generated, as
    in 12+7= -> 19), 'countdown' (generated: reach a target from numbers with + - * /) or 'file' (the local data set at
    path)."""
    prompts_per_step: int = 16
    """Prompts per update step, >= 1."""
    min_digits: int = 3
    """Generated tasks: fewest digits in a generated number (the reversed string, each operand, each countdown
    number), >= 1."""
    max_digits: int = 3
    """Generated tasks: most digits in a generated number, >= min_digits."""
    num_examples: int = 10000
    """Generated tasks: examples in the generated data set, >= 1 (ignored for 'file')."""
    path: str | None = None
    """task='file' only (and then required): a local .jsonl, .parquet or .arrow file, or a directory written by
    datasets' save_to_disk; existence, format and columns are checked when the Session starts."""
    prompt_column: str = "prompt"
    """The column holding the prompts: text, or chat messages (lists of {'role', 'content'}) with chat_template; its
    content reaches the model as the 'prompt' column, and every other column reaches reward functions.
    Non-empty; 'prompt' unless task='file'."""
    chat_template: bool = False
    """Wrap each prompt with the tokenizer's chat template (a text prompt becomes one user message; a generation prompt
    is added); the model's tokenizer must have one."""
    max_prompt_tokens: int | None = None
    """Drop prompts longer than this many tokens (the count is logged); None = keep all, else >= 1."""
    system_prompt: str | None = None
    """With chat_template only: a system message put before prompts that have none; None = none."""
    split: str = "train"
    """task='file' with a saved DatasetDict directory: the split to use, non-empty."""
    countdown_numbers: int = 3
    """task='countdown': numbers offered per puzzle, in [2, 6]."""
    eval_path: str | None = None
    """The held-out prompts ``Session.evaluate(None, ...)`` (and ``train.eval_every``) score: a local file
    or ``save_to_disk`` directory as for path, prepared as the training prompts are (prompt_column, chat_template,
    system_prompt, max_prompt_tokens); None = a freshly seeded sample of a generated task (task='file' then needs the
    prompts passed to evaluate). Checked when the Session starts."""
    eval_split: str = "test"
    """With an eval_path directory holding a saved DatasetDict: the split to score, non-empty."""

    def __post_init__(self) -> None:
        check_types(self)
        require(
            self,
            "eval_path",
            self.eval_path is None or self.eval_path.strip() != "",
            "None or a non-empty local path",
        )
        require(self, "eval_split", self.eval_split.strip() != "", "a non-empty split name")
        require(
            self,
            "path",
            (self.path is not None and self.path.strip() != "") if self.task == "file" else self.path is None,
            "a non-empty local path when task='file', else None",
        )
        require(
            self,
            "prompt_column",
            self.prompt_column.strip() != "" and (self.task == "file" or self.prompt_column == "prompt"),
            "a non-empty column name; 'prompt' unless task='file'",
        )
        require(
            self,
            "max_prompt_tokens",
            self.max_prompt_tokens is None or self.max_prompt_tokens >= 1,
            "None or an int >= 1",
        )
        require(
            self,
            "system_prompt",
            self.system_prompt is None or self.chat_template,
            "None unless chat_template=True",
        )
        require(self, "split", self.split.strip() != "", "a non-empty split name")
        require(self, "countdown_numbers", 2 <= self.countdown_numbers <= 6, "an int in [2, 6]")
        require(self, "prompts_per_step", self.prompts_per_step >= 1, "an int >= 1")
        require(self, "min_digits", self.min_digits >= 1, "an int >= 1")
        require(
            self,
            "max_digits",
            self.max_digits >= self.min_digits,
            f"an int >= min_digits (= {self.min_digits})",
        )
        require(self, "num_examples", self.num_examples >= 1, "an int >= 1")


@dataclass
class ObserveConfig:
    """Logs, metrics and artifacts."""

    output_dir: str = "outputs/run"
    """Output root for logs, TensorBoard events and checkpoints (non-empty)."""
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """Lowest level logged: 'DEBUG', 'INFO', 'WARNING' or 'ERROR'."""
    tensorboard: bool = True
    """Write TensorBoard events under output_dir."""
    console: bool = True
    """Show rank-tagged logs on the terminal."""
    moving_average: int = 10
    """Window, in steps, of the reward moving mean, >= 1."""
    output_mode: str = "0700"
    """Permission bits, as an octal string, of the directories a run creates under output_dir (logs, TensorBoard,
    checkpoints, traces) and, without the execute bits, of the files in them; ranks create theirs under the matching
    umask. '0700' (default): private to you (docs/security.md); e.g. '0750' to let your group read a shared project
    directory. Must give you rwx and never let others write. Directories that already exist keep their mode."""

    def __post_init__(self) -> None:
        check_types(self)
        require(self, "output_dir", self.output_dir.strip() != "", "a non-empty directory path")
        require(self, "moving_average", self.moving_average >= 1, "an int >= 1")
        mode = int(self.output_mode, 8) if re.fullmatch(r"0?[0-7]{3}", self.output_mode) else None
        require(
            self,
            "output_mode",
            mode is not None and mode & 0o700 == 0o700 and mode & 0o002 == 0,
            "an octal mode string such as '0700' (private) or '0750' (group may read): the owner needs rwx "
            "(0700) and others may never write (no 0002 bit)",
        )
