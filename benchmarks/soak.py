"""Soak: the default recipe's loop for hundreds of steps, watching memory, open files and child processes.

Runs ``recipes/grpo_reverse.py``'s step (rollout -> reward -> update -> sync_weights; 2 ranks, the tiny reverse
policy, the embedded engine, TensorBoard on) for ``--steps`` steps (default 500; ``--quick``: 30) and samples,
every few steps: the controller's resident memory (RSS), each rank's RSS, the open file descriptors of the
controller and of each rank (``/proc/PID/fd``), the controller's threads and its child processes (recursive:
the ``accelerate launch`` process and the ranks). After the Session closes it checks that no child process
survives and that the controller's descriptor count is back to its value before the Session started.

Growth is measured after warm-up (the first 10% of the steps, at least 5): ``warm-up`` is the median of the
first three samples after it, ``final`` the median of the last three. Exit status 1 when any RSS grows by more
than 10%, descriptors or child processes grow after warm-up, or a child process or descriptor outlives the
Session. The loop runs a fixed number of steps (the recipe's early stop at ``train.target_reward`` is off).

``--mode async`` (the default) runs the loop with ``rollout.mode='async'`` (the next rollout generates in the
background while the ranks train; ``max_staleness`` 1, decoupled PPO), the long-running mode that keeps the most
state alive; ``--mode sequential`` is the recipe's own default.

Usage: ``python benchmarks/soak.py [--quick] [--steps N] [--mode async|sequential] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))

from _harness import write_json
from grpo_reverse import config as recipe_config

from rlsdk import Session, SessionConfig
from rlsdk.data import build_tiny_policy
from rlsdk.rewards import reverse_reward

RSS_GROWTH_LIMIT_PCT = 10.0
CLOSE_GRACE_S = 10.0


def soak_config(model_dir: Path, out: Path, seed: int, mode: str = "async") -> SessionConfig:
    """The recipe's config with a local model and output root, no console logs, in rollout ``mode`` ('async':
    the next batch generates while the ranks train, ``max_staleness`` 1, decoupled PPO)."""
    cfg = recipe_config()
    staleness = 1 if mode == "async" else cfg.rollout.max_staleness
    off_policy = "decoupled" if mode == "async" else cfg.algorithm.off_policy
    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, path=str(model_dir)),
        rollout=dataclasses.replace(cfg.rollout, mode=mode, max_staleness=staleness),
        algorithm=dataclasses.replace(cfg.algorithm, off_policy=off_policy),
        observe=dataclasses.replace(cfg.observe, output_dir=str(out), console=False, log_level="WARNING"),
        seed=seed,
    )


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def sample(step: int, step_s: float, rank_pids: dict[int, int]) -> dict[str, Any]:
    """One row: the controller's and every rank's RSS (MiB) and descriptors, threads and child processes."""
    me = psutil.Process()
    row: dict[str, Any] = {
        "step": step,
        "time": time.time(),
        "step_s": step_s,
        "controller_rss_mib": me.memory_info().rss / 2**20,
        "controller_fds": open_fds(me.pid),
        "controller_threads": me.num_threads(),
        "children": len(me.children(recursive=True)),
    }
    for rank, pid in sorted(rank_pids.items()):
        row[f"rank{rank}_rss_mib"] = psutil.Process(pid).memory_info().rss / 2**20
        row[f"rank{rank}_fds"] = open_fds(pid)
    return row


async def soak(config: SessionConfig, steps: int, every: int) -> tuple[list[dict[str, Any]], list[int]]:
    samples: list[dict[str, Any]] = []
    async with await Session.start(config) as session:
        rank_pids = {int(rank): int(info["pid"]) for rank, info in session.rank_info.items()}
        samples.append(sample(0, 0.0, rank_pids))
        for step in range(1, steps + 1):
            start = time.perf_counter()
            rollout = await session.rollout()
            rollout = await session.reward(rollout, reverse_reward)
            await session.update(rollout)
            await session.sync_weights()
            seconds = time.perf_counter() - start
            if step % every == 0 or step == steps:
                samples.append(sample(step, seconds, rank_pids))
    return samples, list(rank_pids.values())


def growth(samples: list[dict[str, Any]], key: str, warmup: int) -> dict[str, float]:
    after = [row[key] for row in samples if row["step"] >= warmup]
    warm = statistics.median(after[:3])
    final = statistics.median(after[-3:])
    return {
        "warmup": warm,
        "final": final,
        "min": min(after),
        "max": max(after),
        "growth_pct": (final - warm) / warm * 100.0 if warm else 0.0,
    }


def survivors(pids: list[int]) -> list[int]:
    """The pids still running (zombies count as gone: their resources are released)."""
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            continue
    return alive


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="30 steps: a smoke test, not a measurement")
    parser.add_argument("--steps", type=int, default=None, help="steps to run (default 500; --quick: 30)")
    parser.add_argument("--every", type=int, default=None, help="sample every N steps (default: steps / 50)")
    parser.add_argument("--json", default=None, help="write all samples and figures to this JSON file")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--mode", choices=("async", "sequential"), default="async", help="rollout.mode of the loop (default async)"
    )
    args = parser.parse_args()
    steps = args.steps or (30 if args.quick else 500)
    every = args.every or max(1, steps // 50)
    warmup = min(max(5, steps // 10), steps)

    work = Path(tempfile.mkdtemp(prefix="rlsdk-soak-"))
    model_dir = build_tiny_policy(work / "model", seed=args.seed)
    config = soak_config(model_dir, work / "run", args.seed, args.mode)
    me = psutil.Process()
    baseline = {"controller_fds": open_fds(me.pid), "children": len(me.children(recursive=True))}

    t0 = time.perf_counter()
    samples, rank_pids = asyncio.run(soak(config, steps, every))
    seconds = time.perf_counter() - t0
    deadline = time.monotonic() + CLOSE_GRACE_S
    while time.monotonic() < deadline and (me.children(recursive=True) or survivors(rank_pids)):
        time.sleep(0.2)
    after_close = {
        "controller_fds": open_fds(me.pid),
        "children": len(me.children(recursive=True)),
        "surviving_ranks": survivors(rank_pids),
    }

    keys = [key for key in samples[0] if key.endswith(("_rss_mib", "_fds")) or key in ("children",)]
    keys.append("controller_threads")
    figures = {key: growth(samples, key, warmup) for key in keys}
    step_times = [row["step_s"] for row in samples if row["step"] >= warmup]
    failures = [
        f"{key}: RSS grew {fig['growth_pct']:.1f}% after warm-up (limit {RSS_GROWTH_LIMIT_PCT:.0f}%)"
        for key, fig in figures.items()
        if key.endswith("_rss_mib") and fig["growth_pct"] > RSS_GROWTH_LIMIT_PCT
    ]
    failures += [
        f"{key}: {fig['warmup']:.0f} -> {fig['final']:.0f} after warm-up"
        for key, fig in figures.items()
        if (key.endswith("_fds") or key == "children") and fig["final"] > fig["warmup"]
    ]
    if after_close["children"] or after_close["surviving_ranks"]:
        failures.append(f"processes outlived the Session: {after_close}")
    if after_close["controller_fds"] > baseline["controller_fds"]:
        failures.append(
            f"controller descriptors {baseline['controller_fds']} before start, {after_close['controller_fds']} "
            "after close"
        )

    print(f"\nsoak: {steps} steps in {seconds:.0f} s, sampled every {every}, warm-up {warmup} steps")
    print(f"  {'metric':<22} {'warm-up':>10} {'final':>10} {'min':>10} {'max':>10} {'growth':>9}")
    for key, fig in figures.items():
        print(
            f"  {key:<22} {fig['warmup']:>10.1f} {fig['final']:>10.1f} {fig['min']:>10.1f} {fig['max']:>10.1f} "
            f"{fig['growth_pct']:>8.1f}%"
        )
    print(
        f"  step time after warm-up: median {statistics.median(step_times) * 1e3:.0f} ms "
        f"(first {step_times[0] * 1e3:.0f} ms, last {step_times[-1] * 1e3:.0f} ms)"
    )
    print(
        f"  before start: {baseline['controller_fds']} controller fds, {baseline['children']} children; "
        f"after close: {after_close['controller_fds']} fds, {after_close['children']} children, "
        f"surviving ranks {after_close['surviving_ranks']}"
    )
    print("PASS" if not failures else "FAIL:\n  " + "\n  ".join(failures))
    write_json(
        args.json,
        {
            "benchmark": "soak",
            "quick": args.quick,
            "mode": args.mode,
            "steps": steps,
            "sample_every": every,
            "warmup_steps": warmup,
            "seconds": seconds,
            "rss_growth_limit_pct": RSS_GROWTH_LIMIT_PCT,
            "figures": figures,
            "baseline": baseline,
            "after_close": after_close,
            "failures": failures,
            "passed": not failures,
            "samples": samples,
        },
    )
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
