"""The library lint: print, wildcard imports and process-group creation at import time."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlsdk.testing.lint import check_source, main


@pytest.mark.parametrize(
    ("source", "code"),
    [
        ("print('hi')\n", "RLS001"),
        ("def f():\n    print('hi')\n", "RLS001"),
        ("from os import *\n", "RLS002"),
        ("import torch.distributed as dist\ndist.init_process_group('gloo')\n", "RLS003"),
        ("from accelerate import Accelerator\nACC = Accelerator(cpu=True)\n", "RLS003"),
        ("class A:\n    group = dist.new_group([0, 1])\n", "RLS003"),
        ("def f(state=PartialState()):\n    pass\n", "RLS003"),
        ("try:\n    init_process_group('gloo')\nexcept Exception:\n    pass\n", "RLS003"),
    ],
)
def test_check_source_offending_code_reports_its_code(source: str, code: str) -> None:
    findings = check_source(source, "m.py")

    assert len(findings) == 1
    assert f": {code} " in findings[0]
    assert findings[0].startswith("m.py:")


@pytest.mark.parametrize(
    "source",
    [
        "def start():\n    dist.init_process_group('gloo')\n",
        "async def start():\n    return Accelerator(cpu=True)\n",
        "if __name__ == '__main__':\n    init_process_group('gloo')\n",
        "make = lambda: new_group([0])\n",
        "from os import path\nlogger.info('x')\n",
    ],
)
def test_check_source_clean_code_reports_nothing(source: str) -> None:
    assert check_source(source) == []


def test_main_library_tree_is_clean() -> None:
    assert main([str(Path(__file__).parents[2] / "rlsdk")]) == 0


def test_main_offending_file_exits_one_and_lists_finding(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("from os import *\n")

    rc = main([str(tmp_path)])

    assert rc == 1
    assert f"{bad}:1:1: RLS002" in capsys.readouterr().out
