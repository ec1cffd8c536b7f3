"""vLLM engine: weight-sync latency against memcpy bandwidth, and rollout throughput against a raw HTTP client.

1. Sync latency, update published -> engine verified, for both CPU transfers side by side, each on its own server:
   ``reload`` (:class:`FileWeightTransfer`: the worker reads the file and calls vLLM's ``reload_weights``, which
   re-runs ``process_weights_after_loading`` and repacks every linear weight into oneDNN form) and ``inplace``
   (:class:`InPlaceWeightTransfer`: a server whose linear layers keep plain weights; the worker copies the file into
   the served parameters through the model's ``load_weights``). The trainer's weights are already in the published
   safetensors file (``/dev/shm``, published as ``TrainEngine.export_weights`` does: from the second version on the
   previous file is rewritten in place, which the in-place server keeps mapped); the clock runs over
   ``VLLMEngine.load_weights`` (pause -> transfer, with the checksum on a second thread and the prefix-cache reset
   alongside -> version -> resume -> ``weight_info`` check). Reported as achieved bytes/s (weight bytes / latency)
   against this machine's memcpy bandwidth measured in the same run (one large ``torch`` tensor copy). Target: >=
   25%. The trainer's publish (``save_model`` to /dev/shm + checksum) is timed separately; the checksum's own cost
   (BLAKE3 as used, and the former SHA-256) is measured on each model's state dict. Each server's generation speed
   (tokens/s, plain ``F.linear`` vs oneDNN packed weights) is measured too. Models: the tiny policy (head_dim 32)
   and, unless ``--quick``, a ~113M-parameter Qwen2-style model built locally with random init (hidden 768, 12
   layers, 12 heads, MLP 3072).
2. Rollout tokens/s through the Session (``session.rollout()``: tokenise, one ``n``-sample request per prompt,
   tensors out) against a raw ``httpx`` client sending the same requests to the same server. Target: ratio
   >= 0.9. Interleaved repetitions (A B A B ...).

Needs the ``vllm`` extra. Usage: ``python benchmarks/vllm_sync.py [--quick] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import print_table, summarize, write_json

from rlsdk.data import build_tiny_policy
from rlsdk.engine.publish_dir import PublishDir

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


def hash_bandwidth(state_dict: dict[str, object], reps: int = 3) -> dict[str, float]:
    """Bytes/s of ``state_dict_checksum`` (best of ``reps``) with XXH3-128 (as used), BLAKE3 and SHA-256 (before)."""
    from rlsdk.engine.weights import state_dict_checksum

    nbytes = sum(t.numel() * t.element_size() for t in state_dict.values())  # type: ignore[attr-defined]
    found = {}
    for algorithm in ("xxh3", "blake3", "sha256"):
        best = float("inf")
        for _ in range(reps):
            start = time.perf_counter()
            state_dict_checksum(state_dict, algorithm)  # type: ignore[arg-type]
            best = min(best, time.perf_counter() - start)
        found[f"{algorithm}_bytes_per_s"] = nbytes / best
    return found


async def generation_speed(engine: object, vocab: int, reps: int = 3) -> float:
    """Median tokens/s of 8 prompts x 8 samples x 16 tokens (temperature 1, fixed seeds) on ``engine``."""
    from rlsdk.engine.inference.protocol import SamplingParams

    prompts = [[(3 * i + j) % vocab for j in range(6)] for i in range(8) for _ in range(8)]
    params = SamplingParams(max_new_tokens=16, temperature=1.0, seed=0)
    await engine.generate(prompts, params)  # type: ignore[attr-defined]  # warm-up
    rates = []
    for _ in range(reps):
        start = time.perf_counter()
        result = await engine.generate(prompts, params)  # type: ignore[attr-defined]
        rates.append(float(result.completion_mask_B_C.sum()) / (time.perf_counter() - start))
    return statistics.median(rates)


async def sync_latency(model_dir: Path, publish_dir: Path, reps: int, method: str) -> dict[str, object]:
    """Sync latency through ``method``'s transfer ("reload" or "inplace") on a server started for it."""
    import torch
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM

    from rlsdk.engine.inference.inplace_transfer import InPlaceWeightTransfer
    from rlsdk.engine.inference.vllm import VLLMEngine
    from rlsdk.engine.inference.weight_transfer import FileWeightTransfer
    from rlsdk.engine.train.engine import publish_safetensors
    from rlsdk.engine.weights import state_dict_checksum

    transfer = InPlaceWeightTransfer() if method == "inplace" else FileWeightTransfer()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    params = sum(p.numel() for p in model.parameters())
    start = time.perf_counter()
    engine = await VLLMEngine.start(str(model_dir), kv_cache_gib=1, transfer=transfer)
    start_s = time.perf_counter() - start
    publish: list[float] = []
    latency: list[float] = []
    keys = ("pause_s", "transfer_s", "read_s", "load_s", "checksum_s", "version_s", "resume_s", "verify_s")
    parts: dict[str, list[float]] = {key: [] for key in keys}
    nbytes = 0
    try:
        tokens_per_s = await generation_speed(engine, model.config.vocab_size)
        for version in range(1, reps + 1):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1e-3)
            t0 = time.perf_counter()
            # As TrainEngine.export_weights: the previous version's file rewritten in place, or a new file.
            state_dict = model.state_dict()
            path = Path(publish_safetensors(state_dict, str(publish_dir), version, lambda tmp: save_model(model, tmp)))
            checksum = state_dict_checksum(state_dict)
            publish.append(time.perf_counter() - t0)
            nbytes = path.stat().st_size
            t0 = time.perf_counter()
            info = await engine.load_weights(str(path), version)
            latency.append(time.perf_counter() - t0)
            for key, values in parts.items():
                values.append(float(engine.last_sync.get(key) or 0.0))
            if info.version != version or info.checksum != checksum:
                raise RuntimeError(f"sync v{version} not verified: {info}")
            if bool(engine.last_sync.get("inplace")) != (method == "inplace"):
                raise RuntimeError(f"{method} sync of v{version} took another path: {engine.last_sync}")
        tokens_per_s_after = await generation_speed(engine, model.config.vocab_size)
    finally:
        await engine.close()
        for leftover in publish_dir.glob("v*.safetensors"):
            leftover.unlink()
    return {
        "method": method,
        "parameters": params,
        "bytes": nbytes,
        "server_start_s": start_s,
        "publish_s": summarize(publish),
        "sync_s": summarize(latency),
        # Inside the sync: waiting for the pause; the transfer (RPC round trip included; the prefix-cache reset
        # runs alongside), within it opening the file, vLLM's reload or the in-place copy, and the checksum
        # (which runs alongside the load; checksum_s is from the end of the read until both are done); then the
        # version, resume, read-back.
        "parts_median_s": {key: statistics.median(values) for key, values in parts.items()},
        "generate_tokens_per_s": tokens_per_s,
        "generate_tokens_per_s_after_syncs": tokens_per_s_after,
        "hash": hash_bandwidth(model.state_dict()),
    }


async def rollout_throughput(model_dir: Path, out: Path, reps: int) -> dict[str, object]:
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
    # The raw client uses the engine's socket and token (the server listens on a Unix socket, requires its token).
    async with await Session.start(config) as session, session.engine.server.client(timeout=600) as client:

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
    publish = PublishDir()  # removed below; swept by the next run or Session if this process is killed
    publish_dir = Path(publish.path)
    try:
        memcpy = memcpy_bandwidth()
        print(f"memcpy bandwidth: {memcpy / 1e9:.2f} GB/s")
        models = {"tiny (head_dim 32)": build_tiny_policy(root / "tiny", seed=0, num_heads=2)}
        if not args.quick:
            models["~113M random init"] = build_tiny_policy(root / "big", seed=0, **BIG)
        results: dict[str, object] = {"benchmark": "vllm_sync", "quick": args.quick}
        results.update({"memcpy_bytes_per_s": memcpy, "sync": {}})
        rows = []
        for name, model_dir in models.items():
            for method in ("reload", "inplace"):
                result = await sync_latency(model_dir, publish_dir, reps, method)
                results["sync"][f"{name} / {method}"] = result  # type: ignore[index]
                median = result["sync_s"]["median"]  # type: ignore[index]
                achieved = result["bytes"] / median  # type: ignore[operator]
                result["achieved_bytes_per_s"] = achieved
                result["fraction_of_memcpy"] = achieved / memcpy
                hashes = result["hash"]
                print(
                    f"{name} / {method}: {result['parameters'] / 1e6:.1f}M params, {result['bytes'] / 1e6:.1f} MB; "
                    f"server start {result['server_start_s']:.1f} s; publish "
                    f"{result['publish_s']['median'] * 1e3:.1f} ms; sync {median * 1e3:.1f} ms = "  # type: ignore[index]
                    f"{achieved / 1e9:.3f} GB/s = {achieved / memcpy:.1%} of memcpy"
                )
                print(
                    "  inside the sync (median ms): "
                    + ", ".join(
                        f"{key[:-2]} {value * 1e3:.1f}"
                        for key, value in result["parts_median_s"].items()  # type: ignore[union-attr]
                    )
                    + f"; hash xxh3 {hashes['xxh3_bytes_per_s'] / 1e9:.2f} GB/s, "  # type: ignore[index]
                    f"blake3 {hashes['blake3_bytes_per_s'] / 1e9:.2f} GB/s, sha256 "  # type: ignore[index]
                    f"{hashes['sha256_bytes_per_s'] / 1e9:.2f} GB/s; generate "  # type: ignore[index]
                    f"{result['generate_tokens_per_s']:.0f} tok/s (after syncs "
                    f"{result['generate_tokens_per_s_after_syncs']:.0f})"
                )
                rows.append(
                    {
                        "name": f"sync {name} / {method}",
                        **{k: v * 1e3 for k, v in result["sync_s"].items() if k != "n"},  # type: ignore[union-attr]
                        "of memcpy": achieved / memcpy,
                    }
                )
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
    finally:
        publish.remove()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main())
