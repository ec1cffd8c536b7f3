"""The InferenceEngine protocol: what every inference backend (embedded, vLLM) offers the Session.

Shape names follow docs/glossary.md: ``B`` = sequences in the batch, ``C`` = completion tokens (right-padded).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from rlsdk.generation.params import SamplingParams

# SamplingParams lives in rlsdk.generation (the trainer's colocated generation uses it too); re-exported here.
__all__ = ["GenerateResult", "InferenceEngine", "SamplingParams", "WeightInfo"]


@dataclass(frozen=True)
class GenerateResult:
    """One completion per prompt, right-padded to the longest completion ``C``.

    - ``completion_ids_B_C``: int64 token ids; positions past the end hold the pad id.
    - ``completion_mask_B_C``: bool, True for every generated token (the EOS token included).
    - ``logprobs_B_C``: float32 log-probabilities of the sampled tokens under the sampling distribution
      (logits divided by the temperature, before top-k/top-p filtering); 0.0 where the mask is False.
    - ``versions_B_C``: int64 weight version that produced each token; -1 where the mask is False.
    """

    completion_ids_B_C: torch.Tensor
    completion_mask_B_C: torch.Tensor
    logprobs_B_C: torch.Tensor
    versions_B_C: torch.Tensor


@dataclass(frozen=True)
class WeightInfo:
    """What an engine reports about the weights it serves."""

    version: int
    checksum: str


@runtime_checkable
class InferenceEngine(Protocol):
    """An engine that samples completions and receives new weights with their version."""

    async def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams) -> GenerateResult:
        """Sample one completion for each prompt (token ids in, token ids + logprobs out)."""
        ...

    async def load_weights(self, path: str, version: int) -> WeightInfo:
        """Load the weights published at ``path`` and serve them as ``version``; returns what it now serves.

        Same semantics on every engine: generations already submitted finish on the old weights, later ones
        run on the new weights (the embedded engine serialises on its worker thread; vLLM pauses with
        ``mode=wait`` and always resumes). ``WeightInfo.checksum`` is ``state_dict_checksum`` of the loaded
        weights under the trainer's names.
        """
        ...

    async def weight_info(self) -> WeightInfo:
        """The version and checksum of the weights served now."""
        ...

    async def close(self) -> None:
        """Release the engine's resources; idempotent."""
        ...
