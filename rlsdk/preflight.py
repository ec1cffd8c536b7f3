"""Everything ``Session.start`` (and ``restart``) checks before any process starts: the model directory and its
files, the data set, a ``train.resume_from`` checkpoint, the model's special tokens and the engine's own checks.

Each check raises ``ConfigError`` naming the field and what is allowed, so a bad config fails in a second instead
of after the ranks and an inference server have started.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from rlsdk.config import ConfigError, SessionConfig
from rlsdk.observe.logging import get_logger

logger = get_logger("rlsdk.preflight")


def check_model_dir(path: str) -> None:
    """Fail before any process starts when ``model.path`` is not a local transformers model directory."""
    model_dir = Path(path)
    if not model_dir.is_dir():
        raise ConfigError("model.path", path, "an existing local directory holding a transformers causal LM")
    if not (model_dir / "config.json").is_file():
        raise ConfigError(
            "model.path",
            path,
            "a directory with config.json (a transformers model saved with save_pretrained)",
        )


def check_model_files(config: SessionConfig) -> Any:
    """Load ``model.path``'s config and tokenizer before any process starts (the ranks and the engine would
    fail on them later); returns the tokenizer. Raises ``ConfigError`` naming ``model.path`` and the cause."""
    from transformers import AutoConfig, AutoTokenizer

    path, remote = config.model.path, config.model.trust_remote_code
    try:
        AutoConfig.from_pretrained(path, trust_remote_code=remote)
    except Exception as exc:
        raise ConfigError(
            "model.path", path, f"a directory whose config.json transformers can load ({type(exc).__name__}: {exc})"
        ) from exc
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=remote)
    except Exception as exc:
        raise ConfigError(
            "model.path", path, f"a directory holding the model's tokenizer files ({type(exc).__name__}: {exc})"
        ) from exc
    # transformers builds an empty tokenizer from a directory without tokenizer files instead of raising.
    if not tokenizer("a 0", add_special_tokens=False)["input_ids"]:
        raise ConfigError(
            "model.path",
            path,
            "a directory holding the model's tokenizer files (the tokenizer built from it has no vocabulary: "
            "tokenizer.json or the vocabulary files are missing)",
        )
    return tokenizer


def check_data(config: SessionConfig) -> tuple[Any, Any]:
    """Build the configured prompt data set before any process starts; returns ``(dataset, tokenizer)``.

    The tokenizer (from ``model.path``) is loaded only when the data needs it (``data.chat_template`` or
    ``data.max_prompt_tokens``), else ``None``. Raises ``ConfigError`` naming the ``data.*`` field: a missing or
    unsupported ``path``, an absent ``prompt_column`` (listing the columns found), empty prompts, a tokenizer
    without a chat template, a token budget that keeps no prompt.
    """
    from rlsdk.data.prepare import build_prompt_dataset, data_needs_tokenizer

    tokenizer = None
    if data_needs_tokenizer(config.data):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(config.model.path, trust_remote_code=config.model.trust_remote_code)
    return build_prompt_dataset(config.data, seed=config.seed, tokenizer=tokenizer), tokenizer


def load_resume_state(config: SessionConfig) -> tuple[Path, dict[str, Any]] | None:
    """Find and verify the checkpoint ``train.resume_from`` names, before any process starts; ``None`` when not
    resuming ('auto' without a complete checkpoint under ``observe.output_dir`` starts fresh). Returns
    ``(directory, state)``: ``state`` holds the controller's parts (``ledger``, ``data``, ``session``: step and
    rollout counters, None in checkpoints written before they were saved).

    Raises ``ConfigError`` naming ``train.resume_from`` (missing directory, no manifest.json, not signed with this
    user's key, a checksum that does not match, an unlisted file or a path leaving the directory, see
    :func:`rlsdk.engine.train.checkpoint.resolve_checkpoint`), ``launch.num_ranks`` (the
    checkpoint has another rank count) or ``train.parallelism`` (another optimizer state layout).
    """
    import json

    import yaml

    from rlsdk.engine.train.checkpoint import resolve_checkpoint

    if config.train.resume_from is None:
        return None
    resume_from = config.train.resume_from
    if resume_from == "auto":
        from rlsdk.engine.train.checkpoint import complete_checkpoints

        if not complete_checkpoints(Path(config.observe.output_dir) / "checkpoints"):
            logger.info("train.resume_from='auto': no checkpoint under %s, starting fresh", config.observe.output_dir)
            return None
        resume_from = "latest"
    directory = resolve_checkpoint(resume_from, Path(config.observe.output_dir))
    for name in ("config.yaml", "ledger.json", "data_state.json"):
        if not (directory / name).is_file():  # verified: a file that is there is listed in the signed manifest
            raise ConfigError("train.resume_from", config.train.resume_from, f"a checkpoint with {name}")
    saved = yaml.safe_load((directory / "config.yaml").read_text(encoding="utf-8"))
    # TODO(train): resuming on another rank count (re-seeding the ranks' generators) or converting the optimizer
    # state between 'ddp' and 'fsdp2' layouts is undecided; refuse rather than continue inexactly.
    ranks = saved.get("launch", {}).get("num_ranks")
    if ranks is not None and ranks != config.launch.num_ranks:
        raise ConfigError(
            "launch.num_ranks", config.launch.num_ranks, f"{ranks}, the rank count of checkpoint {directory}"
        )
    lora_rank = saved.get("train", {}).get("lora_rank", 0)
    if lora_rank != config.train.lora_rank:
        raise ConfigError(
            "train.lora_rank", config.train.lora_rank, f"{lora_rank}, the LoRA rank of checkpoint {directory}"
        )
    parallelism = saved.get("train", {}).get("parallelism", "ddp")
    if parallelism != config.train.parallelism:
        raise ConfigError(
            "train.parallelism", config.train.parallelism, f"{parallelism!r}, the parallelism of checkpoint {directory}"
        )
    session_file = directory / "session.json"
    state = {
        "ledger": json.loads((directory / "ledger.json").read_text(encoding="utf-8")),
        "data": json.loads((directory / "data_state.json").read_text(encoding="utf-8")),
        "session": json.loads(session_file.read_text(encoding="utf-8")) if session_file.is_file() else None,
    }
    return directory, state


def check_special_tokens(config: SessionConfig, tokenizer: Any) -> Any:
    """Resolve the model's pad and EOS ids before any process starts (see :mod:`rlsdk.engine.inference.stopping`:
    pad = EOS when the tokenizer has none, as TRL does) and give ``tokenizer`` that pad token; returns the
    :class:`~rlsdk.engine.inference.stopping.SpecialTokens` every engine, workflow and the rollout joining use.
    Raises ``ConfigError`` naming ``model.path`` when the model names no EOS token."""
    from rlsdk.engine.inference.stopping import apply_pad_rule, resolve_special_tokens

    try:
        special = resolve_special_tokens(config.model.path, tokenizer)
    except ValueError as exc:
        raise ConfigError("model.path", config.model.path, f"a model with an EOS token ({exc})") from exc
    apply_pad_rule(tokenizer, special)
    return special


def device_plan(config: SessionConfig) -> Any:
    """Where the ranks (and a vLLM server the Session starts on this machine) run:
    :func:`rlsdk.config.device.plan_devices` of ``config`` and the GPUs this machine sees. Raises ``ConfigError``
    naming the field (e.g. ``launch.device='cuda'`` where torch sees no CUDA device) before any process starts."""
    from rlsdk.config.device import plan_devices, visible_cuda_devices
    from rlsdk.engine.inference.factory import replica_server

    launch = config.launch
    local = launch.scheduler == "local"
    # A server the engine starts on this machine (not attached, not in-process) needs GPUs beside the ranks.
    serves = local and replica_server(config) is not None
    return plan_devices(
        launch,
        mixed_precision=config.train.mixed_precision,
        local_server_gpus=launch.inference_replicas * launch.inference_tensor_parallel_size if serves else 0,
        visible_gpus=visible_cuda_devices() if local else (),
    )


async def check_before_start(config: SessionConfig) -> tuple[tuple[Path, dict[str, Any]] | None, Any, Any, Any]:
    """Everything :meth:`Session.start` checks before a process starts: model path, checkpoint, data set, the
    model's special tokens. Records logged meanwhile (e.g. prompts dropped by ``data.max_prompt_tokens``) are kept
    and shown once the Session's logging is set up."""
    from rlsdk.data.prepare import data_needs_tokenizer
    from rlsdk.engine.inference import check_engine_before_start
    from rlsdk.engine.lora import check_peft_installed

    check_model_dir(config.model.path)
    check_peft_installed(config.train.lora_rank)
    await asyncio.to_thread(device_plan, config)  # CPU or CUDA, and whether the GPUs suffice
    await asyncio.to_thread(check_engine_before_start, config)  # the configured engine's own checks
    resume = await asyncio.to_thread(load_resume_state, config)
    dataset = tokenizer = None
    if config.data.task == "file" or data_needs_tokenizer(config.data):
        dataset, tokenizer = await asyncio.to_thread(check_data, config)
    # else: a generated task, valid by construction (its fields are checked by DataConfig): built while the ranks
    # start (Session._start_engine), off the start-up's critical path (the `datasets` import and the rows).
    if tokenizer is None:
        tokenizer = await asyncio.to_thread(check_model_files, config)
    special = await asyncio.to_thread(check_special_tokens, config, tokenizer)
    if config.data.eval_path is not None:  # ConfigError naming data.eval_path now, not at the first evaluation
        from rlsdk.evaluation import eval_file_dataset

        await asyncio.to_thread(eval_file_dataset, config, tokenizer)
    return resume, dataset, tokenizer, special
