"""Data sets and batching: procedurally generated tasks (reverse-digits, arithmetic, countdown, calculator tool
use, addition with a worked scratchpad for SFT then RL), local prompt files (JSON Lines, Parquet, Arrow,
``save_to_disk`` directories), chat templating, a token budget, the resumable sampler, and SFT batches."""

from rlsdk.data.files import SUPPORTED_SUFFIXES, load_prompt_dataset
from rlsdk.data.prepare import (
    apply_chat_template,
    build_prompt_dataset,
    data_needs_tokenizer,
    filter_long_prompts,
    prepare_prompts,
)
from rlsdk.data.reasoning import ReasoningTask, build_reasoning_policy, write_reasoning_task
from rlsdk.data.reverse import (
    VOCAB,
    VOCAB_SIZE,
    PromptSampler,
    build_tiny_policy,
    build_tokenizer,
    reverse_digits_dataset,
)
from rlsdk.data.sft import SFTBatches, collate_sft, tokenize_sft
from rlsdk.data.tasks import arithmetic_dataset, countdown_dataset
from rlsdk.data.tool_tasks import calculator_dataset, calculator_env, safe_arithmetic, tool_answer_reward

__all__ = [
    "SUPPORTED_SUFFIXES",
    "VOCAB",
    "VOCAB_SIZE",
    "PromptSampler",
    "ReasoningTask",
    "SFTBatches",
    "apply_chat_template",
    "arithmetic_dataset",
    "build_prompt_dataset",
    "build_reasoning_policy",
    "build_tiny_policy",
    "build_tokenizer",
    "calculator_dataset",
    "calculator_env",
    "collate_sft",
    "countdown_dataset",
    "data_needs_tokenizer",
    "filter_long_prompts",
    "load_prompt_dataset",
    "prepare_prompts",
    "reverse_digits_dataset",
    "safe_arithmetic",
    "tokenize_sft",
    "tool_answer_reward",
    "write_reasoning_task",
]
