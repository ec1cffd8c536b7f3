"""LoRA against full fine-tuning: held-out accuracy on the post-training recipe, and what a weight sync costs.

``--parts accuracy`` (does LoRA learn?): recipes/sft_then_grpo.py's post-training run, as benchmarks/algorithms.py
runs it. Per seed, the data set, the tokenizer and the random-init model are built from that seed and SFT'd once
(the recipe's SFT phase, every weight trained); then every system runs ``--steps`` GRPO steps from that SAME SFT
checkpoint, in a fresh Session each, in a fixed order:

- ``full``: the recipe as shipped (every weight trained, ``train.lr`` = ``--full-lr``, the recipe's 5e-4);
- ``lora-r{R}-lr{LR}``: LoRA adapters of rank ``--lora-rank`` (alpha ``--lora-alpha``, every linear layer but the
  output head, peft's ``all-linear``) at each learning rate of ``--lora-lrs``;
- ``lora-r{R}-lr{LR}`` for each rank of ``--lora-ranks`` at ``--rank-lr`` (alpha scaled with the rank, so
  ``lora_alpha / lora_rank`` stays ``--lora-alpha / --lora-rank``).

Everything else is the recipe's (16 problems x 8 samples, a 10-step warm-up, temperature 1.0, the answer + 0.1
format reward, colocated generation). Every ``--eval-every`` steps (and before the first) each run scores the
held-out split (256 problems) greedily (``eval/pass@1``), and with ``--eval-samples`` samples per problem
(``eval_sampled/pass@1``) when that is above 0.
Per system: held-out accuracy at the end (``final``), the mean of the last ``--plateau`` evaluations
(``plateau``: one evaluation of 256 problems moves by several points from one to the next), the best, the mean
training reward of the last 10 steps, and the differences to ``full`` on each seed (paired: the runs of a seed
share the SFT checkpoint) with their 95% interval over seeds.

``--parts reverse`` (why the toy task is no test of LoRA): recipes/grpo_reverse.py from its random init, per seed,
``--reverse-steps`` steps without the early stop, for ``full`` (the recipe), LoRA on the linear layers at
``--reverse-lora-lr`` (10x the recipe's lr), and LoRA with an adapter on the output head too at the recipe's lr:
the 10-step moving mean reward each reaches, the first step where it reaches 0.9. Both parts also record
:func:`rlsdk.engine.lora.head_probability_bound` of each policy (random init, and after SFT for the recipe): the
most probability any token can get while LoRA leaves the output head and final norm frozen.

``--parts sync`` (what LoRA saves): the default recipe's loop (recipes/grpo_reverse.py's config: 2 ranks, 16
prompts x 16 samples, one optimizer step per update) on a randomly initialised policy of each size
(benchmarks/scaling.py's ``SIZES``), with either every weight trained (``full``) or LoRA adapters (``lora``:
``--lora-rank`` / ``--lora-alpha``, all linear layers). Runs are interleaved per repetition (full, lora, full,
lora, ...), each a fresh Session running ``--sync-steps`` steps; the first ``--warmup`` steps of each run are left
out of the medians. Per size and engine the JSON records, for both systems: the bytes each sync moved
(``sync/bytes``: the full state dict, or only the adapter), the trained parameters, the medians of
``time/sync_s``, ``time/rank_update_s`` and the whole step, and the LoRA / full ratios of each.

Usage: ``python benchmarks/lora.py [--parts accuracy reverse sync] [--quick] [--seeds 0 1 2] [--steps 150]
[--lora-lrs 5e-4 ...] [--lora-ranks 1 4] [--rank-lr LR] [--reverse-steps 400] [--reverse-lora-lr 1e-2]
[--sizes 0.1M 10M 100M] [--engines embedded vllm] [--repeats 3] [--sync-steps 30] [--lora-rank 16]
[--lora-alpha 32] [--json P]``. ``--quick``: accuracy on 1 seed with a 24-step SFT and 2 GRPO steps per system
(two systems: full and one LoRA learning rate), 3 toy-task steps per system, sync on the 0.1M model, the
embedded engine, 1 repeat of 4 steps: a smoke test, not a measurement. The accuracy part needs the
``bench`` extra (scipy) for the intervals.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))

from _harness import print_table, summarize, write_json
from grpo_reverse import config as recipe_config
from scaling import SIZES

from rlsdk import Session, SessionConfig
from rlsdk.config import InferenceConfig
from rlsdk.data import build_tiny_policy
from rlsdk.rewards import reverse_reward

ACCURACY_KEYS = ("eval/pass@1", "eval_sampled/pass@1")


# ---------------------------------------------------------------------------------------------------- accuracy


@dataclasses.dataclass(frozen=True)
class System:
    """One GRPO run's training switch: full fine-tuning (``lora_rank`` 0) or LoRA adapters, at ``lr``."""

    lr: float
    lora_rank: int = 0
    lora_alpha: float = 16.0

    @property
    def name(self) -> str:
        return f"full-lr{self.lr:g}" if self.lora_rank == 0 else f"lora-r{self.lora_rank}-lr{self.lr:g}"

    def changes(self) -> dict[str, Any]:
        lora = {"lora_rank": self.lora_rank, "lora_alpha": self.lora_alpha} if self.lora_rank else {}
        return {"lr": self.lr, **lora}


def accuracy_systems(args: argparse.Namespace) -> list[System]:
    """``full`` first (the differences are taken to it), then the learning-rate sweep, then the rank sweep."""
    systems = [System(args.full_lr)]
    systems += [System(lr, args.lora_rank, args.lora_alpha) for lr in args.lora_lrs]
    scale = args.lora_alpha / args.lora_rank
    systems += [System(args.rank_lr, rank, scale * rank) for rank in args.lora_ranks]
    return list(dict.fromkeys(systems))  # a rank-sweep point equal to a learning-rate point runs once


def adapter_parameters(model_dir: str, system: System) -> dict[str, int]:
    """Trained and total parameters of ``system`` on the model at ``model_dir`` (the ranks' count, rebuilt here)."""
    from transformers import AutoModelForCausalLM

    from rlsdk.config import TrainConfig
    from rlsdk.engine.lora import apply_lora

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    total = sum(p.numel() for p in model.parameters())
    if system.lora_rank:
        model = apply_lora(model, TrainConfig(lora_rank=system.lora_rank, lora_alpha=system.lora_alpha))
    return {"trained": sum(p.numel() for p in model.parameters() if p.requires_grad), "total": total}


def run_accuracy(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    import sft_then_grpo as recipe
    from algorithms import reasoning_config

    systems = accuracy_systems(args)
    runs: dict[str, list[dict[str, Any]]] = {system.name: [] for system in systems}
    sft_runs: list[dict[str, Any]] = []
    parameters: dict[str, dict[str, int]] = {}
    bounds: dict[str, dict[str, float | None]] = {}
    for seed in args.seeds:
        config = reasoning_config(seed, root, steps=args.steps, eval_every=args.eval_every, quick=args.quick)
        config = dataclasses.replace(config, eval_samples=0 if args.quick else args.eval_samples)
        sft = asyncio.run(recipe.sft_phase(config, progress=False))
        bounds[f"seed{seed}"] = head_bounds(
            {"random_init": config.model.path, "after_sft": str(Path(sft["checkpoint"]) / "model")}
        )
        sft_runs.append({"seed": seed, **{k: v for k, v in sft.items() if k != "checkpoint"}})
        print(f"seed {seed} SFT: held-out {sft['evaluations'][-1]['eval/pass@1']:.3f} greedy after "
              f"{config.sft.steps} steps ({sft['train_seconds']:.0f} s training)", flush=True)  # fmt: skip
        for system in systems:
            if system.name not in parameters:
                parameters[system.name] = adapter_parameters(str(Path(sft["checkpoint"]) / "model"), system)
            run_config = dataclasses.replace(
                config,
                train=dataclasses.replace(config.train, **system.changes()),
                observe=dataclasses.replace(config.observe, output_dir=str(root / f"seed{seed}" / system.name)),
            )
            started = time.perf_counter()
            result = asyncio.run(recipe.rl_phase(run_config, sft["checkpoint"], progress=False))
            evaluations = [
                {k: e[k] for k in ("step", "train_seconds", *ACCURACY_KEYS) if k in e} for e in result["evaluations"]
            ]
            runs[system.name].append(
                {"seed": seed, "evaluations": evaluations, "rewards": result["rewards"],
                 "train_seconds": result["train_seconds"], "seconds": time.perf_counter() - started}
            )  # fmt: skip
            first, final = evaluations[0]["eval/pass@1"], evaluations[-1]["eval/pass@1"]
            plateau = statistics.fmean(e["eval/pass@1"] for e in evaluations[-args.plateau :])
            print(f"seed {seed} {system.name:>20}: held-out {first:.3f} -> {final:.3f} greedy (last "
                  f"{args.plateau}: {plateau:.3f}), reward {statistics.fmean(result['rewards'][-10:]):.3f}, "
                  f"in {result['steps']} steps ({result['train_seconds']:.0f} s training)", flush=True)  # fmt: skip
    summary = summarize_accuracy(runs, systems, args.plateau)
    print_accuracy(summary, args.plateau)
    return {
        "steps": args.steps,
        "eval_every": args.eval_every,
        "plateau_evaluations": args.plateau,
        "systems": {system.name: {**dataclasses.asdict(system), "parameters": parameters.get(system.name)}
                    for system in systems},
        "head_probability_bound": bounds,
        "sft": sft_runs,
        "summary": summary,
        "runs": runs,
    }  # fmt: skip


def run_figures(run: dict[str, Any], plateau: int) -> dict[str, float]:
    """One run's figures: greedy held-out accuracy at the end, over the last ``plateau`` evaluations, at best,
    the sampled accuracy at the end, and the mean training reward of the last 10 steps."""
    accuracy = [e["eval/pass@1"] for e in run["evaluations"]]
    figures = {
        "final": accuracy[-1],
        "plateau": statistics.fmean(accuracy[-plateau:]),
        "best": max(accuracy),
        "reward": statistics.fmean(run["rewards"][-10:]),
    }
    if "eval_sampled/pass@1" in run["evaluations"][-1]:
        figures["final_sampled"] = run["evaluations"][-1]["eval_sampled/pass@1"]
    return figures


def summarize_accuracy(runs: dict[str, list[dict[str, Any]]], systems: list[System], plateau: int) -> dict[str, Any]:
    """Per system: each figure of :func:`run_figures` as a mean and 95% interval over seeds, the start accuracy,
    and the paired difference to the full fine-tuning system (first in ``systems``) per figure."""
    from algorithms import mean_ci, paired_test

    per_run = {name: [run_figures(run, plateau) for run in seeds] for name, seeds in runs.items()}
    full = systems[0].name
    summary: dict[str, Any] = {}
    for system in systems:
        figures = per_run[system.name]
        row: dict[str, Any] = {
            "start": mean_ci([run["evaluations"][0]["eval/pass@1"] for run in runs[system.name]]),
            **{key: mean_ci([f[key] for f in figures]) for key in figures[0]},
            # per seed: the first evaluation step at 90% held-out accuracy (None: never)
            "steps_to_0.9": [next((int(e["step"]) for e in run["evaluations"] if e["eval/pass@1"] >= 0.9), None)
                             for run in runs[system.name]],
        }  # fmt: skip
        if system.name != full:
            row["vs_full"] = {
                key: paired_test([f[key] for f in figures], [f[key] for f in per_run[full]]) for key in figures[0]
            }
        summary[system.name] = row
    return summary


def _interval(stats: dict[str, Any]) -> str:
    return f"{stats['mean']:.3f}" + ("" if stats.get("ci95") is None else f" +- {stats['ci95']:.3f}")


def print_accuracy(summary: dict[str, Any], plateau: int) -> None:
    print(f"\nheld-out accuracy (greedy pass@1), mean +- 95% interval over seeds; plateau = last {plateau} evaluations")
    print(f"  {'system':<22} {'start':>8} {'final':>16} {'plateau':>16} {'reward':>8} {'plateau vs full':>18}")
    for name, row in summary.items():
        versus = ""
        if "vs_full" in row:
            versus = f"{100 * row['vs_full']['plateau']['difference']['mean']:+.1f} points"
        print(f"  {name:<22} {row['start']['mean']:>8.3f} {_interval(row['final']):>16} "
              f"{_interval(row['plateau']):>16} {row['reward']['mean']:>8.3f} {versus:>18}")  # fmt: skip


# ---------------------------------------------------------------------------------------------------- reverse


def head_bounds(models: dict[str, str]) -> dict[str, float | None]:
    """Per model directory: :func:`rlsdk.engine.lora.head_probability_bound` under the default LoRA targets (the
    most probability any token can get while the output head and final norm stay frozen)."""
    from transformers import AutoModelForCausalLM

    from rlsdk.config import TrainConfig
    from rlsdk.engine.lora import apply_lora, head_probability_bound

    bounds = {}
    for name, path in models.items():
        model = apply_lora(AutoModelForCausalLM.from_pretrained(path), TrainConfig(lora_rank=1))
        bounds[name] = head_probability_bound(model)
    return bounds


REVERSE_HEAD_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")


def reverse_systems(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The toy task's systems: the recipe (full), LoRA on the linear layers at ``--reverse-lora-lr``, and LoRA
    with an adapter on the output head too at the recipe's lr (the setting docs/howto/lora.md found best)."""
    base_lr = recipe_config().train.lr
    lora = {"lora_rank": args.lora_rank, "lora_alpha": args.lora_alpha}
    return {
        "full": {"lr": base_lr},
        f"lora-r{args.lora_rank}-lr{args.reverse_lora_lr:g}": {"lr": args.reverse_lora_lr, **lora},
        f"lora-r{args.lora_rank}+head-lr{base_lr:g}": {
            "lr": base_lr, "lora_target_modules": REVERSE_HEAD_TARGETS, **lora
        },
    }  # fmt: skip


async def run_reverse_once(config: SessionConfig) -> dict[str, Any]:
    async with await Session.start(config) as session:
        summary = await session.train(reverse_reward, progress=False)
    return {
        "rewards": summary.rewards,
        "final_moving_reward": summary.final_reward,
        "best_moving_reward": summary.best_reward,
        "seconds": summary.seconds,
    }


def run_reverse(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """The toy task (recipes/grpo_reverse.py from random init, ``--reverse-steps`` steps, no early stop): the
    10-step moving mean reward each system reaches, and the head bound of each seed's policy."""
    systems = reverse_systems(args)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in systems}
    bounds: dict[str, float | None] = {}
    base = recipe_config()
    for seed in args.seeds:
        model = build_tiny_policy(root / f"model-seed{seed}", seed=seed)
        bounds[f"seed{seed}"] = head_bounds({"policy": str(model)})["policy"]
        for name, changes in systems.items():
            config = dataclasses.replace(
                base,
                seed=seed,
                model=dataclasses.replace(base.model, path=str(model)),
                train=dataclasses.replace(base.train, max_steps=args.reverse_steps, target_reward=None, **changes),
                observe=dataclasses.replace(base.observe, output_dir=str(root / f"{name}-seed{seed}"),
                                            tensorboard=False),
            )  # fmt: skip
            result = {"seed": seed, **asyncio.run(run_reverse_once(config))}
            runs[name].append(result)
            print(f"reverse seed {seed} {name:>24}: moving reward {result['final_moving_reward']:.3f} after "
                  f"{len(result['rewards'])} steps (best {result['best_moving_reward']:.3f})", flush=True)  # fmt: skip
    summary = {
        name: {
            "final_moving_reward": [r["final_moving_reward"] for r in results],
            "best_moving_reward": [r["best_moving_reward"] for r in results],
            "steps_to_0.9": [first_reaching(r["rewards"], 0.9) for r in results],
        }
        for name, results in runs.items()
    }
    for name, row in summary.items():
        print(f"  reverse {name:<24} {row}")
    return {
        "steps": args.reverse_steps,
        "systems": systems,
        "head_probability_bound": bounds,
        "summary": summary,
        "runs": runs,
    }


def first_reaching(rewards: list[float], target: float, window: int = 10) -> int | None:
    """The first step (1-based) whose ``window``-step moving mean reward reaches ``target``; None if none."""
    for step in range(window, len(rewards) + 1):
        if statistics.fmean(rewards[step - window : step]) >= target:
            return step
    return None


# ---------------------------------------------------------------------------------------------------- sync


def system_config(
    model: Path, system: str, engine: str, output: Path, steps: int, lora_rank: int, lora_alpha: float
) -> SessionConfig:
    base = recipe_config()
    lora = {"lora_rank": lora_rank, "lora_alpha": lora_alpha} if system == "lora" else {}
    return dataclasses.replace(
        base,
        model=dataclasses.replace(base.model, path=str(model)),
        inference=dataclasses.replace(base.inference, engine=engine)
        if engine != "vllm"
        else InferenceConfig(engine="vllm"),
        train=dataclasses.replace(base.train, max_steps=steps, target_reward=None, **lora),
        observe=dataclasses.replace(base.observe, output_dir=str(output), tensorboard=False),
    )


async def run_sync_once(config: SessionConfig, steps: int, warmup: int) -> dict[str, Any]:
    step_s: list[float] = []
    async with await Session.start(config) as session:
        for _ in range(steps):
            t0 = time.perf_counter()
            rollout = await session.reward(await session.rollout(), reverse_reward)
            await session.update(rollout)
            await session.sync_weights()
            step_s.append(time.perf_counter() - t0)
        history = list(session.metrics.history) if session.metrics is not None else []
    # step 0 holds the start's sync of v0; the first `warmup` steps are left out
    updates = [m for step, m in history if step > warmup and "time/rank_update_s" in m]
    syncs = [m for step, m in history if step > warmup and "time/sync_s" in m and "sync/bytes" in m]
    return {
        "sync_bytes": [m["sync/bytes"] for m in syncs],
        "sync_s": [m["time/sync_s"] for m in syncs],
        "rank_update_s": [m["time/rank_update_s"] for m in updates],
        "step_s": step_s[warmup:],
    }


def trained_parameters(model: Path, system: str, lora_rank: int, lora_alpha: float) -> tuple[int, int]:
    """(trained, total) parameters of the system's model on the ranks."""
    from transformers import AutoModelForCausalLM

    from rlsdk.config import TrainConfig
    from rlsdk.engine.lora import apply_lora

    loaded = AutoModelForCausalLM.from_pretrained(model)
    if system == "lora":
        loaded = apply_lora(loaded, TrainConfig(lora_rank=lora_rank, lora_alpha=lora_alpha))
    return (
        sum(p.numel() for p in loaded.parameters() if p.requires_grad),
        sum(p.numel() for p in loaded.parameters()),
    )


def run_sync(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    sizes, engines, repeats, steps, warmup = args.sizes, args.engines, args.repeats, args.sync_steps, args.warmup
    if args.quick:
        sizes, engines, repeats, steps, warmup = ["0.1M"], ["embedded"], 1, 4, 1
    results: dict[str, Any] = {}
    for size in sizes:
        # vLLM's CPU attention needs head_dim 32+: the vLLM model halves the heads (same parameter count)
        shape = dict(SIZES[size])
        for engine in engines:
            if engine == "vllm":
                shape["num_heads"] = max(1, shape["hidden_size"] // 32)
            model = build_tiny_policy(root / f"model-{size}-{engine}", seed=0, **shape)
            runs: dict[str, list[dict[str, Any]]] = {"full": [], "lora": []}
            for repeat in range(repeats):
                for system in runs:
                    output = root / f"{size}-{engine}-{system}-{repeat}"
                    config = system_config(model, system, engine, output, steps, args.lora_rank, args.lora_alpha)
                    runs[system].append(asyncio.run(run_sync_once(config, steps, warmup)))
                    print(f"{size} {engine} {system} repeat {repeat}: done", flush=True)
            entry: dict[str, Any] = {"shape": shape}
            for system, system_runs in runs.items():
                trained, total = trained_parameters(model, system, args.lora_rank, args.lora_alpha)
                entry[system] = {
                    "trained_parameters": trained,
                    "parameters": total,
                    "sync_bytes": statistics.median(b for run in system_runs for b in run["sync_bytes"]),
                    **{
                        key: summarize([v for run in system_runs for v in run[key]])
                        for key in ("sync_s", "rank_update_s", "step_s")
                    },
                }
            full, lora = entry["full"], entry["lora"]
            entry["ratios_lora_over_full"] = {
                "sync_bytes": lora["sync_bytes"] / full["sync_bytes"],
                **{key: lora[key]["median"] / full[key]["median"] for key in ("sync_s", "rank_update_s", "step_s")},
            }
            results[f"{size}/{engine}"] = entry
            rows = [
                {"name": f"{size} {engine} {system} {key}", **entry[system][key]}
                for key in ("sync_s", "rank_update_s", "step_s")
                for system in ("full", "lora")
            ]
            print_table(f"{size} on {engine}: seconds (medians over repeats x steps)", rows, "s")
            print(
                f"  bytes per sync: full {full['sync_bytes']:,.0f}, lora {lora['sync_bytes']:,.0f} "
                f"({entry['ratios_lora_over_full']['sync_bytes']:.4f}x); trained parameters: full "
                f"{full['trained_parameters']:,}, lora {lora['trained_parameters']:,}"
            )
    return {"steps": steps, "warmup": warmup, "repeats": repeats, "results": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--parts", nargs="+", choices=("accuracy", "reverse", "sync"), default=["accuracy", "reverse", "sync"]
    )
    parser.add_argument("--quick", action="store_true", help="a few steps of each part: a smoke test")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--lora-alpha", type=float, default=32.0)
    accuracy = parser.add_argument_group("accuracy")
    accuracy.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    accuracy.add_argument("--steps", type=int, default=150, help="GRPO steps per system (the recipe's)")
    accuracy.add_argument("--eval-every", type=int, default=10, help="held-out evaluation every N steps")
    accuracy.add_argument("--plateau", type=int, default=5, help="evaluations averaged at the end")
    accuracy.add_argument("--eval-samples", type=int, default=0, help="sampled evaluation: samples per problem")
    accuracy.add_argument("--full-lr", type=float, default=5e-4, help="full fine-tuning's lr (the recipe's)")
    accuracy.add_argument("--lora-lrs", type=float, nargs="+", default=[5e-4, 1.5e-3, 5e-3], help="1x, 3x, 10x")
    accuracy.add_argument("--lora-ranks", type=int, nargs="*", default=[1, 4], help="ranks run at --rank-lr")
    accuracy.add_argument("--rank-lr", type=float, default=1.5e-3)
    reverse = parser.add_argument_group("reverse")
    reverse.add_argument("--reverse-steps", type=int, default=400, help="toy-task steps per system")
    reverse.add_argument("--reverse-lora-lr", type=float, default=1e-2, help="10x the toy recipe's lr")
    sync = parser.add_argument_group("sync")
    sync.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    sync.add_argument("--engines", nargs="+", choices=("embedded", "colocated", "vllm"), default=["embedded"])
    sync.add_argument("--repeats", type=int, default=3)
    sync.add_argument("--sync-steps", type=int, default=30)
    sync.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.quick:
        args.seeds, args.steps, args.eval_every, args.plateau = args.seeds[:1], 2, 2, 1
        args.lora_lrs, args.lora_ranks, args.reverse_steps = args.lora_lrs[-1:], [], 3
    started = time.perf_counter()
    payload: dict[str, Any] = {}
    parts = {"accuracy": run_accuracy, "reverse": run_reverse, "sync": run_sync}
    with tempfile.TemporaryDirectory(prefix="rlsdk-bench-lora-") as tmp:
        for part in (part for part in parts if part in args.parts):
            payload[part] = parts[part](args, Path(tmp) / part)
            # after each part: a long run that fails later keeps what it measured
            write_json(
                args.json,
                {"benchmark": "lora", "quick": args.quick, "command": " ".join(sys.argv), "parts": list(payload),
                 "lora_rank": args.lora_rank, "lora_alpha": args.lora_alpha,
                 "seconds": time.perf_counter() - started, **payload},
            )  # fmt: skip


if __name__ == "__main__":
    main()
