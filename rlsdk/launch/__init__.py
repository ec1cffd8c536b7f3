"""Process supervision: train ranks via accelerate (and, later, inference servers and cluster schedulers)."""

from rlsdk.launch.local import LocalLauncher
from rlsdk.launch.supervised import RankProcessError

__all__ = ["LocalLauncher", "RankProcessError"]
