"""rlsdk's estimators and losses against values and gradients recorded from TRL 1.16.0 and verl 0.9.1.

The fixtures (tests/algorithms/fixtures/, written by fixtures/regenerate.py, which documents how each reference is
called) hold fixed random inputs and, per case, the reference's outputs, the matching rlsdk options and the
``relation`` asserted here: ``equal`` (values and gradients to rounding), or a deliberate difference, each
checked exactly by a function below (``RELATIONS``). Nothing here recomputes a reference in rlsdk's conventions:
where a conversion is needed it is the documented one (population vs Bessel std, verl's token whitening, ...).
"""

from __future__ import annotations

import importlib.machinery
import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from _loss_options import policy_loss_with_options

from rlsdk.algorithms import compute_advantages, kl_penalty, token_entropy, token_logprobs

FIXTURES = Path(__file__).parent / "fixtures"
REFERENCES = ("trl", "verl")


def _load(stem: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(FIXTURES / f"{stem}.safetensors")


INPUTS = _load("inputs")
OUTPUTS = {name: _load(name) for name in REFERENCES}
CASES = [case for name in REFERENCES for case in json.loads((FIXTURES / f"{name}.json").read_text())["cases"]]


def _cases(kind: str) -> list[dict[str, Any]]:
    return [case for case in CASES if case["kind"] == kind]


def _ref(case: dict[str, Any], key: str) -> torch.Tensor:
    return OUTPUTS[case["name"].split("/")[0]][f"{case['name']}/{key}"]


def _tol(tensor: torch.Tensor) -> dict[str, float]:
    return {"rtol": 1e-10, "atol": 1e-12} if tensor.dtype == torch.float64 else {"rtol": 2e-6, "atol": 1e-6}


def _close(actual: torch.Tensor, expected: torch.Tensor, **tol: float) -> None:
    torch.testing.assert_close(actual, expected.to(actual.dtype), **(tol or _tol(actual)))


# ----------------------------------------------------------------------------------------------------- losses


def our_loss(
    prefix: str,
    opts: dict[str, Any],
    *,
    logprobs: torch.Tensor | None = None,
    rows: slice = slice(None),
    dtype: torch.dtype | None = None,
    **extra: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``policy_loss`` on the fixture inputs ``prefix/*`` (rows ``rows``, floats cast to ``dtype``) with the case's
    rlsdk options: ``(loss, d loss / d logprobs, d loss / d entropy)``; asserts the k1 warning exactly when due."""

    def get(name: str) -> torch.Tensor | None:
        value = INPUTS.get(f"{prefix}/{name}") if name != "logprobs" or logprobs is None else logprobs
        if value is None:
            return None
        return value[rows].to(dtype) if dtype is not None and value.is_floating_point() else value[rows]

    logprobs_B_C = get("logprobs").clone().requires_grad_(True)
    entropy_B_C = get("entropy")
    if entropy_B_C is not None:
        entropy_B_C = entropy_B_C.clone().requires_grad_(True)
    loss, _ = policy_loss_with_options(
        logprobs_B_C,
        get("old"),
        get("advantages"),
        get("mask"),
        opts,
        ref_logprobs_B_C=get("ref") if opts["kl_coef"] > 0 else None,
        entropy_B_C=entropy_B_C,
        behaviour_logprobs_B_C=get("behaviour") if opts["behaviour"] else None,
        **{"num_sequences": opts["num_sequences"], "max_len": opts["max_len"], **extra},
    )
    leaves = [logprobs_B_C] + ([entropy_B_C] if entropy_B_C is not None else [])
    found = torch.autograd.grad(loss, leaves, allow_unused=True)
    grad_e = found[1] if len(found) > 1 and found[1] is not None else torch.zeros_like(logprobs_B_C)
    return loss.detach(), found[0], grad_e


def _equal_loss(case: dict[str, Any]) -> None:
    loss, grad, grad_e = our_loss(case["inputs"], case["ours"])
    _close(loss, _ref(case, "loss"))
    _close(grad, _ref(case, "grad_logprobs"))
    _close(grad_e, _ref(case, "grad_entropy"))


def _trl_entropy_token_mean(case: dict[str, Any]) -> None:
    """TRL subtracts ``coef * token_mean(H)`` whatever the loss type; rlsdk aggregates H like the loss (here the
    per-sequence mean), so the losses differ by ``coef * (seq_mean(H) - token_mean(H))`` and only the entropy
    gradients differ: ``-coef / (|y_i| B)`` per token (rlsdk) against ``-coef / N`` (TRL)."""
    coef, mask = case["ours"]["entropy_coef"], INPUTS["batch/mask"].double()
    entropy = INPUTS["batch/entropy"]
    lengths = mask.sum(1, keepdim=True)
    per_token_seq = mask / lengths.clamp(min=1) / mask.shape[0]
    per_token_tok = mask / mask.sum()
    loss, grad, grad_e = our_loss("batch", case["ours"])
    seq_mean, token_mean = (entropy * per_token_seq).sum(), (entropy * per_token_tok).sum()
    _close(loss + coef * seq_mean - coef * token_mean, _ref(case, "loss"))
    assert not torch.isclose(loss, _ref(case, "loss"), rtol=1e-6, atol=0)  # the difference is real here
    _close(grad, _ref(case, "grad_logprobs"))
    _close(grad_e, -coef * per_token_seq)
    _close(_ref(case, "grad_entropy"), -coef * per_token_tok)


def _trl_overflows(case: dict[str, Any]) -> None:
    """TRL exponentiates the float32 log-ratio (and k3's ``ref - logp``) unguarded: at 89 its loss is inf and its
    gradient NaN. rlsdk's guard keeps both finite (their exact values: test_loss_guards.py)."""
    loss, grad, _ = our_loss(case["inputs"], case["ours"])
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert not (torch.isfinite(_ref(case, "loss")) and torch.isfinite(_ref(case, "grad_logprobs")).all())


def _verl_excludes_empty_sequences(case: dict[str, Any]) -> None:
    """verl's seq-mean without ``global_batch_size`` divides by the NON-EMPTY sequences; rlsdk by every sequence
    (an empty one still was a sample). Equal when rlsdk is given verl's count."""
    mask = INPUTS["batch/mask"]
    nonempty = float((mask.sum(1) > 0).sum())
    assert nonempty < mask.shape[0]
    loss, grad, _ = our_loss("batch", case["ours"], num_sequences=nonempty)
    _close(loss, _ref(case, "loss"))
    _close(grad, _ref(case, "grad_logprobs"))
    default_loss, _, _ = our_loss("batch", case["ours"])
    _close(default_loss * mask.shape[0], _ref(case, "loss") * nonempty)


def _verl_horizon_is_padded_width(case: dict[str, Any]) -> None:
    """verl's seq-mean-token-sum-norm without ``loss_scale_factor`` divides by this batch's padded width; rlsdk
    needs the generation limit ``max_len`` (Dr. GRPO's constant). Equal when given the width."""
    width = INPUTS["batch/mask"].shape[1]
    assert case["ours"]["max_len"] != width
    loss, grad, _ = our_loss("batch", case["ours"], max_len=width)
    _close(loss, _ref(case, "loss"))
    _close(grad, _ref(case, "grad_logprobs"))


def _verl_dual_clip(case: dict[str, Any]) -> None:
    """verl's default dual clip (c = 3, Ye et al. 2019) caps a negative-advantage token's loss at ``3 |A|`` with
    no gradient; rlsdk has no dual clip. Equal to rlsdk's loss with those tokens' ratio set to exactly 3 (in
    float64, so that the ratio is 3 to rounding; verl's float32 values to float32 rounding)."""
    logprobs, old = INPUTS["edge32/logprobs"].double(), INPUTS["edge32/old"].double()
    negative = (INPUTS["edge32/advantages"] < 0).unsqueeze(1)
    capped = negative & (logprobs - old > math.log(3.0))
    assert capped.any()
    at_three = torch.where(capped, old + math.log(3.0), logprobs)
    loss, grad, _ = our_loss("edge32", case["ours"], logprobs=at_three, dtype=torch.float64)
    float32 = {"rtol": 2e-6, "atol": 1e-6}
    _close(loss, _ref(case, "loss"), **float32)
    _close(grad[~capped], _ref(case, "grad_logprobs")[~capped], **float32)
    assert (_ref(case, "grad_logprobs")[capped] == 0).all()


def _verl_gspo_clamp_10(case: dict[str, Any]) -> None:
    """verl's GSPO clamps the sequence log-ratio at 10 (above only); rlsdk at +-20. Rows 0 and 1 (advantage -1,
    log-ratio 12 and 30) give ``s_i`` to the loss: verl ``e^10`` twice with no gradient; rlsdk ``e^12`` with
    gradient ``e^12 / (|y| B)`` per token, and ``e^20`` with none. Row 2 is ordinary and equal."""
    batch, width = INPUTS["gspo_edge/mask"].shape
    row2, grad2, _ = our_loss("gspo_edge", case["ours"], rows=slice(2, 3), num_sequences=float(batch))
    loss, grad, _ = our_loss("gspo_edge", case["ours"])
    _close(_ref(case, "loss"), torch.tensor((2 * math.exp(10.0)) / batch, dtype=torch.float64) + row2)
    _close(loss, torch.tensor((math.exp(12.0) + math.exp(20.0)) / batch, dtype=torch.float64) + row2)
    _close(_ref(case, "grad_logprobs")[:2], torch.zeros(2, width, dtype=torch.float64))
    _close(grad[0], torch.full((width,), math.exp(12.0) / (width * batch), dtype=torch.float64))
    _close(grad[1], torch.zeros(width, dtype=torch.float64))
    _close(grad[2:], grad2)
    _close(_ref(case, "grad_logprobs")[2:], grad2)


LOSS_RELATIONS: dict[str, Callable[[dict[str, Any]], None]] = {
    "equal": _equal_loss,
    "trl_entropy_token_mean": _trl_entropy_token_mean,
    "trl_overflows": _trl_overflows,
    "verl_excludes_empty_sequences": _verl_excludes_empty_sequences,
    "verl_horizon_is_padded_width": _verl_horizon_is_padded_width,
    "verl_dual_clip": _verl_dual_clip,
    "verl_gspo_clamp_10": _verl_gspo_clamp_10,
}


@pytest.mark.parametrize("case", _cases("loss"), ids=lambda c: c["name"])
def test_policy_loss_reference_fixture_values_and_gradients_match_or_differ_as_documented(case: dict) -> None:
    LOSS_RELATIONS[case["relation"]](case)


# ------------------------------------------------------------------------------------------------- advantages


def _our_advantages(case: dict[str, Any]) -> torch.Tensor:
    ours = case["ours"]
    return compute_advantages(
        INPUTS[case["inputs"]],
        case["group_size"],
        ours["estimator"],
        scale_by_std=ours.get("scale_by_std", True),
        eps=ours["eps"],
    )


def _centred(rewards: list[float], group_size: int, group_baseline: bool) -> list[float]:
    """Rewards minus their group mean (``group_baseline``) or batch mean, with ``math.fsum``."""
    size = group_size if group_baseline else len(rewards)
    out: list[float] = []
    for start in range(0, len(rewards), size):
        chunk = rewards[start : start + size]
        out += [r - math.fsum(chunk) / len(chunk) for r in chunk]
    return out


def _adv_equal(case: dict[str, Any]) -> None:
    _close(_our_advantages(case), _ref(case, "advantages"))


def _population_std(rewards: list[float], group_size: int) -> torch.Tensor:
    stds: list[float] = []
    for start in range(0, len(rewards), group_size):
        chunk = rewards[start : start + group_size]
        mean = math.fsum(chunk) / len(chunk)
        stds += [math.sqrt(math.fsum((r - mean) ** 2 for r in chunk) / len(chunk))] * len(chunk)
    return torch.tensor(stds, dtype=torch.float64)


def _bessel_std(case: dict[str, Any]) -> None:
    """TRL and verl divide by the Bessel-corrected group std (TRL with eps 1e-4, verl 1e-6), rlsdk by the
    population std ``s``: the reference's std is ``s sqrt(S / (S - 1))`` (to float32 rounding: TRL's ``nanstd``
    computes the factor ``count / (count - 1)`` in float32), the centred reward is ``A_ref (std_ref + eps_ref)``,
    and rlsdk's advantage is that over ``s + eps``."""
    size, ref = case["group_size"], _ref(case, "advantages")
    std_ref = _ref(case, "std")
    std_pop = _population_std(INPUTS[case["inputs"]].tolist(), size)
    _close(std_ref, std_pop * math.sqrt(size / (size - 1)), rtol=1e-7, atol=1e-12)
    centred = ref * (std_ref + case["reference"]["eps"])
    _close(_our_advantages(case), centred / (std_pop + case["ours"]["eps"]))
    assert not torch.allclose(_our_advantages(case), ref, rtol=1e-3, atol=0)


def _verl_lone_sample(case: dict[str, Any]) -> None:
    """verl gives a group of one sample mean 0 and std 1 (advantage ``r / (1 + eps)``, with ``1 + eps`` rounded
    to float32 by verl's float32 constants); rlsdk gives 0."""
    rewards = INPUTS[case["inputs"]]
    _close(_ref(case, "advantages"), rewards / (1 + 1e-6), rtol=1e-7, atol=0)
    _close(_our_advantages(case), torch.zeros_like(rewards), rtol=0, atol=0)


def _verl_whiten_tokens(case: dict[str, Any]) -> None:
    """verl whitens REINFORCE++ over response TOKENS (3 per sequence here, all valid, so each sequence weighs the
    same) with the Bessel-corrected variance over ``N`` tokens and ``rsqrt(var + 1e-8)``; rlsdk over sequences
    with the population std plus eps: ``A_ref = c / sqrt(var N / (N - 1) + 1e-8)``, ``A = c / (sqrt(var) + eps)``
    (to 1e-8 relative: verl's masked means divide by the token count plus 1e-8)."""
    rewards = INPUTS[case["inputs"]].tolist()
    if case["ours"]["estimator"] == "reinforce_pp_baseline":
        rewards = _centred(rewards, case["group_size"], group_baseline=True)
    centred = _centred(rewards, case["group_size"], group_baseline=False)
    var = math.fsum(c * c for c in centred) / len(centred)
    tokens = 3 * len(centred)
    ref = _ref(case, "advantages")
    c_B = torch.tensor(centred, dtype=torch.float64)
    _close(ref, c_B / math.sqrt(var * tokens / (tokens - 1) + 1e-8), rtol=1e-8, atol=1e-12)
    converted = ref * math.sqrt(var * tokens / (tokens - 1) + 1e-8) / (math.sqrt(var) + case["ours"]["eps"])
    _close(_our_advantages(case), converted, rtol=1e-8, atol=1e-12)


def _constant_groups(case: dict[str, Any]) -> None:
    """Constant float32 groups (0.1, 0.7, 1/3, 0.3, 0.9 x 16): rlsdk gives exactly 0; the references give ulp
    noise divided by a tiny std (verl GRPO: up to 0.056, issue 23's figure)."""
    _close(_our_advantages(case), torch.zeros(INPUTS[case["inputs"]].shape), rtol=0, atol=0)
    ref = _ref(case, "advantages")
    assert ref.abs().max() < 0.1
    assert (ref != 0).any()


ADVANTAGE_RELATIONS: dict[str, Callable[[dict[str, Any]], None]] = {
    "equal": _adv_equal,
    "bessel_std": _bessel_std,
    "verl_lone_sample": _verl_lone_sample,
    "verl_whiten_tokens": _verl_whiten_tokens,
    "constant_groups": _constant_groups,
}


@pytest.mark.parametrize("case", _cases("advantages"), ids=lambda c: c["name"])
def test_advantages_reference_fixture_values_match_or_differ_as_documented(case: dict) -> None:
    ADVANTAGE_RELATIONS[case["relation"]](case)


# ------------------------------------------------------------------------------------------- KL, log-probs


def _our_kl(case: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    logprobs = INPUTS[f"{case['inputs']}/logprobs"].clone().requires_grad_(True)
    kl = kl_penalty(logprobs, INPUTS[f"{case['inputs']}/ref"], case["ours"]["estimator"])
    (grad,) = torch.autograd.grad(kl.sum(), logprobs)
    return kl.detach(), grad


@pytest.mark.parametrize("case", _cases("kl"), ids=lambda c: c["name"])
def test_kl_penalty_reference_fixture_values_and_gradients_match_or_differ_as_documented(case: dict) -> None:
    kl, grad = _our_kl(case)
    if case["relation"] == "equal":
        _close(kl, _ref(case, "kl"))
        _close(grad, _ref(case, "grad_logprobs"))
        return
    # verl_k3_clamp: verl clamps log_r to +-20 and k3 to [-10, 10] (no gradient where either clamp acts); rlsdk
    # is exact up to log_r = 20 and linear beyond (slope e^20 - 1, so the gradient keeps pulling toward ref).
    assert case["relation"] == "verl_k3_clamp"
    limit = 20.0
    log_r = (INPUTS[f"{case['inputs']}/ref"] - INPUTS[f"{case['inputs']}/logprobs"]).flatten().tolist()

    def k3(x: float) -> float:
        return math.expm1(x) - x

    ours_kl = [k3(x) if x <= limit else k3(limit) + math.expm1(limit) * (x - limit) for x in log_r]
    ours_grad = [-math.expm1(min(x, limit)) for x in log_r]
    verl_kl = [min(k3(max(x, -limit) if x <= limit else limit), 10.0) for x in log_r]
    verl_grad = [-math.expm1(x) if abs(x) <= limit and k3(x) < 10.0 else 0.0 for x in log_r]
    as_tensor = lambda values: torch.tensor([values], dtype=torch.float64)  # noqa: E731
    _close(kl, as_tensor(ours_kl), rtol=1e-12, atol=1e-12)
    _close(grad, as_tensor(ours_grad), rtol=1e-12, atol=1e-12)
    _close(_ref(case, "kl"), as_tensor(verl_kl), rtol=1e-12, atol=1e-12)
    _close(_ref(case, "grad_logprobs"), as_tensor(verl_grad), rtol=1e-12, atol=1e-12)
    both_exact = torch.tensor([[abs(x) <= limit and k3(x) < 10.0 for x in log_r]])
    assert 0 < int(both_exact.sum()) < len(log_r)
    _close(kl[both_exact], _ref(case, "kl")[both_exact])


@pytest.mark.parametrize("case", _cases("token_logprobs") + _cases("token_entropy"), ids=lambda c: c["name"])
def test_token_logprobs_and_entropy_reference_fixture_values_and_gradients_match(case: dict) -> None:
    logits = INPUTS["logits/logits"].clone().requires_grad_(True)
    if case["kind"] == "token_logprobs":
        values = token_logprobs(logits, INPUTS["logits/tokens"])
    else:
        values = token_entropy(logits)
    (grad,) = torch.autograd.grad((values * INPUTS["logits/weights"].to(values.dtype)).sum(), logits)

    # rlsdk computes log-probs in float32 (by design, whatever the logits' dtype): float32 tolerances.
    _close(values.double(), _ref(case, "values"), rtol=1e-5, atol=1e-5)
    _close(grad.double(), _ref(case, "grad_logits"), rtol=1e-5, atol=1e-5)


def test_reference_fixtures_cover_every_preset_switch_and_both_references() -> None:
    loss_opts = [c["ours"] for c in _cases("loss")]
    assert {o["loss_agg"] for o in loss_opts} == {"token_mean", "seq_mean_token_mean", "seq_sum_fixed_len"}
    assert {o["ratio_level"] for o in loss_opts} == {"token", "sequence"}
    assert {o["kl_estimator"] for o in loss_opts if o["kl_coef"] > 0} == {"k1", "k2", "k3"}
    assert {o["is_cap_mode"] for o in loss_opts if o["behaviour"]} == {"truncate", "mask"}
    assert any(o["entropy_coef"] > 0 for o in loss_opts)
    estimators = {c["ours"]["estimator"] for c in _cases("advantages")}
    assert estimators == {"grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"}
    assert {c["name"].split("/")[0] for c in CASES} == set(REFERENCES)


# ----------------------------------------------------------------------------------------------- regeneration


def _verl_importable() -> bool:
    paths = [p for p in os.environ.get("RLSDK_VERL_PATH", "").split(os.pathsep) if p] + sys.path
    return importlib.machinery.PathFinder.find_spec("verl", paths) is not None


@pytest.mark.parametrize("reference", REFERENCES)
def test_regenerate_reproduces_committed_fixtures_byte_for_byte(reference: str, tmp_path: Path) -> None:
    if reference == "trl":
        trl = pytest.importorskip("trl", reason="trl is not installed (the `bench` extra): cannot regenerate")
        if trl.__version__ != "1.16.0":
            pytest.skip(f"trl {trl.__version__} is installed; the fixtures follow trl 1.16.0")
    elif not _verl_importable():
        pytest.skip("verl 0.9.1 is not importable: set RLSDK_VERL_PATH as fixtures/regenerate.py explains")

    subprocess.run(
        [sys.executable, str(FIXTURES / "regenerate.py"), "--out", str(tmp_path), "--only", reference],
        check=True,
        timeout=600,
        capture_output=True,
    )

    for name in ("inputs.safetensors", f"{reference}.json"):
        assert (tmp_path / name).read_bytes() == (FIXTURES / name).read_bytes(), name
    from safetensors.torch import load_file

    # The references' outputs: the same up to a few units in the last place. torch's vectorised kernels (AVX2,
    # AVX-512) round a reduction's last bit differently on different CPUs; a real change to the fixtures moves far
    # more than that, and the comparisons against rlsdk use their own (looser) tolerances.
    regenerated = load_file(tmp_path / f"{reference}.safetensors")
    committed = load_file(FIXTURES / f"{reference}.safetensors")
    assert regenerated.keys() == committed.keys()
    for key, tensor in committed.items():
        ulp = torch.finfo(tensor.dtype).eps if tensor.is_floating_point() else 0.0
        torch.testing.assert_close(
            regenerated[key], tensor, rtol=8 * ulp, atol=8 * ulp * float(tensor.nan_to_num().abs().max()),
            equal_nan=True, msg=key,
        )  # fmt: skip
