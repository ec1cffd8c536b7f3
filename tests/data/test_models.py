"""The shared pieces of the local model builders (``rlsdk.data.models``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlsdk.data import build_tiny_policy
from rlsdk.data.models import check_policy_sizes, small_qwen2_config


@pytest.mark.parametrize(
    ("sizes", "match"),
    [
        ((0, 1, 1, 1), r"hidden_size=0 is invalid: allowed an int >= 1"),
        ((8, -1, 1, 1), r"num_layers=-1 is invalid"),
        ((8, 1, 0, 1), r"num_heads=0 is invalid"),
        ((8, 1, 2, 0), r"intermediate_size=0 is invalid"),
        ((10, 1, 4, 8), r"hidden_size=10 must be divisible by num_heads=4"),
    ],
)
def test_check_policy_sizes_bad_size_raises_naming_it(sizes: tuple[int, int, int, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check_policy_sizes(*sizes)


def test_small_qwen2_config_sets_one_kv_head_per_head_tied_embeddings_and_the_token_ids() -> None:
    config = small_qwen2_config(16, 32, 2, 4, 64, max_positions=64, eos_token_id=[1, 2], pad_token_id=0)

    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers) == (16, 32, 2)
    assert (config.num_attention_heads, config.num_key_value_heads, config.intermediate_size) == (4, 4, 64)
    assert (config.max_position_embeddings, config.tie_word_embeddings) == (64, True)
    assert (config.eos_token_id, config.pad_token_id) == ([1, 2], 0)


def test_build_tiny_policy_bad_size_raises_before_writing_anything(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="num_heads=3"):
        build_tiny_policy(tmp_path / "model", hidden_size=64, num_heads=3)

    assert not (tmp_path / "model").exists()


def test_small_qwen2_config_with_fewer_kv_heads_keeps_them_and_passes_other_fields() -> None:
    config = small_qwen2_config(16, 32, 2, 4, 64, max_positions=128, num_kv_heads=2, rope_theta=1_000_000.0)

    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert config.rope_parameters["rope_theta"] == 1_000_000.0
