"""Batched autoregressive sampling with a transformers KV cache: the embedded engine's decode loop.

Shape names: ``B`` = sequences, ``P`` = prompt tokens (left-padded), ``C`` = completion tokens (right-padded),
``V`` = vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from rlsdk.engine.inference.protocol import SamplingParams
from rlsdk.engine.inference.stopping import StopCriteria


def _validate_params(max_new_tokens: int, temperature: float, top_k: int, top_p: float) -> None:
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} is invalid: allowed >= 1")
    if temperature < 0:
        raise ValueError(f"temperature={temperature!r} is invalid: allowed >= 0 (0 = greedy)")
    if top_k < 0:
        raise ValueError(f"top_k={top_k!r} is invalid: allowed >= 0 (0 = off)")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p!r} is invalid: allowed (0, 1] (1 = off)")


def left_pad(
    prompt_ids: Sequence[Sequence[int]], pad_token_id: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token-id lists into ``(prompt_ids_B_P, prompt_mask_B_P)`` (int64 ids, bool mask).

    Raises:
        ValueError: no prompts, or an empty prompt (index named).
    """
    if len(prompt_ids) == 0:
        raise ValueError("prompt_ids is empty: need at least one prompt")
    lengths = [len(ids) for ids in prompt_ids]
    for index, length in enumerate(lengths):
        if length == 0:
            raise ValueError(f"prompt_ids[{index}] is empty: every prompt needs at least one token")
    width = max(lengths)
    ids_B_P = torch.full((len(prompt_ids), width), pad_token_id, dtype=torch.long)
    mask_B_P = torch.zeros((len(prompt_ids), width), dtype=torch.bool)
    for row, ids in enumerate(prompt_ids):
        ids_B_P[row, width - len(ids) :] = torch.as_tensor(list(ids), dtype=torch.long)
        mask_B_P[row, width - len(ids) :] = True
    return ids_B_P.to(device), mask_B_P.to(device)


def _filter_logits(logits_B_V: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k / nucleus to -inf (the most likely token always survives)."""
    if top_k > 0 and top_k < logits_B_V.shape[-1]:
        kth_B_1 = torch.topk(logits_B_V, top_k, dim=-1).values[:, -1:]
        logits_B_V = logits_B_V.masked_fill(logits_B_V < kth_B_1, float("-inf"))
    if top_p < 1.0:
        sorted_B_V, order_B_V = torch.sort(logits_B_V, dim=-1, descending=True)
        cumulative_B_V = sorted_B_V.softmax(dim=-1).cumsum(dim=-1)
        # Drop a token when the mass before it already reaches top_p.
        drop_sorted_B_V = (cumulative_B_V - sorted_B_V.softmax(dim=-1)) >= top_p
        drop_B_V = drop_sorted_B_V.scatter(-1, order_B_V, drop_sorted_B_V)
        logits_B_V = logits_B_V.masked_fill(drop_B_V, float("-inf"))
    return logits_B_V


def sample_completions(
    model: torch.nn.Module,
    prompt_ids: Sequence[Sequence[int]],
    params: SamplingParams,
    *,
    pad_token_id: int,
    eos_token_id: int | Sequence[int],
    generator: torch.Generator | None = None,
    before_step: Callable[[int], None] | None = None,
    stop_criteria: StopCriteria | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample one completion per prompt with a KV cache: prefill, then one token per step for the batch.

    Positions are ``cumsum(attention_mask) - 1`` exactly as in
    :func:`rlsdk.algorithms.logprobs.completion_logprobs`, so on the same weights the returned logprobs equal
    the trainer's to float rounding (~1e-6 in float32).

    Sampling: ``logits / temperature``, then top-k (``params.top_k > 0``) and nucleus (``params.top_p < 1``)
    filtering, then a multinomial draw with ``generator``. ``temperature == 0`` is greedy (argmax); its
    logprobs are then those of ``log_softmax(logits)`` (temperature 1). The returned logprobs are of
    ``log_softmax(logits / temperature)`` BEFORE top-k/top-p filtering: the distribution the trainer
    recomputes with :func:`completion_logprobs` (filtering is treated as part of the environment, as vLLM
    does).

    A row stops after it samples any of the ``eos_token_id`` ids (the EOS token is part of the completion, its
    mask True) or, with ``stop_criteria`` holding stop strings, after the token that completes one in its decoded
    text (that token is kept too; see :mod:`rlsdk.engine.inference.stopping`); the batch stops when every row has
    stopped or ``params.max_new_tokens`` tokens were drawn. Without stop strings the only device-host sync per
    decode step is that one "all rows finished?" check.

    Runs under ``torch.inference_mode()``: the returned tensors are inference tensors; ``.clone()`` them
    outside inference mode before using them in autograd.

    Args:
        model: a transformers causal LM (eval mode expected); its device is used for all tensors.
        prompt_ids: one non-empty list of token ids per prompt.
        params: ``max_new_tokens``, ``temperature``, ``top_k``, ``top_p``; ``params.seed`` is ignored here
            (the caller passes a seeded ``generator``).
        pad_token_id: id written after a row's end.
        eos_token_id: the id, or ids, that end a row (ignored when ``stop_criteria`` is given).
        generator: RNG for the draws; ``None`` uses torch's default generator.
        before_step: called as ``before_step(t)`` before the forward pass that yields token column ``t``
            (``t >= 1``; the prefill yields column 0). An interruptible engine swaps weights there: tokens from
            column ``t`` on come from the new weights, over the KV cache the old ones wrote (kept, not
            recomputed, as vLLM keeps in-flight requests across a weight update).
        stop_criteria: what ends a row (EOS ids and stop strings); ``None``: the ``eos_token_id`` ids only.

    Returns:
        ``(completion_ids_B_C, completion_mask_B_C, logprobs_B_C)``: int64 ids (pad after the end), bool mask,
        float32 logprobs (0.0 where the mask is False). ``C`` is the longest completion (<= max_new_tokens).

    Raises:
        ValueError: empty prompt list or prompt, or invalid sampling parameters.
    """
    from transformers import DynamicCache

    max_new_tokens, temperature = params.max_new_tokens, params.temperature
    top_k, top_p = params.top_k, params.top_p
    _validate_params(max_new_tokens, temperature, top_k, top_p)
    device = next(model.parameters()).device
    stopping = stop_criteria if stop_criteria is not None else StopCriteria(eos_token_id)
    scale = temperature if temperature > 0 else 1.0

    with torch.inference_mode():
        # Prefill each distinct prompt once (a GRPO group repeats its prompt group_size times), then give every
        # row its prompt's cache and last logits: the same numbers as a per-row prefill.
        distinct: dict[tuple[int, ...], int] = {}
        inverse = [distinct.setdefault(tuple(ids), len(distinct)) for ids in prompt_ids]
        batch = len(prompt_ids)
        if () in distinct:  # left_pad would name the index among the distinct prompts
            left_pad(prompt_ids, pad_token_id)
        unique_ids_U_P, unique_mask_U_P = left_pad(list(distinct), pad_token_id, device)
        position_ids_U_P = (unique_mask_U_P.long().cumsum(dim=1) - 1).clamp(min=0)
        cache = DynamicCache()
        output = model(
            input_ids=unique_ids_U_P,
            attention_mask=unique_mask_U_P.long(),
            position_ids=position_ids_U_P,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        attention_mask_B_T = unique_mask_U_P.long()
        next_position_B_1 = position_ids_U_P[:, -1:] + 1
        first_logits_B_1_V = output.logits
        if len(distinct) < batch:
            inverse_B = torch.tensor(inverse, dtype=torch.long, device=device)
            cache.batch_select_indices(inverse_B)
            attention_mask_B_T = attention_mask_B_T[inverse_B]
            next_position_B_1 = next_position_B_1[inverse_B]
            first_logits_B_1_V = first_logits_B_1_V[inverse_B]

        tokens_B_C = torch.full((batch, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
        mask_B_C = torch.zeros((batch, max_new_tokens), dtype=torch.bool, device=device)
        logprobs_B_C = torch.zeros((batch, max_new_tokens), dtype=torch.float32, device=device)
        finished_B = torch.zeros(batch, dtype=torch.bool, device=device)
        steps = 0
        logits_B_1_V = first_logits_B_1_V
        for step in range(max_new_tokens):
            logits_B_V = logits_B_1_V[:, -1, :].float() / scale
            logprobs_B_V = torch.log_softmax(logits_B_V, dim=-1)
            if temperature == 0:
                token_B = logits_B_V.argmax(dim=-1)
            else:
                probs_B_V = _filter_logits(logits_B_V, top_k, top_p).softmax(dim=-1)
                token_B = torch.multinomial(probs_B_V, 1, generator=generator).squeeze(1)
            active_B = ~finished_B
            tokens_B_C[:, step] = torch.where(active_B, token_B, pad_token_id)
            mask_B_C[:, step] = active_B
            logprobs_B_C[:, step] = torch.where(
                active_B, logprobs_B_V.gather(-1, token_B.unsqueeze(-1)).squeeze(-1), 0.0
            )
            finished_B = finished_B | stopping.ended_B(tokens_B_C[:, : step + 1], active_B)
            steps = step + 1
            # One host sync per step: stop as soon as every row has ended.
            if steps == max_new_tokens or bool(finished_B.all()):
                break
            attention_mask_B_T = torch.cat([attention_mask_B_T, attention_mask_B_T.new_ones((batch, 1))], dim=1)
            if before_step is not None:
                before_step(steps)
            output = model(
                input_ids=tokens_B_C[:, step : step + 1],
                attention_mask=attention_mask_B_T,
                position_ids=next_position_B_1,
                past_key_values=cache,
                use_cache=True,
            )
            logits_B_1_V = output.logits
            next_position_B_1 = next_position_B_1 + 1

        return tokens_B_C[:, :steps], mask_B_C[:, :steps], logprobs_B_C[:, :steps]
