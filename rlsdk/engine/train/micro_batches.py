"""Micro-batches of a rank's shard: a count of sequences, or a token budget with sorted, trimmed padding.

Why a token budget: at real lengths the cost of a forward/backward is its padded token count, and a micro-batch
of ragged completions padded to its longest one pays for that one everywhere. With
``train.max_tokens_per_micro_batch`` the rows are sorted by length (longest first), packed greedily so that each
micro-batch's padded size (rows x (longest prompt + longest completion)) stays within the budget, and every
micro-batch is trimmed to its own longest prompt (prompts are left-padded) and completion (right-padded). The
loss normalisers are global (the whole batch's token and sequence counts), so the packing changes no gradient.

Every rank must run the same number of forward/backward passes (DDP's last-micro-batch all-reduce, FSDP2's
per-layer all-gathers), but ranks pack different data: :func:`equalize` splits the largest micro-batches of a
rank until it has as many as the rank with the most (agreed through one all-reduce of the count).
"""

from __future__ import annotations

import torch

# Shard keys laid out [B, P] (left-padded) and [B, C] (right-padded); everything else is per row.
PROMPT_KEYS = ("prompt_ids_B_P", "prompt_mask_B_P")
COMPLETION_KEYS = (
    "completion_ids_B_C",
    "completion_mask_B_C",
    "completion_attention_mask_B_C",
    "logprobs_B_C",
    "old_logprobs_B_C",
    "agreement_mask_B_C",
)


def row_lengths(shard: dict[str, torch.Tensor]) -> tuple[list[int], list[int]]:
    """``(prompt_lengths, completion_lengths)`` per row: real prompt tokens, and completion columns up to the last
    one in context (``completion_attention_mask_B_C`` when present, else ``completion_mask_B_C``)."""
    prompt_B = shard["prompt_mask_B_P"].long().sum(dim=1)
    context_B_C = shard.get("completion_attention_mask_B_C", shard["completion_mask_B_C"]).bool()
    width = context_B_C.shape[1]
    # the last True column + 1 (0 for an empty row): masks may have holes (multi-turn tool outputs)
    columns_C = torch.arange(1, width + 1, device=context_B_C.device)
    last_B = torch.where(context_B_C, columns_C, 0).amax(dim=1) if width else prompt_B * 0
    return prompt_B.tolist(), last_B.tolist()


def _padded_tokens(rows: list[int], prompts: list[int], completions: list[int]) -> int:
    return len(rows) * (max(prompts[r] for r in rows) + max(completions[r] for r in rows))


def plan(prompts: list[int], completions: list[int], *, max_tokens: int, max_sequences: int) -> list[list[int]]:
    """Row indices of each micro-batch: rows sorted longest first (prompt + completion; ties keep their order),
    packed greedily while ``rows x (longest prompt + longest completion) <= max_tokens`` and ``rows <=
    max_sequences``. A row longer than the budget alone forms its own micro-batch.

    Raises:
        ValueError: no rows, or a budget < 1.
    """
    if not prompts or len(prompts) != len(completions):
        raise ValueError(
            f"plan needs one prompt and completion length per row, got {len(prompts)} and {len(completions)}"
        )
    if max_tokens < 1 or max_sequences < 1:
        raise ValueError(f"max_tokens={max_tokens!r} and max_sequences={max_sequences!r} must both be >= 1")
    order = sorted(range(len(prompts)), key=lambda r: -(prompts[r] + completions[r]))
    batches: list[list[int]] = []
    current: list[int] = []
    for row in order:
        candidate = [*current, row]
        if current and (len(candidate) > max_sequences or _padded_tokens(candidate, prompts, completions) > max_tokens):
            batches.append(current)
            candidate = [row]
        current = candidate
    batches.append(current)
    return batches


def equalize(batches: list[list[int]], count: int, prompts: list[int], completions: list[int]) -> list[list[int]]:
    """Split the micro-batch with the most padded tokens (of those with more than one row) in two halves until
    there are ``count`` of them.

    Raises:
        ValueError: ``count`` is below the current count or above the number of rows.
    """
    rows = sum(len(b) for b in batches)
    if not len(batches) <= count <= rows:
        raise ValueError(f"cannot make {count} micro-batches from {len(batches)} micro-batches of {rows} rows")
    batches = [list(b) for b in batches]
    while len(batches) < count:
        index = max(
            (i for i, b in enumerate(batches) if len(b) > 1),
            key=lambda i: _padded_tokens(batches[i], prompts, completions),
        )
        largest = batches.pop(index)
        half = len(largest) // 2
        batches[index:index] = [largest[:half], largest[half:]]
    return batches


def take(shard: dict[str, torch.Tensor], rows: list[int], prompt_len: int, completion_len: int) -> dict:
    """The micro-batch of ``rows``, trimmed to its longest prompt (the last ``prompt_len`` columns: left padding)
    and completion (the first ``completion_len`` columns)."""
    # One index per device: host-side keys (TrainEngine.with_prompt_groups) stay on the CPU.
    indices = {torch.device("cpu"): torch.tensor(rows, dtype=torch.long)}
    micro: dict[str, torch.Tensor] = {}
    for name, tensor in shard.items():
        index = indices.get(tensor.device)
        if index is None:
            index = indices[tensor.device] = indices[torch.device("cpu")].to(tensor.device, non_blocking=True)
        selected = tensor[index]
        if name in PROMPT_KEYS:
            selected = selected[:, selected.shape[1] - prompt_len :]
        elif name in COMPLETION_KEYS:
            selected = selected[:, :completion_len]
        micro[name] = selected
    return micro
