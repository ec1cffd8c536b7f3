"""MultiTurnWorkflow: tool-use episodes with per-token loss masks, against a scripted engine and the tiny policy."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from rlsdk.algorithms import completion_logprobs
from rlsdk.data import build_tiny_policy, build_tokenizer, calculator_dataset, calculator_env, tool_answer_reward
from rlsdk.data.tool_tasks import safe_arithmetic
from rlsdk.engine.inference.embedded import EmbeddedEngine
from rlsdk.engine.inference.protocol import GenerateResult, InferenceEngine, SamplingParams, WeightInfo
from rlsdk.workflow import MultiTurnWorkflow, Rollout, ToolError
from rlsdk.workflow.multi_turn import turn_seed

PAD, EOS = 0, 1


class CharTokenizer:
    """One token per character (id = code point); pad 0 and eos 1 are special and skipped on decode."""

    pad_token_id = PAD
    eos_token_id = EOS

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i in (PAD, EOS)))

    def batch_decode(self, batch: Sequence[Sequence[int]], skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in batch]


class ScriptedEngine:
    """An InferenceEngine whose ``script(context_text)`` says what to emit; token k has logprob -(k+1)/100."""

    def __init__(self, script: Callable[[str], str], *, version: int = 3) -> None:
        self.script = script
        self.version = version
        self.calls: list[tuple[int, int | None]] = []  # (batch size, seed) per generate

    async def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams) -> GenerateResult:
        self.calls.append((len(prompt_ids), params.seed))
        outs = []
        for ids in prompt_ids:
            text = self.script("".join(chr(i) for i in ids))
            out = [EOS if c == "$" else ord(c) for c in text][: params.max_new_tokens]
            outs.append(out)
        width = max(len(o) for o in outs)
        ids_B_C = torch.full((len(outs), width), PAD, dtype=torch.long)
        mask_B_C = torch.zeros((len(outs), width), dtype=torch.bool)
        for b, out in enumerate(outs):
            ids_B_C[b, : len(out)] = torch.tensor(out)
            mask_B_C[b, : len(out)] = True
        steps_B_C = -(torch.arange(width, dtype=torch.float32) + 1).expand(len(outs), width) / 100
        return GenerateResult(
            completion_ids_B_C=ids_B_C,
            completion_mask_B_C=mask_B_C,
            logprobs_B_C=torch.where(mask_B_C, steps_B_C, 0.0),
            versions_B_C=torch.where(mask_B_C, self.version, -1),
        )

    async def load_weights(self, path: str, version: int) -> WeightInfo:
        raise NotImplementedError

    async def weight_info(self) -> WeightInfo:
        return WeightInfo(version=self.version, checksum="")

    async def close(self) -> None:
        return None


def calc_script(context: str) -> str:
    """Call the tool once (with junk after the call, which must be cut), then answer and end with EOS ($)."""
    if "direct" in context:
        return "<answer>0</answer>$"
    if "<output>" not in context:
        return "hm<tool>2*3+1</tool>junk"
    return "<answer>7</answer>$"


PARAMS = SamplingParams(max_new_tokens=64, temperature=1.0)


def _run(workflow: MultiTurnWorkflow, engine: Any, rows: list[dict[str, Any]], group_size: int, seed: int | None = 0):
    return asyncio.run(workflow.arun_batch(engine, rows, group_size, seed=seed))


def test_scripted_engine_is_an_inference_engine() -> None:
    assert isinstance(ScriptedEngine(calc_script), InferenceEngine)


def test_tool_call_episode_masks_exactly_the_tool_tokens_and_aligns_logprobs_and_versions() -> None:
    workflow = MultiTurnWorkflow(CharTokenizer(), PARAMS, calculator_env)

    rows = [{"prompt": "q:", "answer": "7"}]

    rollout = _run(workflow, ScriptedEngine(calc_script, version=3), rows, group_size=2)

    turn1, tool, turn2 = "hm<tool>2*3+1</tool>", "<output>7</output>", "<answer>7</answer>"
    assert rollout.completions == [turn1 + tool + turn2] * 2
    n1, nt, n2 = len(turn1), len(tool), len(turn2) + 1  # + EOS
    want_mask = [True] * n1 + [False] * nt + [True] * n2
    assert rollout.completion_mask_B_C.tolist() == [want_mask] * 2
    assert rollout.attention_mask_B_C is not None and bool(rollout.attention_mask_B_C.all())
    want_lp = [-(k + 1) / 100 for k in range(n1)] + [0.0] * nt + [-(k + 1) / 100 for k in range(n2)]
    torch.testing.assert_close(rollout.logprobs_B_C, torch.tensor([want_lp] * 2), rtol=0, atol=1e-7)
    assert rollout.versions_B_C.tolist() == [[3] * n1 + [-1] * nt + [3] * n2] * 2
    assert rollout.versions == [3] and rollout.behaviour_versions_B.tolist() == [3, 3]
    assert rollout.info["num_turns"] == [2, 2]
    assert rollout.info["num_tool_calls"] == [1, 1]
    assert rollout.info["tool_calls"] == [["2*3+1"], ["2*3+1"]]
    assert rollout.info["generated_texts"][0] == [turn1, turn2]
    assert tool_answer_reward(rollout.completions, **rollout.columns()) == [1.0, 1.0]


def test_each_turn_batches_only_the_running_samples_into_one_generate_call() -> None:
    engine = ScriptedEngine(calc_script)
    workflow = MultiTurnWorkflow(CharTokenizer(), PARAMS, calculator_env)

    rollout = _run(workflow, engine, [{"prompt": "q:"}, {"prompt": "direct:"}], group_size=3)

    assert [size for size, _ in engine.calls] == [6, 3]  # the "direct" group finished in turn 1
    assert rollout.info["num_turns"] == [2, 2, 2, 1, 1, 1]
    assert rollout.completion_mask_B_C[3:].sum(dim=1).tolist() == [len("<answer>0</answer>") + 1] * 3
    assert rollout.completion_ids_B_C.shape[1] == max(rollout.attention_mask_B_C.sum(dim=1).tolist())


def test_max_turns_bounds_generations_and_leaves_the_last_call_unexecuted() -> None:
    engine = ScriptedEngine(lambda context: "<tool>1+1</tool>")
    calls: list[str] = []

    def env(call: str, row: dict[str, Any]) -> str:  # sync env: run in a thread
        calls.append(call)
        return "2"

    rollout = _run(MultiTurnWorkflow(CharTokenizer(), PARAMS, env, max_turns=3), engine, [{"prompt": "q"}], 1)

    assert len(engine.calls) == 3
    assert calls == ["1+1", "1+1"]
    assert rollout.info["num_turns"] == [3] and rollout.info["num_tool_calls"] == [2]
    assert rollout.completions[0].endswith("<output>2</output><tool>1+1</tool>")


def test_env_error_raises_tool_error_naming_sample_and_call() -> None:
    async def env(call: str, row: dict[str, Any]) -> str:
        raise KeyError("no such tool")

    workflow = MultiTurnWorkflow(CharTokenizer(), PARAMS, env)

    with pytest.raises(ToolError, match=r"sample 1 \(prompt 'second'.*call '2\*3\+1'.*KeyError"):
        _run(workflow, ScriptedEngine(calc_script), [{"prompt": "direct"}, {"prompt": "second"}], 1)


def test_env_error_in_message_mode_becomes_the_tool_output() -> None:
    def env(call: str, row: dict[str, Any]) -> str:
        raise ValueError("boom")

    workflow = MultiTurnWorkflow(CharTokenizer(), PARAMS, env, env_errors="message")

    rollout = _run(workflow, ScriptedEngine(calc_script), [{"prompt": "q"}], 1)

    assert "<output>error: ValueError: boom</output>" in rollout.completions[0]
    assert rollout.info["num_tool_calls"] == [1]


def test_per_turn_seeds_derive_from_the_rollout_seed_and_none_passes_none() -> None:
    seeded, unseeded = ScriptedEngine(calc_script), ScriptedEngine(calc_script)
    workflow = MultiTurnWorkflow(CharTokenizer(), PARAMS, calculator_env)

    _run(workflow, seeded, [{"prompt": "q"}], 1, seed=42)
    _run(workflow, unseeded, [{"prompt": "q"}], 1, seed=None)

    assert [seed for _, seed in seeded.calls] == [turn_seed(42, 0), turn_seed(42, 1)]
    assert turn_seed(42, 0) != turn_seed(42, 1) != turn_seed(43, 1)
    assert [seed for _, seed in unseeded.calls] == [None, None]


def test_invalid_arguments_raise_value_error_naming_them() -> None:
    with pytest.raises(ValueError, match="max_turns=0"):
        MultiTurnWorkflow(CharTokenizer(), PARAMS, calculator_env, max_turns=0)
    with pytest.raises(ValueError, match="env_errors='ignore'"):
        MultiTurnWorkflow(CharTokenizer(), PARAMS, calculator_env, env_errors="ignore")  # type: ignore[arg-type]


def test_rollout_attention_mask_of_wrong_shape_raises() -> None:
    rollout = _run(
        MultiTurnWorkflow(CharTokenizer(), PARAMS, calculator_env), ScriptedEngine(calc_script), [{"prompt": "q"}], 1
    )
    with pytest.raises(ValueError, match="attention_mask_B_C has shape"):
        Rollout(**{**rollout.__dict__, "attention_mask_B_C": torch.ones(1, 1, dtype=torch.bool)})


def test_safe_arithmetic_evaluates_integers_and_rejects_everything_else() -> None:
    assert safe_arithmetic("12*3+4") == 40 and safe_arithmetic("-(2-5)*2") == 6
    for bad in ("__import__('os')", "2**10", "1/2", "x+1", "1.5+1", "9" * 13, "1+"):
        with pytest.raises(ValueError):
            safe_arithmetic(bad)
    assert asyncio.run(calculator_env("2**3", {})).startswith("error: unsupported syntax")


def test_calculator_dataset_is_deterministic_and_answers_are_correct() -> None:
    rows = calculator_dataset(5, seed=1)
    assert rows.to_dict() == calculator_dataset(5, seed=1).to_dict()
    for prompt, answer in zip(rows["prompt"], rows["answer"]):
        expression = prompt.split("What is ")[1].split("?")[0]
        assert str(safe_arithmetic(expression)) == answer


# ---------------------------------------------------------------- the tiny policy on the embedded engine
# Its 16-token alphabet has no tags: a turn ending in "|" is a tool call on the digits before it, and the env
# answers with them reversed, followed by ">".


def _digits_call(text: str) -> str | None:
    return text[:-1] if text.endswith("|") else None


async def _reverse_env(call: str, row: dict[str, Any]) -> str:
    return call[::-1] or "0"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_policy(tmp_path_factory.mktemp("multi_turn") / "model", seed=0)


def _tiny_rollout(tiny_dir: Path, seed: int) -> tuple[Rollout, torch.nn.Module]:
    workflow = MultiTurnWorkflow(
        build_tokenizer(),
        SamplingParams(max_new_tokens=6, temperature=1.0),
        _reverse_env,
        max_turns=3,
        parse_call=_digits_call,
        call_end="|",
        format_output=lambda out: out + ">",
    )
    rows = [{"prompt": "123>"}, {"prompt": "9081>"}]

    async def go() -> tuple[Rollout, torch.nn.Module]:
        engine = EmbeddedEngine.from_pretrained(tiny_dir)
        try:
            return await workflow.arun_batch(engine, rows, 4, seed=seed), engine.model
        finally:
            await engine.close()

    return asyncio.run(go())


def test_tiny_policy_rollout_is_reproducible_and_trainer_logprobs_match_with_the_attention_mask(
    tiny_dir: Path,
) -> None:
    rollout, model = _tiny_rollout(tiny_dir, seed=5)
    again, _ = _tiny_rollout(tiny_dir, seed=5)

    assert torch.equal(rollout.completion_ids_B_C, again.completion_ids_B_C)
    assert torch.equal(rollout.completion_mask_B_C, again.completion_mask_B_C)
    assert sum(rollout.info["num_tool_calls"]) > 0  # some samples really went through the tool loop
    assert max(rollout.info["num_turns"]) <= 3
    tool_B_C = rollout.attention_mask_B_C & ~rollout.completion_mask_B_C
    assert bool((rollout.logprobs_B_C[tool_B_C] == 0).all()) and bool((rollout.versions_B_C[tool_B_C] == -1).all())
    # Teacher forcing over prompt + completion gives a logprob at every completion position; with the tool
    # tokens in context (attention_mask_B_C) it equals the engine's logprobs on the sampled tokens.
    with torch.no_grad():
        trainer_B_C, _ = completion_logprobs(
            model,
            rollout.prompt_ids_B_P,
            rollout.prompt_mask_B_P,
            rollout.completion_ids_B_C,
            rollout.completion_mask_B_C,
            attention_mask_B_C=rollout.attention_mask_B_C,
        )
    mask_B_C = rollout.completion_mask_B_C
    torch.testing.assert_close(trainer_B_C[mask_B_C], rollout.logprobs_B_C[mask_B_C], rtol=0, atol=1e-4)


# ---------------------------------------------------------------- a real Session on 2 ranks


@pytest.mark.distributed
def test_session_with_multi_turn_workflow_runs_rollout_reward_update(small_config: Any) -> None:
    from rlsdk import Session

    async def scenario() -> tuple[Rollout, dict[str, float], tuple[int, int]]:
        session = await Session.start(small_config)
        try:
            session.workflow = MultiTurnWorkflow(
                session.tokenizer,
                SamplingParams(max_new_tokens=4, temperature=1.0),
                _reverse_env,
                max_turns=3,
                parse_call=_digits_call,
                call_end="|",
                format_output=lambda out: out + ">",
            )
            rollout = await session.rollout()
            rollout = await session.reward(rollout, lambda completions, **_: [float(len(c)) for c in completions])
            stats = await session.update(rollout)
            return rollout, stats, (session.versions.trainer_version, session.versions.engine_version)
        finally:
            await session.close()

    rollout, stats, versions = asyncio.run(scenario())

    assert rollout.attention_mask_B_C is not None and "num_turns" in rollout.info
    assert versions == (1, 0)
    assert stats["train/tokens"] == pytest.approx(float(rollout.completion_mask_B_C.sum()))
    tool_tokens = int((rollout.attention_mask_B_C & ~rollout.completion_mask_B_C).sum())
    # the ranks attend to the tool outputs as the engine did: their logprobs agree with the engine's
    assert tool_tokens > 0 and stats["agreement/logprob_absdiff_max"] < 1e-4, (tool_tokens, stats)
