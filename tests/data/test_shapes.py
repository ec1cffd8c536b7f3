"""Policies of real shapes built locally: the BPE tokenizer, the model's shape and parameter count, the prompts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlsdk.data.shapes import SHAPES, PolicyShape, build_bpe_tokenizer, build_shape_policy, corpus_files, corpus_prompts

TINY = PolicyShape(64, 2, 4, 2, 128, 600, 16, 8, 2, 2)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # a few files of the corpus keep this quick; the shapes use all of it
    return build_bpe_tokenizer(tmp_path_factory.mktemp("bpe"), 600, files=corpus_files()[:20])


def test_bpe_tokenizer_has_the_vocabulary_eos_and_round_trips_text(tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    text = "def f(x):\n    return x + 1  # ünïcode\n"

    ids = tokenizer(text, add_special_tokens=False)["input_ids"]

    assert len(tokenizer) == 600 and tokenizer.convert_tokens_to_ids("<|endoftext|>") == 0
    assert tokenizer.decode(ids) == text and len(ids) < len(text.encode())


def test_bpe_tokenizer_short_of_merges_fills_the_vocabulary_with_reserved_tokens(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    build_bpe_tokenizer(tmp_path, 5000, files=corpus_files()[:1])
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)

    assert len(tokenizer) == 5000
    assert tokenizer.decode([4999], skip_special_tokens=True) == ""


def test_shape_policy_has_the_shape_and_parameter_count_and_is_reused(tokenizer_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_shape_policy(tmp_path / "policy", TINY, seed=0, tokenizer_dir=tokenizer_dir)
    model = AutoModelForCausalLM.from_pretrained(path)
    stamp = (path / "rlsdk_shape.json").stat().st_mtime_ns

    again = build_shape_policy(tmp_path / "policy", TINY, seed=0, tokenizer_dir=tokenizer_dir)

    assert sum(p.numel() for p in model.parameters()) == TINY.parameters()
    assert model.config.num_key_value_heads == 2 and model.config.tie_word_embeddings
    assert model.generation_config.eos_token_id == model.generation_config.pad_token_id == 0
    assert again == path and (path / "rlsdk_shape.json").stat().st_mtime_ns == stamp
    assert json.loads((path / "rlsdk_shape.json").read_text())["seed"] == 0
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = corpus_prompts(tokenizer, 3, TINY.prompt_tokens, seed=1)
    assert [len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts] == [16, 16, 16]


def test_ladder_parameter_counts_match_the_qwen_shapes() -> None:
    assert SHAPES["S2"].parameters() == 494_032_768  # Qwen2.5-0.5B
    assert 24e6 < SHAPES["S1"].parameters() < 27e6
    with pytest.raises(ValueError, match="shape='S9' is invalid"):
        build_shape_policy("unused", "S9")
