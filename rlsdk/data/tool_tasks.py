"""A procedurally generated tool-use task: ``A*B+C`` with a calculator tool, for :class:`MultiTurnWorkflow`.

The model is told to call ``<tool>expression</tool>``; :func:`calculator_env` answers with the value (evaluated
by :func:`safe_arithmetic`, an ``ast`` walker: never ``eval``), which the workflow appends as
``<output>value</output>``; the model then writes ``<answer>value</answer>``. Score with
:func:`tool_answer_reward`.
"""

from __future__ import annotations

import ast
import operator
import random
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import datasets

CALCULATOR_PROMPT = (
    "What is {expression}? You may call a calculator by writing <tool>expression</tool>; its result comes back as "
    "<output>value</output>. Give the final result inside <answer> </answer>."
)
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
_MAX_ABS = 10**12
_MAX_CHARS = 200
_ANSWER = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")


def safe_arithmetic(expression: str) -> int:
    """The value of an integer expression with ``+ - *``, unary minus and parentheses, via ``ast`` (no ``eval``).

    Raises:
        ValueError: the expression is longer than 200 characters, does not parse, uses anything else (names,
            calls, ``/``, ``**``, floats), or an intermediate value exceeds 10**12 in magnitude.
    """
    if len(expression) > _MAX_CHARS:
        raise ValueError(f"expression has {len(expression)} characters; allowed <= {_MAX_CHARS}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"cannot parse expression {expression!r}: {exc.msg}") from None

    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            value = node.value
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            value = -walk(node.operand) if isinstance(node.op, ast.USub) else walk(node.operand)
        elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            value = _BINARY[type(node.op)](walk(node.left), walk(node.right))
        else:
            raise ValueError(f"unsupported syntax {type(node).__name__} in {expression!r}: allowed integers, + - * ()")
        if abs(value) > _MAX_ABS:
            raise ValueError(f"value {value} in {expression!r} exceeds {_MAX_ABS} in magnitude")
        return value

    return walk(tree.body)


async def calculator_env(call: str, row: dict[str, Any]) -> str:
    """The ``calc`` tool for :class:`MultiTurnWorkflow`: the value of ``call``, or ``error: <reason>``.

    Bad expressions are answered (the model should learn from them), never raised.
    """
    try:
        return str(safe_arithmetic(call))
    except ValueError as exc:
        return f"error: {exc}"


def calculator_dataset(num_examples: int, *, max_operand: int = 99, seed: int = 0) -> datasets.Dataset:
    """``num_examples`` rows ``prompt`` (asks for ``A*B+C`` and explains the tool) and ``answer`` (the integer).

    Operands are drawn uniformly from ``[0, max_operand]``. The same arguments give the same rows.

    Raises:
        ValueError: ``num_examples < 1`` or ``max_operand < 1``.
    """
    import datasets

    if num_examples < 1:
        raise ValueError(f"num_examples={num_examples!r} is invalid: allowed >= 1")
    if max_operand < 1:
        raise ValueError(f"max_operand={max_operand!r} is invalid: allowed >= 1")
    rng = random.Random(seed)
    prompts: list[str] = []
    answers: list[str] = []
    for _ in range(num_examples):
        a, b, c = (rng.randint(0, max_operand) for _ in range(3))
        prompts.append(CALCULATOR_PROMPT.format(expression=f"{a}*{b}+{c}"))
        answers.append(str(a * b + c))
    return datasets.Dataset.from_dict({"prompt": prompts, "answer": answers})


def tool_answer_reward(completions: list[str], answer: list[str], **_: Any) -> list[float]:
    """1.0 where the LAST ``<answer>N</answer>`` of the completion equals ``answer``, else 0.0.

    The completion holds tool outputs too (see :class:`MultiTurnWorkflow`), so only the answer tag counts: a
    ``<output>`` with the right value earns nothing by itself.
    """
    if len(answer) != len(completions):
        raise ValueError(f"completions has {len(completions)} items but answer has {len(answer)}")
    rewards = []
    for text, reference in zip(completions, answer):
        found = _ANSWER.findall(text)
        rewards.append(float(bool(found) and found[-1] == str(reference).strip()))
    return rewards


# --- A tool-use task the tiny reverse policy can learn on CPU (16-token vocabulary: digits, '>', '|') ----------
TOOL_CALL = "|"
CODE_DIGITS = 1
"""Digits of a lookup code: one, so that a ~133k-parameter model learns to call the tool and copy its answer within
a few hundred CPU steps."""
"""The call marker of the lookup tool: a turn ending in it calls the tool (``MultiTurnWorkflow(call_end=...)``)."""


def lookup_code(key: str) -> str:
    """The value the lookup tool stores for ``key`` (the digits of a prompt ``"123>"``): 3 digits the model cannot
    work out from the key (a fixed multiplicative hash), so it must call the tool to answer."""
    digits = "".join(ch for ch in key if ch.isdigit())
    if not digits:
        raise ValueError(f"key {key!r} has no digits; allowed a prompt like '123>'")
    return f"{(int(digits) * 7919 + 4057) % 10**CODE_DIGITS:0{CODE_DIGITS}d}"


def lookup_call(turn_text: str) -> str | None:
    """``parse_call`` for the lookup tool: a turn that ends with :data:`TOOL_CALL` calls it (no arguments)."""
    return "lookup" if turn_text.endswith(TOOL_CALL) else None


def lookup_env(call: str, row: dict[str, Any]) -> str:
    """The lookup tool: the code stored for the row's prompt (:func:`lookup_code`)."""
    return lookup_code(row["prompt"])


def lookup_output(answer: str) -> str:
    """``format_output`` of the lookup tool: its answer, then ``>`` (the model writes its final answer after it)."""
    return f"{answer}>"


def lookup_reward(completions: list[str], prompts: list[str], **_: Any) -> list[float]:
    """:func:`rlsdk.rewards.reverse_reward`'s partial credit of the FINAL answer against the prompt's code: the text
    after the last ``>`` of the completion (after the tool's output when the tool was called). Copying the tool's
    output earns full credit; the output itself, which the model did not write, earns nothing; answering without
    the tool can only guess.
    """
    from rlsdk.rewards import reverse_reward

    finals = [text.rsplit(">", 1)[-1].replace(TOOL_CALL, "") for text in completions]
    return reverse_reward(finals, [lookup_code(p) for p in prompts])


def tool_called_reward(completions: list[str], **_: Any) -> list[float]:
    """1.0 where the completion called the lookup tool (a :data:`TOOL_CALL` answered by the tool's output, which
    ends in ``>``), else 0.0: a small shaping term
    (compose it with :func:`lookup_reward` through :func:`rlsdk.rewards.combine_rewards`) that rewards trying the
    tool before the model has learned to use its answer."""
    return [float(TOOL_CALL in text and ">" in text.split(TOOL_CALL, 1)[1]) for text in completions]
