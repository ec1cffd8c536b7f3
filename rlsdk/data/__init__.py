"""Data sets and batching: the procedurally generated reverse-digits task and its tiny policy."""

from rlsdk.data.reverse import (
    VOCAB,
    VOCAB_SIZE,
    PromptSampler,
    build_tiny_policy,
    build_tokenizer,
    reverse_digits_dataset,
)

__all__ = [
    "VOCAB",
    "VOCAB_SIZE",
    "PromptSampler",
    "build_tiny_policy",
    "build_tokenizer",
    "reverse_digits_dataset",
]
