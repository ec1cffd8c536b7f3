"""Helpers for testing distributed RL code (rlsdk's own tests and users' tests).

- ``rlsdk.testing.plugin``: the pytest plugin (markers, skipped-suite report, fixtures); installing rlsdk
  enables it.
- ``assert_close(actual, expected, *, rtol, atol)``: tensor comparison with required tolerances.
- ``run_gloo_ranks`` / ``run_in_process_group``: run a function on N real gloo ranks (separate processes).

Importing this package imports neither torch nor pytest.
"""

from rlsdk.testing.distributed import run_gloo_ranks, run_in_process_group
from rlsdk.testing.tensors import assert_close

__all__ = ["assert_close", "run_gloo_ranks", "run_in_process_group"]
