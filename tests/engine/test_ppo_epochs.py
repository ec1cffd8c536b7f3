"""Several optimizer steps per update (train.ppo_epochs, train.mini_batch_size) and the learning-rate schedule."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from rlsdk.config import AlgorithmConfig, ConfigError, ModelConfig, SessionConfig, TrainConfig
from rlsdk.engine.train.schedule import minibatch_bounds, minibatch_normalisers, optimizer_steps_per_update
from rlsdk.testing.distributed import run_gloo_ranks


def _on_policy_batch(model_dir: str, batch: int = 16, group_size: int = 4, seed: int = 0) -> dict[str, torch.Tensor]:
    """A GRPO-like update batch whose behaviour log-probs are the model's own (trainer and engine in sync)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlsdk.algorithms import completion_logprobs
    from rlsdk.engine.inference.sampling import left_pad

    gen = torch.Generator().manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [f"{int(n):03d}>" for n in torch.randint(0, 1000, (batch // group_size,), generator=gen)]
    prompts = [p for p in prompts for _ in range(group_size)]
    prompt_ids_B_P, prompt_mask_B_P = left_pad([tokenizer(p)["input_ids"] for p in prompts], tokenizer.pad_token_id)
    digits = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)]
    completion_ids_B_C = torch.tensor(digits)[torch.randint(0, 10, (batch, 5), generator=gen)]
    completion_mask_B_C = torch.arange(5)[None, :] < torch.randint(1, 6, (batch,), generator=gen)[:, None]
    completion_ids_B_C = torch.where(completion_mask_B_C, completion_ids_B_C, tokenizer.pad_token_id)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        logprobs_B_C, _ = completion_logprobs(
            model, prompt_ids_B_P, prompt_mask_B_P, completion_ids_B_C, completion_mask_B_C, share_prompts=True
        )
    return {
        "prompt_ids_B_P": prompt_ids_B_P,
        "prompt_mask_B_P": prompt_mask_B_P,
        "completion_ids_B_C": completion_ids_B_C,
        "completion_mask_B_C": completion_mask_B_C,
        "logprobs_B_C": torch.where(completion_mask_B_C, logprobs_B_C, 0.0),
        # large advantages so that a few steps at lr 1e-2 move the ratio out of the clip range
        "advantages_B": 3.0 * torch.randn(batch, generator=gen),
    }


def _config(model_dir: str, **train: object) -> SessionConfig:
    return SessionConfig(
        model=ModelConfig(path=model_dir),
        train=TrainConfig(**{"micro_batch_size": 2, "lr": 1e-2, **train}),  # type: ignore[arg-type]
        algorithm=AlgorithmConfig(off_policy="tis"),
    )


def _instrumented_update(rank: int, world_size: int, model_dir: str, batch: dict, train: dict) -> dict:
    """One ``update`` on this rank's shard, recording every log-prob forward: grad mode, optimizer steps taken
    before it, and its output."""
    from accelerate import Accelerator

    import rlsdk.engine.train.engine as engine_module
    from rlsdk.engine.train.engine import TrainEngine

    engine = TrainEngine(_config(model_dir, **train), Accelerator(cpu=True))
    calls: list[dict] = []
    original = engine_module.completion_logprobs

    def recording(*args: object, **kwargs: object) -> tuple:
        out = original(*args, **kwargs)  # type: ignore[arg-type]
        calls.append(
            {"grad": torch.is_grad_enabled(), "steps_before": engine.schedule.steps, "logprobs": out[0].detach()}
        )
        return out

    engine_module.completion_logprobs = recording  # this rank process's own module; it exits after the test
    per_rank = batch["advantages_B"].shape[0] // world_size
    shard = {k: v[rank * per_rank : (rank + 1) * per_rank] for k, v in batch.items()}
    minibatches = minibatch_normalisers(batch["completion_mask_B_C"], world_size, engine.config.train.mini_batch_size)
    result = engine.update(shard, int(batch["completion_mask_B_C"].sum()), minibatches=minibatches)
    return {"calls": calls, "result": result, "shard": shard, "steps": engine.schedule.steps}


@pytest.mark.distributed
@pytest.mark.parametrize("parallelism", ["ddp", "fsdp2"])
def test_update_with_ppo_epochs_computes_old_logprobs_once_before_the_first_step_equal_to_behaviour(
    tiny_model_dir: Path, parallelism: str
) -> None:
    model_dir = str(tiny_model_dir)
    batch = _on_policy_batch(model_dir)
    # 2 ranks x 8 sequences: 4 mini-batches of 2 per rank
    train = {"ppo_epochs": 2, "mini_batch_size": 4, "parallelism": parallelism}

    per_rank = run_gloo_ranks(_instrumented_update, 2, model_dir, batch, train)

    for got in per_rank:
        no_grad = [c for c in got["calls"] if not c["grad"]]
        with_grad = [c for c in got["calls"] if c["grad"]]
        # one proximal pass over the shard (4 micro-batches of 2), all before the first optimizer step
        assert len(no_grad) == 4 and all(c["steps_before"] == 0 for c in no_grad)
        assert got["calls"][:4] == no_grad
        assert got["steps"] == got["result"]["optimizer_steps"] == 2 * 4
        assert [c["steps_before"] for c in with_grad] == list(range(8))  # one forward per mini-batch of 2
        old_B_C = torch.cat([c["logprobs"] for c in no_grad])
        mask_B_C = got["shard"]["completion_mask_B_C"]
        torch.testing.assert_close(
            torch.where(mask_B_C, old_B_C, 0.0), got["shard"]["logprobs_B_C"], rtol=1e-5, atol=1e-5
        )
        first = with_grad[0]["logprobs"]  # the first mini-batch's first forward: still the behaviour weights
        torch.testing.assert_close(
            torch.where(mask_B_C[:2], first, 0.0), torch.where(mask_B_C[:2], old_B_C[:2], 0.0), rtol=0, atol=1e-6
        )
        # the agreement metrics come from the proximal pass: trainer and engine agree
        assert got["result"]["logprob_absdiff_max"] < 1e-5
        # later steps move the policy: the ratio against the old log-probs leaves the clip range
        assert got["result"]["clipped_tokens"] > 0
    assert per_rank[0]["result"]["version"] == per_rank[1]["result"]["version"] == 1  # one published version


@pytest.mark.distributed
def test_update_with_one_step_runs_no_proximal_forward(tiny_model_dir: Path) -> None:
    model_dir = str(tiny_model_dir)
    batch = _on_policy_batch(model_dir, batch=8)

    per_rank = run_gloo_ranks(_instrumented_update, 2, model_dir, batch, {})

    for got in per_rank:
        assert all(c["grad"] for c in got["calls"])  # the single step's own forward is the proximal one
        assert got["result"]["optimizer_steps"] == 1 and got["result"]["clipped_tokens"] == 0


def _minibatch_gradients(rank: int, world_size: int, model_dir: str, batch: dict, index: int) -> dict:
    """This rank's gradients of global mini-batch ``index`` (its local slice, the mini-batch's normalisers)."""
    from accelerate import Accelerator

    from rlsdk.engine.train.engine import TrainEngine

    config = _config(model_dir, mini_batch_size=4)
    config = dataclasses.replace(config, algorithm=AlgorithmConfig(name="dr_grpo"))
    engine = TrainEngine(config, Accelerator(cpu=True))
    per_rank = batch["advantages_B"].shape[0] // world_size
    shard = {k: v[rank * per_rank : (rank + 1) * per_rank] for k, v in batch.items()}
    lo, hi = minibatch_bounds(per_rank, 4, world_size)[index]
    tokens, sequences = minibatch_normalisers(batch["completion_mask_B_C"], world_size, 4)[index]
    engine.accumulate_gradients({k: v[lo:hi] for k, v in shard.items()}, tokens, num_sequences_global=sequences)
    return {name: p.grad.clone() for name, p in engine.unwrapped.named_parameters()}


@pytest.mark.distributed
@pytest.mark.parametrize("index", [0, 2])
def test_minibatch_gradients_over_two_gloo_ranks_equal_the_single_process_minibatch_loss(
    tiny_model_dir: Path, index: int
) -> None:
    from transformers import AutoModelForCausalLM

    from rlsdk.algorithms import completion_logprobs, policy_loss

    model_dir = str(tiny_model_dir)
    batch = _on_policy_batch(model_dir)
    per_rank = 8
    lo, hi = minibatch_bounds(per_rank, 4, 2)[index]
    rows = torch.cat([torch.arange(r * per_rank + lo, r * per_rank + hi) for r in range(2)])
    mb = {k: v[rows] for k, v in batch.items()}  # global mini-batch `index`: slice `index` of each rank
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    logprobs_B_C, _ = completion_logprobs(
        model, mb["prompt_ids_B_P"], mb["prompt_mask_B_P"], mb["completion_ids_B_C"], mb["completion_mask_B_C"]
    )
    loss, _ = policy_loss(
        logprobs_B_C,
        mb["logprobs_B_C"],
        mb["advantages_B"],
        mb["completion_mask_B_C"],
        clip_eps_low=0.2,
        clip_eps_high=0.2,
        loss_agg="seq_sum_fixed_len",
        max_len=32,
    )
    loss.backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}

    per_rank_grads = run_gloo_ranks(_minibatch_gradients, 2, model_dir, batch, index)

    for grads in per_rank_grads:
        for name, grad in expected.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_minibatch_bounds_split_each_rank_shard_into_equal_local_slices() -> None:
    assert minibatch_bounds(8, None, 2) == [(0, 8)]
    assert minibatch_bounds(8, 4, 2) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert minibatch_bounds(7, 6, 2) == [(0, 3), (3, 6), (6, 7)]  # a smaller last mini-batch
    with pytest.raises(ValueError, match="multiple of world_size=2"):
        minibatch_bounds(8, 3, 2)


def test_minibatch_normalisers_sum_each_minibatch_over_every_rank_shard() -> None:
    mask_B_C = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0], [0, 0, 0]], dtype=torch.bool)

    got = minibatch_normalisers(mask_B_C, 2, 4)  # rank shards rows 0-2, 3-5; local slices (0, 2), (2, 3)

    assert got == [(2 + 1 + 1 + 2, 4), (3 + 0, 2)]
    assert sum(t for t, _ in got) == int(mask_B_C.sum())


@pytest.mark.parametrize("name", ["constant", "linear", "cosine"])
def test_lr_schedule_follows_transformers_schedule_per_optimizer_step(tiny_model_dir: Path, name: str) -> None:
    import transformers

    from rlsdk.engine.train.schedule import LRSchedule

    config = SessionConfig(
        model=ModelConfig(path=str(tiny_model_dir)),
        train=TrainConfig(lr=1.0, lr_scheduler=name, warmup_steps=3, max_steps=5, ppo_epochs=2),
    )
    horizon = 5 * 2
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)
    schedule = LRSchedule(optimizer, config)
    reference_opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)
    reference = transformers.get_scheduler(
        {"constant": "constant_with_warmup"}.get(name, name),
        reference_opt,
        num_warmup_steps=3,
        num_training_steps=horizon,
    )

    got, want = [], []
    for _ in range(horizon):
        got.append(schedule.lr())
        want.append(reference.get_last_lr()[0])
        optimizer.step()  # no gradients: changes nothing, keeps torch's step-order check quiet
        reference_opt.step()
        schedule.step()
        reference.step()

    assert schedule.horizon == horizon == optimizer_steps_per_update(config) * 5
    assert got == pytest.approx(want, rel=1e-12, abs=0.0)
    assert got[:3] == pytest.approx([0.0, 1 / 3, 2 / 3])


def _schedule(model_dir: Path, name: str, max_steps: int) -> object:
    from rlsdk.engine.train.schedule import LRSchedule

    config = SessionConfig(
        model=ModelConfig(path=str(model_dir)),
        train=TrainConfig(lr=1.0, lr_scheduler=name, warmup_steps=2, max_steps=max_steps),
    )
    return LRSchedule(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0), config)


def test_constant_lr_schedule_resumed_with_more_max_steps_continues_from_the_saved_step(tiny_model_dir: Path) -> None:
    saved = _schedule(tiny_model_dir, "constant", max_steps=2)
    for _ in range(2):
        saved.scheduler.optimizer.step()
        saved.step()
    extended = _schedule(tiny_model_dir, "constant", max_steps=4)

    extended.load_state_dict(saved.state_dict())

    assert extended.steps == 2
    assert extended.lr() == pytest.approx(1.0, rel=1e-12, abs=0.0)


@pytest.mark.parametrize(("name", "max_steps"), [("linear", 4), ("cosine", 3)])
def test_decaying_lr_schedule_resumed_with_another_horizon_raises_naming_the_schedule(
    tiny_model_dir: Path, name: str, max_steps: int
) -> None:
    saved = _schedule(tiny_model_dir, name, max_steps=2)
    resumed = _schedule(tiny_model_dir, name, max_steps=max_steps)

    with pytest.raises(ValueError, match=rf"train.lr_scheduler '{name}' over {max_steps}"):
        resumed.load_state_dict(saved.state_dict())


def test_lr_schedule_resumed_with_another_name_raises(tiny_model_dir: Path) -> None:
    saved = _schedule(tiny_model_dir, "constant", max_steps=2)
    resumed = _schedule(tiny_model_dir, "linear", max_steps=2)

    with pytest.raises(ValueError, match="the checkpoint's learning-rate schedule is 'constant'"):
        resumed.load_state_dict(saved.state_dict())


@pytest.mark.parametrize(
    ("train", "field"),
    [
        ({"ppo_epochs": 0}, "TrainConfig.ppo_epochs"),
        ({"mini_batch_size": 0}, "TrainConfig.mini_batch_size"),
        ({"warmup_steps": -1}, "TrainConfig.warmup_steps"),
        ({"lr_scheduler": "exponential"}, "TrainConfig.lr_scheduler"),
    ],
)
def test_train_config_with_bad_schedule_field_raises_config_error_naming_it(train: dict, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        TrainConfig(**train)  # type: ignore[arg-type]

    assert info.value.field == field


@pytest.mark.parametrize(
    ("mini_batch_size", "allowed"), [(3, "a multiple of launch.num_ranks = 2"), (80, "at most data.prompts_per_step")]
)
def test_session_config_with_mini_batch_size_not_splitting_over_ranks_raises_config_error(
    tiny_model_dir: Path, mini_batch_size: int, allowed: str
) -> None:
    from rlsdk.config import DataConfig, RolloutConfig

    with pytest.raises(ConfigError, match=allowed) as info:
        SessionConfig(
            model=ModelConfig(path=str(tiny_model_dir)),
            train=TrainConfig(mini_batch_size=mini_batch_size),
            rollout=RolloutConfig(group_size=4),
            data=DataConfig(prompts_per_step=16),
        )

    assert info.value.field == "train.mini_batch_size"
