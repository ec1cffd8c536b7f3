"""A reasoning-format task with verifiable answers: column addition with a worked scratchpad.

The stand-in for "a pretrained model and a reasoning data set" where nothing can be downloaded: everything here is
generated locally and seeded, the way a user would make it with the same SDK.

- **Problems**: ``a + b`` with operands of ``min_digits`` to ``max_digits`` digits, asked as a chat message
  (``"What is 472 + 389?"``). Train, RL and held-out problems are disjoint (no ``(a, b)`` pair is in two splits).
- **Completions** (~30-120 tokens): a ``<think>`` block that adds column by column from the right, each line
  ``digit+digit+carry=sum -> the result so far``, then ``The answer is N.``::

      <think>
      2+9+0=11 -> 1
      7+8+1=16 -> 61
      4+3+1=8 -> 861
      </think>
      The answer is 861.

  Each line's result is the previous line's with one digit in front, so every step is local (nothing is read from
  more than a line away but the operands' digits); the last column writes its whole sum.
- **The SFT corpus has slips**, as a corpus of human or model traces does, and its answers follow the trace
  (an honest mistake, not a label error): ``carry_slip`` of the traces that carry into the last column drop that
  carry (``4+3+0=7 -> 751`` where ``4+3+1=8 -> 851`` is right), a slip frequent enough that a model fit to the
  corpus repeats it when decoding greedily, and ``digit_slip`` of all traces have one column's sum off by one.
  About half the problems carry into their last column, so a policy fine-tuned on the corpus solves about half
  the held-out problems; RL, rewarded on the true answer, has something real to fix (see
  docs/howto/post-training.md).
- **A tokenizer trained here**: byte-level BPE with digits split one per token (as Llama-3 and Qwen2 do), a
  ChatML chat template, ``<think>`` / ``</think>`` as added (not special) tokens, EOS ``<|im_end|>``.
- **Rewards**: :func:`answer_reward` (exact match of the stated answer) and :func:`format_reward` (the
  ``<think>...</think>`` then ``The answer is N.`` shape).

Data files are what TRL's trainers read: the SFT split has conversational ``prompt`` / ``completion`` columns
(lists of ``{'role', 'content'}``), the RL and test splits ``prompt`` and ``answer``.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlsdk.observe.logging import get_logger

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedTokenizerFast

logger = get_logger(__name__)

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
END_OF_TEXT = "<|endoftext|>"
# ChatML, as Qwen2-Instruct's template (without tools): one block per message, then the assistant's opening.
CHAT_TEMPLATE = (
    "{% for message in messages %}" + IM_START + "{{ message['role'] }}\n{{ message['content'] }}" + IM_END + "\n"
    "{% endfor %}{% if add_generation_prompt %}" + IM_START + "assistant\n{% endif %}"
)
QUESTION = "What is {a} + {b}?"
ANSWER_PATTERN = re.compile(r"The answer is (-?\d+)\.")
FORMAT_PATTERN = re.compile(r"<think>\n(?:[^\n]*\n)+?</think>\nThe answer is -?\d+\.")
SPLITS = ("sft", "rl", "test")


@dataclass(frozen=True)
class ReasoningTask:
    """How the addition task is generated; every split is a pure function of these fields.

    Attributes:
        min_digits: Fewest digits of an operand, >= 1.
        max_digits: Most digits of an operand, >= min_digits.
        num_sft: Problems in the SFT corpus (each with a worked completion), >= 1.
        num_rl: Problems the RL prompts are drawn from, >= 1.
        num_test: Held-out problems, >= 1.
        carry_slip: Share of SFT traces with a carry into the last column that drop it, in [0, 1].
        digit_slip: Share of SFT traces with one column's sum off by one, in [0, 1].
        seed: Seed of every draw.
    """

    min_digits: int = 2
    max_digits: int = 3
    num_sft: int = 4000
    num_rl: int = 4000
    num_test: int = 256
    carry_slip: float = 0.7
    digit_slip: float = 0.1
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.min_digits <= self.max_digits:
            raise ValueError(
                f"min_digits={self.min_digits!r}, max_digits={self.max_digits!r} are invalid: "
                "need 1 <= min_digits <= max_digits"
            )
        for name in ("num_sft", "num_rl", "num_test"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid: allowed an int >= 1")
        for name in ("carry_slip", "digit_slip"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid: allowed a float in [0, 1]")
        low, high = 10 ** (self.min_digits - 1) if self.min_digits > 1 else 0, 10**self.max_digits
        distinct = (high - low) ** 2
        wanted = self.num_sft + self.num_rl + self.num_test
        if wanted > distinct // 2:  # rejection sampling of distinct pairs stays fast below half the space
            raise ValueError(
                f"num_sft + num_rl + num_test = {wanted} is too many: at most {distinct // 2} distinct problems "
                f"with {self.min_digits}-{self.max_digits} digit operands"
            )


def addition_trace(a: int, b: int, *, drop_last_carry: bool = False, slip_column: int | None = None) -> str:
    """The worked completion for ``a + b`` (see the module docstring), ending with ``The answer is N.``.

    ``drop_last_carry``: the last column adds 0 instead of the carry into it (a no-op without one).
    ``slip_column``: that column's (0 = units) sum is one too high, and every later line follows it.

    Raises:
        ValueError: a negative operand, or ``slip_column`` outside the columns.
    """
    if a < 0 or b < 0:
        raise ValueError(f"a={a!r}, b={b!r} are invalid: allowed ints >= 0")
    digits_a, digits_b = str(a)[::-1], str(b)[::-1]
    columns = max(len(digits_a), len(digits_b))
    if slip_column is not None and not 0 <= slip_column < columns:
        raise ValueError(f"slip_column={slip_column!r} is invalid: allowed 0..{columns - 1} for {a} + {b}")
    lines, result, carry = [], "", 0
    for column in range(columns):
        x = int(digits_a[column]) if column < len(digits_a) else 0
        y = int(digits_b[column]) if column < len(digits_b) else 0
        last = column == columns - 1
        if last and drop_last_carry:
            carry = 0
        total = x + y + carry + (1 if column == slip_column else 0)
        written = str(total) if last else str(total % 10)
        result = written + result
        lines.append(f"{x}+{y}+{carry}={total} -> {result}")
        carry = total // 10
    return f"{THINK_OPEN}\n" + "\n".join(lines) + f"\n{THINK_CLOSE}\nThe answer is {int(result)}."


def carries_into_last_column(a: int, b: int) -> bool:
    """Whether column addition of ``a + b`` carries into its last (leftmost) column."""
    columns = max(len(str(a)), len(str(b)))
    low = 10 ** (columns - 1)
    return (a % low) + (b % low) >= low


def _operand(rng: random.Random, min_digits: int, max_digits: int) -> int:
    digits = rng.randint(min_digits, max_digits)
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


def _problems(task: ReasoningTask) -> dict[str, list[tuple[int, int]]]:
    """Distinct ``(a, b)`` pairs for each split, drawn in one stream so no pair is in two splits."""
    rng = random.Random(task.seed)
    seen: set[tuple[int, int]] = set()
    out: dict[str, list[tuple[int, int]]] = {}
    for split, count in zip(SPLITS, (task.num_sft, task.num_rl, task.num_test)):
        pairs: list[tuple[int, int]] = []
        while len(pairs) < count:
            pair = (_operand(rng, task.min_digits, task.max_digits), _operand(rng, task.min_digits, task.max_digits))
            if pair not in seen:
                seen.add(pair)
                pairs.append(pair)
        out[split] = pairs
    return out


def question(a: int, b: int) -> list[dict[str, str]]:
    """The prompt of ``a + b`` as chat messages (one user message)."""
    return [{"role": "user", "content": QUESTION.format(a=a, b=b)}]


def reasoning_rows(task: ReasoningTask) -> dict[str, list[dict[str, Any]]]:
    """The rows of every split: ``sft`` (``prompt``, ``completion`` as chat messages, ``answer`` the TRUE sum,
    ``slip``: '', 'carry' or 'digit'), ``rl`` and ``test`` (``prompt``, ``answer``). Answers are strings (the
    reward compares text)."""
    problems = _problems(task)
    slips = random.Random(task.seed + 1)
    out: dict[str, list[dict[str, Any]]] = {split: [] for split in SPLITS}
    for a, b in problems["sft"]:
        forget = carries_into_last_column(a, b) and slips.random() < task.carry_slip
        columns = max(len(str(a)), len(str(b)))
        # a dropped last carry already makes the last column one too low: a slip there would cancel it
        slip_column = slips.randrange(columns - forget) if slips.random() < task.digit_slip else None
        trace = addition_trace(a, b, drop_last_carry=forget, slip_column=slip_column)
        out["sft"].append(
            {
                "prompt": question(a, b),
                "completion": [{"role": "assistant", "content": trace}],
                "answer": str(a + b),
                "slip": "carry" if forget else "digit" if slip_column is not None else "",
            }
        )
    for split in ("rl", "test"):
        out[split] = [{"prompt": question(a, b), "answer": str(a + b)} for a, b in problems[split]]
    return out


def reasoning_datasets(task: ReasoningTask) -> dict[str, datasets.Dataset]:
    """:func:`reasoning_rows` as ``datasets.Dataset`` objects, one per split."""
    import datasets

    return {split: datasets.Dataset.from_list(rows) for split, rows in reasoning_rows(task).items()}


def write_reasoning_task(directory: str | Path, task: ReasoningTask | None = None) -> dict[str, Path]:
    """Write each split to ``directory/{sft,rl,test}.jsonl`` (plus ``task.json``, the fields used); returns the
    paths by split. Idempotent: files already written for the same task are kept."""
    task = task or ReasoningTask()
    directory = Path(directory)
    paths = {split: directory / f"{split}.jsonl" for split in SPLITS}
    spec = json.dumps(task.__dict__, sort_keys=True)
    stamp = directory / "task.json"
    if stamp.is_file() and stamp.read_text(encoding="utf-8") == spec and all(p.is_file() for p in paths.values()):
        return paths
    directory.mkdir(parents=True, exist_ok=True)
    for split, rows in reasoning_rows(task).items():
        tmp = paths[split].with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
        tmp.replace(paths[split])
    stamp.write_text(spec, encoding="utf-8")
    return paths


def _corpus(task: ReasoningTask) -> Iterable[str]:
    """Texts to train the tokenizer on: every question and a correct trace of a few thousand problems."""
    rng = random.Random(task.seed + 2)
    for _ in range(2000):
        a, b = _operand(rng, task.min_digits, task.max_digits), _operand(rng, task.min_digits, task.max_digits)
        yield QUESTION.format(a=a, b=b)
        yield addition_trace(a, b)


def build_reasoning_tokenizer(task: ReasoningTask | None = None, *, vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained here on the task's texts: digits one per token, ChatML template.

    Special tokens ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (EOS, the end of a turn, as in
    Qwen2-Instruct); ``<think>`` and ``</think>`` are added tokens that are NOT special, so decoded completions keep
    them (``skip_special_tokens=True`` would drop special ones, and the format reward looks for them). Every
    byte is a token, so any text encodes.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    task = task or ReasoningTask()
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_corpus(task), trainer)
    bpe.add_tokens([AddedToken(t, special=False, normalized=False) for t in (THINK_OPEN, THINK_CLOSE)])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token=IM_END, pad_token=END_OF_TEXT, clean_up_tokenization_spaces=False
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_reasoning_policy(
    path: str | Path,
    *,
    task: ReasoningTask | None = None,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    intermediate_size: int | None = None,
    seed: int = 0,
) -> Path:
    """Write a randomly initialised Qwen2-style causal LM and the task's tokenizer (:func:`build_reasoning_tokenizer`)
    to ``path`` with ``save_pretrained``; returns ``path``. SFT (``Session.sft_update``) makes it a policy.

    ``intermediate_size`` defaults to ``4 * hidden_size``; embeddings are tied; 256 positions. The generation
    config lists ``<|im_end|>`` and ``<|endoftext|>`` as EOS ids (as Qwen2-Instruct's does). Initialisation is
    deterministic for ``seed`` (the global torch RNG state is restored). Idempotent: a directory that already
    holds a complete model is returned untouched.

    Raises:
        ValueError: a size < 1, or ``hidden_size`` not divisible by ``num_heads``.
        RuntimeError: the tokenizer transformers loads back from ``path`` does not encode like the one trained
            (a transformers version that rebuilds it differently).
    """
    from transformers import AutoTokenizer, GenerationConfig

    from rlsdk.data.models import check_policy_sizes, seeded_qwen2, small_qwen2_config

    path = Path(path)
    if all((path / name).is_file() for name in ("config.json", "model.safetensors", "tokenizer.json")):
        return path
    intermediate_size = 4 * hidden_size if intermediate_size is None else intermediate_size
    check_policy_sizes(hidden_size, num_layers, num_heads, intermediate_size)
    task = task or ReasoningTask()
    tokenizer = build_reasoning_tokenizer(task)
    eos_ids = [tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(END_OF_TEXT)]
    config = small_qwen2_config(
        len(tokenizer),
        hidden_size,
        num_layers,
        num_heads,
        intermediate_size,
        max_positions=256,
        bos_token_id=None,
        eos_token_id=eos_ids,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = seeded_qwen2(config, seed)
    model.generation_config = GenerationConfig(eos_token_id=eos_ids, pad_token_id=tokenizer.pad_token_id)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    sample = next(iter(_corpus(task)))
    loaded = AutoTokenizer.from_pretrained(path)
    if loaded(sample)["input_ids"] != tokenizer(sample)["input_ids"]:
        raise RuntimeError(f"the tokenizer loaded from {path} ({type(loaded).__name__}) encodes differently")
    logger.info(
        "built reasoning policy (%d parameters, vocabulary %d, seed %d) at %s",
        sum(p.numel() for p in model.parameters()),
        len(tokenizer),
        seed,
        path,
    )
    return path


def stated_answer(completion: str) -> str | None:
    """The number in the completion's last ``The answer is N.``, or None."""
    found = ANSWER_PATTERN.findall(completion)
    return found[-1] if found else None


def answer_reward(completions: Sequence[str], answer: Sequence[Any], **_: Any) -> list[float]:
    """1.0 where the completion's last ``The answer is N.`` states ``answer`` (compared as integers), else 0.0.

    Raises:
        ValueError: ``completions`` and ``answer`` differ in length.
    """
    if len(completions) != len(answer):
        raise ValueError(f"completions has {len(completions)} items but answer has {len(answer)}")
    out = []
    for completion, reference in zip(completions, answer):
        stated = stated_answer(completion)
        out.append(float(stated is not None and int(stated) == int(str(reference).strip())))
    return out


def format_reward(completions: Sequence[str], **_: Any) -> list[float]:
    """1.0 where the completion is a ``<think>`` block of lines, ``</think>``, then ``The answer is N.``."""
    return [float(FORMAT_PATTERN.fullmatch(completion.strip()) is not None) for completion in completions]
