"""What a default Session exposes to other users of the machine (docs/security.md): one real run (2 accelerate
ranks on gloo, the embedded engine, one step and a checkpoint), observed from outside as an attacker would see it.

The run is observed once (module fixture); each test asserts one property of it. Extend ``_observe`` for another
kind of run (e.g. a vLLM server: its process is a child of the controller, so ``tree_listeners`` sees it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from rlsdk import Session
from rlsdk.config import SessionConfig
from rlsdk.rewards import reverse_reward
from rlsdk.testing.net import Listener, not_loopback, tree_listeners

pytestmark = [pytest.mark.security, pytest.mark.distributed]


def _modes(root: Path) -> dict[Path, tuple[int, str]]:
    """``{path: (permission bits, "dir" | "file" | "link")}`` of ``root`` and everything under it."""
    out = {}
    for path in [root, *root.rglob("*")]:
        info = path.lstat()
        kind = "link" if stat.S_ISLNK(info.st_mode) else "dir" if stat.S_ISDIR(info.st_mode) else "file"
        out[path] = (stat.S_IMODE(info.st_mode), kind)
    return out


def _descendants() -> set[int]:
    import psutil

    return {child.pid for child in psutil.Process(os.getpid()).children(recursive=True)}


async def _observe(config: SessionConfig) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    # Processes of other runs in this test process (a suite-scoped vLLM Session started by an earlier test
    # module) are not this run's: only what the Session starts is observed.
    others = _descendants()
    session = await Session.start(config)
    try:
        rollout = await session.reward(await session.rollout(), reverse_reward)
        await session.update(rollout)
        await session.sync_weights()
        await session.save_checkpoint()
        seen["listeners"] = [lst for lst in tree_listeners(os.getpid()) if lst.pid not in others]
        seen["rank_pids"] = {info["pid"] for info in session.rank_info.values()}
        seen["channel_address"] = session._run.channel.address
        runtime_dir = session._run.runtime_dir  # the private sockets and rendezvous files of this start
        runtime = Path(runtime_dir.path) if runtime_dir is not None else None
        owner = () if runtime is None else (stat.S_IMODE(runtime.stat().st_mode), runtime.stat().st_uid)
        seen["runtime_dir"] = (runtime, *owner)
        publish = Path(session._run.publish_dir)
        seen["publish"] = _modes(publish)
    finally:
        await session.close()
    seen["runtime_dir_after_close"] = runtime is not None and runtime.exists()
    return seen


@pytest.fixture(scope="module")
def observed(
    make_small_config: Callable[[Path], SessionConfig], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    output = tmp_path_factory.mktemp("exposure") / "out"
    config = make_small_config(output)
    previous = os.umask(0o022)  # the usual umask: what is private must be made so, not inherited
    try:
        seen = asyncio.run(_observe(config))
    finally:
        os.umask(previous)
    seen["output"] = _modes(output)
    yield seen


def _describe(listeners: list[Listener]) -> str:
    return "\n".join(str(listener) for listener in listeners) or "(none)"


def test_default_session_controller_listens_on_no_tcp_port(observed: dict[str, Any]) -> None:
    controller = [listener for listener in observed["listeners"] if listener.pid == os.getpid()]

    assert controller == [], _describe(controller)
    assert observed["channel_address"].startswith("ipc://")


def test_default_session_listeners_are_gloo_on_loopback_in_the_ranks_only(observed: dict[str, Any]) -> None:
    listeners = observed["listeners"]

    assert not_loopback(listeners) == [], _describe(not_loopback(listeners))
    # What remains is gloo's transport in each rank (docs/security.md names it); no rendezvous store, no launcher.
    assert {listener.pid for listener in listeners} <= observed["rank_pids"], _describe(listeners)
    assert all(listener.kind == "tcp" for listener in listeners), _describe(listeners)


def test_default_session_runtime_dir_is_private_while_it_runs_and_removed_at_close(observed: dict[str, Any]) -> None:
    path, *owner = observed["runtime_dir"]

    assert path is not None and owner == [0o700, os.getuid()]
    assert observed["channel_address"] == f"ipc://{path}/control"
    assert observed["runtime_dir_after_close"] is False


def test_default_session_output_and_published_weights_are_private(observed: dict[str, Any]) -> None:
    paths = {**observed["output"], **observed["publish"]}
    wrong = {
        str(path): oct(mode)
        for path, (mode, kind) in paths.items()
        if kind != "link" and mode != (0o700 if kind == "dir" else 0o600)
    }

    assert wrong == {}
    names = {path.name for path in observed["output"]}
    assert {"logs", "tensorboard", "checkpoints", "traces", "rank_0.log", "manifest.json"} <= names


def test_output_mode_lets_the_group_read_when_the_user_asks(small_config: SessionConfig, tmp_path: Path) -> None:
    config = dataclasses.replace(small_config, observe=dataclasses.replace(small_config.observe, output_mode="0750"))

    async def run() -> None:
        session = await Session.start(config)
        await session.close()

    previous = os.umask(0o077)
    try:
        asyncio.run(run())
    finally:
        os.umask(previous)

    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "out").rglob("*")}
    assert modes["logs"] == 0o750 and modes["controller.log"] == 0o640
