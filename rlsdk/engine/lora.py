"""LoRA adapters (``peft``) shared by the train and inference engines: build, publish, read, load, checksum.

With ``train.lora_rank > 0`` the ranks train LoRA adapters on frozen base weights, and a weight sync moves only
the adapter: the trainer publishes it as a peft adapter directory (``adapter_config.json`` +
``adapter_model.safetensors``, what ``PeftModel.save_pretrained`` writes and vLLM's ``/v1/load_lora_adapter``
reads) under ``publish_dir/v{version}/``, and the engine loads it onto the base weights it loaded from
``model.path``. The checksum of a LoRA run is :func:`~rlsdk.engine.weights.state_dict_checksum` of the adapter
tensors under peft's saved names (``base_model.model.<module>.lora_A.weight``, ...): the trainer hashes what it
publishes, the engine what it loaded.

Why a new directory per version (not a file rewritten in place as for full weights): an adapter is small, and
vLLM reads the adapter directory itself; a directory that never changes once renamed into place guarantees that
the bytes vLLM loaded are the bytes its worker hashed. Requires ``peft`` (the ``lora`` extra), imported inside
the functions that need it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import weakref
from pathlib import Path
from typing import Any

import torch

from rlsdk.engine.weights import state_dict_checksum
from rlsdk.observe.logging import get_logger

logger = get_logger(__name__)

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
# Below this bound on any token's probability, the adapters cannot make the policy confident: a completion of n
# tokens the policy should always write is sampled at most HEAD_PROBABILITY_FLOOR ** n of the time (0.35 for 10
# tokens). A pretrained model's head allows probabilities within float rounding of 1.
HEAD_PROBABILITY_FLOOR = 0.9


def check_peft_installed(lora_rank: int) -> None:
    """Raise ``ConfigError`` naming ``train.lora_rank`` before any process starts when LoRA is asked for and
    ``peft`` is not installed."""
    import importlib.util

    if lora_rank > 0 and importlib.util.find_spec("peft") is None:
        from rlsdk.config import ConfigError

        raise ConfigError(
            "train.lora_rank",
            lora_rank,
            "0 unless peft is installed (pip install 'rlsdk[lora]'; see docs/howto/lora.md)",
        )


def is_adapter_dir(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a peft adapter directory (holds :data:`ADAPTER_CONFIG` and :data:`ADAPTER_WEIGHTS`)."""
    root = Path(path)
    return (root / ADAPTER_CONFIG).is_file() and (root / ADAPTER_WEIGHTS).is_file()


def apply_lora(model: torch.nn.Module, train: Any) -> Any:
    """``model`` wrapped by peft with LoRA adapters per ``train`` (``lora_rank``, ``lora_alpha``, ``lora_dropout``,
    ``lora_target_modules``); only the adapter parameters require gradients. The adapters start as peft's default
    (``lora_B = 0``: the wrapped model computes exactly what ``model`` computes), ``lora_A`` drawn from torch's
    generator: seed it the same on every rank."""
    from peft import LoraConfig, get_peft_model

    targets = train.lora_target_modules
    config = LoraConfig(
        r=train.lora_rank,
        lora_alpha=train.lora_alpha,
        lora_dropout=train.lora_dropout,
        target_modules="all-linear" if tuple(targets) == ("all-linear",) else list(targets),
        bias="none",
    )
    return get_peft_model(model, config)


def _final_norm(model: torch.nn.Module, hidden_size: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(gain, bias)`` of the model's final normalisation when it computes ``gain * x / rms(x)`` (RMSNorm, also
    with Gemma's ``1 + weight`` gain; bias 0) or is a ``torch.nn.LayerNorm``; None when neither holds or no module
    is found. The final norm is the last module (in registration order, as transformers' causal LMs register it
    after the decoder layers) whose class name contains 'norm'; an RMSNorm-like module is recognised by probing
    it, not by its name."""
    norms = [m for m in model.modules() if "norm" in type(m).__name__.lower()]
    if not norms:
        return None
    norm = norms[-1]
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.shape != (hidden_size,):
        return None
    if isinstance(norm, torch.nn.LayerNorm):
        bias = norm.bias.detach().float() if norm.bias is not None else torch.zeros(hidden_size)
        return weight.detach().float().cpu(), bias.cpu()
    probe = torch.randn(3, hidden_size, generator=torch.Generator().manual_seed(0))
    probe = probe.to(device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        gain = norm(torch.ones(1, hidden_size, device=weight.device, dtype=weight.dtype)).float()[0]
        out = norm(probe).float()
    expected = gain * probe.float() / probe.float().pow(2).mean(dim=-1, keepdim=True).sqrt()
    if not torch.allclose(out, expected, rtol=1e-2, atol=1e-3 * float(gain.abs().max()) + 1e-6):
        return None
    return gain.cpu(), torch.zeros(hidden_size)


def head_probability_bound(model: torch.nn.Module, candidates: int = 16, chunk_rows: int = 1024) -> float | None:
    """Upper bound on the probability any token can get while the output head and the final norm stay frozen,
    whatever the rest of the model computes; None when the head trains (an adapter or a trained weight), has a
    bias, or the final norm is not one whose output norm is bounded (see :func:`_final_norm`).

    The final norm's output is ``g * u + b`` with ``||u|| <= sqrt(d)`` (RMSNorm: ``u = x / rms(x)``; LayerNorm:
    ``u`` also has zero mean), so with head rows ``W_k`` and ``c_k = W_k . b``: ``logit_i - logit_j <= m_ij =
    sqrt(d) * ||(W_i - W_j) * g|| + c_i - c_j`` and ``p_i <= 1 / (1 + sum_{j != i} exp(-m_ij))``. By the triangle
    inequality ``m_ij <= a_i + a_j + c_i - c_j`` with ``a_k = sqrt(d) * ||W_k * g||``: a bound for every token in
    one pass over the head, used to pick the ``candidates`` tokens with the highest bounds, which are then bounded
    through the exact ``m_ij`` (another pass; the rest keep the looser bound). Float64, ``chunk_rows`` rows of
    the head at a time. Logit soft-capping, or a logit scale below 1, only tighten it."""
    head = model.get_output_embeddings()
    # an adapted head is peft's lora.Linear, no torch Linear
    if not isinstance(head, torch.nn.Linear) or head.bias is not None or head.weight.requires_grad:
        return None
    weight = head.weight.detach()
    vocab, hidden = weight.shape
    norm = _final_norm(model, hidden)
    if norm is None:
        return None
    if vocab < 2:
        return 1.0
    gain, bias = (t.double() for t in norm)
    scale = math.sqrt(hidden)

    def chunks() -> Any:  # (first row, rows) of the head in float64 on the CPU
        for start in range(0, vocab, chunk_rows):
            yield start, weight[start : start + chunk_rows].detach().cpu().double()

    a, c = torch.empty(vocab, dtype=torch.float64), torch.empty(vocab, dtype=torch.float64)
    for start, rows in chunks():
        a[start : start + len(rows)] = (rows * gain).norm(dim=1) * scale
        c[start : start + len(rows)] = rows @ bias
    # the loose bound: log sum_{j != i} exp(c_j - a_j), then p_i <= sigmoid(a_i + c_i - that)
    terms = c - a
    total = torch.logsumexp(terms, dim=0)
    others = total + torch.log1p(-torch.exp(terms - total).clamp(max=1.0 - 1e-16))
    loose = torch.sigmoid(a + c - others)
    order = torch.argsort(loose, descending=True)
    top = order[:candidates]
    chosen = weight[top].detach().cpu().double() * gain  # [K, d]
    # exact m_ij for the candidates: ||x - y||^2 = ||x||^2 + ||y||^2 - 2 x.y, one matrix product per chunk
    exponents = torch.empty(len(top), vocab, dtype=torch.float64)
    for start, rows in chunks():
        squared = (a[top, None] ** 2 + a[None, start : start + len(rows)] ** 2) / hidden - 2 * chosen @ (rows * gain).T
        margin = squared.clamp(min=0).sqrt() * scale + c[top, None] - c[None, start : start + len(rows)]
        exponents[:, start : start + len(rows)] = -margin
    exponents[torch.arange(len(top)), top] = -math.inf  # j != i
    exact = torch.sigmoid(-torch.logsumexp(exponents, dim=1))
    rest = float(loose[order[candidates]]) if vocab > candidates else 0.0
    return max(float(exact.max()), rest)


def check_lora_capacity(model: Any) -> list[str]:
    """Warn (through the project logger) where LoRA adapters on ``model`` (a peft model) cannot learn what full
    fine-tuning can; returns the warnings. Cheap: two passes over the output head.

    The check: with the output head and the final norm frozen (the default ``all-linear`` targets leave the head
    out), the head bounds every logit; :func:`head_probability_bound` below :data:`HEAD_PROBABILITY_FLOOR` means the
    policy can never become confident, whatever the adapters learn (a randomly initialised model's small head
    does this, not a pretrained one's)."""
    warnings: list[str] = []
    bound = head_probability_bound(model)
    if bound is not None and bound < HEAD_PROBABILITY_FLOOR:
        warnings.append(
            f"LoRA: with the output head and final norm frozen, no token can get a probability above {bound:.2f} "
            f"whatever the adapters learn (the head's rows are small: a randomly initialised model?), so the "
            f"policy cannot become confident; add 'lm_head' to train.lora_target_modules or train every weight "
            f"(train.lora_rank=0). See docs/howto/lora.md"
        )
    for message in warnings:
        logger.warning("%s", message)
    return warnings


# peft model -> [(saved name, parameter)] of its adapter: peft's get_peft_model_state_dict walks the whole state
# dict with string matching on every call (measured: most of a small adapter's sync); the names do not change.
_ADAPTER_PARAMETERS: weakref.WeakKeyDictionary[Any, list[tuple[str, torch.nn.Parameter]]] = weakref.WeakKeyDictionary()


def _adapter_parameters(model: Any) -> list[tuple[str, torch.nn.Parameter]]:
    """The adapter's parameters of a peft ``model`` under the names peft saves them with (found once per model
    through ``get_peft_model_state_dict``, then cached)."""
    cached = _ADAPTER_PARAMETERS.get(model)
    if cached is None:
        from peft import get_peft_model_state_dict

        saved = get_peft_model_state_dict(model)
        by_storage = {param.data_ptr(): param for param in model.parameters()}
        cached = [(name, by_storage[tensor.data_ptr()]) for name, tensor in saved.items()]
        _ADAPTER_PARAMETERS[model] = cached
    return cached


def adapter_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """The adapter tensors of a peft ``model`` (unwrapped from DDP) under the names peft saves them with
    (``get_peft_model_state_dict``'s), detached views of the parameters."""
    return {name: param.detach() for name, param in _adapter_parameters(model)}


def adapter_checksum(model: Any) -> str:
    """:func:`~rlsdk.engine.weights.state_dict_checksum` of :func:`adapter_state_dict`."""
    return state_dict_checksum(adapter_state_dict(model))


def write_adapter(model: Any, directory: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Write ``model``'s adapter into ``directory`` (created 0700 if missing) as :data:`ADAPTER_WEIGHTS` and
    :data:`ADAPTER_CONFIG` (what ``PeftModel.from_pretrained`` and vLLM load); returns the tensors written."""
    from safetensors.torch import save_file

    state_dict = {name: tensor.detach().contiguous() for name, tensor in adapter_state_dict(model).items()}
    Path(directory).mkdir(mode=0o700, parents=True, exist_ok=True)
    save_file(state_dict, str(Path(directory) / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    model.peft_config["default"].save_pretrained(str(directory))
    return state_dict


def publish_adapter(model: Any, publish_dir: str, version: int) -> dict[str, Any]:
    """Write ``model``'s adapter to ``publish_dir/v{version}/`` (a temporary directory renamed into place, so
    readers see a complete adapter or none); remove older ``v*`` entries. Returns ``{"version", "path",
    "checksum", "bytes"}`` (``bytes``: of the adapter tensors, what a sync moves)."""
    os.makedirs(publish_dir, exist_ok=True)
    path = Path(publish_dir) / f"v{version}"
    tmp = Path(publish_dir) / f".v{version}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    state_dict = write_adapter(model, tmp)
    if path.exists():  # a re-publish of the same version (e.g. a repeated sync): replace it whole
        shutil.rmtree(path)
    os.replace(tmp, path)
    for old in Path(publish_dir).glob("v*"):
        if old.name != path.name:
            with contextlib.suppress(FileNotFoundError):
                shutil.rmtree(old) if old.is_dir() else old.unlink()
    return {
        "version": version,
        "path": str(path),
        "checksum": state_dict_checksum(state_dict),
        "bytes": sum(t.numel() * t.element_size() for t in state_dict.values()),
    }


def read_adapter(path: str | os.PathLike[str]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(tensors, config)`` of the adapter directory at ``path``: its weights (CPU) and its parsed
    ``adapter_config.json``.

    Raises:
        FileNotFoundError: ``path`` is not an adapter directory.
    """
    from safetensors.torch import load_file

    if not is_adapter_dir(path):
        raise FileNotFoundError(f"no peft adapter at {path} (expected {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})")
    config = json.loads((Path(path) / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    return load_file(str(Path(path) / ADAPTER_WEIGHTS)), config


def load_adapter(model: Any, path: str | os.PathLike[str]) -> tuple[Any, str]:
    """Load the adapter directory at ``path`` into ``model`` (a plain causal LM is wrapped by peft with the
    adapter's config first); returns ``(model, checksum)``, the checksum of the adapter tensors ``model`` then
    holds (read back from the model, not from the file).

    Raises:
        FileNotFoundError: ``path`` is not an adapter directory.
        RuntimeError: the adapter's tensors do not match the model's adapter exactly (a missing or unexpected
            tensor, or another shape).
    """
    from peft import LoraConfig, PeftModel, get_peft_model

    tensors, config = read_adapter(path)
    if not isinstance(model, PeftModel):
        model = get_peft_model(model, LoraConfig.from_pretrained(str(path)))
    held = dict(_adapter_parameters(model))
    if set(held) != set(tensors) or any(held[k].shape != tensors[k].shape for k in held):
        missing, unexpected = sorted(set(held) - set(tensors)), sorted(set(tensors) - set(held))
        raise RuntimeError(
            f"adapter at {path} does not fit the served adapter (r={config.get('r')}): missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}, or other shapes"
        )
    with torch.no_grad():
        for name, param in held.items():
            param.copy_(tensors[name])
    return model, adapter_checksum(model)
