"""What every weight transfer to a vLLM server shares: the collective RPC it calls and the check of the workers'
results. Its own module so that each transfer (:mod:`~rlsdk.engine.inference.weight_transfer`,
:mod:`~rlsdk.engine.inference.inplace_transfer`) imports it without importing the other; ``weight_transfer``
re-exports both names.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

# (method, kwargs, timeout_s) -> one result per server worker
CollectiveRpc = Callable[[str, dict[str, Any], float], Awaitable[list[Any]]]


def check_worker_results(method: str, version: int, results: Sequence[Any]) -> dict[str, Any]:
    """The first server worker's result of a weight-loading RPC once every worker returned the same checksum.

    Raises ``RuntimeError`` joining the workers' error messages, when a worker returned no checksum, or when the
    workers loaded different weights for ``version``.
    """
    errors = [r["error"] for r in results if isinstance(r, dict) and r.get("error")]
    if errors:
        raise RuntimeError("; ".join(errors))
    if not results or not all(isinstance(r, dict) and r.get("checksum") for r in results):
        raise RuntimeError(f"{method} returned {results!r}; expected one checksum per worker")
    checksums = {r["checksum"] for r in results}
    if len(checksums) != 1:
        raise RuntimeError(f"server workers loaded different weights for v{version}: checksums {checksums}")
    return dict(results[0])
