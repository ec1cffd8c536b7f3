"""A CPU train rank hands freed large tensors back to the system (glibc's mmap threshold, fixed at start-up)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rlsdk.engine.train.host_allocator import MMAP_THRESHOLD_ENV, configure_host_allocator

# A fresh interpreter: tensors of 6 MiB allocated between small long-lived ones (which pin glibc's arenas), then
# freed; resident memory before, at the peak and after.
_PROBE = """
import json, sys, torch
from rlsdk.engine.train.host_allocator import configure_host_allocator
set_to = configure_host_allocator() if sys.argv[1] == "configured" else None
def rss():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS:")).split()[1]) * 1024
for _ in range(3):  # let glibc's dynamic threshold learn the size, as a training step's tensors do
    torch.ones(6 * 2**20 // 4)
base = rss()
keep, big = [], []
for _ in range(64):
    big.append(torch.ones(6 * 2**20 // 4))
    keep.append(torch.ones(1024))
peak = rss()
del big
print(json.dumps({"set": set_to, "freed": (peak - rss()) / (peak - base)}))
"""


def _probe(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_configured_rank_returns_freed_large_tensors_to_the_system() -> None:
    configured = _probe("configured")

    assert configured["set"] == 4 * 2**20
    # every 6 MiB block was its own mapping (glibc's default may keep them in its heap, depending on its dynamic
    # threshold's history: not asserted, it differs between runs)
    assert configured["freed"] > 0.9


def test_host_allocator_override_zero_sets_nothing_and_a_bad_value_is_refused_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(MMAP_THRESHOLD_ENV, "0")
    assert configure_host_allocator() is None

    monkeypatch.setenv(MMAP_THRESHOLD_ENV, "4MiB")
    with pytest.raises(ValueError, match=r"RLSDK_MMAP_THRESHOLD='4MiB' is invalid: allowed an integer"):
        configure_host_allocator()
    with pytest.raises(ValueError, match=r"mmap threshold -1 is invalid"):
        configure_host_allocator(-1)
