"""Random-init policies built locally: the one seeded construction every task's model builder shares."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedModel, Qwen2Config


def seeded_qwen2(config: Qwen2Config, seed: int) -> PreTrainedModel:
    """A ``Qwen2ForCausalLM`` with random weights drawn from ``seed``, leaving torch's global RNG as it was (a
    model built inside a run must not change the run's later draws)."""
    import torch
    from transformers import Qwen2ForCausalLM

    rng_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(config)
    finally:
        torch.random.set_rng_state(rng_state)


def check_policy_sizes(hidden_size: int, num_layers: int, num_heads: int, intermediate_size: int) -> None:
    """Raise ValueError naming the size that is < 1, or ``hidden_size`` not divisible by ``num_heads``: checked by
    the model builders before they build a tokenizer or write anything."""
    for name, value in (
        ("hidden_size", hidden_size),
        ("num_layers", num_layers),
        ("num_heads", num_heads),
        ("intermediate_size", intermediate_size),
    ):
        if value < 1:
            raise ValueError(f"{name}={value!r} is invalid: allowed an int >= 1")
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size={hidden_size} must be divisible by num_heads={num_heads}")


def small_qwen2_config(
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    intermediate_size: int,
    max_positions: int,
    *,
    num_kv_heads: int | None = None,
    **extra: Any,
) -> Qwen2Config:
    """The ``Qwen2Config`` of a random-init policy built here (sizes checked by :func:`check_policy_sizes`): tied
    input/output embeddings, ``num_kv_heads`` key/value heads (default: one per attention head); ``extra``: its
    ``pad_token_id``, ``eos_token_id``, ``bos_token_id`` and any other ``Qwen2Config`` field."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads if num_kv_heads is None else num_kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        **extra,
    )
