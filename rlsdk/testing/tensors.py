"""Tensor comparison that makes the caller choose the tolerances.

torch's ``assert_close`` picks tolerances from the dtype when none are given, which hides how close "close"
is. Here ``rtol`` and ``atol`` are keyword-only and required: a reader sees the accepted error at the call site.
"""

from __future__ import annotations

from typing import Any


def assert_close(actual: Any, expected: Any, *, rtol: float, atol: float, msg: str | None = None) -> None:
    """Assert ``|actual - expected| <= atol + rtol * |expected|`` elementwise (shapes, dtypes, devices equal).

    Takes tensors, numbers or (nested) sequences/mappings of them, as ``torch.testing.assert_close``. ``rtol`` and
    ``atol`` must be >= 0 (use 0 and 0 for exact equality). Raises AssertionError naming the worst mismatch, and
    ValueError for a negative tolerance.
    """
    if rtol < 0 or atol < 0:
        raise ValueError(f"rtol and atol must be >= 0, got rtol={rtol!r}, atol={atol!r}")
    import torch

    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=msg)
