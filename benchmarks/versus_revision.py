"""This tree against an earlier revision, interleaved: the no-op command round trip and the default recipe's step.

"No change in the performance figures" needs the old and the new code measured side by side, in one run, on the
same machine: a figure from another day, or from a run beside other load, cannot tell 5% apart. Each repetition
runs one fresh process per tree, alternating (base, this tree, base, ...); each process starts a Session of the
default recipe's shape (2 ranks, embedded engine; its ranks import the same tree, through ``PYTHONPATH``) and
measures, with that tree's own ``benchmarks/session_overhead.py`` functions:

- the no-op round trip: the median of ``--iterations`` ``session.call("noop")`` after a warm-up;
- the step: the median seconds of ``--steps`` rollout -> reward -> update -> sync steps after ``--warmup``.

Both trees train the same policy directory (built once) with the same seed. The ratio is this tree's figure over
the base's, pair by pair (a repetition's two processes run back to back, so machine drift mostly cancels); the
table gives the median ratio, its range, a bootstrap 95% interval of that median and a Wilcoxon signed-rank
p-value. The base tree comes from ``git archive REV`` into a temporary directory; its benchmarks must have
``session_config``, ``session_steps`` and ``session_noop_us`` (true since the session overhead benchmark exists).

Usage: ``python benchmarks/versus_revision.py --base REV [--reps 5] [--quick] [--json PATH]``. ``--quick``: 1
repetition of a few steps (a smoke test, not a measurement).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import print_table, write_json

ROOT = Path(__file__).resolve().parent.parent

# Runs inside each tree's process: that tree's rlsdk and its own benchmark functions.
_PROBE = """
import asyncio, json, statistics, sys
from pathlib import Path
sys.path.insert(0, str(Path(sys.argv[1]) / "benchmarks"))
import session_overhead as so
model_dir, out, steps, warmup, iterations = Path(sys.argv[2]), Path(sys.argv[3]), *map(int, sys.argv[4:7])
config = so.session_config(model_dir, out / "steps", 2, 0)
times = asyncio.run(so.session_steps(config, warmup + steps))[warmup:]
raw, noop = asyncio.run(so.session_noop_us(so.session_config(model_dir, out / "noop", 2, 0), iterations, 1, 10))
print("RESULT " + json.dumps({"step_s": statistics.median(times), "noop_us": noop[0]}))
"""


def unpack(revision: str, into: Path) -> Path:
    """The tree of ``revision`` (``git archive``) in ``into``."""
    archive = into / "tree.tar"
    subprocess.run(["git", "-C", str(ROOT), "archive", "-o", str(archive), revision], check=True)
    tree = into / "tree"
    with tarfile.open(archive) as handle:
        handle.extractall(tree, filter="data")
    return tree


def measure(tree: Path, model_dir: Path, out: Path, args: argparse.Namespace) -> dict[str, float]:
    """One process of ``tree``: its Session's median step seconds and no-op round-trip microseconds."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, "-c", _PROBE, str(tree), str(model_dir), str(out), str(args.steps), str(args.warmup),
           str(args.iterations)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True, timeout=1800)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{tree} failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def ratio_interval(ratios: list[float], resamples: int = 20_000) -> dict[str, float | None]:
    """Is the difference more than noise? A seeded bootstrap 95% interval of the median pair ratio, and the
    two-sided Wilcoxon signed-rank p-value of the log ratios (None without scipy, the ``bench`` extra's, or with
    fewer than 6 pairs); an interval holding 1.0 says the two trees cannot be told apart in this run."""
    import numpy as np

    logs = np.log(np.asarray(ratios, dtype=np.float64))
    rng = np.random.default_rng(0)
    medians = np.median(rng.choice(logs, size=(resamples, logs.size)), axis=1)
    low, high = np.exp(np.percentile(medians, [2.5, 97.5]))
    p_value = None
    if logs.size >= 6 and importlib.util.find_spec("scipy") is not None:
        from scipy import stats

        p_value = float(stats.wilcoxon(logs).pvalue)
    return {"ci95_low": float(low), "ci95_high": float(high), "wilcoxon_p": p_value}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the earlier revision (a commit, tag or branch)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.quick:
        args.reps, args.steps, args.warmup, args.iterations = 1, 3, 1, 20
    from rlsdk.data import build_tiny_policy

    base_rev = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", args.base], check=True, capture_output=True, text=True
    ).stdout.strip()
    figures: dict[str, list[dict[str, float]]] = {"base": [], "this": []}
    with tempfile.TemporaryDirectory(prefix="rlsdk-bench-versus-") as tmp:
        work = Path(tmp)
        base = unpack(base_rev, work)
        model_dir = build_tiny_policy(work / "model", seed=0)
        for rep in range(args.reps):
            for name, tree in (("base", base), ("this", ROOT)):
                out = work / f"{name}-{rep}"
                out.mkdir()
                figures[name].append(measure(tree, model_dir, out, args))
                print(f"rep {rep} {name}: {figures[name][-1]}", flush=True)
    results: dict[str, Any] = {"base": base_rev, "quick": args.quick, "reps": args.reps, "steps": args.steps,
                               "iterations": args.iterations, "runs": figures, "ratios": {}}  # fmt: skip
    for key, unit in (("noop_us", "us"), ("step_s", "s")):
        ratios = [this[key] / base[key] for base, this in zip(figures["base"], figures["this"])]
        results["ratios"][key] = {
            "median": statistics.median(ratios),
            "min": min(ratios),
            "max": max(ratios),
            **ratio_interval(ratios),
        }
        rows = []
        for name in ("base", "this"):
            values = [run[key] for run in figures[name]]
            rows.append({"name": f"{name} ({base_rev[:10] if name == 'base' else 'this tree'})",
                         "median": statistics.median(values), "min": min(values), "max": max(values),
                         "ratio": statistics.median(ratios) if name == "this" else None})  # fmt: skip
        print_table(f"{key}: this tree over {args.base}, pair by pair", rows, unit)
        spread = results["ratios"][key]
        p_text = "n/a" if spread["wilcoxon_p"] is None else f"{spread['wilcoxon_p']:.2f}"
        print(
            f"  median pair ratio 95% interval {spread['ci95_low']:.2f}-{spread['ci95_high']:.2f}, Wilcoxon p {p_text}"
        )
    write_json(args.json, results)


if __name__ == "__main__":
    main()
