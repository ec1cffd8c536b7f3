"""The tracer's root-cause verdicts on hard 4-rank divergences, repeated: the same right verdict every run?

Each pattern of ``tests/debug/_faults.py``'s ``ROOT_CAUSE_PATTERNS`` (a 2-D mesh TP{0,1}{2,3} x DP{0,2}{1,3}
whose waits cycle through three groups, an all-to-all with stale split sizes, async all-reduces issued in
another order in the mesh, a DDP-style bucket skipped where its size equals the next one's, a
``batch_isend_irecv`` ring with one reversed pair, and a clean mesh step with async ops) runs ``--runs`` times on
4 real traced gloo ranks through :func:`rlsdk.debug.harness.diagnose`. Per run it records the verdict (kind,
ranks, the diverging group's ranks, seq, certain, call sites), the seconds to the diagnosis and the latency from
the diverging call, and what is wrong with it. Per pattern: whether every run gave the same verdict, how many
verdicts were wrong, how many *certain* verdicts were wrong (must be 0), and the medians. Exit status 1 when any
run is wrong or a pattern's verdicts differ.

``--save-traces DIR`` writes the last run's rank states per pattern, sanitised (call sites as the fault module's
markers, no stacks, times from 0), as the fixtures ``tests/debug/traces/`` holds for the analyser's unit tests.

Usage: ``python benchmarks/root_cause_soak.py [--quick] [--runs 10] [--patterns a,b] [--json PATH]
[--save-traces DIR]`` (``--quick``: one run per pattern).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "debug"))  # the fault programs

import _faults
from _harness import write_json

from rlsdk.debug.harness import diagnose


def sanitize(states: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Rank states as a small, machine-independent fixture: call sites as ``_faults.py:MARKER`` (or the line
    number), no stacks, pids or wall times, times relative to the earliest call."""
    path = os.path.abspath(_faults.__file__)
    lines = Path(path).read_text().splitlines()

    def site(value: Any) -> Any:
        if not isinstance(value, str) or not value.startswith(path + ":"):
            return value
        number = int(value.rsplit(":", 1)[1])
        text = lines[number - 1]
        marker = text.split("# ", 1)[1].split(":")[0].split()[0] if "# " in text else ""
        return f"_faults.py:{marker}" if marker.endswith("_SITE") else f"_faults.py:{number}"

    starts = [rec["t_start"] for state in states.values() for rec in state.get("records", ())]
    base = min(starts, default=0.0)
    out = {}
    for rank, state in states.items():
        clean = {key: value for key, value in state.items() if key not in ("stacks", "pid", "wall_time")}
        if "now" in clean:
            clean["now"] = round(clean["now"] - base, 6)
        clean["errors"] = [str(error).split("\n")[0][:200] for error in clean.get("errors", ())]
        records = []
        for rec in state.get("records", ()):
            item = dict(rec, site=site(rec.get("site")), stack=[site(rec.get("site"))])
            item["t_start"] = round(rec["t_start"] - base, 6)
            if rec.get("t_end") is not None:
                item["t_end"] = round(rec["t_end"] - base, 6)
            records.append(item)
        clean["records"] = records
        out[str(rank)] = clean
    return out


ROOT = str(Path(__file__).resolve().parents[1]) + os.sep


def _relative(value: Any) -> Any:
    """A verdict's field as JSON, call sites relative to the repository."""
    if isinstance(value, tuple):
        return [_relative(item) for item in value]
    return value[len(ROOT) :] if isinstance(value, str) and value.startswith(ROOT) else value


def run_pattern(name: str, runs: int, save: Path | None) -> dict[str, Any]:
    rows = []
    for run in range(runs):
        result = diagnose(
            getattr(_faults, name), 4, within_s=4.0 if _faults.ROOT_CAUSE_PATTERNS[name] is None else 20.0
        )
        found = _faults.verdict(result.report)
        problems = _faults.root_cause_problems(name, result.report, result.seconds)
        if _faults.ROOT_CAUSE_PATTERNS[name] is None:
            problems = [p for p in problems if "diagnosed after" not in p]  # a clean run waits out within_s
        rows.append(
            {
                "run": run,
                "seconds": result.seconds,
                "latency_s": result.latency_s,
                "verdict": None if found is None else [_relative(v) for v in found],
                "certain": bool(result.report.divergence and result.report.divergence.certain),
                "problems": problems,
            }
        )
        print(f"  {name} run {run}: {result.seconds:.2f} s {found} {problems or 'ok'}", flush=True)
        if save is not None and run == runs - 1:
            save.mkdir(parents=True, exist_ok=True)
            (save / f"{name}.json").write_text(json.dumps(sanitize(result.report.states), indent=None) + "\n")
    verdicts = {json.dumps(row["verdict"]) for row in rows}
    seconds = [row["seconds"] for row in rows]
    latencies = [row["latency_s"] for row in rows if row["latency_s"] is not None]
    return {
        "runs": rows,
        "same_verdict_every_run": len(verdicts) == 1,
        "wrong": sum(bool(row["problems"]) for row in rows),
        "wrong_certain": sum(any("certain verdict that is wrong" in p for p in row["problems"]) for row in rows),
        "reports_on_clean": sum(row["verdict"] is not None for row in rows)
        if _faults.ROOT_CAUSE_PATTERNS[name] is None
        else None,
        "seconds": {"median": statistics.median(seconds), "max": max(seconds)},
        "latency_s": {"median": statistics.median(latencies), "max": max(latencies)} if latencies else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one run per pattern")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--patterns", default=",".join(_faults.ROOT_CAUSE_PATTERNS))
    parser.add_argument("--json", default=None)
    parser.add_argument("--save-traces", type=Path, default=None)
    args = parser.parse_args()
    runs = 1 if args.quick else args.runs
    names = [name for name in args.patterns.split(",") if name]
    unknown = sorted(set(names) - set(_faults.ROOT_CAUSE_PATTERNS))
    if unknown:
        parser.error(f"--patterns: unknown {unknown}; allowed: {sorted(_faults.ROOT_CAUSE_PATTERNS)}")
    started = time.monotonic()
    results = {}
    for name in names:
        results[name] = run_pattern(name, runs, args.save_traces)
    ok = all(r["wrong"] == 0 and r["same_verdict_every_run"] for r in results.values())
    print("\npattern                         runs  same  wrong  wrong-certain  median s  max s")
    for name, r in results.items():
        print(
            f"  {name:<30} {len(r['runs']):>4}  {'yes' if r['same_verdict_every_run'] else 'NO':>4}  {r['wrong']:>5}  "
            f"{r['wrong_certain']:>13}  {r['seconds']['median']:>8.2f}  {r['seconds']['max']:>5.2f}"
        )
    write_json(
        args.json,
        {
            "quick": args.quick,
            "runs_per_pattern": runs,
            "patterns": results,
            "ok": ok,
            "wall_s": time.monotonic() - started,
        },
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
