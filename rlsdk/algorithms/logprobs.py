"""Per-token log-probabilities and entropies of completions under a causal LM.

Shape names: ``B`` = sequences, ``T`` = time, ``V`` = vocabulary, ``P`` = prompt tokens (left-padded),
``C`` = completion tokens (right-padded).
"""

from __future__ import annotations

import torch


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature={temperature!r} is invalid: allowed > 0")


def token_logprobs(logits_B_T_V: torch.Tensor, tokens_B_T: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``log_softmax(logits / temperature)`` gathered at ``tokens``.

    Computed in float32 whatever the logits' dtype (bf16 log-softmax loses ~1e-2 nats).

    Args:
        logits_B_T_V: logits predicting ``tokens_B_T`` (already shifted: position t predicts token t).
        tokens_B_T: int64 token ids.
        temperature: > 0; the sampler's temperature, so that the result is the sampling distribution.

    Returns:
        ``logprobs_B_T``, float32, in nats.

    Raises:
        ValueError: shapes disagree (``logits_B_T_V.shape[:2] != tokens_B_T.shape``) or ``temperature <= 0``.
    """
    _check_temperature(temperature)
    if logits_B_T_V.dim() != 3 or tokens_B_T.dim() != 2 or logits_B_T_V.shape[:2] != tokens_B_T.shape:
        raise ValueError(
            f"logits_B_T_V shape {tuple(logits_B_T_V.shape)} does not match tokens_B_T shape "
            f"{tuple(tokens_B_T.shape)}: need [B, T, V] and [B, T]"
        )
    logprobs_B_T_V = torch.log_softmax(logits_B_T_V.float() / temperature, dim=-1)
    return logprobs_B_T_V.gather(-1, tokens_B_T.long().unsqueeze(-1)).squeeze(-1)


def token_entropy(logits_B_T_V: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of ``softmax(logits / temperature)`` at every position, float32, in nats.

    Raises:
        ValueError: ``logits_B_T_V`` is not 3-D or ``temperature <= 0``.
    """
    _check_temperature(temperature)
    if logits_B_T_V.dim() != 3:
        raise ValueError(f"logits_B_T_V must be 3-D [B, T, V], got shape {tuple(logits_B_T_V.shape)}")
    logprobs_B_T_V = torch.log_softmax(logits_B_T_V.float() / temperature, dim=-1)
    return -(logprobs_B_T_V.exp() * logprobs_B_T_V).sum(dim=-1)


def completion_logprobs(
    model: torch.nn.Module,
    prompt_ids_B_P: torch.Tensor,
    prompt_mask_B_P: torch.Tensor,
    completion_ids_B_C: torch.Tensor,
    completion_mask_B_C: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    attention_mask_B_C: torch.Tensor | None = None,
    share_prompts: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities (and optionally entropies) of the completion tokens, in one forward pass.

    The sequence is ``cat(prompt, completion)`` with ``attention_mask = cat(prompt_mask, completion_mask)``
    and ``position_ids = (cumsum(attention_mask) - 1).clamp(min=0)``, the same positions the embedded sampler
    uses, so the result equals the sampler's logprobs on the same weights. ``logits[:, P-1 : P-1+C]`` predict
    the completion; only the last ``C + 1`` positions' logits are computed (``logits_to_keep``).

    Runs under whatever grad mode the caller has; works for a bare transformers causal LM and for one wrapped
    in DDP/FSDP (it only calls ``model(...)``). Positions where ``completion_mask_B_C`` is False hold garbage:
    mask them downstream.

    Args:
        model: a causal LM whose forward takes ``input_ids``, ``attention_mask``, ``position_ids``,
            ``use_cache`` and ``logits_to_keep`` and returns an object with ``.logits``.
        prompt_ids_B_P: int64, left-padded prompts.
        prompt_mask_B_P: bool/int, True for real prompt tokens.
        completion_ids_B_C: int64, right-padded completions.
        completion_mask_B_C: bool/int, True for generated tokens (EOS included).
        temperature: > 0, the sampling temperature.
        with_entropy: also return the entropy of the (temperature-scaled) distribution at each position
            (computed without gradient: a metric, unless ``entropy_grad``).
        entropy_grad: with ``with_entropy``, keep the entropy in the autograd graph (for an entropy bonus in
            the loss).
        attention_mask_B_C: bool/int, the completion tokens in context, when that differs from
            ``completion_mask_B_C`` (multi-turn rollouts: tool-output tokens are attended to but not trained
            on); ``None`` uses ``completion_mask_B_C``. It replaces ``completion_mask_B_C`` in the attention
            mask and the positions above.
        share_prompts: run every distinct prompt (same ids under the same mask) through the model once and
            reuse its key/value cache for each of its completions (a GRPO group's completions share one
            prompt), then run only the completions (``C - 1`` tokens: the last completion token predicts
            nothing). Two model calls instead of one, the same logprobs, entropies and gradients to float
            rounding, and ``(B - U) x P`` fewer token positions through the model (``U`` distinct prompts).
            Used only when some prompt repeats and the model's forward returns a transformers cache with
            ``batch_select_indices`` (every transformers causal LM); otherwise the one-call path runs.

    Returns:
        ``(logprobs_B_C, entropy_B_C or None)``, float32, in nats.

    Raises:
        ValueError: mismatched shapes (naming the tensors), ``P == 0`` or ``temperature <= 0``.
    """
    _check_temperature(temperature)
    if prompt_ids_B_P.dim() != 2 or prompt_ids_B_P.shape != prompt_mask_B_P.shape:
        raise ValueError(
            f"prompt_ids_B_P shape {tuple(prompt_ids_B_P.shape)} and prompt_mask_B_P shape "
            f"{tuple(prompt_mask_B_P.shape)} must be equal and 2-D"
        )
    if completion_ids_B_C.dim() != 2 or completion_ids_B_C.shape != completion_mask_B_C.shape:
        raise ValueError(
            f"completion_ids_B_C shape {tuple(completion_ids_B_C.shape)} and completion_mask_B_C shape "
            f"{tuple(completion_mask_B_C.shape)} must be equal and 2-D"
        )
    if attention_mask_B_C is not None and attention_mask_B_C.shape != completion_ids_B_C.shape:
        raise ValueError(
            f"attention_mask_B_C shape {tuple(attention_mask_B_C.shape)} must equal completion_ids_B_C shape "
            f"{tuple(completion_ids_B_C.shape)}"
        )
    if prompt_ids_B_P.shape[0] != completion_ids_B_C.shape[0]:
        raise ValueError(
            f"prompt_ids_B_P has {prompt_ids_B_P.shape[0]} rows, completion_ids_B_C has {completion_ids_B_C.shape[0]}"
        )
    prompt_len = prompt_ids_B_P.shape[1]
    completion_len = completion_ids_B_C.shape[1]
    if prompt_len == 0:
        raise ValueError("prompt_ids_B_P has no columns: every sequence needs at least one prompt token")

    context_mask_B_C = completion_mask_B_C if attention_mask_B_C is None else attention_mask_B_C
    attention_mask_B_T = torch.cat([prompt_mask_B_P.long(), context_mask_B_C.long()], dim=1)
    position_ids_B_T = (attention_mask_B_T.cumsum(dim=1) - 1).clamp(min=0)
    logits_B_C_V = None
    if share_prompts:
        logits_B_C_V = _shared_prompt_logits(
            model, prompt_ids_B_P, prompt_mask_B_P, completion_ids_B_C, attention_mask_B_T, position_ids_B_T
        )
    if logits_B_C_V is None:
        output = model(
            input_ids=torch.cat([prompt_ids_B_P, completion_ids_B_C], dim=1).long(),
            attention_mask=attention_mask_B_T,
            position_ids=position_ids_B_T,
            use_cache=False,
            logits_to_keep=completion_len + 1,
        )
        # The kept logits are positions P-1 .. P+C-1; the last one predicts past the completion.
        logits_B_C_V = output.logits[:, -(completion_len + 1) : -1]
    logprobs_B_C = token_logprobs(logits_B_C_V, completion_ids_B_C, temperature)
    entropy_B_C = None
    if with_entropy and entropy_grad:  # a loss term (entropy bonus): gradients flow through it
        entropy_B_C = token_entropy(logits_B_C_V, temperature)
    elif with_entropy:  # a metric only: keep it out of the autograd graph
        with torch.no_grad():
            entropy_B_C = token_entropy(logits_B_C_V.detach(), temperature)
    return logprobs_B_C, entropy_B_C


def distinct_rows(rows: list[list[int]]) -> tuple[list[int], list[int]]:
    """``(first, inverse)``: the index of each distinct row's first occurrence, in order of appearance, and for
    every row the position of its distinct row in ``first``. A dict over the rows: for a GRPO batch (128 rows)
    ~10x faster than ``torch.unique(dim=0)``, which sorts them."""
    slots: dict[tuple[int, ...], int] = {}
    first: list[int] = []
    inverse: list[int] = []
    for index, row in enumerate(rows):
        key = tuple(row)
        slot = slots.get(key)
        if slot is None:
            slot = slots[key] = len(first)
            first.append(index)
        inverse.append(slot)
    return first, inverse


def _shared_prompt_logits(
    model: torch.nn.Module,
    prompt_ids_B_P: torch.Tensor,
    prompt_mask_B_P: torch.Tensor,
    completion_ids_B_C: torch.Tensor,
    attention_mask_B_T: torch.Tensor,
    position_ids_B_T: torch.Tensor,
) -> torch.Tensor | None:
    """The logits ``completion_logprobs`` needs (``[B, C, V]``, predicting each completion token), with every
    distinct prompt through the model once; ``None`` when no prompt repeats or the model returns no selectable
    cache (the caller then runs the one-call path).

    Exact by construction: a completion attends to its prompt's keys/values, which depend only on that prompt's
    ids, mask and positions; rows with the same ids under the same mask (padding zeroed) share them. The cache
    rows are gathered with an index, so gradients from every completion flow back into the shared prompt pass.
    """
    batch, prompt_len = prompt_ids_B_P.shape
    completion_len = completion_ids_B_C.shape[1]
    prompt_mask_B_P = prompt_mask_B_P.long()
    key_B_2P = torch.cat([prompt_ids_B_P.long() * prompt_mask_B_P, prompt_mask_B_P], dim=1)
    first_U, inverse = distinct_rows(key_B_2P.tolist())
    if len(first_U) == batch:
        return None
    unique_U_2P = key_B_2P[torch.tensor(first_U, device=key_B_2P.device)]
    inverse_B = torch.tensor(inverse, device=key_B_2P.device)
    prompt_mask_U_P = unique_U_2P[:, prompt_len:]
    output = model(
        input_ids=unique_U_2P[:, :prompt_len],
        attention_mask=prompt_mask_U_P,
        position_ids=(prompt_mask_U_P.cumsum(dim=1) - 1).clamp(min=0),
        use_cache=True,
        logits_to_keep=1,
    )
    cache = getattr(output, "past_key_values", None)
    if not callable(getattr(cache, "batch_select_indices", None)):
        return None
    first_B_1_V = output.logits[:, -1:][inverse_B]  # the last prompt position predicts completion token 0
    if completion_len == 1:
        return first_B_1_V
    cache.batch_select_indices(inverse_B)
    rest = model(
        input_ids=completion_ids_B_C[:, :-1].long(),
        attention_mask=attention_mask_B_T[:, : prompt_len + completion_len - 1],
        position_ids=position_ids_B_T[:, prompt_len : prompt_len + completion_len - 1],
        past_key_values=cache,
        use_cache=True,
    )
    return torch.cat([first_B_1_V, rest.logits], dim=1)
