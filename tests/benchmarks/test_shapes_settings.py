"""benchmarks/shapes.py's per-run settings: each run's Session gets the token budget and FSDP2 resharding its
precision and engine call for, and the derived memory that decides whether it runs follows the same settings."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "shapes.py"


@pytest.fixture
def shapes(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts benchmarks/ on sys.path to find _harness
    spec = importlib.util.spec_from_file_location("shapes_bench", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "shapes_bench", module)  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("precision", "engine", "tokens", "reshard"),
    [("bf16", "embedded", 1536, False), ("bf16", "vllm", 1536, True), ("fp32", "embedded", 768, True)],
)
def test_s2_session_config_takes_the_budget_and_resharding_of_its_precision_and_engine(
    shapes: ModuleType, tmp_path: Path, precision: str, engine: str, tokens: int, reshard: bool
) -> None:
    run = shapes.Run("S2", "fsdp2", engine, precision)

    config = shapes.session_config(run, shapes.SHAPES["S2"], tmp_path, None, tmp_path / "out")

    assert config.train.max_tokens_per_micro_batch == tokens
    assert config.train.fsdp_reshard_after_forward is reshard
    assert config.train.mixed_precision == ("bf16" if precision == "bf16" else "no")


def test_s2_fp32_derived_memory_counts_its_smaller_resharded_micro_batches(shapes: ModuleType) -> None:
    baseline = 2**30
    fp32 = shapes.derived_memory(shapes.Run("S2", "fsdp2", "embedded", "fp32"), baseline)
    bf16 = shapes.derived_memory(shapes.Run("S2", "fsdp2", "embedded", "bf16"), baseline)
    s2 = shapes.SHAPES["S2"]
    layer = (s2.parameters() - s2.vocab * s2.hidden - s2.hidden) / s2.layers

    # float32 activations: 768 padded tokens (two 384-token sequences), not 1536
    per_token = shapes.activation_bytes_per_token_layer(s2, "fsdp2", "fp32") * s2.layers
    assert fp32["activations"] == pytest.approx(per_token * 768, rel=1e-12)
    # resharded: the root and two layers gathered in float32, not every layer
    assert fp32["gathered_parameters"] == pytest.approx(4 * (s2.vocab * s2.hidden + 2 * layer), rel=1e-12)
    assert fp32["total"] < bf16["total"] + 1.5 * 2**30


def test_shapes_without_fp32_settings_use_the_bf16_ones(shapes: ModuleType) -> None:
    s1 = shapes.SHAPES["S1"]

    assert s1.token_budget("fp32") == s1.token_budget("bf16") == s1.max_tokens_per_micro_batch
    assert s1.keeps_gathered("embedded", "fsdp2", "fp32") is s1.keep_gathered


@pytest.mark.parametrize(
    ("chosen", "measured", "quick", "expected"),
    [
        (None, ["S0", "S1", "S2"], False, ["S1", "S2"]),
        (None, ["S1"], False, ["S1"]),
        (["S2"], ["S2"], False, ["S2"]),
        (None, ["S0"], True, ["S0"]),
    ],
)
def test_trl_comparison_runs_at_s1_and_at_s2_where_s2_is_measured_unless_chosen(
    shapes: ModuleType, chosen: list[str] | None, measured: list[str], quick: bool, expected: list[str]
) -> None:
    assert shapes.trl_shapes(chosen, measured, quick) == expected


def test_s2_trl_comparison_uses_fsdp2_ranks_and_trl_micro_batches_of_one_group(shapes: ModuleType) -> None:
    s2 = shapes.SHAPES["S2"]

    assert s2.trl_rlsdk_parallelism == "fsdp2" and shapes.SHAPES["S1"].trl_rlsdk_parallelism == "ddp"
    # one prompt group per TRL micro-batch, as rlsdk's 1536-token micro-batch holds one
    assert (
        s2.trl_micro_batch_size
        == s2.samples
        == s2.max_tokens_per_micro_batch // (s2.prompt_tokens + s2.completion_tokens)
    )


def test_decode_roofline_takes_the_larger_of_weight_reads_and_products_and_adds_the_prefill(
    shapes: ModuleType,
) -> None:
    shape = shapes.SHAPES["S1"]
    run = shapes.Run("S1", "ddp", "embedded", "bf16")
    # 64 rows for 256 decode steps after 64-token prompts; one distinct prompt per group of 8
    step = {"sequences": [(64, 256)] * 64, "completion_tokens": 64 * 256, "distinct_prompt_tokens": 8 * 64}
    slow_memory = {"gemm_flops_per_s": {"S1": {"bf16": 1e15, "fp32": 1e15}}, "memcpy_bytes_per_s": 1e9}
    slow_gemm = {"gemm_flops_per_s": {"S1": {"bf16": 1e9, "fp32": 1e9}}, "memcpy_bytes_per_s": 1e15}

    memory = shapes.decode_roofline(shape, run, [step], 100.0, slow_memory)
    compute = shapes.decode_roofline(shape, run, [step], 100.0, slow_gemm)

    weights = 2 * shape.parameters()  # served in bfloat16
    assert memory["step_bound_kind"] == "memory" and compute["step_bound_kind"] == "compute"
    assert memory["step_bytes"] > weights and memory["step_bound_s"] == memory["step_bytes"] / 1e9
    assert compute["step_bound_s"] == compute["step_flops"] / 2e9  # two cores' GEMM rate
    assert compute["step_flops"] > 64 * 2 * (shape.parameters() - shape.hidden)  # every matmul weight, every row
    assert compute["bound_s"] == 256 * compute["step_bound_s"] + compute["prefill_bound_s"]
    assert compute["fraction"] == compute["bound_s"] / 100.0 and compute["achieved_step_s"] == 100.0 / 256
