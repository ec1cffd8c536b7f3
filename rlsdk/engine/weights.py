"""Weight identity shared by the train and inference engines: one checksum, computed the same way on both.

A checksum names its algorithm: ``"blake3:<64 hex>"`` (the current one) or a bare 64-hex SHA-256 digest (what
rlsdk recorded before BLAKE3, e.g. in older checkpoints). :func:`checksum_matches` recomputes a stored value with
the algorithm it names, so a checkpoint written before the switch still verifies on resume.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from typing import Any, Literal

import torch

ChecksumAlgorithm = Literal["blake3", "sha256"]

# The algorithm new checksums use. BLAKE3 (multithreaded) hashes several times faster than SHA-256, and the
# checksum sits on the weight-sync critical path on both sides (trainer publish, server verify).
CHECKSUM_ALGORITHM: ChecksumAlgorithm = "blake3"

# BLAKE3's hashing threads per update() call: its Rust core splits large buffers across up to this many threads.
# 2 = this machine's cores; more threads gain nothing on 2 cores and contend with the vLLM worker's own threads.
BLAKE3_MAX_THREADS = 2
# Below this many bytes in all, one thread: the thread hand-off costs more than it saves on small state dicts.
BLAKE3_THREADED_MIN_BYTES = 16 << 20

_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


def _tensor_bytes(tensor: torch.Tensor) -> Any:
    """A zero-copy uint8 view (numpy) of ``tensor``'s bytes on the CPU, contiguous; ``b""`` when empty."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    tensor = tensor.contiguous()
    return tensor.reshape(-1).view(torch.uint8).numpy() if tensor.numel() else b""


class StateDictHasher:
    """:func:`state_dict_checksum` one tensor at a time: ``update(name, tensor)`` in sorted name order, then
    :meth:`checksum`. For callers that hash tensors as they become ready (the in-place vLLM sync hashes each
    served parameter right after it is written); equal to :func:`state_dict_checksum` of the same tensors.

    ``max_threads`` (BLAKE3 only): hashing threads per ``update``; 1 when another thread keeps the other core busy.

    Raises:
        ValueError: ``algorithm`` is neither ``"blake3"`` nor ``"sha256"``.
    """

    def __init__(self, algorithm: ChecksumAlgorithm = CHECKSUM_ALGORITHM, *, max_threads: int = 1) -> None:
        if algorithm == "blake3":
            import blake3

            self._digest: Any = blake3.blake3(max_threads=max_threads)
        elif algorithm == "sha256":
            self._digest = hashlib.sha256()
        else:
            raise ValueError(f"checksum algorithm {algorithm!r}: expected 'blake3' or 'sha256'")
        self.algorithm = algorithm

    def update(self, name: str, tensor: torch.Tensor) -> None:
        """Hash ``name``, ``tensor``'s dtype, shape and raw bytes (read in place, no copy when contiguous)."""
        digest = self._digest
        digest.update(name.encode())
        digest.update(str(tensor.dtype).encode())
        digest.update(str(tuple(tensor.shape)).encode())
        # Both read the array's buffer directly (no bytes copy) and release the GIL on large buffers.
        digest.update(_tensor_bytes(tensor))

    def checksum(self) -> str:
        """``"blake3:<hex>"`` or, for ``"sha256"``, the bare hex digest (the legacy format)."""
        hexdigest = self._digest.hexdigest()
        return f"blake3:{hexdigest}" if self.algorithm == "blake3" else hexdigest


def state_dict_checksum(
    state_dict: Mapping[str, torch.Tensor], algorithm: ChecksumAlgorithm = CHECKSUM_ALGORITHM
) -> str:
    """Hash of parameter names, dtypes, shapes and raw bytes, in sorted name order.

    Returns ``"blake3:<hex>"`` for ``algorithm="blake3"`` (the default) and a bare hex digest for ``"sha256"``
    (the legacy format, kept only to verify values recorded before BLAKE3). Equal checksums mean bit-identical
    weights. Cost is one pass over the weights (BLAKE3 on :data:`BLAKE3_MAX_THREADS` threads from
    :data:`BLAKE3_THREADED_MIN_BYTES` on; both hashes release the GIL on large buffers); call it at sync time,
    never per micro-batch.

    Raises:
        ValueError: ``algorithm`` is neither ``"blake3"`` nor ``"sha256"``.
    """
    nbytes = sum(t.numel() * t.element_size() for t in state_dict.values())
    hasher = StateDictHasher(algorithm, max_threads=BLAKE3_MAX_THREADS if nbytes >= BLAKE3_THREADED_MIN_BYTES else 1)
    for name in sorted(state_dict):
        hasher.update(name, state_dict[name])
    return hasher.checksum()


def checksum_algorithm(checksum: str) -> ChecksumAlgorithm:
    """The algorithm a stored checksum names: ``"blake3:<hex>"`` -> blake3, bare 64 hex -> sha256 (legacy).

    Raises:
        ValueError: the value has neither form (names the value).
    """
    if checksum.startswith("blake3:"):
        return "blake3"
    if _SHA256_HEX.fullmatch(checksum):
        return "sha256"
    raise ValueError(f"checksum {checksum[:80]!r}: expected 'blake3:<hex>' or a 64-hex SHA-256 digest")


def checksum_matches(state_dict: Mapping[str, torch.Tensor], expected: str) -> bool:
    """Whether ``state_dict`` hashes to ``expected`` under the algorithm ``expected`` names (legacy values too).

    Raises:
        ValueError: ``expected`` names no known algorithm.
    """
    return state_dict_checksum(state_dict, checksum_algorithm(expected)) == expected
