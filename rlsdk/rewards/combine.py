"""Weighted sums of reward functions that keep each component's values for logging."""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Mapping, Sequence
from typing import Any

from rlsdk.rewards.apply import RewardFn

RESERVED_COMPONENT_NAMES = frozenset({"mean", "std"})
"""Names a component may not take: the Session already logs ``reward/mean`` and ``reward/std``."""


class RewardBreakdown(list[float]):
    """The combined rewards (a ``list`` of ``B`` floats) plus ``components``: name -> the ``B`` unweighted values.

    ``compute_rewards`` treats it as the plain list; ``Session.reward`` also stores ``components`` on the rollout
    (``rollout.info["reward_components"]``, name -> float32 tensor ``(B,)``).
    """

    def __init__(self, values: Sequence[float], components: Mapping[str, Sequence[float]]) -> None:
        super().__init__(values)
        self.components: dict[str, list[float]] = {name: list(v) for name, v in components.items()}


def _name(fn: RewardFn) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def _as_floats(name: str, fn: RewardFn, raw: Any, num_samples: int) -> list[float]:
    try:
        values = [float(v) for v in (raw.tolist() if hasattr(raw, "tolist") else raw)]
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"reward component {name!r} ({_name(fn)}) returned {type(raw).__name__}; "
            f"allowed: a sequence of {num_samples} numbers"
        ) from exc
    if len(values) != num_samples:
        raise ValueError(
            f"reward component {name!r} ({_name(fn)}) returned {len(values)} rewards for {num_samples} completions"
        )
    return values


class RewardComponentError(RuntimeError):
    """A component of a :func:`combine_rewards` function raised; the message names the component."""


def _component_error(name: str, fn: RewardFn, exc: Exception) -> RewardComponentError:
    return RewardComponentError(f"reward component {name!r} ({_name(fn)}) raised {type(exc).__name__}: {exc}")


def combine_rewards(components: Mapping[str, tuple[RewardFn, float]]) -> RewardFn:
    """One reward function: ``sum(weight * fn(...))`` over ``components`` (``{name: (fn, weight)}``).

    Every component receives the same keyword columns (so each needs ``**_`` for the columns it ignores). The
    result is a :class:`RewardBreakdown`: the weighted sums, and each component's unweighted values under its
    name, which ``Session.reward`` keeps on the rollout so they can be logged as ``reward/<name>``.

    The combination is ``async`` when any component is (sync components then run in worker threads,
    concurrently with the async ones); otherwise it is a plain function.

    Raises:
        ValueError: no component; a name that is empty, contains ``/`` or is reserved (``mean``, ``std``); a
            weight that is not a finite number; a component that is not callable. When called: a component
            returned the wrong number of values or non-numbers (the message names the component).
    """
    if not components:
        raise ValueError("combine_rewards needs at least one component: {name: (fn, weight)}")
    checked: dict[str, tuple[RewardFn, float]] = {}
    for name, entry in components.items():
        if not isinstance(name, str) or not name or "/" in name or name in RESERVED_COMPONENT_NAMES:
            raise ValueError(
                f"reward component name {name!r} is invalid: allowed a non-empty string without '/', "
                f"not one of {sorted(RESERVED_COMPONENT_NAMES)}"
            )
        if not isinstance(entry, tuple) or len(entry) != 2:
            raise ValueError(f"reward component {name!r} is {entry!r}; allowed: a (fn, weight) tuple")
        fn, weight = entry
        if not callable(fn):
            raise ValueError(f"reward component {name!r}: {fn!r} is not callable")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
            raise ValueError(f"reward component {name!r} has weight {weight!r}; allowed: a finite number")
        checked[name] = (fn, float(weight))

    def total(columns: dict[str, Any], raw: dict[str, Any]) -> RewardBreakdown:
        num_samples = len(columns["completions"])
        values = {name: _as_floats(name, checked[name][0], raw[name], num_samples) for name in checked}
        summed = [sum(checked[name][1] * values[name][i] for name in checked) for i in range(num_samples)]
        return RewardBreakdown(summed, values)

    label = "combine_rewards(" + ", ".join(f"{n}={w:g}*{_name(f)}" for n, (f, w) in checked.items()) + ")"
    if any(inspect.iscoroutinefunction(fn) for fn, _ in checked.values()):

        async def combined_async(completions: list[str], **columns: Any) -> RewardBreakdown:
            async def one(name: str, fn: RewardFn) -> Any:
                try:
                    if inspect.iscoroutinefunction(fn):
                        return await fn(completions=completions, **columns)
                    return await asyncio.to_thread(fn, completions=completions, **columns)
                except Exception as exc:
                    raise _component_error(name, fn, exc) from exc

            results = await asyncio.gather(*(one(name, fn) for name, (fn, _) in checked.items()))
            return total({"completions": completions, **columns}, dict(zip(checked, results)))

        combined_async.__qualname__ = combined_async.__name__ = label
        return combined_async

    def combined(completions: list[str], **columns: Any) -> RewardBreakdown:
        results: dict[str, Any] = {}
        for name, (fn, _) in checked.items():
            try:
                results[name] = fn(completions=completions, **columns)
            except Exception as exc:
                raise _component_error(name, fn, exc) from exc
        return total({"completions": completions, **columns}, results)

    combined.__qualname__ = combined.__name__ = label
    return combined
