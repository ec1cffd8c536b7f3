"""Authenticated control channel between the controller (``ControllerChannel``) and the ranks (``RankChannel``):
commands out; results, rank-tagged log records and heartbeats back. A Unix socket in a private directory on one
machine, TCP with CURVE across machines.

See ``rlsdk.control.protocol`` for the wire format and the environment contract, ``rlsdk.control.controller`` for
who may connect and whom the controller routes to.
"""

from rlsdk.control.controller import ControllerChannel
from rlsdk.control.errors import (
    AuthenticationError,
    CommandTimeoutError,
    ControlError,
    ProtocolError,
    RankError,
    SessionMismatchError,
)
from rlsdk.control.protocol import new_session_id, new_session_secret, rank_environment
from rlsdk.control.rank import SHUTDOWN, Command, RankChannel

__all__ = [
    "SHUTDOWN",
    "AuthenticationError",
    "Command",
    "CommandTimeoutError",
    "ControlError",
    "ControllerChannel",
    "ProtocolError",
    "RankChannel",
    "RankError",
    "SessionMismatchError",
    "new_session_id",
    "new_session_secret",
    "rank_environment",
]
