"""Start and supervise a real vLLM OpenAI-compatible server on loopback.

The server runs ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script of the CPU build
fails) through :mod:`rlsdk.launch.pdeathsig`, in its own process group, so it dies with the controller (even on
SIGKILL) and :meth:`VLLMServer.stop` takes down every process it started. Its output goes line by line to an
``on_line`` callback (the Session routes it into the log stream with role ``inference``) and the last lines are
kept for error messages.

Serve flags that matter on CPU (measured, see docs/vllm.md): ``--dtype float32`` (else bf16, logprobs drift
~0.27 from an fp32 trainer), ``--no-enable-chunked-prefill`` (else seeded batched requests crash the engine),
``--enforce-eager`` (start ~30-45 s instead of 40-100 s).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence

from rlsdk.launch.output import pump_lines
from rlsdk.observe.logging import get_logger

logger = get_logger(__name__)

WORKER_EXTENSION = "rlsdk.engine.inference.vllm_worker.WeightSyncExtension"
SERVED_MODEL_NAME = "policy"


class InferenceServerError(RuntimeError):
    """The inference server exited, or did not become healthy in time. Names the exit code and last lines."""

    def __init__(self, what: str, returncode: int | None, last_lines: Iterable[str]) -> None:
        self.returncode = returncode
        self.last_lines = list(last_lines)
        if returncode is None:
            how = "still running"
        elif returncode < 0:
            how = f"killed by signal {signal.Signals(-returncode).name} (exit code {returncode})"
        else:
            how = f"exit code {returncode}"
        tail = "\n".join(self.last_lines[-30:]) or "(no output)"
        super().__init__(f"vLLM server {what}: {how}. Last log lines:\n{tail}")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the server binds it a moment later; a race is reported by the server)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def server_command(
    model_path: str,
    port: int,
    *,
    host: str = "127.0.0.1",
    max_model_len: int | None = None,
    extra_args: Sequence[str] = (),
    python: str = sys.executable,
    dtype: str = "float32",
) -> list[str]:
    """The server's command line (wrapped in ``rlsdk.launch.pdeathsig``); ``extra_args`` may name another
    ``--worker-extension-cls`` (a weight transfer's own, e.g. the in-place one), which then replaces rlsdk's.
    ``dtype``: the dtype the server computes in (``--dtype``; float32 unless the config says otherwise)."""
    own = "--worker-extension-cls" in extra_args
    extension = [] if own else ["--worker-extension-cls", WORKER_EXTENSION]
    cmd = [
        python, "-m", "rlsdk.launch.pdeathsig",
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model_path,
        "--served-model-name", SERVED_MODEL_NAME,
        "--host", host,
        "--port", str(port),
        "--dtype", dtype,
        "--no-enable-chunked-prefill",
        "--enforce-eager",
        "--enable-scale-out",  # token-in/out /inference/v1/generate, with per-token weight versions
        "--logprobs-mode", "processed_logprobs",  # log_softmax(logits / temperature), as the trainer computes
        *extension,
        "--disable-uvicorn-access-log",
    ]  # fmt: skip
    if max_model_len is not None:
        cmd += ["--max-model-len", str(max_model_len)]
    return cmd + list(extra_args)


def server_environment(base: Mapping[str, str], kv_cache_gib: int) -> dict[str, str]:
    """The server's environment: the controller's, plus the dev-mode RL endpoints and offline operation."""
    env = dict(base)
    env.update(
        VLLM_SERVER_DEV_MODE="1",
        VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib),
        HF_HUB_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        VLLM_DO_NOT_TRACK="1",
        PYTHONUNBUFFERED="1",
    )
    return env


class VLLMServer:
    """One supervised vLLM server process group. Create with :meth:`start`; stop with :meth:`stop`."""

    def __init__(self, proc: asyncio.subprocess.Process, url: str, on_line: Callable[[str], None] | None) -> None:
        self.proc = proc
        self.url = url
        self.last_lines: deque[str] = deque(maxlen=200)
        self.start_seconds: float | None = None
        self._on_line = on_line
        self._reader = asyncio.get_running_loop().create_task(self._read_output())

    @classmethod
    async def start(
        cls,
        model_path: str,
        *,
        kv_cache_gib: int = 1,
        max_model_len: int | None = None,
        extra_args: Sequence[str] = (),
        timeout_s: float = 300.0,
        on_line: Callable[[str], None] | None = None,
        host: str = "127.0.0.1",
        env: Mapping[str, str] | None = None,
        dtype: str = "float32",
    ) -> VLLMServer:
        """Start the server and wait until ``/health`` answers 200.

        Raises:
            InferenceServerError: the server exited during start-up, or was not healthy within ``timeout_s``
                (it is then stopped); the message holds its exit code and last log lines.
        """
        port = free_port(host)
        cmd = server_command(
            model_path, port, host=host, max_model_len=max_model_len, extra_args=extra_args, dtype=dtype
        )
        logger.debug("starting vLLM server: %s", " ".join(cmd))
        start = time.perf_counter()
        proc = await asyncio.create_subprocess_exec(
            *cmd,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
            env=server_environment(os.environ if env is None else env, kv_cache_gib),
        )
        server = cls(proc, f"http://{host}:{port}", on_line)
        logger.info("started vLLM server (pid %d) at %s for %s", proc.pid, server.url, model_path)
        try:
            await server.wait_healthy(timeout_s)
        except BaseException:
            await server.stop()
            raise
        server.start_seconds = time.perf_counter() - start
        logger.info("vLLM server healthy at %s after %.1f s", server.url, server.start_seconds)
        return server

    async def wait_healthy(self, timeout_s: float) -> None:
        """Poll ``/health`` until it answers 200; raise InferenceServerError on exit or timeout."""
        import httpx

        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(timeout=2.0) as client:
            while True:
                if self.proc.returncode is not None:
                    await self._drain()
                    raise self.error("exited during start-up")
                try:
                    response = await client.get(f"{self.url}/health")
                    if response.status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise InferenceServerError(
                        f"at {self.url} was not healthy within server_start_timeout_s={timeout_s:.0f} s",
                        self.proc.returncode,
                        self.last_lines,
                    )
                await asyncio.sleep(0.5)

    async def _read_output(self) -> None:
        assert self.proc.stdout is not None
        await pump_lines(self.proc.stdout, self.last_lines, self._on_line)

    async def _drain(self) -> None:
        with contextlib.suppress(asyncio.CancelledError, TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._reader), timeout=2.0)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    async def wait_exit(self, poll_s: float = 0.2) -> int:
        """Wait for the API process to exit (not for its output to close); returns its exit code."""
        # asyncio's Process.wait() (3.11) also waits for the output pipe to close, which the engine-core child
        # holds open after the API process died; returncode is set as soon as the API process exits.
        while self.proc.returncode is None:
            await asyncio.sleep(poll_s)
        return self.proc.returncode

    async def wait(self) -> int:
        """Wait for the server's API process to exit, then kill what is left of its process group (the engine
        core is useless without it) and drain the output; returns the API process's exit code."""
        code = await self.wait_exit()
        _signal_group(self.proc.pid, signal.SIGKILL)
        await self._drain()
        return code

    def error(self, what: str = "exited") -> InferenceServerError:
        return InferenceServerError(f"at {self.url} {what}", self.proc.returncode, self.last_lines)

    async def stop(self, grace_s: float = 15.0) -> int | None:
        """SIGTERM the server's process group, SIGKILL it after ``grace_s``. Idempotent."""
        pgid = self.proc.pid  # start_new_session: the process group id is the leader's pid
        if self.proc.returncode is None:
            _signal_group(pgid, signal.SIGTERM)
            try:
                await asyncio.wait_for(self.wait_exit(0.05), timeout=grace_s)
            except TimeoutError:
                logger.warning("vLLM server did not stop within %.0f s; killing it", grace_s)
                _signal_group(pgid, signal.SIGKILL)
                await self.wait_exit(0.05)
        # The engine-core child may outlive the API process for a moment: the group goes down with it.
        _signal_group(pgid, signal.SIGKILL)
        await self._drain()
        if not self._reader.done():
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
        return self.proc.returncode


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
