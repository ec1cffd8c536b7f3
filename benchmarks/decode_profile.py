"""One rollout of the in-process sampler at a ladder shape, to profile (``py-spy record -f raw -- python
benchmarks/decode_profile.py S1``): the embedded engine's generation without a Session around it.

The shape's policy and prompts are built as ``benchmarks/shapes.py`` builds them (``--models``: reuse a folder), served
in ``--dtype`` on 2 torch threads, sampled as one batch of prompts x group size at temperature 1. Prints the seconds
and the time per decode step; ``benchmarks/results/decode_profile_s1.json`` holds what a profile of it showed.

Usage: ``python benchmarks/decode_profile.py [S1|S2] [--tokens N] [--dtype bfloat16|float32] [--decode eager|compile]
[--reps N] [--models DIR]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


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
    for rep in range(args.reps):
        start = time.perf_counter()
        ids_B_C, mask_B_C, _ = sample_completions(
            model, prompt_ids, params, pad_token_id=special.pad_token_id, eos_token_id=special.eos_token_ids,
            generator=generator, decode_step=args.decode,
        )  # fmt: skip
        seconds = time.perf_counter() - start
        print(f"rep {rep}: {seconds:.2f} s, {int(mask_B_C.sum())} tokens, {seconds / ids_B_C.shape[1] * 1e3:.1f} ms "
              "per decode step", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
