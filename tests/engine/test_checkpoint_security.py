"""Attacks through a checkpoint someone hands you: code in a pickle, unlisted files, paths out of the directory,
tampered bytes and another user's signature, each against real files (and one against real ranks)."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
import random
import shlex
import stat
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import torch
import yaml

from rlsdk import Session, SessionConfig
from rlsdk.config import ConfigError, LaunchConfig, ModelConfig, ObserveConfig, TrainConfig
from rlsdk.engine.train import checkpoint as checkpoint_module
from rlsdk.engine.train.checkpoint import finalize_checkpoint, load_rng_state, resolve_checkpoint, rng_state
from rlsdk.rewards import reverse_reward
from rlsdk.session import load_resume_state

pytestmark = pytest.mark.security


class Payload:
    """Unpickling this runs ``touch MARKER``: what a crafted checkpoint file would do to whoever loads it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


@pytest.fixture(autouse=True)
def user_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This test's user: a checkpoint key of their own under a private XDG_CACHE_HOME."""
    cache = tmp_path / "home-cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    return cache / "rlsdk" / "checkpoint.key"


def _checkpoint(output_dir: Path, version: int = 3) -> Path:
    """A checkpoint as the controller finalises one, with real torch files (optimizer stand-in, RNG state)."""
    root = output_dir / "checkpoints"
    tmp = root / f"step_{version}.tmp-test"
    (tmp / "model").mkdir(parents=True)
    (tmp / "model" / "config.json").write_text("{}", encoding="utf-8")
    torch.save({"version": version, "optimizer": {}}, tmp / "trainer_state.pt")
    torch.save(rng_state(), tmp / "rng_rank0.pt")
    extra = {
        "ledger.json": json.dumps({"trainer_version": version, "engine_version": version}),
        "config.yaml": yaml.safe_dump({"launch": {"num_ranks": 1}, "train": {"parallelism": "ddp"}}),
        "data_state.json": json.dumps({"epoch": 0, "position": 4, "seed": 0, "num_rows": 64}),
        "session.json": json.dumps({"step": version, "rollouts": version}),
    }
    return finalize_checkpoint(tmp, root / f"step_{version}", extra)


def _config(output_dir: Path, resume_from: str) -> SessionConfig:
    return SessionConfig(
        model=ModelConfig(path="models/tiny"),
        launch=LaunchConfig(num_ranks=1),
        train=TrainConfig(resume_from=resume_from),
        observe=ObserveConfig(output_dir=str(output_dir)),
    )


def _relist(checkpoint: Path, name: str) -> None:
    """What someone without the key can do: make ``manifest.json`` list ``checkpoint/name`` with its current
    checksum, leaving the signature as it was."""
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    data = (checkpoint / name).read_bytes()
    manifest["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest, indent=1))


def test_checkpoint_key_is_created_0600_in_a_0700_directory_under_xdg_cache_home(
    tmp_path: Path, user_key: Path
) -> None:
    _checkpoint(tmp_path)

    key_dir_mode = stat.S_IMODE(user_key.parent.stat().st_mode)
    key_mode = stat.S_IMODE(user_key.stat().st_mode)
    assert (key_dir_mode, key_mode) == (0o700, 0o600)
    assert user_key.stat().st_uid == os.getuid()
    assert len(bytes.fromhex(user_key.read_text().strip())) == 32


def test_checkpoint_key_readable_by_others_is_refused_like_an_unprotected_ssh_key(
    tmp_path: Path, user_key: Path
) -> None:
    checkpoint = _checkpoint(tmp_path)
    user_key.chmod(0o644)

    with pytest.raises(ConfigError, match="chmod 600") as info:
        resolve_checkpoint(str(checkpoint), tmp_path)

    assert info.value.field == "train.resume_from"


def test_rng_file_with_a_pickle_payload_is_refused_without_running_it_even_when_the_user_trusts_it(
    tmp_path: Path,
) -> None:
    from rlsdk.engine.train.checkpoint import sign_checkpoint

    marker = tmp_path / "payload-ran"
    checkpoint = _checkpoint(tmp_path)
    torch.save({"python": Payload(marker), "numpy": None, "torch": None}, checkpoint / "rng_rank0.pt")
    _relist(checkpoint, "rng_rank0.pt")
    sign_checkpoint(checkpoint)  # the user vouches for it: still nothing in it may run
    resolve_checkpoint(str(checkpoint), tmp_path)

    with pytest.raises(Exception, match=r"posix\.system|Unsupported global|refused"):
        load_rng_state(checkpoint / "rng_rank0.pt")

    assert not marker.exists()


def test_rng_state_round_trips_through_a_weights_only_load_and_legacy_numpy_files_still_load(tmp_path: Path) -> None:
    path, legacy = tmp_path / "rng.pt", tmp_path / "rng-legacy.pt"
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    torch.save(rng_state(), path)
    # rlsdk before this change: numpy's state as an ndarray (needs numpy's array reconstructor unpickled)
    torch.save({"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}, legacy)
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)))

    draws = []
    for file in (path, legacy):
        random.seed(9), np.random.seed(9), torch.manual_seed(9)
        load_rng_state(file)
        draws.append((random.random(), float(np.random.rand()), float(torch.rand(1))))

    assert draws == [expected, expected]
    assert torch.serialization.get_unsafe_globals_in_checkpoint(path) == []


def test_checkpoint_holding_a_file_its_manifest_does_not_list_is_refused_naming_it(tmp_path: Path) -> None:
    checkpoint = _checkpoint(tmp_path)
    # transformers' from_pretrained would torch.load this in place of the listed weights
    torch.save({"lm_head.weight": torch.zeros(1)}, checkpoint / "model" / "pytorch_model.bin")

    with pytest.raises(ConfigError, match=r"does not list: model/pytorch_model\.bin") as info:
        load_resume_state(_config(tmp_path, str(checkpoint)))

    assert info.value.field == "train.resume_from"


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "symlink"])
def test_manifest_entry_leaving_the_checkpoint_directory_is_refused_even_when_signed(tmp_path: Path, kind: str) -> None:
    from rlsdk.engine.train.checkpoint import CheckpointError, verify_checkpoint
    from rlsdk.engine.train.checkpoint_signing import load_key, write_signature

    outside = tmp_path / "outside.txt"
    outside.write_text("not part of the checkpoint")
    checkpoint = _checkpoint(tmp_path)
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    entry = {"sha256": hashlib.sha256(outside.read_bytes()).hexdigest(), "bytes": outside.stat().st_size}
    if kind == "dotdot":
        name = "../../../outside.txt"
    elif kind == "absolute":
        name = str(outside)
    else:
        name = "model/outside.txt"
        (checkpoint / "model" / "outside.txt").symlink_to(outside)
    manifest["files"][name] = entry
    raw = json.dumps(manifest).encode()
    (checkpoint / "manifest.json").write_bytes(raw)
    write_signature(checkpoint, raw, load_key())  # signed: only the path check stands in the way

    with pytest.raises(CheckpointError, match=r"leaves the checkpoint directory|symbolic link"):
        verify_checkpoint(checkpoint)
    with pytest.raises(ConfigError) as info:
        load_resume_state(_config(tmp_path, str(checkpoint)))

    assert info.value.field == "train.resume_from"


@pytest.mark.parametrize("where", ["manifest", "data file"])
def test_tampered_checkpoint_is_refused_before_any_file_of_it_is_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    marker = tmp_path / "payload-ran"
    checkpoint = _checkpoint(tmp_path)
    if where == "manifest":  # one byte of the manifest itself
        raw = bytearray((checkpoint / "manifest.json").read_bytes())
        raw[raw.index(b'"bytes": ') + 9] ^= 0x01
        (checkpoint / "manifest.json").write_bytes(bytes(raw))
    else:  # a payload swapped in, the manifest's checksum rewritten to match (the signature cannot be)
        torch.save(Payload(marker), checkpoint / "rng_rank0.pt")
        _relist(checkpoint, "rng_rank0.pt")
    loads: list[Any] = []  # every file of the checkpoint hashed or loaded
    monkeypatch.setattr(checkpoint_module, "_sha256", lambda path: loads.append(path))
    monkeypatch.setattr(torch, "load", lambda *args, **kwargs: loads.append(args))
    monkeypatch.setattr(yaml, "safe_load", lambda *args, **kwargs: loads.append(args))

    with pytest.raises(ConfigError, match="does not match its signature") as info:
        load_resume_state(_config(tmp_path, str(checkpoint)))

    assert info.value.field == "train.resume_from"
    assert loads == [] and not marker.exists()


def test_checkpoint_signed_with_another_users_key_is_refused_until_this_user_signs_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, user_key: Path
) -> None:
    from rlsdk.cli import main

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "someone-else"))
    checkpoint = _checkpoint(tmp_path)  # written and signed by someone else
    monkeypatch.setenv("XDG_CACHE_HOME", str(user_key.parent.parent))

    with pytest.raises(ConfigError, match="signed with another key") as info:
        load_resume_state(_config(tmp_path, str(checkpoint)))
    assert "rlsdk checkpoint sign" in str(info.value)
    assert main(["checkpoint", "sign", str(checkpoint)]) == 0
    directory, state = load_resume_state(_config(tmp_path, str(checkpoint)))

    assert directory == checkpoint and state["ledger"]["trainer_version"] == 3
    assert main(["checkpoint", "verify", str(checkpoint)]) == 0


def test_unsigned_checkpoint_of_an_older_rlsdk_is_refused_naming_the_command_that_trusts_it(tmp_path: Path) -> None:
    checkpoint = _checkpoint(tmp_path)
    (checkpoint / "manifest.sig").unlink()

    with pytest.raises(ConfigError, match="not signed") as info:
        load_resume_state(_config(tmp_path, str(checkpoint)))

    assert f"rlsdk checkpoint sign {checkpoint}" in str(info.value)


def test_checkpoint_sign_refuses_a_checkpoint_whose_files_do_not_match_its_manifest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from rlsdk.cli import main

    checkpoint = _checkpoint(tmp_path)
    (checkpoint / "manifest.sig").unlink()
    (checkpoint / "trainer_state.pt").write_bytes(b"changed")

    code = main(["checkpoint", "sign", str(checkpoint)])

    assert code == 1
    assert "trainer_state.pt does not match its manifest checksum" in capsys.readouterr().err
    assert not (checkpoint / "manifest.sig").exists()


@pytest.mark.distributed
def test_session_resuming_a_checkpoint_with_a_pickle_payload_never_runs_it_signed_or_not(
    small_config: SessionConfig, tmp_path: Path
) -> None:
    from rlsdk.engine.train.checkpoint import sign_checkpoint

    marker = tmp_path / "payload-ran"
    config = dataclasses.replace(small_config, launch=dataclasses.replace(small_config.launch, num_ranks=1))

    async def save() -> Path:
        async with await Session.start(config) as session:
            rollout = await session.reward(await session.rollout(), reverse_reward)
            await session.update(rollout)
            return await session.save_checkpoint()

    checkpoint = asyncio.run(save())
    torch.save(Payload(marker), checkpoint / "rng_rank0.pt")
    _relist(checkpoint, "rng_rank0.pt")
    resumed = dataclasses.replace(config, train=dataclasses.replace(config.train, resume_from=str(checkpoint)))
    children_before = {p.pid for p in psutil.Process(os.getpid()).children(recursive=True)}

    with pytest.raises(ConfigError, match="does not match its signature"):  # refused before any process starts
        asyncio.run(Session.start(resumed))
    assert {p.pid for p in psutil.Process(os.getpid()).children(recursive=True)} <= children_before
    sign_checkpoint(checkpoint)  # the user trusts it: the ranks still refuse to unpickle it
    with pytest.raises(Exception, match=r"weights_only|Unsupported global|refused") as info:
        asyncio.run(Session.start(resumed))

    assert "rng_rank0.pt" in str(info.value)
    assert not marker.exists()
