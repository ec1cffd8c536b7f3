"""Single-turn episodes: one prompt in, ``group_size`` sampled completions out, as one batched engine call."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from rlsdk.engine.inference.protocol import InferenceEngine, SamplingParams
from rlsdk.generation.sampling import left_pad
from rlsdk.generation.stopping import cut_at_stop, eos_ids_or_default
from rlsdk.workflow.rollout import Rollout


class RolloutWorkflow(Protocol):
    """Turns prompt rows into a :class:`Rollout` using an inference engine.

    ``seed`` makes the sampling reproducible (the Session derives one per rollout from ``SessionConfig.seed``);
    ``None`` leaves it to the engine.
    """

    async def arun_batch(
        self, engine: InferenceEngine, rows: Sequence[dict[str, Any]], group_size: int, *, seed: int | None = None
    ) -> Rollout: ...


class SingleTurnWorkflow:
    """Tokenise each prompt, sample ``group_size`` completions from the engine, decode them.

    A completion's text is cut before the first of ``params.stop`` it holds (vLLM's semantics, see
    :mod:`rlsdk.generation.stopping`); its tokens stay as generated. ``info["finish_reasons"]`` says per
    sample why it ended: ``"eos"`` (its last token is one of ``eos_token_ids``, default: the tokenizer's EOS),
    ``"stop"`` (a stop string) or ``"length"`` (``max_new_tokens`` reached).
    """

    def __init__(self, tokenizer: Any, params: SamplingParams, *, eos_token_ids: Sequence[int] | None = None) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.eos_token_ids = eos_ids_or_default(eos_token_ids, tokenizer)
        # the last request() answer and its key (prompts, group size, params): the Session's look-ahead asks for
        # the next batch, then arun_batch asks again for the same rows; tokenised once
        self._last_request: tuple[tuple[Any, ...], tuple[list[list[int]], list[list[int]], SamplingParams]] | None = (
            None
        )

    def request(
        self, rows: Sequence[dict[str, Any]], group_size: int, *, seed: int | None = None
    ) -> tuple[list[list[int]], list[list[int]], SamplingParams]:
        """What :meth:`arun_batch` asks the engine for: ``(prompt_ids, repeated, params)``, the prompts' token ids,
        each repeated ``group_size`` times (the ``generate`` prompts), and the sampling params with ``seed``.
        The Session's colocated look-ahead samples the next batch from this before ``arun_batch`` runs."""
        prompts = [row["prompt"] for row in rows]
        key = (self.tokenizer, tuple(prompts), group_size, seed, self.params)
        if self._last_request is not None and self._last_request[0] == key:
            return self._last_request[1]
        # one batched tokenizer call: the same ids as one call per prompt, without the per-call overhead
        prompt_ids = [list(ids) for ids in self.tokenizer(prompts)["input_ids"]] if rows else []
        repeated = [ids for ids in prompt_ids for _ in range(group_size)]
        params = self.params if seed is None else dataclasses.replace(self.params, seed=seed)
        self._last_request = (key, (prompt_ids, repeated, params))
        return prompt_ids, repeated, params

    async def arun_batch(
        self, engine: InferenceEngine, rows: Sequence[dict[str, Any]], group_size: int, *, seed: int | None = None
    ) -> Rollout:
        prompt_ids, repeated, params = self.request(rows, group_size, seed=seed)
        result = await engine.generate(repeated, params)
        pad = self.tokenizer.pad_token_id
        # each prompt padded once, then repeated: the same tensors as padding every repeated row
        prompt_ids_B_P, prompt_mask_B_P = (t.repeat_interleave(group_size, dim=0) for t in left_pad(prompt_ids, pad))
        completions = decode_completions(
            self.tokenizer, torch.where(result.completion_mask_B_C, result.completion_ids_B_C, pad).tolist()
        )
        finish_reasons = finish_reasons_of(result.completion_ids_B_C, result.completion_mask_B_C, self.eos_token_ids)
        if params.stop:
            for b, text in enumerate(completions):
                completions[b], stopped = cut_at_stop(text, params.stop)
                if stopped and finish_reasons[b] != "eos":
                    finish_reasons[b] = "stop"
        return Rollout(
            rows=[dict(row) for row in rows],
            group_size=group_size,
            prompt_ids_B_P=prompt_ids_B_P,
            prompt_mask_B_P=prompt_mask_B_P,
            completion_ids_B_C=result.completion_ids_B_C,
            completion_mask_B_C=result.completion_mask_B_C,
            logprobs_B_C=result.logprobs_B_C,
            versions_B_C=result.versions_B_C,
            completions=completions,
            info={"finish_reasons": finish_reasons},
        )


def finish_reasons_of(ids_B_C: torch.Tensor, mask_B_C: torch.Tensor, eos_token_ids: Sequence[int]) -> list[str]:
    """Per row, ``"eos"`` when its last generated token is an EOS id, else ``"length"`` (the caller marks rows a
    stop string ended)."""
    lengths_B = mask_B_C.sum(dim=1)
    last_B = ids_B_C.gather(1, (lengths_B - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    eos_B = torch.isin(last_B, torch.tensor(list(eos_token_ids), dtype=torch.long)) & (lengths_B > 0)
    return ["eos" if eos else "length" for eos in eos_B.tolist()]


def decode_completions(tokenizer: Any, ids: list[list[int]]) -> list[str]:
    """``tokenizer.batch_decode(ids, skip_special_tokens=True)``, the same strings, faster for a fast tokenizer.

    transformers' ``batch_decode`` walks every id through ``to_py_obj`` and decodes one sequence per Python call;
    a tokenizers-backed tokenizer whose decode path is transformers' own is decoded here by its Rust tokenizer
    directly, one call per sequence on this thread (``decode_batch`` hands the sequences to the tokenizers' thread
    pool: for short completions more CPU in total, on cores the engine and the ranks use), plus the same space
    clean-up. Any other tokenizer (slow,
    remote-code, a decode override, or a BPE model asking for clean-up, which transformers ignores with a
    warning) goes through ``batch_decode``.
    """
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    cls = type(tokenizer)
    if (
        not isinstance(tokenizer, TokenizersBackend)
        or cls._decode is not TokenizersBackend._decode
        or cls.decode is not PreTrainedTokenizerBase.decode
        or cls.batch_decode is not PreTrainedTokenizerBase.batch_decode
    ):
        return tokenizer.batch_decode(ids, skip_special_tokens=True)
    backend = tokenizer.backend_tokenizer
    clean_up = bool(tokenizer.clean_up_tokenization_spaces)
    if clean_up and type(backend.model).__name__ == "BPE":
        return tokenizer.batch_decode(ids, skip_special_tokens=True)
    texts = [backend.decode(row, skip_special_tokens=True) for row in ids]
    return [tokenizer.clean_up_tokenization(text) for text in texts] if clean_up else texts
