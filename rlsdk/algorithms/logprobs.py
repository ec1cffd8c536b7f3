"""Per-token log-probabilities and entropies of completions under a causal LM.

Shape names: ``B`` = sequences, ``T`` = time, ``V`` = vocabulary, ``P`` = prompt tokens (left-padded),
``C`` = completion tokens (right-padded).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch

from rlsdk.algorithms.chunked_head import head_logprobs

# The standard library's logger for this module: the one rlsdk.observe.logging.get_logger(__name__) returns (under
# 'rlsdk'), without algorithms depending on anything but torch.
logger = logging.getLogger(__name__)

# The largest float32 logits tensor ``completion_logprobs`` materialises (bytes). A micro-batch whose ``[B, C, V]``
# logits fit takes the one-call path (the toy task: 16-token vocabulary); beyond it the LM head runs fused, one
# chunk of this many bytes of logits at a time, so the peak no longer grows with ``B x C x V``.
DEFAULT_MAX_LOGITS_BYTES = 32 * 2**20


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
    return _gather(_log_softmax(logits_B_T_V, temperature), tokens_B_T)


def token_entropy(logits_B_T_V: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of ``softmax(logits / temperature)`` at every position, float32, in nats.

    Raises:
        ValueError: ``logits_B_T_V`` is not 3-D or ``temperature <= 0``.
    """
    _check_temperature(temperature)
    if logits_B_T_V.dim() != 3:
        raise ValueError(f"logits_B_T_V must be 3-D [B, T, V], got shape {tuple(logits_B_T_V.shape)}")
    return _entropy(_log_softmax(logits_B_T_V, temperature))


def _log_softmax(logits_B_T_V: torch.Tensor, temperature: float) -> torch.Tensor:
    """``log_softmax(logits / temperature)`` in float32."""
    return torch.log_softmax(logits_B_T_V.float() / temperature, dim=-1)


def _gather(logprobs_B_T_V: torch.Tensor, tokens_B_T: torch.Tensor) -> torch.Tensor:
    """The log-probabilities of ``tokens_B_T``."""
    return logprobs_B_T_V.gather(-1, tokens_B_T.long().unsqueeze(-1)).squeeze(-1)


def _entropy(logprobs_B_T_V: torch.Tensor) -> torch.Tensor:
    """``-sum(p * log p)`` over the last dimension, from log-probabilities."""
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
    max_logits_bytes: int | None = DEFAULT_MAX_LOGITS_BYTES,
    uniform_calls: bool = False,
    prompt_groups_B: torch.Tensor | None = None,
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
            ``batch_select_indices`` that the prompt pass filled (every transformers causal LM, unless gradient
            checkpointing turns its cache off); otherwise the one-call path runs.
        max_logits_bytes: > 0, the largest float32 logits tensor to materialise. When the completion logits
            (``B x C x V x 4`` bytes) exceed it and the model's output embedding is a plain ``nn.Linear`` (every
            transformers causal LM without a logits post-processor), the LM head runs fused: the model returns
            its final hidden states to :func:`~rlsdk.algorithms.chunked_head.head_logprobs`, which applies the
            head one chunk of ``max_logits_bytes`` of logits at a time and recomputes each chunk in the backward
            (same values and gradients to float rounding). ``None``: always materialise ``[B, C, V]`` logits.
        uniform_calls: make the same model calls whatever the data (given whether ``C == 1``): with
            ``share_prompts`` the prompt pass runs even when no prompt repeats. FSDP2 ranks all-gather in every
            model call, so ranks whose micro-batches differ in repeats would otherwise issue different collectives
            and hang (the shared path makes one call when ``C == 1``, two otherwise: callers that trim
            micro-batches keep ``C >= 2`` where the batch has it).
        prompt_groups_B: with ``share_prompts``, int64 ON THE CPU, equal for rows with the same prompt (same ids
            under the same mask, as :meth:`rlsdk.engine.train.engine.TrainEngine.with_prompt_groups` computes from
            the CPU copy of a batch): the distinct prompts are then found from it on the host. ``None``: from the
            ids, which on a GPU copies them to the host (a device-host sync per call).

    Returns:
        ``(logprobs_B_C, entropy_B_C or None)``, float32, in nats.

    Raises:
        ValueError: mismatched shapes (naming the tensors), ``P == 0``, ``temperature <= 0`` or
            ``max_logits_bytes <= 0``.
        RuntimeError: on the fused path, the model changed the head's output before returning it (e.g. logit
            soft-capping); pass ``max_logits_bytes=None`` for such a model.
    """
    _check_completion_inputs(
        temperature, max_logits_bytes, prompt_ids_B_P, prompt_mask_B_P, completion_ids_B_C, completion_mask_B_C,
        attention_mask_B_C,
    )  # fmt: skip
    context_mask_B_C = completion_mask_B_C if attention_mask_B_C is None else attention_mask_B_C
    attention_mask_B_T = torch.cat([prompt_mask_B_P.long(), context_mask_B_C.long()], dim=1)
    position_ids_B_T = (attention_mask_B_T.cumsum(dim=1) - 1).clamp(min=0)
    head = _fusable_head(model, completion_ids_B_C.numel(), max_logits_bytes)
    if head is not None:
        assert max_logits_bytes is not None  # a head is only returned with a budget
        fused = _FusedHead(head, temperature, with_entropy, entropy_grad, max_logits_bytes)
        return _fused_completion_logprobs(
            model, fused, prompt_ids_B_P, prompt_mask_B_P, completion_ids_B_C, attention_mask_B_T, position_ids_B_T,
            share_prompts=share_prompts, uniform_calls=uniform_calls, prompt_groups_B=prompt_groups_B,
        )  # fmt: skip
    logits_B_C_V = None
    if share_prompts:
        logits_B_C_V = _shared_prompt_logits(
            model, prompt_ids_B_P, prompt_mask_B_P, completion_ids_B_C, attention_mask_B_T, position_ids_B_T,
            uniform_calls=uniform_calls, prompt_groups_B=prompt_groups_B,
        )  # fmt: skip
    if logits_B_C_V is None:
        logits_B_C_V = _one_call_logits(model, prompt_ids_B_P, completion_ids_B_C, attention_mask_B_T, position_ids_B_T)
    return _logprobs_and_entropy(logits_B_C_V, completion_ids_B_C, temperature, with_entropy, entropy_grad)


def _check_completion_inputs(
    temperature: float,
    max_logits_bytes: int | None,
    prompt_ids_B_P: torch.Tensor,
    prompt_mask_B_P: torch.Tensor,
    completion_ids_B_C: torch.Tensor,
    completion_mask_B_C: torch.Tensor,
    attention_mask_B_C: torch.Tensor | None,
) -> None:
    """Raise on an argument :func:`completion_logprobs` rejects (its "Raises: ValueError")."""
    _check_temperature(temperature)
    if max_logits_bytes is not None and max_logits_bytes <= 0:
        raise ValueError(f"max_logits_bytes={max_logits_bytes!r} is invalid: allowed > 0 or None")
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
    if prompt_ids_B_P.shape[1] == 0:
        raise ValueError("prompt_ids_B_P has no columns: every sequence needs at least one prompt token")


def _one_call_logits(
    model: torch.nn.Module,
    prompt_ids_B_P: torch.Tensor,
    completion_ids_B_C: torch.Tensor,
    attention_mask_B_T: torch.Tensor,
    position_ids_B_T: torch.Tensor,
) -> torch.Tensor:
    """``logits_B_C_V`` predicting each completion token, from one model call over ``cat(prompt, completion)``
    that keeps only the last ``C + 1`` positions' logits."""
    completion_len = completion_ids_B_C.shape[1]
    output = model(
        input_ids=torch.cat([prompt_ids_B_P, completion_ids_B_C], dim=1).long(),
        attention_mask=attention_mask_B_T,
        position_ids=position_ids_B_T,
        use_cache=False,
        logits_to_keep=completion_len + 1,
    )
    # The kept logits are positions P-1 .. P+C-1; the last one predicts past the completion.
    return output.logits[:, -(completion_len + 1) : -1]


def _logprobs_and_entropy(
    logits_B_C_V: torch.Tensor,
    completion_ids_B_C: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(logprobs_B_C, entropy_B_C or None)`` from materialised logits; the entropy in the autograd graph only
    with ``entropy_grad``."""
    if not with_entropy:
        return token_logprobs(logits_B_C_V, completion_ids_B_C, temperature), None
    _check_temperature(temperature)
    # One [B, C, V] log-softmax serves both: the logprobs gather from it, the entropy reads it.
    logprobs_B_C_V = _log_softmax(logits_B_C_V, temperature)
    logprobs_B_C = _gather(logprobs_B_C_V, completion_ids_B_C)
    if entropy_grad:  # a loss term (entropy bonus): gradients flow through it
        return logprobs_B_C, _entropy(logprobs_B_C_V)
    with torch.no_grad():  # a metric only: keep it out of the autograd graph
        return logprobs_B_C, _entropy(logprobs_B_C_V.detach())


def distinct_rows(rows: list[list[int]]) -> tuple[list[int], list[int]]:
    """``(first, inverse)``: the index of each distinct row's first occurrence, in order of appearance, and for
    every row the position of its distinct row in ``first``. A dict over the rows: one hash per row, where
    ``torch.unique(dim=0)`` sorts them."""
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
    *,
    uniform_calls: bool = False,
    prompt_groups_B: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The logits ``completion_logprobs`` needs (``[B, C, V]``, predicting each completion token), with every
    distinct prompt through the model once; ``None`` when no prompt repeats or the model returns no selectable
    cache (the caller then runs the one-call path).

    Exact by construction: a completion attends to its prompt's keys/values, which depend only on that prompt's
    ids, mask and positions; rows with the same ids under the same mask (padding zeroed) share them. The cache
    rows are gathered with an index, so gradients from every completion flow back into the shared prompt pass.
    """
    prompt_len = prompt_ids_B_P.shape[1]
    completion_len = completion_ids_B_C.shape[1]
    distinct = _distinct_prompts(prompt_ids_B_P, prompt_mask_B_P, uniform_calls, prompt_groups_B)
    if distinct is None:
        return None
    first_U, inverse_B = distinct
    prompt_pass = _prompt_pass(model, prompt_ids_B_P, prompt_mask_B_P, first_U)
    if prompt_pass is None:
        return None
    output, cache = prompt_pass
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


def _distinct_prompts(
    prompt_ids_B_P: torch.Tensor,
    prompt_mask_B_P: torch.Tensor,
    uniform_calls: bool = False,
    prompt_groups_B: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(first_U, inverse_B)`` of the distinct prompts (same ids under the same mask, padding zeroed; see
    :func:`distinct_rows`), on the ids' device; None when no prompt repeats, unless ``uniform_calls``.
    ``prompt_groups_B`` (CPU): found from those labels on the host, no device-host copy."""
    if prompt_groups_B is not None:
        return _distinct_groups(prompt_groups_B, prompt_ids_B_P.device, uniform_calls)
    prompt_mask_B_P = prompt_mask_B_P.long()
    key_B_2P = torch.cat([prompt_ids_B_P.long() * prompt_mask_B_P, prompt_mask_B_P], dim=1)
    first_U, inverse = distinct_rows(key_B_2P.tolist())  # on a GPU, a device-host sync: see prompt_groups_B
    if len(first_U) == key_B_2P.shape[0] and not uniform_calls:
        return None
    return torch.tensor(first_U, device=key_B_2P.device), torch.tensor(inverse, device=key_B_2P.device)


def _distinct_groups(
    groups_B: torch.Tensor, device: torch.device, uniform_calls: bool
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`_distinct_prompts` from per-row group labels held on the CPU: host work only, then two small copies
    to ``device``. Groups come in the order of their labels, not of first appearance (any order shares the same
    prompts)."""
    if groups_B.device.type != "cpu":
        raise ValueError(f"prompt_groups_B must be on the CPU (it spares a device-host copy), got {groups_B.device}")
    unique_U, inverse_B = torch.unique(groups_B, return_inverse=True)
    batch, count = groups_B.shape[0], unique_U.shape[0]
    if count == batch and not uniform_calls:
        return None
    rows_B = torch.arange(batch)
    first_U = torch.full((count,), batch, dtype=torch.long).scatter_reduce(0, inverse_B, rows_B, reduce="amin")
    return first_U.to(device, non_blocking=True), inverse_B.to(device, non_blocking=True)


def _prompt_pass(
    model: torch.nn.Module,
    prompt_ids_B_P: torch.Tensor,
    prompt_mask_B_P: torch.Tensor,
    first_U: torch.Tensor,
) -> tuple[Any, Any] | None:
    """Run each distinct prompt (rows ``first_U``) through ``model`` once (``logits_to_keep=1``); ``(output,
    cache)``, or None when the model returned no selectable cache or left it empty (gradient checkpointing turns
    the cache off)."""
    prompt_len = prompt_ids_B_P.shape[1]
    prompt_ids_U_P = prompt_ids_B_P[first_U].long()
    prompt_mask_U_P = prompt_mask_B_P[first_U].long()
    output = model(
        input_ids=prompt_ids_U_P * prompt_mask_U_P,
        attention_mask=prompt_mask_U_P,
        position_ids=(prompt_mask_U_P.cumsum(dim=1) - 1).clamp(min=0),
        use_cache=True,
        logits_to_keep=1,
    )
    cache = getattr(output, "past_key_values", None)
    if not callable(getattr(cache, "batch_select_indices", None)) or cache.get_seq_length() != prompt_len:
        return None
    return output, cache


def _fusable_head(model: torch.nn.Module, num_tokens: int, max_logits_bytes: int | None) -> torch.nn.Linear | None:
    """The model's output embedding when the fused path applies: a budget is set, ``num_tokens`` tokens' float32
    logits exceed it, and the head is a plain ``nn.Linear`` (a wrapped head, e.g. a LoRA layer, computes more than
    ``hidden @ weight.T``: it keeps the one-call path, with a warning)."""
    if max_logits_bytes is None:
        return None
    inner = getattr(model, "module", model)  # DDP's wrapped model; FSDP2 shards the model in place
    get_head = getattr(inner, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    weight = getattr(head, "weight", None)
    if head is None or weight is None or num_tokens * weight.shape[0] * 4 <= max_logits_bytes:
        return None
    if type(head).forward is not torch.nn.Linear.forward or "forward" in vars(head):
        logger.warning(
            "%s's output embedding is a %s, not a plain nn.Linear: its [B, C, V] logits are materialised "
            "(%d tokens x %d vocabulary)",
            type(inner).__name__,
            type(head).__name__,
            num_tokens,
            weight.shape[0],
        )
        return None
    return head


class _FusedHead:
    """Makes a model call return log-probabilities instead of logits: while :meth:`targets` is active, the output
    embedding's forward is replaced by :func:`head_logprobs` on the hidden states it receives, inside the model's
    own forward (so DDP's and FSDP2's forward hooks, and FSDP2's unsharded head weight, apply as usual)."""

    def __init__(
        self, head: torch.nn.Linear, temperature: float, with_entropy: bool, entropy_grad: bool, chunk_bytes: int
    ) -> None:
        self.head = head
        self.temperature, self.with_entropy, self.entropy_grad = temperature, with_entropy, entropy_grad
        self.chunk_bytes = chunk_bytes

    @contextlib.contextmanager
    def targets(self, tokens_B_K: torch.Tensor, rows_B: torch.Tensor | None = None) -> Iterator[list[torch.Tensor]]:
        """Within the block, the head maps hidden states ``[R, K', H]`` (``K' >= K``; the first ``K`` positions are
        used, rows gathered by ``rows_B`` when given) to ``[B, K, 1 or 2]``: log-probabilities of ``tokens_B_K``
        (and entropies). Yields the list the head appends its outputs to."""
        produced: list[torch.Tensor] = []
        head = self.head

        def forward(hidden_R_K_H: torch.Tensor) -> torch.Tensor:
            hidden_B_K_H = hidden_R_K_H[:, : tokens_B_K.shape[1]]
            if rows_B is not None:
                hidden_B_K_H = hidden_B_K_H[rows_B]
            logprobs_B_K, entropy_B_K = head_logprobs(
                hidden_B_K_H,
                head.weight,
                tokens_B_K,
                bias_V=head.bias,
                temperature=self.temperature,
                with_entropy=self.with_entropy,
                entropy_grad=self.entropy_grad,
                chunk_bytes=self.chunk_bytes,
            )
            parts = [logprobs_B_K] if entropy_B_K is None else [logprobs_B_K, entropy_B_K]
            produced.append(torch.stack(parts, dim=-1))
            return produced[-1]

        head.forward = forward  # type: ignore[method-assign]  # an instance attribute: the class's stays as is
        try:
            yield produced
        finally:
            del head.forward

    def split(self, output: Any, produced: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(logprobs_B_K, entropy_B_K or None)`` from a model output; the model must have returned the head's
        output unchanged."""
        if not produced or output.logits is not produced[-1]:
            raise RuntimeError(
                "the model changed its LM head's output before returning it (e.g. logit soft-capping or scaling), "
                "so its log-probabilities cannot be fused with the head; call completion_logprobs with "
                "max_logits_bytes=None for this model"
            )
        stacked_B_K_E = produced[-1]
        if not self.with_entropy:
            return stacked_B_K_E[..., 0], None
        entropy_B_K = stacked_B_K_E[..., 1]
        return stacked_B_K_E[..., 0], (entropy_B_K if self.entropy_grad else entropy_B_K.detach())


def _fused_completion_logprobs(
    model: torch.nn.Module,
    fused: _FusedHead,
    prompt_ids_B_P: torch.Tensor,
    prompt_mask_B_P: torch.Tensor,
    completion_ids_B_C: torch.Tensor,
    attention_mask_B_T: torch.Tensor,
    position_ids_B_T: torch.Tensor,
    *,
    share_prompts: bool,
    uniform_calls: bool,
    prompt_groups_B: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`completion_logprobs` with the LM head fused (``fused``): the same one-call and shared-prompt model
    calls, each returning log-probabilities (and entropies) of its completion tokens instead of logits."""
    prompt_len = prompt_ids_B_P.shape[1]
    completion_ids_B_C = completion_ids_B_C.long()
    completion_len = completion_ids_B_C.shape[1]
    distinct = (
        _distinct_prompts(prompt_ids_B_P, prompt_mask_B_P, uniform_calls, prompt_groups_B) if share_prompts else None
    )
    if distinct is not None:
        first_U, inverse_B = distinct
        with fused.targets(completion_ids_B_C[:, :1], rows_B=inverse_B) as produced:
            prompt_pass = _prompt_pass(model, prompt_ids_B_P, prompt_mask_B_P, first_U)
        if prompt_pass is not None:
            output, cache = prompt_pass
            first = fused.split(output, produced)
            if completion_len == 1:
                return first
            cache.batch_select_indices(inverse_B)
            with fused.targets(completion_ids_B_C[:, 1:]) as produced:
                output = model(
                    input_ids=completion_ids_B_C[:, :-1],
                    attention_mask=attention_mask_B_T[:, : prompt_len + completion_len - 1],
                    position_ids=position_ids_B_T[:, prompt_len : prompt_len + completion_len - 1],
                    past_key_values=cache,
                    use_cache=True,
                )
            rest = fused.split(output, produced)
            entropy_B_C = None if first[1] is None else torch.cat([first[1], rest[1]], dim=1)  # type: ignore[list-item]
            return torch.cat([first[0], rest[0]], dim=1), entropy_B_C
    with fused.targets(completion_ids_B_C) as produced:
        output = model(
            input_ids=torch.cat([prompt_ids_B_P, completion_ids_B_C], dim=1).long(),
            attention_mask=attention_mask_B_T,
            position_ids=position_ids_B_T,
            use_cache=False,
            logits_to_keep=completion_len + 1,  # positions P-1 .. P+C-1; the head uses the first C
        )
    return fused.split(output, produced)
