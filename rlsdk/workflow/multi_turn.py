"""Multi-turn tool-use episodes: the model generates, calls a tool, reads its output, and goes on.

One sample is: ``prompt -> gen_1 [-> tool_1 -> gen_2 [-> tool_2 -> ...]]`` for at most ``max_turns`` generations.
The completion of the :class:`~rlsdk.workflow.rollout.Rollout` is every segment concatenated after the prompt.
Generated segments are trained on (``completion_mask_B_C`` True); tool-output segments were not sampled, so
they are masked out of the loss (``completion_mask_B_C`` False, ``logprobs_B_C`` 0.0, ``versions_B_C`` -1, as on
padding) but stay in the model's context (``attention_mask_B_C`` True).

Shape names as in :mod:`rlsdk.workflow.rollout`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from rlsdk.engine.inference.protocol import InferenceEngine, SamplingParams
from rlsdk.generation.sampling import left_pad
from rlsdk.generation.stopping import eos_ids_or_default
from rlsdk.workflow.rollout import Rollout

logger = logging.getLogger(__name__)

EnvFn = Callable[[Any, dict[str, Any]], "str | Awaitable[str]"]
ParseCallFn = Callable[[str], Any]
EnvErrors = Literal["raise", "message"]
_ENV_ERRORS: tuple[str, ...] = ("raise", "message")


class ToolError(RuntimeError):
    """The environment function raised on a tool call; names the sample, its prompt and the call."""


def tag_call_parser(open_tag: str = "<tool>", close_tag: str = "</tool>") -> Callable[[str], str | None]:
    """A ``parse_call``: the text between the last ``open_tag`` and the first ``close_tag`` after it, else None.

    The workflow cuts each turn right after its first ``call_end`` (``close_tag`` by default), so the close tag,
    if present, ends the turn's text.
    """

    def parse(text: str) -> str | None:
        end = text.find(close_tag)
        if end < 0:
            return None
        start = text.rfind(open_tag, 0, end)
        if start < 0:
            return None
        return text[start + len(open_tag) : end].strip()

    return parse


def default_format_output(output: str) -> str:
    return f"<output>{output}</output>"


def turn_seed(seed: int, turn: int) -> int:
    """The sampling seed of ``turn`` (0-based) in a rollout seeded with ``seed``: distinct per turn, reproducible."""
    return (seed * 1_000_003 + 7919 * (turn + 1)) % (1 << 62)


@dataclass
class _Sample:
    """One episode in flight: its token segments (ids, trained?, logprobs, versions) and counters."""

    row_index: int
    context: list[int]
    ids: list[int] = field(default_factory=list)
    sampled: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turns: int = 0
    calls: list[Any] = field(default_factory=list)
    done: bool = False


class MultiTurnWorkflow:
    """A :class:`~rlsdk.workflow.single_turn.RolloutWorkflow` running a tool-use loop per sample.

    Each turn, the samples still running go to the engine together in ONE ``engine.generate`` call (context =
    prompt + completion so far). A turn's generation is cut right after the first ``call_end`` in its decoded
    text (the tokens after it, and their logprobs, are dropped; so engines need no stop strings); then
    ``parse_call(turn_text)`` (sync or async) gives the call, or ``None`` when the model made none. A sample
    ends when it makes no call, generates EOS, or has had ``max_turns`` generations (a call in the last turn
    is not executed). Otherwise ``env(call, row)`` (sync functions run in a thread; async awaited; all calls
    of a turn run concurrently) answers, ``format_output(answer)`` is tokenised without special tokens and
    appended to the context, and the sample goes on.

    Rollout fields:

    - ``completion_ids_B_C``: generated and tool tokens in order, right-padded with the tokenizer's pad id.
    - ``completion_mask_B_C``: True only on generated tokens (what the loss trains on).
    - ``attention_mask_B_C``: True on generated and tool tokens (the context the model saw).
    - ``logprobs_B_C``: the engine's logprobs on generated tokens; 0.0 on tool tokens and padding.
    - ``versions_B_C``: the weight version of each generated token (turns may differ if weights change
      between them); -1 on tool tokens and padding.
    - ``completions``: the full decoded completion, tool outputs included (as formatted by ``format_output``),
      special tokens skipped. A reward on the final answer should parse it from the end of the text.
    - ``info``: ``num_turns`` (generations per sample), ``num_tool_calls`` (tool calls executed per sample),
      ``tool_calls`` (the parsed calls per sample), ``generated_texts`` (per sample, the decoded text of each
      generated turn).

    Seeds: turn ``t`` samples with ``turn_seed(seed, t)``; with the same seed, engine, weights and env the rollout
    repeats exactly. ``seed=None`` leaves sampling to the engine.

    Env errors: ``env_errors="raise"`` (default) raises :class:`ToolError` naming the sample, its prompt and the
    call; ``"message"`` feeds ``format_output("error: <ExceptionType>: <message>")`` back to the model instead.

    Args:
        tokenizer: a transformers tokenizer (``__call__``, ``decode``, ``batch_decode``, ``pad_token_id``).
        params: sampling parameters per turn (``max_new_tokens`` bounds each generated segment).
        env: ``env(call, row) -> str``, sync or async; ``row`` is the sample's prompt row.
        max_turns: >= 1, generations per sample at most.
        parse_call: ``parse_call(turn_text) -> call | None``, sync or async; default :func:`tag_call_parser`.
        call_end: text that ends a tool call (the turn is cut right after it); ``None`` never cuts.
        format_output: turns the env's answer into the text appended to the context.
        env_errors: ``"raise"`` or ``"message"``.
        eos_token_ids: the ids that end a sample's episode (``Session.special_tokens.eos_token_ids``: every EOS
            id of the model); ``None`` = the tokenizer's ``eos_token_id``.

    Raises:
        ValueError: ``max_turns < 1``, an empty ``call_end``, or an unknown ``env_errors``.
    """

    def __init__(
        self,
        tokenizer: Any,
        params: SamplingParams,
        env: EnvFn,
        *,
        max_turns: int = 4,
        parse_call: ParseCallFn | None = None,
        call_end: str | None = "</tool>",
        format_output: Callable[[str], str] = default_format_output,
        env_errors: EnvErrors = "raise",
        eos_token_ids: Sequence[int] | None = None,
    ) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns={max_turns!r} is invalid: allowed >= 1")
        if call_end == "":
            raise ValueError("call_end='' is invalid: allowed a non-empty string or None")
        if env_errors not in _ENV_ERRORS:
            raise ValueError(f"env_errors={env_errors!r} is invalid: allowed {list(_ENV_ERRORS)}")
        self.tokenizer = tokenizer
        self.params = params
        self.env = env
        self.max_turns = max_turns
        self.parse_call: ParseCallFn = parse_call if parse_call is not None else tag_call_parser()
        self.call_end = call_end
        self.format_output = format_output
        self.env_errors = env_errors
        self.eos_token_ids = frozenset(eos_ids_or_default(eos_token_ids, tokenizer))

    def _cut(self, ids: list[int]) -> tuple[int, str]:
        """The number of tokens up to and including the first ``call_end``, and their text."""
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        if self.call_end is None or self.call_end not in text:
            return len(ids), text
        for n in range(1, len(ids) + 1):  # the shortest prefix whose text holds the marker
            prefix = self.tokenizer.decode(ids[:n], skip_special_tokens=True)
            if self.call_end in prefix:
                return n, prefix
        return len(ids), text

    async def _call_env(self, sample: _Sample, call: Any, row: dict[str, Any]) -> str:
        try:
            if inspect.iscoroutinefunction(self.env):
                answer = await self.env(call, row)
            else:
                answer = await asyncio.to_thread(self.env, call, row)
                if inspect.isawaitable(answer):
                    answer = await answer
        except Exception as exc:
            if self.env_errors == "message":
                return f"error: {type(exc).__name__}: {exc}"
            raise ToolError(
                f"env raised on sample {sample.row_index} (prompt {row.get('prompt')!r}, turn {sample.turns}) "
                f"for call {call!r}: {type(exc).__name__}: {exc}"
            ) from exc
        if not isinstance(answer, str):
            raise ToolError(
                f"env returned a {type(answer).__name__} on sample {sample.row_index} for call {call!r}; allowed: str"
            )
        return answer

    async def _parse(self, text: str) -> Any:
        call = self.parse_call(text)
        return await call if inspect.isawaitable(call) else call

    async def arun_batch(
        self, engine: InferenceEngine, rows: Sequence[dict[str, Any]], group_size: int, *, seed: int | None = None
    ) -> Rollout:
        tokenizer = self.tokenizer
        pad = tokenizer.pad_token_id
        prompt_ids = [list(tokenizer(row["prompt"])["input_ids"]) for row in rows]
        samples = [
            _Sample(row_index=g, context=list(prompt_ids[g])) for g in range(len(rows)) for _ in range(group_size)
        ]
        generated_texts: list[list[str]] = [[] for _ in samples]
        for turn in range(self.max_turns):
            running = [i for i, s in enumerate(samples) if not s.done]
            if not running:
                break
            params = self.params if seed is None else dataclasses.replace(self.params, seed=turn_seed(seed, turn))
            result = await engine.generate([samples[i].context for i in running], params)
            lengths_B = result.completion_mask_B_C.sum(dim=1).tolist()
            ids_B_C = result.completion_ids_B_C.tolist()
            logprobs_B_C = result.logprobs_B_C.tolist()
            versions_B_C = result.versions_B_C.tolist()
            pending: list[tuple[int, Any]] = []
            for b, i in enumerate(running):
                sample = samples[i]
                ids = ids_B_C[b][: lengths_B[b]]
                n, text = self._cut(ids)
                ids = ids[:n]
                sample.ids += ids
                sample.sampled += [True] * n
                sample.logprobs += logprobs_B_C[b][:n]
                sample.versions += versions_B_C[b][:n]
                sample.context += ids
                sample.turns += 1
                generated_texts[i].append(text)
                ended = not self.eos_token_ids.isdisjoint(ids)
                call = None if ended or turn == self.max_turns - 1 else await self._parse(text)
                if call is None:
                    sample.done = True
                else:
                    pending.append((i, call))
            answers = await asyncio.gather(
                *(self._call_env(samples[i], call, dict(rows[samples[i].row_index])) for i, call in pending)
            )
            for (i, call), answer in zip(pending, answers):
                sample = samples[i]
                tool_ids = list(tokenizer(self.format_output(answer), add_special_tokens=False)["input_ids"])
                sample.calls.append(call)
                sample.ids += tool_ids
                sample.sampled += [False] * len(tool_ids)
                sample.logprobs += [0.0] * len(tool_ids)
                sample.versions += [-1] * len(tool_ids)
                sample.context += tool_ids
        return self._to_rollout(rows, group_size, prompt_ids, samples, generated_texts, pad)

    def _to_rollout(
        self,
        rows: Sequence[dict[str, Any]],
        group_size: int,
        prompt_ids: list[list[int]],
        samples: list[_Sample],
        generated_texts: list[list[str]],
        pad: int,
    ) -> Rollout:
        batch = len(samples)
        width = max(1, max(len(s.ids) for s in samples))
        ids_B_C = torch.full((batch, width), pad, dtype=torch.long)
        mask_B_C = torch.zeros((batch, width), dtype=torch.bool)
        attention_B_C = torch.zeros((batch, width), dtype=torch.bool)
        logprobs_B_C = torch.zeros((batch, width), dtype=torch.float32)
        versions_B_C = torch.full((batch, width), -1, dtype=torch.long)
        for b, s in enumerate(samples):
            n = len(s.ids)
            ids_B_C[b, :n] = torch.tensor(s.ids, dtype=torch.long)
            mask_B_C[b, :n] = torch.tensor(s.sampled, dtype=torch.bool)
            attention_B_C[b, :n] = True
            logprobs_B_C[b, :n] = torch.tensor(s.logprobs, dtype=torch.float32)
            versions_B_C[b, :n] = torch.tensor(s.versions, dtype=torch.long)
        prompt_ids_B_P, prompt_mask_B_P = left_pad([ids for ids in prompt_ids for _ in range(group_size)], pad)
        completions = self.tokenizer.batch_decode([s.ids for s in samples], skip_special_tokens=True)
        return Rollout(
            rows=[dict(row) for row in rows],
            group_size=group_size,
            prompt_ids_B_P=prompt_ids_B_P,
            prompt_mask_B_P=prompt_mask_B_P,
            completion_ids_B_C=ids_B_C,
            completion_mask_B_C=mask_B_C,
            logprobs_B_C=logprobs_B_C,
            versions_B_C=versions_B_C,
            completions=completions,
            info={
                "num_turns": [s.turns for s in samples],
                "num_tool_calls": [len(s.calls) for s in samples],
                "tool_calls": [list(s.calls) for s in samples],
                "generated_texts": generated_texts,
            },
            attention_mask_B_C=attention_B_C,
        )
