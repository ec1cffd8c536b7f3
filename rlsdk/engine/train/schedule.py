"""Several optimizer steps per update: the mini-batch split and the learning-rate schedule.

One ``Session.update`` is ``train.ppo_epochs`` passes over the batch, each pass taking its mini-batches in order
(``train.mini_batch_size`` sequences over all ranks, one optimizer step each), as verl's ``ppo_epochs`` /
``ppo_mini_batch_size`` and TRL's ``num_iterations`` / ``steps_per_generation``. Every rank holds an equal,
contiguous shard of the batch and cuts it into the same local slices, so global mini-batch ``k`` is slice ``k``
of every rank: every rank runs the same number of forward/backward passes, optimizer steps and collectives
(SPMD), and the controller computes each mini-batch's global token and sequence counts (its normalisers) from
the same rule (:func:`minibatch_bounds`). No shuffling between epochs: the order is a function of the batch alone,
so a resumed run replays it exactly.

The learning-rate schedule is transformers' (``get_scheduler``, as TRL), stepped once per optimizer step.
"""

from __future__ import annotations

import math
from typing import Any

from rlsdk.observe.logging import get_logger

logger = get_logger(__name__)

# train.lr_scheduler -> transformers' SchedulerType with a warm-up.
_TRANSFORMERS_SCHEDULES = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}


def minibatch_bounds(per_rank: int, mini_batch_size: int | None, world_size: int) -> list[tuple[int, int]]:
    """``[(lo, hi), ...]``: the slices of a rank's shard of ``per_rank`` sequences that make the mini-batches.

    Each slice holds ``mini_batch_size / world_size`` sequences (the last may hold fewer); ``None`` = one slice,
    the whole shard. Every rank gets the same list (equal shards), so every rank runs the same optimizer steps.

    Raises:
        ValueError: ``per_rank < 1``, or ``mini_batch_size`` not a positive multiple of ``world_size``.
    """
    if per_rank < 1:
        raise ValueError(f"per_rank={per_rank!r}: every rank needs at least one sequence")
    if mini_batch_size is None:
        return [(0, per_rank)]
    if mini_batch_size < 1 or mini_batch_size % world_size:
        raise ValueError(f"mini_batch_size={mini_batch_size!r} must be a positive multiple of world_size={world_size}")
    local = mini_batch_size // world_size
    return [(lo, min(lo + local, per_rank)) for lo in range(0, per_rank, local)]


def minibatch_normalisers(
    completion_mask_B_C: Any, world_size: int, mini_batch_size: int | None
) -> list[tuple[int, int]]:
    """Each mini-batch's global ``(num_tokens, num_sequences)`` for a batch split into ``world_size`` equal,
    contiguous rank shards (the controller's split), in the order of :func:`minibatch_bounds`: the normalisers with
    which the ranks' micro-batches of one mini-batch sum to that mini-batch's whole loss."""
    per_rank = completion_mask_B_C.shape[0] // world_size
    tokens_W_B = completion_mask_B_C[: per_rank * world_size].sum(dim=1).reshape(world_size, per_rank)
    bounds = minibatch_bounds(per_rank, mini_batch_size, world_size)
    return [(int(tokens_W_B[:, lo:hi].sum()), (hi - lo) * world_size) for lo, hi in bounds]


def optimizer_steps_per_update(config: Any, batch_sequences: int | None = None) -> int:
    """Optimizer steps one update of ``batch_sequences`` sequences runs (default: a full batch,
    ``data.prompts_per_step x rollout.group_size``): ``train.ppo_epochs x`` its mini-batches."""
    train = config.train
    if batch_sequences is None:
        batch_sequences = config.data.prompts_per_step * config.rollout.group_size
    minibatches = 1 if train.mini_batch_size is None else math.ceil(batch_sequences / train.mini_batch_size)
    return train.ppo_epochs * max(minibatches, 1)


class LRSchedule:
    """``train.lr_scheduler`` with ``train.warmup_steps`` over ``optimizer``: a transformers ``LambdaLR`` whose
    horizon is ``train.max_steps`` updates of :func:`optimizer_steps_per_update` steps each.

    :meth:`step` after every optimizer step; :meth:`state_dict` / :meth:`load_state_dict` go into checkpoints (the
    step count; the learning rates themselves are in the optimizer's state)."""

    def __init__(self, optimizer: Any, config: Any) -> None:
        from transformers import get_scheduler

        train = config.train
        self.name = train.lr_scheduler
        self.horizon = train.max_steps * optimizer_steps_per_update(config)
        self.scheduler = get_scheduler(
            _TRANSFORMERS_SCHEDULES[train.lr_scheduler],
            optimizer,
            num_warmup_steps=train.warmup_steps,
            num_training_steps=self.horizon,
        )
        self._warned = False

    @property
    def steps(self) -> int:
        """Optimizer steps taken so far."""
        return int(self.scheduler.last_epoch)

    def lr(self) -> float:
        """The learning rate the next optimizer step uses (of the first parameter group)."""
        return float(self.scheduler.get_last_lr()[0])

    def step(self) -> None:
        self.scheduler.step()
        if self.name != "constant" and self.steps > self.horizon and not self._warned:
            self._warned = True
            logger.warning(
                "the %r learning-rate schedule passed its horizon of %d optimizer steps (train.max_steps x steps per "
                "update): 'linear' stays at lr 0, 'cosine' rises again; raise train.max_steps to the run's length",
                self.name,
                self.horizon,
            )

    def state_dict(self) -> dict[str, Any]:
        return {"name": self.name, "horizon": self.horizon, "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the schedule from a checkpoint's state.

        Raises:
            ValueError: the checkpoint's schedule differs from this config's (its name; for a decaying schedule
                also its horizon): continuing would not be the run that was saved. A 'constant' schedule (with or
                without warm-up) does not depend on its horizon, so a run resumed with a larger ``train.max_steps``
                (extending it) continues exactly.
        """
        same_horizon = self.name == "constant" or state.get("horizon") == self.horizon
        if state.get("name") != self.name or not same_horizon:
            raise ValueError(
                f"the checkpoint's learning-rate schedule is {state.get('name')!r} over {state.get('horizon')} "
                f"optimizer steps, the config's train.lr_scheduler {self.name!r} over {self.horizon} (train.max_steps "
                "x steps per update): resume with the checkpoint's train settings"
            )
        self.scheduler.load_state_dict(state["scheduler"])
