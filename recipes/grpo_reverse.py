"""GRPO on "reverse a 3-digit string" with a tiny randomly initialised policy, on background CPU ranks.

Run: ``rlsdk run recipes/grpo_reverse.py [--train.lr 1e-3 --launch.num-ranks 2 ...]``.

The loop is rollout -> reward -> update -> sync, one optimizer step per rollout (so every batch is on-policy,
``max_staleness = 0``). Departures from the GRPO paper (Shao et al. 2024, DeepSeekMath):
- the loss is a token-level mean over all completion tokens of the batch (as in DAPO), not a per-sequence mean;
- no KL penalty by default (``algorithm.kl_coef = 0``), as in DAPO and Dr. GRPO;
- advantages are group-centred rewards NOT divided by the group std (``algorithm.scale_rewards = False``, as in
  Dr. GRPO, Liu et al. 2025): with std scaling a group whose rewards barely differ gets full-size advantages, and
  on this task the policy could settle on a near-miss answer;
- an entropy bonus (``algorithm.entropy_coef = 0.01``; the GRPO paper has none): it keeps the policy sampling EOS
  long enough to discover stopping;
- one policy update per batch, so the PPO ratio is ~1 and clipping only guards against engine/trainer drift;
- training stops early once the moving mean reward reaches ``train.target_reward`` (the library loop,
  ``Session.train``, honours it, as it does ``train.max_steps``, ``checkpoint_every`` and ``eval_every``).

How many steps and seconds each of these choices takes to the target, per seed and engine, is measured by
``benchmarks/algorithms.py --task reverse`` and ``benchmarks/bare_grpo.py`` (results in ``benchmarks/results/``).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from rlsdk import Session
from rlsdk.config import (
    AlgorithmConfig,
    DataConfig,
    EmbeddedConfig,
    InferenceConfig,
    ModelConfig,
    ObserveConfig,
    RolloutConfig,
    SessionConfig,
    TrainConfig,
)
from rlsdk.data import build_tiny_policy
from rlsdk.rewards import reverse_reward

DEFAULT_MODEL = "outputs/models/tiny-reverse"
# vLLM's CPU attention has no kernel for head_dim 16: with --inference.engine vllm the default policy is built with
# 2 heads of 32 dims instead of 4 of 16 (same parameter count).
DEFAULT_VLLM_MODEL = "outputs/models/tiny-reverse-h32"


def config() -> SessionConfig:
    return SessionConfig(
        model=ModelConfig(path=DEFAULT_MODEL),
        train=TrainConfig(lr=1e-3, max_steps=2000, target_reward=0.9, micro_batch_size=128),
        algorithm=AlgorithmConfig(scale_rewards=False, entropy_coef=0.01),
        # One thread for the embedded engine: the 2 ranks take a core each while they train, and a second engine
        # thread's OpenMP worker spin-waits beside them after every generation on a 2-core machine. More threads pay
        # off for larger models.
        inference=InferenceConfig(embedded=EmbeddedConfig(num_threads=1)),
        rollout=RolloutConfig(group_size=16, max_new_tokens=5, temperature=1.0),
        data=DataConfig(prompts_per_step=16, min_digits=3, max_digits=3),
        # One output root per run, so TensorBoard curves and checkpoints of separate runs never mix.
        observe=ObserveConfig(output_dir=f"outputs/grpo_reverse/{time.strftime('%Y%m%d-%H%M%S')}", console=False),
    )


async def main(config: SessionConfig) -> dict[str, object]:
    if config.model.path == DEFAULT_MODEL and config.inference.engine == "vllm":
        config = dataclasses.replace(config, model=dataclasses.replace(config.model, path=DEFAULT_VLLM_MODEL))
        build_tiny_policy(DEFAULT_VLLM_MODEL, seed=config.seed, num_heads=2)
    if config.model.path == DEFAULT_MODEL and not Path(DEFAULT_MODEL, "config.json").is_file():
        build_tiny_policy(DEFAULT_MODEL, seed=config.seed)
    start = time.perf_counter()
    async with await Session.start(config) as session:
        # The library loop: train.max_steps (a resumed run continues up to it), train.checkpoint_every,
        # train.eval_every and train.target_reward, with a progress bar; a final checkpoint.
        result = await session.train(reverse_reward)
        output_dir = session.output_dir
    summary = {
        "steps": result.steps,
        "final_moving_reward": result.final_reward,
        "reached_target": result.reached_target,
        "reached_target_at": result.reached_target_at,
        "seconds": time.perf_counter() - start,
        "checkpoint": str(result.checkpoints[-1]) if result.checkpoints else None,
        "tensorboard": str(output_dir / "tensorboard"),
        "logs": str(output_dir / "logs"),
    }
    print_summary(result.rewards, summary, config.observe.moving_average)
    return summary


def print_summary(rewards: list[float], summary: dict[str, object], window: int) -> None:
    print("\nreward curve (moving mean over", window, "steps):")
    # A resumed run that was already at max_steps trains no step: no curve to draw.
    marks = sorted({0, *range(0, len(rewards), max(1, len(rewards) // 10)), len(rewards) - 1}) if rewards else []
    for i in marks:
        chunk = rewards[max(0, i - window + 1) : i + 1]
        mean = sum(chunk) / len(chunk)
        print(f"  step {i + 1:5d}  reward {mean:.3f}  {'#' * round(mean * 40)}")
    print(
        f"\n{summary['steps']} steps in {summary['seconds']:.0f} s; final moving reward "
        f"{summary['final_moving_reward']:.3f} ({'reached' if summary['reached_target'] else 'did NOT reach'} target)"
    )
    print(f"TensorBoard: tensorboard --logdir {summary['tensorboard']}")
    print(f"checkpoint:  {summary['checkpoint']}")
    print(f"logs:        {summary['logs']}")
