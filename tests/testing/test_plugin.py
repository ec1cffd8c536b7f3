"""The pytest plugin, used by this very suite: report formatting, the fake process group, the tiny policy."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from rlsdk.testing import assert_close
from rlsdk.testing.plugin import MARKERS, skipped_suites_report


def test_skipped_suites_report_groups_skips_by_reason_with_files() -> None:
    skips = [
        ("tests/a.py::test_x", "gpu: requires a CUDA device: torch.cuda.is_available() is False"),
        ("tests/a.py::test_y", "gpu: requires a CUDA device: torch.cuda.is_available() is False"),
        ("tests/b.py::test_z", "needs vllm"),
    ]
    selected = {"tests/a.py::test_x": {"gpu"}, "tests/c.py::test_ok": {"distributed"}}

    lines = skipped_suites_report(skips, selected, deselected=2, markexpr="not slow")

    assert lines[0] == "Skipped: 3 test(s):"
    assert lines[1] == "- gpu: requires a CUDA device: torch.cuda.is_available() is False (2): tests/a.py (2)"
    assert lines[2] == "- needs vllm (1): tests/b.py (1)"
    assert lines[3] == "Deselected by -m 'not slow': 2 test(s) not run."
    assert lines[4] == "Markers with no test run: slow, notebook, vllm, gpu, multinode, security."


def test_skipped_suites_report_without_skips_says_none() -> None:
    lines = skipped_suites_report([], {"t::a": set(MARKERS)})

    assert lines == ["Skipped: 0 test(s)."]


def test_plugin_markers_registered_once(pytestconfig: pytest.Config) -> None:
    names = [line.split(":")[0].strip() for line in pytestconfig.getini("markers")]

    assert all(names.count(name) == 1 for name in MARKERS)


def test_fake_pg_collectives_run_in_one_process_without_communicating(fake_pg: Any) -> None:
    tensor_N = torch.ones(3)

    dist.all_reduce(tensor_N, group=fake_pg)

    assert dist.get_world_size(fake_pg) == 4
    assert dist.get_rank(fake_pg) == 0
    assert_close(tensor_N, torch.ones(3), rtol=0.0, atol=0.0)


def test_tiny_model_and_tokenizer_round_trip_digits(tiny_model_and_tokenizer: tuple[Any, Any]) -> None:
    model, tokenizer = tiny_model_and_tokenizer
    ids_B_T = tokenizer(["123"], return_tensors="pt").input_ids

    with torch.no_grad():
        logits_B_T_V = model(ids_B_T).logits

    assert logits_B_T_V.shape == (1, ids_B_T.shape[1], model.config.vocab_size)
    assert tokenizer.decode(ids_B_T[0], skip_special_tokens=True).replace(" ", "") == "123"
