"""Where a completion ends, decided once for every engine: the model's special tokens and the user's stop strings.

One rule per question, so the workflows, the embedded, colocated and vLLM engines, the rollout joining and the
trainer never disagree:

- **pad**: the tokenizer's pad token, else ``generation_config.pad_token_id``, else the first EOS id (TRL's rule
  ``pad_token = eos_token`` for Llama/Mistral tokenizers, which have none). Padding is always masked out, so pad
  = EOS changes no loss or logprob; :func:`apply_pad_rule` sets it on the tokenizer so every ``tokenizer.pad_token_id``
  reader sees the same id.
- **EOS**: every id of ``generation_config.eos_token_id`` (an int or a list: Llama-3-Instruct lists three) and the
  tokenizer's ``eos_token_id``. A completion ends after the first one it samples; that token is part of the
  completion (mask True, its logprob trained), as in vLLM and transformers' ``generate``.
- **stop strings** (``rollout.stop``): vLLM's semantics, matched on the decoded completion text (special tokens
  skipped). Generation ends with the token whose text completes the first occurrence of a stop string; that token
  stays in the completion's ids, mask and logprobs (the trainer sees exactly what was sampled, as vLLM's
  ``token_ids`` keep it), while the completion *text* a reward function reads is cut before the stop string
  (vLLM's default ``include_stop_str_in_output=False``): :func:`cut_at_stop`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class SpecialTokens:
    """The ids that pad and end completions, resolved from a model directory by :func:`resolve_special_tokens`.

    ``eos_token_ids`` is never empty; its first id is the tokenizer's own EOS when that is one of them.
    """

    pad_token_id: int
    eos_token_ids: tuple[int, ...]

    @property
    def eos_token_id(self) -> int:
        """The first EOS id (what code that knows one EOS reads)."""
        return self.eos_token_ids[0]


def token_id_list(value: int | Sequence[int] | None) -> list[int]:
    """A token id, a list of them or None (as ``generation_config.eos_token_id`` holds them) as a list of ints."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def eos_ids_or_default(eos_token_ids: Sequence[int] | None, tokenizer: Any) -> tuple[int, ...]:
    """``eos_token_ids`` as ints, or when None the tokenizer's one ``eos_token_id`` (none if it has none): what a
    workflow stops at when the Session has not resolved the model's EOS ids for it."""
    if eos_token_ids is None:
        eos_token_ids = token_id_list(getattr(tokenizer, "eos_token_id", None))
    return tuple(int(i) for i in eos_token_ids)


def resolve_special_tokens(path: str | Path, tokenizer: Any = None) -> SpecialTokens:
    """The pad and EOS ids of the model at ``path`` (see the module docstring for the rule).

    ``tokenizer``: the model's tokenizer when already loaded (else loaded from ``path``).

    Raises:
        ValueError: neither ``generation_config.json`` nor the tokenizer names an EOS token.
    """
    from transformers import AutoTokenizer, GenerationConfig

    path = Path(path)
    generation_eos: list[int] = []
    generation_pad: int | None = None
    if (path / "generation_config.json").is_file():
        generation_config = GenerationConfig.from_pretrained(path)
        generation_eos = token_id_list(generation_config.eos_token_id)
        pad = token_id_list(generation_config.pad_token_id)
        generation_pad = pad[0] if pad else None
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer_eos = getattr(tokenizer, "eos_token_id", None)
    eos = [tokenizer_eos] if tokenizer_eos is not None else []
    eos += [i for i in generation_eos if i not in eos]
    if not eos:
        raise ValueError(
            f"model {path} names no EOS token: neither generation_config.json's eos_token_id nor the tokenizer's "
            "eos_token is set, so no completion could end before max_new_tokens"
        )
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        pad = generation_pad if generation_pad is not None else eos[0]
    return SpecialTokens(pad_token_id=int(pad), eos_token_ids=tuple(int(i) for i in eos))


def apply_pad_rule(tokenizer: Any, special: SpecialTokens) -> Any:
    """Give ``tokenizer`` the pad token of ``special`` when it has none (returns it, changed in place): the
    workflows pad prompts with ``tokenizer.pad_token_id``, which must be the id the engines pad with."""
    if getattr(tokenizer, "pad_token_id", None) is None:
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(special.pad_token_id)
    return tokenizer


def check_stop_strings(stop: Sequence[str]) -> tuple[str, ...]:
    """``stop`` as a tuple of non-empty strings; raises ValueError naming an invalid entry."""
    if isinstance(stop, str):
        raise ValueError(f"stop={stop!r} is invalid: allowed a list of strings, not one string")
    for index, text in enumerate(stop):
        if not isinstance(text, str) or text == "":
            raise ValueError(f"stop[{index}]={text!r} is invalid: allowed a non-empty string")
    return tuple(stop)


def cut_at_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    """``(text before the earliest stop string, whether one was found)``: the completion text vLLM returns with
    ``include_stop_str_in_output=False``."""
    found = [index for index in (text.find(s) for s in stop) if index >= 0]
    if not found:
        return text, False
    return text[: min(found)], True


class StopCriteria:
    """Which rows of a decode step have ended: an EOS id sampled, or a stop string completed in the decoded text.

    The EOS test is one batched ``isin``; the stop-string test (only when ``stop`` is non-empty) decodes each
    running row's completion so far with ``decode`` (``tokenizer.decode(ids, skip_special_tokens=True)``): one
    host sync and one decode per running row per step, the price of matching text as vLLM does.
    """

    def __init__(
        self,
        eos_token_ids: int | Sequence[int],
        stop: Sequence[str] = (),
        decode: Callable[[list[int]], str] | None = None,
    ) -> None:
        """Raises ValueError: no EOS id, an invalid stop string, or stop strings without ``decode``."""
        ids = token_id_list(eos_token_ids)
        if not ids:
            raise ValueError("eos_token_ids is empty: need at least one id that ends a completion")
        self.eos_token_ids = tuple(ids)
        self.stop = check_stop_strings(stop)
        if self.stop and decode is None:
            raise ValueError("stop strings need a decode function (the model's tokenizer) to match decoded text")
        self._decode = decode
        self._eos_cache: dict[torch.device, torch.Tensor] = {}

    def _eos(self, device: torch.device) -> torch.Tensor:
        eos = self._eos_cache.get(device)
        if eos is None:
            eos = self._eos_cache[device] = torch.tensor(self.eos_token_ids, dtype=torch.long, device=device)
        return eos

    def ended_B(self, tokens_B_T: torch.Tensor, running_B: torch.Tensor) -> torch.Tensor:
        """Rows whose last token (column ``T - 1``, just sampled) ends them: an EOS id, or, for a running row, a
        stop string now in the text of its ``T`` tokens. ``running_B``: rows still generating before this token.
        """
        ended_B = torch.isin(tokens_B_T[:, -1], self._eos(tokens_B_T.device))
        if not self.stop:
            return ended_B
        assert self._decode is not None
        candidates = (running_B & ~ended_B).nonzero().flatten().tolist()
        if candidates:
            rows = tokens_B_T[candidates].tolist()
            hits = [i for i, ids in zip(candidates, rows) if any(s in self._decode(ids) for s in self.stop)]
            if hits:
                ended_B = ended_B.clone()
                ended_B[hits] = True
        return ended_B
