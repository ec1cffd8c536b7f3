"""Cost of the collective tracer (rlsdk.debug.tracer), measured side by side in one run.

1. Recording cost per collective: ``Tracer.record`` (sequence number, shapes, dtypes, call-site walk, ring
   buffer append) timed call by call from a user-level frame, in microseconds. Target: median <= 5 us.
2. Whole-call latency of a 1-float ``all_reduce`` on 2 gloo ranks through a ``traced`` group and through a plain
   gloo group (both in the same processes, blocks interleaved): the difference is what a user pays per
   collective, C++-to-Python bridge and completion callback included.
3. DDP step time (forward, backward with its bucketed all-reduces, SGD step) of a small MLP on 2 ranks,
   traced group vs plain gloo group, interleaved step by step. Target: ratio <= 1.02.

The default recipe's step (rollout + update + sync, ~0.1 s+) issues a handful of collectives, so its ratio is
bounded by (3); this benchmark does not start a Session. Shared, noisy machine: quote ratios and medians.

Usage: ``python benchmarks/tracer_overhead.py [--quick] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="few repetitions: a smoke test, not a measurement")
    parser.add_argument("--json", default=None, help="write all figures to this JSON file")
    args = parser.parse_args()
    calls, steps = (2000, 30) if args.quick else (20000, 300)

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
    write_json(
        args.json,
        {
            "record_us": record,
            "all_reduce_us": latency,
            "ddp_step_s": step,
            "ddp_step_ratio": ratio,
            "quick": args.quick,
        },
    )


if __name__ == "__main__":
    main()
