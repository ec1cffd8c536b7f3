"""ColocatedEngine (controller side): prompts split over the ranks, results joined in order, version checks.

The ranks are stand-ins here: each "rank" samples its share with ``sample_completions`` on the same tiny model
(what ``TrainEngine.generate`` runs). tests/session/test_session_colocated.py drives real gloo ranks.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from rlsdk.data import build_tiny_policy, build_tokenizer
from rlsdk.engine.inference.colocated import ColocatedEngine, pack_prompts, unpack_prompts
from rlsdk.engine.inference.protocol import GenerateResult, InferenceEngine, SamplingParams
from rlsdk.engine.inference.sampling import sample_completions
from rlsdk.versioning import WeightMismatchError

PROMPTS = ["123>", "4>", "98765>", "000>", "31>", "7777>", "5>"]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    path: Path = build_tiny_policy(tmp_path_factory.mktemp("colocated") / "model", seed=0)
    return AutoModelForCausalLM.from_pretrained(path).eval()


@pytest.fixture(scope="module")
def prompt_ids() -> list[list[int]]:
    tokenizer = build_tokenizer()
    return [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]


class FakeRanks:
    """``num_ranks`` stand-in ranks: ``generate`` samples the share with ``sample_completions``; ``weight_info``
    answers from ``infos``. Records every command and body."""

    def __init__(self, model: torch.nn.Module, num_ranks: int, *, version: int = 3) -> None:
        self.model = model
        self.num_ranks = num_ranks
        self.versions = [version] * num_ranks
        self.infos = [{"version": version, "checksum": "xxh3:" + "a" * 32} for _ in range(num_ranks)]
        self.calls: list[tuple[str, Any]] = []

    async def broadcast(self, command: str, body: Any) -> list[Any]:
        self.calls.append((command, body))
        if command == "weight_info":
            return [dict(info) for info in self.infos]
        assert command == "generate" and isinstance(body, list) and len(body) == self.num_ranks
        return [self._generate(rank, b) for rank, b in enumerate(body)]

    def _generate(self, rank: int, body: dict[str, Any]) -> dict[str, Any]:
        prompts = unpack_prompts(body)
        if not prompts:
            empty = torch.zeros((0, 0), dtype=torch.long)
            return {"completion_ids": empty, "completion_mask": empty.bool(), "logprobs": empty.float(),
                    "version": self.versions[rank]}  # fmt: skip
        generator = torch.Generator().manual_seed(body["seed"] if body["seed"] is not None else rank)
        ids, mask, logprobs = sample_completions(
            self.model,
            prompts,
            SamplingParams(**body["params"]),
            pad_token_id=body["pad_token_id"],
            eos_token_id=body["eos_token_id"],
            generator=generator,
        )
        return {"completion_ids": ids, "completion_mask": mask, "logprobs": logprobs, "version": self.versions[rank]}


def _engine(ranks: FakeRanks, **kwargs: Any) -> ColocatedEngine:
    tokenizer = build_tokenizer()
    return ColocatedEngine(
        ranks.broadcast,
        ranks.num_ranks,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **kwargs,
    )


def test_generate_with_three_ranks_splits_prompts_in_order_and_joins_the_shares(
    model: torch.nn.Module, prompt_ids: list[list[int]]
) -> None:
    # Arrange
    ranks = FakeRanks(model, 3, version=3)
    engine = _engine(ranks, max_batch_size=2)
    params = SamplingParams(max_new_tokens=6, seed=11)

    # Act
    result = asyncio.run(engine.generate(prompt_ids, params))

    # Assert: contiguous near-equal shares 2/2/3 in prompt order, each rank's share answered by its own rows
    command, bodies = ranks.calls[0]
    assert command == "generate"
    assert [unpack_prompts(b) for b in bodies] == [prompt_ids[0:2], prompt_ids[2:4], prompt_ids[4:7]]
    assert all(b["max_batch_size"] == 2 and "seed" not in b["params"] for b in bodies)
    assert len({b["seed"] for b in bodies}) == 3  # one stream per rank
    assert isinstance(engine, InferenceEngine)
    assert isinstance(result, GenerateResult)
    assert result.completion_ids_B_C.shape[0] == len(prompt_ids)
    for rank, body in enumerate(bodies):
        alone = ranks._generate(rank, body)
        rows = slice(sum(len(unpack_prompts(b)) for b in bodies[:rank]), None)
        width = alone["completion_ids"].shape[1]
        share_ids = result.completion_ids_B_C[rows][: len(unpack_prompts(body))]
        torch.testing.assert_close(share_ids[:, :width], alone["completion_ids"], rtol=0, atol=0)
        assert (share_ids[:, width:] == build_tokenizer().pad_token_id).all()
    mask_B_C = result.completion_mask_B_C
    torch.testing.assert_close(result.versions_B_C, torch.where(mask_B_C, 3, -1), rtol=0, atol=0)
    assert (result.logprobs_B_C[~mask_B_C] == 0).all() and (result.logprobs_B_C[mask_B_C] <= 0).all()
    assert engine.version == 3


def test_generate_with_the_same_seed_repeats_and_another_seed_differs(
    model: torch.nn.Module, prompt_ids: list[list[int]]
) -> None:
    engine = _engine(FakeRanks(model, 2))
    repeated = [ids for ids in prompt_ids for _ in range(8)]

    first = asyncio.run(engine.generate(repeated, SamplingParams(max_new_tokens=5, seed=1)))
    again = asyncio.run(engine.generate(repeated, SamplingParams(max_new_tokens=5, seed=1)))
    other = asyncio.run(engine.generate(repeated, SamplingParams(max_new_tokens=5, seed=2)))

    torch.testing.assert_close(first.completion_ids_B_C, again.completion_ids_B_C, rtol=0, atol=0)
    torch.testing.assert_close(first.logprobs_B_C, again.logprobs_B_C, rtol=0, atol=0)
    assert not torch.equal(first.completion_ids_B_C, other.completion_ids_B_C)


def test_generate_with_fewer_prompts_than_ranks_leaves_ranks_idle_and_returns_every_prompt(
    model: torch.nn.Module, prompt_ids: list[list[int]]
) -> None:
    ranks = FakeRanks(model, 4)
    engine = _engine(ranks)

    result = asyncio.run(engine.generate(prompt_ids[:2], SamplingParams(max_new_tokens=4, seed=0)))

    assert [len(unpack_prompts(b)) for b in ranks.calls[0][1]] == [0, 1, 0, 1]
    assert result.completion_ids_B_C.shape[0] == 2 and result.completion_mask_B_C[:, 0].all()


@pytest.mark.parametrize(
    ("prompts", "params", "match"),
    [
        ([], SamplingParams(max_new_tokens=4), "at least one prompt"),
        ([[5, 6], []], SamplingParams(max_new_tokens=4), "prompt 1 is empty"),
        ([[5, 6]], SamplingParams(max_new_tokens=0), "max_new_tokens"),
        ([[5, 6]], SamplingParams(max_new_tokens=4, temperature=-1.0), "temperature"),
    ],
)
def test_generate_with_bad_input_raises_before_any_rank_command(
    model: torch.nn.Module, prompts: list[list[int]], params: SamplingParams, match: str
) -> None:
    ranks = FakeRanks(model, 2)

    with pytest.raises(ValueError, match=match):
        asyncio.run(_engine(ranks).generate(prompts, params))

    assert ranks.calls == []


def test_generate_when_ranks_report_different_versions_raises(
    model: torch.nn.Module, prompt_ids: list[list[int]]
) -> None:
    ranks = FakeRanks(model, 2)
    ranks.versions = [3, 4]

    with pytest.raises(RuntimeError, match=r"different weight versions: \[3, 4\]"):
        asyncio.run(_engine(ranks).generate(prompt_ids, SamplingParams(max_new_tokens=3)))


def test_load_weights_when_every_rank_agrees_serves_the_version_with_rank0_checksum(model: torch.nn.Module) -> None:
    ranks = FakeRanks(model, 3, version=5)
    engine = _engine(ranks)

    info = asyncio.run(engine.load_weights("", 5))

    assert (info.version, info.checksum) == (5, ranks.infos[0]["checksum"])
    assert asyncio.run(engine.weight_info()) == info
    assert [c[0] for c in ranks.calls] == ["weight_info"]  # nothing exported, nothing loaded


def test_verify_with_the_ranks_update_results_serves_the_version_without_a_rank_command(
    model: torch.nn.Module,
) -> None:
    ranks = FakeRanks(model, 2, version=5)
    engine = _engine(ranks)

    info = engine.verify(5, ranks.infos)

    assert (info.version, info.checksum, engine.version) == (5, ranks.infos[0]["checksum"], 5)
    assert ranks.calls == []
    with pytest.raises(WeightMismatchError, match=r"other versions \{0: 5, 1: 5\}"):
        engine.verify(6, ranks.infos)


@pytest.mark.parametrize(
    "prompts",
    [[[5, 6, 7], [5, 6, 7], [8], [5, 6, 7], [9, 9]], [], [[4]]],
    ids=["grouped", "empty-share", "one"],
)
def test_pack_prompts_sends_distinct_prompts_once_and_unpacks_every_row(prompts: list[list[int]]) -> None:
    packed = pack_prompts(prompts)

    assert unpack_prompts(packed) == prompts
    assert all(t.dtype == torch.long for t in packed.values())
    assert packed["prompt_tokens"].numel() == sum(len(p) for p in {tuple(p): 0 for p in prompts})


def test_load_weights_when_a_replica_differs_raises_naming_the_rank(model: torch.nn.Module) -> None:
    ranks = FakeRanks(model, 3, version=5)
    ranks.infos[2]["checksum"] = "xxh3:" + "b" * 32
    engine = _engine(ranks)

    with pytest.raises(WeightMismatchError, match=r"differ from rank 0's .*\{2: 'xxh3:bbbbbbb'\}"):
        asyncio.run(engine.load_weights("", 5))
    assert engine.version == 0  # nothing recorded


def test_load_weights_when_a_rank_serves_another_version_raises_naming_it(model: torch.nn.Module) -> None:
    ranks = FakeRanks(model, 2, version=5)
    ranks.infos[1]["version"] = 4

    with pytest.raises(WeightMismatchError, match=r"other versions \{1: 4\}"):
        asyncio.run(_engine(ranks).load_weights("", 5))


def test_calls_after_close_raise(model: torch.nn.Module, prompt_ids: list[list[int]]) -> None:
    engine = _engine(FakeRanks(model, 2))
    asyncio.run(engine.close())
    asyncio.run(engine.close())  # idempotent

    with pytest.raises(RuntimeError, match="closed"):
        asyncio.run(engine.generate(prompt_ids, SamplingParams(max_new_tokens=3)))


@pytest.mark.parametrize(("field", "value"), [("num_ranks", 0), ("max_batch_size", 0)])
def test_constructor_with_bad_sizes_raises_naming_the_argument(field: str, value: int) -> None:
    kwargs: dict[str, Any] = {"num_ranks": 2, "max_batch_size": 8, field: value}

    async def broadcast(command: str, body: Any) -> list[Any]:
        raise AssertionError("never called")

    with pytest.raises(ValueError, match=f"{field}=0 is invalid"):
        ColocatedEngine(broadcast, kwargs["num_ranks"], pad_token_id=0, eos_token_id=1,
                        max_batch_size=kwargs["max_batch_size"])  # fmt: skip


def test_generate_after_hold_of_the_same_request_returns_the_held_result_without_a_rank_command(
    model: torch.nn.Module, prompt_ids: list[list[int]]
) -> None:
    # Arrange: the look-ahead bodies run on the ranks (as update's then_generate would), results held
    ranks = FakeRanks(model, 2, version=4)
    engine = _engine(ranks)
    params = SamplingParams(max_new_tokens=5, seed=9)
    bodies = engine.lookahead_bodies(prompt_ids, params)
    engine.hold([ranks._generate(rank, body) for rank, body in enumerate(bodies)])

    # Act
    held = asyncio.run(engine.generate(prompt_ids, params))
    fresh = asyncio.run(engine.generate(prompt_ids, params))  # the held result is used once

    # Assert: the same samples as a plain generate, the first without any command
    assert [command for command, _ in ranks.calls] == ["generate"]
    assert engine.lookahead_hits == 1
    for name in ("completion_ids_B_C", "completion_mask_B_C", "logprobs_B_C", "versions_B_C"):
        torch.testing.assert_close(getattr(held, name), getattr(fresh, name), rtol=0, atol=0)
    assert engine.version == 4


@pytest.mark.parametrize("change", ["prompts", "seed", "params", "discarded", "failed"])
def test_generate_after_hold_of_another_request_or_a_discard_sends_a_rank_command(
    model: torch.nn.Module, prompt_ids: list[list[int]], change: str
) -> None:
    # Arrange
    ranks = FakeRanks(model, 2)
    engine = _engine(ranks)
    params = SamplingParams(max_new_tokens=5, seed=9)
    bodies = engine.lookahead_bodies(prompt_ids, params)
    results = [ranks._generate(rank, body) for rank, body in enumerate(bodies)]
    engine.hold(None if change == "failed" else results)
    if change == "discarded":
        engine.discard_lookahead()
    asked_prompts = prompt_ids[1:] if change == "prompts" else prompt_ids
    asked = {
        "seed": SamplingParams(max_new_tokens=5, seed=10),
        "params": SamplingParams(max_new_tokens=4, seed=9),
    }.get(change, params)

    # Act
    asyncio.run(engine.generate(asked_prompts, asked))

    # Assert
    assert [command for command, _ in ranks.calls] == ["generate"]
    assert engine.lookahead_hits == 0


def test_generate_of_another_request_between_hold_and_rollout_keeps_the_held_result_for_the_rollout(
    model: torch.nn.Module, prompt_ids: list[list[int]]
) -> None:
    # Arrange: the next rollout's batch held; then a greedy evaluation of other prompts asks first
    ranks = FakeRanks(model, 2)
    engine = _engine(ranks)
    params = SamplingParams(max_new_tokens=5, seed=9)
    bodies = engine.lookahead_bodies(prompt_ids, params)
    engine.hold([ranks._generate(rank, body) for rank, body in enumerate(bodies)])
    asyncio.run(engine.generate(prompt_ids[1:], SamplingParams(max_new_tokens=5, temperature=0.0)))

    # Act
    asyncio.run(engine.generate(prompt_ids, params))

    # Assert: only the evaluation went to the ranks; the rollout took the held batch
    assert [command for command, _ in ranks.calls] == ["generate"]
    assert engine.lookahead_hits == 1


def test_lookahead_bodies_with_bad_input_raise_like_generate(model: torch.nn.Module) -> None:
    engine = _engine(FakeRanks(model, 2))

    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.lookahead_bodies([[3, 4], []], SamplingParams(max_new_tokens=5))
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.lookahead_bodies([[3, 4]], SamplingParams(max_new_tokens=0))
