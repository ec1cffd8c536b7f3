"""Algorithms of the GRPO family compared with error bars: held-out accuracy vs step and vs training time.

``--task reasoning`` (the default): recipes/sft_then_grpo.py's post-training run. Per seed, the data set, the
tokenizer and the random-init model are built from that seed and SFT'd once (the recipe's SFT phase); then every
algorithm runs ``--steps`` RL steps from that SAME SFT checkpoint, in a fresh Session each, the runs of a seed
interleaved in a fixed order. Everything but the algorithm switch is the recipe's (16 problems x 8 samples,
lr 5e-4 after a 10-step warm-up, temperature 1.0, the answer + 0.1 format reward):

- ``grpo``: the recipe as shipped (``algorithm.name='grpo'``: std-scaled group advantages, token-mean loss);
- ``dr_grpo``: ``algorithm.name='dr_grpo'`` (Liu et al. 2025: no std, fixed-length normalisation);
- ``dapo``: ``algorithm.name='dapo'`` with ``clip_eps_high=0.28`` (clip-higher) and
  ``rollout.dynamic_sampling=True`` (Yu et al. 2025);
- ``rloo``: ``algorithm.name='rloo'`` (Ahmadian et al. 2024: leave-one-out baseline);
- ``reinforce_pp``: ``algorithm.name='reinforce_pp'`` (Hu 2025: batch-normalised returns, no group baseline);
- ``gspo``: ``algorithm.name='gspo'`` with the paper's clip range (3e-4, 4e-4) (Zheng et al. 2025: sequence-level
  ratio).

Every ``--eval-every`` steps (and before the first) each run scores the held-out split (256 problems) greedily
(``eval/pass@1``) and with 4 samples per problem (``eval_sampled/pass@1``). Training time excludes evaluation.
Per algorithm and evaluation step: the mean over seeds and its 95% interval (Student t, n - 1 degrees of
freedom). Differences to ``grpo`` are tested on each seed's final accuracy and on its mean accuracy over the
evaluations (the area under the curve) with a paired t-test over seeds (the runs of a seed share the SFT
checkpoint), significant at p < 0.05; with 3 seeds only large, consistent differences are.

``--task reverse``: the previous comparison on the toy task (recipes/grpo_reverse.py from random init): steps and
seconds until the 10-step moving mean reward reaches ``--target``.

Usage: ``python benchmarks/algorithms.py [--task reasoning|reverse] [--quick] [--seeds 0 1 2] [--steps 60]
[--eval-every 5] [--algorithms ...] [--json P]``. ``--quick``: 1 seed, a 24-step SFT, 2 RL steps per algorithm
(a smoke test, not a measurement). Needs the ``bench`` extra (scipy) for the intervals and tests.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))

from _harness import write_json

from rlsdk import SessionConfig

ALGORITHMS: dict[str, dict[str, dict[str, Any]]] = {
    "grpo": {},
    "dr_grpo": {"algorithm": {"name": "dr_grpo"}},
    "dapo": {"algorithm": {"name": "dapo", "clip_eps_high": 0.28}, "rollout": {"dynamic_sampling": True}},
    "rloo": {"algorithm": {"name": "rloo"}},
    "reinforce_pp": {"algorithm": {"name": "reinforce_pp"}},
    "gspo": {"algorithm": {"name": "gspo", "clip_eps_low": 3e-4, "clip_eps_high": 4e-4}},
}
# The toy task's systems (--task reverse), each a switch on recipes/grpo_reverse.py's config.
REVERSE_SYSTEMS: dict[str, dict[str, dict[str, Any]]] = {
    "recipe": {},
    "grpo": {"algorithm": {"name": "grpo", "scale_rewards": True, "loss_agg": "seq_mean_token_mean"}},
    "dr_grpo": {"algorithm": {"name": "dr_grpo"}},
    "dapo": {
        "algorithm": {"name": "dapo", "scale_rewards": True, "clip_eps_high": 0.28},
        "rollout": {"dynamic_sampling": True},
    },
    "rloo": {"algorithm": {"name": "rloo"}},
}
KEYS = ("eval/pass@1", "eval_sampled/pass@1")


def with_changes(config: Any, changes: dict[str, dict[str, Any]]) -> Any:
    return dataclasses.replace(
        config,
        algorithm=dataclasses.replace(config.algorithm, **changes.get("algorithm", {})),
        rollout=dataclasses.replace(config.rollout, **changes.get("rollout", {})),
    )


# ---------------------------------------------------------------------------------------------------- reasoning


def reasoning_config(seed: int, root: Path, *, steps: int, eval_every: int, quick: bool) -> Any:
    """The recipe's config for ``seed``, with its data, base model and outputs under ``root/seed{seed}``."""
    import sft_then_grpo as recipe

    from rlsdk.data.reasoning import write_reasoning_task

    base = recipe.config()
    work = root / f"seed{seed}"
    task = dataclasses.replace(recipe.task(dataclasses.replace(base, seed=seed)), num_test=32 if quick else 256)
    paths = write_reasoning_task(work / "data", task)
    sft = dataclasses.replace(base.sft, steps=24, eval_every=24, warmup_steps=4) if quick else base.sft
    config = dataclasses.replace(
        base,
        seed=seed,
        model=dataclasses.replace(base.model, path=str(work / "base")),
        train=dataclasses.replace(base.train, max_steps=steps, eval_every=eval_every),
        data=dataclasses.replace(base.data, path=str(paths["rl"]), eval_path=str(paths["test"])),
        observe=dataclasses.replace(base.observe, output_dir=str(work / "sft"), tensorboard=False),
        sft=sft,
        eval_samples=0 if quick else base.eval_samples,
    )
    recipe.prepare(config)
    return config


def run_reasoning(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    import sft_then_grpo as recipe

    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in args.algorithms}
    sft_runs: list[dict[str, Any]] = []
    for seed in args.seeds:
        config = reasoning_config(seed, root, steps=args.steps, eval_every=args.eval_every, quick=args.quick)
        sft = asyncio.run(recipe.sft_phase(config, progress=False))
        last = sft["evaluations"][-1]
        sft_runs.append({"seed": seed, **sft})
        print(f"seed {seed} SFT: held-out {last['eval/pass@1']:.3f} greedy after {config.sft.steps} steps "
              f"({sft['train_seconds']:.0f} s training)", flush=True)  # fmt: skip
        for name in args.algorithms:
            run_config = with_changes(config, ALGORITHMS[name])
            run_config = dataclasses.replace(
                run_config, observe=dataclasses.replace(run_config.observe, output_dir=str(root / f"seed{seed}" / name))
            )
            started = time.perf_counter()
            result = asyncio.run(recipe.rl_phase(run_config, sft["checkpoint"], progress=False))
            evaluations = [{k: e[k] for k in ("step", "train_seconds", *KEYS) if k in e} for e in result["evaluations"]]
            runs[name].append(
                {"seed": seed, "evaluations": evaluations, "rewards": result["rewards"],
                 "train_seconds": result["train_seconds"], "seconds": time.perf_counter() - started}
            )  # fmt: skip
            first, final = evaluations[0]["eval/pass@1"], evaluations[-1]["eval/pass@1"]
            print(f"seed {seed} {name:>12}: held-out {first:.3f} -> {final:.3f} greedy in {result['steps']} steps "
                  f"({result['train_seconds']:.0f} s training)", flush=True)  # fmt: skip
    summary = summarize(runs)
    print_summary(summary)
    return {
        "task": "reasoning",
        "steps": args.steps,
        "eval_every": args.eval_every,
        "algorithms": {name: ALGORITHMS[name] for name in args.algorithms},
        "sft": [{k: v for k, v in run.items() if k != "checkpoint"} for run in sft_runs],
        "summary": summary,
        "runs": runs,
    }


def mean_ci(values: list[float]) -> dict[str, Any]:
    """Mean and the half-width of its 95% interval (Student t with n - 1 degrees of freedom; None for n = 1)."""
    from scipy import stats

    n = len(values)
    mean = statistics.fmean(values)
    if n < 2:
        return {"mean": mean, "ci95": None, "n": n}
    half = float(stats.t.ppf(0.975, n - 1)) * statistics.stdev(values) / math.sqrt(n)
    return {"mean": mean, "ci95": half, "low": mean - half, "high": mean + half, "n": n}


def paired_test(a: list[float], b: list[float]) -> dict[str, Any]:
    """Paired t-test of ``a - b`` over seeds: the mean difference, its 95% interval and the two-sided p-value
    (None below 2 seeds, or when every difference is equal)."""
    from scipy import stats

    diffs = [x - y for x, y in zip(a, b, strict=True)]
    out = {"difference": mean_ci(diffs), "p_value": None, "significant": False}
    if len(diffs) >= 2 and len(set(diffs)) > 1:
        p = float(stats.ttest_rel(a, b).pvalue)
        out.update(p_value=p, significant=p < 0.05)
    return out


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per algorithm: the curve (mean and 95% interval over seeds at each evaluation step, with the mean training
    seconds there), the final and mean-over-curve accuracy, and the paired tests against ``grpo``."""
    summary: dict[str, Any] = {}
    for name, seeds in runs.items():
        steps = [e["step"] for e in seeds[0]["evaluations"]]
        curve = []
        for index, step in enumerate(steps):
            point: dict[str, Any] = {
                "step": step,
                "train_seconds": statistics.fmean(run["evaluations"][index]["train_seconds"] for run in seeds),
            }
            for key in KEYS:
                if key in seeds[0]["evaluations"][index]:
                    point[key] = mean_ci([run["evaluations"][index][key] for run in seeds])
            curve.append(point)
        summary[name] = {
            "curve": curve,
            "final": {key: mean_ci([run["evaluations"][-1][key] for run in seeds]) for key in KEYS
                      if key in seeds[0]["evaluations"][-1]},
            "area": mean_ci([statistics.fmean(e["eval/pass@1"] for e in run["evaluations"]) for run in seeds]),
            "train_seconds": mean_ci([run["train_seconds"] for run in seeds]),
        }  # fmt: skip
    if "grpo" in runs:
        base = runs["grpo"]
        for name, seeds in runs.items():
            if name == "grpo":
                continue
            summary[name]["vs_grpo"] = {
                "final": paired_test(
                    [run["evaluations"][-1]["eval/pass@1"] for run in seeds],
                    [run["evaluations"][-1]["eval/pass@1"] for run in base],
                ),
                "area": paired_test(
                    [statistics.fmean(e["eval/pass@1"] for e in run["evaluations"]) for run in seeds],
                    [statistics.fmean(e["eval/pass@1"] for e in run["evaluations"]) for run in base],
                ),
            }
    return summary


def _interval(stats: dict[str, Any]) -> str:
    return f"{stats['mean']:.3f}" + ("" if stats.get("ci95") is None else f" +- {stats['ci95']:.3f}")


def print_summary(summary: dict[str, Any]) -> None:
    print("\nheld-out accuracy (greedy pass@1), mean +- 95% interval over seeds")
    print(f"  {'algorithm':<13} {'start':>16} {'final':>16} {'mean over curve':>16} {'vs grpo (final, p)':>22}")
    for name, row in summary.items():
        start = row["curve"][0]["eval/pass@1"]
        test = row.get("vs_grpo", {}).get("final")
        versus = ""
        if test is not None:
            p = test["p_value"]
            versus = f"{test['difference']['mean']:+.3f}, p={'n/a' if p is None else f'{p:.3f}'}"
            versus += " *" if test["significant"] else ""
        print(f"  {name:<13} {_interval(start):>16} {_interval(row['final']['eval/pass@1']):>16} "
              f"{_interval(row['area']):>16} {versus:>22}")  # fmt: skip


# ---------------------------------------------------------------------------------------------------- reverse


def reverse_config(system: str, seed: int, root: Path, max_steps: int) -> SessionConfig:
    from grpo_reverse import config as recipe_config

    from rlsdk.data import build_tiny_policy

    base = recipe_config()
    model = build_tiny_policy(root / f"model-seed{seed}", seed=seed)
    config = with_changes(base, REVERSE_SYSTEMS[system])
    return dataclasses.replace(
        config,
        seed=seed,
        model=dataclasses.replace(base.model, path=str(model)),
        train=dataclasses.replace(base.train, max_steps=max_steps),
        observe=dataclasses.replace(base.observe, output_dir=str(root / f"{system}-seed{seed}"), tensorboard=False),
    )


def run_reverse(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    from async_rollouts import run_once

    seeds, max_steps, target = args.seeds, args.max_steps, args.target
    if args.quick:
        seeds, max_steps, target = seeds[:1], 10, 2.0  # unreachable: a fixed number of steps
    systems = [s for s in args.systems if s in REVERSE_SYSTEMS]
    runs: dict[str, list[dict[str, Any]]] = {system: [] for system in systems}
    for seed in seeds:
        for system in systems:
            result = asyncio.run(run_once(reverse_config(system, seed, root, max_steps), target))
            result["seed"] = seed
            runs[system].append(result)
            print(
                f"seed {seed} {system:>8}: steps {result['steps']:5d}, to target {result['steps_to_target']}, "
                f"{1000 * result['step_s_median']:.1f} ms/step, final reward {result['final_moving_reward']:.3f}",
                flush=True,
            )
    summary: dict[str, Any] = {}
    print(f"\nsteps to a 10-step mean reward of {target} (cap {max_steps}; seeds {seeds})")
    for system, results in runs.items():
        reached = [r for r in results if r["steps_to_target"] is not None]
        summary[system] = {
            "steps_to_target": [r["steps_to_target"] for r in results],
            "median_steps": statistics.median([r["steps_to_target"] or max_steps + 1 for r in results]),
            "median_seconds": statistics.median([r["seconds_to_target"] or float("inf") for r in results]),
            "missed": len(results) - len(reached),
            "final_moving_reward": [r["final_moving_reward"] for r in results],
        }
        print(f"  {system:<10} {summary[system]}")
    return {
        "task": "reverse",
        "seeds": seeds,
        "max_steps": max_steps,
        "target": target,
        "systems": {name: REVERSE_SYSTEMS[name] for name in systems},
        "summary": summary,
        "runs": runs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=("reasoning", "reverse"), default="reasoning")
    parser.add_argument("--quick", action="store_true", help="1 seed, a few steps: a smoke test")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=60, help="reasoning: RL steps per algorithm")
    parser.add_argument("--eval-every", type=int, default=5, help="reasoning: held-out evaluation every N steps")
    parser.add_argument("--algorithms", nargs="+", choices=list(ALGORITHMS), default=list(ALGORITHMS))
    parser.add_argument("--max-steps", type=int, default=1000, help="reverse: step cap")
    parser.add_argument("--target", type=float, default=0.9, help="reverse: 10-step moving mean reward target")
    parser.add_argument("--systems", nargs="+", choices=sorted(REVERSE_SYSTEMS), default=list(REVERSE_SYSTEMS))
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.quick and args.task == "reasoning":
        args.seeds, args.steps, args.eval_every = args.seeds[:1], 2, 2
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rlsdk-bench-algorithms-") as tmp:
        payload = run_reasoning(args, Path(tmp)) if args.task == "reasoning" else run_reverse(args, Path(tmp))
    write_json(
        args.json,
        {"benchmark": "algorithms", "quick": args.quick, "seeds": args.seeds, "command": " ".join(sys.argv),
         "seconds": time.perf_counter() - started, **payload},
    )  # fmt: skip


if __name__ == "__main__":
    main()
