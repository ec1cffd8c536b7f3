"""vLLM engine: weight-sync latency against memcpy bandwidth, and rollout throughput against a raw HTTP client.

1. Sync latency, update published -> engine verified: the trainer's weights are already in the published
   safetensors file (``/dev/shm``); the clock runs over ``VLLMEngine.load_weights`` (pause -> worker reads the
   file and ``reload_weights`` -> version -> prefix-cache reset -> resume -> ``weight_info`` check). Reported as
   achieved bytes/s (weight bytes / latency) against this machine's memcpy bandwidth measured in the same run
   (one large ``torch`` tensor copy). Target: >= 25%. The trainer's publish (``save_model`` to /dev/shm) is
   timed separately. Models: the tiny policy (head_dim 32) and, unless ``--quick``, a ~113M-parameter
   Qwen2-style model built locally with random init (hidden 768, 12 layers, 12 heads, MLP 3072).
2. Rollout tokens/s through the Session (``session.rollout()``: tokenise, one ``n``-sample request per prompt,
   tensors out) against a raw ``httpx`` client sending the same requests to the same server. Target: ratio
   >= 0.9. Interleaved repetitions (A B A B ...).

Needs the ``vllm`` extra. Usage: ``python benchmarks/vllm_sync.py [--quick] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import print_table, summarize, write_json

from rlsdk.data import build_tiny_policy

BIG = {"hidden_size": 768, "num_layers": 12, "num_heads": 12, "intermediate_size": 3072}


def memcpy_bandwidth(nbytes: int = 256 << 20, reps: int = 5) -> float:
    """Bytes/s of one large tensor copy (best of ``reps``): the host-memory ceiling for moving weights."""
    import torch

    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return nbytes / best


async def sync_latency(model_dir: Path, publish_dir: Path, reps: int) -> dict[str, object]:
    import torch
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM

    from rlsdk.engine.inference.vllm import VLLMEngine
    from rlsdk.engine.weights import state_dict_checksum

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    params = sum(p.numel() for p in model.parameters())
    start = time.perf_counter()
    engine = await VLLMEngine.start(str(model_dir), kv_cache_gib=1)
    start_s = time.perf_counter() - start
    publish: list[float] = []
    latency: list[float] = []
    parts: dict[str, list[float]] = {"pause_s": [], "read_s": [], "load_s": [], "checksum_s": []}
    nbytes = 0
    try:
        for version in range(1, reps + 1):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1e-3)
            path = publish_dir / f"v{version}.safetensors"
            t0 = time.perf_counter()
            save_model(model, str(path))
            checksum = state_dict_checksum(model.state_dict())
            publish.append(time.perf_counter() - t0)
            nbytes = path.stat().st_size
            t0 = time.perf_counter()
            info = await engine.load_weights(str(path), version)
            latency.append(time.perf_counter() - t0)
            for key, values in parts.items():
                values.append(float(engine.last_sync.get(key) or 0.0))
            if info.version != version or info.checksum != checksum:
                raise RuntimeError(f"sync v{version} not verified: {info}")
            path.unlink()
    finally:
        await engine.close()
    return {
        "parameters": params,
        "bytes": nbytes,
        "server_start_s": start_s,
        "publish_s": summarize(publish),
        "sync_s": summarize(latency),
        # Inside the sync: waiting for the pause, reading the file, vLLM's reload, and the checksum (which runs
        # alongside the reload; checksum_s is from the end of the read until both are done).
        "parts_median_s": {key: statistics.median(values) for key, values in parts.items()},
    }


async def rollout_throughput(model_dir: Path, out: Path, reps: int) -> dict[str, object]:
    import httpx

    from rlsdk import Session
    from rlsdk.config import (
        DataConfig,
        InferenceConfig,
        LaunchConfig,
        ModelConfig,
        ObserveConfig,
        RolloutConfig,
        SessionConfig,
    )

    config = SessionConfig(
        model=ModelConfig(path=str(model_dir)),
        launch=LaunchConfig(num_ranks=2),
        inference=InferenceConfig(engine="vllm"),
        rollout=RolloutConfig(group_size=16, max_new_tokens=16),
        data=DataConfig(prompts_per_step=16, num_examples=4096),
        observe=ObserveConfig(output_dir=str(out), console=False, tensorboard=False, log_level="WARNING"),
    )
    session_tps: list[float] = []
    raw_tps: list[float] = []
    async with await Session.start(config) as session:
        url = session.engine.url
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:

            async def raw(prompts: list[list[int]], seed: int) -> int:
                async def one(index: int, ids: list[int]) -> int:
                    sampling = {"n": 16, "max_tokens": 16, "temperature": 1.0, "logprobs": 0, "seed": seed + index}
                    response = await client.post(
                        "/inference/v1/generate",
                        json={"model": "policy", "token_ids": ids, "sampling_params": sampling},
                    )
                    response.raise_for_status()
                    return sum(len(c["token_ids"]) for c in response.json()["choices"])

                counts = await asyncio.gather(*(one(16 * i, ids) for i, ids in enumerate(prompts)))
                return sum(counts)

            await session.rollout()  # warm-up
            for rep in range(reps):
                rows = session.next_prompts()
                t0 = time.perf_counter()
                rollout = await session.rollout(rows)
                session_tps.append(float(rollout.completion_mask_B_C.sum()) / (time.perf_counter() - t0))
                prompts = [list(session.tokenizer(row["prompt"])["input_ids"]) for row in rows]
                t0 = time.perf_counter()
                tokens = await raw(prompts, seed=rep)
                raw_tps.append(tokens / (time.perf_counter() - t0))
    return {"session_tokens_per_s": summarize(session_tps), "raw_tokens_per_s": summarize(raw_tps)}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model only, fewer repetitions")
    parser.add_argument("--json", default=None, help="also write the results as JSON to this path")
    args = parser.parse_args()
    reps = 3 if args.quick else 10
    root = Path(tempfile.mkdtemp(prefix="rlsdk-bench-vllm-"))
    publish_dir = Path(
        tempfile.mkdtemp(prefix="rlsdk-bench-weights-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    )
    memcpy = memcpy_bandwidth()
    print(f"memcpy bandwidth: {memcpy / 1e9:.2f} GB/s")
    models = {"tiny (head_dim 32)": build_tiny_policy(root / "tiny", seed=0, num_heads=2)}
    if not args.quick:
        models["~113M random init"] = build_tiny_policy(root / "big", seed=0, **BIG)
    results: dict[str, object] = {"memcpy_bytes_per_s": memcpy, "sync": {}}
    rows = []
    for name, model_dir in models.items():
        result = await sync_latency(model_dir, publish_dir, reps)
        results["sync"][name] = result  # type: ignore[index]
        median = result["sync_s"]["median"]  # type: ignore[index]
        achieved = result["bytes"] / median  # type: ignore[operator]
        result["achieved_bytes_per_s"] = achieved
        result["fraction_of_memcpy"] = achieved / memcpy
        print(
            f"{name}: {result['parameters'] / 1e6:.1f}M params, {result['bytes'] / 1e6:.1f} MB; server start "
            f"{result['server_start_s']:.1f} s; publish {result['publish_s']['median'] * 1e3:.1f} ms; "  # type: ignore[index]
            f"sync {median * 1e3:.1f} ms = {achieved / 1e9:.3f} GB/s = {achieved / memcpy:.1%} of memcpy"
        )
        print(
            "  inside the sync (median ms): "
            + ", ".join(
                f"{key[:-2]} {value * 1e3:.1f}"
                for key, value in result["parts_median_s"].items()  # type: ignore[union-attr]
            )
        )
        rows.append({"name": f"sync {name}", **{k: v * 1e3 for k, v in result["sync_s"].items() if k != "n"}})  # type: ignore[union-attr]
    print_table("sync latency (published -> verified)", rows, "ms")
    throughput = await rollout_throughput(models["tiny (head_dim 32)"], root / "session", reps)
    results["rollout"] = throughput
    session_median = throughput["session_tokens_per_s"]["median"]  # type: ignore[index]
    raw_median = throughput["raw_tokens_per_s"]["median"]  # type: ignore[index]
    throughput["ratio"] = session_median / raw_median
    print_table(
        "rollout throughput, 16 prompts x 16 samples x <=16 tokens (tiny model)",
        [
            {"name": "raw httpx client", **{k: v for k, v in throughput["raw_tokens_per_s"].items() if k != "n"}},  # type: ignore[union-attr]
            {
                "name": "Session.rollout()",
                **{k: v for k, v in throughput["session_tokens_per_s"].items() if k != "n"},  # type: ignore[union-attr]
                "ratio": session_median / raw_median,
            },
        ],
        "tok/s",
    )
    write_json(args.json, results)


if __name__ == "__main__":
    asyncio.run(main())
