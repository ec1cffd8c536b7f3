"""Start and supervise a real vLLM OpenAI-compatible server on a Unix socket only this user can reach.

The server runs ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script of the CPU build
fails) through :mod:`rlsdk.launch.pdeathsig`, in its own process group, so it dies with the controller (even on
SIGKILL) and :meth:`VLLMServer.stop` takes down every process it started. Its output goes line by line to an
``on_line`` callback (the Session routes it into the log stream with role ``inference``) and the last lines are
kept for error messages.

A server that is killed (SIGKILL, the OOM killer) leaves the shared-memory segments of its engine core's message
queues (``/dev/shm/psm_*``, each as large as the queue) in RAM until reboot: nothing of the dead server can remove
them. :class:`ShmLeftovers` records the ``/dev/shm`` files the server's processes map while they live, and removes
them once the whole process group is gone, however it ended.

Serve flags that matter on CPU (measured, see docs/howto/vllm.md): ``--dtype float32`` (else bf16, logprobs drift
~0.27 from an fp32 trainer), ``--no-enable-chunked-prefill`` (else seeded batched requests crash the engine),
``--enforce-eager`` (start ~30-45 s instead of 40-100 s).

Nothing listens on a TCP port: the server binds a Unix socket (vLLM's ``--uds``) in the session's 0700 runtime
directory (:class:`rlsdk.runtime_dir.SessionRuntimeDir`), which no other user can enter, and every route but
``/health`` also requires a per-server bearer token (:mod:`rlsdk.engine.inference.vllm_auth`; the token travels in
the server's environment), so the development endpoints that load weights answer only the Session that started
it. Where TCP cannot be avoided (Slurm replicas on other nodes, a server attached by URL) the token is what
guards them. The worker extension loads weights only from the directory named by ``RLSDK_VLLM_WEIGHTS_DIR``
(the session's publish directory; :func:`rlsdk.engine.inference.vllm_worker.allowed_weights_path`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import psutil

from rlsdk.engine.inference.vllm_auth import MIDDLEWARE, TOKEN_ENV, bearer_header
from rlsdk.engine.inference.vllm_worker import WEIGHTS_DIR_ENV
from rlsdk.observe.logging import get_logger
from rlsdk.procutil import ReplicaServer, kill_group, pump_lines, signal_group, start_in_own_session, wait_group_gone
from rlsdk.runtime_dir import MAX_SOCKET_PATH, SessionRuntimeDir

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


def server_command(
    model_path: str,
    port: int | None = None,
    *,
    host: str = "127.0.0.1",
    uds: str | None = None,
    max_model_len: int | None = None,
    extra_args: Sequence[str] = (),
    python: str = sys.executable,
    dtype: str = "float32",
) -> list[str]:
    """The server's command line (wrapped in ``rlsdk.launch.pdeathsig``): on the Unix socket ``uds``, else on
    ``host:port`` (a port of None: neither, the caller appends them, as the Slurm replica wrapper does).

    Every route but ``/health`` requires the bearer token in the server's ``VLLM_API_KEY``
    (:class:`~rlsdk.engine.inference.vllm_auth.RequireToken`; the server refuses to start without it).
    ``extra_args`` may name another ``--worker-extension-cls`` (a weight transfer's own, e.g. the in-place one),
    which then replaces rlsdk's.
    ``dtype``: the dtype the server computes in (``--dtype``; float32 unless the config says otherwise).
    """
    own = "--worker-extension-cls" in extra_args
    extension = [] if own else ["--worker-extension-cls", WORKER_EXTENSION]
    if uds is not None:
        listen = ["--uds", uds]
    elif port is not None:
        listen = ["--host", host, "--port", str(port)]
    else:
        listen = []
    cmd = [
        python, "-m", "rlsdk.launch.pdeathsig",
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model_path,
        "--served-model-name", SERVED_MODEL_NAME,
        *listen,
        "--dtype", dtype,
        "--no-enable-chunked-prefill",
        "--enforce-eager",
        "--enable-scale-out",  # token-in/out /inference/v1/generate, with per-token weight versions
        "--logprobs-mode", "processed_logprobs",  # log_softmax(logits / temperature), as the trainer computes
        *extension,
        "--middleware", MIDDLEWARE,  # the token on every route, the development endpoints included
        "--disable-uvicorn-access-log",
    ]  # fmt: skip
    if max_model_len is not None:
        cmd += ["--max-model-len", str(max_model_len)]
    return cmd + list(extra_args)


def server_environment(base: Mapping[str, str], kv_cache_gib: int) -> dict[str, str]:
    """The server's environment: the controller's, plus the dev-mode RL endpoints and offline operation.

    Holds no secret (the Slurm script writes it out): the token is added where the server starts."""
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


def replica_server(config: Any, python: str) -> ReplicaServer | None:
    """The vLLM replicas a batch launcher runs for ``config`` (None: ``inference.vllm.url`` is set, nothing to
    start):
    the local launcher's server flags, the weight transfer's server arguments (the NCCL worker extension when
    ``launch.gpus_per_node > 0``) and ``--tensor-parallel-size`` above 1, with the server's environment."""
    from rlsdk.engine.inference.weight_transfer import weight_transfer_class

    launch, inference, vllm = config.launch, config.inference, config.inference.vllm
    if vllm.url is not None:
        return None
    extra = list(weight_transfer_class(launch, vllm.weight_transfer).SERVER_ARGS)
    replaced = ("--host", "--port", *(arg for arg in extra if arg == "--worker-extension-cls"))
    if launch.inference_tensor_parallel_size > 1:
        extra += ["--tensor-parallel-size", str(launch.inference_tensor_parallel_size)]
    command = server_command(
        config.model.path,
        0,
        max_model_len=vllm.max_model_len,
        python=python,
        dtype=inference.dtype or config.model.dtype,
    )
    command = [*_without_options(command, replaced), *extra, *vllm.extra_server_args]
    env = [f"{key}={value}" for key, value in server_environment({}, vllm.kv_cache_gib).items()]
    return ReplicaServer(
        replicas=launch.inference_replicas,
        command=("env", *env, *command),
        start_timeout_s=vllm.server_start_timeout_s,
        token_env=TOKEN_ENV,
    )


def _without_options(command: list[str], options: tuple[str, ...]) -> list[str]:
    """``command`` without each of ``options`` and its value."""
    out: list[str] = []
    skip = False
    for arg in command:
        if skip:
            skip = False
        elif arg in options:
            skip = True
        else:
            out.append(arg)
    return out


SHM_ROOT = "/dev/shm"


class ShmLeftovers:
    """The ``/dev/shm`` files a process tree maps or holds open, recorded while it lives and removed after it died.

    Only files seen in use by the tree are ever removed, and only when they are regular files owned by this user:
    never another program's segment, whatever its name.
    """

    def __init__(self, root: str = SHM_ROOT) -> None:
        self.root = root
        self.paths: set[str] = set()

    def record(self, pid: int) -> None:
        """Add what process ``pid`` and its descendants map (``/proc/PID/maps``) or hold open under the root."""
        try:
            leader = psutil.Process(pid)
            processes = [leader, *leader.children(recursive=True)]
        except psutil.Error:
            return
        prefix = self.root.rstrip("/") + "/"
        for process in processes:
            with (
                contextlib.suppress(OSError),
                open(f"/proc/{process.pid}/maps", encoding="utf-8", errors="replace") as maps,
            ):
                for line in maps:
                    path = line.rstrip("\n").partition(" " + prefix)[2]
                    if path and not path.endswith(" (deleted)"):
                        self.paths.add(prefix + path)
            with contextlib.suppress(OSError):
                for fd in os.listdir(f"/proc/{process.pid}/fd"):
                    with contextlib.suppress(OSError):
                        target = os.readlink(f"/proc/{process.pid}/fd/{fd}")
                        if target.startswith(prefix) and not target.endswith(" (deleted)"):
                            self.paths.add(target)

    def remove(self) -> list[str]:
        """Unlink the recorded files that still exist (call once the tree is dead); returns their paths."""
        import stat

        removed = []
        for path in sorted(self.paths):
            try:
                info = os.lstat(path)
                if stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid():
                    os.unlink(path)
                    removed.append(path)
            except OSError:
                continue
        self.paths.clear()
        if removed:
            logger.info("removed %d shared-memory file(s) the vLLM server left: %s", len(removed), ", ".join(removed))
        return removed


def new_token() -> str:
    """A fresh bearer token for one server (256 random bits)."""
    return secrets.token_urlsafe(32)


def http_client(url: str, *, token: str | None, timeout: Any, limits: Any = None) -> Any:
    """An ``httpx.AsyncClient`` for the vLLM server at ``url`` that sends ``token`` on every request.

    ``url``: ``unix:/path/to.sock`` (vLLM's own spelling of a ``--uds`` address) or ``http(s)://HOST:PORT``.
    """
    import httpx

    headers = bearer_header(token) if token else {}
    limits = limits if limits is not None else httpx.Limits()
    if url.startswith("unix:"):
        transport = httpx.AsyncHTTPTransport(uds=url.removeprefix("unix:"), limits=limits)
        return httpx.AsyncClient(base_url="http://localhost", transport=transport, headers=headers, timeout=timeout)
    return httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout, limits=limits)


class VLLMServer:
    """One supervised vLLM server process group. Create with :meth:`start`; stop with :meth:`stop`.

    ``url`` is ``unix:SOCKET`` (the Unix socket it listens on, also :attr:`socket_path`); ``token`` the bearer
    token every request but ``/health`` must carry (never logged).
    """

    def __init__(
        self,
        proc: asyncio.subprocess.Process,
        url: str,
        on_line: Callable[[str], None] | None,
        *,
        token: str | None = None,
        own_runtime_dir: SessionRuntimeDir | None = None,
    ) -> None:
        self.proc = proc
        self.url = url
        self.token = token
        self.last_lines: deque[str] = deque(maxlen=200)
        self.start_seconds: float | None = None
        self._on_line = on_line
        self._own_runtime_dir = own_runtime_dir
        self._reader = asyncio.get_running_loop().create_task(self._read_output())
        self.shm = ShmLeftovers()

    def __repr__(self) -> str:  # never the token
        return f"VLLMServer(pid={self.proc.pid}, url={self.url!r}, returncode={self.proc.returncode})"

    @property
    def socket_path(self) -> str | None:
        """The Unix socket the server listens on (None for a TCP address)."""
        return self.url.removeprefix("unix:") if self.url.startswith("unix:") else None

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
        env: Mapping[str, str] | None = None,
        runtime_dir: str | None = None,
        weights_dir: str | None = None,
        dtype: str = "float32",
    ) -> VLLMServer:
        """Start the server on a Unix socket in ``runtime_dir`` and wait until ``/health`` answers 200.

        ``runtime_dir``: a private (0700) directory of this user, the Session's
        :class:`~rlsdk.runtime_dir.SessionRuntimeDir`; None = a fresh one, removed by :meth:`stop`.
        ``weights_dir``: the only directory the worker extension loads weights from (the session's publish
        directory); None = any rlsdk publish directory of this user (see
        :func:`~rlsdk.engine.inference.vllm_worker.allowed_weights_path`).

        Raises:
            ValueError: the socket path is too long for a Unix socket (set ``TMPDIR`` to a shorter directory).
            InferenceServerError: the server exited during start-up, or was not healthy within ``timeout_s``
                (it is then stopped); the message holds its exit code and last log lines.
        """
        own = SessionRuntimeDir() if runtime_dir is None else None
        directory = own.path if own is not None else str(runtime_dir)
        # A fresh name per start: a server restarted in the same directory never meets its predecessor's socket.
        socket_path = os.path.join(directory, f"vllm-{secrets.token_hex(4)}.sock")
        if len(os.fsencode(socket_path)) > MAX_SOCKET_PATH:
            if own is not None:
                own.remove()
            raise ValueError(
                f"Unix socket path {socket_path!r} is longer than the {MAX_SOCKET_PATH} bytes a socket address "
                "holds: set TMPDIR (or XDG_RUNTIME_DIR) to a shorter directory"
            )
        token = new_token()
        cmd = server_command(
            model_path, uds=socket_path, max_model_len=max_model_len, extra_args=extra_args, dtype=dtype
        )
        environment = server_environment(os.environ if env is None else env, kv_cache_gib)
        environment[TOKEN_ENV] = token  # the environment, not argv: /proc/PID/environ is private to this user
        if weights_dir is not None:
            environment[WEIGHTS_DIR_ENV] = weights_dir
        else:
            environment.pop(WEIGHTS_DIR_ENV, None)
        # vLLM's CPU worker forms gloo groups (world size 1 here) whose transport listens on TCP: on loopback,
        # whatever the host name resolves to.
        environment["GLOO_SOCKET_IFNAME"] = "lo"
        logger.debug("starting vLLM server: %s", " ".join(cmd))
        start = time.perf_counter()
        try:
            proc = await start_in_own_session(cmd, environment)
        except BaseException:
            if own is not None:
                own.remove()
            raise
        server = cls(proc, f"unix:{socket_path}", on_line, token=token, own_runtime_dir=own)
        logger.info("started vLLM server (pid %d) at %s for %s", proc.pid, server.url, model_path)
        try:
            await server.wait_healthy(timeout_s)
        except BaseException:
            await server.stop()
            raise
        server.start_seconds = time.perf_counter() - start
        server.shm.record(proc.pid)  # the engine core's message queues exist once the server answers
        logger.info("vLLM server healthy at %s after %.1f s", server.url, server.start_seconds)
        return server

    def client(self, *, timeout: Any = 10.0, limits: Any = None) -> Any:
        """An ``httpx.AsyncClient`` for this server that carries its token (:func:`http_client`)."""
        return http_client(self.url, token=self.token, timeout=timeout, limits=limits)

    async def wait_healthy(self, timeout_s: float) -> None:
        """Poll ``/health`` until it answers 200; raise InferenceServerError on exit or timeout."""
        import httpx

        deadline = time.monotonic() + timeout_s
        async with self.client(timeout=2.0) as client:
            while True:
                if self.proc.returncode is not None:
                    await self._drain()
                    raise self.error("exited during start-up")
                try:
                    response = await client.get("/health")
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
        self.shm.record(self.proc.pid)
        await kill_group(self.proc.pid)  # spares the resource tracker, which unlinks the semaphores it tracks
        await self._drain()
        await wait_group_gone(self.proc.pid)
        self.shm.remove()
        return code

    def error(self, what: str = "exited") -> InferenceServerError:
        return InferenceServerError(f"at {self.url} {what}", self.proc.returncode, self.last_lines)

    async def stop(self, grace_s: float = 15.0) -> int | None:
        """SIGTERM the server's process group, SIGKILL it after ``grace_s``. Idempotent."""
        pgid = self.proc.pid  # start_new_session: the process group id is the leader's pid
        self.shm.record(pgid)
        if self.proc.returncode is None:
            signal_group(pgid, signal.SIGTERM)
            try:
                await asyncio.wait_for(self.wait_exit(0.05), timeout=grace_s)
            except TimeoutError:
                logger.warning("vLLM server did not stop within %.0f s; killing it", grace_s)
                signal_group(pgid, signal.SIGKILL)
                await self.wait_exit(0.05)
        # The engine-core child may outlive the API process for a moment: the group goes down with it (but for the
        # resource tracker, which unlinks the semaphores the server's processes left once they are gone).
        await kill_group(pgid)
        await self._drain()
        await wait_group_gone(pgid)
        self.shm.remove()
        if not self._reader.done():
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
        if self.socket_path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.socket_path)
        if self._own_runtime_dir is not None:
            self._own_runtime_dir.remove()
        return self.proc.returncode
