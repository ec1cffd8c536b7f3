"""Mutation check for rlsdk/algorithms: every plausible single-line mistake below must fail tests/algorithms.

Each mutant replaces one line of ``rlsdk/algorithms/*.py`` in a SCRATCH COPY of the repository (a temporary
directory; the worktree is never touched), then runs ``pytest tests/algorithms -x`` there with ``PYTHONPATH``
and the working directory pointing at the copy (checked: ``import rlsdk`` must resolve inside it). A mutant is
*caught* when pytest fails, *survived* when it passes. The unmutated copy must pass first. Exit status 1 if any
mutant survived, a mutant's line was not found (the code moved: update the mutant), or pytest did not run.

Run from the repository root::

    PYTHONPATH=$PWD .venv/bin/python tests/tools/mutate.py            # all mutants (tens of minutes on 2 cores)
    PYTHONPATH=$PWD .venv/bin/python tests/tools/mutate.py --list     # names and lines, nothing run
    PYTHONPATH=$PWD .venv/bin/python tests/tools/mutate.py --only ratio-unclamped k3-slope-exp

``test_regenerate_reproduces_committed_fixtures_*`` is deselected: it regenerates the TRL/verl fixtures in a
subprocess, never imports rlsdk, so it cannot catch a mutant (and costs ~15 s each time).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ADV = "rlsdk/algorithms/advantages.py"
LOSS = "rlsdk/algorithms/losses.py"


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str
    old: str  # one whole source line (stripped); must occur exactly once in the file
    new: str  # its replacement, same indentation
    mistake: str


MUTANTS = [
    # ---- advantages
    Mutant("grpo-std-bessel", ADV, "std_G_1 = rewards_G_S.std(dim=1, unbiased=False, keepdim=True)",
           "std_G_1 = rewards_G_S.std(dim=1, unbiased=True, keepdim=True)", "Bessel std where population is meant"),
    Mutant("grpo-no-eps", ADV, "centred_G_S = centred_G_S / (std_G_1 + eps)", "centred_G_S = centred_G_S / std_G_1",
           "eps dropped from the std division"),
    Mutant("grpo-mean-wrong-dim", ADV, "centred_G_S = rewards_G_S - rewards_G_S.mean(dim=1, keepdim=True)",
           "centred_G_S = rewards_G_S - rewards_G_S.mean(dim=0, keepdim=True)", "mean over the wrong dim"),
    Mutant("grpo-no-constant-guard", ADV, "centred_G_S = torch.where(_constant_rows(rewards_G_S), 0.0, centred_G_S)",
           "centred_G_S = centred_G_S", "constant groups not zeroed (float64 rewards keep rounding noise)"),
    Mutant("stats-in-float32", ADV, "_STATS_DTYPE = torch.float64", "_STATS_DTYPE = torch.float32",
           "statistics in the rewards' float32 (near-constant groups lose their signs)"),
    Mutant("constant-rows-tolerance", ADV,
           "return values_G_S.amax(dim=1, keepdim=True) == values_G_S.amin(dim=1, keepdim=True)",
           "return (values_G_S.amax(dim=1, keepdim=True) - values_G_S.amin(dim=1, keepdim=True)) < 1e-6",
           "near-constant groups treated as constant"),
    Mutant("rloo-factor-off-by-one", ADV,
           "advantages_G_S = (rewards_G_S - rewards_G_S.mean(dim=1, keepdim=True)) * (group_size / (group_size - 1))",
           "advantages_G_S = (rewards_G_S - rewards_G_S.mean(dim=1, keepdim=True)) * (group_size / group_size)",
           "leave-one-out over S instead of S - 1"),
    Mutant("rloo-accepts-group-of-one", ADV, "if group_size < 2:", "if group_size < 1:",
           "RLOO with a lone sample (no baseline) allowed"),
    Mutant("rpp-baseline-skipped", ADV, "rewards_G_S = rewards_G_S - rewards_G_S.mean(dim=1, keepdim=True)",
           "rewards_G_S = rewards_G_S", "REINFORCE++-baseline without the group baseline"),
    Mutant("rpp-std-bessel", ADV, "advantages_G_S = centred_G_S / (centred_G_S.std(unbiased=False) + eps)",
           "advantages_G_S = centred_G_S / (centred_G_S.std(unbiased=True) + eps)", "Bessel batch std"),
    Mutant("rpp-no-batch-centring", ADV, "centred_G_S = rewards_G_S - rewards_G_S.mean()",
           "centred_G_S = rewards_G_S", "REINFORCE++ without the batch mean"),
    Mutant("rpp-baseline-guard-on-batch", ADV, "constant_G_1 = _constant_rows(rewards_B.view(-1, group_size))",
           "constant_G_1 = _constant_rows(rewards_B.view(1, -1))", "constant groups checked batch-wide"),
    Mutant("dispatch-ignores-scale-by-std", ADV,
           "return group_advantages(rewards_B, group_size, scale_by_std=scale_by_std, eps=eps)",
           "return group_advantages(rewards_B, group_size, scale_by_std=False, eps=eps)",
           "compute_advantages('grpo') never scales"),
    Mutant("dispatch-dr-grpo-scales", ADV,
           "return group_advantages(rewards_B, group_size, scale_by_std=False, eps=eps)",
           "return group_advantages(rewards_B, group_size, scale_by_std=True, eps=eps)",
           "Dr. GRPO divides by the std"),
    # ---- losses
    Mutant("clip-bounds-swapped", LOSS,
           "clipped_surrogate_B_C = ratio_B_C.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high) * advantages_B_1",
           "clipped_surrogate_B_C = ratio_B_C.clamp(1.0 - clip_eps_high, 1.0 + clip_eps_low) * advantages_B_1",
           "asymmetric clip bounds swapped"),
    Mutant("min-to-max", LOSS, "token_loss_B_C = -torch.minimum(surrogate_B_C, clipped_surrogate_B_C)",
           "token_loss_B_C = -torch.maximum(surrogate_B_C, clipped_surrogate_B_C)",
           "optimistic instead of pessimistic"),
    Mutant("pg-sign-flip", LOSS, "token_loss_B_C = -torch.minimum(surrogate_B_C, clipped_surrogate_B_C)",
           "token_loss_B_C = torch.minimum(surrogate_B_C, clipped_surrogate_B_C)", "objective maximised as a loss"),
    Mutant("ratio-detached", LOSS,
           "log_ratio_B_C = torch.where(mask_B_C, logprobs_B_C - old_logprobs_B_C.detach(), zero)",
           "log_ratio_B_C = torch.where(mask_B_C, logprobs_B_C.detach() - old_logprobs_B_C.detach(), zero)",
           "no gradient through the ratio"),
    Mutant("garbage-multiplied", LOSS,
           "log_ratio_B_C = torch.where(mask_B_C, logprobs_B_C - old_logprobs_B_C.detach(), zero)",
           "log_ratio_B_C = (logprobs_B_C - old_logprobs_B_C.detach()) * mask_B_C",
           "mask by multiplication (NaN/inf at padding leaks)"),
    Mutant("gspo-no-stop-gradient", LOSS,
           "log_ratio_B_C = seq_log_ratio_B_1.detach() + safe_logprobs_B_C - safe_logprobs_B_C.detach()",
           "log_ratio_B_C = seq_log_ratio_B_1 + safe_logprobs_B_C - safe_logprobs_B_C.detach()",
           "GSPO's sequence ratio not stop-gradiented"),
    Mutant("gspo-sum-not-mean", LOSS,
           "seq_log_ratio_B_1 = (log_ratio_B_C.sum(dim=1) / tokens_B.clamp(min=1.0)).unsqueeze(1)",
           "seq_log_ratio_B_1 = log_ratio_B_C.sum(dim=1).unsqueeze(1)", "sequence ratio not length-normalised"),
    Mutant("ratio-unclamped", LOSS, "ratio_B_C = log_ratio_B_C.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT).exp()",
           "ratio_B_C = log_ratio_B_C.exp()", "no overflow guard on the ratio"),
    Mutant("ratio-clamped-above-only", LOSS,
           "ratio_B_C = log_ratio_B_C.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT).exp()",
           "ratio_B_C = log_ratio_B_C.clamp(max=LOG_RATIO_LIMIT).exp()", "guard on the overflow side only"),
    Mutant("is-weight-unclamped", LOSS, "weight_B_C = log_w_B_C.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT).exp()",
           "weight_B_C = log_w_B_C.exp()", "importance weight overflows"),
    Mutant("is-weight-direction", LOSS,
           "behaviour_log_w_B_C = old_logprobs_B_C.detach() - behaviour_logprobs_B_C.detach()",
           "behaviour_log_w_B_C = behaviour_logprobs_B_C.detach() - old_logprobs_B_C.detach()",
           "importance weight inverted"),
    Mutant("mask-mode-truncates", LOSS, 'capped_value = is_cap if is_cap_mode == "truncate" else 0.0',
           "capped_value = is_cap", "decoupled mode truncates instead of dropping"),
    Mutant("mask-mode-multiplies", LOSS, "token_loss_B_C = torch.where(capped_B_C, zero, token_loss_B_C)",
           "token_loss_B_C = token_loss_B_C", "dropped token multiplied by 0 (0 * inf = NaN)"),
    Mutant("kl-direction", LOSS, "log_r_B_C = ref_logprobs_B_C.detach() - logprobs_B_C",
           "log_r_B_C = logprobs_B_C - ref_logprobs_B_C.detach()", "KL estimator of the other direction"),
    Mutant("k3-missing-minus-one", LOSS,
           "return torch.expm1(inside_B_C) - inside_B_C + math.expm1(LOG_RATIO_LIMIT) * beyond_B_C",
           "return torch.exp(inside_B_C) - inside_B_C + math.expm1(LOG_RATIO_LIMIT) * beyond_B_C",
           "k3 without its -1 (same gradient, wrong value)"),
    Mutant("k3-slope-exp", LOSS,
           "return torch.expm1(inside_B_C) - inside_B_C + math.expm1(LOG_RATIO_LIMIT) * beyond_B_C",
           "return torch.expm1(inside_B_C) - inside_B_C + math.exp(LOG_RATIO_LIMIT) * beyond_B_C",
           "linear continuation's slope e^L instead of e^L - 1"),
    Mutant("k3-boundary-double-gradient", LOSS,
           "beyond_B_C = torch.relu(log_r_B_C - LOG_RATIO_LIMIT)  # ...this one's does not, so it is counted once",
           "beyond_B_C = (log_r_B_C - LOG_RATIO_LIMIT).clamp(min=0.0)",
           "gradient counted twice at log_r = 20"),
    Mutant("k2-missing-half", LOSS, "return 0.5 * log_r_B_C * log_r_B_C", "return log_r_B_C * log_r_B_C",
           "k2 without its 1/2"),
    Mutant("kl-coef-dropped", LOSS, "token_loss_B_C = token_loss_B_C + kl_coef * kl_B_C",
           "token_loss_B_C = token_loss_B_C + kl_B_C", "KL weight ignored"),
    Mutant("entropy-sign", LOSS,
           "token_loss_B_C = token_loss_B_C - entropy_coef * torch.where(mask_B_C, entropy_B_C, zero)",
           "token_loss_B_C = token_loss_B_C + entropy_coef * torch.where(mask_B_C, entropy_B_C, zero)",
           "entropy penalised instead of rewarded"),
    Mutant("fixed-len-uses-width", LOSS, "loss = loss_sum / (sequences * max_len)",
           "loss = loss_sum / (sequences * shape_B_C[1])", "Dr. GRPO divides by the padded width"),
    Mutant("token-mean-counts-padding", LOSS,
           'loss = loss_sum / _normaliser("num_tokens", num_tokens, tokens.to(loss_sum.dtype).clamp(min=1.0), '
           "loss_sum)",
           'loss = loss_sum / _normaliser("num_tokens", num_tokens, loss_sum.new_tensor(float(mask_B_C.numel())), '
           "loss_sum)", "token mean over padded positions"),
    Mutant("seq-mean-no-length-normaliser", LOSS,
           "loss = (masked_loss_B_C.sum(dim=1) / tokens_B.clamp(min=1.0)).sum() / sequences",
           "loss = masked_loss_B_C.sum(dim=1).sum() / sequences", "sequence sum instead of sequence mean"),
    Mutant("empty-batch-divides-by-zero", LOSS,
           "default_sequences = loss_sum.new_tensor(float(max(shape_B_C[0], 1)))  # B = 0: loss 0, not 0 / 0",
           "default_sequences = loss_sum.new_tensor(float(shape_B_C[0]))", "empty batch gives 0 / 0"),
    Mutant("tensor-normaliser-sign-unchecked", LOSS, "if not 0 < float(value) < math.inf:",
           "if not float(value) != 0:", "negative 0-d tensor normaliser accepted"),
    Mutant("advantages-not-detached", LOSS,
           "advantages_B_1 = advantages_B.detach().to(logprobs_B_C.dtype).unsqueeze(1)",
           "advantages_B_1 = advantages_B.to(logprobs_B_C.dtype).unsqueeze(1)", "gradient flows into advantages"),
    Mutant("clipped-metric-counts-ties", LOSS, "clipped_B_C = (clipped_surrogate_B_C < surrogate_B_C) & mask_B_C",
           "clipped_B_C = (clipped_surrogate_B_C <= surrogate_B_C) & mask_B_C", "ties counted as clipped"),
    Mutant("k1-warning-lost", LOSS, 'if kl_coef > 0 and kl_estimator == "k1":',
           'if kl_coef > 0 and kl_estimator == "k2":', "the k1 warning fires for the wrong estimator"),
]  # fmt: skip


def _apply(source: str, mutant: Mutant) -> str:
    lines = source.splitlines(keepends=True)
    hits = [i for i, line in enumerate(lines) if line.strip() == mutant.old]
    if len(hits) != 1:
        raise LookupError(f"{mutant.name}: line {mutant.old!r} found {len(hits)} times in {mutant.path}")
    line = lines[hits[0]]
    indent = line[: len(line) - len(line.lstrip())]
    lines[hits[0]] = indent + mutant.new + "\n"
    return "".join(lines)


def _line_number(mutant: Mutant) -> int:
    for number, line in enumerate((ROOT / mutant.path).read_text().splitlines(), start=1):
        if line.strip() == mutant.old:
            return number
    return 0


def _copy_repo(scratch: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    shutil.copytree(ROOT / "rlsdk", scratch / "rlsdk", ignore=ignore)
    (scratch / "tests").mkdir()
    shutil.copy2(ROOT / "tests" / "conftest.py", scratch / "tests" / "conftest.py")
    shutil.copytree(ROOT / "tests" / "algorithms", scratch / "tests" / "algorithms", ignore=ignore)
    shutil.copy2(ROOT / "pyproject.toml", scratch / "pyproject.toml")


def _env(scratch: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(scratch)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def _pytest(scratch: Path, timeout: float) -> tuple[int, str]:
    command = [sys.executable, "-m", "pytest", "tests/algorithms", "-x", "-q", "-p", "no:cacheprovider",
               "-k", "not regenerate_reproduces"]  # fmt: skip
    try:
        done = subprocess.run(command, cwd=scratch, env=_env(scratch), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return -1, "timed out"
    lines = [line for line in done.stdout.splitlines() if line.startswith("FAILED") or " passed" in line]
    return done.returncode, (lines[0] if lines else done.stdout[-300:]).strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these mutants")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per pytest run")
    args = parser.parse_args(argv)
    mutants = [m for m in MUTANTS if not args.only or m.name in args.only]
    if args.only and len(mutants) != len(set(args.only)):
        unknown = set(args.only) - {m.name for m in MUTANTS}
        parser.error(f"unknown mutants: {sorted(unknown)}")
    if args.list:
        for m in mutants:
            print(f"{m.name:34s} {m.path}:{_line_number(m):<4d} {m.mistake}")
        return 0

    # SIGTERM unwinds like Ctrl-C: subprocess.run kills the running pytest and the scratch copy is removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory(prefix="rlsdk-mutate-") as tmp:
        scratch = Path(tmp)
        _copy_repo(scratch)
        probe = [sys.executable, "-c", "import rlsdk; print(rlsdk.__file__)"]
        found = subprocess.run(probe, cwd=scratch, env=_env(scratch), capture_output=True, text=True, check=True)
        where = found.stdout.strip()
        if not Path(where).resolve().is_relative_to(scratch.resolve()):
            print(f"rlsdk imports from {where}, not from the scratch copy {scratch}: refusing to run")
            return 1
        rc, summary = _pytest(scratch, args.timeout)
        if rc != 0:
            print(f"the UNMUTATED copy does not pass tests/algorithms (rc={rc}): {summary}")
            return 1
        print(f"baseline (unmutated): {summary}\n")
        print(f"{'mutant':34s} {'where':34s} {'result':9s} {'s':>5s}  first failing test / note")
        failures = 0
        for m in mutants:
            target = scratch / m.path
            original = target.read_text()
            try:
                target.write_text(_apply(original, m))
            except LookupError as error:
                print(f"{m.name:34s} {m.path:34s} {'NOT FOUND':9s} {'':>5s}  {error}")
                failures += 1
                continue
            start = time.monotonic()
            try:
                rc, summary = _pytest(scratch, args.timeout)
            finally:
                target.write_text(original)
            result = {0: "SURVIVED", 1: "caught"}.get(rc, f"ERROR {rc}")
            failures += result != "caught"
            where = f"{m.path}:{_line_number(m)}"
            print(f"{m.name:34s} {where:34s} {result:9s} {time.monotonic() - start:5.0f}  {summary[:110]}", flush=True)
        caught = len(mutants) - failures
        print(f"\n{caught}/{len(mutants)} mutants caught" + ("" if failures == 0 else f"; {failures} NOT caught"))
        return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
