"""Math-answer correctness with Hugging Face's ``math-verify`` (the ``math`` extra)."""

from __future__ import annotations

import threading
from typing import Any

MATH_VERIFY_TIMEOUT_S = 5
"""math-verify's own per-parse and per-comparison timeout, used when called on the main thread."""

_DELIMITERS = ("$", "\\boxed", "\\(", "\\[")


def _math_verify() -> tuple[Any, Any]:
    try:
        from math_verify import parse, verify
    except ImportError as exc:
        raise ImportError(
            "math_reward needs the math-verify package: pip install 'rlsdk[math]' (or math-verify==0.9.0)"
        ) from exc
    return parse, verify


def math_reward(completions: list[str], answer: list[Any], **_: Any) -> list[float]:
    """1.0 where the completion's final answer is mathematically equal to ``answer``, else 0.0.

    Both sides go through ``math_verify.parse`` (LaTeX and plain expressions; the completion's ``\\boxed{}``
    answer first, else its last expression) and are compared with ``math_verify.verify`` (symbolic and numeric
    equality: ``\\frac{1}{2}`` equals ``0.5`` and ``1/2``; sets, intervals, matrices). A reference without LaTeX
    delimiters is read as inline math (``x+1`` -> ``$x+1$``). A completion with no answer to extract earns 0.

    Timeouts: math-verify bounds parsing and comparison with ``signal.alarm``, which only works on the main
    thread. ``Session.reward`` runs sync functions in a worker thread, where those timeouts are off: bound the
    call with ``session.reward(..., timeout_s=...)`` (a runaway sympy computation then still occupies its worker
    thread until it ends).

    Args:
        completions: decoded completions, one per sample.
        answer: the reference answer per sample (a string or a number), e.g. the data set's ``answer`` column.

    Raises:
        ImportError: math-verify is not installed (install the ``math`` extra).
        ValueError: lengths differ, or a reference answer cannot be parsed (the message names its index).
    """
    parse, verify = _math_verify()
    if len(completions) != len(answer):
        raise ValueError(f"completions has {len(completions)} items but answer has {len(answer)}")
    timeout = MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    golds: dict[str, Any] = {}
    rewards: list[float] = []
    for index, (completion, reference) in enumerate(zip(completions, answer)):
        text = str(reference).strip()
        if text not in golds:
            wrapped = text if any(d in text for d in _DELIMITERS) else f"${text}$"
            gold = parse(wrapped, parsing_timeout=timeout) or parse(text, parsing_timeout=timeout)
            if not gold:
                raise ValueError(f"answer[{index}]={reference!r} could not be parsed as a math answer")
            golds[text] = gold
        predicted = parse(completion, parsing_timeout=timeout)
        correct = bool(predicted) and verify(golds[text], predicted, timeout_seconds=timeout)
        rewards.append(float(correct))
    return rewards
