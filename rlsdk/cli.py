"""``rlsdk`` command line: ``rlsdk run RECIPE.py [--section.field VALUE ...] [--config FILE.yaml]``,
``rlsdk promote NOTEBOOK.ipynb [-o recipes/NAME.py]`` and ``rlsdk checkpoint sign|verify DIR ...``.

A recipe is a Python file with ``config() -> SessionConfig`` (its defaults) and either ``async main(config)`` or a
reward function ``reward`` (then ``rlsdk run`` starts a Session and runs the library loop, ``Session.train``, with
it). The command-line flags are generated from the same config dataclasses (no parallel argparse for config
fields); ``--help`` lists where the recipe's values differ from the library defaults.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from rlsdk.observe.logging import get_logger

if TYPE_CHECKING:
    from rlsdk.config import SessionConfig
    from rlsdk.rewards.apply import RewardFn
    from rlsdk.train_loop import TrainSummary

logger = get_logger("rlsdk.cli")


def load_recipe(path: str) -> ModuleType:
    """Import a recipe file; raises ``FileNotFoundError``/``AttributeError`` naming what is missing."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"recipe {path!r} does not exist (expected a .py file with config() and main())")
    spec = importlib.util.spec_from_file_location(f"rlsdk_recipe_{file.stem}", file)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import recipe {path!r}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    if not callable(getattr(module, "config", None)):
        raise AttributeError(f"recipe {path!r} must define config() (config() -> SessionConfig)")
    if not callable(getattr(module, "main", None)) and not callable(getattr(module, "reward", None)):
        raise AttributeError(
            f"recipe {path!r} must define main() (async main(config)) or reward (a reward function that "
            "`rlsdk run` trains with through Session.train)"
        )
    return module


def run_recipe(path: str, args: Sequence[str]) -> object:
    from rlsdk.config import parse_cli

    recipe = load_recipe(path)
    config = parse_cli(recipe.config(), list(args), prog=f"rlsdk run {path}", description=recipe.__doc__)
    if callable(getattr(recipe, "main", None)):
        return asyncio.run(recipe.main(config))
    summary = asyncio.run(train_recipe(config, recipe.reward))
    logger.info("%s", summary.as_dict())
    return summary


async def train_recipe(config: SessionConfig, reward_fn: RewardFn) -> TrainSummary:
    """Start a Session for ``config``, train it with ``reward_fn`` (:meth:`Session.train` with the config's loop
    fields), close it: what ``rlsdk run`` does with a recipe that defines ``reward`` instead of ``main``."""
    from rlsdk.session import Session

    async with await Session.start(config) as session:
        return await session.train(reward_fn)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="rlsdk", description="rlsdk: interactive distributed RL post-training")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a recipe as a script", add_help=False)
    run.add_argument("recipe", help="path to a recipe .py file")
    promote = sub.add_parser(
        "promote",
        help="turn a notebook's cells tagged recipe / recipe:config / recipe:main into a recipe file",
        description="Write a recipe (config() + async main(config)) from the notebook's tagged cells; see "
        "docs/howto/promote-notebook.md for the tag convention.",
    )
    promote.add_argument("notebook", help="path to the .ipynb notebook")
    promote.add_argument("-o", "--output", help="recipe file to write (default: recipes/NOTEBOOK_NAME.py)")
    promote.add_argument("--force", action="store_true", help="overwrite the output file if it exists")
    checkpoint = sub.add_parser(
        "checkpoint",
        help="check a checkpoint, or trust one someone else wrote (sign it with your key)",
        description="A resume loads only checkpoints whose manifest is signed with your key "
        "(~/.cache/rlsdk/checkpoint.key); see docs/howto/checkpoints.md.",
    )
    actions = checkpoint.add_subparsers(dest="checkpoint_command", required=True)
    sign = actions.add_parser(
        "sign",
        help="trust a checkpoint: check its files against its manifest, then sign the manifest with your key",
        description="Use it for a checkpoint written by another user, on another machine, or by an rlsdk that "
        "did not sign checkpoints yet, once you know who wrote it: resuming runs code-bearing files from it.",
    )
    sign.add_argument("directories", nargs="+", metavar="DIR", help="step_N checkpoint directories")
    verify = actions.add_parser("verify", help="run the checks a resume runs, without loading anything")
    verify.add_argument("directories", nargs="+", metavar="DIR", help="step_N checkpoint directories")
    from rlsdk.debug.cli import add_trace_parser, trace_command

    add_trace_parser(sub)
    if len(argv) >= 1 and argv[0] == "run":
        known, rest = run.parse_known_args(argv[1:]) if len(argv) > 1 and not argv[1].startswith("-") else (None, None)
        if known is None:
            run.print_help()
            return 2
        from rlsdk.config import ConfigError

        try:
            run_recipe(known.recipe, rest)
        except (ConfigError, FileNotFoundError) as exc:  # a bad input: say what and why, no traceback
            parser.exit(2, f"rlsdk run: error: {exc}\n")
        return 0
    args = parser.parse_args(argv)
    if args.command == "trace":
        return trace_command(parser, args)
    if args.command == "promote":
        return promote_command(parser, args.notebook, args.output, force=args.force)
    if args.command == "checkpoint":
        return checkpoint_command(args.checkpoint_command, args.directories)
    return 0


def checkpoint_command(action: str, directories: Sequence[str]) -> int:
    """``rlsdk checkpoint sign|verify DIR ...``: 0 when every directory passed, else 1 (each failure on stderr)."""
    from rlsdk.engine.train.checkpoint import sign_checkpoint, verify_checkpoint
    from rlsdk.engine.train.checkpoint_signing import key_id, key_path, load_key

    failed = 0
    for directory in directories:
        try:
            if action == "sign":
                sign_checkpoint(directory)
                message = f"signed {directory} with your key {key_id(load_key())} ({key_path()})"
            else:
                files = verify_checkpoint(Path(directory))
                message = f"ok {directory}: {len(files)} files match the manifest signed with your key"
        except (ValueError, KeyError, TypeError, OSError) as exc:
            failed += 1
            sys.stderr.write(f"rlsdk checkpoint {action}: error: {directory}: {exc}\n")
            continue
        sys.stdout.write(message + "\n")
    return 1 if failed else 0


def promote_command(parser: argparse.ArgumentParser, notebook: str, output: str | None, *, force: bool) -> int:
    from rlsdk.notebook.promote import PromoteError, write_recipe

    target = output or str(Path("recipes") / f"{Path(notebook).stem}.py")
    try:
        written = write_recipe(notebook, target, force=force)
    except (PromoteError, FileNotFoundError) as exc:  # a bad input: say what and why, no traceback
        parser.exit(2, f"rlsdk promote: error: {exc}\n")
    sys.stderr.write(f"wrote {written}; run it with: rlsdk run {written}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
