"""The one place that decides the train ranks' device: CPU with gloo, or CUDA with NCCL.

Everything else asks this module: the config spells its backend choice with :data:`CpuBackend`, the launchers put
:meth:`DevicePlan.rank_environment` into the ranks' environment and :meth:`DevicePlan.accelerate_launch_args` into
``accelerate launch``, and the rank builds its ``Accelerator`` and process group from :func:`accelerator_kwargs` and
:func:`process_group_backend` of the device it was given. No other module hard-codes a device or a backend name.

It lives in ``rlsdk.config`` because the config must name the backend (``launch.backend``) and may import no other
rlsdk module, while the worker, the launchers, the engines and the tracer may all import the config. It imports
nothing heavy: :func:`plan_devices` is a pure function of the configuration and of the GPU ids the controller sees
(:func:`visible_cuda_devices`, the only function here that imports torch), so a CUDA topology is tested on a CPU
machine.

Choices made here, and why:

- **CPU**: ``Accelerator(cpu=True)`` (without it every CPU rank silently believes it is rank 0) on gloo; one rank
  runs under ``accelerate launch --cpu``, several under ``--multi_gpu`` (``--cpu`` would start one process).
- **CUDA**: one GPU per rank, a rank's GPU is ``cuda:LOCAL_RANK`` of the ids in its ``CUDA_VISIBLE_DEVICES`` (the
  mapping accelerate applies itself); the process group is torch's ``cpu:gloo,cuda:nccl``, so CUDA tensors go
  through NCCL while object collectives and CPU tensors still work (NCCL alone has no CPU path).
- **Mixed precision** is applied by the train engine on both devices (autocast, or FSDP2's policy), so
  accelerate's own stays 'no': its ``prepare`` would add a second autocast and cast the whole logits tensor to
  float32, the one tensor the chunked log-probabilities exist to avoid.
- **vLLM beside the ranks** (a server the Session starts on this machine): on GPUs of its own when the machine has
  enough; on a one-GPU machine it shares the card with the one train rank, with a capped
  ``--gpu-memory-utilization`` and vLLM's sleep mode (the colocated layout TRL and verl use on one card). Any other
  shortfall of GPUs is a ConfigError naming the field to change. On Slurm and Ray the scheduler sets
  ``CUDA_VISIBLE_DEVICES`` from the allocation (``launch.gpus_per_node``) and vLLM replicas run on nodes of their own.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

from rlsdk.config.errors import ConfigError

GLOO: Final = "gloo"
"""torch.distributed's CPU backend: every collective of CPU ranks, and CPU tensors of CUDA ranks."""
NCCL: Final = "nccl"
"""torch.distributed's CUDA backend."""
CpuBackend = Literal["gloo"]
"""What ``launch.backend`` may be: the backend of CPU tensors (CUDA tensors of CUDA ranks always use NCCL)."""
DeviceChoice = Literal["auto", "cpu", "cuda"]
"""What ``launch.device`` may be."""
Device = Literal["cpu", "cuda"]

DEVICE_ENV: Final = "RLSDK_DEVICE"
"""The ranks' environment variable holding the resolved device ('cpu' or 'cuda')."""
SHARED_GPU_MEMORY_UTILIZATION: Final = 0.3
"""vLLM's ``--gpu-memory-utilization`` when it shares the one GPU with a train rank: the rest of the card is the
rank's (weights, gradients, optimizer state, activations). TRL's colocate mode defaults to the same fraction; raise
it with ``inference.vllm.extra_server_args`` when the model is small."""
NCCL_TRACE_BUFFER_SIZE: Final = 2000
"""Entries of torch's NCCL Flight Recorder ring buffer per rank (``TORCH_NCCL_TRACE_BUFFER_SIZE``) when the tracer
is on: the last collectives of each process group, readable while the main thread is stuck."""


def accelerator_kwargs(device: Device) -> dict[str, Any]:
    """The ``Accelerator(...)`` arguments of a rank on ``device`` (beyond its kwargs handlers)."""
    if device == "cpu":
        return dict(cpu=True)
    return {}


def process_group_backend(device: Device) -> str:
    """The ``backend`` argument of ``init_process_group`` for ranks on ``device``."""
    if device == "cpu":
        return GLOO
    return f"cpu:{GLOO},cuda:{NCCL}"


def accelerate_launch_args(device: Device, num_processes: int) -> list[str]:
    """The device flags of ``accelerate launch`` for ``num_processes`` ranks in all: ``--cpu`` for one CPU rank
    (``--multi_gpu`` refuses one process, and ``--cpu`` with several would start one), ``--multi_gpu`` for several
    ranks on either device, nothing for one CUDA rank; mixed precision 'no' (the train engine applies it, see the
    module docstring)."""
    if num_processes > 1:
        flag = ["--multi_gpu"]
    else:
        flag = ["--cpu"] if device == "cpu" else []
    return [*flag, "--mixed_precision", "no"]


def local_device(device: Device, local_rank: int) -> str:
    """The torch device of the rank with ``local_rank`` on its node: 'cpu', or 'cuda:LOCAL_RANK' (an index into
    the rank's ``CUDA_VISIBLE_DEVICES``)."""
    return "cpu" if device == "cpu" else f"cuda:{local_rank}"


def rank_device(environ: Mapping[str, str] | None = None) -> Device:
    """The device a rank was started for (``$RLSDK_DEVICE``; 'cpu' when unset, as ranks started before it)."""
    value = (os.environ if environ is None else environ).get(DEVICE_ENV, "cpu")
    if value not in ("cpu", "cuda"):
        raise ValueError(f"{DEVICE_ENV}={value!r}: expected 'cpu' or 'cuda' (set by the Session's launcher)")
    return value  # type: ignore[return-value]


def visible_cuda_devices(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The CUDA device ids this process sees, as ``CUDA_VISIBLE_DEVICES`` spells them (its own ids when the user
    set it, else '0'..'N-1'); empty without CUDA (``torch.cuda.is_available()`` is False)."""
    import torch

    if not torch.cuda.is_available():
        return ()
    count = torch.cuda.device_count()
    listed = (os.environ if environ is None else environ).get("CUDA_VISIBLE_DEVICES")
    if listed is not None and listed.strip():
        return tuple(part.strip() for part in listed.split(","))[:count]
    return tuple(str(i) for i in range(count))


@dataclass(frozen=True)
class DevicePlan:
    """Where the train ranks (and a vLLM server the Session starts beside them) run; from :func:`plan_devices`.

    Attributes:
        device: 'cpu' or 'cuda'.
        backend: The backend of the device's tensors: ``GLOO`` on CPU, ``NCCL`` on CUDA.
        mixed_precision: What the train engine computes in: 'no' or 'bf16' (``train.mixed_precision``).
        ranks_per_node: Train ranks on each node.
        rank_gpus: ``CUDA_VISIBLE_DEVICES`` of the ranks of this machine (one id per rank, in local-rank order);
            empty on CPU and where the scheduler sets it (Slurm, Ray).
        server_gpus: ``CUDA_VISIBLE_DEVICES`` of the vLLM server the Session starts on this machine; empty when
            it starts none on a GPU.
        shares_gpu: The vLLM server shares its GPU with a train rank (one GPU on the machine).
    """

    device: Device
    backend: str
    mixed_precision: Literal["no", "bf16"]
    ranks_per_node: int
    rank_gpus: tuple[str, ...] = ()
    server_gpus: tuple[str, ...] = ()
    shares_gpu: bool = False

    @property
    def process_group_backend(self) -> str:
        """The ``init_process_group`` backend of the ranks (see :func:`process_group_backend`)."""
        return process_group_backend(self.device)

    def accelerator_kwargs(self) -> dict[str, Any]:
        """The ``Accelerator(...)`` arguments every rank gets (see :func:`accelerator_kwargs`)."""
        return accelerator_kwargs(self.device)

    def local_device(self, local_rank: int) -> str:
        """The torch device of local rank ``local_rank`` (see :func:`local_device`)."""
        if self.device == "cuda" and self.rank_gpus and not 0 <= local_rank < len(self.rank_gpus):
            raise ValueError(f"local rank {local_rank} outside the {len(self.rank_gpus)} GPUs of this node's ranks")
        return local_device(self.device, local_rank)

    def accelerate_launch_args(self, num_processes: int) -> list[str]:
        """The device flags of ``accelerate launch`` (see :func:`accelerate_launch_args`)."""
        return accelerate_launch_args(self.device, num_processes)

    def rank_environment(self, *, tracer: bool) -> dict[str, str]:
        """What the plan adds to the ranks' environment: the device; on CUDA the ranks' GPUs (where this machine
        assigns them) and, with the ``tracer``, torch's NCCL Flight Recorder buffer."""
        env = {DEVICE_ENV: self.device}
        if self.rank_gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.rank_gpus)
        if self.device == "cuda" and tracer:
            env["TORCH_NCCL_TRACE_BUFFER_SIZE"] = str(NCCL_TRACE_BUFFER_SIZE)
        return env

    def server_environment(self) -> dict[str, str]:
        """What the plan adds to the environment of a vLLM server the Session starts on this machine."""
        return {"CUDA_VISIBLE_DEVICES": ",".join(self.server_gpus)} if self.server_gpus else {}

    def server_args(self) -> list[str]:
        """vLLM flags for a server sharing the GPU with a train rank: a capped memory fraction and sleep mode (so
        its KV cache can be freed while the rank updates)."""
        # With sleep mode the server also frees its KV cache and weights while the ranks update
        # (VLLMEngine.prepare_train, awaited before each update; woken by the next generation or sync).
        if not self.shares_gpu:
            return []
        return ["--gpu-memory-utilization", str(SHARED_GPU_MEMORY_UTILIZATION), "--enable-sleep-mode"]


def resolve_device(launch: Any, visible_gpus: Sequence[str]) -> Device:
    """``launch.device`` resolved: 'auto' is 'cuda' when the ranks would see a GPU (this machine's ``visible_gpus``
    for scheduler 'local', ``launch.gpus_per_node > 0`` for 'slurm' and 'ray'), else 'cpu'.

    Raises:
        ConfigError: 'cuda' with scheduler 'local' on a machine where torch sees no CUDA device.
    """
    local = launch.scheduler == "local"
    if launch.device == "cpu":
        return "cpu"
    if launch.device == "cuda":
        if local and not visible_gpus:
            raise ConfigError(
                "launch.device",
                "cuda",
                "'auto' or 'cpu' on this machine: torch.cuda.is_available() is False here (no CUDA device, or a "
                "CPU build of torch: see docs/howto/gpu.md, `make gpu-setup`)",
            )
        return "cuda"
    if local:
        return "cuda" if visible_gpus else "cpu"
    return "cuda" if launch.gpus_per_node > 0 else "cpu"


def plan_devices(
    launch: Any,
    *,
    mixed_precision: Literal["no", "bf16"] = "no",
    local_server_gpus: int = 0,
    visible_gpus: Sequence[str] = (),
) -> DevicePlan:
    """The device plan of ``launch`` (a :class:`~rlsdk.config.LaunchConfig`).

    ``mixed_precision``: ``train.mixed_precision``. ``local_server_gpus``: GPUs a vLLM server the Session starts
    on this machine needs (replicas x tensor-parallel size; 0 when it starts none, attaches to ``inference.vllm.url``
    or runs an in-process engine). ``visible_gpus``: the CUDA ids this machine's processes see
    (:func:`visible_cuda_devices`; used with scheduler 'local').

    Raises:
        ConfigError: before any process starts, naming the field to change: 'cuda' without a CUDA device, more
            ranks than GPUs, a vLLM server that fits neither beside the ranks nor on a shared single card, or a
            cluster node with fewer GPUs than ranks.
    """
    ranks_per_node = launch.ranks_per_node or launch.num_ranks // launch.num_nodes
    device = resolve_device(launch, visible_gpus)
    if device == "cpu":
        return DevicePlan("cpu", GLOO, mixed_precision, ranks_per_node)
    if launch.scheduler != "local":
        if launch.gpus_per_node < ranks_per_node:
            raise ConfigError(
                "launch.gpus_per_node",
                launch.gpus_per_node,
                f"at least the {ranks_per_node} train ranks per node with launch.device={launch.device!r} (one GPU "
                "per rank), or launch.device='cpu' (CPU ranks; vLLM replicas still get GPUs)",
            )
        return DevicePlan("cuda", NCCL, mixed_precision, ranks_per_node)
    gpus = tuple(visible_gpus)
    if ranks_per_node > len(gpus):
        raise ConfigError(
            "launch.num_ranks",
            launch.num_ranks,
            f"at most {len(gpus)} on this machine's {len(gpus)} GPU(s) (CUDA_VISIBLE_DEVICES ids {list(gpus)}; one "
            "GPU per rank), or launch.device='cpu'",
        )
    ranks = gpus[:ranks_per_node]
    if ranks_per_node + local_server_gpus <= len(gpus):
        server = gpus[ranks_per_node : ranks_per_node + local_server_gpus]
        return DevicePlan("cuda", NCCL, mixed_precision, ranks_per_node, ranks, server)
    if ranks_per_node == 1 and local_server_gpus == 1:
        return DevicePlan("cuda", NCCL, mixed_precision, 1, ranks, ranks, shares_gpu=True)
    raise ConfigError(
        "launch.num_ranks",
        launch.num_ranks,
        f"at most {len(gpus) - local_server_gpus} with a vLLM server of {local_server_gpus} GPU(s) on this machine's "
        f"{len(gpus)} GPU(s) (one GPU per rank, the server on GPUs of its own; it shares a GPU with a rank only on "
        "a one-GPU machine with num_ranks=1), or inference.vllm.url to attach to a server elsewhere",
    )
