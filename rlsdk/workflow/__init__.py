"""Episode generation against an inference engine -> Rollout."""

from rlsdk.workflow.rollout import Rollout
from rlsdk.workflow.single_turn import RolloutWorkflow, SingleTurnWorkflow

__all__ = ["Rollout", "RolloutWorkflow", "SingleTurnWorkflow"]
