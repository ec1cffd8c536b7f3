"""assert_close makes the caller choose both tolerances."""

from __future__ import annotations

import pytest
import torch

from rlsdk.testing import assert_close


def test_assert_close_without_tolerances_raises_type_error() -> None:
    with pytest.raises(TypeError):
        assert_close(torch.zeros(2), torch.zeros(2))  # type: ignore[call-arg]


def test_assert_close_within_atol_passes() -> None:
    assert_close(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0 + 1e-6]), rtol=0.0, atol=1e-5)


def test_assert_close_outside_tolerances_raises_assertion_error() -> None:
    with pytest.raises(AssertionError, match="not close"):
        assert_close(torch.tensor([1.0]), torch.tensor([1.1]), rtol=1e-3, atol=1e-3)


def test_assert_close_negative_tolerance_raises_value_error() -> None:
    with pytest.raises(ValueError, match="rtol and atol"):
        assert_close(torch.zeros(1), torch.zeros(1), rtol=-1.0, atol=0.0)
