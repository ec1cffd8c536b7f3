"""Require the session's token on every route of a vLLM server: ``--middleware`` plus ``VLLM_API_KEY``.

vLLM's ``--api-key`` (or ``VLLM_API_KEY``) guards only the ``/v1``, ``/v2`` and ``/inference`` prefixes; the
development endpoints a weight sync uses (``/collective_rpc``, ``/sleep``, ``/wake_up``, ``/resume``,
``/update_weight_version``, ``/reset_prefix_cache``, ...) stay open to whoever reaches the port, and
``/collective_rpc`` runs worker methods that load weights. :class:`RequireToken` is a pure ASGI middleware that
vLLM installs around its whole app when started with ``--middleware rlsdk.engine.inference.vllm_auth.RequireToken``
(vLLM's own hook for extra middleware: no patching of vLLM). It reads the token from the same ``VLLM_API_KEY``
variable vLLM's own check uses, so one secret covers both, and answers 401 to any HTTP or websocket request
without ``Authorization: Bearer <token>``; only ``/health`` (liveness, no data) stays open. Without the variable
the server refuses to start: a guard that silently let everything through would be worse than none.

The token reaches the server through its environment (``/proc/PID/environ`` is readable by the same user only),
never its command line. This module is imported inside the vLLM API server: standard library only.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

TOKEN_ENV = "VLLM_API_KEY"
MIDDLEWARE = "rlsdk.engine.inference.vllm_auth.RequireToken"
# Liveness only: schedulers' and the replica wrapper's health probes carry no secret, and it answers no data.
OPEN_PATHS = frozenset({"/health"})

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def bearer_header(token: str) -> dict[str, str]:
    """The request header that carries ``token``."""
    return {"Authorization": f"Bearer {token}"}


def _digest(token: str | bytes) -> bytes:
    return hashlib.sha256(token.encode() if isinstance(token, str) else token).digest()


class RequireToken:
    """ASGI middleware: 401 unless the request carries ``Authorization: Bearer $VLLM_API_KEY`` (see module doc).

    Raises:
        RuntimeError: ``VLLM_API_KEY`` is unset or empty (the server then fails at start-up).
    """

    def __init__(self, app: ASGIApp) -> None:
        token = os.environ.get(TOKEN_ENV, "")
        if not token:
            raise RuntimeError(
                f"{MIDDLEWARE} needs the token in {TOKEN_ENV}; it is unset, so the server would accept anyone"
            )
        self.app = app
        # Compared as digests: equal length whatever the caller sends, so the comparison time says nothing.
        self._digest = _digest(token)

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope.get("headers") or ():
            if name.lower() == b"authorization":
                scheme, _, param = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(_digest(param.strip()), self._digest)
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):  # lifespan events
            await self.app(scope, receive, send)
            return
        path = str(scope.get("path", "")).removeprefix(str(scope.get("root_path", "")))
        if path in OPEN_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})  # policy violation
            return
        body = json.dumps({"error": "Unauthorized: this server requires the session's bearer token"}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
