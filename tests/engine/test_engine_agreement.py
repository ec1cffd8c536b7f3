"""The update's agreement and guard counts: what ``accumulate_gradients`` compares, and where the ratio guard
engaged."""

from __future__ import annotations

from pathlib import Path

import torch

# Same directory, imported as pytest's rootdir-relative path puts it (prepend import mode).
from test_ddp_gradients import _make_batch

from rlsdk.config import ModelConfig, SessionConfig


def _sums(model_dir: str, shard: dict[str, torch.Tensor]) -> dict[str, float]:
    from accelerate import Accelerator

    from rlsdk.engine.train.engine import _SUM_KEYS, TrainEngine

    engine = TrainEngine(SessionConfig(model=ModelConfig(path=model_dir)), Accelerator(cpu=True))
    result = engine.accumulate_gradients(shard, int(shard["completion_mask_B_C"].sum()))
    return dict(zip(_SUM_KEYS, result[: len(_SUM_KEYS)].tolist()))


def test_agreement_mask_compares_only_the_chosen_rows_as_if_the_others_were_absent(tiny_model_dir: Path) -> None:
    model_dir = str(tiny_model_dir)
    batch = _make_batch(model_dir)
    chosen_B = torch.arange(12) < 6
    masked = {**batch, "agreement_mask_B_C": chosen_B[:, None].expand_as(batch["completion_mask_B_C"])}
    alone = {name: tensor[:6] for name, tensor in batch.items()}

    with_mask, rows_alone = _sums(model_dir, masked), _sums(model_dir, alone)

    assert with_mask["agreement_tokens"] == rows_alone["agreement_tokens"] == float(alone["completion_mask_B_C"].sum())
    for key in ("logprob_absdiff_sum", "ratio_dev_sq_sum"):
        assert abs(with_mask[key] - rows_alone[key]) <= 1e-5 * max(1.0, abs(rows_alone[key])), key


def test_ratio_guard_counts_the_tokens_whose_log_ratio_lies_beyond_the_limit(tiny_model_dir: Path) -> None:
    model_dir = str(tiny_model_dir)
    batch = _make_batch(model_dir)
    wrong = batch["logprobs_B_C"].clone()
    wrong[0] -= 30.0 * batch["completion_mask_B_C"][0]  # behaviour log-probs far below the trainer's: log-ratio ~30

    healthy = _sums(model_dir, batch)
    broken = _sums(model_dir, {**batch, "logprobs_B_C": wrong})

    assert healthy["ratio_limited_tokens"] == 0.0
    assert broken["ratio_limited_tokens"] == float(batch["completion_mask_B_C"][0].sum())
