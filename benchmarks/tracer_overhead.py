"""Cost of the collective tracer (rlsdk.debug.tracer), measured side by side in one run.

1. Recording cost per collective: ``Tracer.record`` (sequence number, shapes, dtypes, call-site walk, ring
   buffer append) timed call by call from a user-level frame, in microseconds. Target: median <= 5 us.
2. Whole-call latency of a 1-float ``all_reduce`` on 2 gloo ranks through a ``traced`` group and through a plain
   gloo group (both in the same processes, blocks interleaved): the difference is what a user pays per
   collective, C++-to-Python bridge and completion callback included.
3. DDP step time (forward, backward with its bucketed all-reduces, SGD step) of a small MLP on 2 ranks,
   traced group vs plain gloo group, interleaved step by step. Target: ratio <= 1.02.

4. The default recipe's step (``recipes/grpo_reverse.py``'s config: rollout -> reward -> update -> sync on 2
   background ranks) through live Sessions, ``launch.tracer=True`` (the traced group and the hang watchdog with
   its live checks: the default config) and ``launch.tracer=False``, same model init and seed, stepped in turn
   (the order rotates every round and reverses every other round, so none always goes first). Target: ratio
   <= 1.02. Reported as the ratio of medians and the median of per-round ratios.
5. The live checks' cost on the same step: ``launch.trace_poll_s`` at its default (on) vs ``None`` (off), both
   with the tracer, interleaved with (4) in the same rounds. Target: ratio <= 1.01. A check runs only while a
   command has run ``trace_poll_s``, so on this recipe it mostly costs the timer; (6) prices a check itself.
6. One live check's cost on a rank: :meth:`Tracer.poll` plus encoding its answer, with a full ring buffer
   (4,096 records): the first poll of a command (up to ``POLL_LIMIT`` records) and a later one (nothing new),
   next to the full ``trace`` snapshot it replaces.

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


# Launch overrides of the Sessions compared in (4) and (5): tracer off; tracer on without live checks; the default.
VARIANTS: dict[str, dict[str, Any]] = {"off": {"tracer": False}, "no_poll": {"trace_poll_s": None}, "on": {}}


def _order(index: int) -> list[str]:
    names = list(VARIANTS)
    shift = index % len(names)
    names = names[shift:] + names[:shift]
    return names if (index // len(names)) % 2 == 0 else names[::-1]


async def recipe_step_s(rounds: int, warmup: int) -> dict[str, list[float]]:
    """Per-step seconds of the default recipe through one Session per :data:`VARIANTS`, stepped in turn."""
    from rlsdk import Session
    from rlsdk.data import build_tiny_policy
    from rlsdk.rewards import reverse_reward

    base = _recipe_config()
    root = Path(tempfile.mkdtemp(prefix="rlsdk-bench-tracer-"))
    model_dir = root / "policy"
    build_tiny_policy(model_dir, seed=base.seed)
    sessions: dict[str, Any] = {}
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    try:
        for name, launch in VARIANTS.items():
            config = dataclasses.replace(
                base,
                model=dataclasses.replace(base.model, path=str(model_dir)),
                launch=dataclasses.replace(base.launch, **launch),
                observe=dataclasses.replace(
                    base.observe, output_dir=str(root / name), console=False, tensorboard=False, log_level="WARNING"
                ),
            )
            sessions[name] = await Session.start(config)
        for index in range(warmup + rounds):
            for name in _order(index):
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


def poll_cost_ms(repeats: int) -> dict[str, Any]:
    """(6): milliseconds to answer one live check (``Tracer.poll`` + encoding) with a full ring buffer, first and
    incremental, and the full ``trace`` snapshot for comparison."""
    import torch

    from rlsdk.control import codec
    from rlsdk.debug.tracer import POLL_LIMIT, Tracer

    tracer = Tracer(4096)
    tensors = [torch.ones(4)]

    def user_step() -> None:  # a user frame as the call site, as in training code
        for _ in range(tracer.capacity):
            tracer.record("0", False, "allreduce", tensors, "SUM", None, True)[13] = time.monotonic()

    user_step()
    figures: dict[str, list[float]] = {"first_poll": [], "next_poll": [], "full_snapshot": []}
    for _ in range(repeats):
        t0 = time.perf_counter()
        answer = tracer.poll(None, [])
        codec.encode(answer)
        t1 = time.perf_counter()
        codec.encode(tracer.poll(tracer.count, []))
        t2 = time.perf_counter()
        codec.encode(tracer.snapshot())
        t3 = time.perf_counter()
        figures["first_poll"].append((t1 - t0) * 1e3)
        figures["next_poll"].append((t2 - t1) * 1e3)
        figures["full_snapshot"].append((t3 - t2) * 1e3)
    return {name: _stats(samples) for name, samples in figures.items()} | {"poll_limit": POLL_LIMIT}


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
    poll = poll_cost_ms(5 if args.quick else 50)
    print(
        f"  live check answered by a rank (4,096 records): first {poll['first_poll']['median']:.2f} ms, next "
        f"{poll['next_poll']['median']:.3f} ms; full trace snapshot {poll['full_snapshot']['median']:.1f} ms"
    )
    recipe: dict[str, Any] | None = None
    live: dict[str, Any] | None = None
    if not args.skip_recipe:
        times = asyncio.run(recipe_step_s(rounds, warmup))

        def compare(on: str, off: str) -> tuple[float, float]:
            paired = [a / b for a, b in zip(times[on], times[off], strict=True)]
            return statistics.median(times[on]) / statistics.median(times[off]), statistics.median(paired)

        steps = {name: _stats(samples) for name, samples in times.items()}
        ratio_of_medians, paired_ratio = compare("on", "off")
        recipe = {"step_s": steps, "ratio_of_medians": ratio_of_medians, "median_paired_ratio": paired_ratio,
                  "rounds": rounds}  # fmt: skip
        poll_ratio, poll_paired = compare("on", "no_poll")
        live = {"ratio_of_medians": poll_ratio, "median_paired_ratio": poll_paired, "rounds": rounds}
        print(
            f"  default recipe step: tracer off {steps['off']['median'] * 1e3:.1f} ms, on "
            f"{steps['on']['median'] * 1e3:.1f} ms, ratio {ratio_of_medians:.3f} "
            f"(median paired {paired_ratio:.3f}; target <= 1.02; {rounds} rounds)"
        )
        print(
            f"  live checks: trace_poll_s off {steps['no_poll']['median'] * 1e3:.1f} ms, on "
            f"{steps['on']['median'] * 1e3:.1f} ms, ratio {poll_ratio:.3f} (median paired {poll_paired:.3f}; "
            "target <= 1.01)"
        )
    write_json(
        args.json,
        {
            "record_us": record,
            "all_reduce_us": latency,
            "ddp_step_s": step,
            "ddp_step_ratio": ratio,
            "recipe": recipe,
            "live_check": live,
            "poll_ms": poll,
            "quick": args.quick,
        },
    )


if __name__ == "__main__":
    main()
