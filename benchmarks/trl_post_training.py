"""rlsdk and TRL side by side on the post-training task: SFT, then GRPO from the same SFT checkpoint.

Per seed, the data files and the random-init model of recipes/sft_then_grpo.py are built once; then four runs,
each in a fresh subprocess:

1. ``rlsdk_sft``: the recipe's SFT phase (2 ranks, ``Session.sft_update``, its warm-up + cosine schedule);
2. ``trl_sft``: TRL's ``SFTTrainer`` from the same random init on the same SFT file (conversational
   prompt-completion rows, ``completion_only_loss``), the same hyper-parameters as far as they map:
   ``per_device_train_batch_size=32``, ``max_steps``, ``learning_rate=3e-3``, ``warmup_steps=50``,
   ``lr_scheduler_type='cosine_with_min_lr'`` with ``min_lr_rate=0.1`` (the recipe's schedule), AdamW betas
   (0.9, 0.999), no weight decay, ``max_grad_norm=1.0``;
3. ``rlsdk_grpo``: the recipe's GRPO phase from rlsdk's SFT checkpoint;
4. ``trl_grpo``: TRL's ``GRPOTrainer`` from the SAME checkpoint: 16 prompts x 8 generations
   (``per_device_train_batch_size=128, num_generations=8``), ``max_completion_length=72``, temperature 1.0,
   ``learning_rate=5e-4`` constant after the recipe's warm-up (``constant_with_warmup``, ``warmup_steps=10``),
   ``beta=0``, ``epsilon=0.2``, ``scale_rewards='group'`` (std-scaled, as the
   recipe's GRPO), ``loss_type='dapo'`` (token mean over the generation batch), ``num_iterations=1``, the answer
   and format rewards with ``reward_weights=[1.0, 0.1]``.

Every run scores the held-out split greedily (rlsdk's sampler at temperature 0 on the model being trained, for
TRL in a callback) before its first step and every ``--sft-eval-every`` / ``--grpo-eval-every`` steps; the clock
stops during evaluation, so the curves are held-out accuracy against training seconds. The claim, per phase: the
training seconds rlsdk needs to first reach TRL's final accuracy over the seconds TRL needed to reach it (<= 0.6
is the issue's target for GRPO).

Deviations (also in the JSON under ``trl_deviations``): TRL trains on what the chat template writes after the
assistant's ``<|im_end|>`` (a newline), rlsdk stops at the EOS; TRL's samplers shuffle with their own generators;
TRL runs in one process with 2 torch threads (the machine's cores), rlsdk with 2 ranks x 1 thread that also
generate (the recipe's ``inference.engine='colocated'``; ``--engine embedded``: plus the controller's engine, 1
thread); TRL generates with transformers ``generate`` and recomputes nothing (ratio exactly
1), rlsdk's ranks train on the engine's sampled log-probs.

Usage: ``python benchmarks/trl_post_training.py [--quick] [--seeds 0] [--sft-steps 800] [--grpo-steps 60]
[--engine colocated|embedded] [--json P]``. Needs the ``bench`` extra (TRL).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))

from _harness import write_json

ROOT = Path(__file__).resolve().parent.parent
SYSTEMS = ("rlsdk_sft", "trl_sft", "rlsdk_grpo", "trl_grpo")
TRL_THREADS = 2
TRL_DEVIATIONS = [
    "SFT targets: TRL trains on the newline the chat template writes after <|im_end|>; rlsdk stops at the EOS",
    "data order: TRL's samplers shuffle with their own generator; rlsdk's PromptSampler with torch.randperm",
    "threads: TRL one process with 2 torch threads; rlsdk 2 ranks x 1 thread that also generate (colocated), or "
    "2 ranks x 1 thread plus the embedded engine's 1 thread (see rlsdk_engine)",
    "GRPO old log-probs: TRL (num_iterations=1) uses the detached current ones (ratio exactly 1); rlsdk the "
    "engine's sampled log-probs (ratio 1 up to float rounding)",
    "evaluation: both greedy with rlsdk's sampler on the model being trained, outside the timed training",
]


def recipe_config(work: Path, seed: int, args: argparse.Namespace) -> Any:
    import sft_then_grpo as recipe

    from rlsdk.data.reasoning import write_reasoning_task

    base = recipe.config()
    task = dataclasses.replace(recipe.task(dataclasses.replace(base, seed=seed)), num_test=args.num_test)
    paths = write_reasoning_task(work / "data", task)
    config = dataclasses.replace(
        base,
        seed=seed,
        model=dataclasses.replace(base.model, path=str(work / "base")),
        inference=dataclasses.replace(base.inference, engine=args.engine or base.inference.engine),
        train=dataclasses.replace(base.train, max_steps=args.grpo_steps, eval_every=args.grpo_eval_every),
        data=dataclasses.replace(base.data, path=str(paths["rl"]), eval_path=str(paths["test"])),
        observe=dataclasses.replace(base.observe, output_dir=str(work / "rlsdk"), tensorboard=False),
        sft=dataclasses.replace(base.sft, steps=args.sft_steps, eval_every=args.sft_eval_every,
                                warmup_steps=min(base.sft.warmup_steps, args.sft_steps // 4)),
        eval_samples=0,
    )  # fmt: skip
    recipe.prepare(config)
    return config


# ---------------------------------------------------------------------------------------------------- workers


def held_out_accuracy(model: Any, tokenizer: Any, rows: list[dict[str, Any]], max_new_tokens: int) -> float:
    """Greedy pass@1 on ``rows`` with rlsdk's sampler (the embedded engine's), as ``Session.evaluate`` scores."""
    import torch

    from rlsdk.data.reasoning import answer_reward
    from rlsdk.engine.inference.protocol import SamplingParams
    from rlsdk.generation.sampling import sample_completions

    prompts = [tokenizer.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in rows]
    eos = model.generation_config.eos_token_id
    was_training = model.training
    model.eval()
    try:
        ids, mask, _ = sample_completions(
            model, tokenizer(prompts)["input_ids"], SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0),
            pad_token_id=tokenizer.pad_token_id, eos_token_id=eos,
        )  # fmt: skip
    finally:
        model.train(was_training)
    texts = tokenizer.batch_decode(torch.where(mask, ids, tokenizer.pad_token_id).tolist(), skip_special_tokens=True)
    rewards = answer_reward(texts, [r["answer"] for r in rows])
    return sum(rewards) / len(rewards)


def trl_clock(model_ref: list[Any], tokenizer: Any, rows: list[dict[str, Any]], every: int, points: list[dict]) -> Any:
    """A TrainerCallback timing TRL's steps with evaluation taken out of the clock."""
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        last = 0.0
        train_seconds = 0.0

        def _evaluate(self, step: int) -> None:
            accuracy = held_out_accuracy(model_ref[0], tokenizer, rows, 72)
            points.append({"step": step, "train_seconds": self.train_seconds, "accuracy": accuracy})
            print(f"  step {step}: held-out {accuracy:.3f} after {self.train_seconds:.1f} s", flush=True)

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            model_ref[0] = kwargs["model"]
            self._evaluate(0)
            self.last = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.train_seconds += time.perf_counter() - self.last
            if state.global_step % every == 0 or state.global_step == state.max_steps:
                self._evaluate(state.global_step)
            self.last = time.perf_counter()

    return Clock()


def worker_trl(system: str, config: Any, model_dir: str, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    import warnings

    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback

    warnings.filterwarnings("ignore", message="TRL currently supports vLLM versions")
    from trl import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer

    from rlsdk.data.reasoning import answer_reward, format_reward

    torch.set_num_threads(TRL_THREADS)
    data_dir = Path(config.data.path).parent
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    test = [json.loads(line) for line in (data_dir / "test.jsonl").read_text().splitlines()]
    points: list[dict[str, Any]] = []
    common = {
        "output_dir": str(out), "max_steps": args.sft_steps if system == "trl_sft" else args.grpo_steps,
        "weight_decay": 0.0, "adam_beta1": 0.9, "adam_beta2": 0.999, "max_grad_norm": 1.0, "use_cpu": True,
        "bf16": False, "fp16": False, "gradient_checkpointing": False, "report_to": "none", "save_strategy": "no",
        "logging_steps": 10, "disable_tqdm": True, "dataloader_num_workers": 0, "seed": config.seed,
        "data_seed": config.seed,
    }  # fmt: skip
    if system == "trl_sft":
        sft = config.sft
        rows = datasets.Dataset.from_json(str(data_dir / "sft.jsonl")).select_columns(["prompt", "completion"])
        trl_args = SFTConfig(
            per_device_train_batch_size=sft.batch_size, learning_rate=sft.lr, warmup_steps=sft.warmup_steps,
            lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": 0.1}, max_length=256,
            packing=False, completion_only_loss=True, **common,
        )  # fmt: skip
        clock = trl_clock([model], tokenizer, test, args.sft_eval_every, points)
        trainer: Any = SFTTrainer(model=model, args=trl_args, train_dataset=rows, processing_class=tokenizer,
                                  callbacks=[clock])  # fmt: skip
    else:
        rows = datasets.Dataset.from_json(str(data_dir / "rl.jsonl"))

        def answer(completions: list[Any], answer: list[str], **_: Any) -> list[float]:
            return answer_reward([c[0]["content"] for c in completions], answer)

        def form(completions: list[Any], **_: Any) -> list[float]:
            return format_reward([c[0]["content"] for c in completions])

        trl_args = GRPOConfig(
            per_device_train_batch_size=config.data.prompts_per_step * config.rollout.group_size,
            num_generations=config.rollout.group_size, num_iterations=1,
            max_completion_length=config.rollout.max_new_tokens, temperature=config.rollout.temperature, top_p=1.0,
            top_k=0, learning_rate=config.train.lr, lr_scheduler_type="constant_with_warmup",
            warmup_steps=config.train.warmup_steps, beta=0.0,
            epsilon=0.2, scale_rewards="group", loss_type="dapo", mask_truncated_completions=False,
            reward_weights=[1.0, 0.1], use_vllm=False, **common,
        )  # fmt: skip
        clock = trl_clock([model], tokenizer, test, args.grpo_eval_every, points)
        trainer = GRPOTrainer(model=model, reward_funcs=[answer, form], args=trl_args, train_dataset=rows,
                              processing_class=tokenizer, callbacks=[clock])  # fmt: skip
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    return {"points": points}


def worker_rlsdk(system: str, config: Any, checkpoint: str | None) -> dict[str, Any]:
    import sft_then_grpo as recipe

    if system == "rlsdk_sft":
        result = asyncio.run(recipe.sft_phase(config, progress=False))
    else:
        assert checkpoint is not None
        result = asyncio.run(recipe.rl_phase(config, checkpoint, progress=False))
    points = [{"step": int(e["step"]), "train_seconds": e["train_seconds"], "accuracy": e["eval/pass@1"]}
              for e in result["evaluations"]]  # fmt: skip
    return {"points": points, "checkpoint": result.get("checkpoint")}


def worker_main(args: argparse.Namespace) -> None:
    work = Path(args.work_dir)
    config = recipe_config(work, args.seed, args)
    if args.worker == "rlsdk_sft":
        config = dataclasses.replace(
            config, observe=dataclasses.replace(config.observe, output_dir=str(work / "rlsdk_sft"))
        )
        result = worker_rlsdk("rlsdk_sft", config, None)
    elif args.worker == "rlsdk_grpo":
        config = dataclasses.replace(
            config, observe=dataclasses.replace(config.observe, output_dir=str(work / "rlsdk_grpo"))
        )
        result = worker_rlsdk("rlsdk_grpo", config, args.checkpoint)
    else:
        model_dir = config.model.path if args.worker == "trl_sft" else str(Path(args.checkpoint) / "model")
        result = worker_trl(args.worker, config, model_dir, work / args.worker, args)
    Path(args.result).write_text(json.dumps(result))


# ---------------------------------------------------------------------------------------------------- parent


def run_worker(system: str, seed: int, work: Path, args: argparse.Namespace, checkpoint: str | None) -> dict:
    result = work / f"{system}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", system, "--seed", str(seed),
           "--work-dir", str(work), "--result", str(result), "--sft-steps", str(args.sft_steps),
           "--grpo-steps", str(args.grpo_steps), "--sft-eval-every", str(args.sft_eval_every),
           "--grpo-eval-every", str(args.grpo_eval_every), "--num-test", str(args.num_test)]  # fmt: skip
    if args.engine:
        cmd += ["--engine", args.engine]
    if checkpoint is not None:
        cmd += ["--checkpoint", checkpoint]
    env = {**os.environ, "HF_HUB_DISABLE_PROGRESS_BARS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}  # fmt: skip
    started = time.perf_counter()
    print(f"seed {seed} {system}:", flush=True)
    subprocess.run(cmd, check=True, env=env, cwd=work)
    data = json.loads(result.read_text())
    data.update(system=system.split("_")[0], phase=system.split("_")[1], seed=seed,
                process_seconds=time.perf_counter() - started)  # fmt: skip
    return data


def rlsdk_engine() -> str:
    """The recipe's ``inference.engine`` (what rlsdk's runs use without ``--engine``)."""
    import sft_then_grpo as recipe

    return recipe.config().inference.engine


def time_to(points: list[dict[str, Any]], accuracy: float) -> float | None:
    """Training seconds at the first evaluation reaching ``accuracy``; None if none does."""
    return next((p["train_seconds"] for p in points if p["accuracy"] >= accuracy - 1e-9), None)


def compare(runs: list[dict[str, Any]], phase: str, seed: int) -> dict[str, Any]:
    ours = next(r for r in runs if r["system"] == "rlsdk" and r["phase"] == phase and r["seed"] == seed)
    theirs = next(r for r in runs if r["system"] == "trl" and r["phase"] == phase and r["seed"] == seed)
    target = theirs["points"][-1]["accuracy"]
    trl_s, rlsdk_s = time_to(theirs["points"], target), time_to(ours["points"], target)
    # Both ran the same number of steps: the ratio of their whole training seconds is the ratio of a step's time.
    trl_total, rlsdk_total = theirs["points"][-1]["train_seconds"], ours["points"][-1]["train_seconds"]
    return {
        "trl_final_accuracy": target,
        "rlsdk_final_accuracy": ours["points"][-1]["accuracy"],
        "trl_seconds_to_it": trl_s,
        "rlsdk_seconds_to_it": rlsdk_s,
        "ratio": None if rlsdk_s is None or not trl_s else rlsdk_s / trl_s,
        "step_time_ratio": rlsdk_total / trl_total if trl_total else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 seed, a few steps per run: a smoke test")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--sft-steps", type=int, default=800)
    parser.add_argument("--grpo-steps", type=int, default=60)
    parser.add_argument("--sft-eval-every", type=int, default=100)
    parser.add_argument("--grpo-eval-every", type=int, default=5)
    parser.add_argument("--num-test", type=int, default=256)
    parser.add_argument("--engine", choices=("colocated", "embedded"), default=None,
                        help="rlsdk's inference.engine (default: the recipe's)")  # fmt: skip
    parser.add_argument("--json", default=None)
    parser.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--work-dir", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker_main(args)
        return
    if args.quick:
        args.seeds, args.sft_steps, args.grpo_steps = args.seeds[:1], 16, 2
        args.sft_eval_every, args.grpo_eval_every, args.num_test = 16, 2, 16
    root = Path(tempfile.mkdtemp(prefix="rlsdk-trl-post-training-"))
    runs: list[dict[str, Any]] = []
    try:
        for seed in args.seeds:
            work = root / f"seed{seed}"
            work.mkdir()
            recipe_config(work, seed, args)  # data and base model, once for both systems
            sft = run_worker("rlsdk_sft", seed, work, args, None)
            runs += [sft, run_worker("trl_sft", seed, work, args, None)]
            for system in ("rlsdk_grpo", "trl_grpo"):
                runs.append(run_worker(system, seed, work, args, sft["checkpoint"]))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    comparisons = {
        f"{phase}_seed{seed}": compare(runs, phase, seed) for seed in args.seeds for phase in ("sft", "grpo")
    }
    for name, row in comparisons.items():
        print(f"{name}: {row}")
    for run in runs:
        run.pop("checkpoint", None)
    write_json(
        args.json,
        {"benchmark": "trl_post_training", "quick": args.quick, "seeds": args.seeds, "command": " ".join(sys.argv),
         "sft_steps": args.sft_steps, "grpo_steps": args.grpo_steps, "trl_threads": TRL_THREADS,
         "rlsdk_engine": args.engine or rlsdk_engine(),
         "trl_deviations": TRL_DEVIATIONS, "comparisons": comparisons, "runs": runs},
    )  # fmt: skip


if __name__ == "__main__":
    main()
