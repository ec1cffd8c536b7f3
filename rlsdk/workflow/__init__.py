"""Episode generation against an inference engine -> Rollout."""

from rlsdk.workflow.multi_turn import MultiTurnWorkflow, ToolError, tag_call_parser
from rlsdk.workflow.rollout import Rollout
from rlsdk.workflow.single_turn import RolloutWorkflow, SingleTurnWorkflow

__all__ = [
    "MultiTurnWorkflow",
    "Rollout",
    "RolloutWorkflow",
    "SingleTurnWorkflow",
    "ToolError",
    "tag_call_parser",
]
