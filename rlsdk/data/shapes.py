"""Policies of real shapes, built locally: a byte-level BPE tokenizer and a random-init Qwen2-style causal LM.

The shape ladder of ``benchmarks/shapes.py`` and the long tests: S0 is the default toy policy
(:func:`~rlsdk.data.build_tiny_policy`); S1 a ~25M-parameter Qwen2 shape with a 32k byte-level BPE vocabulary;
S2 the Qwen2.5-0.5B shape (hidden 896, 24 layers, 14 query / 2 key-value heads, intermediate 4,864, vocabulary
151,936, tied embeddings). Nothing downloads: the tokenizer is trained on the Python standard library's own
source files (text every Python installation has) with Hugging Face ``tokenizers``; the weights are random.
Where the corpus yields fewer merges than the vocabulary asks (S2: ~120k of 151,936), reserved special tokens
fill the rest, so every id of the embedding is a token (decoded with ``skip_special_tokens``: nothing).
"""

from __future__ import annotations

import json
import logging
import random
import sysconfig
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"


@dataclass(frozen=True)
class PolicyShape:
    """A model shape and the batch shape it is measured with.

    Attributes:
        hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, vocab_size: the Qwen2 config.
        prompt_tokens: tokens per prompt; completion_tokens: most new tokens per completion.
        prompts_per_step, group_size: prompts per update step, completions per prompt.
    """

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    prompt_tokens: int
    completion_tokens: int
    prompts_per_step: int
    group_size: int

    def parameters(self) -> int:
        """Parameter count (tied embeddings counted once, RMSNorm weights and q/k/v biases included)."""
        head_dim = self.hidden_size // self.num_heads
        kv = self.num_kv_heads * head_dim
        attention = 2 * self.hidden_size * self.hidden_size + 2 * self.hidden_size * kv + self.hidden_size + 2 * kv
        layer = attention + 3 * self.hidden_size * self.intermediate_size + 2 * self.hidden_size
        return self.num_layers * layer + self.vocab_size * self.hidden_size + self.hidden_size


SHAPES: dict[str, PolicyShape] = {
    "S1": PolicyShape(384, 6, 6, 2, 1536, 32_000, 64, 256, 8, 8),
    "S2": PolicyShape(896, 24, 14, 2, 4864, 151_936, 128, 256, 4, 4),
}


def corpus_files() -> list[Path]:
    """The Python standard library's ``.py`` files (sorted): a local, deterministic text corpus."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)


def build_bpe_tokenizer(path: str | Path, vocab_size: int, *, files: Sequence[Path] | None = None) -> Path:
    """Train a byte-level BPE tokenizer of ``vocab_size`` tokens (``<|endoftext|>`` included, id 0; reserved special
    tokens after the merges when the corpus yields too few) on :func:`corpus_files` and save it
    (``save_pretrained``) into ``path``. No pad token, as Qwen's: the eos id pads. ``files``: another corpus.

    Raises:
        ValueError: ``vocab_size`` < 257 (the 256 byte symbols and the eos token).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 257:
        raise ValueError(f"vocab_size={vocab_size!r} is invalid: allowed >= 257 (256 bytes + the eos token)")
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = corpus_files() if files is None else files
    core.train_from_iterator((p.read_text(errors="replace") for p in corpus), trainer)
    if core.get_vocab_size() < vocab_size:
        # The corpus ran out of merges: reserved special tokens fill the rest (as Llama 3's), so that every id
        # of the embedding is a token an engine can detokenize.
        core.add_special_tokens([f"<|reserved_{i}|>" for i in range(vocab_size - core.get_vocab_size())])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=EOS_TOKEN, clean_up_tokenization_spaces=False)
    Path(path).mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(path)
    logger.info("trained a byte-level BPE tokenizer of %d tokens into %s", core.get_vocab_size(), path)
    return Path(path)


def build_shape_policy(
    path: str | Path, shape: str | PolicyShape, *, seed: int = 0, tokenizer_dir: str | Path | None = None
) -> Path:
    """Write a random-init Qwen2 causal LM of ``shape`` (a :data:`SHAPES` name or a :class:`PolicyShape`), its
    BPE tokenizer and generation config (eos = pad = ``<|endoftext|>``) into ``path``; float32 safetensors.

    ``tokenizer_dir``: reuse a tokenizer already built there (training one takes tens of seconds). Idempotent:
    a directory holding a complete model of the same shape and seed is returned as is.

    Raises:
        ValueError: an unknown shape name, or ``hidden_size`` not divisible by ``num_heads``.
    """
    from transformers import AutoTokenizer, GenerationConfig

    from rlsdk.data.models import seeded_qwen2, small_qwen2_config

    if isinstance(shape, str):
        if shape not in SHAPES:
            raise ValueError(f"shape={shape!r} is invalid: allowed {sorted(SHAPES)} or a PolicyShape")
        spec = SHAPES[shape]
    else:
        spec = shape
    if spec.hidden_size % spec.num_heads or spec.num_heads % spec.num_kv_heads:
        raise ValueError(f"{spec}: hidden_size must divide by num_heads, and num_heads by num_kv_heads")
    path = Path(path)
    stamp = {"shape": asdict(spec), "seed": seed}
    marker = path / "rlsdk_shape.json"
    if marker.is_file() and json.loads(marker.read_text()) == stamp and (path / "model.safetensors").is_file():
        return path
    if tokenizer_dir is None or not (Path(tokenizer_dir) / "tokenizer.json").is_file():
        build_bpe_tokenizer(path if tokenizer_dir is None else tokenizer_dir, spec.vocab_size)
    tokenizer = AutoTokenizer.from_pretrained(path if tokenizer_dir is None else tokenizer_dir)
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    config = small_qwen2_config(
        spec.vocab_size,
        spec.hidden_size,
        spec.num_layers,
        spec.num_heads,
        spec.intermediate_size,
        max_positions=max(2048, 2 * (spec.prompt_tokens + spec.completion_tokens)),
        num_kv_heads=spec.num_kv_heads,
        rope_theta=1_000_000.0,
        eos_token_id=eos,
        pad_token_id=eos,
        bos_token_id=None,
        use_cache=True,
    )
    model = seeded_qwen2(config, seed)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=eos)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    marker.write_text(json.dumps(stamp))
    logger.info("built a %d-parameter policy of shape %s at %s", sum(p.numel() for p in model.parameters()), spec, path)
    return path


def corpus_prompts(tokenizer: Any, num_prompts: int, prompt_tokens: int, *, seed: int = 0) -> list[str]:
    """``num_prompts`` texts of ``prompt_tokens`` tokens each (as ``tokenizer`` splits them; decoding and
    re-encoding may move a boundary by a token): windows at random places of :func:`corpus_files`."""
    rng = random.Random(seed)
    files = corpus_files()
    prompts: list[str] = []
    while len(prompts) < num_prompts:
        text = rng.choice(files).read_text(errors="replace")
        span = 16 * prompt_tokens  # characters: more than enough for prompt_tokens tokens of source code
        if len(text) <= span:
            continue
        start = rng.randrange(len(text) - span)
        ids = tokenizer(text[start : start + span], add_special_tokens=False)["input_ids"]
        if len(ids) >= prompt_tokens:
            prompts.append(tokenizer.decode(ids[:prompt_tokens]))
    return prompts
