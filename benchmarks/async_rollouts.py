"""Async overlapped rollouts against sequential ones: seconds to the default recipe's reward threshold.

Both systems run the default recipe's loop (recipes/grpo_reverse.py: 2 ranks, the tiny reverse policy, the
embedded engine, 16 prompts x 16 samples, lr 1e-3, no std scaling) through a real Session and differ in config
only: ``rollout.mode`` 'sequential' (generate, then train) or 'async' (the next batch generates while the ranks
train; ``rollout.max_staleness = 1``; ``algorithm.off_policy`` = ``--async-off-policy``, default 'decoupled').
Why decoupled: with the plain PPO ratio against the one-version-old behaviour logprobs, async needed
1064/1314/>1500 steps on seeds 0/1/2 against sequential's 973/526/748. Runs are interleaved per seed (sequential,
async, sequential, ...), each until the 10-step moving mean reward reaches ``--target`` or ``--max-steps``. Per
run: seconds and steps to the target (``None`` when missed), median seconds per step (after 10 warm-up steps),
the final moving reward.

The table gives medians over seeds and the ratio async / sequential (< 1: async is faster). A run that misses the
target counts as ``--max-steps`` worth of time for the median (stated in the JSON as ``missed``).

A second task, ``tool`` (``--tasks reverse tool``; not in the default run), measures the overlap where
generation is not all compute: the multi-turn tool-use recipe (recipes/tool_lookup.py: the model calls a lookup
tool, then answers with what it returned) with a tool that answers after ``--tool-latency-ms`` (default 50 ms; an
``asyncio.sleep``, standing in for a code sandbox or a web API, which use no local CPU). Same two modes, same
interleaving; the target is the 10-step mean of the ``answer`` reward component. Its figures are under
``tool_task`` in the JSON; the top-level ``summary``/``runs`` are the default task's (absent if it did not run).

Usage: ``python benchmarks/async_rollouts.py [--quick] [--seeds 0 1 2] [--max-steps 1500] [--tasks reverse tool]
[--tool-latency-ms 50] [--json PATH]``.
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
from tool_lookup import REWARD as TOOL_REWARD
from tool_lookup import config as tool_recipe_config
from tool_lookup import lookup_workflow

from rlsdk import Session, SessionConfig
from rlsdk.data import build_tiny_policy
from rlsdk.rewards import reverse_reward

MODES = ("sequential", "async")
TASKS = ("reverse", "tool")
# task -> (the stats key whose 10-step mean must reach the target, reward function)
TASK_TARGET = {"reverse": ("reward/mean", reverse_reward), "tool": ("reward/answer", TOOL_REWARD)}
# algorithm.off_policy of the async system: 'none' (the PPO ratio against the behaviour logprobs, one version
# old) or 'decoupled' (AReaL's decoupled PPO: the proximal policy is the trainer's, behaviour weights capped).
WINDOW = 10
WARMUP = 10


def run_config(
    mode: str, seed: int, root: Path, max_steps: int, off_policy: str = "none", task: str = "reverse"
) -> SessionConfig:
    base = recipe_config() if task == "reverse" else tool_recipe_config()
    model = build_tiny_policy(root / f"model-seed{seed}", seed=seed)
    return dataclasses.replace(
        base,
        seed=seed,
        model=dataclasses.replace(base.model, path=str(model)),
        train=dataclasses.replace(base.train, max_steps=max_steps),
        rollout=dataclasses.replace(base.rollout, mode=mode, max_staleness=1 if mode == "async" else 0),
        algorithm=dataclasses.replace(base.algorithm, off_policy=off_policy if mode == "async" else "none"),
        observe=dataclasses.replace(
            base.observe, output_dir=str(root / f"{task}-{mode}-seed{seed}"), tensorboard=False
        ),
    )


def tool_workflow(session: Session, latency_s: float) -> Any:
    """recipes/tool_lookup.py's workflow with a tool that answers after ``latency_s`` (waiting, not computing)."""
    from rlsdk.data.tool_tasks import lookup_env

    async def remote_lookup(call: str, row: dict[str, Any]) -> str:
        await asyncio.sleep(latency_s)
        return lookup_env(call, row)

    return lookup_workflow(session, env=remote_lookup)


async def run_once(
    config: SessionConfig, target: float, task: str = "reverse", tool_latency_s: float = 0.0
) -> dict[str, Any]:
    """The recipe's loop until the moving mean reaches ``target``; timing starts once the Session is up."""
    rewards: list[float] = []
    step_s: list[float] = []
    metric, reward_fn = TASK_TARGET[task]
    async with await Session.start(config) as session:
        if task == "tool":
            session.workflow = tool_workflow(session, tool_latency_s)
        start = time.perf_counter()
        reached_at: tuple[int, float] | None = None
        for step in range(1, config.train.max_steps + 1):
            t0 = time.perf_counter()
            rollout = await session.reward(await session.rollout(), reward_fn)
            stats = await session.update(rollout)
            await session.sync_weights()
            step_s.append(time.perf_counter() - t0)
            rewards.append(stats[metric])
            if len(rewards) >= WINDOW and statistics.fmean(rewards[-WINDOW:]) >= target:
                reached_at = (step, time.perf_counter() - start)
                break
        total = time.perf_counter() - start
    return {
        "steps_to_target": None if reached_at is None else reached_at[0],
        "seconds_to_target": None if reached_at is None else reached_at[1],
        "seconds": total,
        "steps": len(rewards),
        "step_s_median": statistics.median(step_s[WARMUP:] or step_s),
        "final_moving_reward": statistics.fmean(rewards[-WINDOW:]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 seed, 12 steps, no target (a smoke test)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--max-steps", type=int, default=1500)
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--async-off-policy",
        choices=("none", "tis", "decoupled"),
        default="decoupled",
        help="algorithm.off_policy of the async runs (sequential runs are on-policy: 'none')",
    )
    parser.add_argument("--tasks", nargs="+", choices=TASKS, default=["reverse"])
    parser.add_argument("--tool-latency-ms", type=float, default=50.0, help="the tool task's answer latency")
    args = parser.parse_args()
    seeds, max_steps, target = args.seeds, args.max_steps, args.target
    if args.quick:
        seeds, max_steps, target = seeds[:1], 12, 2.0  # unreachable: a fixed number of steps

    results = {
        task: run_task(task, seeds, max_steps, target, args.async_off_policy, args.tool_latency_ms / 1000, args.quick)
        for task in args.tasks
    }
    payload: dict[str, Any] = {
        "benchmark": "async_rollouts",
        "quick": args.quick,
        "seeds": seeds,
        "max_steps": max_steps,
        "target": target,
        "async_off_policy": args.async_off_policy,
        **results.get("reverse", {}),  # the default task's "summary" and "runs" at the top level
    }
    if "tool" in results:
        payload["tool_task"] = {
            "tool_latency_ms": args.tool_latency_ms,
            "target_metric": TASK_TARGET["tool"][0],
            **results["tool"],
        }
    write_json(args.json, payload)


def run_task(
    task: str, seeds: list[int], max_steps: int, target: float, off_policy: str, tool_latency_s: float, quick: bool
) -> dict[str, Any]:
    """Both modes on ``task``, interleaved per seed; prints the tables and returns ``{"summary", "runs"}``."""
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    print(f"\n== task {task}" + (f" (tool latency {tool_latency_s * 1000:.0f} ms)" if task == "tool" else ""))
    with tempfile.TemporaryDirectory(prefix="rlsdk-bench-async-") as tmp:
        for seed in seeds:
            for mode in MODES:  # interleaved: sequential then async for each seed
                config = run_config(mode, seed, Path(tmp), max_steps, off_policy, task)
                result = asyncio.run(run_once(config, target, task, tool_latency_s))
                result["seed"] = seed
                runs[mode].append(result)
                print(
                    f"seed {seed} {mode:>10}: steps {result['steps']:5d}, to target {result['seconds_to_target']}, "
                    f"{1000 * result['step_s_median']:.1f} ms/step, final reward {result['final_moving_reward']:.3f}",
                    flush=True,
                )

    def to_target(run: dict[str, Any]) -> float:
        if run["seconds_to_target"] is not None:
            return float(run["seconds_to_target"])
        return run["step_s_median"] * max_steps  # a miss counts as the whole step budget

    summary: dict[str, Any] = {}
    for metric, pick in (
        ("seconds_to_target", to_target),
        ("step_ms", lambda run: 1000 * run["step_s_median"]),
        ("final_moving_reward", lambda run: run["final_moving_reward"]),
    ):
        summary[metric] = {mode: summarize([pick(run) for run in runs[mode]]) for mode in MODES}
        summary[metric]["ratio_async_over_sequential"] = (
            summary[metric]["async"]["median"] / summary[metric]["sequential"]["median"]
        )
    summary["missed"] = {mode: sum(run["seconds_to_target"] is None for run in runs[mode]) for mode in MODES}
    for metric, unit in (("seconds_to_target", "s"), ("step_ms", "ms"), ("final_moving_reward", "")):
        if quick and metric == "seconds_to_target":
            continue
        rows = [{"name": mode, **summary[metric][mode], "ratio": None} for mode in MODES]
        rows[1]["ratio"] = summary[metric]["ratio_async_over_sequential"]
        print_table(f"{task}: {metric} (median over seeds {seeds}; ratio = async / sequential)", rows, unit)
    print(f"\n{task}: missed the target: {summary['missed']}")
    return {"summary": summary, "runs": runs}


if __name__ == "__main__":
    main()
