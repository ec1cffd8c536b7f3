"""The default toy task: reverse a string of digits (``"123>"`` -> ``"321"``) and the tiny policy for it.

Everything here is built locally (no hub downloads): a 16-token character-level tokenizer, a ~133k-parameter
Qwen2-style model with random weights, and a procedurally generated data set. The model is written with
``save_pretrained`` so any engine (embedded, vLLM) can load it from a directory.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

PAD_TOKEN = "<pad>"
EOS_TOKEN = "<eos>"
BOS_TOKEN = "<bos>"
UNK_TOKEN = "<unk>"
SEPARATOR = ">"
# Order fixes the ids: specials first (pad=0, eos=1, bos=2, unk=3), digits 4-13, separator 14, a spare 15.
VOCAB: tuple[str, ...] = (
    PAD_TOKEN,
    EOS_TOKEN,
    BOS_TOKEN,
    UNK_TOKEN,
    *(str(d) for d in range(10)),
    SEPARATOR,
    "|",
)
VOCAB_SIZE = len(VOCAB)

_MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json")


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer over :data:`VOCAB` (16 tokens), built locally.

    Every character is one token; ``decode`` joins tokens without spaces (``decode(encode("321")) == "321"``).
    No special token is added on encode. Padding is on the left (prompts are left-padded for generation).
    ``pad_token_id`` = 0, ``eos_token_id`` = 1, ``bos_token_id`` = 2, ``unk_token_id`` = 3.

    Note: ``AutoTokenizer.from_pretrained`` on a saved qwen2 model directory returns transformers'
    ``Qwen2Tokenizer`` (5.x forces it for model type qwen2), which rebuilds a byte-level pre-tokenizer and
    decoder around this vocabulary. On the task's alphabet (digits, ``>``, ``|``, special tokens) it encodes and
    decodes identically; other characters are dropped instead of mapped to ``<unk>``.
    ``PreTrainedTokenizerFast.from_pretrained(path)`` loads this exact tokenizer.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(VOCAB)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        bos_token=BOS_TOKEN,
        unk_token=UNK_TOKEN,
        padding_side="left",
        model_max_length=64,
        clean_up_tokenization_spaces=False,
    )


def _is_complete_model_dir(path: Path) -> bool:
    return all((path / name).is_file() for name in _MODEL_FILES)


def build_tiny_policy(
    path: str | Path,
    *,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_size: int = 256,
) -> Path:
    """Write a randomly initialised Qwen2-style causal LM for the reverse task into ``path``.

    The model has vocabulary :data:`VOCAB_SIZE` (16), tied input/output embeddings and 64 positions; with the
    defaults it has ~133k parameters. Model weights (safetensors), config, tokenizer and a generation config
    (eos/pad ids) are saved with ``save_pretrained``. Initialisation is deterministic for a ``seed`` (the
    global torch RNG state is saved and restored).

    Idempotent: if ``path`` already holds a complete model it is left untouched (whatever its seed or size)
    and returned as is.

    Raises:
        ValueError: ``hidden_size`` not divisible by ``num_heads``, or a size < 1.
    """
    from transformers import GenerationConfig

    from rlsdk.data.models import check_policy_sizes, seeded_qwen2, small_qwen2_config

    path = Path(path)
    if _is_complete_model_dir(path):
        logger.debug("tiny policy already present at %s; not rebuilt", path)
        return path
    check_policy_sizes(hidden_size, num_layers, num_heads, intermediate_size)

    tokenizer = build_tokenizer()
    config = small_qwen2_config(
        VOCAB_SIZE,
        hidden_size,
        num_layers,
        num_heads,
        intermediate_size,
        max_positions=64,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        use_cache=True,
    )
    model = seeded_qwen2(config, seed)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    (path / "rlsdk_tiny_policy.json").write_text(json.dumps({"seed": seed, "task": "reverse_digits"}))
    num_params = sum(p.numel() for p in model.parameters())
    logger.info("built tiny policy (%d parameters, seed %d) at %s", num_params, seed, path)
    return path


def reverse_digits_dataset(
    num_examples: int, *, min_digits: int = 3, max_digits: int = 3, seed: int = 0
) -> datasets.Dataset:
    """``num_examples`` rows of the reverse task: ``prompt`` = digits + ``">"``, ``answer`` = digits reversed.

    Lengths are drawn uniformly from ``[min_digits, max_digits]`` and digits uniformly from 0-9 (leading zeros
    allowed). The same arguments give the same rows.

    Raises:
        ValueError: ``num_examples < 1`` or ``not 1 <= min_digits <= max_digits``.
    """
    import datasets

    if num_examples < 1:
        raise ValueError(f"num_examples={num_examples!r} is invalid: allowed >= 1")
    if not 1 <= min_digits <= max_digits:
        raise ValueError(
            f"min_digits={min_digits!r}, max_digits={max_digits!r} are invalid: need 1 <= min_digits <= max_digits"
        )
    rng = random.Random(seed)
    prompts: list[str] = []
    answers: list[str] = []
    for _ in range(num_examples):
        length = rng.randint(min_digits, max_digits)
        digits = "".join(rng.choice("0123456789") for _ in range(length))
        prompts.append(digits + SEPARATOR)
        answers.append(digits[::-1])
    return datasets.Dataset.from_dict({"prompt": prompts, "answer": answers})


_SCALARS = (str, int, float, bool, type(None))


class PromptSampler:
    """Endless batches of ``prompts_per_step`` rows from a data set, reshuffled every epoch.

    Epoch ``e`` visits the rows in the order of a permutation drawn from ``torch.Generator`` seeded with
    ``seed + e``, so the state is just ``(epoch, position)``: :meth:`load_state_dict` on a fresh sampler over
    the same data set continues exactly where :meth:`state_dict` was taken. A batch that crosses an epoch
    boundary takes the rest of the old epoch and the start of the new one.

    Each batch is a ``dict`` of column name -> list of ``prompts_per_step`` values.

    Raises:
        ValueError: ``prompts_per_step < 1`` or an empty data set.
    """

    CACHE_MAX_ROWS = 50_000
    """Data sets up to this many rows are held as Python lists (see ``__init__``)."""

    def __init__(self, dataset: datasets.Dataset, prompts_per_step: int, *, seed: int = 0) -> None:
        if prompts_per_step < 1:
            raise ValueError(f"prompts_per_step={prompts_per_step!r} is invalid: allowed >= 1")
        if len(dataset) == 0:
            raise ValueError("dataset is empty: PromptSampler needs at least one row")
        self.dataset = dataset
        self.prompts_per_step = prompts_per_step
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._order: list[int] | None = None
        # A small data set of plain scalars (str, int, float, bool, None) is read once into Python lists: a batch is
        # then a list lookup instead of an Arrow gather (a per-row cost on every step), with the same
        # values; nested values (lists, dicts) would be shared with the caller, so those data sets are not cached.
        self._columns: dict[str, list[Any]] | None = None
        if len(dataset) <= self.CACHE_MAX_ROWS:
            columns = dataset[:]
            if all(isinstance(v, _SCALARS) for values in columns.values() for v in values):
                self._columns = columns

    def _epoch_order(self) -> list[int]:
        if self._order is None:
            import torch

            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            self._order = torch.randperm(len(self.dataset), generator=generator).tolist()
        return self._order

    def next_batch(self) -> dict[str, list[Any]]:
        """The next ``prompts_per_step`` rows, as column name -> list of values."""
        indices: list[int] = []
        while len(indices) < self.prompts_per_step:
            order = self._epoch_order()
            take = min(self.prompts_per_step - len(indices), len(order) - self.position)
            indices.extend(order[self.position : self.position + take])
            self.position += take
            if self.position == len(order):
                self.epoch += 1
                self.position = 0
                self._order = None
        if self._columns is not None:
            return {name: [values[i] for i in indices] for name, values in self._columns.items()}
        return self.dataset[indices]

    def __iter__(self) -> Iterator[dict[str, list[Any]]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "position", "seed", "num_rows"}``: enough to resume on the same data set."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "num_rows": len(self.dataset)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a :meth:`state_dict`.

        Raises:
            ValueError: the state's position is outside the data set, or its seed or row count (``num_rows``,
                absent in states written before it existed) differs from this sampler's: a data set rebuilt with
                other rows (another file, another ``max_prompt_tokens``) would silently replay other prompts.
        """
        epoch, position = int(state["epoch"]), int(state["position"])
        if "seed" in state and int(state["seed"]) != self.seed:
            raise ValueError(f"state seed={state['seed']!r} differs from this sampler's seed={self.seed!r}")
        if "num_rows" in state and int(state["num_rows"]) != len(self.dataset):
            raise ValueError(
                f"state num_rows={state['num_rows']!r} differs from this sampler's data set of {len(self.dataset)} "
                "rows: resume on the same data set"
            )
        if epoch < 0 or not 0 <= position < len(self.dataset):
            raise ValueError(
                f"state epoch={epoch!r}, position={position!r} is invalid for a data set of {len(self.dataset)} rows"
            )
        self.epoch, self.position, self._order = epoch, position, None
