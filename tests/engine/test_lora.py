"""rlsdk.engine.lora: publish an adapter, load it onto a base model, checksum what the model holds."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
import torch

from rlsdk.config import TrainConfig
from rlsdk.engine.lora import ADAPTER_WEIGHTS, adapter_checksum, apply_lora, load_adapter, publish_adapter

pytest.importorskip("peft", reason="LoRA needs peft: install the lora extra")


def _trained_lora(model_dir: Path, rank: int = 4) -> torch.nn.Module:
    """A LoRA model whose lora_B is not zero (as after training): the adapter changes the outputs."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = apply_lora(AutoModelForCausalLM.from_pretrained(model_dir), TrainConfig(lora_rank=rank, lora_alpha=8.0))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.1)
    return model


def test_published_adapter_loaded_onto_the_base_reproduces_the_trainers_outputs_and_checksum(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    trained = _trained_lora(tiny_model_dir).eval()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    input_ids = torch.tensor([[1, 5, 6, 7, 2]])

    published = publish_adapter(trained, str(tmp_path / "pub"), 3)
    served, checksum = load_adapter(base, published["path"])

    assert Path(published["path"]).name == "v3"
    assert stat.S_IMODE((Path(published["path"])).stat().st_mode) == 0o700
    assert checksum == published["checksum"] == adapter_checksum(trained)
    assert published["bytes"] == sum(p.numel() * 4 for n, p in trained.named_parameters() if "lora_" in n)
    with torch.no_grad():
        torch.testing.assert_close(served(input_ids).logits, trained(input_ids).logits, rtol=0, atol=0)


def test_publish_adapter_replaces_older_versions(tiny_model_dir: Path, tmp_path: Path) -> None:
    trained = _trained_lora(tiny_model_dir)

    publish_adapter(trained, str(tmp_path), 1)
    publish_adapter(trained, str(tmp_path), 2)

    assert sorted(p.name for p in tmp_path.iterdir()) == ["v2"]


def test_load_adapter_of_another_rank_raises_naming_the_mismatch(tiny_model_dir: Path, tmp_path: Path) -> None:
    served = _trained_lora(tiny_model_dir, rank=4)
    other = publish_adapter(_trained_lora(tiny_model_dir, rank=8), str(tmp_path), 1)

    with pytest.raises(RuntimeError, match="does not fit the served adapter"):
        load_adapter(served, other["path"])


def test_load_adapter_without_adapter_files_raises_file_not_found(tiny_model_dir: Path, tmp_path: Path) -> None:
    published = publish_adapter(_trained_lora(tiny_model_dir), str(tmp_path), 1)
    (Path(published["path"]) / ADAPTER_WEIGHTS).unlink()

    with pytest.raises(FileNotFoundError, match="no peft adapter"):
        load_adapter(_trained_lora(tiny_model_dir), published["path"])
