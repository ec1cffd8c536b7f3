"""Turn a :class:`~rlsdk.config.DataConfig` into the prompt data set a Session samples from.

The pipeline: rows (a procedural task or a local file) -> each prompt checked (non-empty text, or chat messages
when ``chat_template``) -> the chat template applied when asked -> prompts over ``max_prompt_tokens`` dropped
(the count logged). The result has a ``prompt`` column holding exactly the text the workflow tokenises, and every
other column unchanged. Every step is deterministic, so a sampler's ``state_dict`` resumes on a rebuilt set.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from rlsdk.config.errors import ConfigError
from rlsdk.observe.logging import get_logger

if TYPE_CHECKING:
    import datasets

    from rlsdk.config import DataConfig

logger = get_logger(__name__)


def data_needs_tokenizer(data: DataConfig) -> bool:
    """Whether building ``data`` needs the policy's tokenizer (chat template or a prompt-token budget)."""
    return data.chat_template or data.max_prompt_tokens is not None


def _is_messages(value: Any) -> bool:
    return (
        isinstance(value, list)
        and len(value) > 0
        and all(isinstance(m, Mapping) and isinstance(m.get("role"), str) and "content" in m for m in value)
    )


def _check_prompts(values: list[Any], column: str, *, chat_template: bool) -> None:
    allowed = "non-empty strings or, with data.chat_template=True, lists of {'role', 'content'} chat messages"
    for index, value in enumerate(values):
        if isinstance(value, str) and value.strip():
            continue
        if _is_messages(value):
            if chat_template:
                continue
            raise ConfigError(
                "data.chat_template", False, f"True: column {column!r} holds chat messages (row {index}: {value!r})"
            )
        raise ConfigError("data.prompt_column", column, f"a column of {allowed}; row {index} holds {value!r}")


def apply_chat_template(prompts: list[Any], tokenizer: Any, *, system_prompt: str | None = None) -> list[str]:
    """Each prompt as the text the model sees: ``tokenizer.apply_chat_template(messages, tokenize=False,
    add_generation_prompt=True)``. A string prompt becomes one user message; a list of ``{'role', 'content'}``
    messages is used as is. ``system_prompt`` is prepended as a system message where the prompt has none.

    Raises:
        ConfigError: ``data.chat_template`` when the tokenizer has no chat template.
    """
    if getattr(tokenizer, "chat_template", None) is None:
        raise ConfigError(
            "data.chat_template", True, "False, or a model whose tokenizer has a chat template (this one has none)"
        )
    texts: list[str] = []
    for prompt in prompts:
        messages = [dict(m) for m in prompt] if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        if system_prompt is not None and messages[0].get("role") != "system":
            messages.insert(0, {"role": "system", "content": system_prompt})
        texts.append(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    return texts


def prompt_token_counts(prompts: list[str], tokenizer: Any) -> list[int]:
    """Tokens per prompt, counted as the workflow tokenises them (``tokenizer(prompt)``, special tokens included)."""
    return [len(ids) for ids in tokenizer(prompts)["input_ids"]]


def filter_long_prompts(dataset: datasets.Dataset, tokenizer: Any, max_prompt_tokens: int) -> datasets.Dataset:
    """Drop rows whose ``prompt`` has more than ``max_prompt_tokens`` tokens; logs how many were dropped.

    Raises:
        ConfigError: ``data.max_prompt_tokens`` when no prompt fits (the message gives the shortest length).
    """
    counts = prompt_token_counts(list(dataset["prompt"]), tokenizer)
    keep = [index for index, count in enumerate(counts) if count <= max_prompt_tokens]
    if not keep:
        raise ConfigError(
            "data.max_prompt_tokens",
            max_prompt_tokens,
            f"a budget that keeps at least one prompt: the shortest of {len(counts)} has {min(counts)} tokens",
        )
    dropped = len(counts) - len(keep)
    if dropped:
        logger.info(
            "dropped %d of %d prompts longer than data.max_prompt_tokens=%d tokens (longest: %d tokens)",
            dropped,
            len(counts),
            max_prompt_tokens,
            max(counts),
        )
        return dataset.select(keep)
    return dataset


def prepare_prompts(
    dataset: datasets.Dataset,
    *,
    prompt_column: str = "prompt",
    tokenizer: Any = None,
    chat_template: bool = False,
    system_prompt: str | None = None,
    max_prompt_tokens: int | None = None,
) -> datasets.Dataset:
    """Check the prompts of ``dataset``, write the model's input text to ``prompt`` and apply the token budget.

    ``prompt_column`` is copied (templated if ``chat_template``) into ``prompt``; when it is another column, that
    column stays too. Other columns pass through unchanged. ``tokenizer`` is needed for ``chat_template`` and
    ``max_prompt_tokens``.

    Raises:
        ConfigError: ``data.prompt_column`` absent or holding an empty or non-text prompt (row named);
            ``data.chat_template`` needed for a messages column or unsupported by the tokenizer;
            ``data.max_prompt_tokens`` keeping no prompt.
        ValueError: ``tokenizer`` is None but needed.
    """
    if prompt_column not in dataset.column_names:
        raise ConfigError("data.prompt_column", prompt_column, f"one of the columns found: {dataset.column_names}")
    if (chat_template or max_prompt_tokens is not None) and tokenizer is None:
        raise ValueError("prepare_prompts needs a tokenizer for chat_template or max_prompt_tokens")
    prompts = list(dataset[prompt_column])
    _check_prompts(prompts, prompt_column, chat_template=chat_template)
    if chat_template:
        prompts = apply_chat_template(prompts, tokenizer, system_prompt=system_prompt)
    if chat_template or prompt_column != "prompt":
        if "prompt" in dataset.column_names:  # replace it (removing a table's last column would drop its rows)
            dataset = dataset.add_column("_rlsdk_prompt", prompts).remove_columns("prompt")
            dataset = dataset.rename_column("_rlsdk_prompt", "prompt")
        else:
            dataset = dataset.add_column("prompt", prompts)
    if max_prompt_tokens is not None:
        dataset = filter_long_prompts(dataset, tokenizer, max_prompt_tokens)
    return dataset


def build_prompt_dataset(data: DataConfig, *, seed: int, tokenizer: Any = None) -> datasets.Dataset:
    """The data set ``data`` describes: a procedural task (seeded by ``seed``) or a local file, then
    :func:`prepare_prompts`. For the default reverse task without template or budget, exactly
    ``reverse_digits_dataset(num_examples, min_digits=..., max_digits=..., seed=seed)``.

    Raises:
        ConfigError: a bad ``data.*`` value, naming the field (see :func:`~rlsdk.data.files.load_prompt_dataset`
            and :func:`prepare_prompts`).
    """
    from rlsdk.data.files import load_prompt_dataset
    from rlsdk.data.reverse import reverse_digits_dataset
    from rlsdk.data.tasks import arithmetic_dataset, countdown_dataset

    digits = {"min_digits": data.min_digits, "max_digits": data.max_digits, "seed": seed}
    if data.task == "reverse_digits":
        dataset = reverse_digits_dataset(data.num_examples, **digits)
    elif data.task == "arithmetic":
        dataset = arithmetic_dataset(data.num_examples, **digits)
    elif data.task == "countdown":
        dataset = countdown_dataset(data.num_examples, num_numbers=data.countdown_numbers, **digits)
    else:
        assert data.path is not None  # DataConfig requires it for task='file'
        dataset = load_prompt_dataset(data.path, prompt_column=data.prompt_column, split=data.split)
    if not data_needs_tokenizer(data) and data.prompt_column == "prompt" and data.task != "file":
        return dataset  # procedural rows are valid by construction
    return prepare_prompts(
        dataset,
        prompt_column=data.prompt_column,
        tokenizer=tokenizer,
        chat_template=data.chat_template,
        system_prompt=data.system_prompt,
        max_prompt_tokens=data.max_prompt_tokens,
    )
