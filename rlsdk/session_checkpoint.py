"""The controller's half of a checkpoint: what ``Session.save_checkpoint`` writes beside the ranks' shards (version
ledger, config, data position, step and rollout counters, tokenizer), and what a resume restores from it. The ranks'
half (weights, optimizer, RNG states) and the atomic finalize live in :mod:`rlsdk.engine.train.checkpoint`."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from rlsdk.config import SessionConfig, config_to_dict
from rlsdk.observe.logging import get_logger, set_log_context
from rlsdk.runtime_dir import output_modes, private_dir, restrict_tree
from rlsdk.versioning import VersionError, VersionLedger

logger = get_logger("rlsdk.session")  # the Session's own messages, under its logger name as before


async def write_checkpoint(
    session: Any, data_position: tuple[dict[str, Any], int], broadcast: Callable[..., Awaitable[list[Any]]]
) -> Path:
    """Write ``OUTPUT/checkpoints/step_N`` atomically (N = trainer version), then prune to
    ``train.keep_checkpoints``. ``session``: the Session (its public ``config``, ``output_dir``, ``versions``,
    ``tokenizer``, ``step``); ``data_position``: (data position, rollouts sampled) the resume continues from;
    ``broadcast``: the Session's command to every rank (the ranks write their shards first)."""
    import yaml

    from rlsdk.engine.train.checkpoint import finalize_checkpoint, prune_checkpoints

    config: SessionConfig = session.config
    versions: VersionLedger = session.versions
    tokenizer, step, output_dir = session.tokenizer, session.step, session.output_dir

    dir_mode, file_mode = output_modes(config.observe.output_mode)
    root = private_dir(output_dir / "checkpoints", mode=dir_mode)
    version = versions.trainer_version
    data_state, rollouts = data_position
    tmp = root / f"step_{version}.tmp-{uuid.uuid4().hex[:8]}"
    await broadcast("save_checkpoint", {"directory": str(tmp)}, timeout_s=config.launch.command_timeout_s)
    await asyncio.to_thread(tokenizer.save_pretrained, str(tmp / "model"))
    extra = {
        "ledger.json": json.dumps(versions.state_dict(), indent=1),
        "config.yaml": yaml.safe_dump(config_to_dict(config), sort_keys=False),
        "data_state.json": json.dumps(data_state),
        "session.json": json.dumps({"step": step, "rollouts": rollouts}),
    }
    final = await asyncio.to_thread(finalize_checkpoint, tmp, root / f"step_{version}", extra)
    await asyncio.to_thread(restrict_tree, final, dir_mode, file_mode)  # e.g. the tokenizer's files
    await asyncio.to_thread(prune_checkpoints, root, config.train.keep_checkpoints)
    logger.info("checkpoint written: %s", final)
    return final


def restore_controller_state(
    directory: Path, state: dict[str, Any], trainer: dict[str, Any], prompt_sampler: Any
) -> tuple[VersionLedger, int, int]:
    """The controller's half of a resume: returns (version ledger, step, rollouts sampled) and moves
    ``prompt_sampler`` to the checkpoint's data position. Raises ``VersionError`` when the ranks resumed at
    another version than the checkpoint's ledger records."""
    ledger = VersionLedger.from_state_dict(state["ledger"])
    if trainer["version"] != ledger.trainer_version:
        raise VersionError(
            f"checkpoint {directory}: the ranks resumed at v{trainer['version']}, "
            f"its ledger.json records trainer v{ledger.trainer_version}"
        )
    prompt_sampler.load_state_dict(state["data"])
    counters = state["session"]
    if counters is None:
        # Checkpoints written before session.json: one rollout per step, as in the recipes' loop.
        logger.warning(
            "checkpoint %s has no session.json: assuming one rollout per step, so sampling seeds continue "
            "from %d (exact only for one rollout per update)",
            directory,
            ledger.trainer_version,
        )
        counters = {"step": ledger.trainer_version, "rollouts": ledger.trainer_version}
    step, rollouts = int(counters["step"]), int(counters["rollouts"])
    set_log_context(version=ledger.trainer_version)
    logger.info(
        "resuming from %s: trainer v%d, step %d, %d rollouts sampled", directory, ledger.trainer_version, step, rollouts
    )
    return ledger, step, rollouts
