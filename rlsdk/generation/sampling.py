"""Batched autoregressive sampling with a transformers KV cache: the decode loop of every engine that generates
in-process (the embedded engine in the controller, the colocated engine on the train ranks).

Why the decode path looks as it does (each item was a visible share of a profiled S1 rollout, see the benchmarks
page): the model's matrix products should be all that a decode step costs. So a step copies no cache (transformers'
``DynamicCache`` concatenates every layer's keys and values once per step; :mod:`rlsdk.generation.kv_cache` writes
one column in place), draws its tokens with one uniform per row instead of one exponential variate per vocabulary
entry (``torch.multinomial``), concatenates no attention mask, and leaves finished rows out of the batch. The
elementwise ops between the matrix products (norms, rotary embedding, SiLU) can be fused by ``torch.compile``
(``decode_step='compile'``), at the price of compiling once per model.

Shape names: ``B`` = sequences, ``P`` = prompt tokens (left-padded), ``C`` = completion tokens (right-padded),
``V`` = vocabulary.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch

from rlsdk.generation.params import SamplingParams
from rlsdk.generation.stopping import StopCriteria

DecodeStep = Literal["eager", "compile"]
"""How a decode step runs: the model's eager forward, or that forward compiled with ``torch.compile``."""


def validate_params(max_new_tokens: int, temperature: float, top_k: int, top_p: float) -> None:
    """Raise ValueError naming the first sampling parameter out of range and what is allowed (every engine)."""
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


def _draw(
    weights_A_V: torch.Tensor, rows_A: torch.Tensor | None, batch: int, generator: torch.Generator | None
) -> torch.Tensor:
    """One token per row, drawn with probability proportional to ``weights_A_V`` (non-negative, not necessarily
    normalised; a zero weight is never drawn): the inverse of the row's cumulative distribution at one uniform draw.

    Why not ``torch.multinomial``: for one sample it draws an exponential variate for every vocabulary entry of
    every row (the Gumbel-max trick), and on a CPU that RNG work is the costliest op of a decode step at real
    vocabulary sizes. This draws one uniform per row. The cumulative sums are in float64, so a token's share of its
    row's probability is exact to far below float32's resolution.

    ``rows_A``: once finished rows have left the batch, each remaining row's index among the ``batch`` rows the call
    started with. The uniforms are still drawn for all ``batch`` rows and each row takes its own, so the
    generator's stream, and so every row's tokens, stay what they would be without compaction."""
    uniform_B = torch.rand(batch, dtype=torch.float64, device=weights_A_V.device, generator=generator)
    uniform_A = uniform_B if rows_A is None else uniform_B[rows_A]
    cumulative_A_V = weights_A_V.to(torch.float64).cumsum(dim=-1)
    target_A_1 = (uniform_A * cumulative_A_V[:, -1]).unsqueeze(1)
    token_A = torch.searchsorted(cumulative_A_V, target_A_1, right=True).squeeze(1)
    return token_A.clamp_(max=weights_A_V.shape[-1] - 1)


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
    decode_step: DecodeStep = "eager",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample one completion per prompt with a KV cache: prefill, then one token per step for the batch.

    Positions are ``cumsum(attention_mask) - 1`` exactly as in
    :func:`rlsdk.algorithms.logprobs.completion_logprobs`, so on the same weights the returned logprobs equal
    the trainer's to float rounding (~1e-6 in float32).

    Sampling: ``logits / temperature``, then top-k (``params.top_k > 0``) and nucleus (``params.top_p < 1``)
    filtering, then one draw from the result with ``generator`` (:func:`_draw`: one uniform per row).
    ``temperature == 0`` is greedy (argmax); its logprobs are then those of ``log_softmax(logits)`` (temperature
    1). The returned logprobs are of ``log_softmax(logits / temperature)`` BEFORE top-k/top-p filtering: the
    distribution the trainer recomputes with :func:`completion_logprobs` (filtering is treated as part of the
    environment, as vLLM does).

    The decode path (see the module docstring): each distinct prompt is prefilled once and its keys and values
    copied to every row of it, into a cache preallocated for the whole generation
    (:mod:`rlsdk.generation.kv_cache`), so no decode step copies the cache; a step writes one column of
    preallocated token, mask and logprob buffers for the whole batch at once (no loop over rows); ``decode_step``
    chooses the model's eager forward or its compiled one (:func:`decode_forward`).

    A row stops after it samples any of the ``eos_token_id`` ids (the EOS token is part of the completion, its
    mask True) or, with ``stop_criteria`` holding stop strings, after the token that completes one in its decoded
    text (that token is kept too; see :mod:`rlsdk.generation.stopping`); the batch stops when every row has
    stopped or ``params.max_new_tokens`` tokens were drawn. Finished rows leave the batch (their key/value cache
    rows dropped, so later decode steps do no work for them) once the row-steps that saves, finished rows x steps
    left, reach the batch's rows (the cost of copying the cache once): at once in a long generation, rarely in a
    short one. A seeded call draws the same tokens either way (see :func:`_draw`). The EOS test runs on the
    device's tensors; without stop strings the only value read back to the host per decode step is the count of
    finished rows.

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
        decode_step: 'eager' (default) or 'compile' (``inference.decode_step``; :func:`decode_forward`).

    Returns:
        ``(completion_ids_B_C, completion_mask_B_C, logprobs_B_C)``: int64 ids (pad after the end), bool mask,
        float32 logprobs (0.0 where the mask is False). ``C`` is the longest completion (<= max_new_tokens).

    Raises:
        ValueError: empty prompt list or prompt, an empty ``eos_token_id`` list, invalid sampling parameters, or an
            unknown ``decode_step``.
    """
    validate_params(params.max_new_tokens, params.temperature, params.top_k, params.top_p)
    forward = decode_forward(model, decode_step)
    device = next(model.parameters()).device
    stopping = stop_criteria if stop_criteria is not None else StopCriteria(eos_token_id)
    with torch.inference_mode():
        capacity = max(len(ids) for ids in prompt_ids) + params.max_new_tokens if prompt_ids else 0
        cache, attention_mask_A_T, next_position_A_1, logits_A_1_V = _prefill(
            model, prompt_ids, pad_token_id, device, capacity=capacity
        )
        return _decode(
            model,
            cache,
            logits_A_1_V,
            attention_mask_A_T,
            next_position_A_1,
            len(prompt_ids),
            params,
            stopping,
            pad_token_id=pad_token_id,
            generator=generator,
            before_step=before_step,
            forward=forward,
        )


def _prefill(
    model: torch.nn.Module,
    prompt_ids: Sequence[Sequence[int]],
    pad_token_id: int,
    device: torch.device,
    *,
    capacity: int = 0,
) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(cache, attention_mask_B_T, next_position_B_1, logits_B_1_V)`` after the prompts' forward pass.

    Each distinct prompt is prefilled once (a GRPO group repeats its prompt group_size times), then every row
    gets its prompt's cache and last logits: the same numbers as a per-row prefill. With ``capacity`` > 0 the cache
    is preallocated (:mod:`rlsdk.generation.kv_cache`) for that many positions per row, the prompt's included."""
    from transformers import DynamicCache

    from rlsdk.generation.kv_cache import preallocate

    distinct: dict[tuple[int, ...], int] = {}
    inverse = [distinct.setdefault(tuple(ids), len(distinct)) for ids in prompt_ids]
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
    attention_mask_A_T = unique_mask_U_P.long()
    next_position_A_1 = position_ids_U_P[:, -1:] + 1
    first_logits_A_1_V = output.logits
    inverse_B = None
    if len(distinct) < len(prompt_ids):
        inverse_B = torch.tensor(inverse, dtype=torch.long, device=device)
        attention_mask_A_T = attention_mask_A_T[inverse_B]
        next_position_A_1 = next_position_A_1[inverse_B]
        first_logits_A_1_V = first_logits_A_1_V[inverse_B]
    if capacity > 0:
        preallocate(cache, inverse_B, capacity)
    elif inverse_B is not None:
        cache.batch_select_indices(inverse_B)
    return cache, attention_mask_A_T, next_position_A_1, first_logits_A_1_V


def _decode(
    model: torch.nn.Module,
    cache: Any,
    logits_A_1_V: torch.Tensor,
    attention_mask_A_T: torch.Tensor,
    next_position_A_1: torch.Tensor,
    batch: int,
    params: SamplingParams,
    stopping: StopCriteria,
    *,
    pad_token_id: int,
    generator: torch.Generator | None,
    before_step: Callable[[int], None] | None,
    forward: Callable[..., Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`sample_completions`'s decode loop from the prefill's state: one token column per step, finished rows
    leaving the batch (:func:`_compact`) once that saves more than it costs.

    The attention mask is allocated once for the prompt and every new token (all ones past the prompt, so each
    step passes a view of its first columns: no per-step concatenation). ``forward``: the decode step's model call
    (a compiled one, see :func:`decode_forward`); None: ``model`` itself."""
    max_new_tokens, temperature = params.max_new_tokens, params.temperature
    scale = temperature if temperature > 0 else 1.0
    device = attention_mask_A_T.device
    step_forward = forward if forward is not None else model
    prompt_width = attention_mask_A_T.shape[1]
    attention_mask_A_T = torch.cat(
        [attention_mask_A_T, attention_mask_A_T.new_ones((attention_mask_A_T.shape[0], max_new_tokens))], dim=1
    )
    tokens_B_C = torch.full((batch, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
    mask_B_C = torch.zeros((batch, max_new_tokens), dtype=torch.bool, device=device)
    logprobs_B_C = torch.zeros((batch, max_new_tokens), dtype=torch.float32, device=device)
    # The batch's rows ("A", active): rows_A maps them to the call's rows (None: all of them, in order);
    # done_A marks rows that have ended but not yet left the batch.
    rows_A: torch.Tensor | None = None
    done_A = torch.zeros(batch, dtype=torch.bool, device=device)
    steps = 0
    for step in range(max_new_tokens):
        logits_A_V = logits_A_1_V[:, -1, :].float()
        if scale != 1.0:
            logits_A_V = logits_A_V / scale
        logprobs_A_V = torch.log_softmax(logits_A_V, dim=-1)
        if temperature == 0:
            token_A = logits_A_V.argmax(dim=-1)
        else:
            if params.top_k > 0 or params.top_p < 1.0:
                weights_A_V = _filter_logits(logits_A_V, params.top_k, params.top_p).softmax(dim=-1)
            else:
                weights_A_V = logprobs_A_V.exp()
            token_A = _draw(weights_A_V, rows_A, batch, generator)
        live_A = ~done_A
        token_A = torch.where(live_A, token_A, pad_token_id)
        token_logprob_A = torch.where(live_A, logprobs_A_V.gather(-1, token_A.unsqueeze(-1)).squeeze(-1), 0.0)
        if rows_A is None:
            tokens_B_C[:, step], mask_B_C[:, step], logprobs_B_C[:, step] = token_A, live_A, token_logprob_A
        else:
            tokens_B_C[rows_A, step], mask_B_C[rows_A, step] = token_A, live_A
            logprobs_B_C[rows_A, step] = token_logprob_A
        ended_A = stopping.ended_B(_history(stopping, token_A, tokens_B_C, rows_A, step), live_A)
        done_A = done_A | ended_A
        steps = step + 1
        if steps == max_new_tokens:
            break
        finished = int(done_A.sum())  # the one host read per decode step (a device-host sync on an accelerator)
        if finished == done_A.numel():
            break
        if finished and finished * (max_new_tokens - steps) >= done_A.numel():
            rows_A, attention_mask_A_T, next_position_A_1, token_A, done_A = _compact(
                cache, rows_A, attention_mask_A_T, next_position_A_1, token_A, done_A
            )
        if before_step is not None:
            before_step(steps)
        output = step_forward(
            input_ids=token_A.unsqueeze(1),
            attention_mask=attention_mask_A_T[:, : prompt_width + steps],
            position_ids=next_position_A_1,
            past_key_values=cache,
            use_cache=True,
        )
        logits_A_1_V = output.logits
        next_position_A_1 = next_position_A_1 + 1
    return tokens_B_C[:, :steps], mask_B_C[:, :steps], logprobs_B_C[:, :steps]


def _history(
    stopping: StopCriteria, token_A: torch.Tensor, tokens_B_C: torch.Tensor, rows_A: torch.Tensor | None, step: int
) -> torch.Tensor:
    """The tokens ``stopping`` reads to decide which rows end with ``token_A``: that token alone, unless stop
    strings need each row's earlier tokens (its decoded text)."""
    if not stopping.stop:
        return token_A.unsqueeze(1)
    if rows_A is None:
        return tokens_B_C[:, : step + 1]
    return tokens_B_C[rows_A, : step + 1]


def _compact(
    cache: Any,
    rows_A: torch.Tensor | None,
    attention_mask_A_T: torch.Tensor,
    next_position_A_1: torch.Tensor,
    token_A: torch.Tensor,
    done_A: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Drop the finished rows from the batch (the KV cache in place, the per-row state returned): ``(rows_A,
    attention_mask_A_T, next_position_A_1, token_A, done_A)`` of the rows left."""
    keep_A = (~done_A).nonzero().squeeze(1)
    cache.batch_select_indices(keep_A)
    rows_A = keep_A if rows_A is None else rows_A[keep_A]
    return rows_A, attention_mask_A_T[keep_A], next_position_A_1[keep_A], token_A[keep_A], done_A[keep_A]


_COMPILED: weakref.WeakKeyDictionary[torch.nn.Module, Callable[..., Any]] = weakref.WeakKeyDictionary()


def decode_forward(model: torch.nn.Module, decode_step: DecodeStep) -> Callable[..., Any]:
    """The call that runs ``model``'s decode steps: ``model`` itself ('eager'), or ``torch.compile(model,
    dynamic=True)`` ('compile'), made once per model object and kept while the model lives (its first decode steps
    pay the compilation; the batch dimension is dynamic, so finished rows leaving the batch do not recompile).

    Raises:
        ValueError: ``decode_step`` is neither 'eager' nor 'compile'.
    """
    if decode_step == "eager":
        return model
    if decode_step != "compile":
        raise ValueError(f"decode_step={decode_step!r} is invalid: allowed 'eager' or 'compile'")
    compiled = _COMPILED.get(model)
    if compiled is None:
        compiled = _COMPILED[model] = torch.compile(model, dynamic=True)
    return compiled
