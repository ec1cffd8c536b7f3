"""DAPO dynamic sampling: group selection, concatenation, the informative-group filter and the sampling loop."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence

import pytest
import torch

from rlsdk.testing.tensors import assert_close
from rlsdk.workflow.dynamic_sampling import (
    concat_rollouts,
    fill_informative_groups,
    informative_groups,
    select_groups,
)
from rlsdk.workflow.rollout import Rollout

PAD = 0
TENSOR_FIELDS = (
    "prompt_ids_B_P",
    "prompt_mask_B_P",
    "completion_ids_B_C",
    "completion_mask_B_C",
    "logprobs_B_C",
    "versions_B_C",
)


def _rollout(
    prompt_lens: Sequence[int],
    completion_lens: Sequence[int],
    group_size: int,
    *,
    seed: int = 0,
    rewards: Sequence[float] | None = None,
    tag: str = "p",
    attention_extra: Sequence[int] | None = None,
) -> Rollout:
    """A synthetic rollout: ``prompt_lens`` per group, ``completion_lens`` per sample, consistent padding.

    ``attention_extra``: per sample, tool-output tokens after the trained ones (attention True, completion mask
    False, logprobs 0, versions -1), as a multi-turn workflow leaves them.
    """
    gen = torch.Generator().manual_seed(seed)
    batch = len(completion_lens)
    assert batch == len(prompt_lens) * group_size
    extra = list(attention_extra) if attention_extra is not None else [0] * batch
    width_P = max(prompt_lens)
    width_C = max(n + e for n, e in zip(completion_lens, extra))
    prompt_ids = torch.full((batch, width_P), PAD, dtype=torch.long)
    prompt_mask = torch.zeros((batch, width_P), dtype=torch.bool)
    ids = torch.full((batch, width_C), PAD, dtype=torch.long)
    mask = torch.zeros((batch, width_C), dtype=torch.bool)
    attention = torch.zeros((batch, width_C), dtype=torch.bool)
    logprobs = torch.zeros((batch, width_C))
    versions = torch.full((batch, width_C), -1, dtype=torch.long)
    for b in range(batch):
        p = prompt_lens[b // group_size]
        prompt_ids[b, width_P - p :] = torch.randint(1, 100, (p,), generator=gen)
        prompt_mask[b, width_P - p :] = True
        n, e = completion_lens[b], extra[b]
        ids[b, : n + e] = torch.randint(1, 100, (n + e,), generator=gen)
        mask[b, :n] = True
        attention[b, : n + e] = True
        logprobs[b, :n] = -torch.rand(n, generator=gen)
        versions[b, :n] = torch.randint(0, 4, (n,), generator=gen)
    return Rollout(
        rows=[{"prompt": f"{tag}{g}", "answer": str(g)} for g in range(len(prompt_lens))],
        group_size=group_size,
        prompt_ids_B_P=prompt_ids,
        prompt_mask_B_P=prompt_mask,
        completion_ids_B_C=ids,
        completion_mask_B_C=mask,
        logprobs_B_C=logprobs,
        versions_B_C=versions,
        completions=[f"{tag}-c{b}" for b in range(batch)],
        rewards_B=None if rewards is None else torch.tensor(rewards, dtype=torch.float32),
        info={"num_turns": list(range(batch)), "tag": tag},
        attention_mask_B_C=attention if attention_extra is not None else None,
    )


def _assert_rollouts_equal(actual: Rollout, expected: Rollout) -> None:
    for name in (*TENSOR_FIELDS, "rewards_B", "attention_mask_B_C"):
        assert_close(getattr(actual, name), getattr(expected, name), rtol=0.0, atol=0.0, msg=name)
    assert actual.rows == expected.rows
    assert actual.completions == expected.completions
    assert actual.group_size == expected.group_size


# select_groups


def test_select_groups_takes_the_samples_of_the_given_groups_in_order() -> None:
    rollout = _rollout([3, 3, 3], [2, 2, 2, 2, 2, 2], 2, rewards=[0, 1, 2, 3, 4, 5])

    picked = select_groups(rollout, [2, 0])

    assert [row["prompt"] for row in picked.rows] == ["p2", "p0"]
    assert picked.completions == ["p-c4", "p-c5", "p-c0", "p-c1"]
    samples = torch.tensor([4, 5, 0, 1])
    for name in TENSOR_FIELDS:
        assert_close(getattr(picked, name), getattr(rollout, name)[samples], rtol=0.0, atol=0.0, msg=name)
    assert_close(picked.rewards_B, torch.tensor([4.0, 5.0, 0.0, 1.0]), rtol=0.0, atol=0.0)
    assert picked.attention_mask_B_C is None


def test_select_groups_with_shorter_kept_samples_trims_padding_columns() -> None:
    # Group 0: long prompt, long completions; group 1: prompt 2 tokens, completions 1 and 3 tokens.
    rollout = _rollout([5, 2], [6, 4, 1, 3], 2)

    picked = select_groups(rollout, [1])

    assert tuple(picked.prompt_ids_B_P.shape) == (2, 2)
    assert tuple(picked.completion_ids_B_C.shape) == (2, 3)
    assert_close(picked.prompt_ids_B_P, rollout.prompt_ids_B_P[2:, 3:], rtol=0.0, atol=0.0)
    assert picked.prompt_mask_B_P.all()
    assert picked.completion_mask_B_C.tolist() == [[True, False, False], [True, True, True]]
    assert picked.versions_B_C[0, 1:].tolist() == [-1, -1]


def test_select_groups_with_attention_mask_keeps_tool_columns_beyond_completion_mask() -> None:
    # Sample 2 has 1 trained token followed by 3 tool-output tokens: 4 columns stay in context.
    rollout = _rollout([2, 2], [6, 6, 1, 1], 2, attention_extra=[0, 0, 3, 0])

    picked = select_groups(rollout, [1])

    assert tuple(picked.completion_ids_B_C.shape) == (2, 4)
    assert picked.attention_mask_B_C is not None
    assert picked.attention_mask_B_C.tolist() == [[True] * 4, [True, False, False, False]]
    assert picked.completion_mask_B_C[:, 1:].any().item() is False


def test_select_groups_cuts_per_sample_info_and_copies_the_rest() -> None:
    rollout = _rollout([2, 2], [1, 1, 1, 1], 2)
    rollout.info["reward_components"] = {"format": torch.tensor([0.0, 1.0, 2.0, 3.0])}

    picked = select_groups(rollout, [1])

    assert picked.info["num_turns"] == [2, 3]
    assert picked.info["tag"] == "p"
    assert_close(picked.info["reward_components"]["format"], torch.tensor([2.0, 3.0]), rtol=0.0, atol=0.0)
    assert picked.info is not rollout.info


@pytest.mark.parametrize(("groups", "message"), [([], "groups is empty"), ([0, 2], "group index 2"), ([-1], "-1")])
def test_select_groups_with_bad_indices_raises_naming_them(groups: list[int], message: str) -> None:
    rollout = _rollout([2, 2], [1, 1, 1, 1], 2)

    with pytest.raises(ValueError, match=message):
        select_groups(rollout, groups)


# concat_rollouts


def test_concat_of_selected_halves_then_select_all_round_trips_to_original() -> None:
    original = _rollout([4, 2, 3, 1], [3, 1, 2, 5, 4, 1, 2, 2], 2, rewards=[1, 0, 0, 0, 1, 1, 0, 1])
    first, second = select_groups(original, [0, 1]), select_groups(original, [2, 3])

    joined = concat_rollouts([first, second], pad_token_id=PAD)
    again = select_groups(joined, range(4))

    _assert_rollouts_equal(joined, original)
    _assert_rollouts_equal(again, original)
    assert again.info["num_turns"] == original.info["num_turns"]


def test_concat_with_different_widths_left_pads_prompts_and_right_pads_completions() -> None:
    narrow = _rollout([1], [1, 2], 2, seed=1, tag="a")
    wide = _rollout([3], [4, 1], 2, seed=2, tag="b")

    joined = concat_rollouts([narrow, wide], pad_token_id=7)

    assert tuple(joined.prompt_ids_B_P.shape) == (4, 3)
    assert tuple(joined.completion_ids_B_C.shape) == (4, 4)
    assert joined.prompt_ids_B_P[:2, :2].tolist() == [[7, 7], [7, 7]]
    assert_close(joined.prompt_ids_B_P[:2, 2:], narrow.prompt_ids_B_P, rtol=0.0, atol=0.0)
    assert joined.prompt_mask_B_P[:2].tolist() == [[False, False, True]] * 2
    assert joined.completion_ids_B_C[:2, 2:].tolist() == [[7, 7], [7, 7]]
    assert_close(joined.completion_ids_B_C[:2, :2], narrow.completion_ids_B_C, rtol=0.0, atol=0.0)
    assert joined.completion_mask_B_C[:2].tolist() == [[True, False, False, False], [True, True, False, False]]
    assert_close(joined.logprobs_B_C[:2, 2:], torch.zeros(2, 2), rtol=0.0, atol=0.0)
    assert joined.versions_B_C[:2, 2:].tolist() == [[-1, -1], [-1, -1]]
    assert_close(joined.completion_ids_B_C[2:], wide.completion_ids_B_C, rtol=0.0, atol=0.0)
    assert_close(joined.prompt_ids_B_P[2:], wide.prompt_ids_B_P, rtol=0.0, atol=0.0)
    assert [row["prompt"] for row in joined.rows] == ["a0", "b0"]


def test_concat_with_different_group_sizes_raises_naming_both() -> None:
    pairs = _rollout([2], [1, 1], 2)
    triples = _rollout([2], [1, 1, 1], 3)

    with pytest.raises(ValueError, match=r"group_size 3 but rollouts\[0\] has group_size 2"):
        concat_rollouts([pairs, triples], pad_token_id=PAD)


def test_concat_mixing_rewarded_and_unrewarded_raises() -> None:
    rewarded = _rollout([2], [1, 1], 2, rewards=[0, 1])
    unrewarded = _rollout([2], [1, 1], 2)

    with pytest.raises(ValueError, match=r"rollouts \[1\] have no rewards"):
        concat_rollouts([rewarded, unrewarded], pad_token_id=PAD)


def test_concat_of_unrewarded_parts_has_no_rewards() -> None:
    parts = [_rollout([2], [1, 1], 2), _rollout([2], [1, 1], 2)]

    joined = concat_rollouts(parts, pad_token_id=PAD)

    assert joined.rewards_B is None


def test_concat_with_some_attention_masks_materialises_the_missing_from_completion_mask() -> None:
    plain = _rollout([2], [1, 2], 2)
    multi_turn = _rollout([2], [1, 1], 2, attention_extra=[2, 0])

    joined = concat_rollouts([plain, multi_turn], pad_token_id=PAD)
    neither = concat_rollouts([plain, plain], pad_token_id=PAD)

    assert joined.attention_mask_B_C is not None
    assert joined.attention_mask_B_C.tolist() == [
        [True, False, False],
        [True, True, False],
        [True, True, True],
        [True, False, False],
    ]
    assert neither.attention_mask_B_C is None


def test_concat_info_joins_per_sample_entries_keeps_equal_ones_and_lists_parts() -> None:
    first = _rollout([2], [1, 1], 2, tag="a")
    second = _rollout([2], [1, 1], 2, tag="b")
    first.info.update(seconds=1.0, kind="x", reward_components={"f": torch.tensor([1.0, 2.0])})
    second.info.update(seconds=2.0, kind="x", reward_components={"f": torch.tensor([3.0, 4.0])})

    joined = concat_rollouts([first, second], pad_token_id=PAD)

    assert joined.info["num_turns"] == [0, 1, 0, 1]
    assert_close(joined.info["reward_components"]["f"], torch.tensor([1.0, 2.0, 3.0, 4.0]), rtol=0.0, atol=0.0)
    assert joined.info["kind"] == "x"
    assert "seconds" not in joined.info and "tag" not in joined.info
    assert [part["seconds"] for part in joined.info["parts"]] == [1.0, 2.0]


# informative_groups


@pytest.mark.parametrize(
    ("rewards", "group_size", "atol", "expected"),
    [
        ([1, 1, 0, 1, 0, 0], 2, 0.0, [False, True, False]),
        ([1, 1, 1, 1], 4, 0.0, [False]),
        ([0.5, 0.5, 0.5, 0.5], 2, 0.0, [False, False]),
        ([0, 1, 2], 1, 0.0, [False, False, False]),  # one sample: no spread, never informative
        ([0.0, 0.05, 0.0, 0.5], 2, 0.1, [False, True]),
        ([0.0, 0.1, 0.0, 0.2], 2, 0.1, [False, True]),  # spread == atol counts as equal
    ],
)
def test_informative_groups_marks_groups_with_reward_spread_above_atol(
    rewards: list[float], group_size: int, atol: float, expected: list[bool]
) -> None:
    rewards_B = torch.tensor(rewards, dtype=torch.float64)

    informative_G = informative_groups(rewards_B, group_size, atol=atol)

    assert informative_G.dtype == torch.bool
    assert informative_G.tolist() == expected


def test_informative_groups_with_integer_rewards_compares_exactly() -> None:
    rewards_B = torch.tensor([3, 3, 3, 4], dtype=torch.int64)

    assert informative_groups(rewards_B, 2).tolist() == [False, True]


@pytest.mark.parametrize(
    ("rewards_B", "group_size", "atol", "message"),
    [
        (torch.zeros(2, 2), 2, 0.0, "1-D"),
        (torch.zeros(5), 2, 0.0, "not a multiple of group_size=2"),
        (torch.zeros(4), 0, 0.0, "group_size=0"),
        (torch.zeros(4), 2, -0.1, "atol=-0.1"),
        (torch.zeros(4), 2, float("nan"), "atol=nan"),
    ],
)
def test_informative_groups_with_bad_input_raises_naming_it(
    rewards_B: torch.Tensor, group_size: int, atol: float, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        informative_groups(rewards_B, group_size, atol=atol)


# fill_informative_groups


class _ScriptedSampler:
    """Fresh prompts ``g0, g1, ...``; group ``k`` is informative when ``flags[k]`` (rewards 1,0 vs all equal)."""

    def __init__(self, flags: Sequence[bool], group_size: int = 2) -> None:
        self.flags = list(flags)
        self.group_size = group_size
        self.requests: list[int] = []
        self.next = 0

    async def __call__(self, n: int) -> Rollout:
        await asyncio.sleep(0)
        self.requests.append(n)
        ids = range(self.next, self.next + n)
        self.next += n
        rewards = []
        for k in ids:
            same = float(k % 2)  # uninformative groups alternate between accuracy 0 and 1
            rewards += [1.0] + [0.0] * (self.group_size - 1) if self.flags[k] else [same] * self.group_size
        # Widths differ per round (prompt length k % 3 + 1), so joining rounds pads.
        rollout = _rollout(
            [k % 3 + 1 for k in ids], [k % 4 + 1 for k in ids for _ in range(self.group_size)], self.group_size
        )
        rows = [{"prompt": f"g{k}"} for k in ids]
        return dataclasses.replace(
            rollout, rows=rows, rewards_B=torch.tensor(rewards), info={"round": len(self.requests)}
        )


def _fill(sampler: _ScriptedSampler, num_groups: int, **kwargs: object) -> tuple[Rollout, dict[str, float]]:
    kwargs.setdefault("max_rounds", 10)
    return asyncio.run(fill_informative_groups(sampler, num_groups, pad_token_id=PAD, **kwargs))  # type: ignore[arg-type]


def test_fill_over_several_rounds_samples_the_shortfall_and_keeps_first_come_informative_groups() -> None:
    # Round 1 (4 groups): g1, g2 informative; round 2 (2): g5; round 3 (1): g6.
    sampler = _ScriptedSampler([False, True, True, False, False, True, True])

    rollout, stats = _fill(sampler, 4)

    assert sampler.requests == [4, 2, 1]
    assert [row["prompt"] for row in rollout.rows] == ["g1", "g2", "g5", "g6"]
    assert rollout.rewards_B is not None
    assert informative_groups(rollout.rewards_B, 2).all()
    assert stats == {
        "dynamic_sampling/rounds": 3.0,
        "dynamic_sampling/sampled_groups": 7.0,
        "dynamic_sampling/informative_groups": 4.0,
        "dynamic_sampling/kept_groups": 4.0,
        "dynamic_sampling/dropped_groups": 3.0,
        "dynamic_sampling/filled": 1.0,
        "dynamic_sampling/fallback": 0.0,
    }
    assert [part["round"] for part in rollout.info["parts"]] == [1, 2, 3]


def test_fill_with_surplus_informative_groups_returns_exactly_num_groups() -> None:
    # Oversampling 2x: round 1 asks 6 groups for 3 wanted; 5 are informative, the last 2 are dropped.
    sampler = _ScriptedSampler([True, False, True, True, True, True])

    rollout, stats = _fill(sampler, 3, oversample=2.0)

    assert sampler.requests == [6]
    assert [row["prompt"] for row in rollout.rows] == ["g0", "g2", "g3"]
    assert stats["dynamic_sampling/informative_groups"] == 5.0
    assert stats["dynamic_sampling/dropped_groups"] == 3.0
    assert stats["dynamic_sampling/filled"] == 1.0


def test_fill_with_oversample_asks_the_rounded_up_multiple_of_the_shortfall() -> None:
    sampler = _ScriptedSampler([True, False, False, False, False] + [True] * 10)

    _fill(sampler, 3, oversample=1.5)

    assert sampler.requests == [5, 3]  # ceil(3 * 1.5), then ceil(2 * 1.5)


def test_fill_hitting_max_rounds_returns_the_informative_groups_collected() -> None:
    sampler = _ScriptedSampler([True, False, False, False, False, False, True] + [True] * 10)

    rollout, stats = _fill(sampler, 4, max_rounds=2)

    assert sampler.requests == [4, 3]
    assert [row["prompt"] for row in rollout.rows] == ["g0", "g6"]
    assert stats["dynamic_sampling/rounds"] == 2.0
    assert stats["dynamic_sampling/kept_groups"] == 2.0
    assert stats["dynamic_sampling/dropped_groups"] == 5.0
    assert stats["dynamic_sampling/filled"] == 0.0
    assert stats["dynamic_sampling/fallback"] == 0.0


def test_fill_with_no_informative_group_falls_back_to_last_round_unfiltered() -> None:
    sampler = _ScriptedSampler([False] * 9)

    rollout, stats = _fill(sampler, 3, max_rounds=3)

    assert sampler.requests == [3, 3, 3]
    assert [row["prompt"] for row in rollout.rows] == ["g6", "g7", "g8"]
    assert rollout.info == {"round": 3}
    assert stats["dynamic_sampling/fallback"] == 1.0
    assert stats["dynamic_sampling/filled"] == 0.0
    assert stats["dynamic_sampling/kept_groups"] == 3.0
    assert stats["dynamic_sampling/dropped_groups"] == 6.0
    assert stats["dynamic_sampling/informative_groups"] == 0.0


def test_fill_fallback_with_oversample_returns_num_groups_of_the_last_round() -> None:
    sampler = _ScriptedSampler([False] * 4)

    rollout, stats = _fill(sampler, 2, max_rounds=1, oversample=2.0)

    assert [row["prompt"] for row in rollout.rows] == ["g0", "g1"]
    assert stats["dynamic_sampling/dropped_groups"] == 2.0


def test_fill_joins_rounds_of_different_widths_with_versions_kept() -> None:
    sampler = _ScriptedSampler([False, True, True, True])

    rollout, _ = _fill(sampler, 2, max_rounds=2)

    assert [row["prompt"] for row in rollout.rows] == ["g1", "g2"]
    # g1: prompt 2, completions 2; g2: prompt 3, completions 3 -> widths 3 and 3.
    assert tuple(rollout.prompt_ids_B_P.shape) == (4, 3)
    assert rollout.prompt_mask_B_P[:2].tolist() == [[False, True, True]] * 2
    assert (rollout.versions_B_C[~rollout.completion_mask_B_C] == -1).all()
    assert (rollout.versions_B_C[rollout.completion_mask_B_C] >= 0).all()


@pytest.mark.parametrize(
    ("num_groups", "kwargs", "message"),
    [
        (0, {}, "num_groups=0"),
        (2, {"max_rounds": 0}, "max_rounds=0"),
        (2, {"oversample": 0.5}, "oversample=0.5"),
        (2, {"atol": -1.0}, "atol=-1.0"),
    ],
)
def test_fill_with_bad_arguments_raises_before_sampling(
    num_groups: int, kwargs: dict[str, object], message: str
) -> None:
    sampler = _ScriptedSampler([True] * 4)

    with pytest.raises(ValueError, match=message):
        _fill(sampler, num_groups, **kwargs)
    assert sampler.requests == []


def test_fill_with_sampler_returning_wrong_group_count_raises_naming_both() -> None:
    sampler = _ScriptedSampler([True] * 4)

    async def short(n: int) -> Rollout:
        return select_groups(await sampler(n), [0])

    with pytest.raises(ValueError, match=r"sample\(2\) in round 1 returned 1 groups, want 2"):
        asyncio.run(fill_informative_groups(short, 2, max_rounds=3, pad_token_id=PAD))


def test_fill_with_unrewarded_rollout_raises() -> None:
    sampler = _ScriptedSampler([True] * 4)

    async def unrewarded(n: int) -> Rollout:
        return dataclasses.replace(await sampler(n), rewards_B=None)

    with pytest.raises(ValueError, match="unrewarded"):
        asyncio.run(fill_informative_groups(unrewarded, 2, max_rounds=3, pad_token_id=PAD))


def test_fill_with_group_size_one_raises_instead_of_sampling_every_round() -> None:
    sampler = _ScriptedSampler([False] * 10, group_size=1)

    with pytest.raises(ValueError, match="group_size=1"):
        _fill(sampler, 2, max_rounds=5)
    assert sampler.requests == [2]
