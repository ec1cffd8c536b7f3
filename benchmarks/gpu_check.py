"""The prepared device check: what rlsdk does on one CUDA GPU, in one unattended run of under 8 minutes.

Run once on a fresh CUDA machine after ``make gpu-setup`` (``make gpu-check`` does both); it writes one JSON:

- ``device``: the GPU, its memory, torch's CUDA version, the packages' versions;
- ``gemm``: the card's measured bf16 GEMM rate (the MFU denominator);
- ``session_tiny``: a Session with 1 CUDA rank and vLLM on the same GPU (the default recipe's toy policy): start,
  rollout, update, a verified sync;
- ``s2``: the shape ladder's S2 (the Qwen2.5-0.5B shape, random init, nothing downloaded; ``benchmarks/shapes.py``)
  on the same layout for a few steps: rollout tokens/s through the Session over a raw client of the same vLLM
  server, update tokens/s and MFU, verified weight-sync seconds and bytes/s;
- ``gpu_tests``: ``pytest -m gpu`` (tests/gpu; the NCCL tracer fault case and the NCCL weight sync need 2 GPUs and
  report their skip reason on one).

Each part records its error instead of ending the run, and a part that would start past ``--budget-s`` is recorded
as skipped. On a machine where torch sees no CUDA device it exits at once (status 2), saying so, and writes nothing.

Usage: ``python benchmarks/gpu_check.py [--json PATH] [--steps N] [--budget-s S]``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

ROOT = Path(__file__).resolve().parents[1]
NO_CUDA_EXIT = 2


def no_cuda_message() -> str | None:
    """Why this machine cannot run the check (None: it can)."""
    import torch

    if torch.cuda.is_available():
        return None
    build = torch.version.cuda or "none (a CPU build)"
    return (
        f"gpu_check: no CUDA device present: torch.cuda.is_available() is False (torch {torch.__version__}, CUDA "
        f"build {build}). Run it on a machine with an NVIDIA GPU after `make gpu-setup` (docs/howto/gpu.md)."
    )


def device_info() -> dict[str, Any]:
    import torch

    props = torch.cuda.get_device_properties(0)
    return {
        "name": props.name,
        "count": torch.cuda.device_count(),
        "memory_gib": props.total_memory / 2**30,
        "capability": f"{props.major}.{props.minor}",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
    }


def gemm_rate_bf16(n: int = 8192, seconds: float = 3.0) -> float:
    """FLOP/s of a bf16 ``[n, n] @ [n, n]`` on GPU 0 (median over timed repetitions, each synchronised)."""
    import torch

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    samples: list[float] = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(samples) < 5:
        start = time.perf_counter()
        a @ b
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    del a, b
    torch.cuda.empty_cache()
    return 2.0 * n**3 / statistics.median(samples)


def cuda_config(config: Any) -> Any:
    """``config`` on one CUDA rank beside a vLLM server that shares its GPU (the one-GPU layout)."""
    launch = dataclasses.replace(config.launch, num_ranks=1, device="cuda", gpus_per_node=0)
    inference = dataclasses.replace(config.inference, engine="vllm")
    return dataclasses.replace(config, launch=launch, inference=inference)


async def session_tiny(out: Path) -> dict[str, Any]:
    from rlsdk import Session
    from rlsdk.config import DataConfig, ModelConfig, ObserveConfig, RolloutConfig, SessionConfig, TrainConfig
    from rlsdk.data import build_tiny_policy
    from rlsdk.rewards import reverse_reward

    model = build_tiny_policy(out / "tiny", seed=0)
    config = cuda_config(
        SessionConfig(
            model=ModelConfig(path=str(model)),
            train=TrainConfig(lr=1e-3, micro_batch_size=16),
            rollout=RolloutConfig(group_size=8, max_new_tokens=5),
            data=DataConfig(prompts_per_step=8, num_examples=256),
            observe=ObserveConfig(output_dir=str(out / "tiny-run"), console=False, tensorboard=False),
        )
    )
    t0 = time.perf_counter()
    async with await Session.start(config) as session:
        start_s = time.perf_counter() - t0
        plan = session._run.device_plan
        steps = []
        for _ in range(3):
            t = time.perf_counter()
            stats = await session.update(await session.reward(await session.rollout(), reverse_reward))
            info = await session.sync_weights()
            steps.append({"seconds": time.perf_counter() - t, "version": info.version, "loss": stats["train/loss"]})
        # one level-1 sleep per update on a shared card (VLLMEngine.prepare_train), each woken by the next call
        sleeps = getattr(session._engine(), "sleeps", None)
        transfer = getattr(getattr(session._engine(), "transfer", None), "name", None)
    return {
        "vllm_sleeps_around_updates": sleeps,
        "weight_transfer": transfer,  # 'ipc' on a shared card (CUDA IPC handle of rank 0's packed weights)
        "start_s": start_s,
        "device": plan.device,
        "rank_gpus": list(plan.rank_gpus),
        "server_gpus": list(plan.server_gpus),
        "shares_gpu": plan.shares_gpu,
        "steps": steps,
    }


async def s2_run(out: Path, steps: int, gemm: float | None) -> dict[str, Any]:
    import shapes

    from rlsdk import Session

    shape = shapes.SHAPES["S2"]
    models = out / "models"
    model_dir = shapes.build_model(shape, models)
    prompts = shapes.build_prompts(shape, model_dir, models)
    run = shapes.Run("S2", "ddp", "vllm", "bf16")
    config = cuda_config(shapes.session_config(run, shape, model_dir, prompts, out / "s2-run"))
    weight_bytes = 4 * shape.parameters()  # the float32 weights a sync sends (model.dtype float32, tied head once)
    records: list[dict[str, Any]] = []
    async with await Session.start(config) as session, session.engine.server.client(timeout=3600) as client:

        async def raw(rows: list[dict[str, Any]], seed: int) -> int:
            async def one(index: int, ids: list[int]) -> int:
                sampling = {
                    "n": shape.samples,
                    "max_tokens": shape.completion_tokens,
                    "temperature": 1.0,
                    "logprobs": 0,
                    "seed": seed + index,
                }
                response = await client.post(
                    "/inference/v1/generate", json={"model": "policy", "token_ids": ids, "sampling_params": sampling}
                )
                response.raise_for_status()
                return sum(len(c["token_ids"]) for c in response.json()["choices"])

            ids = [list(session.tokenizer(row["prompt"])["input_ids"]) for row in rows]
            return sum(await asyncio.gather(*(one(i * shape.samples, row) for i, row in enumerate(ids))))

        for index in range(steps + 1):  # the first step warms up (kernels, allocator, vLLM's first requests)
            rows = session.next_prompts()
            t = time.perf_counter()
            rollout = await session.reward(await session.rollout(rows), shapes.whitespace_reward)
            rollout_s = time.perf_counter() - t
            t = time.perf_counter()
            raw_tokens = await raw(rows, seed=index)
            raw_s = time.perf_counter() - t
            t = time.perf_counter()
            await session.update(rollout)
            update_s = time.perf_counter() - t
            t = time.perf_counter()
            info = await session.sync_weights()
            sync_s = time.perf_counter() - t
            prompt_lengths = rollout.prompt_mask_B_P.long().sum(dim=1).tolist()
            completion_lengths = rollout.completion_mask_B_C.long().sum(dim=1).tolist()
            completion_tokens = sum(completion_lengths)
            flops = shapes.update_flops(
                shape,
                sum(prompt_lengths[:: shape.samples]),
                completion_tokens,
                list(zip(prompt_lengths, completion_lengths)),
            )
            records.append(
                {
                    "warmup": index == 0,
                    "rollout_tokens_per_s": completion_tokens / rollout_s,
                    "raw_vllm_tokens_per_s": raw_tokens / raw_s,
                    "update_s": update_s,
                    "update_tokens_per_s": (sum(prompt_lengths) + completion_tokens) / update_s,
                    "update_mfu": None if not gemm else flops / update_s / gemm,
                    "sync_s": sync_s,
                    "sync_bytes_per_s": weight_bytes / sync_s,
                    "version": info.version,
                }
            )
            print(f"  S2 step {index}: " + ", ".join(f"{k} {v:.3g}" for k, v in records[-1].items() if v), flush=True)
        transfer = getattr(session.engine.transfer, "name", None)
    timed = [r for r in records if not r["warmup"]] or records
    medians = {
        key: statistics.median(r[key] for r in timed)
        for key in records[0]
        if key not in ("warmup", "version") and records[0][key] is not None
    }
    medians["rollout_over_raw_vllm"] = medians["rollout_tokens_per_s"] / medians["raw_vllm_tokens_per_s"]
    return {
        "parameters": shape.parameters(),
        "weight_bytes": weight_bytes,
        "weight_transfer": transfer,
        "steps": records,
        "median": medians,
    }


def gpu_tests(out: Path) -> dict[str, Any]:
    """``pytest -m gpu`` over tests/gpu (and every other gpu-marked test): each test's outcome and skip reason."""
    report = out / "gpu-tests.xml"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", f"--junitxml={report}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    outcomes: dict[str, str] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        child = next(iter(case), None)
        if child is None:
            outcomes[name] = "passed"
        else:
            outcomes[name] = f"{child.tag}: {child.get('message', '')}"[:300]
    return {"exit_code": proc.returncode, "tests": outcomes, "tail": proc.stdout[-2000:]}


def run_part(results: dict[str, Any], name: str, deadline: float, estimate_s: float, fn: Callable[[], Any]) -> Any:
    """Run one part, recording its result, its error, or why it was skipped; the others run either way."""
    left = deadline - time.monotonic()
    if left < estimate_s:
        results[name] = {"skipped": f"{left:.0f} s of the budget left, the part needs about {estimate_s:.0f} s"}
        return None
    print(f"== {name}", flush=True)
    t = time.perf_counter()
    try:
        value = fn()
    except Exception as exc:
        results[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]}
        return None
    results[name] = {"seconds": time.perf_counter() - t, **(value if isinstance(value, dict) else {"value": value})}
    return value


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None, help="write the results as JSON to this path")
    parser.add_argument("--steps", type=int, default=3, help="timed S2 steps (after one warm-up step)")
    parser.add_argument("--budget-s", type=float, default=450.0, help="start no part past this many seconds")
    args = parser.parse_args()
    message = no_cuda_message()
    if message is not None:
        print(message, file=sys.stderr)
        return NO_CUDA_EXIT
    from _harness import write_json

    deadline = time.monotonic() + args.budget_s
    results: dict[str, Any] = {"device": device_info()}
    with tempfile.TemporaryDirectory(prefix="rlsdk-gpu-check-") as tmp:
        out = Path(tmp)
        gemm = run_part(results, "gemm", deadline, 10, lambda: {"bf16_flop_per_s": gemm_rate_bf16()})
        rate = gemm["bf16_flop_per_s"] if gemm else None
        run_part(results, "session_tiny", deadline, 90, lambda: asyncio.run(session_tiny(out)))
        run_part(results, "s2", deadline, 200, lambda: asyncio.run(s2_run(out, args.steps, rate)))
        run_part(results, "gpu_tests", deadline, 120, lambda: gpu_tests(out))
    write_json(args.json, results)
    failed = [name for name, part in results.items() if isinstance(part, dict) and "error" in part]
    if failed:
        print(f"FAILED parts: {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
