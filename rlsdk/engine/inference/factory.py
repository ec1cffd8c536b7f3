"""Which engine a Session runs: the only place that reads ``inference.engine``.

Every engine registers a builder (``async (EngineContext) -> SessionEngine``), optionally a ``preflight`` check run
before any process starts, and optionally the server a batch launcher runs on nodes of their own (``replica_server``:
vLLM's replicas in a Slurm job). The built-in engines (embedded, vllm, colocated) are registered here, their modules
imported only when built (vLLM's client needs ``httpx``). A new engine is one module with its builder and one
:func:`register_engine` call (its name must also be a choice of ``InferenceConfig.engine``, the config's schema, which
the train ranks validate too).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from rlsdk.engine.inference.protocol import EngineContext, SessionEngine
from rlsdk.procutil import ReplicaServer

EngineBuilder = Callable[[EngineContext], Awaitable[SessionEngine]]
ReplicaServerFn = Callable[[Any, str], "ReplicaServer | None"]


@dataclass(frozen=True)
class EngineSpec:
    """A registered engine: its builder, the check to run before any process starts (None: none) and the server
    a batch launcher runs for it on nodes of their own (``replica_server(config, python)``; None: none)."""

    name: str
    builder: EngineBuilder
    preflight: Callable[[Any], None] | None = None
    replica_server: ReplicaServerFn | None = None


_registry: dict[str, EngineSpec] = {}


def register_engine(
    name: str,
    builder: EngineBuilder,
    *,
    preflight: Callable[[Any], None] | None = None,
    replica_server: ReplicaServerFn | None = None,
    replace: bool = False,
) -> EngineSpec | None:
    """Register the engine ``inference.engine = name`` builds; returns the registration it replaced (None: none),
    so a test can put it back. ``preflight(config)`` raises ``ConfigError`` before any process starts;
    ``replica_server(config, python)`` describes the server a batch launcher starts for this configuration (None:
    the engine needs none, e.g. it attaches to ``inference.vllm.url``).

    Raises:
        ValueError: ``name`` is registered already and ``replace`` is False.
    """
    previous = _registry.get(name)
    if previous is not None and not replace:
        raise ValueError(f"an inference engine named {name!r} is registered already (pass replace=True)")
    _registry[name] = EngineSpec(name, builder, preflight, replica_server)
    return previous


def engine_spec(config: Any) -> EngineSpec:
    """The registration of ``config.inference.engine``. Raises ``ConfigError`` naming the field for a name
    nothing registered."""
    name = config.inference.engine
    spec = _registry.get(name)
    if spec is None:
        from rlsdk.config import ConfigError

        raise ConfigError("inference.engine", name, f"one of the registered engines {sorted(_registry)}")
    return spec


def check_engine_before_start(config: Any) -> None:
    """The configured engine's own checks before any process starts (e.g. vLLM's installation and head size)."""
    spec = engine_spec(config)
    if spec.preflight is not None:
        spec.preflight(config)


def replica_server(config: Any, *, python: str | None = None) -> ReplicaServer | None:
    """The server the configured engine needs a batch launcher to run on nodes of their own (None: none);
    ``python``: the interpreter on those nodes (default: this one, a shared filesystem assumed)."""
    import sys

    spec = engine_spec(config)
    if spec.replica_server is None:
        return None
    return spec.replica_server(config, python or sys.executable)


async def build_engine(context: EngineContext) -> SessionEngine:
    """Build and start the engine ``context.config.inference.engine`` names; it serves the model's weights (or,
    attached, whatever its server holds: the Session's first sync verifies)."""
    return await engine_spec(context.config).builder(context)


async def _embedded(context: EngineContext) -> SessionEngine:
    from rlsdk.engine.inference.embedded import EmbeddedEngine

    return await EmbeddedEngine.build(context)


async def _vllm(context: EngineContext) -> SessionEngine:
    from rlsdk.engine.inference.vllm import VLLMEngine

    return await VLLMEngine.build(context)


def _vllm_preflight(config: Any) -> None:
    from rlsdk.engine.inference.vllm import check_before_start

    check_before_start(config)


async def _colocated(context: EngineContext) -> SessionEngine:
    from rlsdk.engine.inference.colocated import ColocatedEngine

    return ColocatedEngine.build(context)


register_engine("embedded", _embedded)


def _vllm_replica_server(config: Any, python: str) -> ReplicaServer | None:
    from rlsdk.engine.inference.vllm_server import replica_server

    return replica_server(config, python)


register_engine("vllm", _vllm, preflight=_vllm_preflight, replica_server=_vllm_replica_server)
register_engine("colocated", _colocated)
