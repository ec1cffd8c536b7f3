"""How a CPU train rank's heap hands freed tensor memory back: glibc's mmap threshold, fixed.

Why: torch's CPU tensors come from glibc's ``malloc``. glibc serves a request from its heaps (arenas) unless it is
above the *mmap threshold*, and by default that threshold rises to the size of every mmapped block freed, up to
32 MiB. So at a real shape nearly every activation, gradient and gathered FSDP2 parameter of a few MiB comes from
an arena, and what is freed stays there: arenas hand memory back only from their top, and the ranks' threads
(gloo's among them) each get an arena of their own. A rank's resident memory then climbs to its live tensors
plus several GiB of freed but kept pages, and at the Qwen2.5-0.5B shape on 2 ranks of a 24 GiB machine that
difference is the OOM kill (benchmarks/shapes.py, S2 FSDP2; the figures are in the note of the issue and in
``docs/howto/real-shapes.md``). With the threshold fixed at :data:`MMAP_THRESHOLD_BYTES`, every block at least that
large is its own mapping, returned to the system when freed: resident memory follows the live tensors. The price is
the page faults of fresh mappings, which the shape benchmark measures.

Only glibc has ``mallopt``; elsewhere (musl, macOS) nothing changes. ``RLSDK_MMAP_THRESHOLD`` overrides the
threshold in bytes; ``0`` keeps glibc's default. GPU ranks keep their tensors on the device and are not changed.
"""

from __future__ import annotations

import ctypes
import os
from typing import Final

from rlsdk.observe.logging import get_logger

__all__ = ["MMAP_THRESHOLD_BYTES", "MMAP_THRESHOLD_ENV", "configure_host_allocator"]

logger = get_logger(__name__)

MMAP_THRESHOLD_BYTES: Final = 4 * 2**20
"""Blocks from this size up are mapped on their own and returned to the system when freed."""

MMAP_THRESHOLD_ENV: Final = "RLSDK_MMAP_THRESHOLD"
"""Environment override of :data:`MMAP_THRESHOLD_BYTES` in bytes (``0``: glibc's default, nothing set)."""

_M_MMAP_THRESHOLD: Final = -3  # glibc's malloc.h


def configure_host_allocator(threshold: int | None = None) -> int | None:
    """Fix glibc's mmap threshold of this process at ``threshold`` bytes (default: ``RLSDK_MMAP_THRESHOLD``, else
    :data:`MMAP_THRESHOLD_BYTES`). Returns the threshold set, or None when nothing was set (``0``, or not glibc).

    Raises:
        ValueError: ``RLSDK_MMAP_THRESHOLD`` (or ``threshold``) is not an integer in [0, 2**31).
    """
    if threshold is None:
        text = os.environ.get(MMAP_THRESHOLD_ENV, "").strip()
        try:
            threshold = int(text) if text else MMAP_THRESHOLD_BYTES
        except ValueError:
            raise ValueError(
                f"{MMAP_THRESHOLD_ENV}={text!r} is invalid: allowed an integer number of bytes in [0, 2**31), "
                "0 keeps glibc's default"
            ) from None
    if not 0 <= threshold < 2**31:
        raise ValueError(f"mmap threshold {threshold!r} is invalid: allowed [0, 2**31) bytes, 0 keeps glibc's default")
    if threshold == 0:
        return None
    try:
        mallopt = getattr(ctypes.CDLL(None), "mallopt", None)  # the process's own symbols: glibc's where linked
    except OSError:
        return None
    if mallopt is None or mallopt(_M_MMAP_THRESHOLD, threshold) != 1:
        logger.debug("mallopt(M_MMAP_THRESHOLD) unavailable: the C library keeps its own threshold")
        return None
    return threshold
