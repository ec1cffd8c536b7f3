"""Inference engines: the protocol they share and the factory that builds the configured one."""

from rlsdk.engine.inference.factory import (
    EngineSpec,
    build_engine,
    check_engine_before_start,
    engine_spec,
    register_engine,
)
from rlsdk.engine.inference.protocol import EngineContext, EngineLifecycle, SessionEngine, TrainerHandle

__all__ = [
    "EngineContext",
    "EngineLifecycle",
    "EngineSpec",
    "SessionEngine",
    "TrainerHandle",
    "build_engine",
    "check_engine_before_start",
    "engine_spec",
    "register_engine",
]
