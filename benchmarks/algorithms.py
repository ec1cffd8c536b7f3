"""The default recipe under each algorithm of the GRPO family: steps and seconds to its reward threshold.

Every system is the default recipe (recipes/grpo_reverse.py: 2 ranks, the tiny reverse policy, the embedded
engine, 16 prompts x 16 samples, its learning rate and entropy bonus) with a config switch only:

- ``recipe``: the recipe as shipped (``algorithm.name='grpo'`` with ``scale_rewards=False``: group-centred
  advantages, token-mean loss);
- ``grpo``: GRPO as in the paper (Shao et al. 2024): ``scale_rewards=True`` (std-normalised group advantages),
  ``loss_agg='seq_mean_token_mean'``;
- ``dr_grpo``: ``algorithm.name='dr_grpo'`` (Liu et al. 2025: no std, fixed-length normalisation);
- ``dapo``: ``algorithm.name='dapo'`` with ``scale_rewards=True``, ``clip_eps_high=0.28`` (clip-higher) and
  ``rollout.dynamic_sampling=True`` (Yu et al. 2025);
- ``rloo``: ``algorithm.name='rloo'`` (Ahmadian et al. 2024: leave-one-out baseline).

Runs are interleaved per seed (recipe, grpo, dr_grpo, dapo, rloo, recipe, ...), each until the 10-step moving mean
reward reaches ``--target`` (0.9) or ``--max-steps``. The table gives, per system, the steps and seconds to the
target per seed and their medians, and how many runs missed.

Usage: ``python benchmarks/algorithms.py [--quick] [--seeds 0 1 2] [--max-steps 1000] [--systems ...] [--json P]``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))

from _harness import write_json
from async_rollouts import run_once
from grpo_reverse import config as recipe_config

from rlsdk import SessionConfig
from rlsdk.data import build_tiny_policy

SYSTEMS: dict[str, dict[str, dict[str, Any]]] = {
    "recipe": {},
    "grpo": {"algorithm": {"name": "grpo", "scale_rewards": True, "loss_agg": "seq_mean_token_mean"}},
    "dr_grpo": {"algorithm": {"name": "dr_grpo"}},
    "dapo": {
        "algorithm": {"name": "dapo", "scale_rewards": True, "clip_eps_high": 0.28},
        "rollout": {"dynamic_sampling": True},
    },
    "rloo": {"algorithm": {"name": "rloo"}},
}


def system_config(system: str, seed: int, root: Path, max_steps: int) -> SessionConfig:
    base = recipe_config()
    model = build_tiny_policy(root / f"model-seed{seed}", seed=seed)
    changes = SYSTEMS[system]
    return dataclasses.replace(
        base,
        seed=seed,
        model=dataclasses.replace(base.model, path=str(model)),
        train=dataclasses.replace(base.train, max_steps=max_steps),
        algorithm=dataclasses.replace(base.algorithm, **changes.get("algorithm", {})),
        rollout=dataclasses.replace(base.rollout, **changes.get("rollout", {})),
        observe=dataclasses.replace(base.observe, output_dir=str(root / f"{system}-seed{seed}"), tensorboard=False),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 seed, 10 steps per system, no target (smoke test)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--max-steps", type=int, default=1000)
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--systems", nargs="+", choices=sorted(SYSTEMS), default=list(SYSTEMS))
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    seeds, max_steps, target = args.seeds, args.max_steps, args.target
    if args.quick:
        seeds, max_steps, target = seeds[:1], 10, 2.0  # unreachable: a fixed number of steps

    runs: dict[str, list[dict[str, Any]]] = {system: [] for system in args.systems}
    with tempfile.TemporaryDirectory(prefix="rlsdk-bench-algorithms-") as tmp:
        for seed in seeds:
            for system in args.systems:
                result = asyncio.run(run_once(system_config(system, seed, Path(tmp), max_steps), target))
                result["seed"] = seed
                runs[system].append(result)
                print(
                    f"seed {seed} {system:>8}: steps {result['steps']:5d}, to target {result['steps_to_target']}, "
                    f"{1000 * result['step_s_median']:.1f} ms/step, final reward {result['final_moving_reward']:.3f}",
                    flush=True,
                )

    summary: dict[str, Any] = {}
    print(f"\nsteps to a 10-step mean reward of {target} (cap {max_steps}; seeds {seeds})")
    print(f"  {'system':<10} {'per seed':<28} {'median steps':>12} {'median s':>9} {'missed':>7} {'final':>6}")
    for system, results in runs.items():
        reached = [r for r in results if r["steps_to_target"] is not None]
        summary[system] = {
            "steps_to_target": [r["steps_to_target"] for r in results],
            "median_steps": statistics.median([r["steps_to_target"] or max_steps + 1 for r in results]),
            "median_seconds": statistics.median([r["seconds_to_target"] or float("inf") for r in results]),
            "missed": len(results) - len(reached),
            "final_moving_reward": [r["final_moving_reward"] for r in results],
        }
        per_seed = " ".join(str(r["steps_to_target"] or "miss") for r in results)
        row = summary[system]
        print(
            f"  {system:<10} {per_seed:<28} {row['median_steps']:>12} {row['median_seconds']:>9.1f} "
            f"{row['missed']:>7} {statistics.median(row['final_moving_reward']):>6.3f}"
        )
    write_json(
        args.json,
        {
            "benchmark": "algorithms",
            "quick": args.quick,
            "seeds": seeds,
            "max_steps": max_steps,
            "target": target,
            "systems": {name: SYSTEMS[name] for name in args.systems},
            "summary": summary,
            "runs": runs,
        },
    )


if __name__ == "__main__":
    main()
