"""``python -m rlsdk.compat check|update [--snapshot PATH]``: compare with, or rewrite, the committed snapshot."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from rlsdk.compat.diff import compare
from rlsdk.compat.surface import snapshot

DEFAULT_SNAPSHOT = "tests/compat/snapshot.json"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlsdk.compat", description=__doc__)
    parser.add_argument("command", choices=["check", "update"])
    parser.add_argument("--snapshot", default=DEFAULT_SNAPSHOT, help=f"snapshot file (default: {DEFAULT_SNAPSHOT})")
    args = parser.parse_args(argv)
    path = Path(args.snapshot)
    live = snapshot()
    if args.command == "update":
        if path.is_file():
            sys.stdout.write(compare(json.loads(path.read_text()), live).format() + "\n")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(live, indent=2, sort_keys=True) + "\n")
        sys.stdout.write(f"wrote {path}\n")
        return 0
    if not path.is_file():
        sys.stderr.write(f"no snapshot at {path}; create it with `python -m rlsdk.compat update`\n")
        return 1
    report = compare(json.loads(path.read_text()), live)
    sys.stdout.write(report.format() + "\n")
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
