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
import os
import shutil
import weakref
from pathlib import Path
from typing import Any

import torch

from rlsdk.engine.weights import state_dict_checksum

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


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
