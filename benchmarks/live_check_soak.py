"""Zero false reports: clean steps of the default recipe with the watchdog's live checks on, per setup.

For each setup it runs ``recipes/grpo_reverse.py``'s step (rollout -> reward -> update -> sync_weights, 2 ranks,
the tiny reverse policy) for ``--steps`` steps with ``launch.trace_poll_s`` at each value of ``--poll-s`` and
counts what the live checks saw (the watchdog's ``poll_stats``): polls analysed, polls a rank left unanswered,
single-poll *settled* sightings and confirmed reports. On a clean run every confirmed report, and every
``CollectiveHangError``, is a false report: there must be none (exit status 1 otherwise).

Setups and default step counts: ``embedded`` 2,000 (the recipe's config), ``colocated`` 2,000
(``inference.engine='colocated'``), ``fsdp2`` 500 (``train.parallelism='fsdp2'``), ``vllm`` 200
(``inference.engine='vllm'``, the recipe's 2-head model; skipped, and recorded so, where vLLM does not import).

``--poll-s`` defaults to ``1.0`` (the config default: a check once a command has run 1 s, which the toy's
commands rarely reach) and ``0.02`` (a stress setting: nearly every command is checked several times while DDP
buckets, FSDP2 all-gathers and colocated generation are in flight). ``--quick``: 10 steps per setup, stress
setting only.

Usage: ``python benchmarks/live_check_soak.py [--quick] [--setups embedded,colocated,fsdp2,vllm]
[--steps N] [--poll-s 1.0,0.02] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))

from _harness import write_json
from grpo_reverse import config as recipe_config

from rlsdk import Session, SessionConfig
from rlsdk.data import build_tiny_policy
from rlsdk.debug.watchdog import CollectiveHangError
from rlsdk.rewards import reverse_reward

STEPS = {"embedded": 2000, "colocated": 2000, "fsdp2": 500, "vllm": 200}


def vllm_missing() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed"
    proc = subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True, text=True, timeout=300)
    return None if proc.returncode == 0 else f"`import vllm` failed: {proc.stderr.strip().splitlines()[-1:]}"


def setup_config(setup: str, model_dir: Path, out: Path, poll_s: float) -> SessionConfig:
    cfg = recipe_config()
    cfg = dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, path=str(model_dir)),
        launch=dataclasses.replace(cfg.launch, trace_poll_s=poll_s),
        observe=dataclasses.replace(
            cfg.observe, output_dir=str(out), console=False, tensorboard=False, log_level="WARNING"
        ),
    )
    if setup == "colocated":
        cfg = dataclasses.replace(cfg, inference=dataclasses.replace(cfg.inference, engine="colocated"))
    elif setup == "fsdp2":
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, parallelism="fsdp2"))
    elif setup == "vllm":
        cfg = dataclasses.replace(cfg, inference=dataclasses.replace(cfg.inference, engine="vllm"))
    return cfg


async def run(config: SessionConfig, steps: int) -> dict[str, Any]:
    """``steps`` clean steps; the live checks' counts and any report they raised (a false report)."""
    false_reports: list[str] = []
    t0 = time.perf_counter()
    done = 0
    async with await Session.start(config) as session:
        for _ in range(steps):
            try:
                rollout = await session.reward(await session.rollout(), reverse_reward)
                await session.update(rollout)
                await session.sync_weights()
            except CollectiveHangError as error:  # on a clean run, a false report: record it, stop this run
                false_reports.append(str(error).splitlines()[0] + "\n" + str(error.report))
                break
            done += 1
        stats = dict(session._run.channel.poll_stats)
    return {"steps": done, "seconds": time.perf_counter() - t0, "poll_stats": stats, "false_reports": false_reports}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="10 steps per setup, stress setting: a smoke test")
    parser.add_argument("--setups", default="embedded,colocated,fsdp2,vllm", help="comma-separated setups")
    parser.add_argument("--steps", type=int, default=None, help="steps per setup (default: per setup, see above)")
    parser.add_argument("--poll-s", default=None, help="comma-separated launch.trace_poll_s values")
    parser.add_argument("--json", default=None, help="write the counts to this JSON file")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    setups = [name.strip() for name in args.setups.split(",") if name.strip()]
    unknown = sorted(set(setups) - set(STEPS))
    if unknown:
        parser.error(f"--setups: unknown {unknown}; allowed {sorted(STEPS)}")
    polls = [float(v) for v in (args.poll_s or ("0.02" if args.quick else "1.0,0.02")).split(",")]

    work = Path(tempfile.mkdtemp(prefix="rlsdk-live-soak-"))
    results: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    for setup in setups:
        reason = vllm_missing() if setup == "vllm" else None
        if reason is not None:
            skipped[setup] = reason
            print(f"{setup}: skipped ({reason})")
            continue
        model_dir = work / f"model-{setup}"
        build_tiny_policy(model_dir, seed=args.seed, **({"num_heads": 2} if setup == "vllm" else {}))
        steps = args.steps or (10 if args.quick else STEPS[setup])
        for poll_s in polls:
            key = f"{setup}@{poll_s:g}s"
            out = work / key.replace("@", "-")
            results[key] = asyncio.run(run(setup_config(setup, model_dir, out, poll_s), steps))
            row = results[key]
            print(
                f"{key:<22} {row['steps']:>5} steps in {row['seconds']:>6.0f} s  polls {row['poll_stats']['polls']:>6} "
                f"(unanswered {row['poll_stats']['unanswered']}), settled sightings "
                f"{row['poll_stats']['settled']}, false reports {row['poll_stats']['confirmed']}"
                f"{'' if not row['false_reports'] else ' + ' + str(len(row['false_reports'])) + ' raised'}"
            )
    false_total = sum(row["poll_stats"]["confirmed"] + len(row["false_reports"]) for row in results.values())
    write_json(
        args.json,
        {"runs": results, "skipped": skipped, "false_reports": false_total, "poll_s": polls, "quick": args.quick},
    )
    if false_total:
        print(f"FAILED: {false_total} false report(s)")
        sys.exit(1)


if __name__ == "__main__":
    main()
