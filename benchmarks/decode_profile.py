"""The in-process sampler at a ladder shape without a Session around it: one rollout to profile (``py-spy record -f
raw -- python benchmarks/decode_profile.py S1``), or ``--compare``: this tree's decode path beside an earlier
revision's sampler (``--base``), eager and compiled, interleaved, each against the decode roofline of the same run's
GEMM and memcpy rates (``benchmarks/shapes.py``'s ``decode_roofline``).

The shape's policy and prompts are built as ``benchmarks/shapes.py`` builds them (``--models``: reuse a folder), served
in ``--dtype`` on 2 torch threads, sampled as one batch of prompts x group size at temperature 1. Prints the seconds
and the time per decode step; ``benchmarks/results/decode_profile_s1.json`` holds what a profile of it showed.

Usage: ``python benchmarks/decode_profile.py [S1|S2] [--tokens N] [--dtype bfloat16|float32] [--decode eager|compile]
[--reps N] [--models DIR] [--compare [--base REV] [--json PATH]]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

ROOT = Path(__file__).resolve().parents[1]


def sampler_at(revision: str, folder: Path) -> Any:
    """``rlsdk/generation/sampling.py`` as it was at ``revision``, loaded as a module of its own (it imports the
    rest of rlsdk from this tree)."""
    source = subprocess.run(["git", "show", f"{revision}:rlsdk/generation/sampling.py"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout  # fmt: skip
    path = folder / f"sampling_{revision}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"sampling_{revision}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    import shapes
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlsdk.generation.params import SamplingParams
    from rlsdk.generation.sampling import sample_completions
    from rlsdk.generation.stopping import resolve_special_tokens

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shape", choices=["S1", "S2"], nargs="?", default="S1")
    parser.add_argument("--tokens", type=int, default=None, help="new tokens (default: the shape's)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--decode", choices=["eager", "compile"], default="eager")
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--models", default=None, help="folder of the built models (default: a temp folder)")
    parser.add_argument("--compare", action="store_true", help="this tree (eager, compiled) beside --base, interleaved")
    parser.add_argument("--base", default="c336039", help="the revision whose sampler --compare runs beside this one")
    parser.add_argument("--json", default=None, help="write --compare's figures here")
    args = parser.parse_args()
    torch.set_num_threads(2)
    shape = shapes.SHAPES[args.shape]
    models = Path(args.models or tempfile.mkdtemp(prefix="rlsdk-decode-profile-"))
    model_dir = shapes.build_model(shape, models)
    prompts_file = shapes.build_prompts(shape, model_dir, models)
    assert prompts_file is not None
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    special = resolve_special_tokens(model_dir, tokenizer)
    texts = [json.loads(line)["prompt"] for line in prompts_file.read_text().splitlines()[: shape.prompts]]
    prompt_ids = [tokenizer(text)["input_ids"] for text in texts for _ in range(shape.samples)]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype)).eval()
    params = SamplingParams(max_new_tokens=args.tokens or shape.completion_tokens, temperature=1.0)
    generator = torch.Generator().manual_seed(0)
    kwargs = {"pad_token_id": special.pad_token_id, "eos_token_id": special.eos_token_ids}
    if args.compare:
        compare(args, shape, model, prompt_ids, params, kwargs, models)
        return
    for rep in range(args.reps):
        start = time.perf_counter()
        ids_B_C, mask_B_C, _ = sample_completions(
            model, prompt_ids, params, pad_token_id=special.pad_token_id, eos_token_id=special.eos_token_ids,
            generator=generator, decode_step=args.decode,
        )  # fmt: skip
        seconds = time.perf_counter() - start
        print(f"rep {rep}: {seconds:.2f} s, {int(mask_B_C.sum())} tokens, {seconds / ids_B_C.shape[1] * 1e3:.1f} ms "
              "per decode step", flush=True)  # fmt: skip


def compare(args: Any, shape: Any, model: Any, prompt_ids: list[list[int]], params: Any, kwargs: dict[str, Any],
            models: Path) -> None:  # fmt: skip
    """Interleaved rollouts of ``--base``'s sampler and this tree's (eager, compiled); seconds, tokens/s and the share
    of the decode roofline per path; greedy completions of the two trees compared token by token."""
    import shapes
    import torch
    from _harness import write_json

    from rlsdk.generation.params import SamplingParams
    from rlsdk.generation.sampling import sample_completions

    old = sampler_at(args.base, models)
    precision = "bf16" if args.dtype == "bfloat16" else "fp32"
    rates = {
        "gemm_flops_per_s": {
            shape.name: {precision: shapes.gemm_rate(precision, 1024, shape.hidden, shape.intermediate)}
        },
        "memcpy_bytes_per_s": shapes.memcpy_rate(),
    }
    run = shapes.Run(shape.name, "ddp", "embedded", precision)
    greedy = SamplingParams(max_new_tokens=32, temperature=0.0)
    old_greedy = old.sample_completions(model, prompt_ids, greedy, **kwargs)[0]
    new_greedy = sample_completions(model, prompt_ids, greedy, **kwargs)[0]
    paths = {
        f"base {args.base}": lambda g: old.sample_completions(model, prompt_ids, params, generator=g, **kwargs),
        "this tree, eager": lambda g: sample_completions(model, prompt_ids, params, generator=g, **kwargs),
        "this tree, compiled": lambda g: sample_completions(
            model, prompt_ids, params, generator=g, **kwargs, decode_step="compile"
        ),
    }
    start = time.perf_counter()
    paths["this tree, compiled"](torch.Generator().manual_seed(99))  # the compilation, untimed
    compile_s = time.perf_counter() - start
    seconds: dict[str, list[float]] = {name: [] for name in paths}
    steps: dict[str, list[dict[str, Any]]] = {name: [] for name in paths}
    for rep in range(args.reps):
        for name, call in paths.items():
            start = time.perf_counter()
            _, mask_B_C, _ = call(torch.Generator().manual_seed(rep))
            seconds[name].append(time.perf_counter() - start)
            lengths = mask_B_C.sum(dim=1).tolist()
            prompt_lengths = [len(ids) for ids in prompt_ids]
            steps[name].append({
                "sequences": list(zip(prompt_lengths, lengths)), "completion_tokens": int(mask_B_C.sum()),
                "distinct_prompt_tokens": sum(prompt_lengths[:: shape.samples]),
            })  # fmt: skip
            print(f"rep {rep} {name}: {seconds[name][-1]:.1f} s, {int(mask_B_C.sum())} tokens", flush=True)
    results = {}
    for name in paths:
        median = statistics.median(seconds[name])
        roof = shapes.decode_roofline(shape, run, steps[name], median, rates)
        tokens = statistics.median(s["completion_tokens"] for s in steps[name])
        results[name] = {"seconds": seconds[name], "median_s": median, "tokens_per_s": tokens / median,
                         "rollout_roofline": roof}  # fmt: skip
        print(f"{name}: {median:.1f} s, {tokens / median:.0f} tok/s, {roof['achieved_step_s'] * 1e3:.1f} ms per "
              f"decode step, bound {roof['step_bound_s'] * 1e3:.1f} ms ({roof['step_bound_kind']}), "
              f"{roof['fraction']:.1%} of the roofline", flush=True)  # fmt: skip
    base = results[f"base {args.base}"]["median_s"]
    write_json(args.json, {
        "benchmark": "decode_paths", "command": " ".join(["python", *sys.argv]), "shape": shape.name,
        "dtype": args.dtype, "threads": 2, "new_tokens": params.max_new_tokens, "reps": args.reps,
        "cpu": shapes.cpu_flags(), "rates": rates, "compile_s": compile_s, "paths": results,
        "over_base": {name: row["median_s"] / base for name, row in results.items()},
        "greedy_identical_to_base": bool(torch.equal(old_greedy, new_greedy)),
    })  # fmt: skip


if __name__ == "__main__":
    main()
