"""The schedule of one ``TrainEngine.update``, observed in process on one rank: how many optimizer steps it runs,
which rows and normalisers each step's loss gets, when the proximal log-prob pass runs, the gradient the optimizer
sees at step time, and how the steps' metrics are averaged."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

# Same directory, imported as pytest's rootdir-relative path puts it (prepend import mode).
from test_ppo_epochs import _on_policy_batch

import rlsdk.engine.train.engine as engine_module
from rlsdk.config import (
    AlgorithmConfig,
    DataConfig,
    LaunchConfig,
    ModelConfig,
    RolloutConfig,
    SessionConfig,
    TrainConfig,
)
from rlsdk.engine.train.schedule import optimizer_steps_per_update


def _engine(model_dir: Path, algorithm: AlgorithmConfig | None = None, **train: Any) -> Any:
    """A single-rank CPU TrainEngine (no process group: accelerate's one-process state) on the tiny policy."""
    from accelerate import Accelerator

    config = SessionConfig(
        model=ModelConfig(path=str(model_dir)),
        launch=LaunchConfig(num_ranks=1),
        train=TrainConfig(**{"micro_batch_size": 2, "lr": 1e-2, **train}),
        algorithm=algorithm or AlgorithmConfig(),
    )
    return engine_module.TrainEngine(config, Accelerator(cpu=True))


def _batch(model_dir: Path, rows: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """``rows`` on-policy sequences (behaviour log-probs are the tiny policy's own), each with its own prompt."""
    return _on_policy_batch(str(model_dir), batch=rows, group_size=1, seed=seed)


class LossRecorder:
    """Wraps the engine module's ``policy_loss``: every call's optimizer-step index (the schedule's steps before
    it), advantages (which rows), normalisers, log-probs, proximal log-probs, loss and loss sum."""

    def __init__(self, engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[dict[str, Any]] = []
        original = engine_module.policy_loss

        def recording(logprobs_B_C: torch.Tensor, old_logprobs_B_C: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            loss, metrics = original(logprobs_B_C, old_logprobs_B_C, *args, **kwargs)
            self.calls.append(
                {
                    "step": engine.schedule.steps,
                    "advantages": args[0].detach().clone(),
                    "num_tokens": float(kwargs["num_tokens"]),
                    "num_sequences": float(kwargs["num_sequences"]),
                    "logprobs": logprobs_B_C.detach().clone(),
                    "old_logprobs": old_logprobs_B_C.detach().clone(),
                    "loss": float(loss.detach()),
                    "loss_sum": float(metrics["loss_sum"].detach()),
                }
            )
            return loss, metrics

        monkeypatch.setattr(engine_module, "policy_loss", recording)

    def steps(self) -> list[list[dict[str, Any]]]:
        """The calls grouped by optimizer step, in step order."""
        count = max(c["step"] for c in self.calls) + 1
        return [[c for c in self.calls if c["step"] == s] for s in range(count)]


def _step_norms(engine: Any) -> list[float]:
    """Registers an optimizer step pre-hook; the returned list receives the total gradient L2 norm the optimizer
    sees at each step (after clipping, if the clip runs before the step)."""
    norms: list[float] = []
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)  # accelerate's wrapper holds torch's

    def pre_hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        grads = [p.grad.detach().double() for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        norms.append(float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))))

    inner.register_step_pre_hook(pre_hook)
    return norms


def _raw_norms(engine: Any, monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The norms the engine's clip returns (before clipping), one per optimizer step."""
    norms: list[float] = []
    original = engine.accelerator.clip_grad_norm_

    def recording(parameters: Any, max_norm: float, *args: Any, **kwargs: Any) -> torch.Tensor:
        norm = original(parameters, max_norm, *args, **kwargs)
        norms.append(float(norm))
        return norm

    monkeypatch.setattr(engine.accelerator, "clip_grad_norm_", recording)
    return norms


@pytest.mark.parametrize(
    ("rows", "mini_batch_size", "ppo_epochs", "expected"),
    [(16, 6, 2, 6), (16, 8, 2, 4), (5, 3, 1, 2), (16, None, 3, 3), (16, 16, 1, 1)],
)
def test_optimizer_steps_per_update_counts_a_partial_last_mini_batch_as_a_step(
    tiny_model_dir: Path, rows: int, mini_batch_size: int | None, ppo_epochs: int, expected: int
) -> None:
    config = SessionConfig(
        model=ModelConfig(path=str(tiny_model_dir)),
        launch=LaunchConfig(num_ranks=1),
        train=TrainConfig(mini_batch_size=mini_batch_size, ppo_epochs=ppo_epochs),
    )

    assert optimizer_steps_per_update(config, rows) == expected


@pytest.mark.parametrize(("rows", "mini_batch_size", "ppo_epochs"), [(16, 6, 2), (16, 8, 1), (5, 3, 2)])
def test_update_runs_as_many_optimizer_steps_as_the_schedule_counts_for_its_batch(
    tiny_model_dir: Path, rows: int, mini_batch_size: int, ppo_epochs: int
) -> None:
    engine = _engine(tiny_model_dir, mini_batch_size=mini_batch_size, ppo_epochs=ppo_epochs, micro_batch_size=8)
    batch = _batch(tiny_model_dir, rows)
    mask_B_C = batch["completion_mask_B_C"]
    normalisers = [
        (int(mask_B_C[lo : lo + mini_batch_size].sum()), min(mini_batch_size, rows - lo))
        for lo in range(0, rows, mini_batch_size)
    ]

    result = engine.update(batch, int(mask_B_C.sum()), minibatches=normalisers)

    expected = ppo_epochs * math.ceil(rows / mini_batch_size)
    assert result["optimizer_steps"] == engine.schedule.steps == expected
    assert optimizer_steps_per_update(engine.config, rows) == expected


def test_decaying_lr_schedule_horizon_covers_every_step_when_the_mini_batch_does_not_divide_the_batch(
    tiny_model_dir: Path,
) -> None:
    # A full batch of 4 prompts x 4 samples = 16 sequences in mini-batches of 6: 6 + 6 + 4, three steps.
    config = SessionConfig(
        model=ModelConfig(path=str(tiny_model_dir)),
        train=TrainConfig(lr=1.0, lr_scheduler="linear", max_steps=2, ppo_epochs=2, mini_batch_size=6),
        rollout=RolloutConfig(group_size=4),
        data=DataConfig(prompts_per_step=4),
    )
    from rlsdk.engine.train.schedule import LRSchedule

    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)
    schedule = LRSchedule(optimizer, config)

    lrs = []
    for _ in range(2 * 2 * 3):  # max_steps updates x ppo_epochs x 3 mini-batches
        lrs.append(schedule.lr())
        optimizer.step()
        schedule.step()

    assert schedule.horizon == 12
    assert lrs == pytest.approx([1.0 - s / 12 for s in range(12)], rel=1e-12, abs=1e-12)
    assert schedule.lr() == pytest.approx(0.0, abs=1e-12)  # the last update's last step ends the decay


def test_update_over_two_epochs_of_two_unequal_mini_batches_gives_each_step_its_own_slice_and_normalisers(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = _engine(tiny_model_dir, ppo_epochs=2, mini_batch_size=3)
    batch = _batch(tiny_model_dir, 5)
    batch["advantages_B"] = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])  # names each row
    batch["completion_mask_B_C"] = torch.arange(5)[None, :] < torch.tensor([5, 4, 5, 1, 2])[:, None]
    batch["logprobs_B_C"] = torch.where(batch["completion_mask_B_C"], batch["logprobs_B_C"], 0.0)
    # mini-batch 0: rows 0-2, 14 tokens, 3 sequences; mini-batch 1: rows 3-4, 3 tokens, 2 sequences
    normalisers = [(14, 3), (3, 2)]
    recorder = LossRecorder(engine, monkeypatch)

    result = engine.update(batch, 17, minibatches=normalisers)

    steps = recorder.steps()
    assert result["optimizer_steps"] == len(steps) == 4
    slices = [(0, 3), (3, 5), (0, 3), (3, 5)]  # epoch-major: mini-batches 0, 1, then 0, 1 again
    for step, (calls, (lo, hi)) in enumerate(zip(steps, slices)):
        rows = torch.cat([c["advantages"] for c in calls])
        torch.testing.assert_close(rows, batch["advantages_B"][lo:hi], rtol=0, atol=0, msg=f"step {step}")
        tokens, sequences = normalisers[step % 2]
        assert {(c["num_tokens"], c["num_sequences"]) for c in calls} == {(tokens, sequences)}, f"step {step}"


def test_update_of_two_epochs_over_one_mini_batch_takes_the_second_epoch_ratio_against_the_proximal_logprobs(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = _engine(tiny_model_dir, AlgorithmConfig(off_policy="tis"), ppo_epochs=2, micro_batch_size=8)
    batch = _batch(tiny_model_dir, 8)
    recorder = LossRecorder(engine, monkeypatch)

    result = engine.update(batch, int(batch["completion_mask_B_C"].sum()))

    (first,), (second,) = recorder.steps()
    mask_B_C = batch["completion_mask_B_C"]
    # Both epochs take the ratio against the same proximal log-probs: those of the weights the update started from.
    torch.testing.assert_close(second["old_logprobs"], first["old_logprobs"], rtol=0, atol=0)
    torch.testing.assert_close(
        torch.where(mask_B_C, first["old_logprobs"], 0.0), batch["logprobs_B_C"], rtol=1e-5, atol=1e-5
    )
    # After the first optimizer step the policy moved: epoch 2's ratio is no longer 1.
    moved = (second["logprobs"] - second["old_logprobs"]).abs()[mask_B_C].max()
    assert float(moved) > 1e-3
    assert result["optimizer_steps"] == 2


def test_update_clips_the_gradient_before_the_optimizer_step_and_reports_the_norm_before_clipping(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    max_norm = 1e-3
    engine = _engine(tiny_model_dir, ppo_epochs=2, mini_batch_size=4, max_grad_norm=max_norm)
    batch = _batch(tiny_model_dir, 8)
    batch["advantages_B"] = torch.linspace(-2.0, 2.0, 8)
    mask_B_C = batch["completion_mask_B_C"]
    at_step = _step_norms(engine)
    raw = _raw_norms(engine, monkeypatch)
    normalisers = [(int(mask_B_C[:4].sum()), 4), (int(mask_B_C[4:].sum()), 4)]

    result = engine.update(batch, int(mask_B_C.sum()), minibatches=normalisers)

    assert len(at_step) == len(raw) == 4
    assert min(raw) > 10 * max_norm  # the clip had work to do at every step
    assert max(at_step) <= max_norm * (1 + 1e-4)  # ... and had done it when the optimizer stepped
    assert result["grad_norm"] == pytest.approx(sum(raw) / len(raw), rel=1e-9, abs=0.0)


def test_sft_update_clips_the_gradient_before_the_optimizer_step(tiny_model_dir: Path) -> None:
    max_norm = 1e-3
    engine = _engine(tiny_model_dir, max_grad_norm=max_norm)
    batch = _batch(tiny_model_dir, 4)
    shard = {k: batch[k] for k in ("prompt_ids_B_P", "prompt_mask_B_P", "completion_ids_B_C", "completion_mask_B_C")}
    at_step = _step_norms(engine)

    result = engine.sft_update(shard, int(shard["completion_mask_B_C"].sum()))

    assert len(at_step) == 1
    assert result["grad_norm"] > 10 * max_norm
    assert at_step[0] <= max_norm * (1 + 1e-4)
    assert engine.schedule.steps == 0  # SFT's learning rate is the caller's: the RL schedule does not step


def test_update_of_several_steps_reports_epoch_means_of_its_sums_and_the_mean_step_loss(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = _engine(tiny_model_dir, ppo_epochs=2, mini_batch_size=4)
    batch = _batch(tiny_model_dir, 8)
    mask_B_C = batch["completion_mask_B_C"]
    normalisers = [(int(mask_B_C[:4].sum()), 4), (int(mask_B_C[4:].sum()), 4)]
    recorder = LossRecorder(engine, monkeypatch)
    raw = _raw_norms(engine, monkeypatch)

    result = engine.update(batch, int(mask_B_C.sum()), minibatches=normalisers)

    steps = recorder.steps()
    assert result["tokens"] == float(mask_B_C.sum())  # each epoch sees each token once: the mean over epochs
    loss_sum = sum(c["loss_sum"] for c in recorder.calls) / 2
    assert result["loss_sum"] == pytest.approx(loss_sum, rel=1e-5, abs=1e-7)
    step_losses = [sum(c["loss"] for c in calls) for calls in steps]
    assert result["objective"] == pytest.approx(sum(step_losses) / len(step_losses), rel=1e-5, abs=1e-7)
    assert result["grad_norm"] == pytest.approx(sum(raw) / len(raw), rel=1e-9, abs=0.0)
    assert result["version"] == 1  # one published version however many steps


def test_one_step_tis_update_on_policy_gets_the_plain_policy_gradient(tiny_model_dir: Path) -> None:
    """With one optimizer step the proximal log-probs are the forward's own, detached: ratio 1 with the ratio's
    gradient, and an importance weight of 1 on an on-policy batch, so the gradient is the uncorrected one."""
    batch = _batch(tiny_model_dir, 6)
    tokens = int(batch["completion_mask_B_C"].sum())
    grads = {}
    for off_policy in ("none", "tis"):
        engine = _engine(tiny_model_dir, AlgorithmConfig(off_policy=off_policy))
        engine.accumulate_gradients(batch, tokens)
        grads[off_policy] = torch.cat([p.grad.flatten() for p in engine.unwrapped.parameters()])

    assert float(grads["none"].norm()) > 1e-3
    torch.testing.assert_close(grads["tis"], grads["none"], rtol=1e-4, atol=1e-6)


def _step_lrs(engine: Any) -> list[float]:
    """Registers an optimizer step pre-hook; the returned list receives the learning rate each step uses."""
    lrs: list[float] = []
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    inner.register_step_pre_hook(lambda optimizer, args, kwargs: lrs.append(float(optimizer.param_groups[0]["lr"])))
    return lrs


def test_update_zeroes_the_gradients_between_its_optimizer_steps(tiny_model_dir: Path) -> None:
    # lr 1e-12: the weights barely move, so both epochs' gradients of the one mini-batch are the same, unless the
    # first step's gradient is still on the parameters when the second accumulates.
    engine = _engine(tiny_model_dir, ppo_epochs=2, lr=1e-12, max_grad_norm=None)
    batch = _batch(tiny_model_dir, 6)
    at_step = _step_norms(engine)

    engine.update(batch, int(batch["completion_mask_B_C"].sum()))

    assert len(at_step) == 2 and at_step[0] > 1e-3
    assert at_step[1] == pytest.approx(at_step[0], rel=1e-4, abs=0.0)


def test_update_of_several_steps_reports_agreement_from_the_proximal_pass_on_the_starting_weights(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = _engine(tiny_model_dir, AlgorithmConfig(off_policy="tis"), ppo_epochs=2, mini_batch_size=4)
    batch = _batch(tiny_model_dir, 8)
    mask_B_C = batch["completion_mask_B_C"]
    normalisers = [(int(mask_B_C[:4].sum()), 4), (int(mask_B_C[4:].sum()), 4)]
    recorder = LossRecorder(engine, monkeypatch)

    result = engine.update(batch, int(mask_B_C.sum()), minibatches=normalisers)

    last = recorder.steps()[-1]
    moved = max(float((c["logprobs"] - c["old_logprobs"]).abs()[c["old_logprobs"] != 0].max()) for c in last)
    assert moved > 1e-3  # the later steps' forwards ran on moved weights ...
    # ... but trainer and engine are compared on the weights the engine sampled with: they agree
    assert result["agreement_tokens"] == float(mask_B_C.sum())
    assert result["logprob_absdiff_sum"] < 1e-5 * float(mask_B_C.sum())
    assert result["logprob_absdiff_max"] < 1e-5
    assert result["ratio_max"] == pytest.approx(1.0, rel=0.0, abs=1e-5)


def test_update_reports_the_learning_rate_of_its_first_optimizer_step(tiny_model_dir: Path) -> None:
    engine = _engine(tiny_model_dir, mini_batch_size=4, lr_scheduler="linear", warmup_steps=3, max_steps=4)
    batch = _batch(tiny_model_dir, 8)
    mask_B_C = batch["completion_mask_B_C"]
    normalisers = [(int(mask_B_C[:4].sum()), 4), (int(mask_B_C[4:].sum()), 4)]
    lrs = _step_lrs(engine)

    first = engine.update(batch, int(mask_B_C.sum()), minibatches=normalisers)
    second = engine.update(batch, int(mask_B_C.sum()), minibatches=normalisers)

    assert lrs == pytest.approx([0.0, 1e-2 / 3, 2e-2 / 3, 1e-2], rel=1e-9, abs=1e-15)  # warm-up over 3 steps
    assert (first["lr"], second["lr"]) == pytest.approx((lrs[0], lrs[2]), rel=1e-9, abs=1e-15)


def test_sft_update_with_an_lr_steps_with_it_once_and_restores_the_optimizer_learning_rate(
    tiny_model_dir: Path,
) -> None:
    engine = _engine(tiny_model_dir)  # train.lr 1e-2
    batch = _batch(tiny_model_dir, 4)
    shard = {k: batch[k] for k in ("prompt_ids_B_P", "prompt_mask_B_P", "completion_ids_B_C", "completion_mask_B_C")}
    lrs = _step_lrs(engine)

    result = engine.sft_update(shard, int(shard["completion_mask_B_C"].sum()), lr=0.5)
    after = engine.sft_update(shard, int(shard["completion_mask_B_C"].sum()))

    assert lrs == pytest.approx([0.5, 1e-2], rel=1e-12, abs=0.0)
    assert (result["lr"], after["lr"]) == pytest.approx((0.5, 1e-2), rel=1e-12, abs=0.0)
    assert {g["lr"] for g in engine.optimizer.param_groups} == {1e-2}


def _sft_step_gradients(rank: int, world_size: int, model_dir: str, shard_keys: dict, num_tokens: int) -> dict:
    """The gradients this rank's optimizer sees at its ``sft_update`` step (after DDP's all-reduce)."""
    from accelerate import Accelerator

    from rlsdk.engine.train.engine import TrainEngine

    config = SessionConfig(model=ModelConfig(path=model_dir), train=TrainConfig(micro_batch_size=2, max_grad_norm=None))
    engine = TrainEngine(config, Accelerator(cpu=True))
    grads: dict[str, torch.Tensor] = {}
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)

    def pre_hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        grads.update({name: p.grad.clone() for name, p in engine.unwrapped.named_parameters()})

    inner.register_step_pre_hook(pre_hook)
    per_rank = shard_keys["completion_ids_B_C"].shape[0] // world_size
    shard = {k: v[rank * per_rank : (rank + 1) * per_rank] for k, v in shard_keys.items()}
    engine.sft_update(shard, num_tokens)
    return grads


@pytest.mark.distributed
def test_sft_update_over_two_gloo_ranks_steps_with_the_whole_batch_token_mean_gradient(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    from rlsdk.algorithms import completion_logprobs
    from rlsdk.algorithms.sft import sft_loss
    from rlsdk.testing.distributed import run_gloo_ranks

    model_dir = str(tiny_model_dir)
    batch = _batch(tiny_model_dir, 8, seed=3)
    keys = ("prompt_ids_B_P", "prompt_mask_B_P", "completion_ids_B_C", "completion_mask_B_C")
    tensors = {k: batch[k] for k in keys}
    num_tokens = int(tensors["completion_mask_B_C"].sum())
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    logprobs_B_C, _ = completion_logprobs(model, *(tensors[k] for k in keys))
    loss, _ = sft_loss(logprobs_B_C, tensors["completion_mask_B_C"], num_tokens=num_tokens)
    loss.backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}

    per_rank = run_gloo_ranks(_sft_step_gradients, 2, model_dir, tensors, num_tokens)

    for grads in per_rank:
        for name, grad in expected.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
