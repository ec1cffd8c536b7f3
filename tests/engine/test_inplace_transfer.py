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


@pytest.fixture(autouse=True)
def _weights_dir_is_tmp_path(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker extension loads only from its server's weights directory: here each test's tmp_path."""
    monkeypatch.setenv(vllm_worker.WEIGHTS_DIR_ENV, str(tmp_path))


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


class _Trainer(torch.nn.Module):
    """The trainer's side: separate q/k projections, an embedding tied to the output head."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Embedding(10, 4)
        self.q = torch.nn.Linear(4, 4, bias=False)
        self.k = torch.nn.Linear(4, 2, bias=False)
        self.proj = torch.nn.Linear(4, 3, bias=False)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight
        with torch.no_grad():
            for param in self.parameters():
                param.copy_(torch.randn(param.shape, generator=generator))


class _ServedModel(torch.nn.Module):
    """vLLM's side, as its weight loaders see it: q/k fused into one parameter (row slices), a vocabulary padded
    past the file's (a row slice), a tied head the loader skips, and one weight stored transposed (a loader that
    transforms its tensor: no plain copy). ``after_copy`` runs on each parameter slice once written."""

    def __init__(self, after_copy: Any = None) -> None:
        super().__init__()
        self.qk = torch.nn.Parameter(torch.zeros(6, 4), requires_grad=False)
        self.embed = torch.nn.Parameter(torch.zeros(12, 4), requires_grad=False)
        self.proj_t = torch.nn.Parameter(torch.zeros(4, 3), requires_grad=False)
        self.after_copy = after_copy

    def load_weights(self, weights: Any) -> set[str]:
        loaded = set()
        for name, tensor in weights:
            if name == "head.weight":
                continue  # tied to embed, as vLLM's tie_word_embeddings models skip lm_head
            if name == "proj.weight":
                self.proj_t.data.copy_(tensor.t())
                loaded.add("proj_t")
                continue
            target = {"q.weight": self.qk[:4], "k.weight": self.qk[4:], "embed.weight": self.embed[:10]}[name]
            target.copy_(tensor)
            if self.after_copy is not None:
                self.after_copy(target)
            loaded.add({"embed.weight": "embed"}.get(name, "qk"))
        return loaded


def _publish(tmp_path: Any) -> tuple[_Trainer, str]:
    from safetensors.torch import save_model

    trainer = _Trainer()
    path = str(tmp_path / "v1.safetensors")
    save_model(trainer, path)  # keeps one of the tied names, the other in the metadata
    return trainer, path


def _load_in_place(path: str, served: _ServedModel) -> tuple[str | None, vllm_worker.PublishedFile]:
    import threading

    published = vllm_worker.PublishedFile(path)
    try:
        hasher = vllm_worker.ServedWeightsHasher(published, published.state_dict())
        thread = threading.Thread(target=hasher.run)
        thread.start()
        with torch.no_grad(), vllm_worker.read_into_parameters(published, hasher.written):
            served.load_weights((name, hasher.state_dict[name]) for name in hasher.order)
        hasher.finish()
        thread.join()
        assert hasher.error is None
    finally:
        published.close()
    return hasher.checksum, published


def test_inplace_load_reads_the_file_into_parameter_slices_and_hashes_them_to_the_trainers_checksum(
    tmp_path: Any,
) -> None:
    from rlsdk.engine.weights import state_dict_checksum

    trainer, path = _publish(tmp_path)
    served = _ServedModel()

    checksum, published = _load_in_place(path, served)

    assert checksum == state_dict_checksum(trainer.state_dict())
    torch.testing.assert_close(served.qk, torch.cat([trainer.q.weight, trainer.k.weight]), rtol=0.0, atol=0.0)
    torch.testing.assert_close(served.embed[:10], trainer.embed.weight, rtol=0.0, atol=0.0)
    torch.testing.assert_close(served.proj_t, trainer.proj.weight.t(), rtol=0.0, atol=0.0)
    assert served.embed[10:].abs().sum() == 0  # the padding rows are left alone
    # Every plain copy went straight from the file; the transposed one read through the mapping.
    assert published.direct_bytes == published.nbytes - trainer.proj.weight.numel() * 4


def test_inplace_checksum_covers_the_served_bytes_so_a_parameter_changed_after_its_write_does_not_verify(
    tmp_path: Any,
) -> None:
    from rlsdk.engine.weights import state_dict_checksum

    trainer, path = _publish(tmp_path)
    served = _ServedModel(after_copy=lambda target: target.mul_(2.0))

    checksum, _ = _load_in_place(path, served)

    assert checksum != state_dict_checksum(trainer.state_dict())


def _plain_worker(monkeypatch: pytest.MonkeyPatch, served: _ServedModel) -> Any:
    import contextlib
    import types

    monkeypatch.setitem(vllm_worker._PLAIN_WEIGHTS, "active", True)
    monkeypatch.setitem(vllm_worker._PLAIN_WEIGHTS, "delegated", [])
    # vLLM's config context, without importing vLLM (its import changes process-wide state).
    fake_vllm = types.ModuleType("vllm")
    fake_config = types.ModuleType("vllm.config")
    fake_config.set_current_vllm_config = lambda config: contextlib.nullcontext()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm)
    monkeypatch.setitem(sys.modules, "vllm.config", fake_config)

    class Worker(vllm_worker.WeightSyncExtension):
        vllm_config = None

        class model_runner:
            @staticmethod
            def get_model() -> torch.nn.Module:
                return served

    return Worker()


def test_rlsdk_update_weights_inplace_returns_the_trainers_checksum_and_records_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    from rlsdk.engine.weights import state_dict_checksum

    trainer, path = _publish(tmp_path)
    worker = _plain_worker(monkeypatch, _ServedModel())

    result = worker.rlsdk_update_weights_inplace(path)

    assert "error" not in result, result
    assert result["checksum"] == state_dict_checksum(trainer.state_dict()) == worker.rlsdk_weight_info()["checksum"]
    assert result["inplace"] is True and 0 < result["direct_bytes"] < result["bytes"]


def test_rlsdk_update_weights_inplace_failing_midway_reports_loaded_and_clears_the_recorded_checksum(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    _, path = _publish(tmp_path)

    def fail(target: torch.Tensor) -> None:
        raise RuntimeError("loader broke")

    worker = _plain_worker(monkeypatch, _ServedModel(after_copy=fail))
    worker._rlsdk_checksum = "blake3:" + "c" * 64

    result = worker.rlsdk_update_weights_inplace(path)

    assert result["loaded"] is True and "loader broke" in result["error"] and path in result["error"]
    assert worker.rlsdk_weight_info()["checksum"] is None


def test_published_file_with_a_header_past_its_end_raises_value_error_naming_the_file(tmp_path: Any) -> None:
    import struct

    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", 1 << 20) + b"{}")

    with pytest.raises(ValueError, match=r"bad\.safetensors"):
        vllm_worker.PublishedFile(str(path))


def test_rlsdk_update_weights_inplace_reuses_its_mapping_after_an_in_place_publish_and_checksums_the_new_weights(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    from safetensors.torch import save_model

    from rlsdk.engine.train.engine import publish_safetensors
    from rlsdk.engine.weights import state_dict_checksum

    trainer = _Trainer()
    served = _ServedModel()
    worker = _plain_worker(monkeypatch, served)
    first = worker.rlsdk_update_weights_inplace(
        publish_safetensors(trainer.state_dict(), str(tmp_path), 1, lambda tmp: save_model(trainer, tmp))
    )
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(0.5)

    path = publish_safetensors(trainer.state_dict(), str(tmp_path), 2, lambda tmp: save_model(trainer, tmp))
    second = worker.rlsdk_update_weights_inplace(path)

    assert first["mapping_reused"] is False and second["mapping_reused"] is True, (first, second)
    assert second["checksum"] == state_dict_checksum(trainer.state_dict()) != first["checksum"]
    torch.testing.assert_close(served.qk, torch.cat([trainer.q.weight, trainer.k.weight]), rtol=0.0, atol=0.0)
    worker._rlsdk_forget_mapped_file()
