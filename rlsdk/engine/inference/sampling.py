"""Moved to :mod:`rlsdk.generation.sampling` (shared by the embedded and the colocated engine); this path stays
for existing imports."""

from rlsdk.generation.sampling import left_pad, sample_completions, validate_params

__all__ = ["left_pad", "sample_completions", "validate_params"]
