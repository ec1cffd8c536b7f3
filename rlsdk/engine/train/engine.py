"""TrainEngine: one rank's model and optimizer, data-parallel by ``train.parallelism``.

'ddp': prepared by accelerate (DDP on gloo for CPU ranks). 'fsdp2': torch ``fully_shard`` per decoder layer and
the root (``rlsdk.engine.train.fsdp``); accelerate does not wrap the model or the optimizer.

Runs inside ``rlsdk.worker``. Every method is called on every rank in the same order (SPMD); the collectives are
the ones DDP / FSDP2 issue for gradients and, with 'fsdp2', the all-gathers of ``weight_info``,
``export_weights`` and ``save_checkpoint`` (which every rank therefore calls), so no collective depends on rank
or data.
"""

from __future__ import annotations

import contextlib
import os
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rlsdk.algorithms import completion_logprobs, policy_loss
from rlsdk.config import SessionConfig, TrainConfig
from rlsdk.engine.weights import CHECKSUM_ALGORITHM, ChecksumAlgorithm, state_dict_checksum
from rlsdk.observe.logging import get_logger, set_log_context

logger = get_logger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Order of the per-step metric sums packed into one tensor (one host sync per step). The controller adds the
# sums over ranks and takes the maximum of the _MAX_KEYS over ranks.
_SUM_KEYS = (
    "loss_sum", "clipped_tokens", "ratio_sum", "kl_sum", "entropy_sum", "tokens",
    "logprob_absdiff_sum", "ratio_dev_sq_sum", "objective", "is_weight_sum", "is_capped_tokens",
    "agreement_tokens", "ratio_limited_tokens",
)  # fmt: skip
# Trainer-vs-engine agreement extremes; the ratio minimum is packed negated so that every entry is a maximum.
_MAX_KEYS = ("logprob_absdiff_max", "ratio_max", "neg_ratio_min")
# Shard keys that stay on the CPU when the shard moves to the device (TrainEngine.with_prompt_groups).
HOST_KEYS = frozenset({"prompt_group_B"})


# torch dtype -> safetensors dtype code (the header's "dtype").
_SAFETENSORS_CODES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def publish_safetensors(
    state_dict: dict[str, torch.Tensor], publish_dir: str, version: int, save_new: Callable[[str], None]
) -> str:
    """Publish ``state_dict`` as ``publish_dir/v{version}.safetensors``; return that path. Older ``v*`` files go.

    When the newest published file (this version's, else the highest ``v*.safetensors``) has exactly this state
    dict's layout (its header lists the same stored tensors with the same dtypes and shapes, and every tied name
    in its metadata is still an alias of the name kept), its tensor bytes are rewritten in place (same inode,
    same size, header untouched: the file stays what ``save_model`` writes for these weights) and it is renamed
    to the new name. On ``/dev/shm`` that reuses the same memory pages, so an in-place vLLM server that keeps the
    file mapped copies the next version at memcpy speed instead of faulting in a new file
    (:class:`~rlsdk.engine.inference.vllm_worker.PublishedFile`). Otherwise (first publish, changed layout)
    ``save_new(tmp)`` writes a new file (``safetensors.torch.save_model``) that an atomic rename publishes.

    An in-place rewrite is not atomic: a reader of the old file during the rewrite would see a mix of versions.
    Readers are the engine's weight loads, and the caller publishes only after the previous load returned, so
    none runs then; a load that still read a mix (an abandoned, timed-out one) would not verify, because every
    loader checksums what it loaded.
    """
    os.makedirs(publish_dir, exist_ok=True)
    _check_publish_dir(publish_dir)
    path = os.path.join(publish_dir, f"v{version}.safetensors")
    existing = sorted(
        (p for p in Path(publish_dir).glob("v*.safetensors") if p.name[1:-12].isdigit() and p.is_file()),
        key=lambda p: (p.name != Path(path).name, -int(p.name[1:-12])),
    )
    rewritten = False
    if existing and not existing[0].is_symlink():
        try:
            rewritten = _rewrite_in_place(str(existing[0]), state_dict)
        except (OSError, KeyError, TypeError, ValueError) as exc:  # e.g. a header entry of an unexpected form
            logger.warning("rewriting %s in place failed, writing a new file: %s", existing[0], exc)
        if rewritten and str(existing[0]) != path:
            os.replace(existing[0], path)
    if not rewritten:
        tmp = f"{path}.tmp-{os.getpid()}"
        save_new(tmp)
        os.replace(tmp, path)
    for old in Path(publish_dir).glob("v*.safetensors"):
        if old.name != Path(path).name:
            with contextlib.suppress(FileNotFoundError):
                old.unlink()
    return path


def _check_publish_dir(publish_dir: str) -> None:
    """Refuse to publish into a directory another user could plant files or links in (see docs/security.md)."""
    info = os.lstat(publish_dir)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) & 0o022:
        raise PermissionError(
            f"publish directory {publish_dir!r} must be a directory (not a link) of this user that no one else may "
            f"write to (mode {oct(stat.S_IMODE(info.st_mode))}, uid {info.st_uid})"
        )


def _rewrite_in_place(path: str, state_dict: dict[str, torch.Tensor]) -> bool:
    """Overwrite the tensor bytes of the safetensors file at ``path`` with ``state_dict``'s when its header has
    exactly their layout (see :func:`publish_safetensors`); False (nothing written) when it does not."""
    import ctypes
    import json
    import struct

    # Never O_TRUNC: the file keeps its pages (and any reader's mapping stays valid). Never through a link.
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            return False
        size = info.st_size
        if size < 8:
            return False
        (header_len,) = struct.unpack("<Q", os.pread(fd, 8, 0))
        if header_len > size - 8:
            return False
        try:
            header = json.loads(os.pread(fd, header_len, 8))
        except ValueError:
            return False
        metadata = header.pop("__metadata__", None) or {}
        if set(header) | set(metadata) != set(state_dict) or set(header) & set(metadata):
            return False
        for dropped, kept in metadata.items():  # a tied name must still alias the kept tensor
            a, b = state_dict[dropped], state_dict.get(kept)
            if b is None or kept not in header or a.data_ptr() != b.data_ptr() or a.shape != b.shape:
                return False
        data_start = 8 + header_len
        writes = []
        end_of_data = 0
        for name, entry in header.items():
            tensor = state_dict[name]
            begin, end = entry["data_offsets"]
            nbytes = tensor.numel() * tensor.element_size()
            if (
                _SAFETENSORS_CODES.get(tensor.dtype) != entry["dtype"]
                or list(tensor.shape) != list(entry["shape"])
                or end - begin != nbytes
            ):
                return False
            end_of_data = max(end_of_data, end)
            writes.append((data_start + begin, tensor))
        if data_start + end_of_data != size:
            return False
        for offset, tensor in writes:
            data = tensor.detach().to("cpu").contiguous()
            nbytes = data.numel() * data.element_size()
            if nbytes == 0:
                continue
            view = memoryview((ctypes.c_char * nbytes).from_address(data.data_ptr())).cast("B")
            done = 0
            while done < nbytes:
                count = os.pwrite(fd, view[done:], offset + done)
                if count <= 0:
                    raise OSError(f"{path}: wrote {done} of {nbytes} bytes at offset {offset}")
                done += count
        return True
    finally:
        os.close(fd)


def _trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters the optimizer updates: all of them, or the adapters of a LoRA model (same order)."""
    return [p for p in model.parameters() if p.requires_grad]


def _adamw(model: torch.nn.Module, train: TrainConfig) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters with the fused kernel (one pass over each parameter, TRL's default
    'adamw_torch_fused'): the same update in less time than the per-tensor loop torch picks on CPU (it has no foreach
    default there), for plain tensors and FSDP2's sharded DTensors alike; the default implementation where a device
    has no fused kernel."""
    kwargs = {"lr": train.lr, "betas": train.betas, "weight_decay": train.weight_decay}
    try:
        return torch.optim.AdamW(_trainable(model), fused=True, **kwargs)
    except RuntimeError as exc:
        logger.debug("fused AdamW unavailable (%s); using the default implementation", exc)
        return torch.optim.AdamW(_trainable(model), **kwargs)


def _agreement_tokens(shard: dict[str, torch.Tensor]) -> torch.Tensor:
    """The tokens whose trainer and behaviour log-probs are compared (the agreement metrics): completion tokens of
    rows sampled wholly by the weights the trainer holds (``agreement_mask_B_C``, which the Session sets from the
    tokens' versions, see :func:`rlsdk.observe.rollout_metrics.current_rows_B_C`; default: every completion
    token). A row of an older version, or a partial one, differs by the policy's lag, not by a fault."""
    valid_B_C = shard["completion_mask_B_C"].bool()
    chosen_B_C = shard.get("agreement_mask_B_C")
    return valid_B_C if chosen_B_C is None else valid_B_C & chosen_B_C.bool()


class TrainEngine:
    """Model + AdamW on one rank; ``update`` takes this rank's shard of a batch and publishes version + 1.

    With ``train.lora_rank > 0`` the model is a peft LoRA model (:mod:`rlsdk.engine.lora`): only the adapters
    train, and :meth:`weight_info`, :meth:`export_weights` and checkpoints hold the adapter, not the base."""

    def __init__(self, config: SessionConfig, accelerator: Any, *, resume_from: str | None = None) -> None:
        """``resume_from``: a verified checkpoint directory (see :meth:`load_checkpoint`); None: ``model.path``
        at version 0. The reference model (``algorithm.kl_coef`` > 0) always comes from ``model.path``."""
        from transformers import AutoModelForCausalLM

        self.config = config
        self.accelerator = accelerator
        self.version = 0
        # The weights checksum the checkpoint recorded (None: not resumed, or an older checkpoint without one).
        self.resumed_checksum: str | None = None
        # Called with (micro-batches done, micro-batches in the shard) after each one; None: no reporting.
        self.on_progress: Callable[[int, int], None] | None = None
        # The sampling generator of colocated generation without a per-call seed (made on first use).
        self._generator: torch.Generator | None = None
        self._tokenizer: Any = None  # decodes colocated completions for stop strings (made on first use)
        torch.manual_seed(config.seed)
        train = config.train
        self.lora = train.lora_rank > 0
        # LoRA: the base always comes from model.path (a checkpoint holds only the adapter), checksummed once so
        # that a resume can tell it is the base the adapter was trained on.
        self.base_checksum: str | None = None
        model = AutoModelForCausalLM.from_pretrained(
            config.model.path if resume_from is None or self.lora else str(Path(resume_from) / "model"),
            dtype=_DTYPES[config.model.dtype],
            trust_remote_code=config.model.trust_remote_code,
        )
        if self.lora:
            from rlsdk.engine.lora import apply_lora, check_lora_capacity, load_adapter

            self.base_checksum = state_dict_checksum(model.state_dict())
            model = apply_lora(model, train)
            if accelerator.is_main_process:  # the same model on every rank: warn once
                check_lora_capacity(model)
            if resume_from is not None:
                model, _ = load_adapter(model, Path(resume_from) / "model")
        self.fsdp2 = train.parallelism == "fsdp2"
        # bf16 compute on float32 master weights: FSDP2 gathers bf16 parameters (its MixedPrecisionPolicy), DDP
        # runs the forward under autocast for the ranks' device type.
        self.compute_dtype = torch.bfloat16 if train.mixed_precision == "bf16" else None
        if train.gradient_checkpointing:
            # Non-reentrant: works under DDP and FSDP2, with inputs that need no grad (token ids).
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.fsdp2:
            from rlsdk.engine.train.fsdp import shard_model

            # The optimizer is built on the sharded (DTensor) parameters, so its state is sharded too.
            layers = shard_model(
                model,
                accelerator.device.type,
                accelerator.num_processes,
                compute_dtype=self.compute_dtype,
                reshard_after_forward=train.fsdp_reshard_after_forward,
            )
            logger.info("fsdp2: %d decoder layers sharded separately, then the root", layers)
            self.model: Any = model
            self.optimizer: Any = _adamw(model, train)
        else:
            self.model, self.optimizer = accelerator.prepare(model, _adamw(model, train))
            if isinstance(self.model, torch.nn.parallel.DistributedDataParallel):
                # DDP re-broadcasts rank 0's buffers before every forward that syncs gradients (meant for
                # BatchNorm statistics): a collective that makes the ranks wait for each other. A causal LM's
                # buffers (rotary inv_freq) are constants every rank builds from the same config, and DDP's
                # constructor already broadcast them once. (torch 2.13 name of broadcast_buffers.)
                self.model.forward_sync_buffers = False
        from rlsdk.engine.train.schedule import LRSchedule

        self.schedule = LRSchedule(self.optimizer, config)
        self.ref_model: torch.nn.Module | None = None
        if config.algorithm.kl_coef > 0:
            self.ref_model = AutoModelForCausalLM.from_pretrained(
                config.model.path, dtype=_DTYPES[config.model.dtype]
            ).eval()
            self.ref_model.requires_grad_(False)
            self.ref_model.to(accelerator.device)  # not prepared by accelerate: placed here
        logger.info(
            "train engine ready: %s, %d parameters (%d trained), distributed type %s",
            Path(config.model.path).name,
            sum(p.numel() for p in model.parameters()),
            sum(p.numel() for p in _trainable(model)),
            accelerator.distributed_type,
        )
        if resume_from is not None:
            self.load_checkpoint(resume_from)

    @property
    def unwrapped(self) -> torch.nn.Module:
        """The model without the DDP wrapper; with 'fsdp2' the sharded model itself (DTensor parameters)."""
        return self.model if self.fsdp2 else self.accelerator.unwrap_model(self.model)

    def full_state_dict(self, *, keep: bool) -> dict[str, torch.Tensor] | None:
        """The model's full (unsharded) state dict on the ranks that ``keep`` it, None on the others: what a weight
        transfer sends and a checksum hashes. A collective with 'fsdp2' (every rank calls it); with 'ddp' local, and
        ranks that do not keep it do nothing."""
        if self.fsdp2:
            from rlsdk.engine.train.fsdp import full_state_dict

            return full_state_dict(self.model, keep=keep)
        return self.unwrapped.state_dict() if keep else None

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The forward's mixed-precision context: autocast to ``compute_dtype`` on the ranks' device type ('ddp',
        and the reference model, which FSDP2 does not wrap); nothing where the parameters are already in it."""
        if self.compute_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.accelerator.device.type, dtype=self.compute_dtype)

    def _micro_batches(self, shard: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """This rank's micro-batches: ``train.micro_batch_size`` rows each, or packed to
        ``train.max_tokens_per_micro_batch`` (see :mod:`rlsdk.engine.train.micro_batches`), the count agreed
        with the other ranks (an all-reduce MAX every rank calls, whatever its data)."""
        train = self.config.train
        batch_size = shard["completion_ids_B_C"].shape[0]
        micro = train.micro_batch_size
        if train.max_tokens_per_micro_batch is None:
            return [
                {name: tensor[lo : lo + micro] for name, tensor in shard.items()} for lo in range(0, batch_size, micro)
            ]
        from rlsdk.engine.train import micro_batches

        prompts, completions = micro_batches.row_lengths(shard)
        plan = micro_batches.plan(
            prompts, completions, max_tokens=train.max_tokens_per_micro_batch, max_sequences=micro
        )
        count = len(plan)
        if self.accelerator.num_processes > 1:
            import torch.distributed as dist

            count_1 = torch.tensor([count], dtype=torch.long, device=self.accelerator.device)
            dist.all_reduce(count_1, op=dist.ReduceOp.MAX)
            count = int(count_1.item())
        plan = micro_batches.equalize(plan, count, prompts, completions)
        # At least 2 completion columns (unless the batch has 1): with one column the shared-prompt path makes one
        # model call instead of two, and FSDP2 ranks must make the same calls.
        floor = min(2, shard["completion_ids_B_C"].shape[1])
        return [
            micro_batches.take(
                shard, rows, max(prompts[r] for r in rows), max(floor, max(completions[r] for r in rows))
            )
            for rows in plan
        ]

    def _no_sync(self) -> contextlib.AbstractContextManager[Any]:
        """'ddp': skip the gradient all-reduce of a non-final micro-batch (gradients accumulate locally; the last
        micro-batch's backward reduces the sum). 'fsdp2': nothing is skipped: every micro-batch's backward
        reduce-scatters, and the float32 gradients accumulate in this rank's shard. Skipping would keep the whole
        model's unsharded gradients on every rank between micro-batches (FSDP2 upcasts them to the float32 reduce
        dtype: 4 bytes per parameter), the memory FSDP2 is chosen to save; the price is one reduce-scatter per
        micro-batch instead of per update."""
        if not self.fsdp2:
            return self.accelerator.no_sync(self.model)
        return contextlib.nullcontext()

    def update(
        self,
        shard: dict[str, torch.Tensor],
        num_tokens_global: int,
        *,
        num_sequences_global: int | None = None,
        with_checksum: bool = False,
        minibatches: list[tuple[int, int]] | None = None,
    ) -> dict[str, Any]:
        """``train.ppo_epochs`` passes over this rank's shard, one optimizer step per mini-batch; returns metric
        SUMS over this shard (controller reduces), as means over the epochs.

        Publishes version + 1: one update is one published weight version, however many optimizer steps it runs
        (the engine serves only what a sync publishes). See :meth:`accumulate_gradients` for the shard layout and
        normalisation, and :mod:`rlsdk.engine.train.schedule` for the mini-batch split: ``minibatches`` holds each
        mini-batch's global ``(num_tokens, num_sequences)`` over all ranks, in the order of
        :func:`~rlsdk.engine.train.schedule.minibatch_bounds`; None = one mini-batch, the whole batch
        (``num_tokens_global``, ``num_sequences_global``).

        With more than one optimizer step, the proximal ("old") log-probs are computed once first, without
        gradients, on the weights the update starts from (:meth:`proximal_logprobs`), and every step reuses them:
        the PPO ratio of ``algorithm.off_policy`` 'tis' / 'decoupled' is taken against them (it moves away from 1
        after the first step, so the clip acts), and the trainer-vs-engine agreement metrics come from them (the
        later forwards run on weights the engine never served). With ``off_policy='none'`` the ratio is against
        the engine's behaviour log-probs, as with one step. The learning-rate schedule steps after every
        optimizer step. ``with_checksum``: the result also holds the new weights' ``checksum``
        (:meth:`weight_info`; every rank must get the same flag: with 'fsdp2' it gathers), so a colocated engine
        verifies the sync without another command.
        """
        from rlsdk.engine.train.schedule import minibatch_bounds

        start = time.perf_counter()
        if self.fsdp2:
            from rlsdk.engine.train.fsdp import release_freed_memory

            # The last sync and checksum gathered whole weights (on the writer rank: all of them); glibc keeps the
            # freed pages, which would sit under this update's peak.
            release_freed_memory()
        train = self.config.train
        shard = self.on_device(self.with_prompt_groups(shard))
        bounds = minibatch_bounds(shard["completion_ids_B_C"].shape[0], train.mini_batch_size, self.world_size)
        if minibatches is None and len(bounds) == 1:
            minibatches = [(num_tokens_global, num_sequences_global)]
        if minibatches is None or len(minibatches) != len(bounds):
            raise ValueError(
                f"update got {None if minibatches is None else len(minibatches)} mini-batch normalisers for "
                f"{len(bounds)} mini-batches of train.mini_batch_size={train.mini_batch_size} over this shard"
            )
        steps = train.ppo_epochs * len(bounds)
        agreement: tuple[torch.Tensor, torch.Tensor] | None = None
        if steps > 1:
            shard = dict(shard)
            shard["old_logprobs_B_C"], agreement = self.proximal_logprobs(shard)
        num_sums = len(_SUM_KEYS)
        sums = torch.zeros(num_sums, dtype=torch.float64, device=self.accelerator.device)
        maxima = torch.full((len(_MAX_KEYS),), float("-inf"), dtype=torch.float64, device=self.accelerator.device)
        grad_norms: list[torch.Tensor] = []
        lr = self.schedule.lr()
        report = self.on_progress
        try:
            for step in range(steps):
                lo, hi = bounds[step % len(bounds)]
                num_tokens, num_sequences = minibatches[step % len(bounds)]
                if report is not None and steps > 1:
                    self.on_progress = lambda done, total, step=step: report(step * total + done, steps * total)
                result = self.accumulate_gradients(
                    {name: tensor[lo:hi] for name, tensor in shard.items()},
                    num_tokens,
                    num_sequences_global=num_sequences,
                )
                sums += result[:num_sums]
                maxima = torch.maximum(maxima, result[num_sums:])
                grad_norms.append(self._optimizer_step())
        finally:
            self.on_progress = report
        sums /= train.ppo_epochs  # means over the epochs: each epoch sees the batch's tokens once
        sums[_SUM_KEYS.index("objective")] /= len(bounds)  # the mean differentiated loss of one step
        if agreement is not None:
            for key, value in zip(("logprob_absdiff_sum", "ratio_dev_sq_sum", "agreement_tokens"), agreement[0]):
                sums[_SUM_KEYS.index(key)] = value
            maxima = agreement[1]
        self.version += 1
        set_log_context(version=self.version)
        grad_norm = torch.stack([torch.as_tensor(g, dtype=torch.float64).reshape(()) for g in grad_norms]).mean()
        values = torch.cat([sums, maxima, grad_norm.reshape(1)]).tolist()
        result_dict: dict[str, Any] = dict(zip((*_SUM_KEYS, *_MAX_KEYS, "grad_norm"), values))
        result_dict.update(
            version=self.version,
            seconds=time.perf_counter() - start,
            sequences=shard["completion_ids_B_C"].shape[0],
            optimizer_steps=steps,
            lr=lr,
        )
        if with_checksum:
            result_dict["checksum"] = self.weight_info()["checksum"]
        return result_dict

    def on_device(self, shard: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``shard`` on the ranks' device (the controller sends CPU tensors); the same tensors on CPU. Host-side
        keys (``prompt_group_B``, see :meth:`with_prompt_groups`) stay where they are."""
        device = self.accelerator.device
        return {name: tensor if name in HOST_KEYS else tensor.to(device) for name, tensor in shard.items()}

    def with_prompt_groups(self, shard: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``shard`` with ``prompt_group_B``: int64 on the CPU, equal for rows with the same prompt (ids under the
        same mask), found on the CPU copy the controller sent, so the shared-prompt pass of each micro-batch
        needs no device-host copy of the ids (:func:`~rlsdk.algorithms.logprobs.completion_logprobs`'s
        ``prompt_groups_B``). Unchanged when prompts are not shared, when it has them, or when its ids are
        already on an accelerator (then each micro-batch finds them itself)."""
        ids_B_P = shard["prompt_ids_B_P"]
        if not self._logits_options()["share_prompts"] or "prompt_group_B" in shard or ids_B_P.device.type != "cpu":
            return shard
        mask_B_P = shard["prompt_mask_B_P"].long()
        key_B_2P = torch.cat([ids_B_P.long() * mask_B_P, mask_B_P], dim=1)
        _, group_B = torch.unique(key_B_2P, dim=0, return_inverse=True)
        return {**shard, "prompt_group_B": group_B}

    @property
    def world_size(self) -> int:
        return int(self.accelerator.num_processes)

    def _optimizer_step(self) -> torch.Tensor:
        """Clip the accumulated gradients to ``train.max_grad_norm`` (None: no clipping), step the optimizer and
        the learning-rate schedule, zero the gradients. Returns the gradient norm before clipping (NaN without
        clipping), on the device: no host sync."""
        grad_norm = self._clip_and_step()
        self.schedule.step()
        return grad_norm

    def _logits_options(self) -> dict[str, Any]:
        """The keyword arguments of every trainer forward through :func:`completion_logprobs`: the sampling
        temperature, the logits chunk budget, prompt sharing, and FSDP2's data-independent model calls."""
        train = self.config.train
        chunk_mib = train.logits_chunk_mib
        return {
            "temperature": self.config.rollout.temperature,
            "max_logits_bytes": None if chunk_mib is None else chunk_mib * 2**20,
            # Gradient checkpointing keeps no key/value cache, so the shared-prompt pass would have nothing to share.
            "share_prompts": train.share_prompt_prefix and not train.gradient_checkpointing,
            "uniform_calls": self.fsdp2,
        }

    def _forward(
        self, model: Any, mb: dict[str, torch.Tensor], **options: Any
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:func:`completion_logprobs` of ``model`` over the micro-batch ``mb``, under the mixed-precision
        context; ``options`` are its keyword arguments (see :meth:`_logits_options`)."""
        with self._autocast():
            return completion_logprobs(
                model,
                mb["prompt_ids_B_P"],
                mb["prompt_mask_B_P"],
                mb["completion_ids_B_C"],
                mb["completion_mask_B_C"],
                attention_mask_B_C=mb.get("completion_attention_mask_B_C"),
                prompt_groups_B=mb.get("prompt_group_B"),
                **options,
            )

    @torch.no_grad()
    def proximal_logprobs(
        self, shard: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """The proximal ("old") log-probs of this rank's shard on the current weights, without gradients, in
        micro-batches of ``train.micro_batch_size``; and their agreement with the behaviour log-probs.

        Every rank calls it with an equal shard (with 'fsdp2' each forward all-gathers). Returns
        ``(old_logprobs_B_C, (sums, maxima))``: ``sums`` are ``logprob_absdiff_sum``, ``ratio_dev_sq_sum`` and
        ``agreement_tokens``, ``maxima`` the ``_MAX_KEYS``, of ``old - behaviour`` over the compared tokens
        (``agreement_mask_B_C``, see :meth:`accumulate_gradients`; float64, on the device).
        When the trainer holds the weights the engine sampled with, ``old`` equals the behaviour log-probs to
        float rounding, and so does the first forward of :meth:`update`'s first step.
        """
        cfg = self.config
        self.model.train()  # the mode of the gradient forwards, so the first step's ratio is exactly 1
        micro = cfg.train.micro_batch_size
        batch = shard["completion_ids_B_C"].shape[0]
        parts = []
        for lo in range(0, batch, micro):
            mb = {name: tensor[lo : lo + micro] for name, tensor in shard.items()}
            logprobs_B_C, _ = self._forward(self.model, mb, **self._logits_options())
            parts.append(logprobs_B_C.detach())
        old_B_C = torch.cat(parts)
        valid_B_C = _agreement_tokens(shard)
        log_ratio_B_C = torch.where(valid_B_C, old_B_C.double() - shard["logprobs_B_C"].double(), 0.0)
        ratio_B_C = log_ratio_B_C.exp()
        neg_inf = torch.tensor(float("-inf"), dtype=torch.float64, device=self.accelerator.device)
        sums = torch.stack([log_ratio_B_C.abs().sum(), log_ratio_B_C.expm1().square().sum(), valid_B_C.sum().double()])
        maxima = torch.stack(
            [
                torch.where(valid_B_C, log_ratio_B_C.abs(), neg_inf).max(),
                torch.where(valid_B_C, ratio_B_C, neg_inf).max(),
                torch.where(valid_B_C, -ratio_B_C, neg_inf).max(),
            ]
        )
        return old_B_C, (sums, maxima)

    def _clip_and_step(self) -> torch.Tensor:
        """Clip the accumulated gradients to ``train.max_grad_norm`` (None: no clipping), step the optimizer, zero the
        gradients. Returns the gradient norm before clipping (NaN without clipping), on the device: no host sync.
        The SFT step steps through it alone (its learning rate is the caller's); the RL update through
        :meth:`_optimizer_step`, which also steps ``train.lr_scheduler``."""
        grad_norm = torch.tensor(float("nan"), device=self.accelerator.device)
        max_norm = self.config.train.max_grad_norm
        if max_norm is not None:
            if self.fsdp2:
                from rlsdk.engine.train.fsdp import clip_grad_norm

                grad_norm = clip_grad_norm(list(self.model.parameters()), max_norm)
            else:
                grad_norm = self.accelerator.clip_grad_norm_(self.model.parameters(), max_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def accumulate_gradients(
        self, shard: dict[str, torch.Tensor], num_tokens_global: int, *, num_sequences_global: int | None = None
    ) -> torch.Tensor:
        """Forward/backward over this rank's shard in micro-batches; gradients are left on the parameters.

        ``shard`` holds ``prompt_ids_B_P``, ``prompt_mask_B_P``, ``completion_ids_B_C``, ``completion_mask_B_C``,
        ``logprobs_B_C`` (behaviour) and ``advantages_B``, and optionally ``completion_attention_mask_B_C`` (the
        completion tokens the forward attends to, a superset of ``completion_mask_B_C``: a multi-turn rollout's tool
        outputs are in context but not trained on; default: ``completion_mask_B_C``). Every rank runs the same number of
        forward/backward passes (equal shards of ``train.micro_batch_size`` rows, or token-budget micro-batches whose
        count the ranks agree on, see :meth:`_micro_batches`), so DDP's all-reduces (FSDP2's all-gathers and
        reduce-scatters) match; with 'ddp' only the last micro-batch synchronises gradients (see :meth:`_no_sync`).
        ``num_tokens_global`` is the completion-token count of the whole batch across ranks; each rank divides by
        ``num_tokens_global /
        world_size`` because DDP's all-reduce and FSDP2's reduce-scatter both AVERAGE gradients, so the result is the
        gradient of the global token-mean loss. ``num_sequences_global`` (default: this shard's sequences times the
        world size, as every rank gets an equal shard) is divided the same way for the per-sequence aggregations of
        ``algorithm.loss_agg``. Returns the metric sums (``_SUM_KEYS`` order) followed by the maxima (``_MAX_KEYS``
        order) as one float64 tensor, still on the device.

        ``algorithm.off_policy`` 'tis' / 'decoupled': the proximal ("old") logprobs are this forward's own
        logprobs, detached. That is exact here, not an approximation: the optimizer steps only after the last
        micro-batch, so every forward runs on the weights the update starts from (the trainer's "recomputed old
        logprobs" of the TIS note, at no extra forward). The PPO ratio is then exactly 1, so the clip never
        engages; the importance weight trainer/engine carries the correction. With several optimizer steps per
        update, :meth:`update` passes the proximal log-probs it computed before the first step as
        ``old_logprobs_B_C`` instead.

        Logprob agreement: every forward here runs on the weights the engine served for an on-policy batch (the
        optimizer steps only after the last micro-batch; :meth:`update` replaces these metrics with its proximal
        pass's when it steps several times), so ``|logprobs - behaviour logprobs|`` and the
        importance ratio ``exp(logprobs - behaviour logprobs)`` measure trainer-vs-engine disagreement, over the
        tokens of ``agreement_mask_B_C`` (rows the trainer's own weights sampled; one of an older version, or a
        partial one, would add the policy's lag), counted in ``agreement_tokens``. They are computed from tensors
        the loss already needs, on the device, with no extra host sync.
        """
        batch_size = self._check_update_shard(shard)
        shard = self.on_device(self.with_prompt_groups(shard))
        world = self.accelerator.num_processes
        algo = self.config.algorithm.resolved()
        if num_sequences_global is None:
            num_sequences_global = batch_size * world
        denom = num_tokens_global / world
        seq_denom = num_sequences_global / world
        self.model.train()
        sums = torch.zeros(len(_SUM_KEYS), dtype=torch.float64, device=self.accelerator.device)
        maxima = torch.full((len(_MAX_KEYS),), float("-inf"), dtype=torch.float64, device=self.accelerator.device)
        micro_batches = self._micro_batches(shard)
        if self.on_progress is not None:
            self.on_progress(0, len(micro_batches))
        logits_options = self._logits_options()
        for index, mb in enumerate(micro_batches):
            last = index == len(micro_batches) - 1
            with contextlib.nullcontext() if last else self._no_sync():
                loss, metrics, logprobs_B_C, entropy_B_C = self._micro_batch_loss(
                    mb, algo, logits_options, denom, seq_denom
                )
                self.accelerator.backward(loss)
            sums_row, maxima_row = self._micro_batch_stats(mb, loss, metrics, logprobs_B_C, entropy_B_C)
            maxima = torch.maximum(maxima, maxima_row)
            sums += sums_row
            if self.on_progress is not None:
                self.on_progress(index + 1, len(micro_batches))
        return torch.cat([sums, maxima])

    @staticmethod
    def _check_update_shard(shard: dict[str, torch.Tensor]) -> int:
        """The shard's sequence count, after checking its keys (:meth:`accumulate_gradients`) and that it has
        a sequence."""
        expected = {"prompt_ids_B_P", "prompt_mask_B_P", "completion_ids_B_C", "completion_mask_B_C",
                    "logprobs_B_C", "advantages_B"}  # fmt: skip
        # completion_attention_mask_B_C default: completion_mask_B_C (attend = train); old_logprobs_B_C (the
        # proximal log-probs of update()'s several optimizer steps) default: this forward's, detached
        # agreement_mask_B_C default: completion_mask_B_C (see _agreement_tokens)
        # prompt_group_B: with_prompt_groups's host-side labels
        optional = {"completion_attention_mask_B_C", "old_logprobs_B_C", "agreement_mask_B_C", "prompt_group_B"}
        if not expected <= set(shard) <= expected | optional:
            raise ValueError(
                f"update shard has keys {sorted(shard)}, expected {sorted(expected)} (+ optional {sorted(optional)})"
            )
        batch_size = shard["completion_ids_B_C"].shape[0]
        if batch_size == 0:
            raise ValueError("update shard is empty: every rank needs at least one sequence")
        return int(batch_size)

    def _micro_batch_loss(
        self,
        mb: dict[str, torch.Tensor],
        algo: Any,
        logits_options: dict[str, Any],
        denom: float,
        seq_denom: float,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor, torch.Tensor | None]:
        """``(loss, metrics, logprobs_B_C, entropy_B_C)`` of one micro-batch: the policy's forward (and the
        reference model's, without gradients), then :func:`policy_loss` with ``algo``'s options and the per-rank
        normalisers ``denom`` (tokens) and ``seq_denom`` (sequences). The caller runs the backward."""
        cfg = self.config
        logprobs_B_C, entropy_B_C = self._forward(
            self.model, mb, with_entropy=True, entropy_grad=algo.entropy_coef > 0, **logits_options
        )
        ref_logprobs_B_C = None
        if self.ref_model is not None:
            with torch.no_grad():
                # Not checkpointed and not sharded: its own prompt sharing, any model calls.
                ref_options = {**logits_options, "share_prompts": cfg.train.share_prompt_prefix}
                ref_options["uniform_calls"] = False
                ref_logprobs_B_C, _ = self._forward(self.ref_model, mb, **ref_options)
        correct = algo.off_policy != "none"
        loss, metrics = policy_loss(
            logprobs_B_C,
            mb.get("old_logprobs_B_C", logprobs_B_C.detach()) if correct else mb["logprobs_B_C"],
            mb["advantages_B"],
            mb["completion_mask_B_C"],
            clip_eps_low=algo.clip_eps_low,
            clip_eps_high=algo.clip_eps_high,
            loss_agg=algo.loss_agg or "token_mean",
            ratio_level=algo.ratio_level or "token",
            kl_coef=algo.kl_coef,
            kl_estimator=algo.kl_estimator,
            ref_logprobs_B_C=ref_logprobs_B_C,
            entropy_coef=algo.entropy_coef,
            entropy_B_C=entropy_B_C,
            behaviour_logprobs_B_C=mb["logprobs_B_C"] if correct else None,
            is_cap=algo.is_cap if correct else None,
            is_cap_mode="mask" if algo.off_policy == "decoupled" else "truncate",
            num_tokens=denom,
            num_sequences=seq_denom,
            max_len=cfg.rollout.max_new_tokens,
        )
        return loss, metrics, logprobs_B_C, entropy_B_C

    @staticmethod
    def _micro_batch_stats(
        mb: dict[str, torch.Tensor],
        loss: torch.Tensor,
        metrics: dict[str, torch.Tensor],
        logprobs_B_C: torch.Tensor,
        entropy_B_C: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One micro-batch's ``(sums, maxima)`` in ``_SUM_KEYS`` / ``_MAX_KEYS`` order, float64, on the device: the
        loss's metrics, the entropy, and the trainer-vs-engine agreement over :func:`_agreement_tokens`."""
        mask_B_C = mb["completion_mask_B_C"]
        entropy_sum = (
            (entropy_B_C.detach() * mask_B_C).sum()
            if entropy_B_C is not None
            else torch.zeros((), device=mask_B_C.device)
        )
        with torch.no_grad():
            valid_B_C = _agreement_tokens(mb)
            log_ratio_B_C = logprobs_B_C.detach().double() - mb["logprobs_B_C"].double()
            absdiff_B_C = torch.where(valid_B_C, log_ratio_B_C.abs(), 0.0)
            ratio_B_C = torch.where(valid_B_C, log_ratio_B_C.exp(), 0.0)
            ratio_dev_B_C = torch.where(valid_B_C, log_ratio_B_C.expm1(), 0.0)  # ratio - 1, no cancellation
            neg_inf = torch.tensor(float("-inf"), dtype=torch.float64, device=mask_B_C.device)
            maxima = torch.stack(
                [
                    torch.where(valid_B_C, absdiff_B_C, neg_inf).max(),
                    torch.where(valid_B_C, ratio_B_C, neg_inf).max(),
                    torch.where(valid_B_C, -ratio_B_C, neg_inf).max(),
                ]
            )
        sums = torch.stack(
            [
                metrics["loss_sum"].detach().double(),
                metrics["clipped_tokens"].detach().double(),
                metrics["ratio_sum"].detach().double(),
                metrics["kl_sum"].detach().double(),
                entropy_sum.double(),
                metrics["tokens"].detach().double(),
                absdiff_B_C.sum(),
                (ratio_dev_B_C * ratio_dev_B_C).sum(),
                loss.detach().double(),
                metrics["is_weight_sum"].detach().double(),
                metrics["is_capped_tokens"].detach().double(),
                valid_B_C.sum().double(),
                metrics["ratio_limited_tokens"].detach().double(),
            ]
        )
        return sums, maxima

    def sft_update(
        self,
        shard: dict[str, torch.Tensor],
        num_tokens_global: int,
        *,
        lr: float | None = None,
        with_checksum: bool = False,
    ) -> dict[str, Any]:
        """One supervised fine-tuning step on this rank's shard; publishes version + 1, as :meth:`update` does.

        ``shard`` holds ``prompt_ids_B_P``, ``prompt_mask_B_P``, ``completion_ids_B_C`` and ``completion_mask_B_C``
        (:func:`rlsdk.data.sft.collate_sft`); the loss is :func:`rlsdk.algorithms.sft.sft_loss` over the masked
        completion tokens at temperature 1 (the model's own distribution; ``rollout.temperature`` is a sampling
        setting), normalised by ``num_tokens_global / world_size`` per micro-batch for the reason
        :meth:`accumulate_gradients` gives. Same micro-batching (``train.micro_batch_size`` or
        ``train.max_tokens_per_micro_batch``; with 'ddp' only the last one synchronises gradients), mixed
        precision, chunked log-probs, clipping and optimizer step as :meth:`update` (``train.lr_scheduler`` is not
        stepped); ``lr`` (> 0) replaces the optimizer's learning rate for this step only (an SFT schedule computed
        by the caller), None keeps it.
        Returns this shard's SUMS (``nll_sum``, ``tokens``), ``grad_norm``, ``lr`` (the one used), ``version``,
        ``seconds``, ``sequences`` and, with ``with_checksum`` (same flag on every rank), the new weights'
        ``checksum``.

        Raises:
            ValueError: other keys than those four, or an empty shard (every rank needs a sequence).
        """
        from rlsdk.algorithms.sft import sft_loss
        from rlsdk.data.sft import SFT_BATCH_KEYS

        start = time.perf_counter()
        if lr is not None and not lr > 0:
            raise ValueError(f"lr={lr!r} is invalid: allowed None or a float > 0")
        if set(shard) != set(SFT_BATCH_KEYS):
            raise ValueError(f"sft_update shard has keys {sorted(shard)}, expected {sorted(SFT_BATCH_KEYS)}")
        batch_size = shard["completion_ids_B_C"].shape[0]
        if batch_size == 0:
            raise ValueError("sft_update shard is empty: every rank needs at least one sequence")
        shard = self.on_device(self.with_prompt_groups(shard))
        denom = num_tokens_global / self.accelerator.num_processes
        self.model.train()
        sums = torch.zeros(2, dtype=torch.float64, device=self.accelerator.device)
        micro_batches = self._micro_batches(shard)  # the RL update's: token budget and count agreed by the ranks
        # Temperature 1: the model's own distribution (rollout.temperature is a sampling setting).
        logits_options = {**self._logits_options(), "temperature": 1.0}
        for index, mb in enumerate(micro_batches):
            with contextlib.nullcontext() if index == len(micro_batches) - 1 else self._no_sync():
                logprobs_B_C, _ = self._forward(self.model, mb, **logits_options)  # SFT rows: no attention mask
                loss, metrics = sft_loss(logprobs_B_C, mb["completion_mask_B_C"], num_tokens=denom)
                self.accelerator.backward(loss)
            sums += torch.stack([metrics["nll_sum"], metrics["tokens"]])
            if self.on_progress is not None:
                self.on_progress(index + 1, len(micro_batches))
        groups = self.optimizer.param_groups
        saved = [group["lr"] for group in groups]
        if lr is not None:
            for group in groups:
                group["lr"] = lr
        used_lr = float(groups[0]["lr"])
        try:
            grad_norm = self._clip_and_step()  # not the RL learning-rate schedule: SFT's rate is the caller's
        finally:
            for group, value in zip(groups, saved):
                group["lr"] = value
        self.version += 1
        set_log_context(version=self.version)
        norm_1 = torch.as_tensor(grad_norm, dtype=torch.float64).reshape(1)
        nll_sum, tokens, norm = torch.cat([sums, norm_1]).tolist()
        result: dict[str, Any] = {
            "nll_sum": nll_sum, "tokens": tokens, "grad_norm": norm, "lr": used_lr, "version": self.version,
            "seconds": time.perf_counter() - start, "sequences": batch_size,
        }  # fmt: skip
        if with_checksum:
            result["checksum"] = self.weight_info()["checksum"]
        return result

    def generate(
        self,
        prompt_ids: list[list[int]],
        params: dict[str, Any],
        *,
        pad_token_id: int,
        eos_token_id: int | list[int],
        max_batch_size: int,
        seed: int | None,
    ) -> dict[str, Any]:
        """Sample one completion per prompt with the weights this rank trains (``inference.engine='colocated'``).

        :func:`~rlsdk.generation.sampling.sample_completions` on the unwrapped model in eval mode, in
        chunks of ``max_batch_size`` prompts; no collective (each rank samples its own prompts, 'ddp' only).
        ``params`` are :class:`~rlsdk.generation.params.SamplingParams` fields (``stop`` strings are matched
        on text decoded by the model's tokenizer, loaded on first use); ``eos_token_id`` is the id, or every id, that
        ends a completion; ``seed`` seeds this call's
        generator (None: the rank's own generator, seeded once from ``seed`` of the config and the rank).
        Returns ``{"completion_ids", "completion_mask", "logprobs"}`` right-padded to this rank's longest
        completion, and ``"version"``, the weights' version.

        Raises:
            RuntimeError: with ``train.parallelism='fsdp2'`` (its forward all-gathers: every rank would have to
                run the same number of decode steps).
        """
        from rlsdk.generation.params import SamplingParams
        from rlsdk.generation.sampling import sample_completions

        if self.fsdp2:
            raise RuntimeError("colocated generation needs train.parallelism='ddp' (got 'fsdp2')")
        sampling = SamplingParams(**{**params, "stop": tuple(params.get("stop", ()))})
        stop_criteria = self._stop_criteria(eos_token_id, sampling.stop)
        if seed is not None:
            generator = torch.Generator(device=self.accelerator.device).manual_seed(seed)
        else:
            if self._generator is None:
                self._generator = torch.Generator(device=self.accelerator.device).manual_seed(
                    self.config.seed * 1_000_003 + self.accelerator.process_index
                )
            generator = self._generator
        model = self.unwrapped
        was_training = model.training
        model.eval()
        chunks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        try:
            for start in range(0, len(prompt_ids), max_batch_size):
                chunks.append(
                    sample_completions(
                        model,
                        prompt_ids[start : start + max_batch_size],
                        sampling,
                        pad_token_id=pad_token_id,
                        eos_token_id=eos_token_id,
                        generator=generator,
                        stop_criteria=stop_criteria,
                        decode_step=self.config.inference.decode_step,
                    )
                )
        finally:
            model.train(was_training)
        if not chunks:
            empty = torch.zeros((0, 0), dtype=torch.long)
            return {"completion_ids": empty, "completion_mask": empty.bool(), "logprobs": empty.float(),
                    "version": self.version}  # fmt: skip
        width = max(chunk[0].shape[1] for chunk in chunks)

        def pad_right(tensor: torch.Tensor, value: float | int | bool) -> torch.Tensor:
            return torch.nn.functional.pad(tensor, (0, width - tensor.shape[1]), value=value)

        return {
            "completion_ids": torch.cat([pad_right(c[0], pad_token_id) for c in chunks]).cpu(),
            "completion_mask": torch.cat([pad_right(c[1], False) for c in chunks]).cpu(),
            "logprobs": torch.cat([pad_right(c[2], 0.0) for c in chunks]).float().cpu(),
            "version": self.version,
        }

    def _stop_criteria(self, eos_token_id: int | list[int], stop: tuple[str, ...]) -> Any:
        """What ends a colocated completion: the EOS ids, and ``stop`` matched on text decoded by the model's
        tokenizer (loaded from ``model.path`` on the first request with stop strings)."""
        from rlsdk.generation.stopping import StopCriteria

        if not stop:
            return StopCriteria(eos_token_id)
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(
                self.config.model.path, trust_remote_code=self.config.model.trust_remote_code
            )
        tokenizer = self._tokenizer
        return StopCriteria(eos_token_id, stop, lambda ids: tokenizer.decode(ids, skip_special_tokens=True))

    def weight_info(
        self, *, with_checksum: bool = True, algorithm: ChecksumAlgorithm = CHECKSUM_ALGORITHM
    ) -> dict[str, Any]:
        """``{"version", "checksum"}`` (``state_dict_checksum`` of the full state dict, with ``algorithm``:
        ``"blake3"``/``"sha256"`` only to verify a checkpoint recorded before XXH3); without ``with_checksum`` only
        ``{"version"}``. Every rank calls it: with 'fsdp2' the checksum needs the gathered weights (a
        collective), and ranks without ``with_checksum`` only take part."""
        if self.lora:  # the adapter's checksum (DDP only: local)
            from rlsdk.engine.lora import adapter_state_dict

            if not with_checksum:
                return {"version": self.version}
            return {
                "version": self.version,
                "checksum": state_dict_checksum(adapter_state_dict(self.unwrapped), algorithm),
            }
        state_dict = self.full_state_dict(keep=with_checksum)
        if state_dict is None:
            return {"version": self.version}
        return {"version": self.version, "checksum": state_dict_checksum(state_dict, algorithm)}

    def export_weights(self, publish_dir: str, *, is_writer: bool = True) -> dict[str, Any]:
        """Write the current weights to ``publish_dir/v{version}.safetensors`` with a checksum
        (:func:`publish_safetensors`: the previous version's file rewritten in place and renamed, or a new file
        and an atomic rename).

        Every rank calls it (with 'fsdp2' the gather is a collective); only the ``is_writer`` rank writes and
        returns ``{"version", "path", "checksum"}``, the others return ``{"version"}``. The file is what
        ``safetensors.torch.save_model`` writes for the unsharded model, whatever the parallelism. Callers publish
        the next version only after every reader of this one is done (``Session.sync_weights`` exports, then
        loads, one sync at a time): the next export may overwrite this file's bytes.
        """
        from safetensors.torch import save_model

        if self.lora:
            from rlsdk.engine.lora import publish_adapter

            # Only the adapter moves: publish_dir/v{version}/, a peft adapter directory (rlsdk.engine.lora).
            return (
                publish_adapter(self.unwrapped, publish_dir, self.version) if is_writer else {"version": self.version}
            )
        state_dict = self.full_state_dict(keep=is_writer) if self.fsdp2 else None
        if not is_writer:
            return {"version": self.version}
        if state_dict is None:
            model = self.unwrapped
            state_dict = model.state_dict()
            path = publish_safetensors(state_dict, publish_dir, self.version, lambda tmp: save_model(model, tmp))
        else:
            from rlsdk.engine.train.fsdp import StateDictSource

            source = StateDictSource(state_dict)
            path = publish_safetensors(state_dict, publish_dir, self.version, lambda tmp: save_model(source, tmp))  # type: ignore[arg-type]
        return {
            "version": self.version,
            "path": path,
            "checksum": state_dict_checksum(state_dict),
            # tied weights (one storage under two names) are written once
            "bytes": sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in state_dict.values()}.values()),
        }

    def save_checkpoint(self, directory: str, *, is_writer: bool) -> list[str]:
        """Write this rank's part of a checkpoint into ``directory`` (a temporary directory the controller
        renames once every rank is done). The writer rank writes the model (``save_pretrained``), the optimizer
        and the learning-rate schedule; every rank writes its RNG states. Returns the files written, relative to
        ``directory``.

        With 'fsdp2' every rank takes part in gathering the full model and the full optimizer state
        (``get_optimizer_state_dict(full_state_dict=True, cpu_offload=True)``, which only rank 0 receives, so
        the writer must be rank 0); ``trainer_state.pt`` then holds that FQN-keyed optimizer state dict
        (``optimizer_format`` 'fsdp2_full'), where 'ddp' holds ``optimizer.state_dict()`` (index-keyed).
        """
        from rlsdk.engine.train.checkpoint import rng_state

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        rank = self.accelerator.process_index
        written = [f"rng_rank{rank}.pt"]
        torch.save(rng_state(), out / written[0])
        state: dict[str, Any] = {"version": self.version, "lr_schedule": self.schedule.state_dict()}
        model_state: dict[str, torch.Tensor] | None = None
        if self.fsdp2:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

            if is_writer and rank != 0:
                raise ValueError(f"fsdp2 checkpoints are written by rank 0, got writer rank {rank}")
            model_state = self.full_state_dict(keep=is_writer)
            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            state["optimizer"] = get_optimizer_state_dict(self.model, self.optimizer, options=options)
            state["optimizer_format"] = "fsdp2_full"
        elif is_writer:
            state["optimizer"] = self.optimizer.state_dict()
            state["optimizer_format"] = "ddp"
        if is_writer and self.lora:
            from rlsdk.engine.lora import write_adapter

            # The adapter only; the base is model.path's, recorded by checksum.
            state["checksum"] = state_dict_checksum(write_adapter(self.unwrapped, out / "model"))
            state["base_checksum"] = self.base_checksum
        elif is_writer:
            state["checksum"] = state_dict_checksum(
                model_state if model_state is not None else self.unwrapped.state_dict()
            )
            self.unwrapped.save_pretrained(out / "model", state_dict=model_state, safe_serialization=True)
        if is_writer:
            torch.save(state, out / "trainer_state.pt")
            written += [str(p.relative_to(out)) for p in (out / "model").rglob("*") if p.is_file()]
            written.append("trainer_state.pt")
        return written

    def load_checkpoint(self, directory: str) -> None:
        """Continue from a checkpoint :meth:`save_checkpoint` wrote (the model weights are already loaded from
        its ``model/``): the optimizer state, the version and this rank's RNG states (restored last, so that
        nothing done while loading draws from them). Every rank calls it (a collective with 'fsdp2').

        Raises ``ValueError`` when the checkpoint's optimizer format does not match ``train.parallelism`` or this
        rank has no ``rng_rank{r}.pt`` (a checkpoint of another rank count).
        """
        from rlsdk.engine.train.checkpoint import load_rng_state

        root = Path(directory)
        rank = self.accelerator.process_index
        rng_path = root / f"rng_rank{rank}.pt"
        if not rng_path.is_file():
            raise ValueError(f"checkpoint {root} has no {rng_path.name}: it was written by fewer ranks")
        state = torch.load(root / "trainer_state.pt", map_location="cpu", weights_only=True)
        if self.lora and state.get("base_checksum") != self.base_checksum:
            raise ValueError(
                f"checkpoint {root} holds a LoRA adapter trained on base weights with checksum "
                f"{str(state.get('base_checksum'))[:12]}, but model.path {self.config.model.path} has "
                f"{str(self.base_checksum)[:12]}: resume with the base model the adapter was trained on"
            )
        # Checkpoints written before optimizer_format was recorded for 'ddp' have none.
        found = state.get("optimizer_format", "ddp")
        wanted = "fsdp2_full" if self.fsdp2 else "ddp"
        if found != wanted:
            raise ValueError(
                f"checkpoint {root} holds a {found!r} optimizer state, train.parallelism "
                f"{self.config.train.parallelism!r} needs {wanted!r}"
            )
        if self.fsdp2:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            # Every rank holds the full, name-keyed state and keeps its own shard of it.
            set_optimizer_state_dict(
                self.model,
                self.optimizer,
                optim_state_dict=state["optimizer"],
                options=StateDictOptions(full_state_dict=True),
            )
        else:
            self.optimizer.load_state_dict(state["optimizer"])
        schedule = state.get("lr_schedule")
        if schedule is not None:
            self.schedule.load_state_dict(schedule)
        elif self.config.train.lr_scheduler != "constant" or self.config.train.warmup_steps > 0:
            # Checkpoints written before the schedule was saved ran a constant learning rate.
            raise ValueError(
                f"checkpoint {root} has no learning-rate schedule state (written with a constant lr): resume it with "
                f"train.lr_scheduler='constant' and train.warmup_steps=0, got {self.config.train.lr_scheduler!r} and "
                f"{self.config.train.warmup_steps}"
            )
        self.version = int(state["version"])
        self.resumed_checksum = state.get("checksum")
        set_log_context(version=self.version)
        load_rng_state(rng_path)
        logger.info("resumed from %s at version %d", root, self.version)
