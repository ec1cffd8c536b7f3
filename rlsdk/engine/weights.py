"""Weight identity shared by the train and inference engines: one checksum, computed the same way on both."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch


def state_dict_checksum(state_dict: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 over parameter names, dtypes, shapes and raw bytes, in sorted name order.

    Equal checksums mean bit-identical weights. Cost is one pass over the weights (host memory bandwidth);
    call it at sync time, never per micro-batch.
    """
    digest = hashlib.sha256()
    for name in sorted(state_dict):
        tensor = state_dict[name].detach()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        tensor = tensor.contiguous()
        digest.update(name.encode())
        digest.update(str(tensor.dtype).encode())
        digest.update(str(tuple(tensor.shape)).encode())
        # hashlib reads the array's buffer directly (no bytes copy) and releases the GIL for large buffers.
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy() if tensor.numel() else b"")
    return digest.hexdigest()
