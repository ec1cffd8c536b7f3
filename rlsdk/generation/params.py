"""SamplingParams: how an engine samples, shared by every engine and the workflows that call them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one completion per prompt.

    ``top_k = 0`` and ``top_p = 1.0`` disable those filters. ``seed`` makes a batch reproducible on the same
    engine and weights; ``None`` draws from the engine's own generator. ``stop``: strings that end a completion
    when its decoded text contains one, besides the model's EOS ids (vLLM's semantics on every engine: the token
    completing the string is the completion's last; see :mod:`rlsdk.generation.stopping`).
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
