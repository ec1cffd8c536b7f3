"""Process supervision: train ranks via accelerate (and, later, inference servers and cluster schedulers)."""

from rlsdk.launch.local import LocalLauncher, RankProcessError

__all__ = ["LocalLauncher", "RankProcessError"]
