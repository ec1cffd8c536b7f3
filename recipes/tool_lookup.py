"""Multi-turn tool use on CPU: the tiny policy learns to call a lookup tool and answer with what it returned.

Run: ``rlsdk run recipes/tool_lookup.py [--train.max-steps 300 ...]``.

Each prompt is a key (``"123>"``, 3 random digits). Its answer is a code the model cannot work out from the key
(:func:`rlsdk.data.tool_tasks.lookup_code`, a fixed hash, one digit), but a tool knows it. An episode
(:class:`rlsdk.workflow.multi_turn.MultiTurnWorkflow`, at most 2 turns of at most 5 tokens):

    "123>"  ->  model: "|"           (the call marker ends turn 1 and calls the tool)
            ->  tool:  "4>"          (its answer; in the context, masked out of the loss)
            ->  model: "4" <eos>     (the final answer)

Reward (``combine_rewards``, logged per part): ``answer`` = the reverse task's partial credit of the final answer
(the text after the tool's output) against the code, weight 1; ``called`` = 1 when the tool was called and
answered, weight 0.2 (a shaping term: without it the policy, which answers no better after a call than without
one at first, learns to avoid the tool). Answering without the tool can only guess (mean ~0.05).

The policy learns to call the tool first, then to copy its answer; ``tests/workflow/test_tool_lookup_learns.py``
checks the rise of the ``answer`` reward.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from rlsdk import Session
from rlsdk.config import (
    AlgorithmConfig,
    DataConfig,
    ModelConfig,
    ObserveConfig,
    RolloutConfig,
    SessionConfig,
    TrainConfig,
)
from rlsdk.data import build_tiny_policy
from rlsdk.data.tool_tasks import TOOL_CALL, lookup_call, lookup_env, lookup_output, lookup_reward, tool_called_reward
from rlsdk.engine.inference.protocol import SamplingParams
from rlsdk.rewards import combine_rewards
from rlsdk.workflow.multi_turn import EnvFn, MultiTurnWorkflow

DEFAULT_MODEL = "outputs/models/tiny-reverse"
MAX_TURNS = 2
REWARD = combine_rewards({"answer": (lookup_reward, 1.0), "called": (tool_called_reward, 0.2)})


def config() -> SessionConfig:
    return SessionConfig(
        model=ModelConfig(path=DEFAULT_MODEL),
        train=TrainConfig(lr=1e-3, max_steps=300, target_reward=0.9, micro_batch_size=128),
        algorithm=AlgorithmConfig(scale_rewards=False),
        rollout=RolloutConfig(group_size=16, max_new_tokens=5, temperature=1.0),
        data=DataConfig(prompts_per_step=16, min_digits=3, max_digits=3),
        observe=ObserveConfig(output_dir=f"outputs/tool_lookup/{time.strftime('%Y%m%d-%H%M%S')}", console=False),
    )


def lookup_workflow(session: Session, env: EnvFn = lookup_env) -> MultiTurnWorkflow:
    """The tool-use loop over the session's tokenizer and sampling settings; ``env`` answers the calls (default:
    :func:`rlsdk.data.tool_tasks.lookup_env`, in process)."""
    rollout = session.config.rollout
    params = SamplingParams(max_new_tokens=rollout.max_new_tokens, temperature=rollout.temperature)
    return MultiTurnWorkflow(
        session.tokenizer,
        params,
        env,
        max_turns=MAX_TURNS,
        parse_call=lookup_call,
        call_end=TOOL_CALL,
        format_output=lookup_output,
        eos_token_ids=session.special_tokens.eos_token_ids,
    )


async def main(config: SessionConfig) -> dict[str, object]:
    if config.model.path == DEFAULT_MODEL and not Path(DEFAULT_MODEL, "config.json").is_file():
        build_tiny_policy(DEFAULT_MODEL, seed=config.seed)
    answers: list[float] = []
    calls: list[float] = []  # the 'called' reward is 1 when the tool was called (and answered): calls per sample

    def record(stats: dict[str, float]) -> None:
        answers.append(stats["reward/answer"])
        calls.append(stats["reward/called"])

    window = config.observe.moving_average
    start = time.perf_counter()
    async with await Session.start(config) as session:
        session.workflow = lookup_workflow(session)
        # train.target_reward applies to the answer reward alone (the 'called' shaping term is not the task)
        await session.train(REWARD, target_metric="reward/answer", on_step=record)
    summary = {
        "steps": len(answers),
        "first_answer_reward": statistics.fmean(answers[:window]),
        "final_answer_reward": statistics.fmean(answers[-window:]),
        "final_tool_calls_per_sample": statistics.fmean(calls[-window:]),
        "seconds": time.perf_counter() - start,
    }
    print(
        f"\n{summary['steps']} steps in {summary['seconds']:.0f} s: answer reward (mean of {window} steps) "
        f"{summary['first_answer_reward']:.3f} at the start -> {summary['final_answer_reward']:.3f} at the end; "
        f"tool calls per sample {summary['final_tool_calls_per_sample']:.2f}"
    )
    return summary
