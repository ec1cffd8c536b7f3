"""LoRA against full fine-tuning: bytes moved per weight sync, sync time, rank update time and step time.

Each system is the default recipe's loop (recipes/grpo_reverse.py's config: 2 ranks, 16 prompts x 16 samples, one
optimizer step per update) on a randomly initialised policy of each size (benchmarks/scaling.py's ``SIZES``), with
either every weight trained (``full``) or LoRA adapters (``lora``: ``train.lora_rank`` / ``lora_alpha``, all
linear layers). Runs are interleaved per repetition (full, lora, full, lora, ...), each a fresh Session running
``--steps`` steps; the first ``--warmup`` steps of each run are left out of the medians. Per size and engine the
JSON records, for both systems: the bytes each sync moved (``sync/bytes``: the full state dict, or only the
adapter), the trained parameters, the medians of ``time/sync_s``, ``time/rank_update_s`` and the whole step, and the
LoRA / full ratios of each.

Usage: ``python benchmarks/lora.py [--quick] [--sizes 0.1M 10M 100M] [--engines embedded vllm] [--repeats 3]
[--steps 30] [--lora-rank 16] [--json P]``. ``--quick``: the 0.1M model, the embedded engine, 1 repeat of 4 steps.
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


async def run_once(config: SessionConfig, steps: int, warmup: int) -> dict[str, Any]:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="0.1M, embedded, 1 repeat of 4 steps (smoke test)")
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    parser.add_argument("--engines", nargs="+", choices=("embedded", "colocated", "vllm"), default=["embedded"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--lora-alpha", type=float, default=32.0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    sizes, engines, repeats, steps, warmup = args.sizes, args.engines, args.repeats, args.steps, args.warmup
    if args.quick:
        sizes, engines, repeats, steps, warmup = ["0.1M"], ["embedded"], 1, 4, 1

    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="rlsdk-bench-lora-") as tmp:
        root = Path(tmp)
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
                        runs[system].append(asyncio.run(run_once(config, steps, warmup)))
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
    write_json(
        args.json,
        {
            "benchmark": "lora",
            "quick": args.quick,
            "lora_rank": args.lora_rank,
            "lora_alpha": args.lora_alpha,
            "steps": steps,
            "warmup": warmup,
            "repeats": repeats,
            "results": results,
        },
    )


if __name__ == "__main__":
    main()
