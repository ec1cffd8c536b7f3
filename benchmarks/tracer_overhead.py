"""Cost of the collective tracer (rlsdk.debug.tracer), measured side by side in one run.

1. Recording cost per collective: ``Tracer.record`` (sequence number, shapes, dtypes, call-site walk, ring
   buffer append) timed call by call from a user-level frame, in microseconds. Target: median <= 5 us.
2. Whole-call latency of a 1-float ``all_reduce`` on 2 gloo ranks through a ``traced`` group and through a plain
   gloo group (both in the same processes, blocks interleaved): the difference is what a user pays per
   collective, C++-to-Python bridge and completion callback included.
3. DDP step time (forward, backward with its bucketed all-reduces, SGD step) of a small MLP on 2 ranks,
   traced group vs plain gloo group, interleaved step by step. Target: ratio <= 1.02.

4. The default recipe's step (``recipes/grpo_reverse.py``'s config: rollout -> reward -> update -> sync on 2
   background ranks) through two live Sessions, ``launch.tracer=True`` (the traced group and the hang watchdog)
   and ``launch.tracer=False``, same model init and seed, stepped alternately (ABBA order per round so neither
   always goes first). Target: ratio <= 1.02. Reported as the ratio of medians and the median of per-round
   ratios.

Shared, noisy machine: quote ratios and medians.

Usage: ``python benchmarks/tracer_overhead.py [--quick] [--json PATH] [--skip-recipe]``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import write_json

from rlsdk.testing.distributed import run_gloo_ranks


def _percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _stats(samples: list[float]) -> dict[str, float]:
    return {"median": statistics.median(samples), "p99": _percentile(samples, 0.99), "n": len(samples)}


def record_cost_us(calls: int) -> dict[str, float]:
    import torch

    from rlsdk.debug.tracer import Tracer

    tracer = Tracer(4096)
    tensors = [torch.ones(4)]
    clock = time.perf_counter_ns

    def user_step() -> list[float]:  # the record's call site: a user frame, as in training code
        out = []
        for _ in range(calls):
            t0 = clock()
            tracer.record("0", False, "allreduce", tensors, "SUM", None)
            out.append((clock() - t0) / 1000)
        return out

    def empty() -> list[float]:
        out = []
        for _ in range(calls):
            t0 = clock()
            out.append((clock() - t0) / 1000)
        return out

    user_step()  # warm the code-object cache
    floor = statistics.median(empty())
    return _stats([max(0.0, sample - floor) for sample in user_step()])


def _ranks(rank: int, world: int, calls: int, steps: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from rlsdk.debug import tracer

    dist.init_process_group("gloo")
    tracer.install()
    groups = {"gloo": dist.new_group(backend="gloo"), "traced": dist.new_group(backend="traced")}
    t = torch.ones(1)
    latency: dict[str, list[float]] = {name: [] for name in groups}
    for _ in range(10):
        for group in groups.values():
            dist.all_reduce(t, group=group)
    for _block in range(max(1, calls // 100)):
        for name, group in groups.items():
            for _ in range(100):
                t0 = time.perf_counter_ns()
                dist.all_reduce(t, group=group)
                latency[name].append((time.perf_counter_ns() - t0) / 1000)
    torch.manual_seed(0)
    models = {}
    for name, group in groups.items():
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))
        models[name] = (torch.nn.parallel.DistributedDataParallel(net, process_group=group), None)
        models[name] = (models[name][0], torch.optim.SGD(models[name][0].parameters(), lr=1e-3))
    x = torch.randn(64, 256)
    step_s: dict[str, list[float]] = {name: [] for name in groups}
    for step in range(steps + 5):
        for name, (model, opt) in models.items():
            t0 = time.perf_counter()
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            if step >= 5:
                step_s[name].append(time.perf_counter() - t0)
    return {"latency_us": latency, "step_s": step_s, "records": len(tracer.get_tracer().records)}


def _recipe_config() -> Any:
    path = Path(__file__).resolve().parents[1] / "recipes" / "grpo_reverse.py"
    spec = importlib.util.spec_from_file_location("grpo_reverse_recipe", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.config()


async def recipe_step_s(rounds: int, warmup: int) -> dict[str, list[float]]:
    """Per-step seconds of the default recipe through a tracer-on and a tracer-off Session, stepped alternately."""
    from rlsdk import Session
    from rlsdk.data import build_tiny_policy
    from rlsdk.rewards import reverse_reward

    base = _recipe_config()
    root = Path(tempfile.mkdtemp(prefix="rlsdk-bench-tracer-"))
    model_dir = root / "policy"
    build_tiny_policy(model_dir, seed=base.seed)
    sessions: dict[str, Any] = {}
    times: dict[str, list[float]] = {"off": [], "on": []}
    try:
        for name, tracer in (("off", False), ("on", True)):
            config = dataclasses.replace(
                base,
                model=dataclasses.replace(base.model, path=str(model_dir)),
                launch=dataclasses.replace(base.launch, tracer=tracer),
                observe=dataclasses.replace(
                    base.observe, output_dir=str(root / name), console=False, tensorboard=False, log_level="WARNING"
                ),
            )
            sessions[name] = await Session.start(config)
        for index in range(warmup + rounds):
            for name in ("off", "on") if index % 2 == 0 else ("on", "off"):
                session = sessions[name]
                start = time.perf_counter()
                rollout = await session.rollout()
                rollout = await session.reward(rollout, reverse_reward)
                await session.update(rollout)
                await session.sync_weights()
                if index >= warmup:
                    times[name].append(time.perf_counter() - start)
    finally:
        for session in sessions.values():
            await session.close()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="few repetitions: a smoke test, not a measurement")
    parser.add_argument("--json", default=None, help="write all figures to this JSON file")
    parser.add_argument("--skip-recipe", action="store_true", help="skip (4), the two-Session recipe comparison")
    args = parser.parse_args()
    calls, steps = (2000, 30) if args.quick else (20000, 300)
    rounds, warmup = (8, 2) if args.quick else (300, 10)

    record = record_cost_us(calls)
    per_rank = run_gloo_ranks(_ranks, 2, calls // 4, steps, timeout_s=600)
    latency = {name: _stats([x for r in per_rank for x in r["latency_us"][name]]) for name in ("gloo", "traced")}
    step = {name: _stats([x for r in per_rank for x in r["step_s"][name]]) for name in ("gloo", "traced")}
    ratio = step["traced"]["median"] / step["gloo"]["median"]
    print("tracer overhead (2 gloo ranks)")
    print(
        f"  recording per collective       median {record['median']:.2f} us   p99 {record['p99']:.2f} us  (target <= 5)"
    )
    for name in ("gloo", "traced"):
        figures = latency[name]
        print(f"  all_reduce(1 float) {name:<7}     median {figures['median']:.1f} us   p99 {figures['p99']:.1f} us")
    extra = latency["traced"]["median"] - latency["gloo"]["median"]
    print(f"  added per collective (median)  {extra:.1f} us")
    print(
        f"  DDP MLP step: gloo {step['gloo']['median'] * 1e3:.2f} ms, traced {step['traced']['median'] * 1e3:.2f} ms,"
        f" ratio {ratio:.3f} (target <= 1.02)"
    )
    recipe: dict[str, Any] | None = None
    if not args.skip_recipe:
        times = asyncio.run(recipe_step_s(rounds, warmup))
        paired = [on / off for on, off in zip(times["on"], times["off"], strict=True)]
        recipe = {
            "step_s": {name: _stats(samples) for name, samples in times.items()},
            "ratio_of_medians": statistics.median(times["on"]) / statistics.median(times["off"]),
            "median_paired_ratio": statistics.median(paired),
            "rounds": rounds,
        }
        print(
            f"  default recipe step: tracer off {recipe['step_s']['off']['median'] * 1e3:.1f} ms, on "
            f"{recipe['step_s']['on']['median'] * 1e3:.1f} ms, ratio {recipe['ratio_of_medians']:.3f} "
            f"(median paired {recipe['median_paired_ratio']:.3f}; target <= 1.02; {rounds} rounds)"
        )
    write_json(
        args.json,
        {
            "record_us": record,
            "all_reduce_us": latency,
            "ddp_step_s": step,
            "ddp_step_ratio": ratio,
            "recipe": recipe,
            "quick": args.quick,
        },
    )


if __name__ == "__main__":
    main()
