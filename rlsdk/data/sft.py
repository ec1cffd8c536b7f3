"""Supervised fine-tuning data: prompt-completion rows -> token ids -> the batches ``Session.sft_update`` trains on.

Rows follow TRL's ``SFTTrainer`` prompt-completion format: ``prompt`` and ``completion`` columns, each text, or
chat messages (lists of ``{'role', 'content'}``: "conversational"). What the model is trained on, as there:

- **conversational** (or ``chat_template=True`` with text columns, which become one user and one assistant
  message): the prompt is ``apply_chat_template(prompt, add_generation_prompt=True)`` and the completion is what
  the template writes after it for ``prompt + completion``, up to and including the first EOS token (the end of
  the assistant turn: where generation stops). The template must write the prompt part unchanged when the
  completion follows (every chat template does; the row is named otherwise).
- **text**: the prompt as it is, the completion with the EOS token appended (TRL appends ``eos_token``).

Completion-only loss: the batch keeps the prompt and the completion apart, in the layout of a rollout
(``prompt_ids_B_P`` left-padded, ``completion_ids_B_C`` right-padded, ``completion_mask_B_C``), and the loss
(:func:`rlsdk.algorithms.sft.sft_loss`) covers the completion tokens only. One departure from TRL: the prompt is
tokenised on its own, exactly as the rollout workflow tokenises it (``tokenizer(prompt)``), where TRL tokenises
prompt + completion in one call and splits at the prompt's length; so SFT trains on the same token boundary
generation starts from (with a template that ends the prompt in a special token, as ChatML does, both agree).
Rows longer than ``max_length`` tokens are dropped (counted in the log), where TRL truncates: a truncated
completion would teach the model to stop mid-answer without an EOS.

The batcher shuffles with :class:`~rlsdk.data.reverse.PromptSampler` (epoch-seeded, resumable through
``state_dict``), as the RL prompts are.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlsdk.config.errors import ConfigError
from rlsdk.observe.logging import get_logger

if TYPE_CHECKING:
    import datasets
    import torch

logger = get_logger(__name__)

SFT_BATCH_KEYS = ("prompt_ids_B_P", "prompt_mask_B_P", "completion_ids_B_C", "completion_mask_B_C")


def _is_messages(value: Any) -> bool:
    return (
        isinstance(value, list)
        and len(value) > 0
        and all(isinstance(m, Mapping) and isinstance(m.get("role"), str) and "content" in m for m in value)
    )


@dataclass(frozen=True)
class SFTExample:
    """One tokenised row: ``prompt_ids`` (as the rollout workflow tokenises the prompt) and ``completion_ids``
    (the trained tokens, ending with an EOS id)."""

    prompt_ids: list[int]
    completion_ids: list[int]


def sft_texts(
    prompt: Any, completion: Any, tokenizer: Any, *, chat_template: bool, system_prompt: str | None = None
) -> tuple[str, str]:
    """The prompt text and the completion text of one row (see the module docstring).

    Raises:
        ValueError: a text/messages mix, an empty prompt or completion, a tokenizer without a chat template
            for conversational rows, or a template that rewrites the prompt when the completion follows.
    """
    conversational = _is_messages(prompt) or _is_messages(completion)
    if conversational and not (_is_messages(prompt) and _is_messages(completion)):
        raise ValueError("prompt and completion must both be text or both be chat messages (lists of role/content)")
    if not conversational:
        if not isinstance(prompt, str) or not prompt.strip() or not isinstance(completion, str) or not completion:
            raise ValueError(f"an empty or non-text prompt or completion: {prompt!r} / {completion!r}")
        if not chat_template:
            return prompt, completion
        prompt, completion = [{"role": "user", "content": prompt}], [{"role": "assistant", "content": completion}]
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("conversational rows (or chat_template=True) need a tokenizer with a chat template")
    messages = [dict(m) for m in prompt]
    if system_prompt is not None and messages[0].get("role") != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    prompt_text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    full_text = tokenizer.apply_chat_template(messages + [dict(m) for m in completion], tokenize=False)
    if not full_text.startswith(prompt_text):
        raise ValueError(
            "the chat template writes the prompt differently when the completion follows, so the completion cannot "
            f"be cut from it: prompt part {prompt_text!r}, whole {full_text[: len(prompt_text) + 40]!r}..."
        )
    return prompt_text, full_text[len(prompt_text) :]


def tokenize_sft(
    rows: Sequence[Mapping[str, Any]] | datasets.Dataset,
    tokenizer: Any,
    *,
    prompt_column: str = "prompt",
    completion_column: str = "completion",
    chat_template: bool = False,
    system_prompt: str | None = None,
    eos_token_ids: Sequence[int] | None = None,
    max_length: int | None = None,
) -> list[SFTExample]:
    """Tokenise prompt-completion ``rows`` for SFT (see the module docstring).

    ``eos_token_ids``: the ids that end a completion (default: the tokenizer's EOS); a completion is cut after the
    first one, and gets the first of them appended when it has none. ``max_length``: rows with more prompt +
    completion tokens are dropped (the count is logged); None keeps all.

    Raises:
        ValueError: a missing column (the columns found are listed), a bad row (its index named, see
            :func:`sft_texts`), no EOS id, ``max_length < 1``, or no row left.
    """
    if max_length is not None and max_length < 1:
        raise ValueError(f"max_length={max_length!r} is invalid: allowed None or an int >= 1")
    eos = list(eos_token_ids) if eos_token_ids is not None else [tokenizer.eos_token_id]
    if not eos or any(e is None for e in eos):
        raise ValueError("tokenize_sft needs an EOS id: the tokenizer has no eos_token and none was given")
    columns = list(rows.column_names) if hasattr(rows, "column_names") else list(rows[0]) if len(rows) else []
    for column in (prompt_column, completion_column):
        if column not in columns:
            raise ValueError(f"SFT rows need a {column!r} column; found {columns}")
    prompts, completions = [], []
    for index, row in enumerate(rows):
        try:
            prompt, completion = sft_texts(
                row[prompt_column], row[completion_column], tokenizer, chat_template=chat_template,
                system_prompt=system_prompt,
            )  # fmt: skip
        except ValueError as exc:
            raise ValueError(f"SFT row {index}: {exc}") from exc
        prompts.append(prompt)
        completions.append(completion)
    if not prompts:
        raise ValueError("no SFT rows: need at least one prompt-completion row")
    prompt_ids = tokenizer(prompts)["input_ids"]
    completion_ids = tokenizer(completions, add_special_tokens=False)["input_ids"]
    eos_set = set(eos)
    examples: list[SFTExample] = []
    dropped = 0
    for p_ids, c_ids in zip(prompt_ids, completion_ids):
        end = next((i for i, token in enumerate(c_ids) if token in eos_set), None)
        c_ids = list(c_ids[: end + 1]) if end is not None else [*c_ids, eos[0]]
        if max_length is not None and len(p_ids) + len(c_ids) > max_length:
            dropped += 1
            continue
        examples.append(SFTExample(list(p_ids), c_ids))
    if dropped:
        logger.info("dropped %d of %d SFT rows longer than max_length=%d tokens", dropped, len(prompts), max_length)
    if not examples:
        raise ValueError(f"max_length={max_length} keeps no SFT row")
    return examples


def collate_sft(examples: Sequence[SFTExample], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Pad ``examples`` into an SFT batch: ``prompt_ids_B_P`` / ``prompt_mask_B_P`` (left-padded, as the rollout
    workflow pads prompts) and ``completion_ids_B_C`` / ``completion_mask_B_C`` (right-padded; the mask marks the
    trained tokens).

    Raises:
        ValueError: no examples, or an empty prompt or completion.
    """
    import torch

    from rlsdk.generation.sampling import left_pad

    if not examples:
        raise ValueError("collate_sft needs at least one example")
    prompt_ids_B_P, prompt_mask_B_P = left_pad([e.prompt_ids for e in examples], pad_token_id)
    width = max(len(e.completion_ids) for e in examples)
    completion_ids_B_C = torch.full((len(examples), width), pad_token_id, dtype=torch.long)
    completion_mask_B_C = torch.zeros((len(examples), width), dtype=torch.bool)
    for row, example in enumerate(examples):
        if not example.completion_ids:
            raise ValueError(f"example {row} has an empty completion")
        completion_ids_B_C[row, : len(example.completion_ids)] = torch.tensor(example.completion_ids)
        completion_mask_B_C[row, : len(example.completion_ids)] = True
    return {
        "prompt_ids_B_P": prompt_ids_B_P,
        "prompt_mask_B_P": prompt_mask_B_P,
        "completion_ids_B_C": completion_ids_B_C,
        "completion_mask_B_C": completion_mask_B_C,
    }


class SFTBatches:
    """Endless SFT batches of ``batch_size`` tokenised examples, reshuffled every epoch (seeded, resumable).

    Build from rows with :meth:`from_rows` (a ``datasets.Dataset``, a list of dicts) or a local file with
    :meth:`from_file` (JSON Lines, Parquet, Arrow, ``save_to_disk``; see :func:`rlsdk.data.load_prompt_dataset`).
    ``next_batch()`` returns the tensors :meth:`rlsdk.Session.sft_update` takes.
    """

    def __init__(self, examples: Sequence[SFTExample], batch_size: int, *, pad_token_id: int, seed: int = 0) -> None:
        import datasets

        from rlsdk.data.reverse import PromptSampler

        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r} is invalid: allowed an int >= 1")
        self.examples = list(examples)
        self.pad_token_id = pad_token_id
        self.batch_size = batch_size
        index = datasets.Dataset.from_dict({"index": list(range(len(self.examples)))})
        self._sampler = PromptSampler(index, batch_size, seed=seed)

    @classmethod
    def from_rows(
        cls, rows: Sequence[Mapping[str, Any]] | datasets.Dataset, tokenizer: Any, batch_size: int, *,
        seed: int = 0, **tokenize: Any,
    ) -> SFTBatches:  # fmt: skip
        """Tokenise ``rows`` with :func:`tokenize_sft` (keyword arguments go there) and batch them; padding with
        ``tokenizer.pad_token_id`` (pad = EOS when it has none)."""
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        return cls(tokenize_sft(rows, tokenizer, **tokenize), batch_size, pad_token_id=pad, seed=seed)

    @classmethod
    def from_file(
        cls, path: str, tokenizer: Any, batch_size: int, *, split: str = "train", seed: int = 0, **tokenize: Any
    ) -> SFTBatches:
        """:meth:`from_rows` on a local data set file (see :func:`rlsdk.data.load_prompt_dataset`).

        Raises:
            ValueError: a missing, unreadable or empty file, an absent split, or an absent prompt or completion
                column (the columns found are listed), naming the argument; then as :meth:`from_rows`.
        """
        from rlsdk.data.files import load_prompt_dataset

        arguments = {"data.path": "path", "data.prompt_column": "prompt_column", "data.split": "split"}
        try:
            rows = load_prompt_dataset(path, prompt_column=tokenize.get("prompt_column", "prompt"), split=split)
        except ConfigError as exc:  # the prompt loader names DataConfig's fields; these are this call's arguments
            name = arguments.get(exc.field, exc.field)
            raise ValueError(f"SFT data {name}={exc.value!r} is invalid: allowed {exc.allowed}") from exc
        column = tokenize.get("completion_column", "completion")
        if column not in rows.column_names:
            raise ValueError(
                f"SFT data completion_column={column!r} is invalid: allowed one of the columns found in {path}: "
                f"{rows.column_names}"
            )
        return cls.from_rows(rows, tokenizer, batch_size, seed=seed, **tokenize)

    def __len__(self) -> int:
        return len(self.examples)

    def next_batch(self) -> dict[str, torch.Tensor]:
        """The next ``batch_size`` examples, collated (:func:`collate_sft`)."""
        indices = self._sampler.next_batch()["index"]
        return collate_sft([self.examples[i] for i in indices], self.pad_token_id)

    @property
    def epoch(self) -> float:
        """Epochs done, fractional."""
        return self._sampler.epoch + self._sampler.position / len(self.examples)

    def state_dict(self) -> dict[str, int]:
        """Where the batcher stands: see :meth:`~rlsdk.data.reverse.PromptSampler.state_dict`."""
        return self._sampler.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._sampler.load_state_dict(state)


def check_sft_batch(batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """``batch`` as :func:`collate_sft` makes it, checked: exactly :data:`SFT_BATCH_KEYS`, 2-D tensors, each ids
    tensor the shape of its mask, one row count, integer ids, at least one trained token. Returns the tensors
    (masks as bool, ids as int64).

    Raises:
        ValueError: naming the key and what is allowed.
    """
    import torch

    if set(batch) != set(SFT_BATCH_KEYS):
        raise ValueError(
            f"an SFT batch has exactly the keys {list(SFT_BATCH_KEYS)} (see rlsdk.data.sft.collate_sft); got "
            f"{sorted(batch)}"
        )
    out: dict[str, torch.Tensor] = {}
    for key in SFT_BATCH_KEYS:
        value = batch[key]
        if not isinstance(value, torch.Tensor) or value.dim() != 2:
            raise ValueError(f"SFT batch {key!r} must be a 2-D torch tensor, got {type(value).__name__}")
        if key.endswith("ids_B_P") or key.endswith("ids_B_C"):
            if value.dtype.is_floating_point or value.dtype == torch.bool:
                raise ValueError(f"SFT batch {key!r} must hold integer token ids, got dtype {value.dtype}")
            value = value.long()
        else:
            value = value.bool()
        out[key] = value
    for ids, mask in (("prompt_ids_B_P", "prompt_mask_B_P"), ("completion_ids_B_C", "completion_mask_B_C")):
        if out[ids].shape != out[mask].shape:
            raise ValueError(f"SFT batch {ids!r} has shape {tuple(out[ids].shape)}, {mask!r} {tuple(out[mask].shape)}")
    if out["prompt_ids_B_P"].shape[0] != out["completion_ids_B_C"].shape[0]:
        raise ValueError(
            f"SFT batch has {out['prompt_ids_B_P'].shape[0]} prompts and {out['completion_ids_B_C'].shape[0]} "
            "completions: one row each"
        )
    if not bool(out["completion_mask_B_C"].any()):
        raise ValueError("SFT batch has no trained token: completion_mask_B_C is all False")
    return out
