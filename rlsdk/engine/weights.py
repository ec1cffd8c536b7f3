"""Weight identity shared by the train and inference engines: one checksum, computed the same way on both.

A checksum names its algorithm: ``"xxh3:<32 hex>"`` (XXH3-128, the current one), ``"blake3:<64 hex>"`` (what
rlsdk recorded before XXH3) or a bare 64-hex SHA-256 digest (before BLAKE3), e.g. in older checkpoints.
:func:`checksum_matches` recomputes a stored value with the algorithm it names, so a checkpoint written before a
switch still verifies on resume.

Why a non-cryptographic hash: the checksum answers "does the engine serve bit-for-bit the weights the trainer
published?" (stale, half-loaded or corrupted weights), on the weight-sync critical path of both sides. It is not
a defence against someone who can write the published file (they could write any weights); the checkpoint
manifest's per-file SHA-256 and the HMAC-authenticated control channel are (docs/security.md). XXH3-128 hashes
much faster than BLAKE3, on one core (benchmarks/vllm_sync.py measures the three algorithms).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from typing import Any, Literal

import torch

ChecksumAlgorithm = Literal["xxh3", "blake3", "sha256"]

# The algorithm new checksums use: the checksum sits on the weight-sync critical path on both sides (trainer
# publish, server verify). XXH3-128 (``xxhash``) is the fastest of the three (benchmarks/vllm_sync.py) and releases
# the GIL.
CHECKSUM_ALGORITHM: ChecksumAlgorithm = "xxh3"

# BLAKE3's hashing threads per update() call: its Rust core splits large buffers across up to this many threads.
# Two: BLAKE3 is only the verifier of old checkpoints now, and more hashing threads would contend with the ranks'
# and the vLLM worker's own threads for the cores.
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
        ValueError: ``algorithm`` is not ``"xxh3"``, ``"blake3"`` or ``"sha256"``.
    """

    def __init__(self, algorithm: ChecksumAlgorithm = CHECKSUM_ALGORITHM, *, max_threads: int = 1) -> None:
        if algorithm == "xxh3":
            import xxhash

            self._digest: Any = xxhash.xxh3_128()
        elif algorithm == "blake3":
            import blake3

            self._digest = blake3.blake3(max_threads=max_threads)
        elif algorithm == "sha256":
            self._digest = hashlib.sha256()
        else:
            raise ValueError(f"checksum algorithm {algorithm!r}: expected 'xxh3', 'blake3' or 'sha256'")
        self.algorithm = algorithm

    def update(self, name: str, tensor: torch.Tensor) -> None:
        """Hash ``name``, ``tensor``'s dtype, shape and raw bytes (read in place, no copy when contiguous)."""
        digest = self._digest
        digest.update(name.encode())
        digest.update(str(tensor.dtype).encode())
        digest.update(str(tuple(tensor.shape)).encode())
        # All three read the array's buffer directly (no bytes copy) and release the GIL on large buffers.
        digest.update(_tensor_bytes(tensor))

    def checksum(self) -> str:
        """``"xxh3:<hex>"``, ``"blake3:<hex>"`` or, for ``"sha256"``, the bare hex digest (the oldest format)."""
        hexdigest = self._digest.hexdigest()
        return hexdigest if self.algorithm == "sha256" else f"{self.algorithm}:{hexdigest}"


def state_dict_checksum(
    state_dict: Mapping[str, torch.Tensor], algorithm: ChecksumAlgorithm = CHECKSUM_ALGORITHM
) -> str:
    """Hash of parameter names, dtypes, shapes and raw bytes, in sorted name order.

    Returns ``"xxh3:<hex>"`` (XXH3-128) for ``algorithm="xxh3"`` (the default), ``"blake3:<hex>"`` for
    ``"blake3"`` and a bare hex digest for ``"sha256"`` (both kept to verify values recorded before XXH3). Equal
    checksums mean bit-identical weights (up to a 2^-128 collision chance for accidental differences). Cost is one
    pass over the weights (BLAKE3 on :data:`BLAKE3_MAX_THREADS` threads from :data:`BLAKE3_THREADED_MIN_BYTES`
    on; all three release the GIL on large buffers); call it at sync time, never per micro-batch.

    Raises:
        ValueError: ``algorithm`` is not ``"xxh3"``, ``"blake3"`` or ``"sha256"``.
    """
    nbytes = sum(t.numel() * t.element_size() for t in state_dict.values())
    hasher = StateDictHasher(algorithm, max_threads=BLAKE3_MAX_THREADS if nbytes >= BLAKE3_THREADED_MIN_BYTES else 1)
    for name in sorted(state_dict):
        hasher.update(name, state_dict[name])
    return hasher.checksum()


def checksum_algorithm(checksum: str) -> ChecksumAlgorithm:
    """The algorithm a stored checksum names: ``"xxh3:<hex>"`` -> xxh3, ``"blake3:<hex>"`` -> blake3, bare 64
    hex -> sha256 (legacy).

    Raises:
        ValueError: the value has none of these forms (names the value).
    """
    if checksum.startswith("xxh3:"):
        return "xxh3"
    if checksum.startswith("blake3:"):
        return "blake3"
    if _SHA256_HEX.fullmatch(checksum):
        return "sha256"
    raise ValueError(f"checksum {checksum[:80]!r}: expected 'xxh3:<hex>', 'blake3:<hex>' or a 64-hex SHA-256 digest")


def checksum_matches(state_dict: Mapping[str, torch.Tensor], expected: str) -> bool:
    """Whether ``state_dict`` hashes to ``expected`` under the algorithm ``expected`` names (legacy values too).

    Raises:
        ValueError: ``expected`` names no known algorithm.
    """
    return state_dict_checksum(state_dict, checksum_algorithm(expected)) == expected
