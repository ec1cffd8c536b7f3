"""``rlsdk trace show OUTPUT_DIR [--json | --flight-recorder DIR]``: analyse saved traces offline."""

from __future__ import annotations

import argparse
import json
import pickle
import sys
from pathlib import Path

__all__ = ["add_trace_parser", "trace_command"]


def add_trace_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    trace = sub.add_parser("trace", help="analyse saved collective traces (hang reports)")
    actions = trace.add_subparsers(dest="trace_command", required=True)
    show = actions.add_parser(
        "show",
        help="print the first collective divergence of a saved report",
        description="Re-analyse OUTPUT/traces/<report>/rank_N.json (the newest report when given the output root).",
    )
    show.add_argument("path", help="an output root, or one OUTPUT/traces/<report> folder")
    show.add_argument("--json", action="store_true", help="print the report as JSON")
    show.add_argument(
        "--flight-recorder",
        metavar="DIR",
        help="also write Flight Recorder dumps (DIR/rank_N, pickled) for `python -m "
        "torch.distributed.flight_recorder.fr_trace -p rank_ DIR`",
    )


def trace_command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from rlsdk.debug.analyze import load_report, to_flight_recorder

    try:
        report = load_report(args.path)
    except (FileNotFoundError, ValueError) as exc:  # a bad input: say what and why, no traceback
        parser.exit(2, f"rlsdk trace show: error: {exc}\n")
    if args.flight_recorder:
        out = Path(args.flight_recorder)
        out.mkdir(parents=True, exist_ok=True)
        for rank, state in report.states.items():  # the analyser's layout: pickles named <prefix><rank>
            (out / f"rank_{rank}").write_bytes(pickle.dumps(to_flight_recorder(state)))
    sys.stdout.write((json.dumps(report.to_dict(), default=str, indent=1) if args.json else str(report)) + "\n")
    return 1 if report.divergence is not None and report.divergence.kind != "straggler" else 0
