"""Moved to :mod:`rlsdk.generation.stopping` (one rule for every engine and the trainer); this path stays for
existing imports."""

from rlsdk.generation.stopping import (
    SpecialTokens,
    StopCriteria,
    apply_pad_rule,
    check_stop_strings,
    cut_at_stop,
    resolve_special_tokens,
    token_id_list,
)

__all__ = [
    "SpecialTokens",
    "StopCriteria",
    "apply_pad_rule",
    "check_stop_strings",
    "cut_at_stop",
    "resolve_special_tokens",
    "token_id_list",
]
