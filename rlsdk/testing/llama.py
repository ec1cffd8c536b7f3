"""A tiny Llama-architecture policy with a locally trained byte-level BPE tokenizer, built the way a user's own
model looks on day one: no pad token, several EOS ids (``generation_config.eos_token_id`` is a list, as in
Llama-3-Instruct), ``save_pretrained`` directories. Nothing downloads.

The weights are random except for a *script*: for each scripted token ``t`` the model's next token is
``script[t]`` with probability ~1 (even at temperature 1), so tests can tell exactly where a completion must
stop. How: token ``t``'s embedding is one large coordinate in a dimension of its own (random layers barely move
the residual stream), and the unembedding row of ``script[t]`` reads that dimension.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

# The special tokens: BOS, the tokenizer's EOS, and two more EOS ids only generation_config.json lists.
BOS = "<|begin|>"
EOS = "<|end|>"
EOT = "<|eot|>"
EOM = "<|eom|>"

# Default script: the last prompt character decides how the completion ends.
# 'p' -> EOS (the tokenizer's own), 'q' -> EOT and 'r' -> EOM (EOS ids only generation_config.json names),
# 's' -> 'a' 'b' 'c' 'd' 'e' 'a' ... (never ends by itself: max_new_tokens, or a stop string such as "cd").
DEFAULT_SCRIPT: dict[str, str] = {
    "p": EOS, "q": EOT, "r": EOM, "s": "a", "a": "b", "b": "c", "c": "d", "d": "e", "e": "a",
}  # fmt: skip

_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "pack my box with five dozen liquor jugs",
    "abcde abcde edcba 0123456789 + - * / = ( ) < > |",
    "how vexingly quick daft zebras jump; sphinx of black quartz, judge my vow",
]


def build_llama_policy(
    directory: str | Path,
    *,
    script: Mapping[str, str] | None = None,
    hidden_size: int = 64,
    num_heads: int = 2,
    seed: int = 0,
) -> Path:
    """Write a scripted tiny ``LlamaForCausalLM`` and its tokenizer to ``directory``; returns it.

    ``script`` maps a token (a single character, or one of :data:`EOS`, :data:`EOT`, :data:`EOM`, :data:`BOS`) to
    the token the model emits after it (default :data:`DEFAULT_SCRIPT`). ``hidden_size / num_heads`` is the head
    dimension: keep it one vLLM's CPU attention supports (32 or 64) to serve the model with vLLM.

    The tokenizer: byte-level BPE trained here on a few sentences (every byte is a token), special tokens
    :data:`BOS`, :data:`EOS`, :data:`EOT`, :data:`EOM`, ``eos_token`` :data:`EOS`, **no pad token**. The
    generation config lists all three EOS ids.

    Raises:
        ValueError: a scripted token that is not one token of the tokenizer, or more scripted tokens than
            ``hidden_size`` dimensions.
    """
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    script = dict(DEFAULT_SCRIPT if script is None else script)
    specials = [BOS, EOS, EOT, EOM]

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(_CORPUS, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=BOS, eos_token=EOS)
    tokenizer.add_special_tokens({"additional_special_tokens": [EOT, EOM]})
    tokenizer.save_pretrained(directory)

    def token_id(text: str) -> int:
        ids = tokenizer.convert_tokens_to_ids(text) if text in specials else tokenizer.encode(text)
        if isinstance(ids, list):
            if len(ids) != 1:
                raise ValueError(f"script token {text!r} is {len(ids)} tokens of the tokenizer; allowed: one token")
            ids = ids[0]
        return int(ids)

    eos_ids = [token_id(EOS), token_id(EOT), token_id(EOM)]
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=256,
        bos_token_id=token_id(BOS),
        eos_token_id=eos_ids,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    sources = sorted({token_id(t) for t in script})
    if len(sources) > hidden_size:
        raise ValueError(f"{len(sources)} scripted tokens need hidden_size >= {len(sources)}, got {hidden_size}")
    slot = {source: dim for dim, source in enumerate(sources)}
    with torch.no_grad():
        embed = model.model.embed_tokens.weight
        head = model.lm_head.weight
        head.zero_()
        for text, following in script.items():
            source, target = token_id(text), token_id(following)
            embed[source].zero_()
            embed[source, slot[source]] = 1.0
            head[target, slot[source]] = 10.0
    model.save_pretrained(directory)
    GenerationConfig(bos_token_id=token_id(BOS), eos_token_id=eos_ids).save_pretrained(directory)
    return directory
