"""The vLLM server's guards without vLLM: the token middleware on a real ASGI app, the server command, where the
worker extension may load weights from, and attaching only to a server that refuses callers without the token.
The same guards against a real vLLM server: tests/engine/vllm/test_vllm_security.py."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import os
import socketserver
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rlsdk.engine.inference import vllm_worker
from rlsdk.engine.inference.vllm_auth import MIDDLEWARE, OPEN_PATHS, TOKEN_ENV, RequireToken
from rlsdk.engine.inference.vllm_server import server_command
from rlsdk.engine.publish_dir import PublishDir

pytestmark = pytest.mark.security
httpx = pytest.importorskip("httpx", reason="httpx comes with the vllm extra")


async def _echo_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Stands in for vLLM's app: answers 200 with the path it was asked for (so a test sees what got through)."""
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": scope["path"].encode()})


def _status(app: Any, path: str, headers: dict[str, str] | None = None, method: str = "POST") -> int:
    async def call() -> int:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://server") as client:
            return (await client.request(method, path, headers=headers or {})).status_code

    return asyncio.run(call())


@pytest.mark.parametrize(
    "path", ["/collective_rpc", "/sleep", "/wake_up", "/update_weight_version", "/v1/completions", "/metrics", "/"]
)
def test_token_middleware_refuses_every_route_without_the_bearer_token(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(TOKEN_ENV, "s3cret")
    app = RequireToken(_echo_app)

    missing = _status(app, path)
    wrong = _status(app, path, {"Authorization": "Bearer s3cre"})
    other_scheme = _status(app, path, {"Authorization": "Basic s3cret"})
    right = _status(app, path, {"Authorization": "Bearer s3cret"})

    assert (missing, wrong, other_scheme, right) == (401, 401, 401, 200)


def test_token_middleware_leaves_only_health_open(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TOKEN_ENV, "s3cret")

    assert frozenset({"/health"}) == OPEN_PATHS
    assert _status(RequireToken(_echo_app), "/health", method="GET") == 200


def test_token_middleware_without_a_token_refuses_to_start_the_server(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)

    with pytest.raises(RuntimeError, match=TOKEN_ENV):
        RequireToken(_echo_app)


def test_server_command_on_a_unix_socket_has_no_host_or_port_and_installs_the_token_middleware() -> None:
    cmd = server_command("/m", uds="/run/user/1000/rlsdk-run-x/vllm-1.sock")

    assert cmd[cmd.index("--uds") + 1] == "/run/user/1000/rlsdk-run-x/vllm-1.sock"
    assert "--host" not in cmd and "--port" not in cmd
    assert cmd[cmd.index("--middleware") + 1] == MIDDLEWARE
    assert not any("s3cret" in arg or TOKEN_ENV in arg for arg in cmd)  # the token never goes on argv


@pytest.fixture()
def publish() -> Iterator[PublishDir]:
    directory = PublishDir()
    try:
        yield directory
    finally:
        directory.remove()


def test_worker_loads_weights_only_from_its_weights_dir_with_links_resolved(
    publish: PublishDir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(vllm_worker.WEIGHTS_DIR_ENV, publish.path)
    inside = Path(publish.path) / "v1.safetensors"
    inside.write_bytes(b"weights")
    outside = tmp_path / "v1.safetensors"
    outside.write_bytes(b"someone else's weights")
    link = Path(publish.path) / "v2.safetensors"
    link.symlink_to(outside)

    assert vllm_worker.allowed_weights_path(str(inside)) == os.path.realpath(inside)
    for path in (outside, link, Path(publish.path) / ".." / tmp_path.name / "v1.safetensors", Path(publish.path)):
        with pytest.raises(PermissionError, match="outside"):
            vllm_worker.allowed_weights_path(str(path))


def test_worker_without_a_weights_dir_loads_only_from_a_private_rlsdk_publish_dir_of_its_user(
    publish: PublishDir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(vllm_worker.WEIGHTS_DIR_ENV, raising=False)
    inside = Path(publish.path) / "v1.safetensors"
    inside.write_bytes(b"weights")
    outside = tmp_path / "rlsdk-weights-fake" / "v1.safetensors"  # the right name, another directory
    outside.parent.mkdir(mode=0o700)
    outside.write_bytes(b"someone else's weights")

    assert vllm_worker.allowed_weights_path(str(inside)) == os.path.realpath(inside)
    with pytest.raises(PermissionError, match="not in a private rlsdk publish directory"):
        vllm_worker.allowed_weights_path(str(outside))
    os.chmod(publish.path, 0o755)  # opened up to others: no longer private
    with pytest.raises(PermissionError, match="not in a private rlsdk publish directory"):
        vllm_worker.allowed_weights_path(str(inside))


def test_worker_refuses_to_load_from_outside_returning_the_error_without_touching_the_model(
    publish: PublishDir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(vllm_worker.WEIGHTS_DIR_ENV, publish.path)
    outside = tmp_path / "v1.safetensors"
    outside.write_bytes(b"\x00" * 16)
    reloads: list[Any] = []

    class Worker(vllm_worker.WeightSyncExtension):
        def reload_weights(self, **kwargs: Any) -> None:
            reloads.append(kwargs)

    result = Worker().rlsdk_load_weights(str(outside))

    assert "outside" in result["error"] and str(outside) in result["error"]
    assert reloads == []


class _OpenHandler(http.server.BaseHTTPRequestHandler):
    """A server whose development endpoints answer anyone (vLLM without the token middleware)."""

    def do_GET(self) -> None:
        body = b'{"is_paused": false}'
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


class _UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def get_request(self) -> Any:
        request, _ = super().get_request()
        return request, ("local", 0)  # BaseHTTPRequestHandler wants a (host, port) client address


@contextlib.contextmanager
def _open_server(path: Path) -> Iterator[str]:
    server = _UnixHTTPServer(str(path), _OpenHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"unix:{path}"
    finally:
        server.shutdown()
        server.server_close()


def test_attach_without_a_token_raises_before_connecting(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rlsdk.engine.inference.vllm import VLLMEngine

    monkeypatch.delenv(TOKEN_ENV, raising=False)

    with pytest.raises(RuntimeError, match=f"without its token.*{TOKEN_ENV}"):
        asyncio.run(VLLMEngine.attach("http://127.0.0.1:9", str(tiny_model_dir)))


def test_attach_to_a_server_that_answers_without_the_token_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    from rlsdk.engine.inference.vllm import VLLMEngine

    with _open_server(tmp_path / "open.sock") as url, pytest.raises(RuntimeError, match="without a token") as info:
        asyncio.run(VLLMEngine.attach(url, str(tiny_model_dir), token="anything"))

    assert "RequireToken" in str(info.value)
