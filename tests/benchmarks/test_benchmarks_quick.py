"""Every benchmark's ``--quick`` variant runs end to end and writes its JSON (smoke tests: no speed thresholds).

One run per benchmark: ``python benchmarks/NAME.py --quick --json TMP/NAME.json`` must exit 0 and write the
environment block (versions, CPU, threads) and the benchmark's key figure. The seconds noted per case were measured
on 2 shared cores under a load average of 8-11 (all eight: 666 s); idle cores take roughly half.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"
VLLM_CONFTEST = Path(__file__).parents[1] / "engine" / "vllm" / "conftest.py"


def check_session_overhead(data: dict[str, Any]) -> None:
    assert data["step_ms"]["ratio"] > 0
    assert set(data["noop"]) == {"2"} and all(entry["ratio"] > 0 for entry in data["noop"].values())


def check_tracer_overhead(data: dict[str, Any]) -> None:
    assert data["record_us"]["median"] > 0 and data["ddp_step_ratio"] > 0
    assert data["recipe"]["ratio_of_medians"] > 0
    assert data["live_check"]["ratio_of_medians"] > 0
    assert data["poll_ms"]["next_poll"]["median"] < data["poll_ms"]["full_snapshot"]["median"]


def check_live_check_soak(data: dict[str, Any]) -> None:
    ran = {key.split("@")[0] for key in data["runs"]}
    assert {"embedded", "colocated", "fsdp2"} <= ran
    assert ran | set(data["skipped"]) == {"embedded", "colocated", "fsdp2", "vllm"}
    assert all(run["steps"] == 10 for run in data["runs"].values())
    assert data["false_reports"] == 0
    assert sum(run["poll_stats"]["polls"] for run in data["runs"].values()) > 0  # the stress setting polled


def check_root_cause_soak(data: dict[str, Any]) -> None:
    assert data["runs_per_pattern"] == 1 and len(data["patterns"]) == 6
    assert data["ok"] and all(entry["wrong_certain"] == 0 for entry in data["patterns"].values())


def check_dashboard_logs(data: dict[str, Any]) -> None:
    assert data["records"] == 1000 and data["displayed_per_s"] > 0
    assert data["lag_ms_p99"] >= 0


def check_vllm_sync(data: dict[str, Any]) -> None:
    assert data["memcpy_bytes_per_s"] > 0
    assert data["sync"]  # --quick: the tiny model only (one entry per transfer method, where there are several)
    for entry in data["sync"].values():
        assert entry["parameters"] > 0 and entry["achieved_bytes_per_s"] > 0
    assert data["rollout"]["ratio"] > 0


def check_async_rollouts(data: dict[str, Any]) -> None:
    assert {mode: len(runs) for mode, runs in data["runs"].items()} == {"sequential": 1, "async": 1}
    assert all(run["steps"] == 12 for runs in data["runs"].values() for run in runs)
    assert data["summary"]["step_ms"]["ratio_async_over_sequential"] > 0
    assert "tool_task" not in data  # opt-in: --tasks reverse tool


def check_algorithms(data: dict[str, Any]) -> None:
    assert data["task"] == "reasoning" and len(data["sft"]) == 1
    assert set(data["runs"]) == {"grpo", "dr_grpo", "dapo", "rloo", "reinforce_pp", "gspo"}
    for runs in data["runs"].values():
        (run,) = runs  # one seed
        assert [e["step"] for e in run["evaluations"]] == [0.0, 2.0]  # before the first step, then every 2
        assert all(0.0 <= e["eval/pass@1"] <= 1.0 for e in run["evaluations"])
    for row in data["summary"].values():
        assert [p["step"] for p in row["curve"]] == [0.0, 2.0] and row["final"]["eval/pass@1"]["n"] == 1
    assert data["summary"]["dr_grpo"]["vs_grpo"]["final"]["p_value"] is None  # one seed: no test


def check_post_training(data: dict[str, Any]) -> None:
    (run,) = data["runs"]
    greedy = run["summary"]["greedy"]
    assert 0.0 <= greedy["sft_accuracy"] <= 1.0 and 0.0 <= greedy["rl_final_accuracy"] <= 1.0
    assert [e["step"] for e in run["summary"]["rl"]["evaluations"]] == [0.0, 2.0, 4.0]
    assert set(run["checks"]) == {"sft_accuracy_in_range", "gain_at_least_0.25", "grpo_within_30_min"}
    assert run["process_seconds"] > run["summary"]["rl_seconds"] > 0


def check_trl_post_training(data: dict[str, Any]) -> None:
    assert [(run["system"], run["phase"]) for run in data["runs"]] == [
        ("rlsdk", "sft"), ("trl", "sft"), ("rlsdk", "grpo"), ("trl", "grpo")
    ]  # fmt: skip
    for run in data["runs"]:
        assert run["points"][0]["train_seconds"] == 0.0 or run["phase"] == "sft"
        assert all(0.0 <= p["accuracy"] <= 1.0 for p in run["points"])
    assert set(data["comparisons"]) == {"sft_seed0", "grpo_seed0"}
    assert data["environment"]["versions"]["trl"] and data["trl_deviations"]


def check_trl_compare(data: dict[str, Any]) -> None:
    assert [run["system"] for run in data["runs"]] == ["trl", "bare", "rlsdk", "rlsdk_async", "rlsdk_colocated"]
    for run in data["runs"]:
        assert run["steps_run"] == 5
        assert len(run["step_time_s"]) == len(run["reward_mean"]) == 5
        assert run["step_s_median"] > 0
        assert all(0.0 <= r <= 1.0 for r in run["reward_mean"])
    assert set(data["summary"]) == {"trl", "bare", "rlsdk", "rlsdk_async", "rlsdk_colocated"}
    assert data["ratios"]["rlsdk_over_bare_step"] > 0
    assert data["environment"]["versions"]["trl"]
    assert data["trl_settings"]["loss_type"] == "dapo"
    assert data["trl_deviations"]


def check_scaling(data: dict[str, Any]) -> None:
    (size,) = data["model_sweep"]["sizes"]  # --quick: the ~0.1M model only
    assert size["name"] == "0.1M" and size["parameters"] > 0
    assert size["update_s"]["median"] > 0 and size["sync_bytes_per_s"] > 0
    ranks = data["rank_sweep"]
    measured = {row["num_ranks"] for row in ranks["ranks"]} | {int(n) for n in ranks["failed"]}
    assert measured == {1, 2} and 2 in {row["num_ranks"] for row in ranks["ranks"]}


def check_soak(data: dict[str, Any]) -> None:
    assert data["steps"] == 30 and data["passed"] is True
    assert [row["step"] for row in data["samples"]] == list(range(31))  # step 0, then every step
    assert {"controller_rss_mib", "rank0_rss_mib", "rank1_rss_mib", "controller_fds", "children"} <= set(
        data["figures"]
    )
    assert data["after_close"]["children"] == 0 and data["after_close"]["surviving_ranks"] == []
    assert data["after_close"]["controller_fds"] <= data["baseline"]["controller_fds"]


def check_lora(data: dict[str, Any]) -> None:
    assert data["parts"] == ["accuracy", "reverse", "sync"]
    accuracy = data["accuracy"]  # --quick: 1 seed, full and one LoRA learning rate, 2 GRPO steps each
    assert list(accuracy["summary"]) == ["full-lr0.0005", "lora-r16-lr0.005"]
    assert all([e["step"] for e in run["evaluations"]] == [0.0, 2.0] for (run,) in accuracy["runs"].values())
    full_count, lora_count = (accuracy["systems"][name]["parameters"] for name in accuracy["summary"])
    assert 0 < lora_count["trained"] < full_count["trained"] == full_count["total"] == lora_count["total"]
    assert "vs_full" in accuracy["summary"]["lora-r16-lr0.005"]
    (bounds,) = accuracy["head_probability_bound"].values()
    assert bounds["random_init"] < 0.9  # the random-init model's head caps every token
    reverse = data["reverse"]
    assert len(reverse["systems"]) == 3 and all(len(runs[0]["rewards"]) == 3 for runs in reverse["runs"].values())
    assert all(bound < 0.9 for bound in reverse["head_probability_bound"].values())
    (entry,) = data["sync"]["results"].values()  # --quick: the 0.1M model on the embedded engine
    full, lora = entry["full"], entry["lora"]
    assert 0 < lora["sync_bytes"] < full["sync_bytes"]  # the sync moves only the adapter
    assert 0 < lora["trained_parameters"] < full["trained_parameters"] == full["parameters"]
    assert entry["ratios_lora_over_full"]["step_s"] > 0


def peft_missing() -> str | None:
    if importlib.util.find_spec("peft") is None:
        return 'peft is not installed (the lora extra: pip install -e ".[lora]")'
    return None


def check_shapes(data: dict[str, Any]) -> None:
    assert data["cpu"]["flags"] and data["rates"]["memcpy_bytes_per_s"] > 0
    assert data["rates"]["gemm_flops_per_s"]["S0"]["bf16"] > 0 and data["runtime_baseline_bytes"] > 0
    assert set(data["runs"]) == {"S0-ddp-embedded-fp32", "S0-fsdp2-embedded-bf16"}  # --quick: S0 only
    for row in data["runs"].values():
        assert all(row["seconds"][phase] > 0 for phase in ("rollout", "update", "sync"))
        assert {"controller", "rank0", "rank1"} <= set(row["peak_rss_mib"]["update"])
        assert row["update_mfu"] > 0 and row["sync_over_memcpy"] > 0 and row["generation_tokens_per_s"] > 0
        assert row["derived_rank_memory"]["total"] > 0 and row["rank_update_peak_over_derived"] > 0
        assert row["rollout_roofline"]["fraction"] > 0 and row["rollout_roofline"]["step_bound_s"] > 0
        assert row["update_bound_s"] > 0
    if data["trl"] is not None:  # trl installed: the interleaved comparison at S0
        assert data["trl"]["rlsdk_over_trl_step"]["embedded"] > 0


def trl_missing() -> str | None:
    if importlib.util.find_spec("trl") is None:
        return 'trl is not installed (the bench extra: pip install -e ".[bench]")'
    return None


def vllm_missing() -> str | None:
    """tests/engine/vllm/conftest.py's check (``import vllm`` in a subprocess), run only for this case."""
    spec = importlib.util.spec_from_file_location("rlsdk_tests_vllm_conftest", VLLM_CONFTEST)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    error = module.vllm_import_error()
    return None if error is None else f"vllm: `import vllm` failed ({error}); install the vllm extra"


SLOW = [pytest.mark.slow]
DISTRIBUTED = [pytest.mark.slow, pytest.mark.distributed]
# name: (key-figure check, marks, why it cannot run here or None)
CASES: dict[str, tuple[Callable[[dict[str, Any]], None], list[Any], Callable[[], str | None] | None]] = {
    "session_overhead": (check_session_overhead, DISTRIBUTED, None),  # 89 s: bare loop, 2 Sessions
    "tracer_overhead": (check_tracer_overhead, DISTRIBUTED, None),  # 70 s: gloo ranks, then 2 live Sessions
    "dashboard_logs": (check_dashboard_logs, [*SLOW, pytest.mark.notebook], None),  # 15 s: a real Jupyter kernel
    "vllm_sync": (check_vllm_sync, [*DISTRIBUTED, pytest.mark.vllm], vllm_missing),  # 181 s: 2 vLLM server starts
    "async_rollouts": (check_async_rollouts, DISTRIBUTED, None),  # 79 s at 25 steps (now 12): 2 Sessions
    "algorithms": (check_algorithms, DISTRIBUTED, None),  # an SFT Session, then 6 x 2 RL steps: every algorithm runs
    "post_training": (check_post_training, DISTRIBUTED, None),  # the recipe end to end: 2 Sessions, a few steps each
    "trl_post_training": (check_trl_post_training, DISTRIBUTED, trl_missing),  # 4 subprocesses, 2 of them Sessions
    "trl_compare": (check_trl_compare, DISTRIBUTED, trl_missing),  # 151 s: 4 subprocesses, two 2-rank Sessions
    "scaling": (check_scaling, DISTRIBUTED, None),  # 49 s: 3 Session starts (1 rank may not start: recorded)
    "soak": (check_soak, DISTRIBUTED, None),  # 32 s: a 2-rank Session for 30 steps
    "lora": (check_lora, DISTRIBUTED, peft_missing),  # 200 s: an SFT Session and 2 GRPO, 3 toy, 2 sync Sessions
    "live_check_soak": (check_live_check_soak, DISTRIBUTED, None),  # 290 s loaded (vLLM's start 190 s): 4 Sessions
    "shapes": (check_shapes, DISTRIBUTED, None),  # S0 Sessions (DDP, FSDP2), then TRL and rlsdk at S0
    "root_cause_soak": (check_root_cause_soak, DISTRIBUTED, None),  # 6 x 4 gloo ranks, one run each
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", [pytest.param(name, marks=marks, id=name) for name, (_, marks, _) in CASES.items()])
def test_benchmark_quick_exits_zero_and_writes_environment_and_key_figure(name: str, tmp_path: Path) -> None:
    check, _, missing = CASES[name]
    reason = missing() if missing is not None else None
    if reason is not None:
        pytest.skip(reason)
    out = tmp_path / f"{name}.json"

    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / f"{name}.py"), "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=540,
    )

    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert {"python", "versions", "cpu", "cpu_count", "torch_threads"} <= set(data["environment"])
    assert data["environment"]["versions"]["torch"]
    assert data["quick"] is True
    check(data)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_async_rollouts_quick_with_the_tool_task_runs_both_modes_through_the_slow_tool(tmp_path: Path) -> None:
    out = tmp_path / "async_rollouts.json"

    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "async_rollouts.py"), "--quick", "--tasks", "tool",
         "--tool-latency-ms", "5", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=540,
    )  # fmt: skip

    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    tool = data["tool_task"]
    assert "summary" not in data  # the default task did not run
    assert {mode: [run["steps"] for run in runs] for mode, runs in tool["runs"].items()} == {
        "sequential": [12],
        "async": [12],
    }
    assert tool["tool_latency_ms"] == 5.0 and tool["target_metric"] == "reward/answer"
    assert tool["summary"]["step_ms"]["ratio_async_over_sequential"] > 0


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_versus_revision_quick_measures_both_trees_and_writes_their_ratios(tmp_path: Path) -> None:
    out = tmp_path / "versus_revision.json"

    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "versus_revision.py"), "--base", "HEAD", "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=540,
    )

    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["quick"] is True and len(data["base"]) == 40
    for key in ("noop_us", "step_s"):
        assert all(run[key] > 0 for name in ("base", "this") for run in data["runs"][name])
        assert data["ratios"][key]["median"] > 0
