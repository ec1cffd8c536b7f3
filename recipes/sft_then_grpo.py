"""A post-training run on CPU: SFT a randomly initialised model on worked solutions, then GRPO from that checkpoint.

Run: ``rlsdk run recipes/sft_then_grpo.py [--sft.steps 800 --train.max-steps 150 --algorithm.name dr_grpo ...]``.

The task (``rlsdk.data.reasoning``): add two 2-3 digit numbers with a ``<think>`` scratchpad, one line per column,
then ``The answer is N.`` (completions of ~30-55 tokens of a byte-level BPE vocabulary trained here). Everything is
generated locally and seeded: the data files (``outputs/data/addition/{sft,rl,test}.jsonl``, chat-message rows as
TRL's trainers read them), the tokenizer and a ~216k-parameter Qwen2-style model with random weights.

1. **SFT** on the ranks (``Session.sft_update``): completion-only loss through the ChatML template, on a corpus
   whose traces slip as a real corpus does (``rlsdk.data.reasoning``: 70% of the traces that carry into the
   last column drop that carry; 10% have a column off by one). The fine-tuned policy copies the frequent slip when
   decoding greedily: it solves the problems without that carry (about half), fails most of the others.
   Evaluated on the held-out split, checkpointed (signed, as every checkpoint).
2. **GRPO** in a new Session whose ``model.path`` is that checkpoint's model (a fresh optimizer, the RL learning
   rate), rewarded on the TRUE answer (exact match) plus 0.1 for the format; ``Session.train`` evaluates the
   held-out split greedily and sampled every ``train.eval_every`` steps. RL turns the carries the policy samples
   sometimes into the ones it writes greedily. ``--train.lora-rank R`` trains LoRA adapters on the SFT'd weights
   in this phase only (SFT always trains every weight of the random-init model); docs/howto/lora.md has the
   learning rates measured for it.

Both phases generate on the train ranks (``inference.engine='colocated'``: no separate engine, no weights to
copy); ``--inference.engine embedded`` or ``vllm`` serve from a separate engine instead, with the same results up to
the sampler's random draws.

Held-out accuracy is ``eval/pass@1``: the share of held-out problems whose answer is right (greedy: temperature 0;
sampled: ``rollout.temperature``, 4 samples per problem). The summary (printed, and written to
``OUTPUT/summary.json``) has SFT's accuracy, GRPO's before and after, the gain and the wall time of each phase.

Departures from GRPO as published (Shao et al. 2024), as in recipes/grpo_reverse.py where they apply:
- the loss is a token mean over the batch's completion tokens (DAPO), not a per-sequence mean;
- no KL penalty and no reference model (``algorithm.kl_coef = 0``), as DAPO and Dr. GRPO;
- one policy update per batch (on-policy), so the PPO ratio is ~1 and clipping only guards engine/trainer drift;
- SFT runs a fixed number of steps with a warm-up and cosine schedule computed here (``sft_update(batch, lr=)``);
  GRPO warms its learning rate up over its first 10 steps (``train.warmup_steps``), then keeps it constant.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlsdk import Session
from rlsdk.config import (
    DataConfig,
    EmbeddedConfig,
    InferenceConfig,
    ModelConfig,
    ObserveConfig,
    RolloutConfig,
    SessionConfig,
    TrainConfig,
)
from rlsdk.data.reasoning import (
    ReasoningTask,
    answer_reward,
    build_reasoning_policy,
    format_reward,
    write_reasoning_task,
)
from rlsdk.data.sft import SFTBatches
from rlsdk.rewards import combine_rewards

DATA_DIR = "outputs/data/addition"
BASE_MODEL = "outputs/models/addition-base"
# The training reward: the answer (1.0) plus the format (0.1). Evaluation uses it too, with pass@1 at reward
# >= 1.0: an answer that is right.
REWARD = combine_rewards({"answer": (answer_reward, 1.0), "format": (format_reward, 0.1)})


@dataclass
class SFTPhase:
    """The supervised warm start (this recipe's own section: ``--sft.steps``, ``--sft.lr``, ...).

    Attributes:
        steps: SFT optimizer steps, >= 1.
        batch_size: SFT rows per step, a multiple of launch.num_ranks.
        lr: Peak AdamW learning rate of the SFT phase, > 0 (train.lr is GRPO's): linear warm-up over
            warmup_steps, then cosine decay to a tenth at the last step.
        warmup_steps: Steps of the SFT warm-up, >= 0.
        eval_every: Evaluate the held-out split every N SFT steps and after the last, >= 1.
        hidden_size: Width of the model built at model.path when it does not exist yet.
        num_layers: Decoder layers of that model.
        num_heads: Attention heads of that model.
        carry_slip: Share of SFT traces with a carry into the last column that drop it, in [0, 1].
        digit_slip: Share of SFT traces with a column off by one, in [0, 1].
    """

    steps: int = 800
    batch_size: int = 32
    lr: float = 3e-3
    warmup_steps: int = 50
    eval_every: int = 200
    hidden_size: int = 64
    num_layers: int = 3
    num_heads: int = 4
    carry_slip: float = 0.7
    digit_slip: float = 0.1

    def __post_init__(self) -> None:
        from rlsdk.config.validate import require

        require(self, "steps", self.steps >= 1, "an int >= 1")
        require(self, "batch_size", self.batch_size >= 1, "an int >= 1")
        require(self, "lr", self.lr > 0, "a float > 0")
        require(self, "warmup_steps", self.warmup_steps >= 0, "an int >= 0")
        require(self, "eval_every", self.eval_every >= 1, "an int >= 1")


@dataclass
class SFTThenGRPOConfig(SessionConfig):
    """The GRPO phase's SessionConfig (every ``rlsdk run`` flag) plus this recipe's SFT section."""

    sft: SFTPhase = field(default_factory=SFTPhase)
    eval_samples: int = 4


def sft_lr(sft: SFTPhase, step: int) -> float:
    """The SFT learning rate of ``step`` (1-based): linear warm-up to ``sft.lr``, then cosine decay to a tenth."""
    if step <= sft.warmup_steps:
        return sft.lr * step / sft.warmup_steps
    progress = (step - sft.warmup_steps) / max(1, sft.steps - sft.warmup_steps)
    return sft.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))


def session_config(config: SFTThenGRPOConfig, **changes: Any) -> SessionConfig:
    """The plain SessionConfig of ``config`` (the ranks know no recipe sections), with ``changes`` applied."""
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(SessionConfig)}
    return SessionConfig(**{**fields, **changes})


def task(config: SFTThenGRPOConfig) -> ReasoningTask:
    return ReasoningTask(carry_slip=config.sft.carry_slip, digit_slip=config.sft.digit_slip, seed=config.seed)


def config() -> SFTThenGRPOConfig:
    data_dir = Path(DATA_DIR)
    return SFTThenGRPOConfig(
        model=ModelConfig(path=BASE_MODEL),
        # GRPO: 16 problems x 8 samples per step at temperature 1.0. A fresh AdamW's first steps move every weight
        # by about lr whatever the gradient's size; the warm-up keeps them from undoing the SFT policy in one step.
        train=TrainConfig(lr=5e-4, warmup_steps=10, max_steps=150, eval_every=10, micro_batch_size=64),
        rollout=RolloutConfig(group_size=8, max_new_tokens=72, temperature=1.0),
        # The ranks generate with the weights they train (docs/howto/colocated.md), as TRL's GRPOTrainer does: on
        # a CPU machine every rank samples its share of the batch on its own core, where the embedded engine
        # samples the whole batch on one while the ranks wait, and a sync moves nothing. --inference.engine
        # embedded runs the controller-side engine instead (then with one thread: the ranks take a core each).
        inference=InferenceConfig(engine="colocated", embedded=EmbeddedConfig(num_threads=1)),
        data=DataConfig(
            task="file",
            path=str(data_dir / "rl.jsonl"),
            chat_template=True,
            prompts_per_step=16,
            eval_path=str(data_dir / "test.jsonl"),
        ),
        observe=ObserveConfig(output_dir=f"outputs/sft_then_grpo/{time.strftime('%Y%m%d-%H%M%S')}", console=False),
    )


def prepare(config: SFTThenGRPOConfig) -> None:
    """The data files (DATA_DIR, when the config points there) and the base model (model.path, when absent)."""
    if Path(config.data.path or "").parent == Path(DATA_DIR):
        write_reasoning_task(DATA_DIR, task(config))
    if not Path(config.model.path, "config.json").is_file():
        sft = config.sft
        build_reasoning_policy(
            config.model.path, task=task(config), hidden_size=sft.hidden_size, num_layers=sft.num_layers,
            num_heads=sft.num_heads, seed=config.seed,
        )  # fmt: skip


async def evaluate(session: Session, samples: int) -> dict[str, float]:
    """Greedy and (``samples`` > 0) sampled held-out evaluation of what the engine serves."""
    metrics = await session.evaluate(None, REWARD)
    if samples:
        metrics.update(await session.evaluate(None, REWARD, n=samples, greedy=False, prefix="eval_sampled"))
    return metrics


def sft_data_path(config: SFTThenGRPOConfig) -> Path:
    return Path(config.data.path or DATA_DIR).with_name("sft.jsonl")


async def sft_phase(config: SFTThenGRPOConfig, *, progress: bool = True) -> dict[str, Any]:
    """SFT from ``model.path`` in a Session of its own; returns the checkpoint, the evaluations and the times."""
    from rlsdk.observe.progress import make_bar

    sft = config.sft
    cfg = session_config(
        config,
        # Every weight: the base is randomly initialised, and LoRA adapters cannot make a policy of its small
        # output head (docs/howto/lora.md); train.lora_rank applies to GRPO, from the SFT'd weights.
        train=dataclasses.replace(config.train, lr=sft.lr, lora_rank=0),
        observe=dataclasses.replace(config.observe, output_dir=str(Path(config.observe.output_dir) / "sft")),
    )
    started = time.perf_counter()
    evaluations: list[dict[str, float]] = []
    train_seconds = 0.0
    async with await Session.start(cfg) as session:
        batches = SFTBatches.from_file(
            str(sft_data_path(config)), session.tokenizer, sft.batch_size, seed=config.seed,
            eos_token_ids=session.special_tokens.eos_token_ids,
        )  # fmt: skip
        bar = make_bar(total=sft.steps, desc="sft", unit="step", leave=True) if progress else None
        for step in range(1, sft.steps + 1):
            began = time.perf_counter()
            stats = await session.sft_update(batches.next_batch(), lr=sft_lr(sft, step))
            train_seconds += time.perf_counter() - began
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{stats['sft/loss']:.4f}", epoch=f"{batches.epoch:.2f}")
            if step % sft.eval_every == 0 or step == sft.steps:
                began = time.perf_counter()
                await session.sync_weights()
                train_seconds += time.perf_counter() - began
                metrics = await evaluate(session, config.eval_samples)
                evaluations.append({"step": float(step), "train_seconds": train_seconds, "loss": stats["sft/loss"],
                                    **metrics})  # fmt: skip
        if bar is not None:
            bar.close()
        checkpoint = await session.save_checkpoint()
    return {
        "checkpoint": str(checkpoint),
        "evaluations": evaluations,
        "train_seconds": train_seconds,
        "seconds": time.perf_counter() - started,
    }


async def rl_phase(config: SFTThenGRPOConfig, checkpoint: str, *, progress: bool = True) -> dict[str, Any]:
    """GRPO (``algorithm.*``) from the SFT checkpoint's model; returns the evaluations, rewards and times.

    The checkpoint is verified first (signature, manifest, every file's checksum), as ``train.resume_from`` is:
    its ``model/`` directory becomes ``model.path``."""
    from rlsdk.engine.train.checkpoint import verify_checkpoint

    verify_checkpoint(Path(checkpoint))
    cfg = session_config(
        config,
        model=dataclasses.replace(config.model, path=str(Path(checkpoint) / "model")),
        observe=dataclasses.replace(config.observe, output_dir=str(Path(config.observe.output_dir) / "rl")),
    )
    started = time.perf_counter()
    async with await Session.start(cfg) as session:
        before = {"step": 0.0, "train_seconds": 0.0, **await evaluate(session, config.eval_samples)}
        step_seconds: list[float] = []
        last = [time.perf_counter()]

        def clock(_stats: dict[str, float]) -> None:
            now = time.perf_counter()
            step_seconds.append(now - last[0])
            last[0] = now

        summary = await session.train(REWARD, progress=progress, eval_samples=config.eval_samples, on_step=clock)
    # Training time only: an evaluation runs after a step's on_step, so it falls in the next step's interval;
    # take it out again (its own eval/seconds).
    evaluations = [before]
    evaluation_seconds = {int(e["step"]): e.get("eval/seconds", 0.0) + e.get("eval_sampled/seconds", 0.0)
                          for e in summary.evaluations}  # fmt: skip
    train_seconds = 0.0
    for step, seconds in enumerate(step_seconds, start=1):
        train_seconds += seconds - evaluation_seconds.get(step - 1, 0.0)
        if step in evaluation_seconds:
            match = next(e for e in summary.evaluations if int(e["step"]) == step)
            evaluations.append({"train_seconds": train_seconds, **match})
    return {
        "evaluations": evaluations,
        "rewards": summary.rewards,
        "steps": summary.steps,
        "checkpoint": str(summary.checkpoints[-1]) if summary.checkpoints else None,
        "train_seconds": train_seconds,
        "seconds": time.perf_counter() - started,
    }


def gain_summary(sft: dict[str, Any], rl: dict[str, Any], key: str = "eval/pass@1") -> dict[str, Any]:
    """Accuracy after SFT, after GRPO (the last evaluation) and the best, the gain, and the first GRPO step and
    training seconds at which the gain reached 25 points."""
    start = rl["evaluations"][0][key]
    reached = next((e for e in rl["evaluations"] if e[key] - start >= 0.25 - 1e-9), None)
    return {
        "sft_accuracy": sft["evaluations"][-1][key],
        "rl_start_accuracy": start,
        "rl_final_accuracy": rl["evaluations"][-1][key],
        "rl_best_accuracy": max(e[key] for e in rl["evaluations"]),
        "gain": rl["evaluations"][-1][key] - start,
        "gain_25_at_step": None if reached is None else int(reached["step"]),
        "gain_25_at_train_seconds": None if reached is None else reached["train_seconds"],
    }


async def main(config: SFTThenGRPOConfig) -> dict[str, Any]:
    prepare(config)
    sft = await sft_phase(config)
    rl = await rl_phase(config, sft["checkpoint"])
    summary = {
        "greedy": gain_summary(sft, rl),
        "sampled": gain_summary(sft, rl, "eval_sampled/pass@1") if config.eval_samples else None,
        "sft_seconds": sft["seconds"],
        "rl_seconds": rl["seconds"],
        "rl_train_seconds": rl["train_seconds"],
        "sft": sft,
        "rl": rl,
    }
    out = Path(config.observe.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    print_summary(summary, out)
    return summary


def print_summary(summary: dict[str, Any], out: Path) -> None:
    greedy = summary["greedy"]
    print("\nheld-out accuracy (greedy pass@1):")
    for e in summary["sft"]["evaluations"]:
        print(f"  SFT  step {int(e['step']):5d}  {e['eval/pass@1']:.3f}  {'#' * round(e['eval/pass@1'] * 40)}")
    for e in summary["rl"]["evaluations"]:
        print(f"  GRPO step {int(e['step']):5d}  {e['eval/pass@1']:.3f}  {'#' * round(e['eval/pass@1'] * 40)}")
    reached = greedy["gain_25_at_step"]
    print(
        f"\nSFT {greedy['sft_accuracy']:.3f} -> GRPO {greedy['rl_final_accuracy']:.3f} (gain "
        f"{greedy['gain']:+.3f}; +0.25 {'at GRPO step ' + str(reached) if reached else 'not reached'}); "
        f"SFT {summary['sft_seconds']:.0f} s, GRPO {summary['rl_seconds']:.0f} s "
        f"({summary['rl_train_seconds']:.0f} s training)"
    )
    if summary["sampled"]:
        s = summary["sampled"]
        print(f"sampled pass@1: SFT {s['sft_accuracy']:.3f} -> GRPO {s['rl_final_accuracy']:.3f}")
    print(f"summary: {out / 'summary.json'}")
