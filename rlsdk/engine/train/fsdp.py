"""FSDP2 (torch ``fully_shard``) for the train engine: sharding, gradient clipping and full state dicts.

accelerate ignores its FSDP plugin on CPU/gloo ranks (it returns DDP), so the engine applies torch's
``fully_shard`` itself. Functions that gather (``full_state_dict``, ``clip_grad_norm``) are COLLECTIVES over
the mesh: every rank calls them, in the same order, whatever it does with the result.
"""

from __future__ import annotations

from typing import Any

import torch

from rlsdk.observe.logging import get_logger

logger = get_logger(__name__)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules to shard one by one: instances of the classes in the transformers model's
    ``_no_split_modules`` (its decoder-layer classes, the same list accelerate's FSDP auto-wrap uses), else the
    modules whose class name ends with ``DecoderLayer``. The root is never in the list."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if m is not model and type(m).__name__ in names]
    if not layers:
        layers = [m for m in model.modules() if m is not model and type(m).__name__.endswith("DecoderLayer")]
    return layers


def shard_model(
    model: torch.nn.Module,
    device_type: str,
    world_size: int,
    *,
    compute_dtype: torch.dtype | None = None,
    reshard_after_forward: bool = True,
) -> int:
    """Apply ``fully_shard`` to each decoder layer, then to the root, on a 1-D mesh over the default group
    (axis ``dp_shard``). Parameters become sharded DTensors in place; build the optimizer afterwards.
    ``compute_dtype`` (e.g. bfloat16): FSDP2's mixed precision, parameters all-gathered and used in that dtype,
    gradients reduced in float32 into the float32 shards. ``reshard_after_forward``: the decoder layers'
    (``train.fsdp_reshard_after_forward``; the root keeps its parameters gathered until the backward either way, as
    torch does). Returns the number of layers sharded separately (0: only the root, with a warning)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device_type, (world_size,), mesh_dim_names=("dp_shard",))
    layers = decoder_layers(model)
    if not layers:
        logger.warning(
            "fsdp2: no decoder layers found (%s has no _no_split_modules and no *DecoderLayer module); "
            "sharding the root only, so every forward gathers the whole model at once",
            type(model).__name__,
        )
    policy = MixedPrecisionPolicy() if compute_dtype is None else MixedPrecisionPolicy(compute_dtype, torch.float32)
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    release_freed_memory()
    return len(layers)


def release_freed_memory() -> None:
    """Hand freed heap memory back to the operating system (glibc's ``malloc_trim``; nothing elsewhere).

    Why after sharding: the model was loaded whole, and glibc keeps the pages of the freed unsharded tensors for
    reuse (tensors below its mmap threshold come from the heap), so without it a rank's resident memory stays at
    the whole model's size, which FSDP2 exists to avoid."""
    import ctypes

    try:
        trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # the process's own symbols: libc's where glibc
    except OSError:
        return
    if trim is not None:
        trim(0)


def clip_grad_norm(parameters: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip the global L2 norm of the (sharded) gradients to ``max_norm``; returns the norm before clipping
    (a plain tensor, equal on every rank). Collective: the norm of a sharded gradient is all-reduced."""
    from torch.distributed.tensor import DTensor

    with_grad = [p for p in parameters if p.grad is not None]
    total = torch.nn.utils.get_total_norm([p.grad for p in with_grad], norm_type=2.0)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(with_grad, max_norm, total)
    return total


def full_state_dict(model: torch.nn.Module, *, keep: bool) -> dict[str, torch.Tensor] | None:
    """The model's full (unsharded) state dict on the CPU when ``keep``, else None after taking part.

    Collective: every rank all-gathers each sharded tensor in ``state_dict`` order (the same on every rank);
    only ranks with ``keep`` hold the results, one full tensor at a time otherwise. Names that share one
    parameter (tied embeddings) map to one tensor, as in an unsharded ``state_dict``, so safetensors'
    ``save_model`` and ``save_pretrained`` drop the same duplicates as they do for DDP.
    """
    from torch.distributed.tensor import DTensor

    gathered: dict[int, torch.Tensor] = {}
    full: dict[str, torch.Tensor] = {}
    # keep_vars: the Parameter objects themselves, so tied names are recognised by identity
    for name, tensor in model.state_dict(keep_vars=True).items():
        key = id(tensor)
        if key not in gathered:
            value = tensor.detach()
            if isinstance(value, DTensor):
                value = value.full_tensor()
            gathered[key] = value.cpu() if keep else value.new_empty(0)
        if keep:
            full[name] = gathered[key]
    return full if keep else None


class StateDictSource:
    """What safetensors' ``save_model`` needs of a module (``state_dict()``), for an already gathered dict:
    the file then has exactly the tensors, duplicate handling and metadata of ``save_model(unsharded_model)``."""

    def __init__(self, state_dict: dict[str, Any]) -> None:
        self._state_dict = state_dict

    def state_dict(self) -> dict[str, Any]:
        return dict(self._state_dict)
