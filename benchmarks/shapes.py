"""Shape ladder: the whole stack at real shapes, against this machine's own limits.

Shapes (``SHAPES``; S1/S2 built by :mod:`rlsdk.data.shapes`, random init, nothing downloaded):

- S0: today's toy, the default recipe's policy (~133k parameters, 16-token vocabulary), 16 prompts x 16 samples,
  5 new tokens, the reverse task;
- S1: a ~25M-parameter Qwen2 shape (hidden 384, 6 layers, 6/2 heads, intermediate 1,536) with a 32k byte-level
  BPE tokenizer trained here on the Python standard library's source; prompts of 64 tokens (windows of that
  source), completions of up to 256, 8 prompts x 8 samples;
- S2: the Qwen2.5-0.5B shape (hidden 896, 24 layers, 14/2 heads, intermediate 4,864, vocabulary 151,936, tied),
  prompts of 128 tokens, completions of up to 256, 4 prompts x 4 samples; micro-batches of 1,536 tokens (one
  group: a prompt and its 4 completions), and FSDP2 keeps the decoder layers gathered from forward to backward
  (``train.fsdp_reshard_after_forward=False``: one all-gather per layer and micro-batch instead of two, for
  ~0.7 GB more per rank), except with vLLM: its server stays resident through the update and leaves no room for
  the kept layers on a 24 GiB machine.

Each run is a real Session in a fresh subprocess (2 train ranks, 1 torch thread each; the embedded engine with 2
threads in the controller, or a vLLM server): ``--warmup`` untimed steps, then ``--steps`` timed steps of rollout
(+ reward), update, sync_weights. Per phase it records the seconds and the peak resident memory (VmHWM, reset
through ``/proc/PID/clear_refs`` before the phase) of every process: the controller, each rank, each process of
the vLLM server. Random-init policies rarely end early, so completions run to the limit; the reward (the share of
whitespace in the completion text) only gives the update non-zero advantages.

Figures:
- update MFU: model FLOPs of the update (``update_flops``: 6 x the matmul parameters per token through the body,
  the LM head on completion tokens only, causal attention; no recompute counted) over the update seconds, divided
  by the GEMM rate this run measured with one thread in the same dtype (``gemm_rate``, the shape's MLP matmul),
  times the 2 ranks: utilisation against this CPU's own limit. bf16 runs use ``train.mixed_precision='bf16'``;
- train tokens/s, generation tokens/s (completion tokens over the rollout seconds) and embedded over vLLM;
- sync bytes/s (the published float32 weights over the sync seconds) over this run's memcpy rate;
- memory: each train rank's peak during the update against ``rank_memory_model`` (parameters, gradients and
  AdamW states of its shard, FSDP2's unsharded gradient accumulation and gathered layers, one micro-batch's
  activations, one logits chunk, the interpreter and libraries measured once); at S2 also the same update with
  today's materialised logits (``train.logits_chunk_mib=None``) or its failure;
- TRL (when installed; ``--no-trl`` skips it): HF TRL's GRPOTrainer on S1 with the same model, data, batch,
  lengths, bf16 autocast and lr, against rlsdk's S1 runs (DDP, each engine), interleaved (TRL, rlsdk embedded,
  rlsdk vLLM, TRL, ...), per-step time ratios; and on S2 where S2 is measured (TRL in micro-batches of one prompt
  group, as rlsdk's; rlsdk on FSDP2, as DDP does not fit in 24 GiB). ``--trl-shapes`` chooses the shapes,
  ``--trl-only`` runs the comparison without the ladder.

A run whose derived memory need exceeds the memory available when it would start is skipped and recorded with
the reason (e.g. DDP at S2 on a 24 GiB machine); the materialised-logits row runs all the same, to record its peak
or its OOM. S2 in float32 uses smaller micro-batches with its layers resharded, so that it fits.

``--quick``: S0 only (DDP and FSDP2, embedded, 1 step; TRL at S0 for 2 steps): a smoke test, not a measurement.
The full run (the default, one command, unattended) takes hours on 2 cores (the TRL comparisons about half; the
recorded ``seconds`` say how long it took) and needs a quiet machine; its S2 runs want ~18 GiB free.

Usage: ``python benchmarks/shapes.py [--quick] [--json PATH] [--shapes S0 S1 S2] [--engines embedded vllm]
[--no-trl] [--trl-shapes S1 S2] [--trl-only] [--models DIR] [--only RUN ...]``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import write_json

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("rollout", "update", "sync")
STEP_STATS = (
    "train/loss", "agreement/logprob_absdiff_mean", "agreement/logprob_absdiff_max", "reward/mean", "train/grad_norm",
)  # fmt: skip
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")


@dataclasses.dataclass(frozen=True)
class Shape:
    """A rung of the ladder: model dimensions and the batch it is measured with."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    prompt_tokens: int
    completion_tokens: int
    prompts: int
    samples: int
    # tokens per micro-batch (None: train.micro_batch_size sequences)
    max_tokens_per_micro_batch: int | None
    # FSDP2 keeps the decoder layers gathered from forward to backward (train.fsdp_reshard_after_forward=False)
    keep_gathered: bool = False
    # the same with the vLLM engine, whose server stays resident through the update (None: as above)
    vllm_keep_gathered: bool | None = None
    # float32 runs hold every activation and gathered weight at twice the bytes: their own token budget and
    # resharding, so that two ranks still fit beside the engine (None: as bf16)
    fp32_max_tokens_per_micro_batch: int | None = None
    fp32_keep_gathered: bool | None = None
    # TRL beside rlsdk at this shape: TRL's micro-batch in sequences (None: the whole batch in one pass), and how
    # rlsdk's ranks hold the model in the comparison ('fsdp2' where DDP does not fit)
    trl_micro_batch_size: int | None = None
    trl_rlsdk_parallelism: str = "ddp"

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def token_budget(self, precision: str) -> int | None:
        """Tokens per micro-batch of a run in ``precision`` (None: ``train.micro_batch_size`` sequences)."""
        if precision == "fp32" and self.fp32_max_tokens_per_micro_batch is not None:
            return self.fp32_max_tokens_per_micro_batch
        return self.max_tokens_per_micro_batch

    def keeps_gathered(self, engine: str, parallelism: str, precision: str = "bf16") -> bool:
        """Whether a run with ``engine``, ``parallelism`` and ``precision`` keeps FSDP2's layers gathered to the
        backward."""
        if parallelism != "fsdp2":
            return False
        if precision == "fp32" and self.fp32_keep_gathered is not None:
            return self.fp32_keep_gathered
        if engine == "vllm" and self.vllm_keep_gathered is not None:
            return self.vllm_keep_gathered
        return self.keep_gathered

    def parameters(self) -> int:
        kv = self.kv_heads * self.head_dim
        attention = 2 * self.hidden * self.hidden + 2 * self.hidden * kv + self.hidden + 2 * kv
        layer = attention + 3 * self.hidden * self.intermediate + 2 * self.hidden
        return self.layers * layer + self.vocab * self.hidden + self.hidden


SHAPES = {
    "S0": Shape("S0", 64, 2, 4, 4, 256, 16, 4, 5, 16, 16, None),
    "S1": Shape("S1", 384, 6, 6, 2, 1536, 32_000, 64, 256, 8, 8, 8192),
    "S2": Shape("S2", 896, 24, 14, 2, 4864, 151_936, 128, 256, 4, 4, 1536, True, vllm_keep_gathered=False,
                fp32_max_tokens_per_micro_batch=768, fp32_keep_gathered=False, trl_micro_batch_size=4,
                trl_rlsdk_parallelism="fsdp2"),
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Run:
    """One Session: a shape, how the ranks hold it, which engine generates, in which precision."""

    shape: str
    parallelism: str = "fsdp2"
    engine: str = "embedded"
    precision: str = "bf16"  # bf16: train.mixed_precision='bf16'; fp32: every op in float32
    logits: str = "chunked"  # materialised: train.logits_chunk_mib=None (today's token_logprobs path)
    warmup: int = 1
    steps: int = 2
    decode: str = "eager"  # inference.decode_step of the in-process engines: 'eager' or 'compile'

    @property
    def name(self) -> str:
        extra = "" if self.logits == "chunked" else f"-{self.logits}"
        extra += "" if self.decode == "eager" else f"-{self.decode}"
        return f"{self.shape}-{self.parallelism}-{self.engine}-{self.precision}{extra}"


def default_runs(shapes: list[str], engines: list[str], quick: bool) -> list[Run]:
    if quick:
        return [Run("S0", "ddp", "embedded", "fp32", warmup=0, steps=1), Run("S0", "fsdp2", "embedded", "bf16",
                                                                            warmup=0, steps=1)]  # fmt: skip
    runs: list[Run] = []
    for shape in shapes:
        steps = {"S0": (2, 8), "S1": (1, 3), "S2": (1, 2)}[shape]
        for engine in engines:
            for parallelism in ("ddp",) if engine == "colocated" else ("ddp", "fsdp2"):
                runs.append(Run(shape, parallelism, engine, "bf16", warmup=steps[0], steps=steps[1]))
        runs.append(Run(shape, "fsdp2", "embedded", "fp32", warmup=steps[0], steps=steps[1]))
        if shape != "S0":  # the compiled decode step beside the eager one (S0's rollouts are too short to pay it back)
            runs.append(Run(shape, "fsdp2", "embedded", "bf16", warmup=steps[0], steps=steps[1], decode="compile"))
        if shape == "S2":
            runs.append(Run(shape, "fsdp2", "embedded", "bf16", "materialised", warmup=0, steps=1))
    return runs


# ----------------------------------------------------------------------------------------------- the machine


def cpu_flags() -> dict[str, Any]:
    """The CPU model and which of ``CPU_FLAGS`` it reports (bf16 GEMM support: avx512_bf16, amx_bf16)."""
    flags: set[str] = set()
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
            elif line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return {"model": model, "flags": {flag: flag in flags for flag in CPU_FLAGS}}


def gemm_rate(dtype: str, m: int, k: int, n: int, *, threads: int = 1, seconds: float = 1.5) -> float:
    """FLOP/s of ``[m, k] @ [k, n]`` in ``dtype`` on ``threads`` torch threads (median of timed repetitions)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
        a, b = torch.randn(m, k, dtype=torch_dtype), torch.randn(k, n, dtype=torch_dtype)
        for _ in range(3):
            a @ b
        samples: list[float] = []
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline or len(samples) < 5:
            start = time.perf_counter()
            a @ b
            samples.append(time.perf_counter() - start)
        return 2.0 * m * k * n / statistics.median(samples)
    finally:
        torch.set_num_threads(previous)


def memcpy_rate(nbytes: int = 256 * 2**20) -> float:
    """Bytes/s of one large tensor copy on one thread (median of 5): the floor a weight sync is measured against."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
        dst.copy_(src)
        samples = []
        for _ in range(5):
            start = time.perf_counter()
            dst.copy_(src)
            samples.append(time.perf_counter() - start)
        return nbytes / statistics.median(samples)
    finally:
        torch.set_num_threads(previous)


def runtime_baseline_bytes() -> int:
    """RSS of a fresh interpreter that imported what a train rank imports (torch, transformers, accelerate, the
    worker): the part of a rank's memory that is neither tensors nor the model."""
    code = (
        "import torch, transformers, accelerate, psutil\n"
        "from transformers import Qwen2ForCausalLM\n"
        "import rlsdk.worker.main, rlsdk.engine.train.engine\n"
        "print(psutil.Process().memory_info().rss)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    return int(out.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------- work and memory


def update_flops(shape: Shape, prompt_tokens: int, completion_tokens: int, sequences: list[tuple[int, int]]) -> float:
    """Model FLOPs of one update (forward + backward = 3 forwards; recompute not counted).

    ``prompt_tokens``: prompt positions through the model (each distinct prompt once: the shared-prompt pass);
    ``completion_tokens``: completion positions; ``sequences``: (prompt, completion) lengths for attention.
    Per position: 2 x the matmul parameters of the decoder layers; the LM head (2 x hidden x vocab) on completion
    positions only (the only logits computed); causal attention 4 x hidden per (query, key) pair per layer.
    """
    kv = shape.kv_heads * shape.head_dim
    layer_matmul = 2 * shape.hidden * shape.hidden + 2 * shape.hidden * kv + 3 * shape.hidden * shape.intermediate
    body = 2 * shape.layers * layer_matmul * (prompt_tokens + completion_tokens)
    head = 2 * shape.hidden * shape.vocab * completion_tokens
    pairs = sum((p + c) * (p + c + 1) // 2 for p, c in sequences)
    attention = 4 * shape.hidden * shape.layers * pairs
    return 3.0 * (body + head + attention)


def served_dtype_bytes(run: Run) -> int:
    """Bytes per parameter of the weights the engine generates with: ``inference.dtype`` of the run's config; a
    colocated engine generates with the ranks' own float32 parameters."""
    return 2 if run.precision == "bf16" and run.shape != "S0" and run.engine != "colocated" else 4


def decode_roofline(
    shape: Shape, run: Run, steps: list[dict[str, Any]], seconds_rollout: float, rates: dict[str, Any]
) -> dict[str, float]:
    """The rollout's bound on this machine, from this run's own GEMM and memcpy rates, and the fraction reached.

    A decode step can go no faster than the larger of reading the served weights and the key/value cache once
    (bytes / the memcpy rate) and its matrix products (FLOPs / 2 x the one-thread GEMM rate in the served dtype: two
    cores); the prefill (each distinct prompt once) is bounded by its FLOPs alone. Per step of the run: ``decode
    steps`` = its longest completion (the batch runs that many decode steps), the rows per step = its completion
    tokens over them. The achieved time per decode step is the rollout's seconds over its decode steps, prefill
    included (a rollout is what the user waits for); ``fraction`` = the whole bound over the rollout's seconds.
    """
    width = served_dtype_bytes(run)
    precision = "bf16" if width == 2 else "fp32"
    gemm = 2 * rates["gemm_flops_per_s"][run.shape][precision]
    memcpy = rates["memcpy_bytes_per_s"]
    kv = shape.kv_heads * shape.head_dim
    layer_matmul = 2 * shape.hidden * shape.hidden + 2 * shape.hidden * kv + 3 * shape.hidden * shape.intermediate
    token_matmul = shape.layers * layer_matmul + shape.hidden * shape.vocab  # body and LM head, per new token
    kv_bytes_per_position = 2 * shape.layers * kv * width  # keys and values of every layer
    decode_steps = statistics.median(max(c for _, c in s["sequences"]) for s in steps)
    rows = statistics.median(s["completion_tokens"] for s in steps) / max(decode_steps, 1)
    prompt = statistics.median(statistics.mean(p for p, _ in s["sequences"]) for s in steps)
    context = prompt + decode_steps / 2  # the mean key/value length a step attends over
    step_flops = rows * (2 * token_matmul + 4 * shape.hidden * shape.layers * context)
    step_bytes = shape.parameters() * width + rows * context * kv_bytes_per_position
    step_bound = max(step_flops / gemm, step_bytes / memcpy)
    prefill_tokens = statistics.median(s["distinct_prompt_tokens"] for s in steps)
    prefill_flops = 2 * token_matmul * prefill_tokens + 2 * shape.hidden * shape.layers * prefill_tokens * prompt
    prefill_bound = prefill_flops / gemm
    return {
        "decode_steps": decode_steps,
        "rows_per_step": rows,
        "step_flops": step_flops,
        "step_bytes": step_bytes,
        "step_bound_s": step_bound,
        "step_bound_kind": "memory" if step_bytes / memcpy >= step_flops / gemm else "compute",
        "prefill_bound_s": prefill_bound,
        "achieved_step_s": seconds_rollout / max(decode_steps, 1),
        "bound_s": decode_steps * step_bound + prefill_bound,
        "fraction": (decode_steps * step_bound + prefill_bound) / seconds_rollout,
    }


def activation_bytes_per_token_layer(shape: Shape, parallelism: str, precision: str) -> int:
    """Bytes one token keeps for the backward in one Qwen2 decoder layer (transformers' eager ops, SDPA attention
    with key/value heads repeated to the query heads), counted tensor by tensor:

    - each RMSNorm keeps its float32 input (for the square and the product) and its normalised output before the
      weight (float32: ``4 + 4`` bytes x hidden; with bf16 parameters the float32 upcast of the input and the bf16
      normalised tensor, ``4 + 2``); two per layer;
    - the inputs of q/k/v (one tensor), o_proj and gate/up (one tensor): ``3 x c x hidden``; under autocast each
      linear casts its input itself, so q, k, v, gate and up each keep their own bf16 copy (``7 x 2 x hidden``);
    - attention: q, k, v (repeated) and the output, ``4 x c x hidden``;
    - the MLP: gate (SiLU's input), SiLU's output, up and the product (down's input), ``4 x c x intermediate``.

    ``c`` = 2 (bf16) or 4 (float32). Measured on S1's layer (forward activations, glibc returning freed memory):
    fp32 38.7 kB (this count: 41.5), autocast 27.9 kB (26.1), bf16 parameters 21.6 kB (22.3).
    """
    h, i = shape.hidden, shape.intermediate
    if precision == "fp32":
        return 2 * 8 * h + 3 * 4 * h + 4 * 4 * h + 4 * 4 * i
    if parallelism == "ddp":  # autocast over float32 parameters: a float32 residual stream
        return 2 * 8 * h + 7 * 2 * h + 4 * 2 * h + 4 * 2 * i
    return 2 * 6 * h + 3 * 2 * h + 4 * 2 * h + 4 * 2 * i  # FSDP2's bf16 parameters


def rank_memory_model(
    shape: Shape, parallelism: str, precision: str, *, world: int, micro_batch_tokens: int, chunk_mib: int | None,
    baseline_bytes: int, completion_tokens: int, keep_gathered: bool = False,
) -> dict[str, float]:  # fmt: skip
    """Expected peak RSS of one train rank during an update, from first principles, in bytes per component.

    - ``parameters``, ``gradients``: float32, ``N / world`` each with FSDP2 (its shard; every micro-batch
      reduce-scatters, so no unsharded gradient outlives a backward), ``N`` with DDP;
    - ``adamw_states``: exp_avg and exp_avg_sq, float32, the same share;
    - ``ddp_buckets``: DDP's flat gradient buckets beside the gradients (``4 N``);
    - ``gathered_parameters``: FSDP2's root (embedding/LM head, kept gathered from forward to backward) and two
      decoder layers (the one computing and the prefetched one) in the compute dtype, or every decoder layer with
      ``keep_gathered`` (``train.fsdp_reshard_after_forward=False``); DDP with autocast keeps bf16 copies of every
      weight it cast (2 N) until the backward;
    - ``activations``: :func:`activation_bytes_per_token_layer` x layers x the micro-batch's padded tokens;
    - ``logits_chunk``: the fused head's two [n, V] float32 buffers plus its bf16 gradient copy (2.5 chunks), and
      the head weight's gradient buffer (V x hidden) in the compute dtype; materialised logits: the micro-batch's
      ``completion_tokens`` x V logits in the compute dtype and four float32 copies (upcast, log-softmax,
      softmax, gradient) instead;
    - ``runtime``: the interpreter and libraries (measured: ``runtime_baseline_bytes``).

    Not counted: what the allocator keeps of freed memory. CPU ranks map every block from 4 MiB up on its own
    (:mod:`rlsdk.engine.train.host_allocator`), so only smaller freed blocks stay in glibc's heaps for reuse.
    """
    n = shape.parameters()
    share = 1 / world if parallelism == "fsdp2" else 1.0
    compute = 2 if precision == "bf16" else 4
    layer_params = (shape.parameters() - shape.vocab * shape.hidden - shape.hidden) / shape.layers
    model = {
        "runtime": float(baseline_bytes),
        "parameters": 4.0 * n * share,
        "gradients": 4.0 * n * share,
        "adamw_states": 8.0 * n * share,
        "ddp_buckets": 4.0 * n if parallelism == "ddp" else 0.0,
        "gathered_parameters": float(
            compute * (shape.vocab * shape.hidden + (shape.layers if keep_gathered else 2) * layer_params)
            if parallelism == "fsdp2"
            else (2 * n if precision == "bf16" else 0)
        ),
        "activations": float(
            activation_bytes_per_token_layer(shape, parallelism, precision) * shape.layers * micro_batch_tokens
        ),
    }
    if chunk_mib is None:
        model["logits_chunk"] = float((compute + 4 * 4) * completion_tokens * shape.vocab)
    else:
        model["logits_chunk"] = 2.5 * chunk_mib * 2**20 + compute * shape.vocab * shape.hidden
    model["total"] = sum(model.values())
    return model


# ------------------------------------------------------------------------------------------------ processes


def reset_peaks(pids: list[int]) -> None:
    """Reset each process's peak RSS (VmHWM) to its current RSS (Linux ``clear_refs`` 5)."""
    for pid in pids:
        try:
            Path(f"/proc/{pid}/clear_refs").write_text("5")
        except OSError:
            continue


def read_peaks(pids: dict[str, int]) -> dict[str, float]:
    """VmHWM (MiB) of each named process (absent: it exited)."""
    peaks = {}
    for name, pid in pids.items():
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    peaks[name] = int(line.split()[1]) / 1024
        except OSError:
            continue
    return peaks


def session_processes(session: Any) -> dict[str, int]:
    """controller, rank{r} and server processes (the vLLM server's tree: API server and engine core) by name."""
    pids = {"controller": os.getpid()}
    for rank, info in sorted(session.rank_info.items()):
        pids[f"rank{rank}"] = int(info["pid"])
    server = getattr(session.engine, "server", None)
    proc = getattr(server, "proc", None)
    if proc is not None:
        try:
            root = psutil.Process(proc.pid)
            for index, child in enumerate([root, *root.children(recursive=True)]):
                pids[f"server{index}"] = child.pid
        except psutil.NoSuchProcess:
            pass
    return pids


def whitespace_reward(completions: list[str], **_: Any) -> list[float]:
    """The share of whitespace characters: varies between samples of a random policy (non-zero advantages)."""
    return [sum(ch.isspace() for ch in text) / max(len(text), 1) for text in completions]


# ---------------------------------------------------------------------------------------------------- models


def build_model(shape: Shape, models: Path) -> Path:
    """The shape's policy under ``models`` (built once, reused by later runs)."""
    if shape.name == "S0":
        from rlsdk.data import build_tiny_policy

        return build_tiny_policy(models / "S0", seed=0, num_heads=2)  # vLLM's CPU attention needs head_dim >= 32
    from rlsdk.data.shapes import PolicyShape, build_shape_policy

    spec = PolicyShape(
        shape.hidden, shape.layers, shape.heads, shape.kv_heads, shape.intermediate, shape.vocab,
        shape.prompt_tokens, shape.completion_tokens, shape.prompts, shape.samples,
    )  # fmt: skip
    return build_shape_policy(models / shape.name, spec, seed=0, tokenizer_dir=models / f"tokenizer-{shape.vocab}")


def build_prompts(shape: Shape, model_dir: Path, models: Path) -> Path | None:
    """A JSON Lines file of prompts of the shape's length (None for S0: the reverse task)."""
    if shape.name == "S0":
        return None
    from transformers import AutoTokenizer

    from rlsdk.data.shapes import corpus_prompts

    path = models / f"prompts-{shape.name}.jsonl"
    if not path.is_file():
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        rows = corpus_prompts(tokenizer, 256, shape.prompt_tokens, seed=0)
        path.write_text("".join(json.dumps({"prompt": text}) + "\n" for text in rows))
    return path


def session_config(run: Run, shape: Shape, model_dir: Path, prompts: Path | None, out: Path) -> Any:
    from rlsdk.config import (
        DataConfig,
        EmbeddedConfig,
        InferenceConfig,
        LaunchConfig,
        ModelConfig,
        ObserveConfig,
        RolloutConfig,
        SessionConfig,
        TrainConfig,
        VLLMConfig,
    )

    data = DataConfig(prompts_per_step=shape.prompts, num_examples=4096)
    if prompts is not None:
        data = DataConfig(task="file", path=str(prompts), prompts_per_step=shape.prompts)
    longest = shape.prompt_tokens + shape.completion_tokens + 16
    return SessionConfig(
        model=ModelConfig(path=str(model_dir)),
        launch=LaunchConfig(
            num_ranks=2, threads_per_rank=1, start_timeout_s=600.0, heartbeat_timeout_s=120.0, hang_timeout_s=None
        ),
        inference=InferenceConfig(
            engine=run.engine,
            dtype="bfloat16" if run.precision == "bf16" and shape.name != "S0" else None,
            decode_step=run.decode,  # type: ignore[arg-type]
            embedded=EmbeddedConfig(num_threads=2),
            vllm=VLLMConfig(
                max_model_len=max(longest, 64) if run.engine == "vllm" else None,
                kv_cache_gib=1,  # the most S2 needs is ~0.1 GiB; the server's memory stays through the update
                server_start_timeout_s=900.0,
                sync_timeout_s=600.0,
                request_timeout_s=3600.0,
            ),
        ),
        train=TrainConfig(
            lr=1e-5 if shape.name != "S0" else 1e-3,
            micro_batch_size=128,
            parallelism=run.parallelism,  # type: ignore[arg-type]
            max_tokens_per_micro_batch=shape.token_budget(run.precision),
            fsdp_reshard_after_forward=not shape.keeps_gathered(run.engine, run.parallelism, run.precision),
            mixed_precision="bf16" if run.precision == "bf16" else "no",
            logits_chunk_mib=None if run.logits == "materialised" else 32,
        ),
        rollout=RolloutConfig(group_size=shape.samples, max_new_tokens=shape.completion_tokens),
        data=data,
        observe=ObserveConfig(output_dir=str(out), console=False, tensorboard=False, log_level="WARNING"),
        seed=0,
    )


# ---------------------------------------------------------------------------------------------------- worker


async def measure_session(run: Run, shape: Shape, config: Any) -> dict[str, Any]:
    """Warm-up and timed steps of one Session; per step and phase: seconds and peak RSS of every process."""
    from rlsdk import Session
    from rlsdk.rewards import reverse_reward

    reward = reverse_reward if shape.name == "S0" else whitespace_reward
    steps: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    async with await Session.start(config) as session:
        start_s = time.perf_counter() - t0
        pids = session_processes(session)
        for index in range(run.warmup + run.steps):
            step: dict[str, Any] = {"timed": index >= run.warmup, "seconds": {}, "peak_rss_mib": {}}
            reset_peaks(list(pids.values()))
            t = time.perf_counter()
            rollout = await session.reward(await session.rollout(), reward)
            step["seconds"]["rollout"] = time.perf_counter() - t
            step["peak_rss_mib"]["rollout"] = read_peaks(pids)
            reset_peaks(list(pids.values()))
            t = time.perf_counter()
            stats = await session.update(rollout)
            step["seconds"]["update"] = time.perf_counter() - t
            step["peak_rss_mib"]["update"] = read_peaks(pids)
            reset_peaks(list(pids.values()))
            t = time.perf_counter()
            await session.sync_weights()
            step["seconds"]["sync"] = time.perf_counter() - t
            step["peak_rss_mib"]["sync"] = read_peaks(pids)
            step["completion_tokens"] = int(rollout.completion_mask_B_C.sum())
            prompt_lengths = rollout.prompt_mask_B_P.long().sum(dim=1).tolist()
            completion_lengths = rollout.completion_mask_B_C.long().sum(dim=1).tolist()
            step["sequences"] = list(zip(prompt_lengths, completion_lengths))
            step["distinct_prompt_tokens"] = sum(prompt_lengths[:: shape.samples])
            step["stats"] = {k: stats[k] for k in STEP_STATS}
            steps.append(step)
            print(
                f"  {run.name} step {index}: rollout {step['seconds']['rollout']:.1f} s, update "
                f"{step['seconds']['update']:.1f} s, sync {step['seconds']['sync']:.2f} s, "
                f"{step['completion_tokens']} completion tokens",
                flush=True,
            )
    return {"start_s": start_s, "processes": list(pids), "steps": steps}


def worker_main(args: argparse.Namespace) -> None:
    run = Run(**json.loads(args.run))
    shape = SHAPES[run.shape]
    models = Path(args.models)
    model_dir = build_model(shape, models)
    prompts = build_prompts(shape, model_dir, models)
    out = Path(args.work_dir)
    config = session_config(run, shape, model_dir, prompts, out / "session")
    result = asyncio.run(measure_session(run, shape, config))
    Path(args.result).write_text(json.dumps(result))


# ---------------------------------------------------------------------------------------------------- parent


def run_worker(run: Run, models: Path, root: Path, extra: list[str] | None = None) -> dict[str, Any]:
    """One run in a fresh subprocess; its JSON, or ``{"error": ...}`` when it failed."""
    work = Path(tempfile.mkdtemp(prefix=f"{run.name}-", dir=root))
    result = work / "result.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(dataclasses.asdict(run))]
    cmd += ["--models", str(models), "--work-dir", str(work), "--result", str(result), *(extra or [])]
    env = {**os.environ, "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TOKENIZERS_PARALLELISM": "false"}
    tail: list[str] = []
    with subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:  # the worker's progress lines as they come; the last ones kept for an error
            if line.startswith("  "):
                print(line, end="", flush=True)
            tail = [*tail[-29:], line.rstrip()]
    if proc.returncode != 0 or not result.is_file():
        print(f"  {run.name}: failed (exit code {proc.returncode})", flush=True)
        return {"error": f"exit code {proc.returncode}", "last_lines": tail}
    return json.loads(result.read_text())


def summarize_run(run: Run, data: dict[str, Any], rates: dict[str, Any], memory: dict[str, float]) -> dict:
    """Medians over the timed steps: seconds, peaks, tokens/s, MFU, sync bytes/s; the rank peak against ``memory``."""
    shape = SHAPES[run.shape]
    timed = [s for s in data["steps"] if s["timed"]] or data["steps"]
    seconds = {phase: statistics.median(s["seconds"][phase] for s in timed) for phase in PHASES}
    peaks: dict[str, dict[str, float]] = {}
    for phase in PHASES:
        names = {name for s in timed for name in s["peak_rss_mib"][phase]}
        peaks[phase] = {n: max(s["peak_rss_mib"][phase].get(n, 0.0) for s in timed) for n in sorted(names)}
    flops = statistics.median(
        update_flops(shape, s["distinct_prompt_tokens"], s["completion_tokens"], s["sequences"]) for s in timed
    )
    completion = statistics.median(s["completion_tokens"] for s in timed)
    train_tokens = statistics.median(s["distinct_prompt_tokens"] + s["completion_tokens"] for s in timed)
    gemm = rates["gemm_flops_per_s"][run.shape][run.precision]
    sync_bytes = 4 * shape.parameters()
    rank_peak = max(v for k, v in peaks["update"].items() if k.startswith("rank")) * 2**20
    # the first update of the run (its warm-up step, if any): its forward and backward run before the first optimizer
    # step creates AdamW's states, so its peak is below the derived total by up to those states
    first = data["steps"][0]["peak_rss_mib"]["update"]
    first_peak = max(v for k, v in first.items() if k.startswith("rank")) * 2**20
    return {
        "run": dataclasses.asdict(run),
        "name": run.name,
        "parameters": shape.parameters(),
        "start_s": data["start_s"],
        "seconds": seconds,
        "peak_rss_mib": peaks,
        "completion_tokens": completion,
        "generation_tokens_per_s": completion / seconds["rollout"],
        "train_tokens_per_s": train_tokens / seconds["update"],
        "update_model_flops": flops,
        "update_mfu": flops / seconds["update"] / (2 * gemm),
        # the update's bound: its forward+backward FLOPs at 2 x the one-thread GEMM rate (its fraction: the MFU)
        "update_bound_s": flops / (2 * gemm),
        "rollout_roofline": decode_roofline(shape, run, timed, seconds["rollout"], rates),
        "sync_bytes": sync_bytes,
        "sync_bytes_per_s": sync_bytes / seconds["sync"],
        "sync_over_memcpy": sync_bytes / seconds["sync"] / rates["memcpy_bytes_per_s"],
        "rank_update_peak_over_derived": rank_peak / memory["total"],
        "first_update_rank_peak_over_derived": first_peak / memory["total"],
        "derived_rank_memory": memory,
        "agreement_logprob_absdiff_mean": statistics.median(
            s["stats"]["agreement/logprob_absdiff_mean"] for s in timed
        ),
        "steps": data["steps"],
    }


def measure_rates(shapes: list[str]) -> dict[str, Any]:
    """The machine's own limits, measured now: GEMM FLOP/s per shape and dtype (1 thread), memcpy bytes/s."""
    rates: dict[str, Any] = {"gemm_flops_per_s": {}, "gemm_shapes": {}}
    for name in shapes:
        shape = SHAPES[name]
        m, k, n = 1024, max(shape.hidden, 256), max(shape.intermediate, 1024)
        rates["gemm_shapes"][name] = [m, k, n]
        rates["gemm_flops_per_s"][name] = {dtype: gemm_rate(dtype, m, k, n) for dtype in ("fp32", "bf16")}
        fp32, bf16 = rates["gemm_flops_per_s"][name]["fp32"], rates["gemm_flops_per_s"][name]["bf16"]
        print(f"GEMM {m}x{k}x{n}, 1 thread: fp32 {fp32 / 1e9:.1f} GFLOP/s, bf16 {bf16 / 1e9:.1f} GFLOP/s "
              f"({bf16 / fp32:.2f}x)", flush=True)  # fmt: skip
    rates["memcpy_bytes_per_s"] = memcpy_rate()
    print(f"memcpy, 1 thread: {rates['memcpy_bytes_per_s'] / 1e9:.2f} GB/s", flush=True)
    # the decode step's own products: the batch's rows through the shape's MLP matmul (what the roofline's GEMM
    # rate, measured at 1,024 rows, promises them)
    rates["gemm_decode_flops_per_s"] = {}
    for name in shapes:
        shape = SHAPES[name]
        rows = shape.prompts * shape.samples
        rates["gemm_decode_flops_per_s"][name] = {
            dtype: gemm_rate(dtype, rows, shape.hidden, shape.intermediate, threads=2, seconds=1.0)
            for dtype in ("fp32", "bf16")
        }
    return rates


def micro_batch_tokens(shape: Shape, precision: str = "bf16") -> tuple[int, int, int]:
    """(padded tokens of the largest micro-batch, micro-batches per rank, its completion tokens) at full-length
    completions, for a run in ``precision``."""
    per_rank = shape.prompts * shape.samples // 2
    seq = shape.prompt_tokens + shape.completion_tokens
    rows = per_rank
    budget = shape.token_budget(precision)
    if budget is not None:
        rows = max(1, min(per_rank, budget // seq))
    return rows * seq, -(-per_rank // rows), rows * shape.completion_tokens


def derived_memory(run: Run, baseline: int) -> dict[str, float]:
    shape = SHAPES[run.shape]
    tokens, _, completion = micro_batch_tokens(shape, run.precision)
    return rank_memory_model(
        shape, run.parallelism, run.precision, world=2, micro_batch_tokens=tokens,
        chunk_mib=None if run.logits == "materialised" else 32, baseline_bytes=baseline,
        completion_tokens=completion, keep_gathered=shape.keeps_gathered(run.engine, run.parallelism, run.precision),
    )  # fmt: skip


def run_ladder(runs: list[Run], models: Path, root: Path, rates: dict[str, Any], baseline: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for run in runs:
        memory = derived_memory(run, baseline)
        # two ranks, plus the controller (and a server) holding the model again in the served dtype
        need = 2 * memory["total"] + 3 * SHAPES[run.shape].parameters() + 3 * 2**30
        available = psutil.virtual_memory().available
        # the materialised-logits row is the comparison the chunked head is judged against: it runs even where
        # its derived need does not fit, so that what it records is its measured peak or its OOM, not a forecast
        if need > available and run.logits == "materialised":
            print(f"{run.name}: derived need {need / 2**30:.1f} GiB > {available / 2**30:.1f} GiB available; "
                  "running it anyway (the comparison row: its peak or its OOM)", flush=True)  # fmt: skip
        elif need > available:
            reason = f"derived need {need / 2**30:.1f} GiB > {available / 2**30:.1f} GiB available"
            print(f"{run.name}: skipped ({reason})", flush=True)
            results[run.name] = {"run": dataclasses.asdict(run), "skipped": reason, "derived_rank_memory": memory}
            continue
        print(f"{run.name}: derived rank peak {memory['total'] / 2**30:.2f} GiB", flush=True)
        data = run_worker(run, models, root)
        if "error" in data:
            results[run.name] = {"run": dataclasses.asdict(run), **data, "derived_rank_memory": memory}
            continue
        row = summarize_run(run, data, rates, memory)
        roof = row["rollout_roofline"]
        print(
            f"{run.name}: rollout {roof['achieved_step_s'] * 1e3:.1f} ms per decode step, bound "
            f"{roof['step_bound_s'] * 1e3:.1f} ms ({roof['step_bound_kind']}), {roof['fraction']:.0%} of the roofline",
            flush=True,
        )
        print(
            f"{run.name}: update {row['seconds']['update']:.1f} s (MFU {row['update_mfu'] * 100:.1f}%), rollout "
            f"{row['seconds']['rollout']:.1f} s ({row['generation_tokens_per_s']:.0f} tok/s), sync "
            f"{row['seconds']['sync']:.2f} s ({row['sync_over_memcpy']:.2f}x memcpy), rank peak "
            f"{row['rank_update_peak_over_derived']:.2f}x derived",
            flush=True,
        )
        results[run.name] = row
    return results


def ratios(results: dict[str, Any]) -> dict[str, Any]:
    """Embedded over vLLM generation tokens/s, and FSDP2 over DDP update seconds, per shape and precision."""
    out: dict[str, Any] = {}
    for name, row in results.items():
        if "seconds" not in row:
            continue
        run = row["run"]
        if run["engine"] == "embedded" and run["logits"] == "chunked":
            other = results.get(name.replace("-embedded-", "-vllm-").removesuffix("-compile"), {})
            if "generation_tokens_per_s" not in other and run["parallelism"] == "fsdp2":
                other = results.get(name.replace("-embedded-", "-vllm-").replace("-fsdp2-", "-ddp-"), {})
            if "generation_tokens_per_s" in other:
                out[f"{name}:embedded_over_vllm_generation"] = (
                    row["generation_tokens_per_s"] / other["generation_tokens_per_s"]
                )
    return out


# ----------------------------------------------------------------------------------------------- TRL at S1


def worker_trl(args: argparse.Namespace) -> None:
    """HF TRL's GRPOTrainer on the shape's model, data, batch and lengths, bf16 autocast, one process (2 threads)."""
    import warnings

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback

    warnings.filterwarnings("ignore", message="TRL currently supports vLLM versions")
    import datasets
    from trl import GRPOConfig, GRPOTrainer

    run = Run(**json.loads(args.run))
    shape = SHAPES[run.shape]
    models = Path(args.models)
    model_dir = build_model(shape, models)
    prompts = build_prompts(shape, model_dir, models)
    torch.set_num_threads(2)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if prompts is None:
        from rlsdk.data import reverse_digits_dataset
        from rlsdk.rewards import reverse_reward

        dataset = reverse_digits_dataset(4096, seed=0)
        reward = reverse_reward
    else:
        dataset = datasets.Dataset.from_list([json.loads(line) for line in prompts.read_text().splitlines()])
        reward = whitespace_reward
    times: list[float] = []
    lengths: list[float] = []  # TRL's mean completion length per logged step: the tokens it generated and trained on

    def reward_fn(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
        return reward(completions, **{k: v for k, v in kwargs.items() if k == "answer"})

    class StepClock(TrainerCallback):
        last = 0.0

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.last = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            now = time.perf_counter()
            times.append(now - self.last)
            self.last = now

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
            if logs and "completions/mean_length" in logs:
                lengths.append(float(logs["completions/mean_length"]))

    batch = shape.prompts * shape.samples
    micro = shape.trl_micro_batch_size or batch  # one generation of the whole batch per optimizer step either way
    config = GRPOConfig(
        output_dir=str(Path(args.work_dir) / "trl"),
        max_steps=run.warmup + run.steps,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=batch // micro,
        num_generations=shape.samples,
        num_iterations=1,
        max_completion_length=shape.completion_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        learning_rate=1e-5 if shape.name != "S0" else 1e-3,
        lr_scheduler_type="constant",
        beta=0.0,
        epsilon=0.2,
        scale_rewards="group",
        loss_type="dapo",
        use_cpu=True,
        bf16=run.precision == "bf16",
        gradient_checkpointing=False,
        use_vllm=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=[reward_fn], args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[StepClock()])  # fmt: skip
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    Path(args.result).write_text(json.dumps({"step_s": times, "completion_mean_length": lengths}))


def compare_trl(
    shape_name: str,
    models: Path,
    root: Path,
    engines: list[str],
    quick: bool,
    decode: str = "eager",
    schedule: tuple[int, int, int] | None = None,
    summarize: Any = None,
) -> dict[str, Any]:
    """TRL and rlsdk (2 ranks, DDP or the shape's ``trl_rlsdk_parallelism``, each of ``engines``) on the same shape,
    interleaved per repetition (TRL, rlsdk embedded, rlsdk vLLM, TRL, ...), each in a fresh subprocess; per-step
    seconds after the warm-up. S2's steps are minutes long: fewer of them."""
    warmup, steps, reps = (0, 2, 1) if quick else (1, 2, 1) if shape_name == "S2" else (1, 4, 2)
    if schedule is not None:  # --trl-schedule: (warm-up steps, timed steps, repetitions)
        warmup, steps, reps = schedule
    precision = "bf16"
    parallelism = SHAPES[shape_name].trl_rlsdk_parallelism
    micro = SHAPES[shape_name].trl_micro_batch_size
    batching = f"micro-batches of {micro} sequences" if micro else "the whole batch in one micro-batch"
    rlsdk_runs = [
        Run(shape_name, "ddp" if engine == "colocated" else parallelism, engine, precision, warmup=warmup, steps=steps,
            decode=decode if engine != "vllm" else "eager")
        for engine in engines
    ]  # fmt: skip
    trl_run = dataclasses.replace(rlsdk_runs[0], engine="trl")
    step_s: dict[str, list[float]] = {"trl": [], **{run.engine: [] for run in rlsdk_runs}}
    # mean completion tokens per sequence in the timed steps: both sides must generate (and train on) as many
    lengths: dict[str, list[float]] = {"trl": [], **{run.engine: [] for run in rlsdk_runs}}
    for rep in range(reps):
        work = Path(tempfile.mkdtemp(prefix=f"trl-{rep}-", dir=root))
        result = work / "result.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker-trl", json.dumps(dataclasses.asdict(trl_run)),
               "--models", str(models), "--work-dir", str(work), "--result", str(result)]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "2", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            return {"error": f"TRL exit code {proc.returncode}", "last_lines": proc.stderr.strip().splitlines()[-15:]}
        trl_result = json.loads(result.read_text())
        step_s["trl"] += trl_result["step_s"][warmup:]
        lengths["trl"] += trl_result["completion_mean_length"][warmup:]
        print(f"  TRL rep {rep}: {statistics.median(step_s['trl']):.1f} s/step, completions "
              f"{statistics.median(lengths['trl'] or [0]):.0f} tokens on average", flush=True)  # fmt: skip
        for run in rlsdk_runs:
            data = run_worker(run, models, root)
            if "error" in data:
                return {"error": f"rlsdk run {run.name} failed", **data}
            if summarize is not None and rep == 0:  # the ladder's figures of this run too (roofline, MFU, memory)
                summarize(run, data)
            step_s[run.engine] += [sum(s["seconds"].values()) for s in data["steps"] if s["timed"]]
            sequences = SHAPES[shape_name].prompts * SHAPES[shape_name].samples
            lengths[run.engine] += [s["completion_tokens"] / sequences for s in data["steps"] if s["timed"]]
            print(f"  rlsdk {run.engine} rep {rep}: {statistics.median(step_s[run.engine]):.1f} s/step", flush=True)
    trl_median = statistics.median(step_s["trl"])
    return {
        "shape": shape_name,
        "precision": precision,
        "step_s": step_s,
        "completion_mean_length": lengths,
        "rlsdk_runs": [dataclasses.asdict(run) for run in rlsdk_runs],
        "trl_settings": "GRPOTrainer, transformers generate, bf16 autocast, 2 threads, loss_type dapo, "
        f"num_iterations 1, same model/data/reward/lr/batch/lengths, no gradient checkpointing, {batching}",
        "rlsdk_over_trl_step": {
            engine: statistics.median(v) / trl_median for engine, v in step_s.items() if engine != "trl"
        },
    }


def trl_shapes(chosen: list[str] | None, shapes: list[str], quick: bool) -> list[str]:
    """The shapes of the TRL comparison: ``chosen``, else S0 with ``quick``, else S1 and S2 where S2 is measured."""
    if quick:
        return ["S0"]
    if chosen:
        return chosen
    return ["S1"] + (["S2"] if "S2" in shapes else [])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="S0 only, 1 step per run: a smoke test")
    parser.add_argument("--json", default=None, help="write all figures to this JSON file")
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument(
        "--engines",
        nargs="+",
        choices=["embedded", "vllm", "colocated"],
        default=None,
        help="default: embedded and vllm (embedded only with --quick or without vllm installed)",
    )
    parser.add_argument(
        "--trl-schedule",
        nargs=3,
        type=int,
        default=None,
        metavar=("WARMUP", "STEPS", "REPS"),
        help="the TRL comparison's untimed steps, timed steps and interleaved repetitions (default: per shape)",
    )
    parser.add_argument(
        "--decode",
        choices=["eager", "compile"],
        default="eager",
        help="inference.decode_step of the in-process engines in the TRL comparison (the ladder runs both at S1/S2)",
    )
    parser.add_argument(
        "--trl",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="compare with TRL's GRPOTrainer (see --trl-shapes); default: when trl is installed",
    )
    parser.add_argument(
        "--trl-shapes",
        nargs="+",
        choices=list(SHAPES),
        default=None,
        help="shapes of the TRL comparison (default: S1, and S2 when S2 is among --shapes; S0 with --quick)",
    )
    parser.add_argument("--trl-only", action="store_true", help="run the TRL comparison only, not the ladder")
    parser.add_argument("--models", default=None, help="folder for the built models (kept; default: a temp folder)")
    parser.add_argument("--only", nargs="+", default=None, help="run only these runs (names as printed)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps per run (default: per shape)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run (default: per shape)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--worker-trl", help=argparse.SUPPRESS)
    parser.add_argument("--work-dir", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.run = args.worker
        worker_main(args)
        return
    if args.worker_trl:
        args.run = args.worker_trl
        worker_trl(args)
        return

    engines = args.engines
    if engines is None:
        engines = ["embedded"] + ([] if args.quick or importlib.util.find_spec("vllm") is None else ["vllm"])
    shapes = ["S0"] if args.quick else args.shapes
    root = Path(tempfile.mkdtemp(prefix="rlsdk-bench-shapes-"))  # the runs' output roots, deleted at the end
    models = Path(args.models) if args.models else root / "models"
    models.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    try:
        cpu = cpu_flags()
        print(f"{cpu['model']}: {', '.join(f for f, on in cpu['flags'].items() if on)}", flush=True)
        rates = measure_rates(shapes)
        baseline = runtime_baseline_bytes()
        runs = [] if args.trl_only else default_runs(shapes, engines, args.quick)
        if args.only:
            runs = [run for run in runs if run.name in args.only]
        if args.warmup is not None or args.steps is not None:
            runs = [
                dataclasses.replace(
                    run,
                    warmup=run.warmup if args.warmup is None else args.warmup,
                    steps=run.steps if args.steps is None else args.steps,
                )
                for run in runs
            ]
        results = run_ladder(runs, models, root, rates, baseline)
        trl_by_shape: dict[str, Any] = {}

        def summarize(run: Run, data: dict[str, Any]) -> None:
            results.setdefault(run.name, summarize_run(run, data, rates, derived_memory(run, baseline)))

        if args.trl if args.trl is not None else importlib.util.find_spec("trl") is not None:
            for name in trl_shapes(args.trl_shapes, shapes, args.quick):
                trl_by_shape[name] = compare_trl(
                    name, models, root, engines, args.quick, args.decode,
                    tuple(args.trl_schedule) if args.trl_schedule else None, summarize,
                )  # fmt: skip
                for engine, ratio in (trl_by_shape[name].get("rlsdk_over_trl_step") or {}).items():
                    print(f"rlsdk ({engine}) / TRL per-step time at {name}: {ratio:.2f}", flush=True)
    finally:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    seconds = time.perf_counter() - t0
    print(f"\n{seconds:.0f} s in all")
    write_json(
        args.json,
        {
            "benchmark": "shapes",
            "quick": args.quick,
            "command": " ".join(["python", *sys.argv]),
            "seconds": seconds,
            "cpu": cpu,
            "rates": rates,
            "runtime_baseline_bytes": baseline,
            "shapes": {
                name: {**dataclasses.asdict(SHAPES[name]), "parameters": SHAPES[name].parameters()} for name in shapes
            },
            "runs": results,
            "ratios": ratios(results),
            "trl": next(iter(trl_by_shape.values()), None),  # the first shape's (S1 by default), as before
            "trl_by_shape": trl_by_shape,
        },
    )


if __name__ == "__main__":
    main()
