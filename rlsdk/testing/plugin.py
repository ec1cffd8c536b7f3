"""rlsdk's pytest plugin: the test markers, a skipped-suite report, and fixtures for distributed RL tests.

Enabled by installing rlsdk (entry point ``pytest11``: ``rlsdk.testing.plugin``); without the entry point, add
``-p rlsdk.testing.plugin`` to pytest's ``addopts`` or ``pytest_plugins = ["rlsdk.testing.plugin"]`` to the
root ``conftest.py``. Disable it with ``-p no:rlsdk.testing.plugin``.

Markers (registered unless the project declares them itself): ``slow``, ``distributed``, ``notebook``,
``vllm``, ``gpu``, ``multinode``, ``security``. A ``gpu`` test is skipped, with that reason, when torch sees no
CUDA device; a test using ``gloo_group`` is marked ``distributed``.

Report: the run ends with a "skipped suites" section, ready to paste into a pull request: every skip grouped by
reason with its files, tests deselected by ``-m``, and the markers of which no test ran.

Fixtures:
    gloo_group: ``gloo_group(fn, world_size, *args) -> [result of rank 0, ...]`` runs ``fn(rank, world_size,
        *args)`` in ``world_size`` processes with a real gloo default process group; ``fn`` must be importable
        (module level).
    fake_pg: torch's fake process group as the default group, rank ``fake_pg_rank`` (0) of
        ``fake_pg_world_size`` (4): collectives return at once without communicating, so call order and shapes
        are testable in one process, values are not. Destroyed after the test. Override either fixture (or
        parametrize it indirectly) for other sizes.
    tiny_policy: ``tiny_policy(seed=0, **sizes) -> Path`` of a tiny local causal LM with its tokenizer, built
        once per (seed, sizes) per session; nothing downloads.
    tiny_model_and_tokenizer: a fresh ``(model, tokenizer)`` loaded from ``tiny_policy()`` for each test.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

MARKERS = {
    "slow": "long-running test (deselect with -m 'not slow')",
    "distributed": "starts real multi-rank process groups (gloo)",
    "notebook": "executes notebooks with a real kernel",
    "vllm": "needs the vllm extra and a real vLLM server",
    "gpu": "needs a CUDA device",
    "multinode": "needs more than one machine",
    "security": "an attack on the threat model of docs/security.md, run against real sockets, files and servers",
}
REPORT_TITLE = "skipped suites (paste into the PR)"
_SELECTED = pytest.StashKey[dict[str, set[str]]]()
_EXTRA_LINES = pytest.StashKey[list[str]]()
_DESELECTED = pytest.StashKey[int]()


def pytest_configure(config: pytest.Config) -> None:
    declared = {line.split(":")[0].split("(")[0].strip() for line in config.getini("markers")}
    for name, text in MARKERS.items():
        if name not in declared:
            config.addinivalue_line("markers", f"{name}: {text}")
    config.stash[_SELECTED] = {}
    config.stash[_DESELECTED] = 0


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects, so an added `distributed` marker counts
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "gloo_group" in getattr(item, "fixturenames", ()) and item.get_closest_marker("distributed") is None:
            item.add_marker(pytest.mark.distributed)
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if gpu_items and not _cuda_available():
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason="gpu: requires a CUDA device: torch.cuda.is_available() is False"))


def pytest_deselected(items: Sequence[pytest.Item]) -> None:
    if items:
        config = items[0].config
        config.stash[_DESELECTED] = config.stash.get(_DESELECTED, 0) + len(items)


def pytest_collection_finish(session: pytest.Session) -> None:
    session.config.stash[_SELECTED] = {
        item.nodeid: {m.name for m in item.iter_markers() if m.name in MARKERS} for item in session.items
    }


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    skips = [(report.nodeid, _skip_reason(report)) for report in terminalreporter.stats.get("skipped", [])]
    lines = skipped_suites_report(
        skips,
        config.stash.get(_SELECTED, {}),
        deselected=config.stash.get(_DESELECTED, 0),
        markexpr=config.getoption("markexpr", "") or "",
    )
    terminalreporter.write_sep("=", REPORT_TITLE)
    for line in [*lines, *config.stash.get(_EXTRA_LINES, [])]:
        terminalreporter.write_line(line)


def add_report_lines(config: pytest.Config, lines: Sequence[str]) -> None:
    """Append ``lines`` to this run's skipped-suite report: for what a test runs or skips inside itself (e.g.
    the documentation blocks of a page, each executed or not run with a reason)."""
    config.stash.setdefault(_EXTRA_LINES, []).extend(lines)


def skipped_suites_report(
    skips: Sequence[tuple[str, str]],
    selected: dict[str, set[str]],
    *,
    deselected: int = 0,
    markexpr: str = "",
) -> list[str]:
    """Markdown lines: skips grouped by reason (with files), deselected tests, markers of which no test ran.

    ``skips`` holds ``(nodeid, reason)`` pairs; ``selected`` maps each selected test's nodeid to its markers.
    """
    by_reason: dict[str, list[str]] = defaultdict(list)
    for nodeid, reason in skips:
        by_reason[reason].append(nodeid)
    lines = [f"Skipped: {len(skips)} test(s)" + (":" if skips else ".")]
    for reason, nodeids in sorted(by_reason.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        files = Counter(nodeid.split("::")[0] for nodeid in nodeids)
        where = ", ".join(f"{path} ({count})" for path, count in sorted(files.items()))
        lines.append(f"- {reason} ({len(nodeids)}): {where}")
    if deselected:
        how = f" by -m {markexpr!r}" if markexpr else ""
        lines.append(f"Deselected{how}: {deselected} test(s) not run.")
    skipped = {nodeid for nodeid, _ in skips}
    ran = set().union(*(marks for nodeid, marks in selected.items() if nodeid not in skipped))
    not_run = [name for name in MARKERS if name not in ran]
    if not_run:
        lines.append(f"Markers with no test run: {', '.join(not_run)}.")
    return lines


def _skip_reason(report: Any) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return reason.removeprefix("Skipped: ")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@pytest.fixture
def gloo_group() -> Callable[..., list[Any]]:
    """``gloo_group(fn, world_size, *args)``: run ``fn(rank, world_size, *args)`` on real gloo ranks."""
    from rlsdk.testing.distributed import run_in_process_group

    return run_in_process_group


@pytest.fixture
def fake_pg_world_size() -> int:
    return 4


@pytest.fixture
def fake_pg_rank() -> int:
    return 0


@pytest.fixture
def fake_pg(fake_pg_world_size: int, fake_pg_rank: int) -> Iterator[Any]:
    """torch's fake process group as the default group for one test; yields the group."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        raise RuntimeError("fake_pg: a default process group already exists in this process; destroy it first")
    dist.init_process_group("fake", store=FakeStore(), rank=fake_pg_rank, world_size=fake_pg_world_size)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def tiny_policy(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``tiny_policy(seed=0, **sizes) -> Path``: a tiny local causal LM + tokenizer (``build_tiny_policy``)."""
    built: dict[tuple[Any, ...], Path] = {}

    def build(seed: int = 0, **sizes: int) -> Path:
        key = (seed, *sorted(sizes.items()))
        if key not in built:
            from rlsdk.data import build_tiny_policy

            built[key] = build_tiny_policy(tmp_path_factory.mktemp("tiny-policy") / "model", seed=seed, **sizes)
        return built[key]

    return build


@pytest.fixture
def tiny_model_and_tokenizer(tiny_policy: Callable[..., Path]) -> tuple[Any, Any]:
    """A fresh ``(model, tokenizer)`` of the seed-0 tiny policy, in eval mode on CPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_policy()
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
