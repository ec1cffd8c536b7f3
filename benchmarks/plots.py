"""Plots of the benchmark results: PNGs for docs/benchmarks.md, drawn from the JSON files the benchmarks wrote.

Reads ``RESULTS/NAME.json`` (default ``benchmarks/results``) and writes, for each file that exists:

- ``scaling.json`` -> ``scaling_model.png`` (update and weight-sync seconds against parameters, log-log, min-max
  bars) and ``scaling_ranks.png`` (update and step time over the fewest ranks' time, against ranks);
- ``trl_compare.json`` -> ``trl_compare.png`` (seconds to the target reward and ms per step per system, median
  over seeds with min-max whiskers; misses are counted in the labels);
- ``async_rollouts.json`` -> ``async_rollouts.png`` (sequential against async: seconds to the target, ms per step);
- ``shapes.json`` -> ``shapes.png`` (per run of the shape ladder: update MFU against the 35% target, and each
  rank's peak memory during the timed updates over the first-principles figure, and during the first update over
  that figure less the AdamW states, which do not exist yet);
- ``algorithms.json`` (``--task reasoning``) -> ``algorithms.png`` (held-out accuracy of each algorithm against RL
  step and against training seconds, mean over seeds with its 95% interval as a band);
- ``post_training.json`` -> ``post_training.png`` (held-out accuracy through SFT, then GRPO, per seed);
- ``trl_post_training.json`` -> ``trl_post_training.png`` (held-out accuracy against training seconds, rlsdk and
  TRL, SFT and GRPO);
- ``lora.json`` (with its accuracy part) -> ``lora.png`` (held-out accuracy of each LoRA system and of full
  fine-tuning against GRPO step, mean over seeds).

The PNGs are committed artifacts made by ``make bench`` (which runs this last); the docs build only links them.
Needs matplotlib (the ``docs`` extra). Usage: ``python benchmarks/plots.py [--results DIR] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
OUT = ROOT / "docs" / "img" / "benchmarks"
SYSTEM_LABELS = {
    "trl": "TRL GRPOTrainer",
    "bare": "bare loop",
    "rlsdk": "rlsdk",
    "rlsdk_async": "rlsdk async",
    "rlsdk_colocated": "rlsdk colocated",
}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display, same output everywhere
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})  # no version string: PNGs diff only on data changes
    _pyplot().close(fig)
    return path


def _whiskers(stats: list[dict[str, Any]]) -> tuple[list[float], list[list[float]]]:
    """Medians and matplotlib's [below, above] error lengths from min/max; a missing value (a miss) plots as 0."""
    medians, below, above = [], [], []
    for s in stats:
        median, low, high = s.get("median") or 0.0, s.get("min"), s.get("max")
        medians.append(median)
        below.append(max(0.0, median - low) if low is not None else 0.0)
        above.append(max(0.0, high - median) if high is not None else 0.0)
    return medians, [below, above]


def _quick_note(data: dict[str, Any]) -> str:
    return "\n(--quick: a smoke run, not a measurement)" if data.get("quick") else ""


def plot_scaling(data: dict[str, Any], out: Path) -> list[Path]:
    plt = _pyplot()
    written = []
    sweep = data.get("model_sweep") or {}
    sizes = sweep.get("sizes") or []
    if sizes:
        fig, ax = plt.subplots(figsize=(6, 4))
        params = [row["parameters"] for row in sizes]
        for phase, label, marker in (("update_s", "update", "o"), ("sync_s", "sync_weights", "s")):
            medians, err = _whiskers([row[phase] for row in sizes])
            ax.errorbar(params, medians, yerr=err, marker=marker, capsize=3, label=label)
        for row in sizes:
            ax.annotate(row["name"], (row["parameters"], row["update_s"]["median"]), textcoords="offset points",
                        xytext=(4, 6), fontsize=8)  # fmt: skip
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("parameters")
        ax.set_ylabel("seconds (median)")
        ax.set_title(
            f"Time vs model size: {sweep.get('prompts_per_step')} prompts x {sweep.get('group_size')} samples, "
            f"{sweep.get('num_ranks')} ranks{_quick_note(data)}",
            fontsize=9,
        )
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        written.append(_save(fig, out / "scaling_model.png"))
    ranks = data.get("rank_sweep") or {}
    rows = ranks.get("ranks") or []
    if rows:
        base = ranks.get("baseline_ranks", rows[0]["num_ranks"])
        fig, ax = plt.subplots(figsize=(6, 4))
        counts = [row["num_ranks"] for row in rows]
        for key, label, marker in (("update", "update", "o"), ("step", "whole step", "s")):
            ax.plot(counts, [row[f"{key}_ratio_vs_{base}"] for row in rows], marker=marker, label=label)
        ax.plot(counts, [base / n for n in counts], linestyle="--", color="grey", label="ideal (time / ranks)")
        ax.set_xticks(counts)
        ax.set_xlabel("train ranks (1 torch thread each)")
        ax.set_ylabel(f"time / time at {base} rank(s)")
        ax.set_title(
            f"Rank scaling at a fixed global batch ({ranks.get('prompts_per_step')} x {ranks.get('group_size')}), "
            f"{data.get('environment', {}).get('cpu_count')} cores{_quick_note(data)}",
            fontsize=9,
        )
        ax.grid(True, alpha=0.3)
        ax.legend()
        written.append(_save(fig, out / "scaling_ranks.png"))
    return written


def plot_trl_compare(data: dict[str, Any], out: Path) -> list[Path]:
    plt = _pyplot()
    summary = data.get("summary") or {}
    systems = [s for s in SYSTEM_LABELS if s in summary]
    if not systems:
        return []
    fig, axes = plt.subplots(1, 2, figsize=(9, 4))
    for ax, key, unit in ((axes[0], "seconds_to_target", "seconds to target"), (axes[1], "step_ms", "ms per step")):
        stats = [summary[s][key] for s in systems]
        medians, err = _whiskers(stats)
        bars = ax.bar(range(len(systems)), medians, yerr=err, capsize=4, color="tab:blue")
        labels = []
        for system, s, bar in zip(systems, stats, bars):
            missed = s.get("missed") or 0
            labels.append(SYSTEM_LABELS[system] + (f"\n{missed}/{s.get('n')} missed" if missed else ""))
            if s.get("median") is None:
                bar.set_hatch("//")
                ax.annotate("median missed", (bar.get_x() + bar.get_width() / 2, 0), ha="center", va="bottom",
                            fontsize=8)  # fmt: skip
        ax.set_xticks(range(len(systems)), labels, fontsize=8)
        ax.set_ylabel(unit + " (median over seeds, min-max)")
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(
        f"Default task to moving reward {data.get('target')}, seeds {data.get('seeds')}{_quick_note(data)}",
        fontsize=10,
    )
    return [_save(fig, out / "trl_compare.png")]


def plot_async(data: dict[str, Any], out: Path) -> list[Path]:
    plt = _pyplot()
    summary = data.get("summary") or {}
    modes = ("sequential", "async")
    panels = [
        (k, u) for k, u in (("seconds_to_target", "seconds to target"), ("step_ms", "ms per step")) if k in summary
    ]
    if not panels:
        return []
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 4), squeeze=False)
    missed = summary.get("missed") or {}
    for ax, (key, unit) in zip(axes[0], panels):
        medians, err = _whiskers([summary[key][m] for m in modes])
        ax.bar(range(2), medians, yerr=err, capsize=4, color=["tab:grey", "tab:green"])
        labels = [m + (f"\n{missed[m]} missed" if missed.get(m) else "") for m in modes]
        ax.set_xticks(range(2), labels)
        ratio = summary[key].get("ratio_async_over_sequential")
        ax.set_title(f"async / sequential = {ratio:.2f}" if ratio else "", fontsize=9)
        ax.set_ylabel(unit + " (median over seeds, min-max)")
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"rollout.mode, seeds {data.get('seeds')}{_quick_note(data)}", fontsize=10)
    return [_save(fig, out / "async_rollouts.png")]


def first_update_peak(row: dict[str, Any]) -> tuple[float, float]:
    """A shape-ladder run's first update: its largest rank peak (bytes), and that peak over the derived figure less
    the AdamW states, which the first optimizer step creates after that update's backward; (0, 0) where not
    recorded. (Also the docs' table figure.)"""
    steps, derived = row.get("steps") or [], row.get("derived_rank_memory") or {}
    first = (steps[0].get("peak_rss_mib") or {}).get("update", {}) if steps else {}
    peak = max((v for k, v in first.items() if k.startswith("rank")), default=0.0) * 2**20
    before_adamw = derived.get("total", 0.0) - derived.get("adamw_states", 0.0)
    return peak, (peak / before_adamw if peak and before_adamw > 0 else 0.0)


def plot_shapes(data: dict[str, Any], out: Path) -> list[Path]:
    plt = _pyplot()
    runs = {name: row for name, row in (data.get("runs") or {}).items() if "update_mfu" in row}
    if not runs:
        return []
    names = list(runs)
    fig, axes = plt.subplots(1, 2, figsize=(10, 0.5 * len(names) + 1.8), sharey=True)
    axes[0].barh(range(len(names)), [runs[n]["update_mfu"] * 100 for n in names], color="tab:blue")
    axes[0].axvline(35, linestyle="--", color="grey")
    axes[0].set_xlabel("update MFU (% of the measured GEMM rate, same dtype)")
    rows = [i - 0.2 for i in range(len(names))]
    axes[1].barh(rows, [runs[n]["rank_update_peak_over_derived"] for n in names], height=0.4, color="tab:orange",
                 label="timed updates / derived")  # fmt: skip
    first = [first_update_peak(runs[n])[1] for n in names]
    axes[1].barh([i + 0.2 for i in range(len(names))], first, height=0.4, color="tab:green",
                 label="first update / derived less AdamW states")  # fmt: skip
    axes[1].axvline(1.3, linestyle="--", color="grey", label="1.3x derived")
    axes[1].set_xlabel("rank peak RSS during the update / derived")
    axes[1].set_ylim(-0.7, len(names) + 0.9)  # room above the top row for the legend
    axes[1].legend(fontsize=8, loc="upper right")
    axes[0].set_yticks(range(len(names)), names, fontsize=8)
    for ax in axes:
        ax.grid(True, axis="x", alpha=0.3)
    fig.suptitle(f"Shape ladder, 2 ranks{_quick_note(data)}", fontsize=10)
    return [_save(fig, out / "shapes.png")]


def plot_roofline(data: dict[str, Any], out: Path) -> list[Path]:
    """Each run's rollout (``rollout_roofline``) and update (its MFU) as a share of this machine's roofline."""
    plt = _pyplot()
    runs = {name: row for name, row in (data.get("runs") or {}).items() if row.get("rollout_roofline")}
    if not runs:
        return []
    names = list(runs)
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(names) + 1.8))
    ax.barh([i - 0.2 for i in range(len(names))], [runs[n]["rollout_roofline"]["fraction"] * 100 for n in names],
            height=0.4, color="tab:purple", label="rollout (decode and prefill bounds)")  # fmt: skip
    ax.barh([i + 0.2 for i in range(len(names))], [runs[n]["update_mfu"] * 100 for n in names], height=0.4,
            color="tab:blue", label="update (forward+backward FLOPs)")  # fmt: skip
    ax.axvline(50, linestyle="--", color="grey", label="50%")
    ax.set_xlabel("% of the roofline from this run's measured GEMM and memcpy rates")
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.set_ylim(-0.7, len(names) + 0.9)
    ax.legend(fontsize=8, loc="upper right")
    ax.grid(True, axis="x", alpha=0.3)
    fig.suptitle(f"Rollouts and updates against the roofline{_quick_note(data)}", fontsize=10)
    return [_save(fig, out / "roofline.png")]


def plot_decode_paths(files: list[dict[str, Any]], out: Path) -> list[Path]:
    """Each ``decode_profile.py --compare`` file's paths (base, this tree eager and compiled) as a share of the
    decode roofline of the same run."""
    if not files:
        return []
    plt = _pyplot()
    labels, shares = [], []
    for data in files:
        for name, row in data["paths"].items():
            labels.append(f"{data['shape']} {data['dtype']}: {name}")
            shares.append(row["rollout_roofline"]["fraction"] * 100)
    fig, ax = plt.subplots(figsize=(8, 0.4 * len(labels) + 1.5))
    ax.barh(range(len(labels)), shares, color="tab:purple")
    ax.axvline(50, linestyle="--", color="grey")
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.set_xlabel("% of the decode roofline (same run's GEMM and memcpy rates)")
    ax.grid(True, axis="x", alpha=0.3)
    fig.suptitle("The sampler alone: decode paths against the roofline", fontsize=10)
    return [_save(fig, out / "decode_paths.png")]


def plot_algorithms(data: dict[str, Any], out: Path) -> list[Path]:
    """Held-out greedy accuracy per algorithm vs step and vs training seconds: mean line, 95% interval band."""
    summary = data.get("summary") or {}
    if data.get("task") != "reasoning" or not summary:
        return []
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for name, row in summary.items():
        curve = row["curve"]
        means = [p["eval/pass@1"]["mean"] for p in curve]
        lows = [p["eval/pass@1"].get("low", p["eval/pass@1"]["mean"]) for p in curve]
        highs = [p["eval/pass@1"].get("high", p["eval/pass@1"]["mean"]) for p in curve]
        for ax, xs in ((axes[0], [p["step"] for p in curve]), (axes[1], [p["train_seconds"] for p in curve])):
            (line,) = ax.plot(xs, means, marker="o", markersize=3, label=name)
            ax.fill_between(xs, lows, highs, color=line.get_color(), alpha=0.15)
    axes[0].set_xlabel("RL step")
    axes[1].set_xlabel("training seconds (evaluation excluded)")
    axes[0].set_ylabel("held-out accuracy (greedy pass@1)")
    axes[0].set_ylim(0, 1)
    for ax in axes:
        ax.grid(True, alpha=0.3)
    axes[1].legend(fontsize=8, loc="lower right")
    fig.suptitle(
        f"From the same SFT checkpoint per seed, seeds {data.get('seeds')}: mean and 95% interval{_quick_note(data)}",
        fontsize=10,
    )
    return [_save(fig, out / "algorithms.png")]


def plot_post_training(data: dict[str, Any], out: Path) -> list[Path]:
    """Held-out greedy accuracy through SFT then GRPO, per seed, against training seconds."""
    runs = data.get("runs") or []
    if not runs:
        return []
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for run in runs:
        sft, rl = run["summary"]["sft"]["evaluations"], run["summary"]["rl"]["evaluations"]
        offset = run["summary"]["sft"]["train_seconds"]
        xs = [e["train_seconds"] for e in sft] + [offset + e["train_seconds"] for e in rl]
        (line,) = ax.plot(xs, [e["eval/pass@1"] for e in sft + rl], marker="o", markersize=3,
                          label=f"seed {run['seed']}")  # fmt: skip
        ax.axvline(offset, color=line.get_color(), linestyle=":", alpha=0.5)
    ax.set_xlabel("training seconds: SFT, then GRPO (dotted: where GRPO starts)")
    ax.set_ylabel("held-out accuracy (greedy pass@1)")
    ax.set_ylim(0, 1)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"recipes/sft_then_grpo.py{_quick_note(data)}", fontsize=10)
    return [_save(fig, out / "post_training.png")]


def plot_trl_post_training(data: dict[str, Any], out: Path) -> list[Path]:
    """Held-out accuracy vs training seconds for rlsdk and TRL, SFT and GRPO panels."""
    runs = data.get("runs") or []
    if not runs:
        return []
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    styles = {"rlsdk": "tab:blue", "trl": "tab:orange"}
    for run in runs:
        ax = axes[0 if run["phase"] == "sft" else 1]
        points = run["points"]
        ax.plot([p["train_seconds"] for p in points], [p["accuracy"] for p in points], marker="o", markersize=3,
                color=styles.get(run["system"]), alpha=0.8, label=f"{run['system']} seed {run['seed']}")  # fmt: skip
    for ax, title in zip(axes, ("SFT from the same random init", "GRPO from the same SFT checkpoint")):
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("training seconds (evaluation excluded)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("held-out accuracy (greedy pass@1)")
    axes[0].set_ylim(0, 1)
    fig.suptitle(f"rlsdk and TRL on the post-training task{_quick_note(data)}", fontsize=10)
    return [_save(fig, out / "trl_post_training.png")]


def plot_lora(data: dict[str, Any], out: Path) -> list[Path]:
    """Held-out greedy accuracy of each LoRA system and of full fine-tuning vs GRPO step: the mean over seeds."""
    runs = (data.get("accuracy") or {}).get("runs") or {}
    if not runs:
        return []
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, seeds in runs.items():
        steps = [e["step"] for e in seeds[0]["evaluations"]]
        means = [sum(run["evaluations"][i]["eval/pass@1"] for run in seeds) / len(seeds) for i in range(len(steps))]
        style = {"color": "black", "linewidth": 2} if name.startswith("full") else {}
        ax.plot(steps, means, marker="o", markersize=3, label=name, **style)
    ax.set_xlabel("GRPO step (from the same SFT checkpoint per seed)")
    ax.set_ylabel("held-out accuracy (greedy pass@1)")
    ax.set_ylim(0, 1)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    seeds = sorted({run["seed"] for seeds in runs.values() for run in seeds})
    ax.set_title(f"LoRA and full fine-tuning, mean over seeds {seeds}{_quick_note(data)}", fontsize=10)
    return [_save(fig, out / "lora.png")]


PLOTS: dict[str, Callable[[dict[str, Any], Path], list[Path]]] = {
    "scaling.json": plot_scaling,
    "trl_compare.json": plot_trl_compare,
    "async_rollouts.json": plot_async,
    "shapes.json": plot_shapes,
    "shapes_roofline.json": plot_roofline,
    "algorithms.json": plot_algorithms,
    "post_training.json": plot_post_training,
    "trl_post_training.json": plot_trl_post_training,
    "lora.json": plot_lora,
}


def make_plots(results: Path, out: Path) -> list[Path]:
    """Every plot whose JSON exists in ``results``; returns the PNGs written."""
    written: list[Path] = []
    for name, plot in PLOTS.items():
        path = results / name
        if path.is_file():
            written += plot(json.loads(path.read_text()), out)
        else:
            print(f"skipped {name}: not in {results}")
    written += plot_decode_paths([json.loads(p.read_text()) for p in sorted(results.glob("decode_paths_*.json"))], out)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder of the benchmarks' JSON files")
    parser.add_argument("--out", type=Path, default=OUT, help="folder for the PNGs")
    args = parser.parse_args()
    for path in make_plots(args.results, args.out):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
