"""A tiny Llama-architecture policy with a locally trained byte-level BPE tokenizer, built the way a user's own
model looks on day one: no pad token, several EOS ids (``generation_config.eos_token_id`` is a list, as in
Llama-3-Instruct), ``save_pretrained`` directories. Nothing downloads.

The weights are random except for a *script*: for each scripted token ``t`` the model's next token is
``script[t]`` with probability ~1 (even at temperature 1), so tests can tell exactly where a completion must
stop; :func:`run_stop_scenario` drives a real Session through it on any engine. How: token ``t``'s embedding is
one large coordinate in a dimension of its own (random layers barely move the residual stream), and the
unembedding row of ``script[t]`` reads that dimension.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rlsdk.config import (
    DataConfig,
    InferenceConfig,
    LaunchConfig,
    ModelConfig,
    ObserveConfig,
    RolloutConfig,
    SessionConfig,
    TrainConfig,
    VLLMConfig,
)

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


# prompt -> (expected completion tokens, expected completion text, finish reason) with rollout.stop = ("cd",)
STOP_SCENARIO = {
    "p": ([EOS], "", "eos"),
    "q": ([EOT], "", "eos"),
    "r": ([EOM], "", "eos"),
    "s": (["a", "b", "c", "d"], "ab", "stop"),  # 'd' completes "cd": kept as the last token, text cut before
}


def stop_scenario_config(model_dir: Path, output_dir: Path, engine: str) -> SessionConfig:
    """A small Session config (2 ranks, groups of 2, ``rollout.stop=("cd",)``) for the scripted model."""
    return SessionConfig(
        model=ModelConfig(path=str(model_dir)),
        launch=LaunchConfig(num_ranks=2, start_timeout_s=180.0, heartbeat_interval_s=0.5, heartbeat_timeout_s=30.0),
        inference=InferenceConfig(engine=engine, vllm=VLLMConfig(server_start_timeout_s=300.0)),  # type: ignore[arg-type]
        train=TrainConfig(lr=1e-3, micro_batch_size=8),
        rollout=RolloutConfig(group_size=2, max_new_tokens=8, stop=("cd",)),
        data=DataConfig(prompts_per_step=4, num_examples=16),
        observe=ObserveConfig(output_dir=str(output_dir), console=False),
    )


def length_reward(completions: list[str], **_: Any) -> list[float]:
    """The completion text's length: any reward will do to run an update."""
    return [float(len(text)) for text in completions]


async def run_stop_scenario(session: Any) -> dict[str, Any]:
    """One rollout of the scripted prompts, then reward, update and sync: what each sample ended with."""
    tokenizer = session.tokenizer
    rollout = await session.rollout(list(STOP_SCENARIO))
    lengths = rollout.completion_mask_B_C.sum(dim=1).tolist()
    tokens = [tokenizer.convert_ids_to_tokens(ids[:n]) for ids, n in zip(rollout.completion_ids_B_C.tolist(), lengths)]
    padding = [ids[n:] for ids, n in zip(rollout.completion_ids_B_C.tolist(), lengths)]
    rollout = await session.reward(rollout, length_reward)
    stats = await session.update(rollout)
    info = await session.sync_weights()
    return {
        "tokens": tokens,
        "texts": list(rollout.completions),
        "reasons": list(rollout.info["finish_reasons"]),
        "padding": padding,
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_ids": session.special_tokens.eos_token_ids,
        "eos_ids": tokenizer.convert_tokens_to_ids([EOS, EOT, EOM]),
        "stats": stats,
        "synced": (info.version, session.versions.trainer_version),
    }


def check_stop_scenario(out: dict[str, Any], group_size: int = 2) -> None:
    """Raise AssertionError where :func:`run_stop_scenario`'s result departs from :data:`STOP_SCENARIO`."""
    expected = [value for value in STOP_SCENARIO.values() for _ in range(group_size)]
    assert out["tokens"] == [tokens for tokens, _, _ in expected]
    assert out["texts"] == [text for _, text, _ in expected]
    assert out["reasons"] == [reason for _, _, reason in expected]
    assert out["pad_token_id"] == out["eos_ids"][0]  # pad = EOS: the tokenizer had none
    assert list(out["eos_token_ids"]) == out["eos_ids"]
    assert all(set(rest) <= {out["pad_token_id"]} for rest in out["padding"])
    assert out["stats"]["completion/eos_rate"] == 0.75 and out["stats"]["completion/stop_rate"] == 0.25
    assert out["synced"] == (1, 1)
