"""Session overhead against its floors, measured side by side in one run.

1. Per-step time of the default recipe's step through a Session (rollout -> reward -> update -> sync on 2
   background ranks) against the bare single-process GRPO loop (``bare_grpo.run_bare``) on the same task, model
   init, batch (16 prompts x 16 samples) and seed. Target: ratio <= 1.5.
2. No-op command round trip through the Session's control channel to 2 and 4 ranks against a raw pyzmq
   ROUTER/DEALER round trip to the same number of peer processes. Target: ratio <= 3.
3. ``Session.start`` and ``Session.close`` of the default recipe's config (2 ranks, embedded engine), each phase
   (``Session.start_seconds`` / ``close_seconds``: pre-start checks, launcher, the ranks' imports, process group,
   train engine, the overlapped engine load; ranks' exit). Targets: ready <= 5 s, close <= 1 s (medians).
4. The start's floor on this machine, interleaved with 3: what any start through ``accelerate launch`` and a
   transformers model pays before rlsdk's own work, measured as fresh processes: the launcher's interpreter and
   imports (``accelerate.commands.launch``, which imports torch) followed by, concurrently for each rank, an
   interpreter importing what a rank imports (torch, accelerate, the worker) and loading the policy with
   ``AutoModelForCausalLM.from_pretrained``. ``ready / floor`` says how much of the start is rlsdk's.

``--quick`` (a smoke test, not a measurement): 1 repetition of 5 steps, the no-op round trip to 2 ranks only, one
start/close.

Systems run interleaved (A B A B ...); each repetition starts from the same initial weights. Thread settings:
the bare loop uses all cores (``torch.set_num_threads(os.cpu_count())``); the Session gives each rank 1 thread
and the embedded engine the process default. Quote the ratios, not the absolute times (shared, noisy machine).

Usage: ``python benchmarks/session_overhead.py [--quick] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import print_table, summarize, write_json
from _zmq_raw import raw_roundtrip_us
from bare_grpo import run_bare

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
from rlsdk.rewards import reverse_reward


def session_config(model_dir: Path, out: Path, num_ranks: int, seed: int) -> SessionConfig:
    return SessionConfig(
        model=ModelConfig(path=str(model_dir)),
        launch=LaunchConfig(num_ranks=num_ranks),
        train=TrainConfig(lr=1e-3, micro_batch_size=256),
        rollout=RolloutConfig(group_size=16, max_new_tokens=5),
        data=DataConfig(prompts_per_step=16, num_examples=4096),
        observe=ObserveConfig(output_dir=str(out), console=False, tensorboard=False, log_level="WARNING"),
        seed=seed,
    )


async def session_steps(config: SessionConfig, steps: int) -> list[float]:
    times: list[float] = []
    async with await Session.start(config) as session:
        for _ in range(steps):
            start = time.perf_counter()
            rollout = await session.rollout()
            rollout = await session.reward(rollout, reverse_reward)
            await session.update(rollout)
            await session.sync_weights()
            times.append(time.perf_counter() - start)
    return times


async def session_noop_us(config: SessionConfig, iterations: int, reps: int, raw_iterations: int) -> tuple:
    """Interleave: raw pyzmq round trips, then the Session's no-op, per repetition (the Session stays up)."""
    raw: list[float] = []
    ours: list[float] = []
    async with await Session.start(config) as session:
        for _ in range(10):
            await session.call("noop")
        for _ in range(reps):
            raw_us = await asyncio.to_thread(raw_roundtrip_us, config.launch.num_ranks, raw_iterations)
            raw.append(statistics.median(raw_us))
            samples = []
            for _ in range(iterations):
                start = time.perf_counter()
                await session.call("noop")
                samples.append((time.perf_counter() - start) * 1e6)
            ours.append(statistics.median(samples))
    return raw, ours


# Each leaves with os._exit, as rlsdk's launcher and ranks do: the interpreter's teardown of torch is not start-up.
LAUNCHER_IMPORTS = "import os, accelerate.commands.launch\nos._exit(0)"
RANK_IMPORTS = (
    "import os, sys, rlsdk.worker.main, accelerate\n"
    "from transformers import AutoModelForCausalLM\n"
    "AutoModelForCausalLM.from_pretrained(sys.argv[1])\n"
    "os._exit(0)"
)


def import_floor_seconds(model_dir: Path, num_ranks: int) -> dict[str, float]:
    """The launcher's imports, then ``num_ranks`` concurrent rank-like interpreters (wall seconds, fresh
    processes): the part of ``Session.start`` that belongs to Python, torch, accelerate and transformers."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    began = time.perf_counter()
    subprocess.run([sys.executable, "-c", LAUNCHER_IMPORTS], check=True, env=env)
    launcher = time.perf_counter() - began
    began = time.perf_counter()
    ranks = [
        subprocess.Popen([sys.executable, "-c", RANK_IMPORTS, str(model_dir)], env=env, stderr=subprocess.DEVNULL)
        for _ in range(num_ranks)
    ]
    if any(process.wait() != 0 for process in ranks):
        raise RuntimeError("a rank-like interpreter failed: run it by hand to see why")
    rank = time.perf_counter() - began
    return {"launcher_imports": launcher, "rank_imports_and_load": rank, "floor": launcher + rank}


async def start_close_seconds(config: SessionConfig) -> tuple[dict[str, float], dict[str, float]]:
    """One Session.start then close, with their phases (seconds)."""
    session = await Session.start(config)
    await session.close()
    return dict(session.start_seconds), dict(session.close_seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="few repetitions: a smoke test, not a measurement")
    parser.add_argument("--json", default=None, help="write all figures to this JSON file")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    # --quick: one repetition, one Session per measurement, 2 ranks only (a CI smoke test of ~1 minute).
    reps, steps, warmup = (1, 5, 1) if args.quick else (5, 40, 5)
    noop_iters, noop_reps, noop_ranks = (100, 1, (2,)) if args.quick else (1000, 5, (2, 4))

    work = Path(tempfile.mkdtemp(prefix="rlsdk-bench-"))
    model_dir = build_tiny_policy(work / "model", seed=args.seed)
    bare_step: list[float] = []
    session_step: list[float] = []
    for rep in range(reps):
        history = run_bare(model_dir, steps=steps, seed=args.seed, num_threads=os.cpu_count())
        bare_step.append(statistics.median(m["step_time_s"] for m in history[warmup:]))
        config = session_config(model_dir, work / f"session-{rep}", 2, args.seed)
        times = asyncio.run(session_steps(config, steps))
        session_step.append(statistics.median(times[warmup:]))
        print(f"rep {rep}: bare {bare_step[-1] * 1e3:.1f} ms/step, session {session_step[-1] * 1e3:.1f} ms/step")

    bare, ours = summarize([t * 1e3 for t in bare_step]), summarize([t * 1e3 for t in session_step])
    step_ratio = ours["median"] / bare["median"]
    print_table(
        "per-step time, 16 prompts x 16 samples (median of per-repetition medians)",
        [
            {"name": "bare single-process GRPO loop", **bare},
            {"name": "Session, 2 ranks (rollout+reward+update+sync)", **ours, "ratio": step_ratio},
        ],
        "ms",
    )

    noop: dict[str, dict] = {}
    rows = []
    for ranks in noop_ranks:
        config = session_config(model_dir, work / f"noop-{ranks}", ranks, args.seed)
        raw, session = asyncio.run(session_noop_us(config, noop_iters, noop_reps, noop_iters))
        raw_s, session_s = summarize(raw), summarize(session)
        ratio = session_s["median"] / raw_s["median"]
        noop[str(ranks)] = {"raw_pyzmq_us": raw_s, "session_noop_us": session_s, "ratio": ratio}
        rows += [
            {"name": f"raw pyzmq ROUTER/DEALER, {ranks} peers", **raw_s},
            {"name": f"Session.call('noop'), {ranks} ranks", **session_s, "ratio": ratio},
        ]
    print_table("no-op command round trip", rows, "us")
    starts: dict[str, list[float]] = {}
    closes: dict[str, list[float]] = {}
    floors: dict[str, list[float]] = {}
    for rep in range(reps):
        config = session_config(model_dir, work / f"start-{rep}", 2, args.seed)
        started, closed = asyncio.run(start_close_seconds(config))
        for name, value in import_floor_seconds(model_dir, config.launch.num_ranks).items():
            floors.setdefault(name, []).append(value)
        for name, value in started.items():
            starts.setdefault(name, []).append(value)
        for name, value in closed.items():
            closes.setdefault(name, []).append(value)
    start_phases = {name: summarize(values) for name, values in starts.items()}
    close_phases = {name: summarize(values) for name, values in closes.items()}
    floor = {name: summarize(values) for name, values in floors.items()}
    # Paired per repetition: each start against the floor measured right after it.
    over_floor = summarize([total / low for total, low in zip(starts["total"], floors["floor"])])
    print_table("Session.start phases (s)", [{"name": k, **v} for k, v in start_phases.items()], "s")
    print_table("Session.close phases (s)", [{"name": k, **v} for k, v in close_phases.items()], "s")
    print_table(
        "start floor: fresh interpreters' imports and model load (s)", [{"name": k, **v} for k, v in floor.items()], "s"
    )
    ready, close = start_phases["total"]["median"], close_phases["total"]["median"]
    noop_ratios = " / ".join(f"{entry['ratio']:.2f} @{ranks}" for ranks, entry in noop.items())
    print(
        f"\ntargets: step-time ratio {step_ratio:.2f} (<= 1.5), no-op ratio {noop_ratios} ranks (<= 3), "
        f"ready {ready:.1f} s (<= 5; floor {floor['floor']['median']:.1f} s, ready/floor "
        f"{over_floor['median']:.2f}), close {close:.2f} s (<= 1)"
    )
    write_json(
        args.json,
        {
            "benchmark": "session_overhead",
            "quick": args.quick,
            "threads": {"bare": os.cpu_count(), "session_rank": 1, "session_engine": "process default"},
            "step_ms": {"bare": bare, "session": ours, "ratio": step_ratio, "steps": steps, "warmup": warmup},
            "noop": noop,
            "start_s": {
                "phases": start_phases,
                "ready_median": ready,
                "target": 5.0,
                "floor": floor,
                "ready_over_floor": over_floor,
            },
            "close_s": {"phases": close_phases, "close_median": close, "target": 1.0},
        },
    )


if __name__ == "__main__":
    main()
