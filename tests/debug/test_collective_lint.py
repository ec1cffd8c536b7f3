"""The lint aid flags collectives inside rank-conditional branches and nothing else."""

from __future__ import annotations

import pytest

from rlsdk.debug.lint import assert_no_rank_conditional_collectives, lint_source, site_is_rank_conditional

SOURCE = """
import torch.distributed as dist

def step(accelerator, t, rank):
    dist.all_reduce(t)
    if rank == 0:
        dist.broadcast(t, src=0)
    if dist.get_rank() != 0:
        print("not main")
    else:
        dist.barrier()
    if accelerator.is_main_process:
        torch.distributed.all_gather([t], t)
        dist.send(t, 1)  # rlsdk: allow-conditional-collective
    if t.sum() > 0:
        dist.all_reduce(t)
"""


def test_lint_source_flags_each_collective_in_a_rank_branch_with_line_and_condition() -> None:
    findings = lint_source(SOURCE, "step.py")

    assert [(f.line, f.call) for f in findings] == [(7, "broadcast"), (11, "barrier"), (13, "all_gather")]
    assert "rank == 0" in str(findings[0]) and "accelerator.is_main_process" in findings[2].condition


def test_site_is_rank_conditional_reads_the_file_at_the_call_site(tmp_path) -> None:
    path = tmp_path / "step.py"
    path.write_text(SOURCE)

    assert site_is_rank_conditional(f"{path}:7")
    assert not site_is_rank_conditional(f"{path}:5")
    assert not site_is_rank_conditional("/does/not/exist.py:3")


def test_assert_helper_fails_naming_the_finding(tmp_path) -> None:
    (tmp_path / "ok.py").write_text("import torch.distributed as dist\ndist.barrier()\n")
    (tmp_path / "bad.py").write_text(SOURCE)

    with pytest.raises(AssertionError, match=r"bad.py:7: broadcast\(\)"):
        assert_no_rank_conditional_collectives(tmp_path)
    assert_no_rank_conditional_collectives(tmp_path / "ok.py")
