"""rlsdk.engine.lora: publish an adapter, load it onto a base model, checksum what the model holds."""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

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


def _best_probability_reached(head: torch.nn.Module, norm: torch.nn.Module) -> float:
    """The highest probability gradient ascent on the final norm's input gets for any token (what the rest of the
    model could feed the frozen norm and head): Adam on one input per token, maximising that token's log-prob."""
    vocab, hidden = head.weight.shape
    x = torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
    optimizer = torch.optim.Adam([x], lr=0.1)
    for _ in range(100):
        optimizer.zero_grad()
        loss = -torch.log_softmax(head(norm(x)), dim=-1).diagonal().sum()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        return float(torch.softmax(head(norm(x)), dim=-1).diagonal().max())


def _qwen_head_and_norm(model: Any) -> tuple[torch.nn.Module, torch.nn.Module]:
    return model.get_output_embeddings(), model.base_model.model.model.norm


def test_check_lora_capacity_on_a_random_init_model_warns_naming_the_probability_bound_and_the_fix(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from transformers import AutoModelForCausalLM

    from rlsdk.engine.lora import check_lora_capacity, head_probability_bound

    model = apply_lora(AutoModelForCausalLM.from_pretrained(tiny_model_dir), TrainConfig(lora_rank=16))

    with caplog.at_level("WARNING", logger="rlsdk"):
        warnings = check_lora_capacity(model)

    bound = head_probability_bound(model)
    assert bound is not None and bound < 0.9
    assert len(warnings) == 1 and f"above {bound:.2f}" in warnings[0]
    assert "train.lora_target_modules" in warnings[0] and "train.lora_rank=0" in warnings[0]
    assert [r.getMessage() for r in caplog.records if r.name == "rlsdk.engine.lora"] == warnings
    reached = _best_probability_reached(*_qwen_head_and_norm(model))
    assert 0.7 * bound < reached <= bound + 1e-6  # a bound, and a tight one


def test_check_lora_capacity_on_a_model_with_a_well_scaled_head_stays_silent(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    from rlsdk.engine.lora import check_lora_capacity, head_probability_bound

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        base.get_output_embeddings().weight.mul_(20.0)  # row norms of a trained head (tied: the embeddings too)
    model = apply_lora(base, TrainConfig(lora_rank=16))

    warnings = check_lora_capacity(model)

    bound = head_probability_bound(model)
    assert warnings == [] and bound is not None and bound > 0.99
    assert _best_probability_reached(*_qwen_head_and_norm(model)) <= bound + 1e-6


def test_check_lora_capacity_with_an_adapter_on_the_output_head_stays_silent(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    from rlsdk.engine.lora import check_lora_capacity, head_probability_bound

    targets = ("q_proj", "v_proj", "lm_head")
    model = apply_lora(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), TrainConfig(lora_rank=4, lora_target_modules=targets)
    )

    assert head_probability_bound(model) is None  # the adapter moves the head: no bound
    assert check_lora_capacity(model) == []


def test_head_probability_bound_through_a_layer_norm_with_bias_holds_against_gradient_ascent() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    from rlsdk.engine.lora import head_probability_bound

    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(vocab_size=32, n_embd=16, n_layer=1, n_head=2, n_positions=16, bos_token_id=0, eos_token_id=0)
    )
    with torch.no_grad():
        model.transformer.ln_f.bias.normal_(std=0.5)  # a bias adds a fixed logit per token
    model.requires_grad_(False)

    bound = head_probability_bound(model)

    reached = _best_probability_reached(model.lm_head, model.transformer.ln_f)
    assert bound is not None and 0.7 * bound < reached <= bound + 1e-6
