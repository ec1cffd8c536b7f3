"""Docs are tests: every fenced block of README.md and docs/ runs as a reader would run it, or says why not.

A page's blocks run in order in one namespace and one work directory (see tests/docs/markdown_blocks.py for the
directives a page uses: fragment/skip with a reason, args for short settings, pytest, vllm, slow). The counts of
executed, text, fragment and skipped blocks, with the reasons, go into the skipped-suite report. Every dotted
flag a page shows must be a flag of `rlsdk run`, every repository path it names must exist, every relative link
must resolve inside the project.
"""

from __future__ import annotations

import importlib.util
from collections import Counter, defaultdict
from pathlib import Path

import pytest
from markdown_blocks import (
    ROOT,
    Block,
    DocsError,
    bash_commands,
    check_flags,
    check_links,
    check_paths,
    cli_flags,
    doc_pages,
    parse_page,
    prepare_workdir,
    run_page,
)

from rlsdk.testing.plugin import add_report_lines

PAGES = doc_pages()
FIXTURES = Path(__file__).parent / "fixtures"


def _page_param(page: Path) -> object:
    try:
        blocks = parse_page(page)
    except DocsError:  # the page's test raises it, naming the page and line
        blocks = []
    markers = sorted(set().union(*(b.markers for b in blocks if b.kind == "run")))
    marks = [getattr(pytest.mark, m) for m in markers]
    if "vllm" in markers or "slow" in markers:  # a vLLM server takes ~30-45 s to come up; slow pages run Sessions
        marks.append(pytest.mark.timeout(900))
    return pytest.param(page, id=str(page.relative_to(ROOT)), marks=marks)


@pytest.fixture(scope="module")
def tally(request: pytest.FixtureRequest) -> dict[str, list[Block]]:
    counts: dict[str, list[Block]] = defaultdict(list)
    yield counts
    report = docs_report(counts)
    if report:
        add_report_lines(request.config, report)


def docs_report(counts: dict[str, list[Block]]) -> list[str]:
    """Lines for the skipped-suite report: executed blocks by language, text blocks, and the blocks not run
    grouped by reason with their places."""
    if not any(counts.values()):
        return []
    ran = Counter(block.lang for block in counts["run"])
    lines = [
        f"Docs blocks: {len(counts['run'])} executed ("
        + ", ".join(f"{lang} {n}" for lang, n in sorted(ran.items()))
        + f"), {len(counts['text'])} text, {len(counts['fragment'])} fragments, {len(counts['skip'])} skipped:"
    ]
    for kind in ("fragment", "skip"):
        reasons: dict[str, list[str]] = defaultdict(list)
        for block in counts[kind]:
            reasons[getattr(block, kind)].append(block.where)
        for reason, where in sorted(reasons.items()):
            lines.append(f"- docs {kind}: {reason} ({len(where)}): {', '.join(where)}")
    return lines


@pytest.mark.parametrize("page", [_page_param(page) for page in PAGES])
def test_docs_page_blocks_run_in_order_as_a_reader_runs_them(
    page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tally: dict[str, list[Block]]
) -> None:
    blocks = parse_page(page)
    prepare_workdir(tmp_path)
    monkeypatch.chdir(tmp_path)

    run_page(blocks, tmp_path)

    for block in blocks:
        tally[block.kind].append(block)


def _hooks_generated() -> set[str]:
    spec = importlib.util.spec_from_file_location("rlsdk_docs_hooks_pages", ROOT / "docs" / "hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return set(module.generate_pages())


def test_docs_pages_name_only_real_flags_paths_and_links() -> None:
    flags, generated = cli_flags(), _hooks_generated()

    problems = [
        p for page in PAGES for p in (*check_flags(page, flags), *check_paths(page), *check_links(page, generated))
    ]

    assert not problems, "\n".join(problems)


def test_docs_broken_snippet_fails_naming_the_page_and_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    page = FIXTURES / "broken_page.md"
    blocks = parse_page(page)
    monkeypatch.chdir(tmp_path)

    with pytest.raises(DocsError) as info:
        run_page(blocks, tmp_path)

    message = str(info.value)
    assert message.startswith("tests/docs/fixtures/broken_page.md:18: python block failed")
    assert f'File "{page}", line 20' in message  # the traceback points into the page
    assert "ZeroDivisionError" in message


def test_docs_block_without_language_or_with_reasonless_skip_is_refused(tmp_path: Path) -> None:
    bare = tmp_path / "bare.md"
    bare.write_text("# Page\n\n```\nmake run\n```\n")
    reasonless = tmp_path / "reasonless.md"
    reasonless.write_text("<!-- docs: skip -->\n```bash\nmake run\n```\n")

    with pytest.raises(DocsError, match=r"bare.md:3: a fenced block needs a language"):
        parse_page(bare)
    with pytest.raises(DocsError, match=r"reasonless.md:2: `docs: skip` needs a reason"):
        parse_page(reasonless)


def test_docs_args_directive_appends_short_settings_to_rlsdk_run_commands_only(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- docs: args --train.max-steps 2 -->\n```bash\nrlsdk run recipes/grpo_reverse.py \\\n"
        "    --algorithm.name rloo  # RLOO\nrlsdk promote a.ipynb -o b.py\n```\n"
    )

    (block,) = parse_page(page)

    assert bash_commands(block) == [
        "rlsdk run recipes/grpo_reverse.py --algorithm.name rloo --train.max-steps 2  # RLOO",
        "rlsdk promote a.ipynb -o b.py",
    ]


def test_docs_static_checks_report_unknown_flag_missing_path_and_escaping_link(tmp_path: Path) -> None:
    (tmp_path / "docs" / "howto").mkdir(parents=True)
    (tmp_path / "docs" / "howto" / "vllm.md").write_text("# vLLM\n\n## Use it\n")
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "grpo_reverse.py").write_text("")
    page = tmp_path / "docs" / "page.md"
    page.write_text(
        "Run `rlsdk run recipes/grpo_reverse.py --train.lrr 1` on `rlsdk/no_such_module.py`.\n"
        "See [the plan](../../shared/ARCHITECTURE.md) and [vllm](howto/vllm.md#no-such-heading).\n"
        "[ok](howto/vllm.md#use-it), [generated](reference/config.md), `benchmarks/results/NAME.json`.\n"
    )

    problems = [
        *check_flags(page, cli_flags()),
        *check_paths(page, root=tmp_path),
        *check_links(page, {"reference/config.md"}, root=tmp_path),
    ]

    assert problems == [
        f"{page}:1: --train.lrr is not a flag of `rlsdk run`",
        f"{page}:1: rlsdk/no_such_module.py does not exist in the repository",
        f"{page}:2: link ../../shared/ARCHITECTURE.md leaves the project",
        f"{page}:2: link howto/vllm.md#no-such-heading: no heading #no-such-heading in docs/howto/vllm.md",
    ]
