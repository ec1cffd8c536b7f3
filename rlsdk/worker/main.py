"""The rank's command loop.

Start-up order matters: set the parent-death signal first (so a dead launcher takes this rank with it),
connect the control channel and ship logs, then create the process group and the ``Accelerator`` for the device
the launcher chose (``$RLSDK_DEVICE``, :mod:`rlsdk.config.device`: CPU on gloo, or one CUDA GPU per rank on NCCL).
Commands arrive with sequence numbers and run in that order on every rank (SPMD).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from rlsdk.debug.tracer import set_command
from rlsdk.launch.pdeathsig import set_parent_death_signal
from rlsdk.observe.logging import get_logger, install_rank_logging, set_log_context

if TYPE_CHECKING:
    from rlsdk.config.device import Device

logger = get_logger(__name__)


class Worker:
    """Holds the rank's state; one method per command."""

    def __init__(
        self,
        accelerator: Any,
        rank: int,
        world_size: int,
        *,
        report_progress: Callable[[int, int], None] | None = None,
        startup: dict[str, float] | None = None,
    ) -> None:
        self.accelerator = accelerator
        # Wall-clock marks of this rank's start-up (see main()), reported once with the init result.
        self.startup = startup
        self.rank = rank
        self.world_size = world_size
        self.engine: Any = None
        self.nccl: Any = None  # NcclRankSide of broadcast_weights_nccl, made on first use
        self.ipc: Any = None  # IpcRankSide of share_weights_ipc, made on first use
        # (done, total) of the running command, shown by the Session's progress bars (RankChannel.set_progress)
        self.report_progress = report_progress
        self.handlers: dict[str, Callable[[dict[str, Any]], Any]] = {
            "noop": self.noop,
            "init": self.init,
            "update": self.update,
            "sft_update": self.sft_update,
            "weight_info": self.weight_info,
            "generate": self.generate,
            "export_weights": self.export_weights,
            "save_checkpoint": self.save_checkpoint,
            "broadcast_weights_nccl": self.broadcast_weights_nccl,
            "share_weights_ipc": self.share_weights_ipc,
            "raise": self.raise_error,
            "call_function": self.call_function,
        }

    def _require_engine(self) -> Any:
        if self.engine is None:
            raise RuntimeError("the train engine is not initialised: the Session sends 'init' first")
        return self.engine

    def noop(self, body: dict[str, Any]) -> dict[str, Any]:
        return {"rank": self.rank}

    def raise_error(self, body: dict[str, Any]) -> None:
        """Raise the given message (tests use it to check error reporting)."""
        raise RuntimeError(body.get("message", "requested error"))

    def call_function(self, body: dict[str, Any]) -> Any:
        """Run ``module:function(worker, **kwargs)`` from ``body["target"]`` / ``body["kwargs"]`` on every rank
        (a custom rank command, e.g. a debugging probe; the module must be importable on the ranks)."""
        import importlib

        module_name, _, function_name = str(body["target"]).partition(":")
        function = getattr(importlib.import_module(module_name), function_name)
        return function(self, **body.get("kwargs", {}))

    def init(self, body: dict[str, Any]) -> dict[str, Any]:
        began = time.time()
        info = self._init(body)
        if self.startup is not None:
            info["startup"] = {**self.startup, "init_begin": began, "init_end": time.time()}
            self.startup = None
        return info

    def _init(self, body: dict[str, Any]) -> dict[str, Any]:
        from rlsdk.config import SessionConfig, config_from_dict
        from rlsdk.engine.train.engine import TrainEngine

        config = config_from_dict(SessionConfig, body["config"])
        logging.getLogger("rlsdk").setLevel(config.observe.log_level)
        self.engine = TrainEngine(config, self.accelerator, resume_from=body.get("resume_from"))
        self.engine.on_progress = self.report_progress
        # Every rank calls it (a collective with train.parallelism 'fsdp2'); only rank 0 computes the checksum.
        info = self.engine.weight_info(with_checksum=self.rank == 0)
        if self.engine.base_checksum is not None:  # LoRA: the frozen base's, for the engine's start-up check
            info["base_checksum"] = self.engine.base_checksum
        expected = self.engine.resumed_checksum
        loaded = info.get("checksum")
        if expected is not None and self._legacy_checksum(expected):
            # A checkpoint from before XXH3 recorded a BLAKE3 or SHA-256 checksum: verify with the algorithm it
            # names (one more pass over the weights, only on such a resume); the Session goes on with the current
            # algorithm.
            from rlsdk.engine.weights import checksum_algorithm

            loaded = self.engine.weight_info(with_checksum=self.rank == 0, algorithm=checksum_algorithm(expected)).get(
                "checksum"
            )
        if loaded is not None and expected is not None and loaded != expected:
            from rlsdk.versioning import WeightMismatchError

            raise WeightMismatchError(
                f"weights loaded from {body['resume_from']} have checksum {loaded[:12]}, "
                f"the checkpoint recorded {expected[:12]}"
            )
        return info

    @staticmethod
    def _legacy_checksum(checksum: str) -> bool:
        from rlsdk.engine.weights import CHECKSUM_ALGORITHM, checksum_algorithm

        return checksum_algorithm(checksum) != CHECKSUM_ALGORITHM

    def update(self, body: dict[str, Any]) -> dict[str, Any]:
        """One update (``train.ppo_epochs`` x mini-batches optimizer steps). With ``then_generate`` (a ``generate``
        body: the colocated engine's look-ahead), this rank then samples its share of the next batch with the new
        weights and returns it as ``then_generate``; a generation that raises leaves the update's result standing
        and returns ``then_generate_error`` instead (the Session then generates the batch with a plain
        ``generate`` command, which raises it again)."""
        result = self._require_engine().update(
            body["shard"],
            body["num_tokens"],
            num_sequences_global=body.get("num_sequences"),
            with_checksum=bool(body.get("with_checksum", False)),
            minibatches=[tuple(m) for m in body["minibatches"]] if body.get("minibatches") else None,
        )
        then_generate = body.get("then_generate")
        if then_generate is not None:
            try:
                result["then_generate"] = self.generate(then_generate)
            except Exception as exc:
                logger.debug("look-ahead generation after update failed", exc_info=True)
                result["then_generate_error"] = f"{type(exc).__name__}: {exc}"
        return result

    def sft_update(self, body: dict[str, Any]) -> dict[str, Any]:
        """One supervised fine-tuning step (``Session.sft_update``): see ``TrainEngine.sft_update``."""
        return self._require_engine().sft_update(
            body["shard"], body["num_tokens"], lr=body.get("lr"), with_checksum=bool(body.get("with_checksum", False))
        )

    def weight_info(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._require_engine().weight_info()

    def generate(self, body: dict[str, Any]) -> dict[str, Any]:
        """Colocated generation (``inference.engine='colocated'``): this rank's share of the prompts."""
        from rlsdk.engine.inference.colocated import unpack_prompts

        return self._require_engine().generate(
            unpack_prompts(body),
            body["params"],
            pad_token_id=body["pad_token_id"],
            eos_token_id=body["eos_token_id"],
            max_batch_size=body["max_batch_size"],
            seed=body.get("seed"),
        )

    def export_weights(self, body: dict[str, Any]) -> dict[str, Any]:
        # Every rank calls it (the 'fsdp2' gather is a collective); only ``src`` writes.
        return self._require_engine().export_weights(body["publish_dir"], is_writer=self.rank == body.get("src", 0))

    def save_checkpoint(self, body: dict[str, Any]) -> list[str]:
        return self._require_engine().save_checkpoint(body["directory"], is_writer=self.rank == 0)

    def broadcast_weights_nccl(self, body: dict[str, Any]) -> dict[str, Any] | None:
        """The trainer's half of the GPU weight sync (``launch.gpus_per_node > 0``): ``body["step"]`` is
        'address', 'join', 'layout' or 'send' (see :class:`rlsdk.engine.inference.nccl_sync.NcclRankSide`).
        Every rank runs every step ('layout' gathers the weights, a collective with 'fsdp2'); rank 0 answers,
        the others return None. Needs CUDA and vLLM on rank 0."""
        from rlsdk.engine.inference.nccl_sync import NcclRankSide

        if self.nccl is None:
            self.nccl = NcclRankSide(self.rank)
        return self.nccl.handle(self._require_engine(), body)

    def share_weights_ipc(self, body: dict[str, Any]) -> dict[str, Any] | None:
        """The trainer's half of the weight sync to a vLLM server on the rank's own GPU (one card):
        ``body["step"]`` is 'export' or 'release' (see :class:`rlsdk.engine.inference.ipc_sync.IpcRankSide`).
        Every rank runs every step ('export' gathers the weights, a collective with 'fsdp2'); rank 0 answers, the
        others return None. Needs CUDA on rank 0."""
        from rlsdk.engine.inference.ipc_sync import IpcRankSide

        if self.ipc is None:
            self.ipc = IpcRankSide(self.rank)
        return self.ipc.handle(self._require_engine(), body)


def main() -> None:
    startup = {"imported": time.time()}  # this module's imports (torch) are done
    set_parent_death_signal(signal.SIGTERM)
    # Checkpoints, published weights and traces this rank writes get observe.output_mode (0700/0600 by default).
    os.umask(int(os.environ.get("RLSDK_UMASK", "0o077"), 8))
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(int(os.environ.get("RLSDK_THREADS_PER_RANK", "1")))

    from rlsdk.control.rank import RankChannel

    channel = RankChannel.from_env(rank, world_size)
    channel.connect()
    startup["connected"] = time.time()
    install_rank_logging(
        channel.send_log, rank=rank, world_size=world_size, level=int(os.environ.get("RLSDK_LOG_LEVEL", "20"))
    )
    set_log_context(version=0)
    code = 0
    try:
        from accelerate import Accelerator

        from rlsdk.config.device import accelerator_kwargs, rank_device

        device = rank_device()
        if device == "cpu":
            from rlsdk.engine.train.host_allocator import configure_host_allocator

            # before the model loads: large freed tensors go back to the system, not into glibc's arenas
            configure_host_allocator()
        accelerator = Accelerator(**accelerator_kwargs(device), kwargs_handlers=_process_group(channel, device))
        if accelerator.process_index != rank or accelerator.num_processes != world_size:
            raise RuntimeError(
                f"accelerate reports rank {accelerator.process_index}/{accelerator.num_processes}, "
                f"the launcher assigned {rank}/{world_size}"
            )
        startup["process_group"] = time.time()
        startup["process_start"] = _process_start_time()
        worker = Worker(accelerator, rank, world_size, report_progress=channel.set_progress, startup=startup)
        logger.debug("rank %d/%d ready (pid %d)", rank, world_size, os.getpid())
        _serve(channel, worker)
    except Exception:
        logger.exception("rank %d failed outside a command", rank)
        code = 1
    finally:
        _shutdown(channel)
    # Leave without the interpreter's teardown: with torch and transformers loaded, finalize_modules' garbage
    # collection alone took seconds (a gdb stack of a rank that had shut down), and the Session waits for this
    # exit in close(). Nothing is left to flush: commands are done, logs went through the closed channel, the
    # shared-memory segment was unlinked at start, the process group is destroyed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _process_start_time() -> float:
    """When this process was created (wall clock); its start-up marks count from here."""
    import psutil

    return float(psutil.Process(os.getpid()).create_time())


def _serve(channel: Any, worker: Worker) -> None:
    while True:
        command = channel.recv_command()
        if command is None:
            continue
        if command.name == "shutdown":
            logger.debug("shutdown requested")
            return
        handler = worker.handlers.get(command.name)
        channel.set_current(command.name, command.seq)
        set_command(command.name, command.seq)
        try:
            if handler is None:
                raise ValueError(f"unknown command {command.name!r}; known: {sorted(worker.handlers)}")
            result = handler(command.body or {})
        except Exception as exc:
            logger.debug("command %s (seq %d) failed", command.name, command.seq, exc_info=True)
            channel.send_error(command.seq, exc)
        else:
            channel.send_result(command.seq, result)
        finally:
            channel.set_current(None, None)
            set_command(None, None)


def _process_group(channel: Any, device: Device = "cpu") -> list[Any]:
    """Create the default process group before accelerate does: on CPU on the ``traced`` backend when
    ``RLSDK_TRACER=1`` or ``RLSDK_SHM_ALLREDUCE=1`` (accelerate refuses other backend names but uses an existing
    group; without the tracer the group records nothing and only routes all-reduces through shared memory),
    with the ``RLSDK_PG_TIMEOUT_S`` timeout. On one machine the group meets through a file store in the session's
    private directory (:mod:`rlsdk.launch.rendezvous`), never a TCP store. Returns accelerate's kwargs handlers
    when accelerate creates a plain group itself (``env://``, several machines).

    On CUDA (``device``) the traced backend and the shared-memory all-reduce, both CPU-only, are not used: the
    rank takes its GPU (``cuda:LOCAL_RANK``) and NCCL's own Flight Recorder records the collectives
    (``TORCH_NCCL_TRACE_BUFFER_SIZE``, set by the launcher with the tracer)."""
    import datetime

    from rlsdk.config.device import local_device, process_group_backend

    timeout_text = os.environ.get("RLSDK_PG_TIMEOUT_S", "")
    timeout_s = float(timeout_text) if timeout_text else None
    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    from rlsdk.debug.rank import install_trace_query
    from rlsdk.launch.rendezvous import rank_store

    record = os.environ.get("RLSDK_TRACER") == "1"
    # stacks of every thread, with or without the tracer; on CUDA the records come from NCCL's Flight Recorder
    install_trace_query(channel, flight_recorder=record and device == "cuda")
    shm_allreduce = os.environ.get("RLSDK_SHM_ALLREDUCE") == "1"
    store = rank_store(int(os.environ["WORLD_SIZE"]), timeout)
    if device == "cuda":
        torch.cuda.set_device(local_device(device, int(os.environ.get("LOCAL_RANK", "0"))))
    elif record or shm_allreduce:
        from rlsdk.debug.tracer import init_traced_process_group

        init_traced_process_group(timeout_s, record=record, shm_allreduce=shm_allreduce, store=store)
        return []
    if store is not None or device == "cuda":
        # On CUDA also over env:// (several machines): accelerate would make an NCCL-only group, without the CPU
        # path object collectives need.
        import torch.distributed as dist

        kwargs: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        backend = process_group_backend(device)
        if store is None:
            dist.init_process_group(backend, init_method="env://", **kwargs)
        else:
            rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, **kwargs)
        return []
    if timeout is None:
        return []
    from accelerate.utils import InitProcessGroupKwargs

    return [InitProcessGroupKwargs(timeout=timeout)]


def _shutdown(channel: Any) -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    channel.close()
