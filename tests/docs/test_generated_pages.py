"""The generated docs pages (docs/hooks.py) describe the live code; `make docs` builds them with --strict."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

from rlsdk.compat.surface import config_fields
from rlsdk.config import SessionConfig
from rlsdk.config import deprecations as deps

HOOKS = Path(__file__).parents[2] / "docs" / "hooks.py"


@pytest.fixture(scope="module")
def hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("rlsdk_docs_hooks", HOOKS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_config_reference_lists_every_field_with_its_flag_and_doc(hooks: ModuleType) -> None:
    page = hooks.config_reference()

    for info in config_fields(SessionConfig):
        if not info.section:
            assert f"| `{info.path}` | `--{info.path.replace('_', '-')}` |" in page
    assert "Learning rate, > 0." in page


def test_config_reference_has_a_table_per_nested_section_and_lists_moved_fields(hooks: ModuleType) -> None:
    page = hooks.config_reference()

    assert "## inference.vllm\n\n`VLLMConfig`: Options of the vLLM engine" in page
    assert "## launch.slurm\n\n`SlurmConfig`:" in page
    row = "| `inference.vllm.kv_cache_gib` | `--inference.vllm.kv-cache-gib` | `int` | `1` | KV-cache size in GiB"
    assert row in page
    assert "| `inference.kv_cache_gib` | `inference.vllm.kv_cache_gib` | 0.3 |" in page
    assert "| `launch.slurm_partition` | `launch.slurm.partition` | 0.3 |" in page


def test_config_reference_registered_deprecation_is_listed(hooks: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(deps, "_REGISTRY", {})
    deps.deprecated_field(old="train.learning_rate", new="train.lr", remove_in="0.3")

    page = hooks.config_reference()

    assert "| `train.learning_rate` | `train.lr` | 0.3 |" in page


def test_benchmarks_page_with_results_file_shows_ratios(hooks: ModuleType, tmp_path: Path) -> None:
    stats = {"median": 2.0, "min": 1.0, "max": 3.0, "n": 2}
    results = {
        "environment": {"python": "3.11", "cpu": "cpu", "cpu_count": 2, "versions": {"torch": "2"}},
        "quick": False,
        "step_ms": {"bare": stats, "session": stats, "ratio": 1.25},
        "noop": {"2": {"raw_pyzmq_us": stats, "session_noop_us": stats, "ratio": 2.5}},
    }
    path = tmp_path / "session_overhead.json"
    path.write_text(json.dumps(results))

    page = hooks.benchmarks_page(path)

    assert "| step time (ms) | Session, 2 ranks | 2.0 | 1.0 | 3.0 | 1.25x |" in page
    assert "| no-op round trip (us) | Session, 2 ranks | 2.0 | 1.0 | 3.0 | 2.50x |" in page


def test_benchmarks_page_without_results_file_says_how_to_make_one(hooks: ModuleType, tmp_path: Path) -> None:
    page = hooks.benchmarks_page(tmp_path / "missing.json")

    assert "No results yet" in page
    assert "--json benchmarks/results/session_overhead.json" in page


STATS = {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3, "missed": 0}
ENVIRONMENT = {"python": "3.11", "cpu": "cpu", "cpu_count": 2, "torch_threads": 2, "versions": {"torch": "2"}}


def _write(tmp_path: Path, name: str, payload: dict) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps({"environment": ENVIRONMENT, **payload}))
    return path


def test_peer_section_with_fake_results_shows_table_ratios_threads_and_deviations(
    hooks: ModuleType, tmp_path: Path
) -> None:
    missed = {"median": None, "min": 10.0, "max": 10.0, "n": 3, "missed": 2}
    row = {"step_ms": STATS, "steps_to_target": STATS, "seconds_to_target": STATS}
    path = _write(
        tmp_path,
        "trl_compare.json",
        {
            "quick": False,
            "seeds": [0, 1, 2],
            "max_steps": 1000,
            "target": 0.9,
            "summary": {"trl": {**row, "seconds_to_target": missed}, "rlsdk": row},
            "ratios": {"rlsdk_over_trl_seconds_to_target": None, "rlsdk_over_bare_step": 0.75},
            "threads": {"chosen": {"trl": 2, "bare": 1}, "rlsdk": {"num_ranks": 2, "threads_per_rank": 1}},
            "trl_deviations": ["optimizer: fused"],
        },
    )

    page = hooks.peer_section(path)

    assert "python benchmarks/trl_compare.py --json benchmarks/results/trl_compare.json" in page
    assert "| trl | 2.0 (1.0-3.0) | 2 (1-3) | miss (10.0-10.0), 2/3 missed |" in page
    assert "| rlsdk_over_bare_step | 0.75 | <= 1.5 |" in page
    assert "| rlsdk_over_trl_seconds_to_target | n/a (a median missed the target) | <= 0.5 |" in page
    assert "Threads: TRL 2, bare loop 1" in page and "- optimizer: fused" in page


def test_peer_section_without_results_file_says_how_to_make_one(hooks: ModuleType, tmp_path: Path) -> None:
    page = hooks.peer_section(tmp_path / "missing.json")

    assert "No results yet" in page and "benchmarks/trl_compare.py" in page


def test_async_section_with_fake_results_shows_both_modes_and_ratio(hooks: ModuleType, tmp_path: Path) -> None:
    by_mode = {"sequential": STATS, "async": STATS, "ratio_async_over_sequential": 0.8}
    path = _write(
        tmp_path,
        "async_rollouts.json",
        {
            "quick": True,
            "seeds": [0],
            "max_steps": 25,
            "target": 2.0,
            "summary": {
                "seconds_to_target": by_mode,
                "step_ms": by_mode,
                "final_moving_reward": by_mode,
                "missed": {"sequential": 1, "async": 0},
            },
        },
    )

    page = hooks.async_section(path)

    assert "## Async vs sequential rollouts (a `--quick` smoke run: not a measurement)" in page
    assert "| ms per step | 2.0 (1.0-3.0) | 2.0 (1.0-3.0) | 0.80 |" in page
    assert "sequential 1, async 0" in page


def test_scaling_section_with_fake_results_shows_sizes_exponents_and_ranks(hooks: ModuleType, tmp_path: Path) -> None:
    seconds = {"median": 0.002, "min": 0.001, "max": 0.003, "n": 3}
    size = {
        "name": "0.1M",
        "parameters": 132800,
        "update_s": seconds,
        "sync_s": seconds,
        "update_s_per_mparam": 0.015,
        "sync_bytes_per_s": 2.5e8,
    }
    path = _write(
        tmp_path,
        "scaling.json",
        {
            "quick": False,
            "model_sweep": {
                "num_ranks": 2,
                "prompts_per_step": 4,
                "group_size": 4,
                "max_new_tokens": 5,
                "sizes": [size, {**size, "name": "10M", "parameters": 10_000_000}],
                "exponents": [{"from": "0.1M", "to": "10M", "update": 0.5, "sync": 0.9}],
            },
            "rank_sweep": {
                "model": "0.1M",
                "prompts_per_step": 16,
                "group_size": 16,
                "micro_batch_size": 64,
                "baseline_ranks": 1,
                "ranks": [
                    {
                        "num_ranks": n,
                        "update_s": seconds,
                        "step_s": seconds,
                        "update_ratio_vs_1": r,
                        "step_ratio_vs_1": r,
                    }
                    for n, r in ((1, 1.0), (2, 0.6))
                ],
                "failed": {"4": "out of memory"},
            },
        },
    )

    page = hooks.scaling_section(path)

    assert "python benchmarks/scaling.py --json benchmarks/results/scaling.json" in page
    assert "| 0.1M | 132,800 | 2.0 (1.0-3.0) | 2.0 (1.0-3.0) | 15.00 | 250.0 |" in page
    assert "| 0.1M -> 10M | 0.50 | 0.90 |" in page
    assert "| 2 | 2.0 (1.0-3.0) | 2.0 (1.0-3.0) | 0.60 | 0.60 |" in page
    assert "4 rank(s): not measured" in page


def test_soak_section_with_fake_results_shows_growth_and_verdict(hooks: ModuleType, tmp_path: Path) -> None:
    figure = {"warmup": 100.0, "final": 101.0, "min": 99.0, "max": 102.0, "growth_pct": 1.0}
    path = _write(
        tmp_path,
        "soak.json",
        {
            "quick": False,
            "steps": 500,
            "seconds": 60.0,
            "sample_every": 10,
            "warmup_steps": 50,
            "figures": {"controller_rss_mib": figure},
            "passed": True,
            "failures": [],
            "baseline": {"controller_fds": 6},
            "after_close": {"children": 0, "controller_fds": 6, "surviving_ranks": []},
        },
    )

    page = hooks.soak_section(path)

    assert "python benchmarks/soak.py --json benchmarks/results/soak.json" in page
    assert "| controller_rss_mib | 100.0 | 101.0 | 99.0 | 102.0 | 1.0% |" in page
    assert "Passed" in page and "0 child processes" in page


def test_vllm_section_with_fake_results_shows_sync_and_rollout_ratio(hooks: ModuleType, tmp_path: Path) -> None:
    seconds = {"median": 0.01, "min": 0.009, "max": 0.02, "n": 3}
    path = _write(
        tmp_path,
        "vllm_sync.json",
        {
            "quick": True,
            "memcpy_bytes_per_s": 1e10,
            "sync": {
                "tiny": {"parameters": 1000, "sync_s": seconds, "achieved_bytes_per_s": 5e9, "fraction_of_memcpy": 0.5}
            },
            "rollout": {"raw_tokens_per_s": STATS, "session_tokens_per_s": STATS, "ratio": 0.95},
        },
    )

    page = hooks.vllm_section(path)

    assert "| tiny | 1,000 | 10.0 (9.0-20.0) | 5.000 | 50.0% |" in page
    assert "| ratio (target >= 0.9) | 0.95 |" in page


def test_benchmark_sections_without_results_files_are_empty(hooks: ModuleType, tmp_path: Path) -> None:
    for section in (hooks.async_section, hooks.scaling_section, hooks.soak_section, hooks.vllm_section):
        assert section(tmp_path / "missing.json") == ""


def test_benchmark_plots_are_embedded_only_when_the_png_exists(
    hooks: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hooks, "ROOT", tmp_path)
    assert hooks._plot("trl_compare.png", "bars") == []
    (tmp_path / "docs" / "img" / "benchmarks").mkdir(parents=True)
    (tmp_path / "docs" / "img" / "benchmarks" / "trl_compare.png").write_bytes(b"\x89PNG")

    assert hooks._plot("trl_compare.png", "bars") == ["![bars](img/benchmarks/trl_compare.png)", ""]


def test_shapes_section_with_fake_results_shows_rates_runs_skips_and_trl_ratio(
    hooks: ModuleType, tmp_path: Path
) -> None:
    measured = {
        "seconds": {"rollout": 10.0, "update": 20.0, "sync": 0.5},
        "peak_rss_mib": {"update": {"controller": 900.0, "rank0": 4096.0, "rank1": 3072.0}},
        "update_mfu": 0.41,
        "generation_tokens_per_s": 123.0,
        "rank_update_peak_over_derived": 1.1,
        "sync_over_memcpy": 0.25,
        "derived_rank_memory": {"total": 5.0 * 2**30, "adamw_states": 1.0 * 2**30},
        "steps": [{"peak_rss_mib": {"update": {"controller": 900.0, "rank0": 3072.0, "rank1": 2048.0}}}],
    }
    path = _write(
        tmp_path,
        "shapes.json",
        {
            "quick": False,
            "cpu": {"model": "cpu", "flags": {"avx512_bf16": True, "amx_bf16": False}},
            "rates": {"memcpy_bytes_per_s": 3e9, "gemm_flops_per_s": {"S2": {"fp32": 30e9, "bf16": 90e9}}},
            "shapes": {
                "S0": {"max_tokens_per_micro_batch": None},
                "S2": {"max_tokens_per_micro_batch": 1536, "keep_gathered": True},
            },
            "runs": {
                "S2-fsdp2-embedded-bf16": measured,
                "S2-ddp-embedded-bf16": {"skipped": "derived need 30.0 GiB > 20.0 GiB available"},
            },
            "trl": {"shape": "S1", "rlsdk_over_trl_step": {"embedded": 0.6}},
        },
    )

    page = hooks.shapes_section(path)

    assert "## Shape ladder" in page and "avx512_bf16; memcpy 3.00 GB/s" in page
    assert (
        "Settings: S0: micro-batches of `train.micro_batch_size` sequences, FSDP2 layers resharded after the forward; "
        "S2: micro-batches of 1536 tokens, FSDP2 layers kept gathered." in page
    )
    assert "| S2 | 30.0 | 90.0 |" in page
    # the first update (before AdamW has states) against the derived figure less those states: 3 GiB / 4 GiB
    assert "| S2-fsdp2-embedded-bf16 | 10.0 | 20.0 | 0.50 | 41.0% | 123 | 4.00 | 1.10x | 3.00 | 0.75x | 0.25 |" in page
    assert "| S2-ddp-embedded-bf16 | derived need 30.0 GiB > 20.0 GiB available |" in page
    assert "rlsdk (embedded engine, ddp) / TRL GRPOTrainer per-step time at S1: 0.60." in page
    data = json.loads(path.read_text())
    data["trl_by_shape"] = {
        "S1": data["trl"],
        "S2": {"shape": "S2", "rlsdk_over_trl_step": {"embedded": 0.8}, "rlsdk_runs": [{"parallelism": "fsdp2"}]},
    }
    path.write_text(json.dumps(data))
    page = hooks.shapes_section(path)
    assert page.index("ddp) / TRL GRPOTrainer per-step time at S1: 0.60.") < page.index(
        "rlsdk (embedded engine, fsdp2) / TRL GRPOTrainer per-step time at S2: 0.80."
    )
    data["trl_by_shape"]["S2"] = {"error": "TRL exit code -9"}
    path.write_text(json.dumps(data))
    assert "TRL GRPOTrainer beside rlsdk at S2: failed (TRL exit code -9)." in hooks.shapes_section(path)


def test_shapes_sections_without_the_full_ladder_show_each_partial_run_under_its_command(
    hooks: ModuleType, tmp_path: Path
) -> None:
    measured = {
        "seconds": {"rollout": 10.0, "update": 20.0, "sync": 0.5},
        "peak_rss_mib": {"update": {"rank0": 4096.0, "rank1": 3072.0}},
        "update_mfu": 0.41,
        "generation_tokens_per_s": 123.0,
        "rank_update_peak_over_derived": 1.1,
        "sync_over_memcpy": 0.25,
    }
    s2 = {"S2": {"max_tokens_per_micro_batch": 1536, "keep_gathered": True, "vllm_keep_gathered": False,
                 "fp32_max_tokens_per_micro_batch": 768, "fp32_keep_gathered": False}}  # fmt: skip
    for name, run, shapes in (("shapes_s1.json", "S1-fsdp2-embedded-bf16", {}),
                              ("shapes_s2.json", "S2-fsdp2-embedded-bf16", s2)):  # fmt: skip
        _write(tmp_path, name, {"quick": False, "command": f"python benchmarks/shapes.py --only {run}",
                                "shapes": shapes, "runs": {run: measured}})  # fmt: skip

    page = hooks.shapes_sections(tmp_path)

    assert page.index("## Shape ladder, part: `shapes_s1.json`") < page.index("## Shape ladder, part: `shapes_s2.json`")
    assert "`python benchmarks/shapes.py --only S1-fsdp2-embedded-bf16` (settings not recorded)" in page
    assert (
        "`python benchmarks/shapes.py --only S2-fsdp2-embedded-bf16` (S2: micro-batches of 1536 tokens, FSDP2 layers "
        "kept gathered (resharded with vLLM) (in float32: 768 tokens, resharded))" in page
    )
    assert "| S1-fsdp2-embedded-bf16 | 10.0 | 20.0 | 0.50 | 41.0% |" in page
    ladder = {"S1-fsdp2-embedded-bf16": measured, "S2-fsdp2-embedded-bf16": measured}
    _write(tmp_path, "shapes.json", {"quick": False, "runs": ladder, "trl_by_shape": {}})
    assert "part:" not in hooks.shapes_sections(tmp_path)  # the whole ladder, once run, replaces the parts
    trl_s2 = {"shape": "S2", "rlsdk_over_trl_step": {"embedded": 0.8}, "rlsdk_runs": [{"parallelism": "fsdp2"}]}
    _write(tmp_path, "shapes_trl_s2.json", {"quick": False, "command": "python benchmarks/shapes.py --trl-only",
                                             "runs": {}, "trl_by_shape": {"S2": trl_s2}})  # fmt: skip

    page = hooks.shapes_sections(tmp_path)

    # a part that measured what the whole ladder did not (TRL at S2) follows it; no empty runs table
    assert page.index("## Shape ladder\n") < page.index("## Shape ladder, part: `shapes_trl_s2.json`")
    assert page.count("## Shape ladder, part:") == 1 and page.count("| run | rollout (s)") == 1
    assert "rlsdk (embedded engine, fsdp2) / TRL GRPOTrainer per-step time at S2: 0.80." in page


def test_post_training_results_fill_the_marker_with_tables_intervals_and_significance(
    hooks: ModuleType, tmp_path: Path
) -> None:
    env = {"environment": {"python": "3.11", "cpu": "cpu", "cpu_count": 2, "versions": {"torch": "2"}}}
    greedy = {"sft_accuracy": 0.46, "rl_final_accuracy": 0.91, "gain": 0.45, "gain_25_at_step": 10}
    recipe = {**env, "quick": False, "runs": [
        {"seed": 0, "checks": {"sft_accuracy_in_range": True, "gain_at_least_0.25": True},
         "summary": {"greedy": greedy, "sft_seconds": 180.0, "rl_seconds": 120.0}}]}  # fmt: skip
    point = {"mean": 0.5, "ci95": 0.05, "n": 3}
    row = {"curve": [{"eval/pass@1": point}], "final": {"eval/pass@1": point}, "area": point}
    test = {"difference": {"mean": 0.1, "ci95": 0.02, "n": 3}, "p_value": 0.01, "significant": True}
    algorithms = {**env, "task": "reasoning", "steps": 60, "seeds": [0, 1, 2],
                  "summary": {"grpo": row, "rloo": {**row, "vs_grpo": {"final": test}}}}  # fmt: skip
    (tmp_path / "post_training.json").write_text(json.dumps(recipe))
    (tmp_path / "algorithms.json").write_text(json.dumps(algorithms))

    text = hooks.post_training_results(tmp_path, "../img/benchmarks")
    page = hooks.on_page_markdown(f"# Page\n\n{hooks.POST_TRAINING_MARKER}\n", None, None, None)

    assert "| 0 | 46.0% | 91.0% | +45.0 | 10 | 180 | 120 | all held |" in text
    assert "| rloo | 50.0% ± 5.0 | 50.0% ± 5.0 | 50.0% ± 5.0 | 10.0 points ± 2.0 | 0.010 | yes |" in text
    assert "(paired t-test over seeds, p < 0.05): rloo." in text
    assert "No results yet: `benchmarks/results/trl_post_training.json`" in text  # that file is absent here
    assert hooks.POST_TRAINING_MARKER not in page and "## The recipe from scratch" in page


def test_lora_results_fill_the_marker_with_accuracy_toy_and_sync_tables(hooks: ModuleType, tmp_path: Path) -> None:
    env = {"environment": {"python": "3.11", "cpu": "cpu", "cpu_count": 2, "versions": {"torch": "2"}}}
    point = {"mean": 0.95, "ci95": 0.02, "n": 3}
    test = {"difference": {"mean": 0.04, "ci95": 0.01, "n": 3}, "p_value": 0.01, "significant": True}
    row = {"start": point, "final": point, "plateau": point, "best": point, "reward": point}
    accuracy = {
        "steps": 150, "eval_every": 10, "plateau_evaluations": 5,
        "systems": {"full-lr0.0005": {"lr": 5e-4, "lora_rank": 0, "parameters": {"trained": 200, "total": 200}},
                    "lora-r1-lr0.0015": {"lr": 1.5e-3, "lora_rank": 1, "parameters": {"trained": 4, "total": 200}}},
        "summary": {"full-lr0.0005": {**row, "steps_to_0.9": [10, 20, None]},
                    "lora-r1-lr0.0015": {**row, "steps_to_0.9": [20, 20, 30], "vs_full": {"plateau": test}}},
        "head_probability_bound": {"seed0": {"random_init": 0.05, "after_sft": 0.9999}},
        "runs": {"full-lr0.0005": [{"seed": 0}], "lora-r1-lr0.0015": [{"seed": 0}]},
    }  # fmt: skip
    toy = {"final_moving_reward": [0.91], "best_moving_reward": [0.93], "steps_to_0.9": [250]}
    reverse = {"steps": 400, "systems": {"full": {"lr": 1e-3}}, "summary": {"full": toy},
               "head_probability_bound": {"seed0": 0.308}}  # fmt: skip
    ratios = {"sync_bytes": 0.1, "sync_s": 0.5, "rank_update_s": 0.9, "step_s": 0.95}
    sync = {"repeats": 3, "steps": 30, "results": {"0.1M/embedded": {
        "full": {"trained_parameters": 1000}, "lora": {"trained_parameters": 100},
        "ratios_lora_over_full": ratios}}}  # fmt: skip
    data = {**env, "quick": False, "command": "benchmarks/lora.py", "accuracy": accuracy, "reverse": reverse,
            "sync": sync}  # fmt: skip
    (tmp_path / "lora.json").write_text(json.dumps(data))

    text = hooks.lora_results(tmp_path / "lora.json", "../img/benchmarks")
    missing = hooks.lora_results(tmp_path / "absent.json", "../img/benchmarks")
    page = hooks.on_page_markdown(f"# Page\n\n{hooks.LORA_MARKER}\n", None, None, None)

    assert (
        "| lora-r1-lr0.0015 | 0.0015 | 4 (2.0%) | 95.0% ± 2.0 | 95.0% ± 2.0 | 95.0% ± 2.0 | 95.0% ± 2.0 | 0.950 | "
        "20, 20, 30 | +4.0 points ± 1.0 |" in text
    )
    assert "| full-lr0.0005 | 0.0005 | 200 (100.0%) |" in text and "10, 20, never |" in text
    assert "seed0: 0.050 at random init, 1.000 after SFT" in text
    assert "| full | 0.001 | 0.910 | 0.930 | 250 |" in text and "seed0 0.308" in text
    assert "| 0.1M/embedded | 1,000 | 100 | 0.1000 | 0.50 | 0.90 | 0.95 |" in text
    assert "No results yet: `benchmarks/results/absent.json`" in missing
    assert hooks.LORA_MARKER not in page and "### LoRA on the post-training recipe" in page


def test_decode_paths_section_shows_each_path_against_the_roofline_and_the_base(
    hooks: ModuleType, tmp_path: Path
) -> None:
    roof = {"achieved_step_s": 0.05, "step_bound_s": 0.02, "step_bound_kind": "memory", "fraction": 0.4}
    _write(tmp_path, "decode_paths_s1_bf16.json", {
        "shape": "S1", "new_tokens": 256, "dtype": "bfloat16", "compile_s": 42.0, "greedy_identical_to_base": True,
        "paths": {
            "base c336039": {"median_s": 20.0, "tokens_per_s": 800.0, "rollout_roofline": {**roof, "fraction": 0.2}},
            "this tree, eager": {"median_s": 10.0, "tokens_per_s": 1600.0, "rollout_roofline": roof},
        },
        "over_base": {"base c336039": 1.0, "this tree, eager": 0.5},
    })  # fmt: skip

    section = hooks.decode_paths_section(tmp_path)

    assert "## Decode paths against the roofline" in section
    assert (
        "| S1 x 256 tokens, bfloat16 | this tree, eager | 10.0 | 1600 | 0.50x | 50.0 | 20.0 (memory) | 40.0% | yes |"
        in section
    )
    assert "| compilation (once) | 42.0 |" in section
    assert hooks.decode_paths_section(tmp_path / "none") == ""
