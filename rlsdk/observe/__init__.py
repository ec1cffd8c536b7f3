"""Observability: rank-tagged logs and metrics."""

from rlsdk.observe.logging import RankLogRouter, get_logger, set_log_context

__all__ = ["RankLogRouter", "get_logger", "set_log_context"]
