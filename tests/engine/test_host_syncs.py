"""The update's device-host syncs, counted on CPU (CONVENTIONS §3): the CPU-side twin of the ``gpu`` test that runs
an update under ``torch.cuda.set_sync_debug_mode('error')`` (tests/gpu/test_gpu.py)."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from test_ddp_gradients import _make_batch

from rlsdk.config import ModelConfig, SessionConfig, TrainConfig
from rlsdk.config.device import accelerator_kwargs

SYNCS = ("item", "tolist", "cpu")


@contextlib.contextmanager
def count_host_syncs() -> Iterator[Counter[str]]:
    """Count ``Tensor.item``/``.tolist``/``.cpu`` calls while the block runs (each one a device-host sync on GPU)."""
    counts: Counter[str] = Counter()
    originals = {name: getattr(torch.Tensor, name) for name in SYNCS}

    def counting(name: str) -> Any:
        original = originals[name]

        def call(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return original(self, *args, **kwargs)

        return call

    with pytest.MonkeyPatch.context() as patch:
        for name in SYNCS:
            patch.setattr(torch.Tensor, name, counting(name))
        yield counts


@pytest.mark.parametrize(("micro_batch_size", "micro_batches"), [(4, 3), (12, 1)])
def test_update_step_syncs_the_host_once_for_its_metrics_whatever_its_micro_batches(
    tiny_model_dir: Path, micro_batch_size: int, micro_batches: int
) -> None:
    from accelerate import Accelerator

    from rlsdk.engine.train.engine import TrainEngine

    model_dir = str(tiny_model_dir)
    config = SessionConfig(model=ModelConfig(path=model_dir), train=TrainConfig(micro_batch_size=micro_batch_size))
    engine = TrainEngine(config, Accelerator(**accelerator_kwargs("cpu")))
    batch = _make_batch(model_dir, group_size=3)  # 12 sequences in groups of 3 (prompts repeat)
    tokens = int(batch["completion_mask_B_C"].sum())

    with count_host_syncs() as counts:
        result = engine.update(batch, tokens, num_sequences_global=batch["completion_ids_B_C"].shape[0])

    # The bound, call by call: one .tolist() at the end of TrainEngine.update (the step's metric sums, maxima and
    # gradient norm, gathered into one tensor), whatever the micro-batch count. The shared-prompt pass of each
    # micro-batch reads the distinct prompts from labels found on the CPU copy of the shard
    # (TrainEngine.with_prompt_groups), not from the ids. No .item() or .cpu(): the loss, the log-probs, the
    # gradient norm and the optimizer step stay on the device.
    assert dict(counts) == {"tolist": 1}
    assert result["version"] == 1
