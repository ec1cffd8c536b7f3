"""Scaling curves: how a Session's update and weight-sync time grow with the model and with the number of ranks.

1. Model size: Qwen2-style random-init policies of ~0.1M, ~10M and ~100M parameters (the 16-token reverse
   vocabulary, tied embeddings; shapes in ``SIZES``, actual counts printed and in the JSON) through a real
   Session with the embedded engine on 2 train ranks (1 torch thread each). Every size uses the same small
   batch, 4 prompts x 4 samples x at most 5 new tokens, so the 100M model stays affordable on CPU and the sizes
   stay comparable (the per-step work differs only by the model). Per step: seconds in ``update`` (forward,
   backward, all-reduce, AdamW) and in ``sync_weights`` (rank 0 publishes a safetensors file, the engine loads
   and verifies it). Reported per size: medians, seconds per million parameters, sync bytes/s (the published
   file's size over the sync time) and the scaling exponent k between consecutive sizes (time ~ parameters^k:
   k = 1 is linear in the work; k < 1 means fixed costs still dominate).
2. Ranks: the ~0.1M default policy on 1, 2 and 4 ranks (1 torch thread each) at a fixed global batch, the
   default recipe's 16 prompts x 16 samples, micro-batch 64 (so every rank count runs the same micro-batch
   shape). Reported as each time over the 1-rank time: strong scaling. On a machine with fewer cores than
   ranks + engine the ranks share cores; the JSON records ``cpu_count``.

Repetitions are interleaved (A B C A B C ...); each repetition is a fresh Session, a few warm-up steps, then the
timed steps; a figure is the median over repetitions of the per-repetition medians (min-max across them).
``--quick``: the 0.1M model only, 1 and 2 ranks, 1 repetition of 3 timed steps (a smoke test, not a measurement).

Usage: ``python benchmarks/scaling.py [--quick] [--json PATH] [--reps 3] [--sizes 0.1M 10M 100M] [--ranks 1 2 4]``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import print_table, summarize, write_json

from rlsdk import Session
from rlsdk.config import (
    DataConfig,
    LaunchConfig,
    ModelConfig,
    ObserveConfig,
    RolloutConfig,
    SessionConfig,
    TrainConfig,
)
from rlsdk.data import build_tiny_policy
from rlsdk.launch.supervised import RankProcessError
from rlsdk.rewards import reverse_reward

# build_tiny_policy shapes; parameters ~ layers x (4 h^2 + 3 h i) + 16 h (tied embeddings).
SIZES: dict[str, dict[str, int]] = {
    "0.1M": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "intermediate_size": 256},
    "10M": {"hidden_size": 256, "num_layers": 10, "num_heads": 4, "intermediate_size": 1024},
    "100M": {"hidden_size": 768, "num_layers": 10, "num_heads": 12, "intermediate_size": 3072},
}
# (warm-up steps, timed steps) per size: the 100M model takes seconds per step on CPU.
SIZE_STEPS = {"0.1M": (2, 8), "10M": (2, 6), "100M": (1, 3)}
SIZE_BATCH = {"prompts_per_step": 4, "group_size": 4, "micro_batch_size": 16, "num_ranks": 2}
RANK_BATCH = {"prompts_per_step": 16, "group_size": 16, "micro_batch_size": 64}
RANK_STEPS = (2, 8)
MAX_NEW_TOKENS = 5
PHASES = ("rollout_s", "update_s", "sync_s", "step_s")


def model_size(model_dir: Path) -> tuple[int, int]:
    """(parameters, bytes) of the saved weights: what one sync publishes and loads (fp32, tied embeddings once)."""
    from safetensors import safe_open

    params = 0
    files = sorted(model_dir.glob("*.safetensors"))
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                params += math.prod(f.get_slice(name).get_shape())
    return params, sum(file.stat().st_size for file in files)


def session_config(
    model_dir: Path, out: Path, *, num_ranks: int, prompts_per_step: int, group_size: int, micro_batch_size: int
) -> SessionConfig:
    return SessionConfig(
        model=ModelConfig(path=str(model_dir)),
        launch=LaunchConfig(num_ranks=num_ranks, threads_per_rank=1),
        train=TrainConfig(lr=1e-3, micro_batch_size=micro_batch_size),
        rollout=RolloutConfig(group_size=group_size, max_new_tokens=MAX_NEW_TOKENS),
        data=DataConfig(prompts_per_step=prompts_per_step, num_examples=4096),
        observe=ObserveConfig(output_dir=str(out), console=False, tensorboard=False, log_level="WARNING"),
        seed=0,
    )


async def timed_steps(config: SessionConfig, warmup: int, steps: int) -> dict[str, float]:
    """One fresh Session: ``warmup`` untimed steps, then the median seconds per phase over ``steps`` steps."""
    times: dict[str, list[float]] = {phase: [] for phase in PHASES}
    async with await Session.start(config) as session:
        for index in range(warmup + steps):
            t0 = time.perf_counter()
            rollout = await session.reward(await session.rollout(), reverse_reward)
            t1 = time.perf_counter()
            await session.update(rollout)
            t2 = time.perf_counter()
            await session.sync_weights()
            t3 = time.perf_counter()
            if index >= warmup:
                for phase, seconds in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t3 - t0)):
                    times[phase].append(seconds)
    return {phase: statistics.median(samples) for phase, samples in times.items()}


def exponent(t0: float, t1: float, p0: int, p1: int) -> float:
    """k in time ~ parameters^k between two sizes."""
    return math.log(t1 / t0) / math.log(p1 / p0)


def model_sweep(root: Path, names: list[str], reps: int, quick: bool) -> dict[str, Any]:
    models = {name: build_tiny_policy(root / f"model-{name}", seed=0, **SIZES[name]) for name in names}
    sizes = {name: model_size(path) for name, path in models.items()}
    for name, (params, nbytes) in sizes.items():
        print(f"model {name}: {params:,} parameters, {nbytes / 1e6:.1f} MB of weights, shape {SIZES[name]}")
    per_rep: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for rep in range(reps):
        for name in names:  # interleaved: 0.1M, 10M, 100M, 0.1M, ...
            warmup, steps = (1, 3) if quick else SIZE_STEPS[name]
            config = session_config(models[name], root / f"size-{name}-{rep}", **SIZE_BATCH)
            medians = asyncio.run(timed_steps(config, warmup, steps))
            per_rep[name].append(medians)
            print(
                f"rep {rep} {name:>5}: update {medians['update_s'] * 1e3:.1f} ms, sync {medians['sync_s'] * 1e3:.1f} "
                f"ms, step {medians['step_s'] * 1e3:.1f} ms",
                flush=True,
            )
    rows = []
    for name in names:
        params, nbytes = sizes[name]
        figures = {phase: summarize([m[phase] for m in per_rep[name]]) for phase in PHASES}
        update, sync = figures["update_s"]["median"], figures["sync_s"]["median"]
        rows.append(
            {
                "name": name,
                "shape": SIZES[name],
                "parameters": params,
                "sync_bytes": nbytes,
                "warmup_steps": 1 if quick else SIZE_STEPS[name][0],
                "steps": 3 if quick else SIZE_STEPS[name][1],
                **figures,
                "update_s_per_mparam": update / (params / 1e6),
                "sync_s_per_mparam": sync / (params / 1e6),
                "sync_bytes_per_s": nbytes / sync,
            }
        )
    exponents = [
        {
            "from": a["name"],
            "to": b["name"],
            "update": exponent(a["update_s"]["median"], b["update_s"]["median"], a["parameters"], b["parameters"]),
            "sync": exponent(a["sync_s"]["median"], b["sync_s"]["median"], a["parameters"], b["parameters"]),
        }
        for a, b in itertools.pairwise(rows)
    ]
    return {**SIZE_BATCH, "max_new_tokens": MAX_NEW_TOKENS, "reps": reps, "sizes": rows, "exponents": exponents}


def rank_sweep(root: Path, ranks: list[int], reps: int, quick: bool) -> dict[str, Any]:
    model = build_tiny_policy(root / "model-0.1M", seed=0, **SIZES["0.1M"])
    params, nbytes = model_size(model)
    warmup, steps = (1, 3) if quick else RANK_STEPS
    per_rep: dict[int, list[dict[str, float]]] = {n: [] for n in ranks}
    failed: dict[int, str] = {}
    for rep in range(reps):
        for n in ranks:  # interleaved: 1, 2, 4, 1, ...
            if n in failed:
                continue
            config = session_config(model, root / f"ranks-{n}-{rep}", num_ranks=n, **RANK_BATCH)
            try:
                medians = asyncio.run(timed_steps(config, warmup, steps))
            except RankProcessError as exc:  # recorded, not fatal: the other rank counts still measure
                failed[n] = str(exc).strip().splitlines()[-1]
                print(f"rep {rep} {n} rank(s): the ranks did not start ({failed[n]}); skipped", flush=True)
                continue
            per_rep[n].append(medians)
            print(
                f"rep {rep} {n} rank(s): update {medians['update_s'] * 1e3:.1f} ms, sync "
                f"{medians['sync_s'] * 1e3:.1f} ms, step {medians['step_s'] * 1e3:.1f} ms",
                flush=True,
            )
    rows = [
        {"num_ranks": n, **{phase: summarize([m[phase] for m in per_rep[n]]) for phase in PHASES}}
        for n in ranks
        if per_rep[n]
    ]
    if not rows:
        raise RuntimeError(f"no rank count started: {failed}")
    base = rows[0]  # the fewest ranks that ran (1 unless it failed)
    for row in rows:
        for phase in ("update_s", "step_s"):
            row[f"{phase[:-2]}_ratio_vs_{base['num_ranks']}"] = row[phase]["median"] / base[phase]["median"]
    return {
        "model": "0.1M",
        "parameters": params,
        "sync_bytes": nbytes,
        **RANK_BATCH,
        "max_new_tokens": MAX_NEW_TOKENS,
        "threads_per_rank": 1,
        "warmup_steps": warmup,
        "steps": steps,
        "reps": reps,
        "baseline_ranks": base["num_ranks"],
        "ranks": rows,
        "failed": {str(n): reason for n, reason in failed.items()},
    }


def report(sizes: dict[str, Any], ranks: dict[str, Any]) -> None:
    batch = f"{sizes['prompts_per_step']} prompts x {sizes['group_size']} samples, {sizes['num_ranks']} ranks"
    for phase in ("update_s", "sync_s"):
        print_table(
            f"{phase[:-2]} time by model size ({batch}; median of per-repetition medians)",
            [{"name": f"{r['name']} ({r['parameters'] / 1e6:.2f}M params)", **ms(r[phase])} for r in sizes["sizes"]],
            "ms",
        )
    print("\ncost per unit of work")
    for r in sizes["sizes"]:
        print(
            f"  {r['name']:>5}: update {r['update_s_per_mparam'] * 1e3:.2f} ms per M params, sync "
            f"{r['sync_bytes_per_s'] / 1e6:.1f} MB/s ({r['sync_bytes'] / 1e6:.1f} MB)"
        )
    for e in sizes["exponents"]:
        print(f"  exponent {e['from']} -> {e['to']}: update k = {e['update']:.2f}, sync k = {e['sync']:.2f}")
    base = ranks["baseline_ranks"]
    for n, reason in ranks["failed"].items():
        print(f"\n{n} rank(s): not measured, the ranks did not start: {reason}")
    print_table(
        f"update time by ranks (0.1M model, global batch {ranks['prompts_per_step']} x {ranks['group_size']}; "
        f"ratio vs {base} rank(s))",
        [
            {"name": f"{r['num_ranks']} rank(s)", **ms(r["update_s"]), "ratio": r[f"update_ratio_vs_{base}"]}
            for r in ranks["ranks"]
        ],
        "ms",
    )
    print_table(
        f"step time by ranks (rollout + reward + update + sync; ratio vs {base} rank(s))",
        [
            {"name": f"{r['num_ranks']} rank(s)", **ms(r["step_s"]), "ratio": r[f"step_ratio_vs_{base}"]}
            for r in ranks["ranks"]
        ],
        "ms",
    )


def ms(stats: dict[str, float]) -> dict[str, float]:
    return {key: stats[key] * 1e3 for key in ("median", "min", "max")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="0.1M model, 1-2 ranks, 3 steps: a smoke test")
    parser.add_argument("--json", default=None, help="write all figures to this JSON file")
    parser.add_argument("--reps", type=int, default=3, help="interleaved repetitions (fresh Sessions) per point")
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    names, ranks, reps = args.sizes, sorted(set(args.ranks)), args.reps
    if args.quick:
        names, ranks, reps = ["0.1M"], [n for n in ranks if n <= 2] or [1], 1

    root = Path(tempfile.mkdtemp(prefix="rlsdk-bench-scaling-"))
    try:
        t0 = time.perf_counter()
        sizes = model_sweep(root, names, reps, args.quick)
        by_ranks = rank_sweep(root, ranks, reps, args.quick)
        seconds = time.perf_counter() - t0
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report(sizes, by_ranks)
    print(f"\n{seconds:.0f} s in all")
    write_json(
        args.json,
        {
            "benchmark": "scaling",
            "quick": args.quick,
            "command": " ".join(["python", *sys.argv]),
            "seconds": seconds,
            "model_sweep": sizes,
            "rank_sweep": by_ranks,
        },
    )


if __name__ == "__main__":
    main()
