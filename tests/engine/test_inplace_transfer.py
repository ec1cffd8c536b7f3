"""The in-place CPU weight transfer: its server arguments, the in-place path, and its fallbacks to vLLM's reload."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
from typing import Any

import pytest
import torch

from rlsdk.engine.inference import vllm_worker
from rlsdk.engine.inference.inplace_transfer import PLAIN_WORKER_EXTENSION, InPlaceWeightTransfer
from rlsdk.engine.inference.vllm_server import WORKER_EXTENSION, server_command


class FakeRpc:
    """The server's ``/collective_rpc``: ``answers[method]`` is the list of worker results (or one per call)."""

    def __init__(self, answers: dict[str, Any]) -> None:
        self.answers = answers
        self.calls: list[str] = []

    async def __call__(self, method: str, kwargs: dict[str, Any], timeout_s: float) -> list[Any]:
        self.calls.append(method)
        answer = self.answers[method]
        return answer.pop(0) if isinstance(answer, list) and answer and isinstance(answer[0], list) else answer


OK = {"checksum": "blake3:" + "a" * 64, "bytes": 8, "inplace": True}
RELOADED = {"checksum": "blake3:" + "a" * 64, "bytes": 8}


def test_inplace_transfer_server_args_replace_the_default_worker_extension_with_the_plain_weights_one() -> None:
    cmd = server_command("/m", 1234, extra_args=[*InPlaceWeightTransfer().server_args(), "--seed", "1"])

    assert cmd.count("--worker-extension-cls") == 1
    assert cmd[cmd.index("--worker-extension-cls") + 1] == PLAIN_WORKER_EXTENSION
    assert WORKER_EXTENSION not in cmd


def test_inplace_transfer_push_uses_the_inplace_rpc_when_every_worker_succeeds() -> None:
    transfer = InPlaceWeightTransfer()
    rpc = FakeRpc({"rlsdk_update_weights_inplace": [OK, OK]})

    loaded = asyncio.run(transfer.push(rpc, "/dev/shm/v1.safetensors", 1, 10.0))

    assert rpc.calls == ["rlsdk_update_weights_inplace"]
    assert loaded["checksum"] == OK["checksum"] and transfer.last_method == "inplace"


def test_inplace_transfer_on_a_packed_weights_server_logs_why_reloads_and_skips_inplace_afterwards(
    caplog: pytest.LogCaptureFixture,
) -> None:
    transfer = InPlaceWeightTransfer()
    unsupported = {"error": "in-place update unavailable: packed", "loaded": False, "unsupported": True}
    rpc = FakeRpc({"rlsdk_update_weights_inplace": [unsupported], "rlsdk_load_weights": [RELOADED]})

    with caplog.at_level(logging.WARNING, logger="rlsdk"):
        first = asyncio.run(transfer.push(rpc, "/p/v1", 1, 10.0))
        second = asyncio.run(transfer.push(rpc, "/p/v2", 2, 10.0))

    assert rpc.calls == ["rlsdk_update_weights_inplace", "rlsdk_load_weights", "rlsdk_load_weights"]
    assert first["checksum"] == second["checksum"] == RELOADED["checksum"]
    assert transfer.last_method == "reload" and "packed" in (transfer.unavailable or "")
    assert "in-place update unavailable: packed" in caplog.text


def test_inplace_transfer_failing_after_the_copy_began_reloads_every_weight_and_tries_inplace_next_time() -> None:
    transfer = InPlaceWeightTransfer()
    failed = {"error": "in-place load_weights from /p/v1: RuntimeError: boom", "loaded": True}
    rpc = FakeRpc({"rlsdk_update_weights_inplace": [[failed], [OK]], "rlsdk_load_weights": [RELOADED]})

    first = asyncio.run(transfer.push(rpc, "/p/v1", 1, 10.0))
    second = asyncio.run(transfer.push(rpc, "/p/v2", 2, 10.0))

    assert rpc.calls == ["rlsdk_update_weights_inplace", "rlsdk_load_weights", "rlsdk_update_weights_inplace"]
    assert first["fallback"] == "in-place update failed" and second.get("inplace") is True
    assert transfer.unavailable is None


def test_inplace_transfer_raises_when_workers_report_different_checksums_or_the_reload_fails() -> None:
    other = dict(OK, checksum="blake3:" + "b" * 64)
    with pytest.raises(RuntimeError, match="different weights for v3"):
        asyncio.run(InPlaceWeightTransfer().push(FakeRpc({"rlsdk_update_weights_inplace": [OK, other]}), "/p", 3, 1))
    unsupported = {"error": "unavailable", "loaded": False, "unsupported": True}
    rpc = FakeRpc({"rlsdk_update_weights_inplace": [unsupported], "rlsdk_load_weights": [{"error": "reading /p"}]})
    with pytest.raises(RuntimeError, match="reading /p"):
        asyncio.run(InPlaceWeightTransfer().push(rpc, "/p", 4, 1.0))


class _Linear(torch.nn.Module):
    def __init__(self, packed: bool) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(0 if packed else 4, 4), requires_grad=False)
        self.cpu_linear = (lambda x, w, b: x) if packed else torch.nn.functional.linear


@pytest.mark.parametrize(
    ("active", "delegated", "packed", "reason"),
    [
        (False, [], False, "keeps packed weights"),
        (True, ["Conv"], False, "left to vLLM's packing"),
        (True, [], True, "not F.linear"),
        (True, [], False, None),
    ],
)
def test_plain_weights_problem_names_why_inplace_cannot_run(
    monkeypatch: pytest.MonkeyPatch, active: bool, delegated: list[str], packed: bool, reason: str | None
) -> None:
    monkeypatch.setitem(vllm_worker._PLAIN_WEIGHTS, "active", active)
    monkeypatch.setitem(vllm_worker._PLAIN_WEIGHTS, "delegated", delegated)
    model = torch.nn.Sequential(_Linear(packed))

    problem = vllm_worker.plain_weights_problem(model)

    assert problem is None if reason is None else reason in (problem or "")


def test_rlsdk_update_weights_inplace_on_a_packed_worker_returns_unsupported_without_raising() -> None:
    class Worker(vllm_worker.WeightSyncExtension):
        class model_runner:
            @staticmethod
            def get_model() -> torch.nn.Module:
                return torch.nn.Sequential(_Linear(packed=True))

    result = Worker().rlsdk_update_weights_inplace("/nonexistent.safetensors")

    assert result["unsupported"] is True and result["loaded"] is False and "unavailable" in result["error"]


def test_importing_the_plain_worker_extension_patches_vllms_cpu_gemm_dispatch_to_keep_plain_weights() -> None:
    pytest.importorskip("vllm", reason="needs the vllm extra")
    code = """
import torch
import vllm.model_executor.layers.utils as utils
import rlsdk.engine.inference.vllm_plain_worker as plain
assert plain.PLAIN_WEIGHTS_ACTIVE
layer = torch.nn.Module()
layer.weight = torch.nn.Parameter(torch.randn(8, 4), requires_grad=False)
weight = layer.weight
utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
assert layer.weight is weight and layer.cpu_linear is torch.nn.functional.linear
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)

    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]
