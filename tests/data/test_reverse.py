"""The reverse task: tokenizer round trip, tiny policy on disk, deterministic data set and resumable sampler."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlsdk.data import PromptSampler, build_tiny_policy, build_tokenizer, reverse_digits_dataset


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_policy(tmp_path_factory.mktemp("reverse") / "model", seed=1)


def test_build_tokenizer_encode_decode_round_trips_without_spaces() -> None:
    tokenizer = build_tokenizer()

    ids = tokenizer("123>", add_special_tokens=False)["input_ids"]

    assert len(tokenizer) == 16
    assert len(ids) == 4
    assert tokenizer.decode(tokenizer("321")["input_ids"]) == "321"
    assert tokenizer.decode([*ids, tokenizer.eos_token_id], skip_special_tokens=True) == "123>"
    assert tokenizer.padding_side == "left"
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id) == (0, 1)


def test_build_tokenizer_batch_padding_pads_on_the_left() -> None:
    tokenizer = build_tokenizer()

    batch = tokenizer(["1>", "123>"], padding=True)

    assert batch["input_ids"][0][:2] == [tokenizer.pad_token_id] * 2
    assert batch["attention_mask"] == [[0, 0, 1, 1], [1, 1, 1, 1]]


def test_auto_tokenizer_after_save_pretrained_encodes_and_decodes_the_same(policy_dir: Path) -> None:
    from transformers import AutoTokenizer

    original = build_tokenizer()
    loaded = AutoTokenizer.from_pretrained(policy_dir)

    for text in ["0123456789>", "987>", "1|2>"]:
        ids = original(text, add_special_tokens=False)["input_ids"]
        assert loaded(text, add_special_tokens=False)["input_ids"] == ids
        assert loaded.decode(ids) == text
    assert loaded.decode([4, 5, 1], skip_special_tokens=True) == "01"
    assert (loaded.pad_token_id, loaded.eos_token_id, loaded.padding_side) == (0, 1, "left")


def test_build_tiny_policy_saved_model_loads_with_expected_size(policy_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(policy_dir)
    generation_config = GenerationConfig.from_pretrained(policy_dir)

    assert model.config.model_type == "qwen2"
    assert model.config.vocab_size == 16
    assert model.config.tie_word_embeddings
    assert 120_000 < sum(p.numel() for p in model.parameters()) < 140_000
    assert (generation_config.eos_token_id, generation_config.pad_token_id) == (1, 0)


def test_build_tiny_policy_existing_model_is_not_rebuilt(policy_dir: Path) -> None:
    weights = policy_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns

    returned = build_tiny_policy(policy_dir, seed=99)

    assert returned == policy_dir
    assert weights.stat().st_mtime_ns == before


def test_build_tiny_policy_same_seed_gives_identical_weights(tmp_path: Path) -> None:
    a = build_tiny_policy(tmp_path / "a", seed=5, hidden_size=16, num_heads=2, intermediate_size=32)
    b = build_tiny_policy(tmp_path / "b", seed=5, hidden_size=16, num_heads=2, intermediate_size=32)

    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()


def test_reverse_digits_dataset_same_seed_gives_same_rows() -> None:
    first = reverse_digits_dataset(50, min_digits=2, max_digits=4, seed=7)
    second = reverse_digits_dataset(50, min_digits=2, max_digits=4, seed=7)
    other = reverse_digits_dataset(50, min_digits=2, max_digits=4, seed=8)

    assert first[:] == second[:]
    assert first[:] != other[:]
    for prompt, answer in zip(first["prompt"], first["answer"]):
        assert prompt.endswith(">")
        assert 2 <= len(answer) <= 4
        assert prompt[:-1][::-1] == answer


def test_reverse_digits_dataset_bad_lengths_raise_value_error() -> None:
    with pytest.raises(ValueError, match="min_digits=4, max_digits=3"):
        reverse_digits_dataset(10, min_digits=4, max_digits=3)


def test_prompt_sampler_one_epoch_visits_every_row_once() -> None:
    dataset = reverse_digits_dataset(12, seed=0)
    sampler = PromptSampler(dataset, 4, seed=0)

    seen = [p for _ in range(3) for p in sampler.next_batch()["prompt"]]

    assert sorted(seen) == sorted(dataset["prompt"])
    assert sampler.state_dict() == {"epoch": 1, "position": 0, "seed": 0, "num_rows": 12}


def test_prompt_sampler_resumed_from_state_dict_continues_identically() -> None:
    dataset = reverse_digits_dataset(10, seed=0)
    sampler = PromptSampler(dataset, 3, seed=4)
    for _ in range(5):  # crosses an epoch boundary
        sampler.next_batch()
    state = sampler.state_dict()
    expected = [sampler.next_batch() for _ in range(6)]

    resumed = PromptSampler(dataset, 3, seed=4)
    resumed.load_state_dict(state)

    assert [resumed.next_batch() for _ in range(6)] == expected


def test_prompt_sampler_new_epoch_reshuffles() -> None:
    dataset = reverse_digits_dataset(32, seed=0)
    sampler = PromptSampler(dataset, 32, seed=0)

    assert sampler.next_batch()["prompt"] != sampler.next_batch()["prompt"]


def test_prompt_sampler_state_with_other_seed_raises_value_error() -> None:
    sampler = PromptSampler(reverse_digits_dataset(4), 2, seed=0)

    with pytest.raises(ValueError, match="seed=1"):
        sampler.load_state_dict({"epoch": 0, "position": 0, "seed": 1})


def test_pretrained_tokenizer_fast_after_save_pretrained_keeps_char_level_pipeline(policy_dir: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    loaded = PreTrainedTokenizerFast.from_pretrained(policy_dir)

    assert loaded("1 a>", add_special_tokens=False)["input_ids"] == [5, 3, 3, 14]  # unknown chars -> <unk>
    assert loaded.decode(loaded("0123456789>|")["input_ids"]) == "0123456789>|"
    assert loaded.padding_side == "left"


def test_prompt_sampler_column_cache_gives_the_same_batches_as_arrow_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    # Arrange: one sampler with the column cache (the default for 10 rows), one reading the Arrow table
    dataset = reverse_digits_dataset(10, seed=3)
    cached = PromptSampler(dataset, 4, seed=1)
    monkeypatch.setattr(PromptSampler, "CACHE_MAX_ROWS", 0)
    uncached = PromptSampler(dataset, 4, seed=1)

    # Act: 5 batches of 4 over 10 rows cross two epoch boundaries
    batches = [(cached.next_batch(), uncached.next_batch()) for _ in range(5)]

    # Assert
    assert cached._columns is not None and uncached._columns is None
    assert all(a == b for a, b in batches)
    assert cached.state_dict() == uncached.state_dict()


def test_prompt_sampler_with_nested_values_reads_from_the_table_each_batch() -> None:
    import datasets

    dataset = datasets.Dataset.from_dict({"prompt": ["a", "b"], "messages": [[{"role": "user"}], [{"role": "x"}]]})

    sampler = PromptSampler(dataset, 2, seed=0)
    first = sampler.next_batch()
    first["messages"][0][0]["role"] = "changed"

    assert sampler._columns is None
    assert all(m[0]["role"] != "changed" for m in sampler.next_batch()["messages"])
