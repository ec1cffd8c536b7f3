"""EmbeddedEngine: logprobs equal the trainer's, seeded reproducibility, EOS handling, versioned weight loads."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch

from rlsdk.algorithms import completion_logprobs
from rlsdk.data import build_tiny_policy, build_tokenizer
from rlsdk.engine.inference.embedded import EmbeddedEngine, single_thread_caller
from rlsdk.engine.inference.protocol import GenerateResult, InferenceEngine, SamplingParams
from rlsdk.engine.inference.sampling import left_pad
from rlsdk.engine.weights import state_dict_checksum

PROMPTS = ["123>", "4>", "98765>", "000>", "31>", "7777>", "5>"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_policy(tmp_path_factory.mktemp("engine") / "model", seed=0)


@pytest.fixture(scope="module")
def prompt_ids() -> list[list[int]]:
    tokenizer = build_tokenizer()
    return [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]


def _generate(engine: EmbeddedEngine, prompt_ids: list[list[int]], params: SamplingParams) -> GenerateResult:
    async def go() -> GenerateResult:
        try:
            return await engine.generate(prompt_ids, params)
        finally:
            await engine.close()

    return asyncio.run(go())


def _assert_well_formed(result: GenerateResult, pad_token_id: int, eos_token_id: int, version: int) -> None:
    mask_B_C = result.completion_mask_B_C
    # The mask is a prefix per row; it ends at the first EOS or at the last column.
    lengths_B = mask_B_C.sum(dim=1)
    positions_C = torch.arange(mask_B_C.shape[1])
    torch.testing.assert_close(mask_B_C, positions_C.unsqueeze(0) < lengths_B.unsqueeze(1), rtol=0, atol=0)
    for row in range(mask_B_C.shape[0]):
        tokens = result.completion_ids_B_C[row, : int(lengths_B[row])].tolist()
        assert eos_token_id not in tokens[:-1]
        assert (result.completion_ids_B_C[row, int(lengths_B[row]) :] == pad_token_id).all()
    assert (result.logprobs_B_C[~mask_B_C] == 0).all()
    assert (result.logprobs_B_C[mask_B_C] <= 0).all()
    expected_versions = torch.where(mask_B_C, torch.tensor(version), torch.tensor(-1))
    torch.testing.assert_close(result.versions_B_C, expected_versions, rtol=0, atol=0)
    assert result.completion_ids_B_C.dtype == torch.long
    assert result.logprobs_B_C.dtype == torch.float32


def test_embedded_engine_is_an_inference_engine(model_dir: Path) -> None:
    engine = EmbeddedEngine.from_pretrained(model_dir)

    assert isinstance(engine, InferenceEngine)
    assert (engine.pad_token_id, engine.eos_token_id, engine.version) == (0, 1, 0)
    asyncio.run(engine.close())


@pytest.mark.parametrize("max_batch_size", [1024, 3])
def test_generate_logprobs_equal_completion_logprobs_on_same_weights(
    model_dir: Path, prompt_ids: list[list[int]], max_batch_size: int
) -> None:
    engine = EmbeddedEngine.from_pretrained(model_dir, max_batch_size=max_batch_size)
    params = SamplingParams(max_new_tokens=6, temperature=0.8, top_k=8, top_p=0.95, seed=0)
    prompts = prompt_ids + prompt_ids[::2] + prompt_ids[:1]  # repeats: the sampler prefills each prompt once

    result = _generate(engine, prompts, params)

    _assert_well_formed(result, engine.pad_token_id, engine.eos_token_id, version=0)
    prompt_ids_B_P, prompt_mask_B_P = left_pad(prompts, engine.pad_token_id)
    with torch.no_grad():
        logprobs_B_C, _ = completion_logprobs(
            engine.model,
            prompt_ids_B_P,
            prompt_mask_B_P,
            result.completion_ids_B_C,
            result.completion_mask_B_C,
            temperature=0.8,
        )
    mask_B_C = result.completion_mask_B_C
    torch.testing.assert_close(result.logprobs_B_C[mask_B_C], logprobs_B_C[mask_B_C], rtol=0, atol=1e-5)


def test_generate_same_seed_reproduces_and_other_seed_differs(model_dir: Path, prompt_ids: list[list[int]]) -> None:
    engine = EmbeddedEngine.from_pretrained(model_dir)
    many = prompt_ids * 4

    async def go() -> tuple[GenerateResult, GenerateResult, GenerateResult]:
        try:
            first = await engine.generate(many, SamplingParams(max_new_tokens=6, seed=11))
            second = await engine.generate(many, SamplingParams(max_new_tokens=6, seed=11))
            other = await engine.generate(many, SamplingParams(max_new_tokens=6, seed=12))
            return first, second, other
        finally:
            await engine.close()

    first, second, other = asyncio.run(go())

    torch.testing.assert_close(first.completion_ids_B_C, second.completion_ids_B_C, rtol=0, atol=0)
    torch.testing.assert_close(first.logprobs_B_C, second.logprobs_B_C, rtol=0, atol=0)
    assert not torch.equal(first.completion_ids_B_C, other.completion_ids_B_C)


def test_generate_eos_stops_rows_and_masks_after_it(model_dir: Path, prompt_ids: list[list[int]]) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    # Greedy decoding with an EOS id that never appears gives each row's full continuation ...
    free = _generate(EmbeddedEngine(model, pad_token_id=0, eos_token_id=99), prompt_ids, greedy)
    assert free.completion_mask_B_C.all()
    # ... then declaring the token at row 0, step 1 to be EOS must cut every row at its first occurrence.
    eos = int(free.completion_ids_B_C[0, 1])

    result = _generate(EmbeddedEngine(model, pad_token_id=0, eos_token_id=eos), prompt_ids, greedy)

    _assert_well_formed(result, pad_token_id=0, eos_token_id=eos, version=0)
    for row in range(len(prompt_ids)):
        full = free.completion_ids_B_C[row].tolist()
        expected_length = full.index(eos) + 1 if eos in full else 8
        assert int(result.completion_mask_B_C[row].sum()) == expected_length
        assert result.completion_ids_B_C[row, :expected_length].tolist() == full[:expected_length]
    assert int(result.completion_mask_B_C[0].sum()) <= 2


def test_generate_all_rows_finished_stops_batch_before_max_new_tokens(
    model_dir: Path, prompt_ids: list[list[int]]
) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    free = _generate(EmbeddedEngine(model, pad_token_id=0, eos_token_id=99), prompt_ids[:1], greedy)
    eos = int(free.completion_ids_B_C[0, 1])

    result = _generate(EmbeddedEngine(model, pad_token_id=0, eos_token_id=eos), prompt_ids[:1], greedy)

    assert result.completion_ids_B_C.shape[1] <= 2
    assert int(result.completion_ids_B_C[0, -1]) == eos
    assert result.completion_mask_B_C.all()


def test_load_weights_bumps_version_and_checksum_matches_saved_model(
    model_dir: Path, prompt_ids: list[list[int]], tmp_path: Path
) -> None:
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM

    other_dir = build_tiny_policy(tmp_path / "other", seed=123)
    new_model = AutoModelForCausalLM.from_pretrained(other_dir)
    weights_path = tmp_path / "v1.safetensors"
    save_model(new_model, str(weights_path))
    expected_checksum = state_dict_checksum(new_model.state_dict())
    engine = EmbeddedEngine.from_pretrained(model_dir)

    async def go() -> tuple[object, object, object, GenerateResult]:
        try:
            before = await engine.weight_info()
            loaded = await engine.load_weights(str(weights_path), version=1)
            after = await engine.weight_info()
            result = await engine.generate(prompt_ids, SamplingParams(max_new_tokens=4, seed=0))
            return before, loaded, after, result
        finally:
            await engine.close()

    before, loaded, after, result = asyncio.run(go())

    assert before.version == 0 and before.checksum != expected_checksum
    assert (loaded.version, loaded.checksum) == (1, expected_checksum)
    assert after == loaded
    assert engine.version == 1
    _assert_well_formed(result, engine.pad_token_id, engine.eos_token_id, version=1)


def test_bfloat16_engine_loads_float32_weights_and_reports_the_published_bytes_checksum(
    model_dir: Path, prompt_ids: list[list[int]], tmp_path: Path
) -> None:
    # inference.dtype='bfloat16' beside a float32 trainer: the served weights are the published ones, rounded
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM

    trained = AutoModelForCausalLM.from_pretrained(build_tiny_policy(tmp_path / "other", seed=123))
    weights_path = tmp_path / "v1.safetensors"
    save_model(trained, str(weights_path))
    engine = EmbeddedEngine.from_pretrained(model_dir, dtype="bfloat16")

    async def go() -> tuple[object, GenerateResult]:
        try:
            loaded = await engine.load_weights(str(weights_path), version=1)
            return loaded, await engine.generate(prompt_ids, SamplingParams(max_new_tokens=4, seed=0))
        finally:
            await engine.close()

    loaded, result = asyncio.run(go())

    assert loaded.checksum == state_dict_checksum(trained.state_dict())
    served = engine.model.state_dict()
    assert all(tensor.dtype == torch.bfloat16 for tensor in served.values() if tensor.is_floating_point())
    for name, tensor in trained.state_dict().items():
        torch.testing.assert_close(served[name], tensor.bfloat16(), rtol=0, atol=0, msg=name)
    _assert_well_formed(result, engine.pad_token_id, engine.eos_token_id, version=1)


def test_load_weights_missing_file_raises_file_not_found(model_dir: Path, tmp_path: Path) -> None:
    engine = EmbeddedEngine.from_pretrained(model_dir)

    async def go() -> None:
        try:
            await engine.load_weights(str(tmp_path / "absent.safetensors"), version=1)
        finally:
            await engine.close()

    with pytest.raises(FileNotFoundError, match=r"absent\.safetensors"):
        asyncio.run(go())
    assert engine.version == 0


def test_load_weights_during_generate_is_applied_between_decode_steps_and_tags_later_tokens(
    model_dir: Path, tmp_path: Path
) -> None:
    import threading

    from safetensors.torch import save_model

    engine = EmbeddedEngine.from_pretrained(model_dir)
    weights_path = tmp_path / "v5.safetensors"
    save_model(engine.model, str(weights_path))
    prompts = [[4, 5, 6, 14]] * 64
    at_column_3 = threading.Event()
    original = engine._apply_pending_load
    columns: list[int] = []

    def apply_at_column_3() -> bool:  # the generation reaches column 3, then waits for the load request
        columns.append(len(columns))
        if len(columns) == 4:  # calls: chunk start, then before columns 1, 2, 3
            at_column_3.set()
            deadline = time.monotonic() + 30
            while engine._pending_load is None and time.monotonic() < deadline:
                time.sleep(0.001)
        return original()

    engine._apply_pending_load = apply_at_column_3  # type: ignore[method-assign]
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=0)

    async def go() -> tuple[GenerateResult, int]:
        try:
            generation = asyncio.create_task(engine.generate(prompts, params))
            await asyncio.to_thread(at_column_3.wait, 30)
            loaded = await engine.load_weights(str(weights_path), version=5)
            return await generation, loaded.version
        finally:
            await engine.close()

    result, version = asyncio.run(go())

    assert version == 5
    mask = result.completion_mask_B_C
    versions = result.versions_B_C
    assert versions.shape[1] >= 4, "the batch ended before column 3; lower the eos chance or raise max_new_tokens"
    assert bool((versions[:, :3][mask[:, :3]] == 0).all())
    assert bool((versions[:, 3:][mask[:, 3:]] == 5).all())
    assert bool((versions[~mask] == -1).all())


def test_load_weights_with_no_generation_running_loads_at_once(model_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import save_model

    engine = EmbeddedEngine.from_pretrained(model_dir)
    weights_path = tmp_path / "v2.safetensors"
    save_model(engine.model, str(weights_path))

    async def go() -> tuple[int, GenerateResult]:
        try:
            info = await engine.load_weights(str(weights_path), version=2)
            return info.version, await engine.generate([[4, 5, 14]] * 4, SamplingParams(max_new_tokens=3, seed=0))
        finally:
            await engine.close()

    version, result = asyncio.run(go())

    assert version == 2
    _assert_well_formed(result, engine.pad_token_id, engine.eos_token_id, version=2)


def test_close_is_idempotent_and_later_calls_raise(model_dir: Path, prompt_ids: list[list[int]]) -> None:
    engine = EmbeddedEngine.from_pretrained(model_dir)

    async def go() -> None:
        await engine.close()
        await engine.close()
        await engine.generate(prompt_ids, SamplingParams(max_new_tokens=2))

    with pytest.raises(RuntimeError, match="closed"):
        asyncio.run(go())


@pytest.mark.parametrize(
    ("params", "match"),
    [
        (SamplingParams(max_new_tokens=0), "max_new_tokens=0"),
        (SamplingParams(max_new_tokens=2, top_p=0.0), "top_p=0.0"),
        (SamplingParams(max_new_tokens=2, temperature=-1.0), "temperature=-1.0"),
    ],
)
def test_generate_invalid_params_raise_value_error(
    model_dir: Path, prompt_ids: list[list[int]], params: SamplingParams, match: str
) -> None:
    engine = EmbeddedEngine.from_pretrained(model_dir)

    with pytest.raises(ValueError, match=match):
        _generate(engine, prompt_ids, params)


def test_unknown_decode_step_is_refused_at_construction_naming_the_value(model_dir: Path) -> None:
    with pytest.raises(ValueError, match="decode_step='jit' is invalid: allowed 'eager' or 'compile'"):
        EmbeddedEngine.from_pretrained(model_dir, decode_step="jit")  # type: ignore[arg-type]


def test_generate_empty_prompt_raises_value_error_naming_index(model_dir: Path) -> None:
    engine = EmbeddedEngine.from_pretrained(model_dir)

    with pytest.raises(ValueError, match=r"prompt_ids\[1\] is empty"):
        _generate(engine, [[4, 14], []], SamplingParams(max_new_tokens=2))


def test_single_thread_caller_lowers_only_the_calling_thread_and_restores_it() -> None:
    # Arrange
    import threading

    before = torch.get_num_threads()
    seen: list[int] = []

    # Act
    restore = single_thread_caller()
    inside = torch.get_num_threads()
    other = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    other.start()
    other.join()
    restore()

    # Assert: the count is the thread's own; torch starts a new thread with the count set last (here 1)
    assert inside == 1 and seen == [1]
    assert torch.get_num_threads() == before


def test_engine_worker_thread_keeps_its_thread_count_while_the_caller_runs_single_threaded(model_dir: Path) -> None:
    restore = single_thread_caller()
    try:
        engine = EmbeddedEngine.from_pretrained(model_dir, num_threads=2)

        async def go() -> int:
            try:
                return await engine._run(torch.get_num_threads)
            finally:
                await engine.close()

        worker_threads = asyncio.run(go())
        caller_threads = torch.get_num_threads()
    finally:
        restore()

    assert (engine.num_threads, worker_threads, caller_threads) == (2, 2, 1)
