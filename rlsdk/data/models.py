"""Random-init policies built locally: the one seeded construction every task's model builder shares."""

from __future__ import annotations

from typing import TYPE_CHECKING

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
