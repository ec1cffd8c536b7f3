"""The fenced blocks of the project's Markdown pages, run as a reader would run them (tests/docs/test_docs_run.py).

Every fenced block of README.md and docs/**.md is one of:

- **run**: ```` ```python ```` blocks of a page run in order in one namespace, as a reader pastes them into one
  notebook (top-level ``await`` works, on one event loop per page); ```` ```bash ```` blocks run each command line
  with bash in the page's work directory (the project's ``recipes/`` and ``notebooks/`` copied there, the venv's
  ``bin/`` first on ``PATH``); ```` ```yaml ```` blocks are loaded with ``rlsdk.config.load_config`` as a strict
  config (a partial one is applied on top of the defaults).
- **text**: ```` ```text ```` blocks (output, diagrams, formulas) hold nothing to run.
- **not run, with the reason**, by a directive on the line right before the fence:
  ``<!-- docs: fragment: REASON -->`` (code that needs context the page does not give: a signature, part of a
  file) or ``<!-- docs: skip: REASON -->`` (runnable, but not here: a GPU, a Slurm cluster, a long run).

Other directives, visible in the page's source where the block is:

- ``<!-- docs: args FLAGS -->``: FLAGS are appended to every ``rlsdk run`` command of the block (short settings,
  e.g. ``--train.max-steps 2``); the page shows the command as a user types it.
- ``<!-- docs: pytest -->``: the python block is a test file: it is written out and run by pytest.
- ``<!-- docs: vllm -->`` / ``<!-- docs: slow -->``: the page's test carries that pytest marker.

Several directives go in one comment, separated by ``;``. A block with any other language, or no language, is an
error: say what it is.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import os
import re
import shutil
import subprocess
import sys
import textwrap
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RUNNABLE = ("python", "bash", "yaml")
TEXT = ("text",)
_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
_DIRECTIVE = re.compile(r"^\s*<!--\s*docs:\s*(?P<body>.*?)\s*-->\s*$")


class DocsError(AssertionError):
    """A page's block failed, or a page breaks a rule; the message names the page and the line."""


@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    fragment: str | None = None
    skip: str | None = None
    args: list[str] = field(default_factory=list)
    pytest_file: bool = False
    markers: set[str] = field(default_factory=set)

    @property
    def where(self) -> str:
        return f"{_rel(self.page)}:{self.line}"

    @property
    def kind(self) -> str:
        """'fragment', 'skip', 'text' or 'run'."""
        if self.fragment is not None:
            return "fragment"
        if self.skip is not None:
            return "skip"
        return "text" if self.lang in TEXT else "run"


def doc_pages(root: Path = ROOT) -> list[Path]:
    """README.md and every page under docs/, in a stable order."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def parse_page(page: Path) -> list[Block]:
    """The fenced blocks of ``page`` with their directives.

    Raises:
        DocsError: a fence without a closing one, a block without a language or of an unknown one, a directive
            that is not understood, or a not-run directive without a reason.
    """
    lines = page.read_text(encoding="utf-8").split("\n")
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if match is None:
            i += 1
            continue
        fence, lang, indent = match["fence"], match["info"].strip().split(" ")[0], match["indent"]
        start = i
        end = next(
            (
                j
                for j in range(i + 1, len(lines))
                if lines[j].strip().startswith(fence) and not lines[j].strip()[len(fence) :]
            ),
            None,
        )
        if end is None:
            raise DocsError(f"{_rel(page)}:{start + 1}: a {fence} fence is never closed")
        code = textwrap.dedent(
            "\n".join(line[len(indent) :] if line.startswith(indent) else line for line in lines[start + 1 : end])
        )
        block = Block(page, start + 1, lang, code + "\n")
        if not lang:
            raise DocsError(f"{block.where}: a fenced block needs a language: {', '.join(RUNNABLE + TEXT)}")
        if lang not in RUNNABLE + TEXT:
            raise DocsError(f"{block.where}: block language {lang!r} is not one of {', '.join(RUNNABLE + TEXT)}")
        previous = lines[start - 1] if start > 0 else ""
        directive = _DIRECTIVE.match(previous)
        if directive is not None:
            _apply_directives(block, directive["body"])
        blocks.append(block)
        i = end + 1
    return blocks


def _apply_directives(block: Block, body: str) -> None:
    rest = body
    while rest:
        part, _, rest = rest.partition(";")
        part, rest = part.strip(), rest.strip()
        name, _, value = part.partition(" ")
        if name.rstrip(":") in ("fragment", "skip"):
            # The reason is the rest of the comment, ';' included: nothing may follow it.
            kind = name.rstrip(":")
            reason = f"{value.strip()}; {rest}" if rest else value.strip()
            if not name.endswith(":") or not reason:
                raise DocsError(f"{block.where}: `docs: {kind}` needs a reason: <!-- docs: {kind}: WHY -->")
            setattr(block, kind, reason)
            return
        if name == "args":
            block.args += value.split()
        elif name == "pytest" and not value:
            block.pytest_file = True
        elif name in ("vllm", "slow") and not value:
            block.markers.add(name)
        else:
            raise DocsError(
                f"{block.where}: unknown docs directive {part!r}: allowed fragment: WHY, skip: WHY, args FLAGS, "
                "pytest, vllm, slow"
            )


# ---------------------------------------------------------------------------------------------------- running
def prepare_workdir(workdir: Path, root: Path = ROOT) -> None:
    """A reader's checkout for one page: copies of ``recipes/`` and ``notebooks/`` (commands may write there)."""
    for name in ("recipes", "notebooks"):
        if (root / name).is_dir() and not (workdir / name).exists():
            shutil.copytree(root / name, workdir / name)


def run_page(blocks: list[Block], workdir: Path, *, timeout_s: float = 600.0) -> None:
    """Run the page's runnable blocks in order in ``workdir`` (the caller's current directory).

    Raises:
        DocsError: the first block that fails, naming the page and line, with the traceback or the command's
            output.
    """
    namespace: dict[str, Any] = {"__name__": "__docs__"}
    loop = asyncio.new_event_loop()
    try:
        for block in blocks:
            if block.kind != "run":
                continue
            if block.lang == "python" and block.pytest_file:
                _run_pytest_block(block, workdir, timeout_s)
            elif block.lang == "python":
                _run_python_block(block, namespace, loop)
            elif block.lang == "bash":
                _run_bash_block(block, workdir, timeout_s)
            elif block.lang == "yaml":
                _run_yaml_block(block, workdir)
    finally:
        _close_sessions(namespace, loop)
        loop.close()


def _run_python_block(block: Block, namespace: dict[str, Any], loop: asyncio.AbstractEventLoop) -> None:
    # Line numbers of a traceback are the page's: the code is compiled as if it started after the fence.
    source = "\n" * block.line + block.code
    try:
        code = compile(source, str(block.page), "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        result = eval(code, namespace)  # the project's own docs, run as a reader runs them
        if inspect.iscoroutine(result):
            loop.run_until_complete(result)
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):
            raise
        trace = "".join(traceback.format_exception(exc))
        raise DocsError(f"{block.where}: python block failed:\n{trace}") from None


def _run_pytest_block(block: Block, workdir: Path, timeout_s: float) -> None:
    test_file = workdir / f"test_docs_block_{block.line}.py"
    test_file.write_text(block.code, encoding="utf-8")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test_file)],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=_env(),
    )
    if proc.returncode != 0:
        raise DocsError(f"{block.where}: the block as a test file failed (pytest exit {proc.returncode}):\n"
                        f"{_tail(proc.stdout + proc.stderr)}")  # fmt: skip


def bash_commands(block: Block) -> list[str]:
    """The block's command lines (continuations joined, comments and blank lines dropped), with the block's
    ``args`` appended to every ``rlsdk run`` command."""
    commands: list[str] = []
    pending = ""
    for raw in block.code.split("\n"):
        line = raw.rstrip()
        if line.endswith("\\"):
            pending += (line[:-1].strip() if pending else line[:-1].rstrip()) + " "
            continue
        line = pending + (line.strip() if pending else line)
        pending = ""
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if block.args and re.match(r"\s*rlsdk\s+run\s", line):
            command, hash_, comment = line.partition("  #")
            line = command.rstrip() + " " + " ".join(block.args) + (f"  {hash_[2:]}{comment}" if hash_ else "")
        commands.append(line)
    return commands


def _run_bash_block(block: Block, workdir: Path, timeout_s: float) -> None:
    for command in bash_commands(block):
        proc = subprocess.run(
            ["bash", "-e", "-o", "pipefail", "-c", command],
            cwd=workdir,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=_env(),
        )
        if proc.returncode != 0:
            raise DocsError(
                f"{block.where}: `{command}` failed (exit {proc.returncode}):\n{_tail(proc.stdout + proc.stderr)}"
            )


def _run_yaml_block(block: Block, workdir: Path) -> None:
    from rlsdk.config import ConfigError, ModelConfig, SessionConfig, merge_overrides
    from rlsdk.config.io import read_yaml_mapping

    path = workdir / f"docs_block_{block.line}.yaml"
    path.write_text(block.code, encoding="utf-8")
    try:
        mapping = read_yaml_mapping(path)
        if "model" not in mapping:  # a partial config: on top of a default one
            merge_overrides(SessionConfig(model=ModelConfig(path="model")), mapping)
        else:
            merge_overrides(SessionConfig(model=ModelConfig(path=str(mapping["model"]["path"]))), mapping)
    except (ConfigError, ValueError, TypeError, KeyError) as exc:
        raise DocsError(f"{block.where}: yaml block is not a valid config: {exc}") from None


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _close_sessions(namespace: dict[str, Any], loop: asyncio.AbstractEventLoop) -> None:
    """Close every Session a page left open (a failed block, or a page that keeps one for the reader), after
    cancelling what a block left running in the loop: a timeout that interrupts ``Session.start`` leaves its task
    pending, and only cancelling it runs its cleanup (stopping the ranks and the inference server it started)."""
    from rlsdk import Session

    pending = [task for task in asyncio.all_tasks(loop) if not task.done()]
    for task in pending:
        task.cancel()
    if pending:
        try:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        except Exception:
            traceback.print_exc()
    for value in list(namespace.values()):
        if isinstance(value, Session) and not value._closed:
            try:
                loop.run_until_complete(value.close())
            except Exception:  # the page's own error is what the test reports
                traceback.print_exc()


# ---------------------------------------------------------------------------------------------------- static checks
_FLAG = re.compile(r"(?<![\w-])--([a-z][a-z0-9-]*(?:\.[a-z][a-z0-9-]*)+)")
_REPO_PATH = re.compile(r"(?<![\w./-])((?:rlsdk|tests|recipes|notebooks|benchmarks|docs|\.ci)/[\w./*{}-]*[\w/*}])")
_OUTPUT_ARG = re.compile(r"(?:-o|--out|--output|>)\s+$")
_HYPOTHETICAL = re.compile(r"<!--\s*docs:\s*hypothetical\s+(?P<names>.*?)\s*-->")
_LINK = re.compile(r"\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)\)")
_PLACEHOLDER = re.compile(r"(?:^|[/_.-])(?:[A-Z][A-Z0-9_]*)(?:$|[/_.-])")


def cli_flags(root: Path = ROOT) -> set[str]:
    """Every config flag of ``rlsdk run`` (tyro's names), booleans with their ``no-`` forms: SessionConfig's, and
    those a recipe adds when its ``config()`` returns a SessionConfig subclass with sections of its own (e.g.
    ``--sft.steps`` of recipes/sft_then_grpo.py)."""
    from rlsdk.cli import load_recipe
    from rlsdk.compat.surface import config_fields
    from rlsdk.config import SessionConfig
    from rlsdk.config.cli import bool_flags

    roots: list[type] = [SessionConfig]
    for recipe in sorted((root / "recipes").glob("*.py")):
        try:
            config = load_recipe(str(recipe)).config()
        except Exception:  # not a recipe (a helper module); its own tests report it
            continue
        if isinstance(config, SessionConfig) and type(config) is not SessionConfig:
            roots.append(type(config))
    flags: set[str] = set()
    for config_class in roots:
        flags |= {info.path.replace("_", "-") for info in config_fields(config_class) if not info.section}
        for flag in bool_flags(config_class):
            section, _, leaf = flag.rpartition(".")
            flags.add(f"{section}.no-{leaf}" if section else f"no-{leaf}")
    return flags


def _checked_lines(page: Path) -> tuple[list[tuple[int, str]], set[str]]:
    """The page's lines that name real things, with their numbers: not those of fragment and skip blocks (a
    user's own code), and the names the page declares hypothetical (``<!-- docs: hypothetical NAME ... -->``:
    e.g. the old name of a deprecation example)."""
    lines = page.read_text(encoding="utf-8").split("\n")
    ignored: set[int] = set()
    for block in parse_page(page):
        if block.kind in ("fragment", "skip"):
            ignored.update(range(block.line, block.line + block.code.count("\n") + 1))
    hypothetical = {name for m in _HYPOTHETICAL.finditer("\n".join(lines)) for name in m["names"].split()}
    return [(n, line) for n, line in enumerate(lines, start=1) if n not in ignored], hypothetical


def check_flags(page: Path, flags: set[str]) -> list[str]:
    """``page:line: --flag`` for every dotted flag in the page that ``rlsdk run`` does not have."""
    problems = []
    lines, hypothetical = _checked_lines(page)
    for number, line in lines:
        for match in _FLAG.finditer(line):
            if match[1] not in flags and match[0] not in hypothetical:
                problems.append(f"{_rel(page)}:{number}: --{match[1]} is not a flag of `rlsdk run`")
    return problems


def check_paths(page: Path, root: Path = ROOT) -> list[str]:
    """``page:line: path`` for every repository path the page names that does not exist (placeholders such as
    ``benchmarks/results/NAME.json``, globs, and what a command writes with ``-o PATH`` are not paths)."""
    problems = []
    lines, hypothetical = _checked_lines(page)
    written = {  # what the page's commands write: `rlsdk promote ... -o recipes/x.py`, then `rlsdk run recipes/x.py`
        match[1] for _, line in lines for match in _REPO_PATH.finditer(line)
        if _OUTPUT_ARG.search(line[: match.start()].replace("`", ""))
    }  # fmt: skip
    for number, line in lines:
        for match in _REPO_PATH.finditer(line):
            path = match[1].split("::")[0].rstrip(".")
            if any(c in path for c in "*{}<>") or _PLACEHOLDER.search(path.replace(".md", "").replace(".py", "")):
                continue
            if path in hypothetical or path in written:
                continue
            if not (root / path).exists():
                problems.append(f"{_rel(page)}:{number}: {path} does not exist in the repository")
    return problems


def check_links(page: Path, generated: set[str], root: Path = ROOT) -> list[str]:
    """``page:line: target`` for every relative link that leaves the project or names no file (pages that
    docs/hooks.py generates at build time count as files), or an anchor that names no heading."""
    problems = []
    text = page.read_text(encoding="utf-8")
    for number, line in enumerate(text.split("\n"), start=1):
        for match in _LINK.finditer(line):
            target = match[1]
            if re.match(r"^[a-z]+:", target):
                continue
            path_part, _, anchor = target.partition("#")
            resolved = (page.parent / path_part).resolve() if path_part else page.resolve()
            try:
                inside = resolved.relative_to(root)
            except ValueError:
                problems.append(f"{_rel(page)}:{number}: link {target} leaves the project")
                continue
            docs_rel = _docs_relative(resolved, root)
            if not resolved.exists() and docs_rel not in generated:
                problems.append(f"{_rel(page)}:{number}: link {target} names no file ({inside})")
                continue
            if anchor and resolved.suffix == ".md" and resolved.exists() and anchor not in heading_slugs(resolved):
                problems.append(f"{_rel(page)}:{number}: link {target}: no heading #{anchor} in {inside}")
    return problems


def _docs_relative(path: Path, root: Path) -> str | None:
    try:
        return str(path.relative_to(root / "docs"))
    except ValueError:
        return None


def heading_slugs(page: Path) -> set[str]:
    """The anchors mkdocs gives the page's headings (its default ``toc`` slugify)."""
    slugs = set()
    in_fence = False
    for line in page.read_text(encoding="utf-8").split("\n"):
        if _FENCE.match(line):
            in_fence = not in_fence
        if in_fence or not line.startswith("#"):
            continue
        title = line.lstrip("#").strip()
        slug = re.sub(r"[^\w\s-]", "", title).strip().lower()
        slugs.add(re.sub(r"[-\s]+", "-", slug))
    return slugs


def _rel(page: Path) -> str:
    try:
        return str(page.relative_to(ROOT))
    except ValueError:
        return str(page)
