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
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rlsdk.algorithms import completion_logprobs, policy_loss
from rlsdk.config import SessionConfig
from rlsdk.engine.weights import CHECKSUM_ALGORITHM, ChecksumAlgorithm, state_dict_checksum
from rlsdk.observe.logging import get_logger, set_log_context

logger = get_logger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Order of the per-step metric sums packed into one tensor (one host sync per step). The controller adds the
# sums over ranks and takes the maximum of the _MAX_KEYS over ranks.
_SUM_KEYS = (
    "loss_sum", "clipped_tokens", "ratio_sum", "kl_sum", "entropy_sum", "tokens",
    "logprob_absdiff_sum", "ratio_dev_sq_sum", "objective", "is_weight_sum", "is_capped_tokens",
)  # fmt: skip
# Trainer-vs-engine agreement extremes; the ratio minimum is packed negated so that every entry is a maximum.
_MAX_KEYS = ("logprob_absdiff_max", "ratio_max", "neg_ratio_min")


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


def _rewrite_in_place(path: str, state_dict: dict[str, torch.Tensor]) -> bool:
    """Overwrite the tensor bytes of the safetensors file at ``path`` with ``state_dict``'s when its header has
    exactly their layout (see :func:`publish_safetensors`); False (nothing written) when it does not."""
    import ctypes
    import json
    import struct

    fd = os.open(path, os.O_RDWR)  # never O_TRUNC: the file keeps its pages (and any reader's mapping stays valid)
    try:
        size = os.fstat(fd).st_size
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


class TrainEngine:
    """Model + AdamW on one rank; ``update`` takes this rank's shard of a batch and publishes version + 1."""

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
        model = AutoModelForCausalLM.from_pretrained(
            config.model.path if resume_from is None else str(Path(resume_from) / "model"),
            dtype=_DTYPES[config.model.dtype],
            trust_remote_code=config.model.trust_remote_code,
        )
        train = config.train
        self.fsdp2 = train.parallelism == "fsdp2"
        if self.fsdp2:
            from rlsdk.engine.train.fsdp import shard_model

            # The optimizer is built on the sharded (DTensor) parameters, so its state is sharded too.
            layers = shard_model(model, accelerator.device.type, accelerator.num_processes)
            logger.info("fsdp2: %d decoder layers sharded separately, then the root", layers)
            self.model: Any = model
            self.optimizer: Any = torch.optim.AdamW(
                model.parameters(), lr=train.lr, betas=train.betas, weight_decay=train.weight_decay
            )
        else:
            # The fused kernel (one pass over each parameter, TRL's default 'adamw_torch_fused'): the same AdamW
            # update at ~3x less time than foreach on the default policy; foreach where a device has no kernel.
            try:
                optimizer = torch.optim.AdamW(
                    model.parameters(), lr=train.lr, betas=train.betas, weight_decay=train.weight_decay, fused=True
                )
            except RuntimeError as exc:
                logger.debug("fused AdamW unavailable (%s); using foreach", exc)
                optimizer = torch.optim.AdamW(
                    model.parameters(), lr=train.lr, betas=train.betas, weight_decay=train.weight_decay
                )
            self.model, self.optimizer = accelerator.prepare(model, optimizer)
            if isinstance(self.model, torch.nn.parallel.DistributedDataParallel):
                # DDP re-broadcasts rank 0's buffers before every forward that syncs gradients (meant for
                # BatchNorm statistics): a collective that makes the ranks wait for each other. A causal LM's
                # buffers (rotary inv_freq) are constants every rank builds from the same config, and DDP's
                # constructor already broadcast them once. (torch 2.13 name of broadcast_buffers.)
                self.model.forward_sync_buffers = False
        self.ref_model: torch.nn.Module | None = None
        if config.algorithm.kl_coef > 0:
            self.ref_model = AutoModelForCausalLM.from_pretrained(
                config.model.path, dtype=_DTYPES[config.model.dtype]
            ).eval()
            self.ref_model.requires_grad_(False)
        logger.info(
            "train engine ready: %s, %d parameters, distributed type %s",
            Path(config.model.path).name,
            sum(p.numel() for p in model.parameters()),
            accelerator.distributed_type,
        )
        if resume_from is not None:
            self.load_checkpoint(resume_from)

    @property
    def unwrapped(self) -> torch.nn.Module:
        """The model without the DDP wrapper; with 'fsdp2' the sharded model itself (DTensor parameters)."""
        return self.model if self.fsdp2 else self.accelerator.unwrap_model(self.model)

    def _full_state_dict(self, *, keep: bool) -> dict[str, torch.Tensor] | None:
        """The unsharded state dict where ``keep`` (None elsewhere). Collective with 'fsdp2' (every rank calls
        it); with 'ddp' local, and ranks that do not keep it do nothing."""
        if self.fsdp2:
            from rlsdk.engine.train.fsdp import full_state_dict

            return full_state_dict(self.model, keep=keep)
        return self.unwrapped.state_dict() if keep else None

    def _no_sync(self) -> contextlib.AbstractContextManager[Any]:
        """Skip the gradient reduction of a non-final micro-batch (gradients accumulate locally, unsharded
        with 'fsdp2'); the last micro-batch's backward reduces the sum."""
        if not self.fsdp2:
            return self.accelerator.no_sync(self.model)
        model = self.model

        @contextlib.contextmanager
        def no_sync() -> Any:
            model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                model.set_requires_gradient_sync(True)

        return no_sync()

    def update(
        self,
        shard: dict[str, torch.Tensor],
        num_tokens_global: int,
        *,
        num_sequences_global: int | None = None,
        with_checksum: bool = False,
    ) -> dict[str, Any]:
        """One optimizer step on this rank's shard; returns metric SUMS over this shard (controller reduces).

        Publishes version + 1. See :meth:`accumulate_gradients` for the shard layout and normalisation.
        ``with_checksum``: the result also holds the new weights' ``checksum`` (:meth:`weight_info`; every rank
        must get the same flag: with 'fsdp2' it gathers), so a colocated engine verifies the sync without another
        command.
        """
        start = time.perf_counter()
        sums = self.accumulate_gradients(shard, num_tokens_global, num_sequences_global=num_sequences_global)
        grad_norm = self._clip_and_step()
        self.version += 1
        set_log_context(version=self.version)
        values = torch.cat([sums, torch.as_tensor(grad_norm, dtype=torch.float64).reshape(1)]).tolist()
        result: dict[str, Any] = dict(zip((*_SUM_KEYS, *_MAX_KEYS, "grad_norm"), values))
        result.update(
            version=self.version,
            seconds=time.perf_counter() - start,
            sequences=shard["completion_ids_B_C"].shape[0],
        )
        if with_checksum:
            result["checksum"] = self.weight_info()["checksum"]
        return result

    def _clip_and_step(self) -> torch.Tensor:
        """Clip the accumulated gradients to ``train.max_grad_norm`` (None: no clipping), step the optimizer, zero the
        gradients. Returns the gradient norm before clipping (NaN without clipping), on the device: no host sync.
        The RL update and the SFT step both step through it; each publishes its own version."""
        grad_norm = torch.tensor(float("nan"))
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
        outputs are in context but not trained on; default: ``completion_mask_B_C``). Every rank gets the same number of
        sequences, so every rank runs the same number of forward/backward passes and DDP's all-reduces (FSDP2's
        all-gathers and reduce-scatters) match; only the last micro-batch synchronises gradients. ``num_tokens_global``
        is the completion-token count of the whole batch across ranks; each rank divides by ``num_tokens_global /
        world_size`` because DDP's all-reduce and FSDP2's reduce-scatter both AVERAGE gradients, so the result is the
        gradient of the global token-mean loss. ``num_sequences_global`` (default: this shard's sequences times the
        world size, as every rank gets an equal shard) is divided the same way for the per-sequence aggregations of
        ``algorithm.loss_agg``. Returns the metric sums (``_SUM_KEYS`` order) followed by the maxima (``_MAX_KEYS``
        order) as one float64 tensor, still on the device.

        ``algorithm.off_policy`` 'tis' / 'decoupled': the proximal ("old") logprobs are this forward's own
        logprobs, detached. That is exact here, not an approximation: the optimizer steps only after the last
        micro-batch, so every forward runs on the weights the update starts from (the trainer's "recomputed old
        logprobs" of the TIS note, at no extra forward). The PPO ratio is then exactly 1, so the clip never
        engages; the importance weight trainer/engine carries the correction.
        TODO(algorithms): with several optimizer steps per rollout (PPO epochs / mini-batches) the proximal
        logprobs must be recomputed by a no-grad forward before the first step.

        Logprob agreement: every forward here runs on the weights the engine served for an on-policy batch (the
        optimizer steps only after the last micro-batch), so ``|logprobs - behaviour logprobs|`` and the
        importance ratio ``exp(logprobs - behaviour logprobs)`` measure trainer-vs-engine disagreement (plus the
        policy lag of samples older than the trainer's version). They are computed from tensors the loss
        already needs, on the device, with no extra host sync.
        """
        cfg = self.config
        expected = {"prompt_ids_B_P", "prompt_mask_B_P", "completion_ids_B_C", "completion_mask_B_C",
                    "logprobs_B_C", "advantages_B"}  # fmt: skip
        optional = {"completion_attention_mask_B_C"}  # default: completion_mask_B_C (attend = train)
        if not expected <= set(shard) <= expected | optional:
            raise ValueError(
                f"update shard has keys {sorted(shard)}, expected {sorted(expected)} (+ optional {sorted(optional)})"
            )
        batch_size = shard["completion_ids_B_C"].shape[0]
        if batch_size == 0:
            raise ValueError("update shard is empty: every rank needs at least one sequence")
        micro = cfg.train.micro_batch_size
        world = self.accelerator.num_processes
        algo = cfg.algorithm.resolved()
        if num_sequences_global is None:
            num_sequences_global = batch_size * world
        denom = num_tokens_global / world
        seq_denom = num_sequences_global / world
        entropy_grad = algo.entropy_coef > 0
        self.model.train()
        sums = torch.zeros(len(_SUM_KEYS), dtype=torch.float64)
        maxima = torch.full((len(_MAX_KEYS),), float("-inf"), dtype=torch.float64)
        starts = list(range(0, batch_size, micro))
        if self.on_progress is not None:
            self.on_progress(0, len(starts))
        for index, lo in enumerate(starts):
            mb = {name: tensor[lo : lo + micro] for name, tensor in shard.items()}
            last = index == len(starts) - 1
            sync_ctx = contextlib.nullcontext() if last else self._no_sync()
            with sync_ctx:
                logprobs_B_C, entropy_B_C = completion_logprobs(
                    self.model,
                    mb["prompt_ids_B_P"],
                    mb["prompt_mask_B_P"],
                    mb["completion_ids_B_C"],
                    mb["completion_mask_B_C"],
                    attention_mask_B_C=mb.get("completion_attention_mask_B_C"),
                    temperature=cfg.rollout.temperature,
                    with_entropy=True,
                    entropy_grad=entropy_grad,
                    share_prompts=cfg.train.share_prompt_prefix,
                )
                ref_logprobs_B_C = None
                if self.ref_model is not None:
                    with torch.no_grad():
                        ref_logprobs_B_C, _ = completion_logprobs(
                            self.ref_model,
                            mb["prompt_ids_B_P"],
                            mb["prompt_mask_B_P"],
                            mb["completion_ids_B_C"],
                            mb["completion_mask_B_C"],
                            attention_mask_B_C=mb.get("completion_attention_mask_B_C"),
                            temperature=cfg.rollout.temperature,
                            share_prompts=cfg.train.share_prompt_prefix,
                        )
                correct = algo.off_policy != "none"
                loss, metrics = policy_loss(
                    logprobs_B_C,
                    logprobs_B_C.detach() if correct else mb["logprobs_B_C"],
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
                self.accelerator.backward(loss)
            mask_B_C = mb["completion_mask_B_C"]
            entropy_sum = (entropy_B_C.detach() * mask_B_C).sum() if entropy_B_C is not None else torch.zeros(())
            with torch.no_grad():
                valid_B_C = mask_B_C.bool()
                log_ratio_B_C = logprobs_B_C.detach().double() - mb["logprobs_B_C"].double()
                absdiff_B_C = torch.where(valid_B_C, log_ratio_B_C.abs(), 0.0)
                ratio_B_C = torch.where(valid_B_C, log_ratio_B_C.exp(), 0.0)
                ratio_dev_B_C = torch.where(valid_B_C, log_ratio_B_C.expm1(), 0.0)  # ratio - 1, no cancellation
                neg_inf = torch.tensor(float("-inf"), dtype=torch.float64)
                maxima = torch.maximum(
                    maxima,
                    torch.stack(
                        [
                            torch.where(valid_B_C, absdiff_B_C, neg_inf).max(),
                            torch.where(valid_B_C, ratio_B_C, neg_inf).max(),
                            torch.where(valid_B_C, -ratio_B_C, neg_inf).max(),
                        ]
                    ),
                )
            sums += torch.stack(
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
                ]
            )
            if self.on_progress is not None:
                self.on_progress(index + 1, len(starts))
        return torch.cat([sums, maxima])

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
        :meth:`accumulate_gradients` gives. Same micro-batching (``train.micro_batch_size``, only the last one
        synchronising gradients), clipping and optimizer step as :meth:`update`; ``lr`` (> 0) replaces the
        optimizer's learning rate for this step only (an SFT schedule computed by the caller), None keeps it.
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
        micro = self.config.train.micro_batch_size
        denom = num_tokens_global / self.accelerator.num_processes
        self.model.train()
        sums = torch.zeros(2, dtype=torch.float64)
        starts = list(range(0, batch_size, micro))
        for index, lo in enumerate(starts):
            mb = {name: tensor[lo : lo + micro] for name, tensor in shard.items()}
            with contextlib.nullcontext() if index == len(starts) - 1 else self._no_sync():
                logprobs_B_C, _ = completion_logprobs(
                    self.model,
                    mb["prompt_ids_B_P"],
                    mb["prompt_mask_B_P"],
                    mb["completion_ids_B_C"],
                    mb["completion_mask_B_C"],
                    share_prompts=self.config.train.share_prompt_prefix,
                )
                loss, metrics = sft_loss(logprobs_B_C, mb["completion_mask_B_C"], num_tokens=denom)
                self.accelerator.backward(loss)
            sums += torch.stack([metrics["nll_sum"], metrics["tokens"]])
            if self.on_progress is not None:
                self.on_progress(index + 1, len(starts))
        groups = self.optimizer.param_groups
        saved = [group["lr"] for group in groups]
        if lr is not None:
            for group in groups:
                group["lr"] = lr
        used_lr = float(groups[0]["lr"])
        try:
            grad_norm = self._clip_and_step()
        finally:
            # Back to the rate before the override, unless the step set the next one itself (a learning-rate
            # schedule does, after every optimizer step).
            for group, value in zip(groups, saved):
                if lr is not None and group["lr"] == lr:
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

        :func:`~rlsdk.engine.inference.sampling.sample_completions` on the unwrapped model in eval mode, in
        chunks of ``max_batch_size`` prompts; no collective (each rank samples its own prompts, 'ddp' only).
        ``params`` are :class:`~rlsdk.engine.inference.protocol.SamplingParams` fields (``stop`` strings are matched
        on text decoded by the model's tokenizer, loaded on first use); ``eos_token_id`` is the id, or every id, that
        ends a completion; ``seed`` seeds this call's
        generator (None: the rank's own generator, seeded once from ``seed`` of the config and the rank).
        Returns ``{"completion_ids", "completion_mask", "logprobs"}`` right-padded to this rank's longest
        completion, and ``"version"``, the weights' version.

        Raises:
            RuntimeError: with ``train.parallelism='fsdp2'`` (its forward all-gathers: every rank would have to
                run the same number of decode steps).
        """
        from rlsdk.engine.inference.protocol import SamplingParams
        from rlsdk.engine.inference.sampling import sample_completions

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
        from rlsdk.engine.inference.stopping import StopCriteria

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
        state_dict = self._full_state_dict(keep=with_checksum)
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

        state_dict = self._full_state_dict(keep=is_writer) if self.fsdp2 else None
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
        return {"version": self.version, "path": path, "checksum": state_dict_checksum(state_dict)}

    def save_checkpoint(self, directory: str, *, is_writer: bool) -> list[str]:
        """Write this rank's part of a checkpoint into ``directory`` (a temporary directory the controller
        renames once every rank is done). The writer rank writes the model (``save_pretrained``) and the
        optimizer; every rank writes its RNG states. Returns the files written, relative to ``directory``.

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
        state: dict[str, Any] = {"version": self.version}
        model_state: dict[str, torch.Tensor] | None = None
        if self.fsdp2:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

            if is_writer and rank != 0:
                raise ValueError(f"fsdp2 checkpoints are written by rank 0, got writer rank {rank}")
            model_state = self._full_state_dict(keep=is_writer)
            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            state["optimizer"] = get_optimizer_state_dict(self.model, self.optimizer, options=options)
            state["optimizer_format"] = "fsdp2_full"
        elif is_writer:
            state["optimizer"] = self.optimizer.state_dict()
            state["optimizer_format"] = "ddp"
        if is_writer:
            state["checksum"] = state_dict_checksum(
                model_state if model_state is not None else self.unwrapped.state_dict()
            )
            self.unwrapped.save_pretrained(out / "model", state_dict=model_state, safe_serialization=True)
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
        self.version = int(state["version"])
        self.resumed_checksum = state.get("checksum")
        set_log_context(version=self.version)
        load_rng_state(rng_path)
        logger.info("resumed from %s at version %d", root, self.version)
