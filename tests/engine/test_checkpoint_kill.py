"""A kill -9 during checkpoint writing leaves the previous checkpoint loadable and the partial one ignored.

Two levels: a real Session whose writer rank is SIGKILLed half-way through writing ``trainer_state.pt`` (then a
new Session resumes from 'latest'), and :func:`finalize_checkpoint` in a subprocess killed with SIGKILL at each
step of the controller's finalisation (extra files, hashing, manifest, fsync, rename).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import _checkpoint_faults
import psutil
import pytest

from rlsdk import Session, SessionConfig
from rlsdk.engine.train.checkpoint import (
    complete_checkpoints,
    finalize_checkpoint,
    prune_checkpoints,
    resolve_checkpoint,
    verify_checkpoint,
)
from rlsdk.rewards import reverse_reward

MARKER_TIMEOUT_S = 60.0


async def _step(session: Session) -> None:
    rollout = await session.rollout()
    rollout = await session.reward(rollout, reverse_reward)
    await session.update(rollout)
    await session.sync_weights()


async def _wait_for(path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s} s")
        await asyncio.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.distributed
def test_writer_rank_killed_mid_checkpoint_leaves_previous_loadable_and_resume_continues_from_it(
    small_config: SessionConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(
        "PYTHONPATH",
        os.pathsep.join(filter(None, [str(Path(_checkpoint_faults.__file__).parent), os.environ.get("PYTHONPATH")])),
    )  # the ranks import it
    marker = tmp_path / "writer-paused"
    root = Path(small_config.observe.output_dir) / "checkpoints"

    async def killed_run() -> tuple[Path, BaseException, list[Path], list[int]]:
        session = await Session.start(small_config)
        try:
            pids = [int(info["pid"]) for info in session.rank_info.values()]
            await _step(session)
            first = await session.save_checkpoint()
            await _step(session)
            await session.call(
                "call_function",
                {
                    "target": "_checkpoint_faults:hang_mid_trainer_state_write",
                    "kwargs": {"victim": 0, "marker": str(marker)},
                },
            )
            saving = asyncio.get_running_loop().create_task(session.save_checkpoint())
            await _wait_for(marker, MARKER_TIMEOUT_S)
            partial = sorted(root.glob("step_2.tmp-*"))  # as the kill finds it: rank 0 half-way through
            os.kill(int(marker.read_text()), signal.SIGKILL)
            try:
                await asyncio.wait_for(saving, timeout=60.0)
            except Exception as exc:  # the Session reports the dead rank to the pending command
                error: BaseException = exc
            else:
                raise AssertionError("save_checkpoint returned although its writer rank was killed")
        finally:
            await session.close()
        return first, error, partial, pids

    resumed_config = dataclasses.replace(
        small_config, train=dataclasses.replace(small_config.train, resume_from="latest")
    )

    async def resumed_run() -> tuple[dict[str, Any], Path]:
        async with await Session.start(resumed_config) as session:
            start = {
                "resumed_from": session.resumed_from,
                "versions": (session.versions.trainer_version, session.versions.engine_version),
                "step": session.step,
            }
            await _step(session)
            saved = await session.save_checkpoint()
        return start, saved

    first, error, partial, pids = asyncio.run(killed_run())
    partial_files = {str(f.relative_to(partial[0])) for f in partial[0].rglob("*") if f.is_file()} if partial else set()
    after_kill = complete_checkpoints(root)
    latest = resolve_checkpoint("latest", root.parent)
    survivors = [pid for pid in pids if _alive(pid)]
    start, saved = asyncio.run(resumed_run())

    assert first == root / "step_1"
    assert "rank 0" in str(error) and "SIGKILL" in str(error)
    assert len(partial) == 1 and {"rng_rank0.pt", "rng_rank1.pt", "trainer_state.pt"} <= partial_files
    assert "manifest.json" not in partial_files  # never finalised
    assert after_kill == [root / "step_1"]  # the partial step_2 is not a checkpoint
    assert latest == root / "step_1"
    assert survivors == []
    assert start == {"resumed_from": root / "step_1", "versions": (1, 1), "step": 1}
    assert saved == root / "step_2"
    verify_checkpoint(saved)
    assert not list(root.glob("step_*.tmp-*"))  # the next save cleaned the partial directory up


# ------------------------------------------------------------------------------------------------ unit level
# Each point kills the finalising process with SIGKILL from inside the step it names (deterministic: no race).
_FINALIZE_UNDER_KILL = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    import rlsdk.engine.train.checkpoint as checkpoint

    point, tmp, final = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    calls = {"n": 0}

    def kill():
        os.kill(os.getpid(), signal.SIGKILL)

    def after(n, real):
        def wrapped(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] > n:
                kill()
            return real(*args, **kwargs)
        return wrapped

    if point == "writing-extra-files":
        Path.write_text = after(1, Path.write_text)  # the first extra file written, the second not
    elif point == "hashing-for-manifest":
        checkpoint._sha256 = after(2, checkpoint._sha256)
    elif point == "signing-manifest":
        checkpoint.write_signature = after(0, checkpoint.write_signature)  # manifest written, not signed
    elif point == "before-fsync":
        checkpoint._fsync_tree = after(0, checkpoint._fsync_tree)  # manifest written and signed, nothing synced
    elif point == "before-rename":  # the directory's rename (os.replace also moves the signature into place)
        real_replace = checkpoint.os.replace
        def die_before_rename(src, dst, *args, **kwargs):
            if Path(dst) == final:
                kill()
            return real_replace(src, dst, *args, **kwargs)
        checkpoint.os.replace = die_before_rename
        # EXTRA_PATCH
    elif point == "after-rename":
        real_replace = checkpoint.os.replace
        def replace_then_die(src, dst, *args, **kwargs):
            real_replace(src, dst, *args, **kwargs)
            if Path(dst) == final:
                kill()
        checkpoint.os.replace = replace_then_die
    elif point == "between-removing-old-and-rename":  # re-saving an existing step_N
        real_rmtree = checkpoint.shutil.rmtree
        def rmtree_then_die(*args, **kwargs):
            real_rmtree(*args, **kwargs)
            kill()
        checkpoint.shutil.rmtree = rmtree_then_die
    checkpoint.finalize_checkpoint(tmp, final, {"ledger.json": "{}", "config.yaml": "seed: 0\\n", "session.json": "{}"})
    """
)


def _rank_files(directory: Path, fill: bytes) -> Path:
    """What the ranks leave in a temporary checkpoint directory before the controller finalises it."""
    (directory / "model").mkdir(parents=True)
    (directory / "model" / "model.safetensors").write_bytes(fill * 200_000)
    (directory / "model" / "config.json").write_text('{"model_type": "llama"}')
    (directory / "trainer_state.pt").write_bytes(fill * 100_000)
    for rank in range(2):
        (directory / f"rng_rank{rank}.pt").write_bytes(fill * 1000)
    return directory


def _finalized(root: Path, step: int, fill: bytes) -> Path:
    tmp = _rank_files(root / f"step_{step}.tmp-00000000", fill)
    extra = {"ledger.json": "{}", "config.yaml": "seed: 0\n", "session.json": "{}"}
    return finalize_checkpoint(tmp, root / f"step_{step}", extra)


@pytest.mark.parametrize(
    ("point", "new_is_complete"),
    [
        ("writing-extra-files", False),
        ("hashing-for-manifest", False),
        ("signing-manifest", False),
        ("before-fsync", False),
        ("before-rename", False),
        ("after-rename", True),
    ],
)
def test_finalize_killed_at_each_step_leaves_only_complete_verified_checkpoints(
    tmp_path: Path, point: str, new_is_complete: bool
) -> None:
    root = tmp_path / "checkpoints"
    previous = _finalized(root, 1, b"\x01")
    tmp = _rank_files(root / "step_2.tmp-deadbeef", b"\x02")

    proc = subprocess.run(
        [sys.executable, "-c", _FINALIZE_UNDER_KILL, point, str(tmp), str(root / "step_2")],
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert proc.returncode == -signal.SIGKILL, proc.stderr
    expected = [previous, root / "step_2"] if new_is_complete else [previous]
    assert complete_checkpoints(root) == expected
    assert resolve_checkpoint("latest", tmp_path) == expected[-1]  # verified against its manifest
    verify_checkpoint(previous)
    assert tmp.is_dir() != new_is_complete  # a partial stays where 'latest' never looks ...
    prune_checkpoints(root, keep=2)
    assert not list(root.glob("step_*.tmp-*"))  # ... until the next save prunes it
    assert complete_checkpoints(root) == expected


@pytest.mark.parametrize(
    ("point", "survivor_fill"), [("before-rename", b"\x02"), ("between-removing-old-and-rename", b"\x03")]
)
def test_finalize_killed_while_replacing_the_same_step_leaves_one_complete_copy_of_that_step(
    tmp_path: Path, point: str, survivor_fill: bytes
) -> None:
    # Re-saving step_2 (no update in between) swaps the new copy into place atomically (renameat2 exchange):
    # killed before the swap, the old step_2 stays; killed after it (while the old copy is being removed), the
    # new one is in place. Never neither.
    root = tmp_path / "checkpoints"
    _finalized(root, 1, b"\x01")
    _finalized(root, 2, b"\x02")
    tmp = _rank_files(root / "step_2.tmp-deadbeef", b"\x03")
    patch = "checkpoint._exchange = after(0, checkpoint._exchange)" if point == "before-rename" else ""

    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            _FINALIZE_UNDER_KILL.replace("# EXTRA_PATCH", patch),
            point,
            str(tmp),
            str(root / "step_2"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert complete_checkpoints(root) == [root / "step_1", root / "step_2"]
    assert resolve_checkpoint("latest", tmp_path) == root / "step_2"  # verified against its manifest
    assert (root / "step_2" / "trainer_state.pt").read_bytes()[:1] == survivor_fill
